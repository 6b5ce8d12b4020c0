"""Elementwise ops with one plain operand under the probe's mode (``logra_optim.tangents``): primal
and tangent against torch's own forward AD of the same call, over operations, broadcasting, dtypes,
tensor and Python-number operands; and the calls the mode must leave to torch. The probe's predicted
KL with and without the mode: tests/test_probe.py."""

from __future__ import annotations

import contextlib
import operator

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from hypothesis import given, settings
from hypothesis import strategies as st

from logra_optim import tangents
from logra_optim.tangents import ElementwiseTangentMode, binary_with_plain_operand

# Each call as the model would write it: ``(name, call(a, b))``.
CALLS = {
    "a * b": operator.mul,
    "torch.mul": torch.mul,
    "a.mul(b)": lambda a, b: a.mul(b),
    "a + b": operator.add,
    "torch.add alpha": lambda a, b: torch.add(a, b, alpha=-0.5),
    "a.add(b)": lambda a, b: a.add(b),
    "a - b": operator.sub,
    "torch.sub alpha": lambda a, b: torch.sub(a, b, alpha=2.0),
    "a / b": operator.truediv,
    "torch.div": torch.div,
}
SHAPES = {"same": ((3, 5), (3, 5)), "row": ((3, 5), (5,)), "column": ((3, 5), (3, 1)), "grown": ((5,), (3, 5))}


@contextlib.contextmanager
def _spying(replacement):
    """``tangents.binary_with_plain_operand`` replaced for the duration (the mode looks it up by name)."""
    direct = tangents.binary_with_plain_operand
    tangents.binary_with_plain_operand = replacement
    try:
        yield
    finally:
        tangents.binary_with_plain_operand = direct


def _evaluate(call, a, b, a_tangent, b_tangent, mode):
    """``call`` on duals (an operand with ``None`` tangent stays plain), primal and tangent."""
    with fwAD.dual_level(), torch.no_grad(), ElementwiseTangentMode() if mode else contextlib.nullcontext():
        a = a if a_tangent is None else fwAD.make_dual(a, a_tangent)
        b = b if b_tangent is None else fwAD.make_dual(b, b_tangent)
        primal, tangent = fwAD.unpack_dual(call(a, b))
    return primal, tangent


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(CALLS)),
    shapes=st.sampled_from(sorted(SHAPES)),
    dual=st.sampled_from(["first", "second"]),
    plain=st.sampled_from(["tensor", "number"]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    swap=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_one_plain_operand_matches_torch_forward_ad(name, shapes, dual, plain, dtype, swap, seed):
    generator = torch.Generator().manual_seed(seed)
    first_shape, second_shape = SHAPES[shapes]
    if swap:
        first_shape, second_shape = second_shape, first_shape
    a = torch.randn(first_shape, generator=generator, dtype=dtype)
    b = torch.rand(second_shape, generator=generator, dtype=dtype) + 0.5  # a divisor away from 0
    tangent = torch.randn((first_shape if dual == "first" else second_shape), generator=generator, dtype=dtype)
    a_tangent, b_tangent = (tangent, None) if dual == "first" else (None, tangent)
    if plain == "number":  # the plain operand is a Python float
        if dual == "first":
            b = 1.75
        else:
            a = -0.625
    call = CALLS[name]
    if isinstance(a, float) and not name.startswith("a "):
        a = torch.tensor(a, dtype=dtype)  # a method or torch.* function takes a tensor first
    expected = _evaluate(call, a, b, a_tangent, b_tangent, mode=False)
    taken = []
    direct = tangents.binary_with_plain_operand
    with _spying(lambda *args: taken.append(direct(*args)) or taken[-1]):
        got = _evaluate(call, a, b, a_tangent, b_tangent, mode=True)
    divisor_is_dual = name in ("a / b", "torch.div") and dual == "second"
    # The mode computed the call itself, except a division by a dual, which it leaves to torch.
    computed = [result is not None for result in taken]
    assert not any(computed) if divisor_is_dual else computed == [True]
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    assert got[1] is not None and got[1].shape == expected[1].shape and got[1].dtype == expected[1].dtype
    torch.testing.assert_close(got[1], expected[1], rtol=1e-15 if dtype == torch.float64 else 1e-6, atol=0)


def test_reversed_number_operands_match_torch_forward_ad():
    """``2 * x``, ``1 + x``, ``1 - x``: the reflected methods (``__rmul__``, ``__radd__``, ``__rsub__``)."""
    x, t = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    for call in (lambda a, b: 2.5 * a, lambda a, b: 1.0 + a, lambda a, b: 1.0 - a):
        expected = _evaluate(call, x, None, t, None, mode=False)
        got = _evaluate(call, x, None, t, None, mode=True)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_calls_left_to_torch():
    """Two dual operands, none, a divisor with a tangent, ``out=`` and a rounding mode are torch's."""
    x, y = torch.randn(3), torch.rand(3) + 0.5
    with fwAD.dual_level():
        dx, dy = fwAD.make_dual(x, torch.ones(3)), fwAD.make_dual(y, torch.ones(3))
        assert binary_with_plain_operand(torch.mul, (dx, dy), {}) is None
        assert binary_with_plain_operand(torch.mul, (x, y), {}) is None
        assert binary_with_plain_operand(torch.div, (x, dy), {}) is None
        assert binary_with_plain_operand(torch.div, (dx, y), {"rounding_mode": "floor"}) is None
        assert binary_with_plain_operand(torch.add, (dx, y), {"out": torch.empty(3)}) is None
        assert binary_with_plain_operand(torch.exp, (dx,), {}) is None
        assert binary_with_plain_operand(torch.mul, (dx, "text"), {}) is None
        assert binary_with_plain_operand(torch.mul, (dx, 1j), {}) is None
        # Under the mode such calls still compute what torch computes.
        with ElementwiseTangentMode():
            quotient = fwAD.unpack_dual(x / dy)
            floored = torch.div(dx, y, rounding_mode="floor")
        torch.testing.assert_close(quotient.primal, x / y)
        torch.testing.assert_close(quotient.tangent, -x / y**2)
        torch.testing.assert_close(fwAD.unpack_dual(floored).primal, torch.div(x, y, rounding_mode="floor"))


@pytest.mark.parametrize(
    "dual_dtype, plain",
    [
        (torch.bfloat16, torch.rand(3, 4) + 0.5),  # promoted to the plain operand's fp32
        (torch.float32, (torch.rand(3, 4) + 0.5).bfloat16()),  # the plain operand promoted
        (torch.float32, torch.tensor(1.5, dtype=torch.float64)),  # a 0-d tensor does not promote
        (torch.float32, torch.arange(1, 5)),  # integers
        (torch.float32, torch.tensor([True, False, True, True])),  # booleans
        (torch.float32, (torch.rand(4, 3) + 0.5).t()),  # a non-contiguous operand
    ],
)
def test_mixed_dtypes_and_layouts_match_torch_forward_ad(dual_dtype, plain):
    x = torch.randn(3, 4).to(dual_dtype)
    t = torch.randn(3, 4).to(dual_dtype)
    for call in (operator.mul, operator.add, operator.sub, lambda a, b: b - a, operator.truediv):
        if plain.dtype == torch.bool and call not in (operator.mul, operator.add):
            continue  # torch refuses to subtract booleans
        expected = _evaluate(call, x, plain, t, None, mode=False)
        got = _evaluate(call, x, plain, t, None, mode=True)
        assert got[0].dtype == expected[0].dtype and got[1].dtype == expected[1].dtype
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], expected[1])


def test_the_result_does_not_share_its_tangent_with_an_operand():
    """``y = x + c`` has ``ẏ = ẋ``, as values; an in-place op on either afterwards (model code that
    updates activations in place) must not change the other's tangent, as under torch's own AD."""
    with fwAD.dual_level(), torch.no_grad(), ElementwiseTangentMode():
        x = fwAD.make_dual(torch.randn(5), torch.ones(5))
        y = x + 1.0
        z = 2.0 - x  # rsub: ż = −ẋ is a new tensor already
        y.mul_(3.0)
        x.mul_(2.0)
        assert torch.equal(fwAD.unpack_dual(x).tangent, torch.full((5,), 2.0))
        assert torch.equal(fwAD.unpack_dual(y).tangent, torch.full((5,), 3.0))
        assert torch.equal(fwAD.unpack_dual(z).tangent, torch.full((5,), -1.0))
