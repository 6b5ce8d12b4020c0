"""The update math of docs/method.md §2 (``logra_optim.updates``) against float64 dense references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from logra_optim.updates import (
    all_finite,
    basis_change,
    carry_first_moment,
    first_moment,
    gram,
    low_rank_sq_norm,
    next_direction,
    next_directions,
    merge_low_rank_,
    relative_step_size,
    step_sizes,
    rowadam_direction,
    stochastic_round_to_bf16,
)
from logra_optim.polar import orthogonal_direction
from logra_optim.projection import make_projection
from tests.helpers.reference import U16, U32, bf16_neighbours, carried, merged, momentum_step, rowadam_step


def random_sketch(d, r, generator, spread=3.0):
    """A sketch whose rows differ in scale by orders of magnitude, as layers' output rows do; this is
    what makes a per-row normaliser differ from a global one."""
    row_scale = torch.exp(spread * torch.randn(d, 1, generator=generator, dtype=torch.float64))
    return (torch.randn(d, r, generator=generator, dtype=torch.float64) * row_scale).float()


# --------------------------------------------------------------------------------------------------
# RowAdam


@given(
    d=st.integers(1, 24),
    r=st.integers(1, 12),
    steps=st.integers(1, 6),
    beta2=st.sampled_from([0.0, 0.5, 0.95, 0.999]),
    eps=st.sampled_from([1e-8, 1e-3, 0.5]),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=60)
def test_rowadam_matches_float64_reference_over_steps(d, r, steps, beta2, eps, seed):
    generator = torch.Generator().manual_seed(seed)
    # Row scales drift between steps so the moment really carries history.
    sketches = [random_sketch(d, r, generator) for _ in range(steps)]
    v, v_ref = torch.zeros(d), torch.zeros(d, dtype=torch.float64)
    for t, s in enumerate(sketches, start=1):
        u_ref, v_ref = rowadam_step(s, v_ref, t, beta2=beta2, eps=eps)
        u, v = rowadam_direction(s, v, t, beta2=beta2, eps=eps)
        assert u.dtype == torch.float32 and v.shape == (d,)  # one moment per output row
        torch.testing.assert_close(v.double(), v_ref, rtol=1e-5, atol=0)
        # ‖U‖ = ‖S‖, so an absolute tolerance relative to ‖S‖ is the natural one for small entries.
        torch.testing.assert_close(u.double(), u_ref, rtol=1e-5, atol=1e-6 * torch.linalg.norm(s.double()).item())


@given(d=st.integers(1, 32), r=st.integers(1, 16), t=st.integers(1, 50), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=40)
def test_rowadam_preserves_the_sketch_norm(d, r, t, seed):
    generator = torch.Generator().manual_seed(seed)
    s = random_sketch(d, r, generator)
    v = torch.rand(d, generator=generator) * s.square().mean()
    u, _ = rowadam_direction(s, v, t)
    torch.testing.assert_close(torch.linalg.norm(u.double()), torch.linalg.norm(s.double()), rtol=1e-5, atol=0)


def test_rowadam_rescales_rows_not_just_a_constant():
    """Guard against a direction that is merely a multiple of S (which would also satisfy ‖U‖ = ‖S‖):
    at t = 1 with β2 = 0, every row of U has the same RMS."""
    generator = torch.Generator().manual_seed(0)
    s = random_sketch(8, 6, generator)
    u, _ = rowadam_direction(s, torch.zeros(8), 1, beta2=0.0, eps=1e-12)
    row_rms = u.double().square().mean(dim=1).sqrt()
    torch.testing.assert_close(row_rms, row_rms.mean().expand(8), rtol=1e-5, atol=0)
    assert s.double().square().mean(dim=1).sqrt().std() > 0.1 * row_rms.mean()


@given(scale=st.floats(1e-20, 1e20), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=30)
def test_rowadam_is_scale_equivariant(scale, seed):
    """Relative ε: U(cS) = c U(S), unlike Adam's absolute ε which breaks down for tiny gradients
    (RL policy-gradient sketches can be ~1e-10)."""
    generator = torch.Generator().manual_seed(seed)
    s = random_sketch(6, 4, generator, spread=1.0).double()
    u, v = rowadam_direction(s, torch.zeros(6, dtype=torch.float64), 1)
    u_scaled, v_scaled = rowadam_direction(s * scale, torch.zeros(6, dtype=torch.float64), 1)
    torch.testing.assert_close(u_scaled, u * scale, rtol=1e-10, atol=0)
    torch.testing.assert_close(v_scaled, v * scale**2, rtol=1e-10, atol=0)


def test_rowadam_zero_rows_stay_zero_and_finite():
    s = torch.tensor([[0.0, 0.0], [1.0, -2.0], [0.0, 0.0]])
    u, _ = rowadam_direction(s, torch.zeros(3), 1)
    assert torch.isfinite(u).all() and torch.equal(u[[0, 2]], torch.zeros(2, 2))


def test_rowadam_all_zero_sketch_gives_a_zero_direction():
    u, v = rowadam_direction(torch.zeros(4, 3), torch.zeros(4), 1)
    assert torch.equal(u, torch.zeros(4, 3)) and torch.equal(v, torch.zeros(4))


def test_rowadam_does_not_mutate_its_state_argument():
    """The optimizer commits the new moment only once the step is accepted (non-finite skip)."""
    v = torch.full((4,), 0.25)
    _, v_new = rowadam_direction(torch.ones(4, 2), v, 3)
    assert torch.equal(v, torch.full((4,), 0.25)) and not torch.equal(v_new, v)


def test_rowadam_moment_is_invariant_to_a_change_of_sketch_basis():
    """The row moment only sees row norms of S; a sketch expressed in another orthonormal basis
    (what a refreshed A amounts to, in expectation) leaves it unchanged. This is why the moment is
    kept per output row and carried across refreshes."""
    generator = torch.Generator().manual_seed(3)
    s = random_sketch(10, 6, generator).double()
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=generator, dtype=torch.float64))
    v = torch.rand(10, generator=generator, dtype=torch.float64)
    _, v_a = rowadam_direction(s, v, 4)
    _, v_b = rowadam_direction(s @ q, v, 4)
    torch.testing.assert_close(v_a, v_b, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------------------------------
# The first moment in sketch space


@given(
    d=st.integers(1, 16),
    r=st.integers(1, 8),
    steps=st.integers(1, 6),
    beta1=st.sampled_from([0.5, 0.9, 0.99]),
    kind=st.sampled_from(["rowadam", "sgd"]),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=60)
def test_momentum_direction_matches_float64_reference(d, r, steps, beta1, kind, seed):
    generator = torch.Generator().manual_seed(seed)
    state, m_ref, v_ref = {}, torch.zeros(d, r, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
    for t in range(1, steps + 1):
        s = random_sketch(d, r, generator)
        numerator, m_ref = momentum_step(s, m_ref, t, beta1)
        if kind == "rowadam":
            u_ref, v_ref = rowadam_step(s, v_ref, t, numerator=numerator)
        else:
            u_ref = numerator
        u, state = next_direction(kind, s, state, beta1=beta1)
        # Row scales differ by orders of magnitude and (1−β1)·S may cancel β1·M: tolerance per row.
        row_scale = torch.maximum(m_ref.abs().amax(dim=1, keepdim=True), s.double().abs().amax(dim=1, keepdim=True))
        assert ((state["first_moment"].double() - m_ref).abs() <= 1e-5 * row_scale).all()
        torch.testing.assert_close(u.double(), u_ref, rtol=1e-4, atol=1e-5 * u_ref.norm().item())


def test_momentum_off_keeps_no_first_moment_and_equals_the_sketch_direction():
    generator = torch.Generator().manual_seed(0)
    s = random_sketch(5, 3, generator)
    u0, state0 = next_direction("rowadam", s, {})
    u1, state1 = next_direction("rowadam", s, {}, beta1=0.0)
    assert "first_moment" not in state0 and "first_moment" not in state1
    assert torch.equal(u0, u1) and torch.equal(u0, rowadam_direction(s, torch.zeros(5), 1)[0])


def test_first_moment_averages_out_noise_that_a_single_sketch_keeps():
    """Why it exists: with a common signal under independent noise, the bias-corrected moment is
    closer to the signal than the latest sketch (β1 = 0.9 averages ≈ 19 sketches)."""
    generator = torch.Generator().manual_seed(0)
    signal = torch.randn(64, 8, generator=generator)
    moment = torch.zeros(64, 8)
    for t in range(1, 101):
        sketch = signal + 3.0 * torch.randn(64, 8, generator=generator)
        estimate, moment = first_moment(sketch, moment, t, 0.9)
    assert (estimate - signal).norm() < 0.4 * (sketch - signal).norm()


def test_first_moment_rejects_bad_arguments_and_does_not_mutate():
    moment = torch.ones(3, 2)
    with pytest.raises(ValueError, match="beta1 must be in"):
        first_moment(torch.zeros(3, 2), moment, 1, 1.0)
    with pytest.raises(ValueError, match="step must be >= 1"):
        first_moment(torch.zeros(3, 2), moment, 0, 0.9)
    first_moment(torch.zeros(3, 2), moment, 1, 0.9)
    assert torch.equal(moment, torch.ones(3, 2))


def carried_both_ways(d: int, r: int, k: int, kind: str, seed: int):
    """``(moment, A_old, A_new, carried by basis_change, float64 lstsq reference)`` for one draw."""
    old, new = (make_projection(seed + i, r, k, kind) for i in (0, 1))
    moment = torch.randn(d, r, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()
    return moment, old, new, carry_first_moment(moment, basis_change(old, new)), carried(moment, old, new)


basis_draws = dict(
    d=st.integers(1, 10), kind=st.sampled_from(["rademacher", "gaussian"]), seed=st.integers(0, 2**31 - 1)
)


@given(r=st.integers(1, 6), extra=st.integers(0, 20), **basis_draws)
@settings(max_examples=60)
def test_basis_change_is_the_least_squares_projection_onto_the_new_basis(d, r, extra, kind, seed):
    k = r + extra
    moment, old, new, moved, expected = carried_both_ways(d, r, k, kind, seed)
    # Compared where it matters, in weight space: (M T) A_new against the float64 projection.
    scale = (moment.double() @ old.double()).abs().max().item() + 1e-30
    torch.testing.assert_close(
        moved.double() @ new.double(), expected @ new.double(), rtol=0, atol=1e-4 * scale * max(1.0, k / r)
    )
    # A projection never adds energy: ‖M' A_new‖ ≤ ‖M A_old‖.
    assert (moved.double() @ new.double()).norm() <= (moment.double() @ old.double()).norm() * (1 + 1e-4)


@given(r=st.integers(2, 8), short=st.integers(0, 7), **basis_draws)
@settings(max_examples=60)
def test_basis_change_of_a_rank_deficient_basis_is_the_minimum_norm_solution(d, r, short, kind, seed):
    """``k ≤ r``: ``A_new`` has a null space (``r − k`` directions at least, more for a singular square
    Rademacher draw). The carried moment itself, not only its image ``M' A_new``, is the float64
    minimum-norm least-squares solution: nothing of it lies along directions ``A_new`` cannot express."""
    moment, _, new, moved, expected = carried_both_ways(d, r, max(1, r - short), kind, seed)
    scale = moment.abs().max().item() * (1.0 + float(torch.linalg.pinv(new.double()).abs().max()))
    torch.testing.assert_close(moved.double(), expected, rtol=0, atol=1e-4 * scale)


def test_basis_change_of_a_basis_to_itself_is_the_identity():
    a = make_projection(3, 6, 40)
    torch.testing.assert_close(basis_change(a, a), torch.eye(6), rtol=0, atol=1e-6)


@pytest.mark.parametrize("smallest", [1e-2, 1e-3, 1e-5])
def test_basis_change_keeps_a_weak_direction_of_an_ill_conditioned_basis(smallest):
    """A new basis with one singular value far below the others (``smallest`` of the largest, above
    the 1e-6 cut-off) still expresses that direction: carried into itself, a moment stays as it was,
    its component along the weak direction included."""
    generator = torch.Generator().manual_seed(0)
    left = torch.linalg.qr(torch.randn(4, 4, generator=generator, dtype=torch.float64))[0]
    right = torch.linalg.qr(torch.randn(30, 4, generator=generator, dtype=torch.float64))[0]
    basis = (left * torch.tensor([1.0, 0.7, 0.4, smallest], dtype=torch.float64)) @ right.T
    moment = torch.randn(5, 4, generator=generator)
    carried = carry_first_moment(moment, basis_change(basis.float(), basis.float()))
    torch.testing.assert_close(carried, moment, rtol=0, atol=1e-4)


def test_basis_change_keeps_a_shared_row_space_and_drops_an_orthogonal_one():
    """Same row space (``A_new = Q A_old``): the weight-space momentum survives exactly. Orthogonal
    row spaces (disjoint input columns): nothing of it can be expressed, and nothing is kept."""
    generator = torch.Generator().manual_seed(0)
    old = make_projection(0, 4, 30)
    moment = torch.randn(5, 4, generator=generator)
    mixed = torch.randn(4, 4, generator=generator) + 4 * torch.eye(4)
    same_space = mixed @ old
    kept = carry_first_moment(moment, basis_change(old, same_space)) @ same_space
    torch.testing.assert_close(kept, moment @ old, rtol=0, atol=1e-4)
    left, right = torch.zeros(4, 30), torch.zeros(4, 30)
    left[:, :15], right[:, 15:] = old[:, :15], old[:, 15:]
    assert carry_first_moment(moment, basis_change(left, right)).abs().max() < 1e-6


def test_basis_change_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="projections must have one shape"):
        basis_change(torch.zeros(2, 5), torch.zeros(3, 5))


def test_rowadam_rejects_step_zero():
    with pytest.raises(ValueError, match="step must be >= 1"):
        rowadam_direction(torch.ones(2, 2), torch.zeros(2), 0)


# --------------------------------------------------------------------------------------------------
# Step size


@given(d=st.integers(1, 24), k=st.integers(1, 48), r=st.integers(1, 12), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=50)
def test_low_rank_sq_norm_matches_dense(d, k, r, seed):
    generator = torch.Generator().manual_seed(seed)
    factor = random_sketch(d, r, generator, spread=1.0)
    a = torch.randn(r, k, generator=generator)
    dense = (factor.double() @ a.double()).square().sum()
    # Gram products in fp32: error ≤ γ · Σ(|F|ᵀ|F|)∘(|A||A|ᵀ), bounded here by a relative 1e-5
    # of the same sum taken in absolute values.
    bound = ((factor.double().abs().t() @ factor.double().abs()) * (a.double().abs() @ a.double().abs().t())).sum()
    got = low_rank_sq_norm(factor, gram(a))
    assert got.dtype == torch.float64
    assert abs(got.item() - dense.item()) <= 1e-5 * bound.item()
    # Also from a bf16 factor (the wire dtype).
    got_bf16 = low_rank_sq_norm(factor.bfloat16(), gram(a))
    dense_bf16 = (factor.bfloat16().double() @ a.double()).square().sum()
    assert abs(got_bf16.item() - dense_bf16.item()) <= 1e-5 * bound.item()


@given(
    ratio=st.floats(1e-8, 1.0),
    shapes=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 16), st.integers(1, 6)), min_size=1, max_size=4),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=40)
def test_relative_step_size_gives_the_requested_global_update_norm(ratio, shapes, seed):
    generator = torch.Generator().manual_seed(seed)
    weights, updates = [], []
    for d, k, r in shapes:
        weights.append(torch.randn(d, k, generator=generator, dtype=torch.float64))
        updates.append(
            torch.randn(d, r, generator=generator, dtype=torch.float64)
            @ torch.randn(r, k, generator=generator, dtype=torch.float64)
        )
    w_sq = sum(float(w.square().sum()) for w in weights)
    u_sq = sum(float(u.square().sum()) for u in updates)
    eta = relative_step_size(ratio, w_sq, u_sq)
    delta_sq = sum(float((eta * u).square().sum()) for u in updates)
    assert math.isclose(math.sqrt(delta_sq / w_sq), ratio, rel_tol=1e-12)


def test_relative_step_size_of_a_zero_direction_is_zero():
    assert relative_step_size(1e-3, 4.0, 0.0) == 0.0


@given(
    ratio=st.floats(1e-8, 1.0),
    shapes=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 16), st.integers(1, 6)), min_size=1, max_size=4),
    scales=st.lists(st.floats(1e-6, 1e6), min_size=4, max_size=4),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=40)
def test_step_sizes_per_target_and_per_model(ratio, shapes, scales, seed):
    """``"target"``: every target's own ‖ΔW_i‖/‖W_i‖ is ρ, however different the gradient scales;
    ``"model"``: one η, and only the total is ρ."""
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(d, k, generator=generator, dtype=torch.float64) for d, k, _ in shapes]
    updates = [
        scale
        * torch.randn(d, r, generator=generator, dtype=torch.float64)
        @ torch.randn(r, k, generator=generator, dtype=torch.float64)
        for (d, k, r), scale in zip(shapes, scales)
    ]
    w_sq = [float(w.square().sum()) for w in weights]
    u_sq = [float(u.square().sum()) for u in updates]
    per_target = step_sizes(ratio, w_sq, u_sq, "target")
    for eta, w, u in zip(per_target, w_sq, u_sq):
        assert math.isclose(eta * math.sqrt(u / w), ratio, rel_tol=1e-12)
    shared = step_sizes(ratio, w_sq, u_sq, "model")
    assert len(set(shared)) == 1 and shared[0] == relative_step_size(ratio, math.fsum(w_sq), math.fsum(u_sq))
    # Both move the targets by ρ in total.
    for etas in (per_target, shared):
        total = math.fsum(eta**2 * u for eta, u in zip(etas, u_sq))
        assert math.isclose(math.sqrt(total / math.fsum(w_sq)), ratio, rel_tol=1e-9)


def test_step_sizes_edge_cases():
    # A zero direction does not move; an all-zero weight has nothing to be relative to: the model-wide η.
    assert step_sizes(1e-2, [4.0, 9.0], [0.0, 1.0]) == [0.0, pytest.approx(3e-2)]
    shared = relative_step_size(1e-2, 4.0, 2.0)
    assert step_sizes(1e-2, [4.0, 0.0], [1.0, 1.0]) == [pytest.approx(2e-2), pytest.approx(shared)]
    assert step_sizes(1e-2, [0.0], [0.0]) == [0.0]
    with pytest.raises(ValueError, match="ratio_scope must be one of"):
        step_sizes(1e-2, [1.0], [1.0], "layer")
    with pytest.raises(ValueError, match="2 weight norms for 1 update norms"):
        step_sizes(1e-2, [1.0, 1.0], [1.0])


# --------------------------------------------------------------------------------------------------
# Merge


def merge_inputs(d, k, r, seed, update_scale=1e-2):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(d, k, generator=generator)
    factor = torch.randn(d, r, generator=generator) * update_scale
    projection = torch.randn(r, k, generator=generator) / math.sqrt(r)
    return weight, factor, projection


@given(
    d=st.integers(1, 24),
    k=st.integers(1, 40),
    r=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
@settings(max_examples=50)
def test_merge_full_precision_matches_dense(d, k, r, seed, dtype):
    weight, factor, projection = merge_inputs(d, k, r, seed)
    weight = weight.to(dtype)
    reference = merged(weight, factor, projection)
    abs_product = weight.double().abs() + factor.double().abs() @ projection.double().abs()
    u = U32 if dtype == torch.float32 else 2.0**-53
    storage = weight.data_ptr()
    assert merge_low_rank_(weight, factor, projection) is weight
    assert weight.data_ptr() == storage and weight.dtype == dtype
    assert ((weight.double() - reference).abs() <= (r + 2) * u * abs_product).all()


@given(
    d=st.integers(1, 40),
    k=st.integers(1, 24),
    r=st.integers(1, 8),
    rows_per_chunk=st.integers(1, 7),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=50)
def test_merge_bf16_in_row_chunks_matches_dense(d, k, r, rows_per_chunk, seed):
    weight, factor, projection = merge_inputs(d, k, r, seed, update_scale=0.3)
    weight = weight.bfloat16()
    reference = merged(weight, factor, projection)
    # chunk_bytes sized for a few rows of fp32 temporary, so d rows take ⌈d/rows⌉ chunks, usually
    # with a ragged last one.
    merge_low_rank_(weight, factor, projection, stochastic_rounding=False, chunk_bytes=rows_per_chunk * 4 * k)
    assert weight.dtype == torch.bfloat16
    # Round-to-nearest into bf16 (≤ u·|x|) of an fp32 value (≤ γ_r |F||A| + u32|W|).
    fp32_error = (r + 2) * U32 * (weight.double().abs() + factor.double().abs() @ projection.double().abs())
    assert ((weight.double() - reference).abs() <= U16 * reference.abs() + fp32_error).all()


def test_merge_bf16_chunking_does_not_change_the_result():
    weight, factor, projection = merge_inputs(37, 16, 4, 0, update_scale=0.3)
    weight = weight.bfloat16()
    one_chunk = merge_low_rank_(weight.clone(), factor, projection, stochastic_rounding=False)
    for rows in (1, 5, 36):
        chunked = merge_low_rank_(
            weight.clone(), factor, projection, stochastic_rounding=False, chunk_bytes=rows * 4 * 16
        )
        assert torch.equal(chunked, one_chunk), rows
    # A chunk smaller than one row still makes progress (one row per chunk).
    tiny = merge_low_rank_(weight.clone(), factor, projection, stochastic_rounding=False, chunk_bytes=1)
    assert torch.equal(tiny, one_chunk)


def test_merge_into_a_row_block_touches_only_that_block():
    """An FSDP2 shard is a row block of W; merging its rows of F must leave the others alone."""
    weight, factor, projection = merge_inputs(12, 10, 3, 1)
    full = weight.clone()
    merge_low_rank_(weight[4:9], factor[4:9], projection)
    assert torch.equal(weight[:4], full[:4]) and torch.equal(weight[9:], full[9:])
    expected = full.clone()
    merge_low_rank_(expected, factor, projection)
    torch.testing.assert_close(weight[4:9], expected[4:9], rtol=0, atol=0)


def test_merge_rejects_mismatched_shapes():
    weight, factor, projection = merge_inputs(6, 8, 3, 0)
    with pytest.raises(ValueError, match="merge shapes do not line up"):
        merge_low_rank_(weight, factor[:, :2], projection)
    with pytest.raises(ValueError, match="merge shapes do not line up"):
        merge_low_rank_(weight, factor, projection[:, :5])


def test_merge_bf16_stochastic_rounding_is_unbiased_for_sub_ulp_updates():
    """Every row is the same weight and update, so the d rows are d independent roundings. The update
    is 0.1 ulp: round-to-nearest would lose it entirely (a bias of 10 standard errors or more)."""
    d, k = 20000, 4
    w0 = torch.tensor([1.0, -1.5, 3.0, 0.75]).bfloat16()
    ulp = torch.tensor([2.0**-7, 2.0**-7, 2.0**-6, 2.0**-8], dtype=torch.float64)
    target_delta = 0.1 * ulp  # W − F A, expressed through a rank-1 factor and projection
    weight = w0.expand(d, k).clone()
    factor = torch.ones(d, 1)
    projection = (-target_delta).float().unsqueeze(0)
    generator = torch.Generator().manual_seed(0)
    merge_low_rank_(weight, factor, projection, generator=generator, chunk_bytes=4 * k * 999)
    moved = weight.double() - w0.double()
    # Each entry is either unchanged or one ulp up (the update is +0.1 ulp everywhere).
    assert ((moved == 0) | (moved == ulp)).all()
    expected = w0.double() + target_delta.float().double()  # the fp32 sum being rounded
    p = 0.1
    standard_error = ulp * math.sqrt(p * (1 - p) / d)
    assert ((weight.double().mean(0) - expected).abs() < 5 * standard_error).all()


# --------------------------------------------------------------------------------------------------
# Stochastic rounding


def test_stochastic_rounding_is_unbiased():
    generator = torch.Generator().manual_seed(0)
    values = torch.cat(
        [
            torch.randn(32, generator=generator) * 10.0 ** torch.randint(-30, 30, (32,), generator=generator),
            -torch.rand(16, generator=generator),
        ]
    ).float()
    draws = 4000
    rounded = stochastic_round_to_bf16(values.expand(draws, -1).contiguous(), torch.Generator().manual_seed(1))
    assert rounded.dtype == torch.bfloat16
    low, high = bf16_neighbours(values)
    r64 = rounded.double()
    assert ((r64 == low) | (r64 == high)).all()
    # Bernoulli between the neighbours with p = distance to low / spacing: unbiased, with a per-value
    # standard error of spacing·sqrt(p(1−p)/draws). Bonferroni over 48 values at 5σ.
    p = ((values.double() - low) / (high - low)).clamp(0, 1)
    standard_error = (high - low).abs() * torch.sqrt(p * (1 - p) / draws)
    assert ((r64.mean(0) - values.double()).abs() <= 5 * standard_error + 1e-300).all()


def test_stochastic_rounding_keeps_representable_and_non_finite_values():
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.0e38, 2.0**-130]).bfloat16().float()
    # NaNs whose payload fills the low bits: adding rounding noise to their bit pattern would carry
    # into the sign bit and turn them into ±0, silently hiding the NaN.
    nan_payloads = torch.tensor([0x7FFFFFFF, -1, 0x7FFF8000], dtype=torch.int32).view(torch.float32)
    special = torch.cat([torch.tensor([float("inf"), float("-inf"), float("nan")]), nan_payloads])
    x = torch.cat([exact, special]).expand(1000, -1).contiguous()
    out = stochastic_round_to_bf16(x, torch.Generator().manual_seed(0)).float()
    assert torch.equal(out[:, :6], exact.expand(1000, -1))
    assert (out[:, 6] == float("inf")).all() and (out[:, 7] == float("-inf")).all()
    assert out[:, 8:].isnan().all()


def test_stochastic_rounding_with_a_seeded_generator_is_reproducible():
    x = torch.randn(1000)
    a = stochastic_round_to_bf16(x, torch.Generator().manual_seed(5))
    b = stochastic_round_to_bf16(x, torch.Generator().manual_seed(5))
    c = stochastic_round_to_bf16(x, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


# ------------------------------------------------------------------------------------------------
# Orthogonal directions (the polar factor: tests/test_polar.py)


def test_orthogonal_direction_of_zero_is_zero_and_next_direction_keeps_the_moment():
    assert torch.equal(orthogonal_direction(torch.zeros(5, 3)), torch.zeros(5, 3))
    sketch = torch.randn(6, 3)
    state = {"step": torch.tensor(2.0), "first_moment": torch.randn(6, 3)}
    before = {k: v.clone() for k, v in state.items()}
    direction, new_state = next_direction("orthogonal", sketch, state, beta1=0.9)
    assert all(torch.equal(state[k], before[k]) for k in state)  # not mutated
    momentum = state["first_moment"] * 0.9 + sketch * 0.1
    torch.testing.assert_close(new_state["first_moment"], momentum)
    torch.testing.assert_close(direction, orthogonal_direction(momentum / (1 - 0.9**3)))
    torch.testing.assert_close(direction.T @ direction, torch.eye(3), atol=1e-5, rtol=0)


@settings(max_examples=30, deadline=None)
@given(experts=st.integers(1, 4), d=st.integers(1, 8), r=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_orthogonal_direction_of_stacked_experts_is_each_experts_polar_factor(experts, d, r, seed):
    """Experts stacked as ``E·d × r`` rows: every expert's block is its own polar factor (a scaled or
    zero expert does not change another's)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = [torch.randn(d, r, generator=generator) * 10.0 ** (2 * e) for e in range(experts)]
    blocks[-1] = blocks[-1] * (seed % 2)  # an expert with no tokens: a zero block
    direction = orthogonal_direction(torch.cat(blocks), experts)
    for block, expected in zip(direction.split(d), blocks):
        torch.testing.assert_close(block, orthogonal_direction(expected), rtol=0, atol=2e-5)
    _, state = next_direction("orthogonal", torch.cat(blocks), {}, experts=experts)
    assert set(state) == {"step"}


def test_next_directions_of_several_targets_equal_each_alone():
    """Targets of two ranks, one with stacked experts, each kind: the batch gives what each target
    alone gives; an unknown kind is refused by name."""
    generator = torch.Generator().manual_seed(8)
    sketches = [torch.randn(6, 4, generator=generator), torch.randn(3 * 5, 4, generator=generator)]
    sketches.append(torch.randn(7, 2, generator=generator))
    experts = [1, 3, 1]
    state = {"step": torch.tensor(1.0), "first_moment": torch.randn(6, 4, generator=generator)}
    states = [state, {}, {}]
    for kind in ("rowadam", "orthogonal", "sgd"):
        for beta1 in (0.0, 0.9):
            states = [state if beta1 else {}, {}, {}]
            together = next_directions(kind, sketches, states, beta1=beta1, experts=experts)
            for (u, new_state), sketch, old, e in zip(together, sketches, states, experts):
                alone, alone_state = next_direction(kind, sketch, old, beta1=beta1, experts=e)
                torch.testing.assert_close(u, alone, rtol=0, atol=1e-6)
                assert set(new_state) == set(alone_state)
    with pytest.raises(ValueError, match="direction must be one of rowadam, orthogonal, sgd, got 'adam'"):
        next_directions("adam", sketches, states)


@settings(deadline=None, max_examples=40)
@given(
    shapes=st.lists(st.sampled_from([(), (0,), (7,), (300, 2), (17, 9), (1 << 17,), (3, 0)]), min_size=1, max_size=4),
    strided=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
    bad=st.sampled_from([None, math.nan, math.inf, -math.inf]),
    where=st.integers(0, 10**6),
    seed=st.integers(0, 2**16),
)
def test_all_finite_equals_isfinite_everywhere(shapes, strided, dtype, bad, where, seed):
    """One non-finite entry anywhere, in any tensor (NaN, +inf or -inf), makes it false; empty and
    0-dim tensors, contiguous tensors large enough for the vectorised and threaded CPU loops, and
    strided views all count. Entries near the dtype's largest finite value, whose sum would
    overflow, are finite."""
    generator = torch.Generator().manual_seed(seed)
    largest = torch.finfo(dtype).max
    tensors = []
    for shape in shapes:
        full = torch.rand((*shape, 2) if strided else shape, generator=generator, dtype=torch.float64)
        values = ((full * 2 - 1) * 0.99 * largest).to(dtype)
        tensors.append(values[..., 0] if strided else values)
    filled = [t for t in tensors if t.numel()]
    if bad is not None and filled:
        victim = filled[where % len(filled)]
        index = torch.unravel_index(torch.tensor(where % victim.numel()), victim.shape)
        victim[index] = bad  # through the view itself where it is strided
    assert all_finite(tensors) == all(bool(torch.isfinite(t).all()) for t in tensors)


def test_all_finite_of_nothing_and_of_empty_tensors_is_true():
    assert all_finite([]) and all_finite([torch.empty(0), torch.empty(3, 0)])
    assert not all_finite([torch.empty(0), torch.tensor(math.nan)])


@given(
    experts=st.integers(1, 5),
    d=st.integers(1, 4),
    r=st.integers(1, 4),
    idle=st.lists(st.booleans(), min_size=5, max_size=5),
    seed=st.integers(0, 2**20),
)
def test_idle_weights_and_experts_are_still_and_the_others_untouched(experts, d, r, idle, seed):
    """A weight whose sketch is zero gets a zero direction, and so does an expert block whose sketch
    rows are zero; every other block keeps its direction exactly."""
    from logra_optim.updates import idle_still

    generator = torch.Generator().manual_seed(seed)
    sketch = torch.randn(experts, d, r, generator=generator)
    sketch[torch.tensor(idle[:experts])] = 0.0
    direction = torch.randn(experts * d, r, generator=generator)
    result = idle_still(direction, sketch.reshape(-1, r), experts).reshape(experts, d, r)
    for expert in range(experts):
        block = torch.zeros(d, r) if idle[expert] else direction.reshape(experts, d, r)[expert]
        assert torch.equal(result[expert], block)
