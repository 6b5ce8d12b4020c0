"""Float64 references: each formula of the method transcribed literally, once, for every test that
checks the implementation against it (docs/method.md §1 sketch, §2 RowAdam / step size / merge, §3 KL).

They favour the obvious form over the careful one (dense products, no chunking, no guards against
zero rows): only the inputs the tests give them need to work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

U32 = 2.0**-24  # unit roundoff of fp32
U16 = 2.0**-8  # unit roundoff of bf16 (8 significant bits)


# ------------------------------------------------------------------------------------------------
# §1 The sketch


def dense_gradient(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``G = gᵀ x`` (d×k) from output gradients ``g`` (n×d) and inputs ``x`` (n×k)."""
    return g.double().t() @ x.double()


def dense_sketch(g: torch.Tensor, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``S = G Aᵀ`` (d×r), with ``G`` formed densely."""
    return dense_gradient(g, x) @ a.double().t()


# ------------------------------------------------------------------------------------------------
# §2 Directions, step size, merge


def rowadam_step(
    sketch: torch.Tensor, moment: torch.Tensor, step: int, beta2: float = 0.95, eps: float = 1e-8, numerator=None
):
    """RowAdam at step ``t``: ``(U_t, v_t)`` from ``S_t`` and ``v_{t−1}``; the direction normalises
    ``numerator`` (default ``S_t``) row by row."""
    s = sketch.double()
    n = s if numerator is None else numerator.double()
    v = beta2 * moment.double() + (1 - beta2) * (s**2).mean(dim=1)
    rho = torch.sqrt(v / (1 - beta2**step))
    den = rho + eps * rho.mean()
    u = n / den[:, None]
    return u * (torch.linalg.norm(n) / torch.linalg.norm(u)), v


def momentum_step(sketch: torch.Tensor, moment: torch.Tensor, step: int, beta1: float):
    """``(M̂_t, M_t)``: ``M_t = β1 M_{t−1} + (1−β1) S_t`` and its bias correction."""
    m = beta1 * moment.double() + (1 - beta1) * sketch.double()
    return m / (1 - beta1**step), m


def carried(moment: torch.Tensor, old_projection: torch.Tensor, new_projection: torch.Tensor) -> torch.Tensor:
    """The least-squares ``M'`` with ``M' A_new ≈ M A_old`` (row by row), by ``lstsq`` in float64."""
    target = (moment.double() @ old_projection.double()).t()  # k×d
    return torch.linalg.lstsq(new_projection.double().t(), target, driver="gelsd").solution.t()


def polar(numerator: torch.Tensor, floor: float = 1e-5) -> torch.Tensor:
    """The polar factor ``P Qᵀ`` of ``N = P Σ Qᵀ`` by a float64 SVD, with its floor: ``N``'s singular
    values ``σ`` set to ``σ / sqrt(σ² + (floor · σ_max)²)`` (docs/method.md §2)."""
    left, singular, right = torch.linalg.svd(numerator.double(), full_matrices=False)
    shift = (floor * singular.max().clamp_min(1e-150)) ** 2
    return (left * (singular / (singular.square() + shift).sqrt())) @ right


def direction(
    optimizer: str, sketch: torch.Tensor, moment: torch.Tensor, step: int, beta2=0.95, eps=1e-8, numerator=None
):
    """``(U, v)`` of ``optimizer`` ("sgd": ``U = numerator`` or ``S``, the moment unused;
    "orthogonal": :func:`polar` of it, the moment unused; "rowadam": :func:`rowadam_step`)."""
    if optimizer == "sgd":
        return (sketch if numerator is None else numerator).double(), moment
    if optimizer == "orthogonal":
        return polar(sketch if numerator is None else numerator), moment
    return rowadam_step(sketch, moment, step, beta2, eps, numerator)


def step_sizes(
    ratio: float,
    weights: Sequence[torch.Tensor],
    directions: Sequence[torch.Tensor],
    projections: Sequence,
    scope: str = "target",
) -> list[float]:
    """``η_i`` of ``update_ratio`` mode: ``ρ · ‖W_i‖/‖U_i A_i‖`` per target (``scope="target"``) or
    ``ρ · sqrt(Σ‖W‖² / Σ‖U A‖²)`` for all (``"model"``)."""
    w_sq = [float(w.double().square().sum()) for w in weights]
    u_sq = [float((u.double() @ a.double()).square().sum()) for u, a in zip(directions, projections)]
    if scope == "model":
        return [ratio * math.sqrt(sum(w_sq) / sum(u_sq))] * len(w_sq)
    return [ratio * math.sqrt(w / u) for w, u in zip(w_sq, u_sq)]


def merged(weight: torch.Tensor, factor: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """``W − F A``."""
    return weight.double() - factor.double() @ projection.double()


def relative_update_norm(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]) -> float:
    """``‖ΔW‖ / ‖W‖`` over all the given weights together (what ``update_ratio`` sets)."""
    delta_sq = sum(float((b.double() - a.double()).square().sum()) for a, b in zip(before, after))
    return math.sqrt(delta_sq / sum(float(a.double().square().sum()) for a in before))


def bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two bf16 values around fp32 ``x`` (toward zero, away from zero), as float64."""
    toward_zero = (x.view(torch.int32) & -65536).view(torch.float32)
    away = ((x.view(torch.int32) & -65536) + 65536).view(torch.float32)
    return toward_zero.double(), away.double()


# ------------------------------------------------------------------------------------------------
# §3 KL


def fisher_quadratic_form(logits: torch.Tensor, tangent: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per position ``q = ½ żᵀ (diag p − p pᵀ) ż / T²``, ``p = softmax(z/T)``: the second-order KL
    of moving the logits along ``ż`` (the Hessian of the KL is the softmax Fisher information)."""
    logits, tangent = logits.double(), tangent.double()
    p = torch.softmax(logits / temperature, -1)
    fisher = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    return 0.5 * torch.einsum("sv,svw,sw->s", tangent, fisher, tangent) / temperature**2


def kl_divergence(logits: torch.Tensor, other: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per position ``KL(softmax(z/T) ‖ softmax(z'/T)) = Σ_v p_v (log p_v − log p'_v)``."""
    log_p = torch.log_softmax(logits.double() / temperature, -1)
    log_q = torch.log_softmax(other.double() / temperature, -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


@torch.no_grad()
def measured_kl(model_before, model_after, contexts, temperature: float | None = None) -> float:
    """The true KL between two models, mean over the probe positions of ``contexts`` (at its
    temperature unless given): measured independently of the optimizer's own bookkeeping."""
    before = model_before(input_ids=contexts.input_ids).logits[contexts.probe_mask]
    after = model_after(input_ids=contexts.input_ids).logits[contexts.probe_mask]
    return float(kl_divergence(before, after, contexts.temperature if temperature is None else temperature).mean())
