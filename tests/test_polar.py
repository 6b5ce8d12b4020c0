"""Orthogonal directions (``logra_optim.polar``) against float64 SVD references, and the GPU's
Newton–Schulz path against the CPU's eigendecomposition (both run here, on the CPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from logra_optim import polar
from logra_optim.polar import (
    POLAR_FLOOR,
    POLAR_FLOOR_16BIT,
    orthogonal_direction,
    orthogonal_directions,
    regularised_inverse_sqrt,
)
from tests.helpers import reference

FLOORS = st.sampled_from([POLAR_FLOOR, POLAR_FLOOR_16BIT])


def low_rank(d: int, r: int, rank: int, scale: float, generator: torch.Generator) -> torch.Tensor:
    factors = torch.randn(d, rank, generator=generator, dtype=torch.float64)
    return factors @ torch.randn(rank, r, generator=generator, dtype=torch.float64) * scale


@settings(max_examples=60, deadline=None)
@given(
    d=st.integers(1, 24),
    r=st.integers(1, 12),
    rank=st.integers(0, 12),
    scale=st.sampled_from([1e-12, 1e-3, 1.0, 1e6]),
    seed=st.integers(0, 2**16),
    floor=FLOORS,
)
def test_orthogonal_direction_is_the_polar_factor_of_a_float64_svd(d, r, rank, scale, seed, floor):
    """``U = P diag(σ / sqrt(σ² + (floor σ_max)²)) Qᵀ`` from ``N = P Σ Qᵀ``, whatever the shape, rank or
    scale of ``N``: unit singular values for the directions that carry it, those at its noise shrunk
    (not blown up), the same singular vectors."""
    numerator = low_rank(d, r, min(rank, d, r), scale, torch.Generator().manual_seed(seed)).float()
    direction = orthogonal_direction(numerator, floor=floor)
    assert direction.dtype == torch.float32 and direction.shape == (d, r)
    torch.testing.assert_close(direction.double(), reference.polar(numerator, floor), rtol=0, atol=2e-4)


@settings(max_examples=40, deadline=None)
@given(
    r=st.integers(1, 24),
    rank=st.integers(1, 24),
    gap=st.floats(0.05, 0.5),
    floor=FLOORS,
    seed=st.integers(0, 2**16),
)
def test_newton_schulz_equals_the_eigendecomposition(r, rank, gap, floor, seed):
    """The GPU's path (matrix products only) computes the CPU's ``(G + τI)^-½`` in float64 (``τ`` from
    one estimate of ``λ_max`` on both): the directions ``N (G + τI)^-½`` agree within a few fp32 ulps
    whatever the rank, the spread of singular values and the gap below the largest."""
    generator = torch.Generator().manual_seed(seed)
    rank = min(rank, r)
    left, _ = torch.linalg.qr(torch.randn(2 * r, r, generator=generator, dtype=torch.float64))
    right, _ = torch.linalg.qr(torch.randn(r, r, generator=generator, dtype=torch.float64))
    spread = torch.logspace(-6, 0, rank, dtype=torch.float64)[torch.randperm(rank, generator=generator)]
    singular = torch.zeros(r, dtype=torch.float64)
    singular[:rank] = spread * (1.0 - gap)
    singular[0] = 1.0
    numerator = (left * singular) @ right.T * 10.0 ** (seed % 7 - 3)
    grams = (numerator.T @ numerator).unsqueeze(0)
    shift = polar.largest_eigenvalue(grams) * floor**2
    assert polar._newton_schulz_inverse_sqrt(grams, shift, floor)[1].all()  # converged: no eigh fallback
    exact = numerator @ regularised_inverse_sqrt(grams, floor, "eigh")[0]
    iterated = numerator @ regularised_inverse_sqrt(grams, floor, "newton-schulz")[0]
    # Float64 iterates of a matrix of condition up to 1/floor²: within a few of fp32's ulps of U's unit
    # singular values.
    torch.testing.assert_close(iterated, exact, rtol=0, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 12), st.sampled_from([2, 5])), min_size=1, max_size=5),
    floor=FLOORS,
    seed=st.integers(0, 2**16),
)
def test_one_batch_for_all_targets_equals_each_target_alone(sizes, floor, seed):
    """Targets of two ranks and stacked experts in one call: grouped by ``r`` and batched, each block
    its own polar factor, by either method."""
    generator = torch.Generator().manual_seed(seed)
    numerators = [torch.randn(e * d, r, generator=generator) * 10.0 ** (i - 2) for i, (e, d, r) in enumerate(sizes)]
    experts = [e for e, _, _ in sizes]
    for method in polar.METHODS:
        together = orthogonal_directions(numerators, experts, floor, method)
        for direction, numerator, (e, d, _) in zip(together, numerators, sizes):
            assert direction.shape == numerator.shape and direction.dtype == numerator.dtype
            for block, alone in zip(direction.split(d), numerator.split(d)):
                torch.testing.assert_close(block.double(), reference.polar(alone, floor), rtol=0, atol=1e-4)


def test_newton_schulz_equals_the_eigendecomposition_at_r_256():
    """Sketch-like directions at the GPU check's rank: 128 signal directions of crowded singular
    values and 128 at 1e-3 noise, near the 1e-5 floor."""
    generator = torch.Generator().manual_seed(4)
    numerators = [
        torch.randn(d, 128, generator=generator) @ torch.randn(128, 256, generator=generator)
        + 1e-3 * torch.randn(d, 256, generator=generator)
        for d in (256, 1536)
    ]
    exact = orthogonal_directions(numerators, method="eigh")
    iterated = orthogonal_directions(numerators, method="newton-schulz")
    for e, i in zip(exact, iterated):
        torch.testing.assert_close(i, e, rtol=0, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(r=st.integers(1, 40), gap=st.floats(0.0, 0.9), seed=st.integers(0, 2**16))
def test_largest_eigenvalue_is_never_above_and_close_to_the_largest(r, gap, seed):
    """The estimate that sets ``τ``: at most ``λ_max`` (to rounding), within 5% of it for a crowded
    top, exact to 1e-9 where the largest stands 30% apart."""
    generator = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(r, r, generator=generator, dtype=torch.float64))
    eigenvalues = torch.rand(r, generator=generator, dtype=torch.float64) * (1.0 - gap)
    eigenvalues[0] = 1.0
    grams = ((basis * eigenvalues) @ basis.T).unsqueeze(0) * 10.0 ** (seed % 9 - 4)
    exact = float(torch.linalg.eigvalsh(grams[0])[-1])
    estimate = float(polar.largest_eigenvalue(grams))
    assert estimate <= exact * (1 + 1e-12)
    assert estimate >= exact * (1 - (1e-9 if gap >= 0.3 else 0.05))


def test_zero_blocks_stay_zero_and_leave_the_others_to_newton_schulz(monkeypatch):
    """An expert that got no tokens (a zero block) beside others: its direction is 0, and the other
    blocks still converge by Newton–Schulz (eigh is not called)."""
    numerator = torch.randn(4 * 16, 8, generator=torch.Generator().manual_seed(3))
    numerator[16:32] = 0
    expected = [reference.polar(block, POLAR_FLOOR) for block in numerator.double().split(16)]
    monkeypatch.setattr(polar, "_eigh_inverse_sqrt", None)  # any fallback would fail
    for directions in (orthogonal_directions([numerator, torch.zeros(5, 8)], [4, 1], method="newton-schulz"),):
        assert torch.equal(directions[1], torch.zeros(5, 8))
        for block, alone in zip(directions[0].split(16), expected):
            torch.testing.assert_close(block.double(), alone, rtol=0, atol=1e-5)
    monkeypatch.undo()
    for method in polar.METHODS:
        zero = orthogonal_directions([torch.zeros(4, 3)], method=method)[0]
        assert torch.equal(zero, torch.zeros(4, 3))


def test_only_the_blocks_that_do_not_converge_go_to_eigh(monkeypatch):
    """Block 1 reported unconverged: eigh recomputes it alone, the others keep their Newton–Schulz
    roots."""
    generator = torch.Generator().manual_seed(5)
    numerators = torch.randn(3, 20, 6, generator=generator, dtype=torch.float64)
    grams = numerators.mT @ numerators
    iterated = regularised_inverse_sqrt(grams, POLAR_FLOOR, "newton-schulz")
    exact = regularised_inverse_sqrt(grams, POLAR_FLOOR, "eigh")
    original = polar._newton_schulz_inverse_sqrt

    def one_unconverged(*args):
        root, _ = original(*args)
        return root, torch.tensor([True, False, True])

    calls = []
    eigh = polar._eigh_inverse_sqrt
    monkeypatch.setattr(polar, "_newton_schulz_inverse_sqrt", one_unconverged)
    monkeypatch.setattr(polar, "_eigh_inverse_sqrt", lambda g, s: calls.append(g.shape[0]) or eigh(g, s))
    roots = regularised_inverse_sqrt(grams, POLAR_FLOOR, "newton-schulz")
    assert calls == [1]
    assert torch.equal(roots[[0, 2]], iterated[[0, 2]]) and torch.equal(roots[1], exact[1])


@pytest.mark.parametrize("method", polar.METHODS)
def test_batches_are_bounded_and_equal_one_batch(monkeypatch, method):
    """Targets beyond a batch's bytes of Gram matrices (``BATCH_BYTES``, ``EIGH_BATCH_BYTES``) go in
    several batches, with the same result (eigh batches too: its power iterations run once per
    batch, not once per target)."""
    generator = torch.Generator().manual_seed(6)
    numerators = [torch.randn(30, 8, generator=generator) for _ in range(7)]
    sizes = []
    original = polar.regularised_inverse_sqrt
    monkeypatch.setattr(polar, "regularised_inverse_sqrt", lambda g, *a: sizes.append(g.shape[0]) or original(g, *a))
    together = orthogonal_directions(numerators, method=method)
    assert sizes == [7]
    monkeypatch.setattr(polar, "BATCH_BYTES" if method == "newton-schulz" else "EIGH_BATCH_BYTES", 3 * 8 * 8 * 8)
    chunked = orthogonal_directions(numerators, method=method)  # three 8×8 float64 matrices a batch
    assert sizes == [7, 3, 3, 1]
    for a, b in zip(together, chunked):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    one_by_one = [orthogonal_directions([n], method=method)[0] for n in numerators]
    for a, b in zip(together, one_by_one):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_newton_schulz_that_does_not_converge_falls_back_to_eigh(monkeypatch):
    generator = torch.Generator().manual_seed(1)
    numerator = low_rank(40, 16, 16, 1.0, generator)
    grams = (numerator.T @ numerator).unsqueeze(0)
    monkeypatch.setattr(polar, "NEWTON_SCHULZ_TOLERANCE", 0.0)  # no float64 iterate is that exact
    assert torch.equal(
        regularised_inverse_sqrt(grams, POLAR_FLOOR, "newton-schulz"),
        regularised_inverse_sqrt(grams, POLAR_FLOOR, "eigh"),
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "svd"}, "method must be one of"),
        ({"floor": 0.0}, "floor must be in"),
        ({"floor": 1.0}, "floor must be in"),
        ({"experts": [1, 1]}, "experts: one count per numerator"),
        ({"experts": [3]}, r"numerators\[0\]: expected a 2-D E·d × r matrix of experts\[0\] = 3 blocks"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        orthogonal_directions([torch.randn(4, 3)], **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_newton_schulz_is_the_default_and_equals_the_cpu():
    generator = torch.Generator().manual_seed(2)
    numerators = [low_rank(200, 32, 32, 1.0, generator).float() for _ in range(3)]
    on_cuda = orthogonal_directions([n.cuda() for n in numerators])
    for u, n in zip(on_cuda, numerators):
        torch.testing.assert_close(u.cpu(), orthogonal_direction(n), rtol=0, atol=1e-5)
