"""Orthogonal directions: the polar factor of each target's ``d×r`` direction, all targets at once.

``U = N (NᵀN + τ I)^-½`` with ``τ = (floor · σ_max)²``: ``N``'s singular vectors, its singular
values ``σ`` set to ``σ / sqrt(σ² + (floor σ_max)²)``. A direction at ``k · floor · σ_max`` keeps
``1 / sqrt(1 + 1/k²)`` (0.995 at ``k = 10``), so those that carry the sketch stay at 1 and those at
its rounding noise become ``≈ σ / (floor σ_max)`` instead of being raised to 1.

Only the ``r×r`` Gram matrices need the inverse square root, and they are taken in batches of
targets of one ``r``, so that the power iterations that set the floor run once per batch instead of
once per target (at small ranks their products cost more in calls than in arithmetic). On a CPU
the root is a float64 eigendecomposition, in batches of at most 512 KiB of Gram matrices. On a GPU
it is a coupled Newton–Schulz iteration in float64, matrix products only: cuSOLVER's
eigendecomposition of a 256×256 matrix takes about 2 ms and does not batch at that size, 0.11 s of
GPU time per update for the 56 targets of an 8-layer Qwen2.5-1.5B on an H200, against 0.47 s for
the optimizer's whole step (docs/benchmarks.md, "On a GPU"). The two paths are built to compute
one function, and ``tests/test_polar.py`` checks them against each other on the CPU (and
gpu_check.py on a GPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# Relative singular-value floors. fp32 products: 1e-5. Once bf16/fp16 products have gone into the
# sketches: 1e-2, above their rounding noise (about 1e-3 of the signal in a 2-token sketch), which
# 1e-5 would raise to unit size.
POLAR_FLOOR = 1e-5
POLAR_FLOOR_16BIT = 1e-2

METHODS = ("eigh", "newton-schulz")
# Newton–Schulz converges once ZY is within this of the identity (float64 rounding at r ≤ 1024
# stays near 1e-13); a block that does not is recomputed by eigh.
NEWTON_SCHULZ_TOLERANCE = 1e-9
# Gram matrices per Newton–Schulz batch: 64 at r = 256. Its iterates hold a few copies of them.
BATCH_BYTES = 32 * 2**20
# Gram matrices per eigh batch (the CPU's): 64 at r = 32, where the power iterations' small products
# cost more in calls than in arithmetic and a batch saves them; 1 from r = 256 on, where a batch saves
# little and its targets' second float64 copy (for the product) costs more (about 2% of the
# directions' time at the h1024 shape, docs/benchmarks.md).
EIGH_BATCH_BYTES = 2**19
POWER_ITERATIONS = 32


def orthogonal_directions(
    numerators: Sequence[torch.Tensor],
    experts: Sequence[int] | None = None,
    floor: float = POLAR_FLOOR,
    method: str | None = None,
) -> list[torch.Tensor]:
    """The polar factor of each ``numerators[i]`` (``E_i·d_i × r``, ``experts[i]`` stacked blocks,
    each its own matrix), in its dtype and on its device.

    Why equalise singular values: a sketch's few large singular directions carry most of its norm,
    so a step normalised by that norm (``η``) and by the KL budget (``α``) barely moves along the
    others. Equalising them, as Muon does for full gradients, spends the step evenly over the
    subspace the sketch (or its first moment) found; with ``A``'s rows nearly orthonormal, ``U A``
    then has nearly equal singular values too. ``floor`` must lie above the rounding noise of the
    products ``N`` was summed from (:data:`POLAR_FLOOR_16BIT` for bf16/fp16 ones), or that noise
    would be raised to unit size. ``method``: ``"eigh"`` or ``"newton-schulz"``; by default the
    latter on CUDA and the former elsewhere.
    """
    experts = [1] * len(numerators) if experts is None else list(experts)
    if len(experts) != len(numerators):
        raise ValueError(f"experts: one count per numerator, got {len(experts)} for {len(numerators)}")
    if method is not None and method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} or None, got {method!r}")
    if not 0.0 < floor < 1.0:
        raise ValueError(f"floor must be in (0, 1), got {floor!r}")
    for index, (numerator, count) in enumerate(zip(numerators, experts)):
        if numerator.ndim != 2 or count < 1 or numerator.shape[0] % count:
            raise ValueError(
                f"numerators[{index}]: expected a 2-D E·d × r matrix of experts[{index}] = {count} blocks, "
                f"got shape {tuple(numerator.shape)}"
            )
    directions: list[torch.Tensor | None] = [None] * len(numerators)
    for chunk, chosen in _chunks(numerators, experts, method):
        # One target's float64 copy at a time: all of them at once would weigh twice the sketches. A
        # chunk of one target keeps its copy from the Gram matrix to the product; larger chunks make it
        # again for the product (a d×r cast, against the two d×r² products).
        kept = None
        grams = []
        for index in chunk:
            kept = _blocks(numerators[index], experts[index])
            grams.append(kept.mT @ kept)
        roots = regularised_inverse_sqrt(torch.cat(grams), floor, chosen).split([experts[i] for i in chunk])
        for index, root in zip(chunk, roots):
            blocks = kept if len(chunk) == 1 else _blocks(numerators[index], experts[index])
            directions[index] = (blocks @ root).reshape(numerators[index].shape).to(numerators[index].dtype)
        del kept
    return directions


def _chunks(numerators: Sequence[torch.Tensor], experts: Sequence[int], method: str | None):
    """Targets in batches of one device and one ``r``, with the method for each: up to
    :data:`BATCH_BYTES` of Gram matrices for Newton–Schulz (its iterates are a few copies of them),
    :data:`EIGH_BATCH_BYTES` for eigh."""
    groups: dict[tuple, list[int]] = {}
    for index, numerator in enumerate(numerators):
        groups.setdefault((numerator.device, numerator.shape[-1]), []).append(index)
    for (device, r), indices in groups.items():
        chosen = method or ("newton-schulz" if device.type == "cuda" else "eigh")
        budget = max(1, (BATCH_BYTES if chosen == "newton-schulz" else EIGH_BATCH_BYTES) // (r * r * 8))
        chunk, blocks = [], 0
        for index in indices:
            if chunk and blocks + experts[index] > budget:
                yield chunk, chosen
                chunk, blocks = [], 0
            chunk.append(index)
            blocks += experts[index]
        yield chunk, chosen


def _blocks(numerator: torch.Tensor, experts: int) -> torch.Tensor:
    """``numerator`` in float64 as its ``experts`` blocks of rows: ``E × d × r``."""
    return numerator.double().reshape(experts, -1, numerator.shape[-1])


def orthogonal_direction(numerator: torch.Tensor, experts: int = 1, floor: float = POLAR_FLOOR) -> torch.Tensor:
    """:func:`orthogonal_directions` of one target."""
    return orthogonal_directions([numerator], [experts], floor)[0]


def regularised_inverse_sqrt(grams: torch.Tensor, floor: float, method: str = "eigh") -> torch.Tensor:
    """``(G + τ I)^-½`` of each symmetric PSD ``G`` in a ``B×r×r`` float64 batch, ``τ = floor² ·
    λ̂``; the identity for an all-zero ``G`` (whose zero ``N`` it maps to 0 either way).

    ``λ̂`` is :func:`largest_eigenvalue`'s estimate on either path, so that a CPU and a GPU compute one
    function: the eigendecomposition's exact ``λ_max`` would differ from it, and so would the floor.
    Newton–Schulz blocks that do not converge are recomputed by eigh, block by block."""
    eye = torch.eye(grams.shape[-1], dtype=grams.dtype, device=grams.device)
    zero = (grams == 0).flatten(1).all(dim=1).view(-1, 1, 1)
    grams = torch.where(zero, eye, grams)
    shift = torch.where(zero, 0.0, largest_eigenvalue(grams) * floor**2)
    if method == "newton-schulz":
        root, converged = _newton_schulz_inverse_sqrt(grams, shift, floor)
        if bool(converged.all()):
            return root
        failed = (~converged).nonzero().flatten()
        root[failed] = _eigh_inverse_sqrt(grams[failed], shift[failed])
        return root
    return _eigh_inverse_sqrt(grams, shift)


def _eigh_inverse_sqrt(grams: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    values, vectors = torch.linalg.eigh(grams)
    return (vectors * (values.clamp_min(0).unsqueeze(-1) + shift).rsqrt().mT) @ vectors.mT


def largest_eigenvalue(grams: torch.Tensor, iterations: int = POWER_ITERATIONS) -> torch.Tensor:
    """A ``B×1×1`` estimate of each ``G``'s largest eigenvalue: the Rayleigh quotient after
    ``iterations`` power iterations from one fixed pseudo-random vector (the same on every device).
    Never above ``λ_max``; exact to rounding where the largest stands apart from the next, and below
    it where many eigenvalues crowd the top (sketches of Gaussian-like gradients), by how much depends
    on the spectrum. At least 1e-300.

    The iterations run on ``G / tr G``, whose largest eigenvalue lies in ``[1/r, 1]``: the vector
    can neither overflow nor, for ``r`` below a million, underflow in float64 over 32 products, so
    it is normalised once at the end instead of after every product: one operation per iteration
    instead of four, where each is a matrix–vector product of ``r`` at most a few thousand, whose
    cost is mostly the call's."""
    batch, r, _ = grams.shape
    start = torch.rand(r, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.5
    trace = grams.diagonal(dim1=-2, dim2=-1).sum(-1).view(batch, 1, 1).clamp_min(1e-300)
    unit = grams / trace
    vector = start.to(grams.device).expand(batch, r, 1)
    for _ in range(iterations):
        vector = unit @ vector
    vector = vector / vector.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return (vector.mT @ unit @ vector * trace).clamp_min(1e-300)


def _newton_schulz_inverse_sqrt(
    grams: torch.Tensor, shift: torch.Tensor, floor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The coupled Newton–Schulz iteration ``T = (3I − Z Y)/2, Y ← Y T, Z ← T Z`` from ``Y = M/c``,
    ``Z = I``, with ``M = G + τ I`` (``shift``: ``τ``, ``B×1×1``) and ``c = ‖M‖_F ≥ λ_max(M)``:
    ``Z → (M/c)^-½``. Returns the root and which blocks converged.

    In the eigenbasis each eigenvalue ``m = λ/c`` of ``ZY`` follows ``m ← m (3 − m)²/4``: at least
    ×1.89 per step while ``m ≤ 1/4``, then quadratically to 1. ``τ`` bounds the smallest ``m`` from
    below, so the number of steps follows from ``floor`` and ``r``: 49 for ``1e-5`` at ``r = 256``,
    three batched products each. The count allows ``τ`` to rest on an estimate of ``λ_max`` ten times
    too small; a block it does not cover fails the residual check and goes to eigh."""
    batch, r, _ = grams.shape
    eye = torch.eye(r, dtype=grams.dtype, device=grams.device).expand(batch, r, r)
    shifted = grams + eye * shift
    scale = torch.linalg.matrix_norm(shifted).view(batch, 1, 1)
    smallest = floor**2 / (10.0 * math.sqrt(r) * (1.0 + floor**2))
    steps = math.ceil(math.log(0.25 / smallest) / math.log(1.89)) + 7
    y, z = shifted / scale, eye
    for _ in range(steps):
        t = 1.5 * eye - 0.5 * (z @ y)
        y, z = y @ t, t @ z
    residual = (z @ y - eye).abs().amax(dim=(1, 2))
    return z / scale.sqrt(), residual <= NEWTON_SCHULZ_TOLERANCE  # NaN fails too
