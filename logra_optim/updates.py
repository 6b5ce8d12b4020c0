"""The update math of docs/method.md §2 as pure functions: directions, step size, merge.

Notation: a target ``W ∈ R^{d×k}``, its projection ``A ∈ R^{r×k}`` and sketch ``S ∈ R^{d×r}``;
the optimizer turns ``S`` into a direction ``U`` (d×r) and merges ``W ← W − α η U A``.
Nothing here touches optimizer bookkeeping; every function is checked against dense float64
references in the tests.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from .polar import POLAR_FLOOR, orthogonal_directions

# Row chunk of the merge for low-precision weights: bounds the fp32 temporary to about 64 MiB.
MERGE_CHUNK_BYTES = 64 * 2**20


def rowadam_direction(
    sketch: torch.Tensor,
    row_second_moment: torch.Tensor,
    step: int,
    beta2: float = 0.95,
    eps: float = 1e-8,
    numerator: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RowAdam: one second moment per output row. Returns ``(U, v_new)``.

    ::

        v_i   ← β2 v_i + (1−β2) · mean_j S_ij²
        ρ_i   = sqrt(v_i / (1 − β2^t))
        den_i = ρ_i + ε · mean_i ρ_i          # relative ε: scale-free, unlike Adam's absolute ε
        U     = diag(1/den) N · ‖N‖_F / ‖diag(1/den) N‖_F

    ``N`` is ``numerator`` (the bias-corrected first moment, :func:`first_moment`) or, by default,
    the sketch itself. The moment is indexed by output rows (neurons), not sketch columns, so it
    stays meaningful when ``A`` is refreshed. The final rescale only redistributes magnitude across
    rows; the step size comes from ``η``. ``row_second_moment`` is not modified, so a step that is
    rejected later leaves the state untouched.
    """
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    # Row mean of squares in float64, then cast: the squares of single entries below about 1e-22 or
    # above about 1e19 would underflow or overflow in fp32 and distort the row's mean. A mean beyond
    # fp32's range still overflows the moment (the optimizer skips that update, StepPlan.finite) or
    # flushes it to zero (the row keeps a zero direction).
    row_mean_square = sketch.double().square().mean(dim=1).to(row_second_moment.dtype)
    v_new = row_second_moment * beta2 + row_mean_square * (1.0 - beta2)
    rms = (v_new / (1.0 - beta2**step)).sqrt()
    denominator = rms + eps * rms.mean()
    # A row whose moment is still zero has had a zero sketch at every step: keep its direction 0.
    denominator = denominator.masked_fill(denominator == 0, 1.0)
    numerator = sketch if numerator is None else numerator
    direction = numerator / denominator.unsqueeze(1)
    direction_norm = torch.linalg.vector_norm(direction)
    numerator_norm = torch.linalg.vector_norm(numerator)
    scale = torch.where(direction_norm > 0, numerator_norm / direction_norm, torch.zeros_like(numerator_norm))
    return direction * scale, v_new


def first_moment(
    sketch: torch.Tensor, moment: torch.Tensor, step: int, beta1: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Momentum in sketch space: ``M ← β1 M + (1−β1) S``. Returns ``(M̂, M_new)`` with the
    bias-corrected ``M̂ = M_new / (1 − β1^t)``.

    Why: a GRPO batch's gradient is mostly noise (a few dozen completions), and a KL-controlled step
    spends its whole budget on whatever direction it is given. Averaging over updates keeps what the
    batches agree on, as Adam's first moment does. While ``A`` is fixed, ``M A`` is exactly the
    momentum of the projected gradients ``G AᵀA``; when ``A`` is redrawn, :func:`carry_first_moment`
    moves ``M`` into the new basis. ``moment`` is not modified.
    """
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"beta1 must be in [0, 1), got {beta1!r}")
    moment_new = moment * beta1 + sketch * (1.0 - beta1)
    return moment_new / (1.0 - beta1**step), moment_new


# Eigenvalues of A Aᵀ below this fraction of the largest are zero: singular values of A below 1e-6.
_GRAM_RTOL = 1e-12


def basis_change(old_projection: torch.Tensor, new_projection: torch.Tensor) -> torch.Tensor:
    """The ``r×r`` matrix ``T`` that carries a low-rank factor from ``A_old`` to ``A_new``:
    ``(M T) A_new`` is the orthogonal projection of ``M A_old`` onto the row space of ``A_new``,
    the closest matrix to ``M A_old`` that the new basis can express (least squares, row by row).

    ``T = A_old A_newᵀ (A_new A_newᵀ)⁺`` in float64, which is ``A_old · pinv(A_new)`` (``A_new`` may
    be rank-deficient: a square Rademacher draw can be, and ``r > k`` always is). Through the ``r×r``
    Gram matrix rather than an SVD of the ``r×k`` ``A_new``: 6–7× faster on 2 CPU cores
    (docs/benchmarks.md, "The first moment's basis change"), and the same ``T`` to about 1e-15 for
    the well-conditioned draws of ``r ≪ k``. The Gram matrix squares ``A_new``'s condition number, so
    singular values below ``1e-6`` of the largest count as zero (``_GRAM_RTOL`` on its eigenvalues;
    an SVD keeps them down to about ``1e-16·k``). That cut-off stays above the rounding of a null
    direction (at most about ``1e-16·k`` of the largest eigenvalue) wherever one exists, ``k ≤ r``.
    For ``A_new = A_old`` it is the identity.

    Why a projection and not Flora's ``A_old A_newᵀ``: the latter is unbiased over draws of ``A_new``
    but, for independent draws, multiplies the factor's norm by about ``sqrt(k/r)`` with noise
    orthogonal to the old momentum, and a KL-normalised step would spend its budget on that noise.
    The projection keeps only what the new basis can represent (≈ ``r/k`` of the energy for an
    independent draw): momentum mostly restarts at a refresh, which is why it pairs with
    ``refresh_every > 1``.
    """
    if old_projection.shape != new_projection.shape:
        raise ValueError(
            f"projections must have one shape (r×k): old {tuple(old_projection.shape)}, "
            f"new {tuple(new_projection.shape)}"
        )
    new = new_projection.double()
    transfer = (old_projection.double() @ new.T) @ torch.linalg.pinv(new @ new.T, rtol=_GRAM_RTOL, hermitian=True)
    return transfer.to(torch.float32)


def carry_first_moment(moment: torch.Tensor, transfer: torch.Tensor) -> torch.Tensor:
    """``M T``: the first moment expressed in the new basis (:func:`basis_change`); a new tensor."""
    return moment @ transfer.to(moment.dtype)


DIRECTIONS = ("rowadam", "orthogonal", "sgd")


def next_direction(
    kind: str,
    sketch: torch.Tensor,
    state: dict[str, torch.Tensor],
    beta2: float = 0.95,
    eps: float = 1e-8,
    beta1: float = 0.0,
    experts: int = 1,
    floor: float = POLAR_FLOOR,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`next_directions` of one target."""
    return next_directions(kind, [sketch], [state], beta2, eps, beta1, [experts], floor)[0]


def next_directions(
    kind: str,
    sketches: Sequence[torch.Tensor],
    states: Sequence[dict[str, torch.Tensor]],
    beta2: float = 0.95,
    eps: float = 1e-8,
    beta1: float = 0.0,
    experts: Sequence[int] | None = None,
    floor: float = POLAR_FLOOR,
) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """``U`` of every target (``kind`` ``"rowadam"``, ``"orthogonal"`` or ``"sgd"``) and the state it
    would commit, from its optimizer state (empty before its first update); with ``beta1 > 0`` the
    direction is built from the first moment (:func:`first_moment`) instead of the sketch;
    ``experts``: each target's stacked experts (their rows, in order, in the sketch); ``floor``: the
    orthogonal directions' (:func:`~logra_optim.polar.orthogonal_directions`, one batch for all
    targets). Nothing is mutated, so that an update rejected later (probe, realised KL) leaves the
    state as it was."""
    if kind not in DIRECTIONS:
        raise ValueError(f"direction must be one of {', '.join(DIRECTIONS)}, got {kind!r}")
    results = []
    for sketch, state in zip(sketches, states, strict=True):
        step = state.get("step", torch.tensor(0.0)) + 1
        new_state = {"step": step}
        numerator = sketch
        if beta1 > 0.0:
            moment = state.get("first_moment")
            if moment is None:
                moment = torch.zeros_like(sketch)
            numerator, new_state["first_moment"] = first_moment(sketch, moment, int(step), beta1)
        if kind == "rowadam":
            moment = state.get("row_second_moment")
            if moment is None:
                moment = torch.zeros(sketch.shape[0], dtype=torch.float32, device=sketch.device)
            numerator, new_state["row_second_moment"] = rowadam_direction(
                sketch, moment, int(step), beta2, eps, None if beta1 == 0.0 else numerator
            )
        # "sgd": U may alias the sketch, safe because every use (η, probe, merge) precedes zeroing it.
        results.append((numerator, new_state))
    if kind == "orthogonal":
        directions = orthogonal_directions([u for u, _ in results], experts, floor)
        results = [(u, state) for u, (_, state) in zip(directions, results)]
    return results


def idle_still(direction: torch.Tensor, sketch: torch.Tensor, experts: int = 1) -> torch.Tensor:
    """``direction`` with zeros where no gradient reached the weight in this update (on any rank):
    everywhere if its sketch is zero, and in the block of each of its ``experts`` stacked experts
    whose sketch rows are zero (no token was routed to it).

    Why: the step size ``η`` scales every nonzero direction to ``ρ_upd``, and orthogonal directions
    raise any first moment to unit singular values, so a weight that stops receiving gradient would
    keep taking full steps along its decaying momentum for as long as it stays idle: a layer off the
    loss path, a vision tower on text-only batches, an expert no token is routed to, every target in
    a batch of equal rewards. For towers and experts the KL probe cannot see those steps either (no
    probed token reaches them). So a weight or expert moves only in the updates whose gradient
    reached it, and its first moment decays meanwhile. The optimizer applies this after ``η``, so
    that the other targets and experts move as far as they would have had the idle ones moved too
    (an idle block without momentum is zero before either way)."""
    idle = ~sketch.reshape(experts, -1).any(dim=1)
    if not bool(idle.any()):
        return direction
    return (
        direction.reshape(experts, -1, direction.shape[-1]).masked_fill(idle.view(-1, 1, 1), 0.0).reshape_as(direction)
    )


def gram(projection: torch.Tensor) -> torch.Tensor:
    """``A Aᵀ`` (r×r, an fp32 product) of a projection, for :func:`low_rank_sq_norm`."""
    projection = projection.float()
    return projection @ projection.t()


def low_rank_sq_norm(factor: torch.Tensor, projection_gram: torch.Tensor) -> torch.Tensor:
    """``‖F A‖_F²`` without forming the d×k product: ``Σ (FᵀF) ∘ (AAᵀ)``, from the projection's Gram
    matrix ``A Aᵀ`` (:func:`gram`; it changes only when ``A`` is redrawn)."""
    factor_gram = factor.t().float() @ factor.float()
    return (factor_gram.double() * projection_gram.double()).sum()


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every entry of every tensor is finite (empty tensors are), with one host sync per
    device.

    On CPU and CUDA each tensor is read once, for two scalars: ``aminmax`` propagates NaN, and ±inf
    is the minimum or the maximum. ``isfinite(t).all()`` would write a mask the size of ``t`` and
    read it again, on every update, over every sketch. Elsewhere (MPS's reductions have not always
    propagated NaN) it is what runs."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        if not tensor.numel():
            continue
        if tensor.device.type in ("cpu", "cuda"):
            flag = torch.isfinite(torch.stack(torch.aminmax(tensor)))
        else:
            flag = torch.isfinite(tensor).all().view(1)
        flags.setdefault(tensor.device, []).append(flag)
    return all(bool(torch.cat(device_flags).all()) for device_flags in flags.values())


def relative_step_size(update_ratio: float, weight_sq_norm: float, update_sq_norm: float) -> float:
    """``η = ρ_upd · sqrt(‖W‖² / ‖UA‖²)``: at α = 1 the update has ``‖ΔW‖/‖W‖ = ρ_upd``.

    Returns 0 for a zero direction (there is nothing to scale).
    """
    if update_sq_norm <= 0.0:
        return 0.0
    return update_ratio * math.sqrt(weight_sq_norm / update_sq_norm)


RATIO_SCOPES = ("target", "model")


def step_sizes(
    update_ratio: float, weight_sq_norms: Sequence[float], update_sq_norms: Sequence[float], scope: str = "target"
) -> list[float]:
    """``η_i`` of every target, so that at α = 1 the update moves by ``ρ_upd`` relative to the weights.

    ``scope="target"``: every target moves by the same relative amount, ``‖ΔW_i‖ = ρ_upd ‖W_i‖``
    (a layer-wise trust ratio, as in LARS/LAMB). ``scope="model"``: one ``η`` for all, so that
    ``‖ΔW‖ = ρ_upd ‖W‖`` over all targets together.

    Why ``"target"`` is the default: with one shared ``η`` each target's share of the step is
    proportional to its gradient norm, and gradient norms differ by orders of magnitude between
    layers (the largest ones are also where the policy is most sensitive). The update then
    spends its KL budget on the few targets with the largest gradients while the rest barely
    move; Adam, whose per-element normalisation removes each layer's gradient scale, does not.
    A target whose weight is all zeros has nothing to be relative to and gets the model-wide ``η``.
    """
    if scope not in RATIO_SCOPES:
        raise ValueError(f"ratio_scope must be one of {RATIO_SCOPES}, got {scope!r}")
    if len(weight_sq_norms) != len(update_sq_norms):
        raise ValueError(f"got {len(weight_sq_norms)} weight norms for {len(update_sq_norms)} update norms")
    shared = relative_step_size(update_ratio, math.fsum(weight_sq_norms), math.fsum(update_sq_norms))
    if scope == "model":
        return [shared] * len(update_sq_norms)
    return [
        relative_step_size(update_ratio, weight, update) if weight > 0.0 else shared * (update > 0.0)
        for weight, update in zip(weight_sq_norms, update_sq_norms)
    ]


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round fp32 ``x`` to bfloat16, up or down with probability proportional to proximity.

    ``E[round(x)] = x``, so updates far below bf16's resolution still move the weight on average
    instead of vanishing. Adds uniform noise to the 16 bits that bf16 drops, then truncates.
    """
    return _round_with_noise_to_bf16(x, _bf16_noise(x.shape, x.device, generator))


def _bf16_noise(shape, device: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """Uniform 16-bit noise (int32) for :func:`_round_with_noise_to_bf16`: one draw per entry, in
    row-major order, so that a block can take its part of a whole matrix's draw."""
    return torch.randint(0, 1 << 16, tuple(shape), dtype=torch.int32, device=device, generator=generator)


def _rows_per_chunk(width: int, chunk_bytes: int) -> int:
    """Rows of a ``width``-wide matrix per chunk of a 16-bit merge (an fp32 temporary of at most
    ``chunk_bytes``): the trainer's and an engine's merges must chunk alike to draw alike."""
    return max(1, chunk_bytes // (4 * width))


def _round_with_noise_to_bf16(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """:func:`stochastic_round_to_bf16` with its 16-bit uniform ``noise`` (int32, ``x``'s shape) given."""
    bits = x.contiguous().view(torch.int32)
    rounded = (bits + noise) & -65536
    # Non-finite values must not be carried into the exponent by the noise.
    rounded = torch.where(torch.isfinite(x), rounded, bits)
    return rounded.view(torch.float32).to(torch.bfloat16)


def _check_merge_shapes(weight: torch.Tensor, factor: torch.Tensor, projection: torch.Tensor) -> None:
    if (
        weight.dim() != 2
        or factor.shape != (weight.shape[0], projection.shape[0])
        or projection.shape[1] != weight.shape[1]
    ):
        raise ValueError(
            f"merge shapes do not line up: weight {tuple(weight.shape)}, factor {tuple(factor.shape)}, "
            f"projection {tuple(projection.shape)} (expected d×k, d×r, r×k)"
        )


def merge_low_rank_(
    weight: torch.Tensor,
    factor: torch.Tensor,
    projection: torch.Tensor,
    *,
    stochastic_rounding: bool = True,
    generator: torch.Generator | None = None,
    chunk_bytes: int = MERGE_CHUNK_BYTES,
) -> torch.Tensor:
    """``W ← W − F A`` in place, for ``F = α η U`` (d×r) and ``A`` (r×k). Returns ``weight``.

    ``weight`` may be any row block of a target (an FSDP2 shard's local rows, with the matching
    rows of ``F``). fp32/fp64 weights are updated by one in-place GEMM (no temporary); bf16/fp16
    weights in row chunks through an fp32 temporary of at most ``chunk_bytes``, rounded back
    stochastically (bf16, default) or to nearest.
    """
    _check_merge_shapes(weight, factor, projection)
    if weight.dtype in (torch.float32, torch.float64):
        return weight.addmm_(factor.to(weight.dtype), projection.to(weight.dtype), alpha=-1.0)
    projection32 = projection.float()
    rows_per_chunk = _rows_per_chunk(weight.shape[1], chunk_bytes)
    for start in range(0, weight.shape[0], rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        updated = torch.addmm(weight[rows].float(), factor[rows].float(), projection32, alpha=-1.0)
        if stochastic_rounding and weight.dtype == torch.bfloat16:
            weight[rows] = stochastic_round_to_bf16(updated, generator)
        else:
            weight[rows] = updated.to(weight.dtype)
    return weight


def merge_low_rank_blocks_(
    blocks: Sequence[tuple[torch.Tensor, slice, slice]],
    factor: torch.Tensor,
    projection: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    chunk_bytes: int = MERGE_CHUNK_BYTES,
) -> None:
    """``W[rows, cols] ← W[rows, cols] − (F A)[rows, cols]`` on each ``(block, rows, cols)``, a tensor
    holding that block of one ``d×k`` matrix (``factor``: the whole ``F``, ``d×r``; ``projection``: the
    whole ``A``, ``r×k``), rounded to bf16 stochastically with the noise a merge of the whole matrix
    (:func:`merge_low_rank_` with the same ``generator`` and ``chunk_bytes``) draws for those entries,
    and stored in the block's dtype (exactly in fp32; fp16 rounds values below its normal range).

    Why: a tensor-parallel engine holds blocks of a bf16 trainer's matrix (a rank's experts, several
    blocks of one stack). Drawing each block's noise as if it were a matrix of its own gives every
    rank but the first other uniforms than the trainer's, and its copy then drifts from the trainer's
    like a random walk. Here the whole matrix's row chunks draw their noise once, in order, up to the
    last row any block holds, and every block takes its part, one chunk at a time (no copy of a block
    is made). A block's product over its own rows and columns can round an entry's last fp32 bit
    otherwise than the whole matrix's, which with the same noise rarely gives the neighbouring bf16
    value. The blocks must be disjoint and, with the generator, on ``factor``'s device."""
    d, k = factor.shape[0], projection.shape[1]
    rows_per_chunk = _rows_per_chunk(k, chunk_bytes)
    by_chunk: dict[int, list] = {}  # chunk index → the blocks that hold rows of it
    for block, rows, cols in blocks:
        first, end, step = rows.indices(d)
        if step != 1 or cols.indices(k)[2] != 1 or not block.is_floating_point():
            raise ValueError(
                f"merge_low_rank_blocks_: floating blocks of contiguous rows and columns, got {block.dtype}"
            )
        span = (block, first, end, cols, projection[:, cols].float())
        for chunk in range(first // rows_per_chunk, (end - 1) // rows_per_chunk + 1 if end > first else 0):
            by_chunk.setdefault(chunk, []).append(span)
    for chunk in range(max(by_chunk, default=-1) + 1):
        start, stop = chunk * rows_per_chunk, min((chunk + 1) * rows_per_chunk, d)
        noise = _bf16_noise((stop - start, k), factor.device, generator)
        for block, first, end, cols, projection32 in by_chunk.get(chunk, ()):
            low, high = max(start, first), min(stop, end)
            local = slice(low - first, high - first)
            updated = torch.addmm(block[local].float(), factor[low:high].float(), projection32, alpha=-1.0)
            block[local] = _round_with_noise_to_bf16(updated, noise[low - start : high - start, cols]).to(block.dtype)


def merge_transposed_experts_(
    stored: torch.Tensor, factor: torch.Tensor, projection: torch.Tensor, **options
) -> torch.Tensor:
    """``W_e ← W_e − F_e A`` for every expert of a stack stored transposed: ``stored[e]`` is ``W_eᵀ``
    (``E×k×d``, GPT-OSS), ``factor`` the experts' ``F_e`` (``d×r``) stacked by rows (``E·d × r``), as
    for any stacked weight. Returns ``stored``.

    Each ``W_e`` is a transposed view of its storage, which :func:`merge_low_rank_` (``options``:
    its rounding and chunking) updates in place: ``stored[e] ← stored[e] − (F_e A)ᵀ``, with nothing
    transposed in memory. The row-major ``E·d × k`` view of other stacks does not exist here (its
    rows are columns of the storage), hence one merge per expert."""
    experts, k, d = stored.shape
    if factor.dim() != 2 or factor.shape[0] != experts * d or projection.shape[1:] != (k,):
        raise ValueError(
            f"merge shapes do not line up: experts stored {tuple(stored.shape)} (E×k×d), factor "
            f"{tuple(factor.shape)}, projection {tuple(projection.shape)} (expected E·d×r, r×k)"
        )
    for matrix, rows in zip(stored.transpose(1, 2), factor.split(d)):
        merge_low_rank_(matrix, rows, projection, **options)
    return stored


def rounding_remainder(exact: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """``X − round(X)`` in ``rounded``'s dtype: what storing ``exact`` (fp32 or wider) in the 16-bit
    ``rounded`` dropped, i.e. the compensation of :func:`merge_low_rank_compensated_` right after the
    load, so that ``rounded + remainder`` is ``exact`` to within the remainder's own rounding."""
    if exact.shape != rounded.shape:
        raise ValueError(f"shapes differ: exact {tuple(exact.shape)}, rounded {tuple(rounded.shape)}")
    return (exact.to(rounded.device, torch.float64) - rounded.double()).to(rounded.dtype)


def merge_low_rank_compensated_(
    weight: torch.Tensor,
    compensation: torch.Tensor,
    factor: torch.Tensor,
    projection: torch.Tensor,
    *,
    chunk_bytes: int = MERGE_CHUNK_BYTES,
) -> torch.Tensor:
    """``W ← W − F A`` for a 16-bit ``W`` that must follow many tiny updates deterministically
    (Kahan summation). Returns ``weight``.

    An RL update moves a weight by ~``6e-5·α`` of itself, far below half a bf16 ulp (~``2e-3``):
    rounded to nearest, every one of them is dropped. ``compensation`` (same shape and dtype as
    ``W``) keeps what rounding dropped so far; each merge rounds ``W + C − F A`` to ``W`` and keeps
    the remainder in ``C``, so ``W + C`` tracks the exact sum and ``W`` stays within one rounding
    of it. After loading wider values ``X`` into ``W``, start ``C`` at their rounding remainder
    (:func:`rounding_remainder`), not at zero: otherwise ``W + C`` is off by up to half an ulp from
    the start and later merges round against the wrong value. This is for a rollout engine without
    fp32 master weights (vLLM's in-place path); the trainer uses fp32 masters or stochastic rounding.
    """
    if compensation.shape != weight.shape or compensation.dtype != weight.dtype:
        raise ValueError(
            f"compensation must match the weight: weight {tuple(weight.shape)} {weight.dtype}, compensation "
            f"{tuple(compensation.shape)} {compensation.dtype}"
        )
    if weight.dtype in (torch.float32, torch.float64):  # nothing is dropped: a plain merge
        return merge_low_rank_(weight, factor, projection)
    _check_merge_shapes(weight, factor, projection)
    projection32 = projection.float()
    rows_per_chunk = max(1, chunk_bytes // (8 * weight.shape[1]))
    for start in range(0, weight.shape[0], rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        exact = torch.addmm(
            weight[rows].float() + compensation[rows].float(), factor[rows].float(), projection32, alpha=-1.0
        )
        weight[rows] = exact.to(weight.dtype)
        compensation[rows] = (exact - weight[rows].float()).to(compensation.dtype)
    return weight
