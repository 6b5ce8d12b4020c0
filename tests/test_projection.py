"""Projections ``A`` (docs/method.md §1): the counter-based generator, scale, unbiasedness, and
bit-exact regeneration.

Every party that needs ``A`` (the patched layer, the merge, another rank, the rollout engine, a
resumed run) regenerates it from ``(seed, update index, module name)``; any drift between them
silently corrupts the merged weights, hence the emphasis on bit-identity.
"""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from logra_optim import canonical_name, make_projection, projection_seed
from logra_optim import projection as projection_module
from logra_optim.projection import ProjectionSpec, projection_key, splitmix64

KINDS = ("rademacher", "gaussian")
Q_PROJ = "model.layers.0.self_attn.q_proj"


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


# --------------------------------------------------------------------------------------------------
# Names and seeds


@pytest.mark.parametrize(
    "wrapped",
    [
        "model.layers.0.self_attn.q_proj",
        "module.model.layers.0.self_attn.q_proj",  # DDP / DeepSpeed engine
        "_orig_mod.model.layers.0.self_attn.q_proj",  # torch.compile
        "model._fsdp_wrapped_module.layers.0.self_attn.q_proj",  # FSDP1
        "model.layers.0._checkpoint_wrapped_module.self_attn.q_proj",  # activation checkpointing
        "model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.self_attn.q_proj",
        "module._orig_mod.model.layers.0._fsdp_wrapped_module.self_attn.q_proj",
        "_orig_mod.module.model.layers.0.self_attn.q_proj",
    ],
)
def test_canonical_name_strips_wrapper_prefixes(wrapped):
    assert canonical_name(wrapped) == Q_PROJ
    assert projection_seed(3, 5, wrapped) == projection_seed(3, 5, Q_PROJ)


@pytest.mark.parametrize(
    "name",
    [
        "model.module.layers.0.q_proj",  # a submodule really called "module", not a leading wrapper
        "model.layers.0.my_orig_mod.q_proj",  # substring of a wrapper name, not a component
        "model.layers.0._orig_mod_x.q_proj",
        "q_proj",
        "",
    ],
)
def test_canonical_name_leaves_real_components_alone(name):
    assert canonical_name(name) == name


@pytest.mark.parametrize(
    ("names", "shared"),
    [
        (["model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.k_proj", "model.layers.3.self_attn.v_proj"], 1),
        (["model.layers.3.mlp.gate_proj", "module.model.layers.3.mlp.up_proj"], 1),  # wrappers do not matter
        (["encoder.layer.0.attention.self.query", "encoder.layer.0.attention.self.key"], 1),
        (["model.layers.3.self_attn.q_proj", "model.layers.4.self_attn.q_proj"], 2),  # another layer
        (["model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.o_proj"], 2),  # o reads its own input
        (["model.layers.3.mlp.up_proj", "model.layers.3.mlp.down_proj"], 2),
        (["model.layers.3.self_attn.q_proj", "model.layers.3.mlp.gate_proj"], 2),
    ],
)
def test_projection_key_is_one_per_shared_input(names, shared):
    assert len({projection_key(name) for name in names}) == shared
    assert [projection_key(name, shared=False) for name in names] == [canonical_name(name) for name in names]
    assert projection_key("model.layers.3.self_attn.o_proj") == "model.layers.3.self_attn.o_proj"
    # Pinned: the members in sorted order whichever sibling asks, so every party derives one key (and seed).
    assert projection_key("a.v_proj") == projection_key("a.q_proj") == "a.{k_proj,q_proj,v_proj}"
    assert projection_key("_orig_mod.m.up_proj") == "m.{gate_proj,up_proj}"


@given(
    seed=st.integers(0, 2**62),
    index=st.integers(0, 10**6),
    name=st.text(min_size=1, max_size=30),
)
@settings(max_examples=50)
def test_seed_separates_seed_index_and_name(seed, index, name):
    base = projection_seed(seed, index, name)
    assert 0 <= base < 2**63
    assert projection_seed(seed, index, name) == base
    assert projection_seed(seed + 1, index, name) != base
    assert projection_seed(seed, index + 1, name) != base
    assert projection_seed(seed, index, name + "x") != base


# --------------------------------------------------------------------------------------------------
# The generator: SplitMix64 in int64 torch operations

_MASK64 = (1 << 64) - 1


def splitmix64_reference(seed: int, start: int, count: int) -> list[int]:
    """SplitMix64 (Steele, Lea and Flood 2014) in Python integers, as signed 64-bit values."""
    out = []
    for counter in range(start, start + count):
        z = (seed + (counter + 1) * 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
        out.append(z - (1 << 64) if z >= 1 << 63 else z)
    return out


def test_splitmix64_matches_the_published_stream():
    # The first outputs for seed 1234567 of the reference C implementation (Vigna's splitmix64.c).
    assert [v & _MASK64 for v in splitmix64(1234567, 0, 3).tolist()] == [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
    ]


@given(seed=st.integers(0, 2**63 - 1), start=st.integers(0, 2**40), count=st.integers(1, 300))
@settings(max_examples=40)
def test_torch_int64_arithmetic_is_the_exact_stream(seed, start, count):
    """int64 torch ops wrap modulo 2⁶⁴ and the emulated logical shifts are exact: every bit agrees
    with unbounded Python integers, for any range of counters."""
    assert splitmix64(seed, start, count).tolist() == splitmix64_reference(seed, start, count)


@given(seed=st.integers(0, 2**63 - 1), kind=st.sampled_from(KINDS), r=st.integers(1, 12), k=st.integers(1, 200))
@settings(max_examples=30, deadline=None)
def test_chunking_does_not_change_the_bits(seed, kind, r, k):
    whole = make_projection(seed, r, k, kind)
    with mock.patch.object(projection_module, "_CHUNK", 64):
        assert torch.equal(make_projection(seed, r, k, kind), whole)


@given(seed=st.integers(0, 2**63 - 1), kind=st.sampled_from(KINDS), k1=st.integers(1, 100), k2=st.integers(1, 100))
@settings(max_examples=30, deadline=None)
def test_entry_depends_on_seed_and_position_only(seed, kind, k1, k2):
    """Entry ``e = i·k + j`` is a function of ``(seed, e)``: row-major prefixes of two shapes agree
    (up to the ``1/√r`` scale)."""
    a = make_projection(seed, 4, k1, kind).flatten() * 2.0
    b = make_projection(seed, 9, k2, kind).flatten() * 3.0
    n = min(a.numel(), b.numel())
    torch.testing.assert_close(a[:n], b[:n], rtol=1e-6, atol=0)
    if kind == "rademacher":
        assert torch.equal(a[:n], b[:n])


@pytest.mark.parametrize("kind", KINDS)
def test_spec_generates_its_matrix(kind):
    spec = ProjectionSpec(99, 6, 50, kind)
    assert torch.equal(spec.generate(), make_projection(99, 6, 50, kind))
    assert spec.generate(dtype=torch.bfloat16).dtype == torch.bfloat16
    assert spec.nbytes() == 6 * 50 * 4 and spec.nbytes(torch.bfloat16) == 6 * 50 * 2


# --------------------------------------------------------------------------------------------------
# Values


@given(r=st.integers(1, 64), k=st.integers(1, 64), seed=st.integers(0, 2**63 - 1))
@settings(max_examples=40)
def test_rademacher_entries_are_exactly_plus_minus_inverse_sqrt_r(r, k, seed):
    a = make_projection(seed, r, k, "rademacher")
    assert a.shape == (r, k) and a.dtype == torch.float32
    magnitude = torch.tensor(1.0 / math.sqrt(r), dtype=torch.float64).float()
    assert torch.equal(a.abs(), magnitude.expand(r, k))


@pytest.mark.parametrize("kind", KINDS)
def test_dtype_and_device_arguments_only_cast(kind):
    a = make_projection(11, 8, 40, kind)
    assert torch.equal(make_projection(11, 8, 40, kind, dtype=torch.bfloat16), a.to(torch.bfloat16))
    assert torch.equal(make_projection(11, 8, 40, kind, device="cpu", dtype=torch.float64), a.double())


def test_unknown_projection_kind_is_rejected():
    with pytest.raises(ValueError, match="projection must be one of .*'sparse'"):
        make_projection(0, 4, 8, "sparse")


@pytest.mark.parametrize("kind", KINDS)
def test_entry_distribution(kind):
    """Mean 0 and variance 1/r, checked against the sampling error of N entries."""
    r, k, count = 16, 64, 64
    entries = torch.cat([make_projection(projection_seed(0, i, "p"), r, k, kind).flatten() for i in range(count)])
    entries = entries.double() * math.sqrt(r)  # unit variance if the scale is right
    n = entries.numel()
    assert abs(entries.mean().item()) < 5.0 / math.sqrt(n)
    # Var of x² is 0 for ±1 and 2 for N(0, 1): the sample variance is exact or within 5 σ.
    second_moment_sd = math.sqrt(2.0 / n) if kind == "gaussian" else 1e-12
    assert abs(entries.square().mean().item() - 1.0) < 5.0 * second_moment_sd + 1e-12
    if kind == "gaussian":
        # Shape, not just moments: P(|x| < 1) = 0.6827 for a normal, 0 for ±1 or a badly scaled uniform.
        p = math.erf(1 / math.sqrt(2))
        inside = (entries.abs() < 1).double().mean().item()
        assert abs(inside - p) < 5.0 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("kind", KINDS)
def test_expected_gram_is_identity(kind):
    """E[AᵀA] = I_k, so S A = G AᵀA is an unbiased estimate of G.

    Each entry of the mean of M Gram matrices is compared with the identity in units of its own
    standard error: off-diagonal entries have variance 1/r per draw; the diagonal has variance 0
    (Rademacher: exactly 1) or 2/r (Gaussian). The max-|z| bound is Bonferroni over the k² entries;
    the mean z² checks that the spread is the predicted one, not just that the mean is close.
    """
    r, k, m = 4, 24, 400
    gram = torch.zeros(k, k, dtype=torch.float64)
    for i in range(m):
        a = make_projection(projection_seed(1, i, "gram"), r, k, kind).double()
        gram += a.t() @ a
    gram /= m
    eye = torch.eye(k, dtype=torch.float64)
    off = ~torch.eye(k, dtype=torch.bool)
    z_off = (gram - eye)[off] / math.sqrt(1.0 / (r * m))
    assert z_off.abs().max() < 5.0
    assert 0.75 < z_off.square().mean() < 1.25
    diagonal = gram.diagonal()
    if kind == "rademacher":
        torch.testing.assert_close(diagonal, torch.ones(k, dtype=torch.float64), rtol=0, atol=1e-6)
    else:
        assert ((diagonal - 1) / math.sqrt(2.0 / (r * m))).abs().max() < 5.0


@given(r=st.integers(4, 32), k=st.integers(16, 64), seed=st.integers(0, 2**63 - 1), kind=st.sampled_from(KINDS))
@settings(max_examples=30)
def test_same_seed_same_bits_other_seed_other_matrix(r, k, seed, kind):
    a = make_projection(seed, r, k, kind)
    assert torch.equal(make_projection(seed, r, k, kind), a)
    # ≥ 64 independent entries: an accidental match has probability ≤ 2⁻⁶⁴.
    assert not torch.equal(make_projection(seed ^ 1, r, k, kind), a)


# --------------------------------------------------------------------------------------------------
# Bit-identity across processes, machines and versions

_CHILD = textwrap.dedent(
    """
    import hashlib, json, sys
    from logra_optim import make_projection, projection_seed
    out = {}
    for kind in ("rademacher", "gaussian"):
        for name in sys.argv[1:]:
            a = make_projection(projection_seed(7, 3, name), 8, 96, kind)
            out[kind + ":" + name] = [projection_seed(7, 3, name), hashlib.sha256(a.numpy().tobytes()).hexdigest()]
    print(json.dumps(out))
    """
)


def test_projection_is_bit_identical_in_a_separate_process():
    import json

    names = [
        Q_PROJ,
        "module._orig_mod.model.layers.0._fsdp_wrapped_module.self_attn.q_proj",
        "model.layers.1.mlp.up_proj",
    ]
    expected = {}
    for kind in KINDS:
        for name in names:
            seed = projection_seed(7, 3, name)
            expected[f"{kind}:{name}"] = [seed, digest(make_projection(seed, 8, 96, kind))]
    # A different hash seed and a single thread: neither may influence A.
    env = dict(os.environ, PYTHONHASHSEED="12345", OMP_NUM_THREADS="1")
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, *names], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    got = json.loads(child.stdout.strip().splitlines()[-1])
    assert got == expected
    # Wrapping the name must not change A.
    assert got[f"rademacher:{names[0]}"] == got[f"rademacher:{names[1]}"]
    assert got[f"rademacher:{names[0]}"] != got[f"rademacher:{names[2]}"]


def test_projection_matches_pinned_bits():
    """Golden values: a checkpoint or a rollout engine on another version must regenerate the same A.
    If this fails the projection stream changed; that must be a deliberate, versioned change
    (the ``logra/v1`` seed key, ``GENERATOR``, the sync payload version), never a side effect.
    (Changed deliberately once: the CPU Mersenne Twister gave way to SplitMix64, payload version 4.)"""
    seed = projection_seed(0, 0, Q_PROJ)
    assert seed == 6096856087719476021
    assert projection_module.GENERATOR == "splitmix64/v1"
    assert digest(make_projection(seed, 8, 64, "rademacher")) == (
        "b39609c3f0e42f18bdc1df09309ecda33258778a20c0d73d4181a2eeceeb0994"
    )
    assert digest(make_projection(seed, 8, 64, "gaussian")) == (
        "a12300c9493fdedc087504e2f3d6a1ef323d0700e6f56634ba0b67aa80fa0f36"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
def test_projection_generated_on_cuda_is_the_cpu_one(kind):
    """Rademacher bit for bit (integers only); Gaussian within one fp32 ulp, the float64 transcendental
    functions of two math libraries being allowed to differ in their last bit."""
    cpu = make_projection(123, 16, 256, kind)
    cuda = make_projection(123, 16, 256, kind, device="cuda")
    assert torch.equal(splitmix64(123, 0, 4096, "cuda").cpu(), splitmix64(123, 0, 4096))
    if kind == "rademacher":
        assert torch.equal(cuda.cpu(), cpu)
    else:
        torch.testing.assert_close(cuda.cpu(), cpu, rtol=2.0**-23, atol=0)


def test_importing_the_package_leaves_torch_compile_unloaded():
    """``make_projection`` excludes itself from ``torch.compile`` only when traced, so importing
    logra_optim does not import dynamo (seconds of import time in every worker process)."""
    import subprocess
    import sys

    code = "import sys, logra_optim; sys.exit('torch._dynamo' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
