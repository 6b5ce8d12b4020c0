"""Orthogonal directions: the polar factor of each target's ``d×r`` direction, all targets at once.

``U = N (NᵀN + τ I)^-½`` with ``τ = (floor · σ_max)²``: ``N``'s singular vectors, its singular
values ``σ`` set to ``σ / sqrt(σ² + (floor σ_max)²)``, which is 1 to within ``floor²/2`` for the
directions that carry the sketch and ``≈ σ / (floor σ_max)`` for those at its rounding noise.

Only the ``r×r`` Gram matrices need the inverse square root, and every target of a model has the
same ``r``, so they are stacked and computed in one batch. On a CPU by a float64 eigendecomposition
(LAPACK's is fast at these sizes); on a GPU by a coupled Newton–Schulz iteration in float64,
matrix products only. cuSOLVER's eigendecomposition of a 256×256 matrix takes about 2 ms and does
not batch at that size: 0.11 s per update for the 56 targets of an 8-layer Qwen2.5-1.5B on an H200,
against 0.49 s for the optimizer's whole step (docs/benchmarks.md, "On a GPU"). Both paths compute
the same function (``tests/test_polar.py``).
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
# stays near 1e-13); a batch that does not is recomputed by eigh.
_NEWTON_SCHULZ_TOLERANCE = 1e-9
POWER_ITERATIONS = 32  # for τ: 1 ms of launches on a GPU, 39 ms for 28 targets at r = 256 on 2 CPU cores


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
    # One target's float64 copy at a time: all of them at once would weigh twice the sketches.
    grams = [_blocks(n, e).mT @ _blocks(n, e) for n, e in zip(numerators, experts)]
    groups: dict[tuple, list[int]] = {}
    for index, gram in enumerate(grams):
        groups.setdefault((gram.device, gram.shape[-1]), []).append(index)
    inverse_roots: list[torch.Tensor] = list(grams)
    for (device, _), indices in groups.items():
        chosen = method or ("newton-schulz" if device.type == "cuda" else "eigh")
        stacked = regularised_inverse_sqrt(torch.cat([grams[i] for i in indices]), floor, chosen)
        for index, root in zip(indices, stacked.split([experts[i] for i in indices])):
            inverse_roots[index] = root
    return [
        (_blocks(n, e) @ root).reshape(n.shape).to(n.dtype)
        for n, e, root in zip(numerators, experts, inverse_roots, strict=True)
    ]


def _blocks(numerator: torch.Tensor, experts: int) -> torch.Tensor:
    """``numerator`` in float64 as ``experts`` blocks of its rows: ``E × d × r``."""
    return numerator.double().reshape(experts, -1, numerator.shape[-1])


def orthogonal_direction(numerator: torch.Tensor, experts: int = 1, floor: float = POLAR_FLOOR) -> torch.Tensor:
    """:func:`orthogonal_directions` of one target."""
    return orthogonal_directions([numerator], [experts], floor)[0]


def regularised_inverse_sqrt(grams: torch.Tensor, floor: float, method: str = "eigh") -> torch.Tensor:
    """``(G + τ I)^-½`` of each symmetric PSD ``G`` in a ``B×r×r`` float64 batch, ``τ = floor² ·
    λ̂``. An all-zero ``G`` gives a finite (large) result, which its zero ``N`` maps to 0.

    ``λ̂`` is :func:`largest_eigenvalue`'s estimate on either path, so that a CPU and a GPU compute one
    function: the eigendecomposition's exact ``λ_max`` would differ from it by up to a few percent,
    and so would the floor."""
    shift = largest_eigenvalue(grams) * floor**2
    if method == "newton-schulz":
        root = _newton_schulz_inverse_sqrt(grams, shift, floor)
        if root is not None:
            return root
    values, vectors = torch.linalg.eigh(grams)
    return (vectors * (values.clamp_min(0).unsqueeze(-1) + shift).rsqrt().mT) @ vectors.mT


def largest_eigenvalue(grams: torch.Tensor, iterations: int = POWER_ITERATIONS) -> torch.Tensor:
    """A ``B×1×1`` estimate of each ``G``'s largest eigenvalue: the Rayleigh quotient after
    ``iterations`` power iterations from ``G``'s column of largest diagonal. Never above ``λ_max``;
    below it by a few percent at most where many eigenvalues crowd near the top (sketches of
    Gaussian-like gradients), by rounding where the largest stands apart. At least 1e-300."""
    batch, r, _ = grams.shape
    start = grams.diagonal(dim1=-2, dim2=-1).argmax(dim=-1)
    vector = grams.gather(-1, start.view(batch, 1, 1).expand(batch, r, 1))
    for _ in range(iterations):
        vector = grams @ vector
        vector = vector / vector.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return (vector.mT @ grams @ vector).clamp_min(1e-300)


def _newton_schulz_inverse_sqrt(grams: torch.Tensor, shift: torch.Tensor, floor: float) -> torch.Tensor | None:
    """The coupled Newton–Schulz iteration ``T = (3I − Z Y)/2, Y ← Y T, Z ← T Z`` from ``Y = M/c``,
    ``Z = I``, with ``M = G + τ I`` (``shift``: ``τ``, ``B×1×1``) and ``c = ‖M‖_F ≥ λ_max(M)``:
    ``Z → (M/c)^-½``. ``None`` if it has not converged (the caller falls back to eigh).

    In the eigenbasis each eigenvalue ``m = λ/c`` of ``ZY`` follows ``m ← m (3 − m)²/4``: at least
    ×1.89 per step while ``m ≤ 1/4``, then quadratically to 1. ``τ`` bounds the smallest ``m`` from
    below, so the number of steps follows from ``floor`` and ``r``: 49 for ``1e-5`` at ``r = 256``,
    three batched products each. The count allows ``τ`` to rest on an estimate of ``λ_max`` ten times
    too small."""
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
    residual = float((z @ y - eye).abs().amax()) if batch else 0.0
    if not residual <= _NEWTON_SCHULZ_TOLERANCE:  # NaN too
        return None
    return z / scale.sqrt()
