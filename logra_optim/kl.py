"""Predicted-KL step control (docs/method.md §3): the estimator, the step scale, budgets and mismatch.

For a proposed update ``D`` and scale ``α``, ``KL(π_θ ‖ π_{θ+αD}) ≈ α² q(D)`` with

    p = softmax(z/T),   ż = JVP of the logits along D,
    q(D) = 1/(2|P|T²) Σ_s Var_{v∼p(s)}[ż_v(s)],

the second-order expansion of the KL around α = 0 (its Hessian is the Fisher information of the
softmax). The controller picks ``α = min(α_max, sqrt(δ/q))`` so the update moves the policy by the
budget ``δ``. :func:`sampled_fisher_kl_terms` estimates ``q_s`` without bias from ``ż`` at a few
words per position (:func:`sample_words`), which spares the probe the tangent logits over the whole
vocabulary. Everything here is pure math on tensors; running the model lives in :mod:`.probe`.
"""

from __future__ import annotations

import math
import numbers
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# Positions per chunk of the float64 vocabulary math on an accelerator, where fewer, larger kernels win.
_POSITIONS_PER_CHUNK = 256
# Elements per float64 array of a chunk on a CPU: 8 MiB, so that a chunk's three arrays (z, ż, p)
# stay in a last-level cache while the math makes its ten or so passes over them. At a vocabulary
# of 32k this was 2.6-3.7x faster than 256 positions at a time, at 152k about 2x
# (benchmarks/results/kl-chunks/head_chunks.txt).
_CPU_CHUNK_ELEMENTS = 1 << 20


def fisher_kl_terms(logits: torch.Tensor, tangent: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-position ``q_s = ½ Σ_v p_v c_v²`` with ``c = ż/T − Σ_v p_v ż_v/T``, in float64.

    ``logits`` and ``tangent`` are ``(..., V)``; returns ``(...)``. The centred form (rather than
    ``E[ż²] − E[ż]²``) avoids cancellation when ``ż`` has a large common shift, which does not
    change the distribution.
    """

    def terms(z: torch.Tensor, centred: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(z, dim=-1)
        centred -= torch.einsum("sv,sv->s", p, centred).unsqueeze(-1)
        return 0.5 * torch.einsum("sv,sv->s", p, centred.square_())

    return _per_position(terms, logits, tangent, temperature)


@dataclass(frozen=True)
class WordSample:
    """The words at which :func:`sampled_fisher_kl_terms` reads each position's tangent: per position
    (row), its ``top`` most likely words, then ``samples`` words drawn from the rest in proportion to
    their probability (``indices``, ``n × (top + samples)``); the top words' probabilities
    (``top_probabilities``, ``n × top``) and the rest's total (``tail_mass``, ``n``), in float64."""

    indices: torch.Tensor
    top_probabilities: torch.Tensor
    tail_mass: torch.Tensor


def sample_words(logits: torch.Tensor, top: int, uniforms: torch.Tensor, temperature: float = 1.0) -> WordSample:
    """Per position of ``logits`` (``n × V``) its ``top`` most likely words, and one word per column of
    ``uniforms`` (``n × samples``, in [0, 1)) drawn from the others by inverse transform, ``p_v`` over
    their total. ``top ≥ V`` takes every word (and ignores ``uniforms``).

    In float64, a chunk of positions at a time (as the exact terms). Why sample at all: the exact term
    needs the tangent logits ``ż`` at every word, a second product with the output embedding and
    float64 arithmetic over ``n × V`` values; an estimate from a few words per position needs ``ż`` at
    those words only (a dot product each), which at a 150k-word vocabulary is most of the probe."""
    _check_temperature(temperature)
    rows, vocabulary = logits.shape
    top = min(top, vocabulary)
    samples = uniforms.shape[1] if top < vocabulary else 0
    if top < vocabulary and samples < 2:
        # Without draws the rest's share of the variance would be dropped, not estimated.
        raise ValueError(f"sample_words needs at least 2 sampled words (uniforms per position), got {samples}")
    indices = logits.new_empty((rows, top + samples), dtype=torch.long)
    top_probabilities = logits.new_empty((rows, top), dtype=torch.float64)
    tail_mass = logits.new_zeros(rows, dtype=torch.float64)
    step = positions_per_chunk(vocabulary, logits.device)
    for start in range(0, rows, step):
        chunk = slice(start, start + step)
        # The softmax in place: one float64 array per chunk (cumulative sums overwrite it too).
        p = _scaled_double(logits[chunk], temperature)
        p = p.sub_(p.amax(dim=-1, keepdim=True)).exp_()
        p = p.div_(p.sum(dim=-1, keepdim=True))
        top_probabilities[chunk], indices[chunk, :top] = p.topk(top, dim=-1)
        if samples:
            # The others' cumulative mass; "right" finds the first word whose mass lies above u·total,
            # never a top word (its mass is zeroed, so the cumulative sum stays flat there).
            cumulative = p.scatter_(-1, indices[chunk, :top], 0.0).cumsum_(dim=-1)
            tail_mass[chunk] = cumulative[:, -1]
            draws = uniforms[chunk].to(cumulative) * cumulative[:, -1:]
            indices[chunk, top:] = torch.searchsorted(cumulative, draws, right=True).clamp_max_(vocabulary - 1)
    return WordSample(indices, top_probabilities, tail_mass)


def sampled_fisher_kl_terms(sample: WordSample, tangent: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """An unbiased estimate of :func:`fisher_kl_terms` per position, from ``tangent`` = ``ż`` at
    ``sample.indices`` only (``n × (top + samples)``).

    ``Var_p(ż)`` splits into the top words, summed exactly, and the rest, whose first and second
    moments the samples estimate without bias (each drawn from ``p`` restricted to the rest, weighted
    by its mass ``P``). The square of the estimated mean is biased upwards by its variance,
    ``P² Var_rest(ż)/m`` for ``m`` samples; adding the samples' unbiased estimate of that term makes
    the whole unbiased. Exactly the exact terms (up to rounding) where the top words are all of the
    vocabulary. Moments are taken about each position's most likely word's ``ż`` (the variance does
    not depend on the shift), which keeps the difference of moments free of cancellation."""
    _check_temperature(temperature)
    top = sample.top_probabilities.shape[1]
    values = tangent.to(torch.float64) / temperature
    values = values - values[:, :1]
    head, rest = values[:, :top], values[:, top:]
    mean = torch.einsum("sv,sv->s", sample.top_probabilities, head)
    second = torch.einsum("sv,sv->s", sample.top_probabilities, head.square())
    correction = torch.zeros_like(mean)
    if rest.shape[1]:
        if rest.shape[1] < 2:
            raise ValueError(f"sampled_fisher_kl_terms needs at least 2 sampled words, got {rest.shape[1]}")
        mass = sample.tail_mass
        mean += mass * rest.mean(dim=1)
        second += mass * rest.square().mean(dim=1)
        correction = mass.square() * rest.var(dim=1) / rest.shape[1]
    return 0.5 * (second - mean.square()).clamp_min_(0.0) + 0.5 * correction


def exact_kl_terms(logits: torch.Tensor, perturbed_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-position full-vocabulary ``KL(softmax(z/T) ‖ softmax(z'/T))`` in float64."""

    def terms(z: torch.Tensor, z_perturbed: torch.Tensor) -> torch.Tensor:
        log_p = torch.log_softmax(z, dim=-1)
        return torch.einsum("sv,sv->s", log_p.exp(), log_p - torch.log_softmax(z_perturbed, dim=-1))

    return _per_position(terms, logits, perturbed_logits, temperature)


def _per_position(terms, first: torch.Tensor, second: torch.Tensor, temperature: float) -> torch.Tensor:
    """``terms(first/T, second/T)`` on fresh float64 copies, a chunk of positions at a time, so the
    float64 temporaries stay at ``chunk × vocab``."""
    _check_temperature(temperature)
    first_rows = first.reshape(-1, first.shape[-1])
    second_rows = second.reshape(-1, second.shape[-1])
    chunks = [torch.zeros(0, dtype=torch.float64, device=first.device)]
    step = positions_per_chunk(first_rows.shape[-1], first.device)
    for start in range(0, first_rows.shape[0], step):
        rows = slice(start, start + step)
        chunks.append(
            terms(_scaled_double(first_rows[rows], temperature), _scaled_double(second_rows[rows], temperature))
        )
    return torch.cat(chunks).reshape(first.shape[:-1])


def positions_per_chunk(vocabulary: int, device: torch.device) -> int:
    """Positions per chunk of the float64 vocabulary math: on a CPU as many as keep each array near
    8 MiB (cache-resident; at least one, at most 256), elsewhere 256. Either way the temporaries are
    bounded at ``chunk × vocabulary`` instead of ``positions × vocabulary``."""
    if device.type != "cpu":
        return _POSITIONS_PER_CHUNK
    return max(1, min(_POSITIONS_PER_CHUNK, _CPU_CHUNK_ELEMENTS // max(vocabulary, 1)))


def _scaled_double(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """``x / T`` as a fresh float64 tensor (one pass when T = 1)."""
    x = x.to(torch.float64, copy=True)
    return x if temperature == 1.0 else x.div_(temperature)


def floored_kl(predicted_kl: float, recent: Sequence[float], fraction: float) -> float:
    """``max(q, fraction · median(recent))``: the predicted KL of the unit step, floored at a fraction
    of its median over recent updates (``q`` itself while ``recent`` is empty).

    ``q`` comes from a few probed sequences. When they happen to be ones the step barely moves, ``q``
    drops far below its recent values and ``α = sqrt(δ/q)`` rises far above them, while the rest of
    the batch moves by much more than the budget; the floor caps α at ``1/sqrt(fraction)`` times what
    the recent median ``q`` would give (2× for ``fraction = 0.25``)."""
    if not recent:
        return predicted_kl
    return max(predicted_kl, fraction * statistics.median(recent))


def step_scale(predicted_kl: float, budget: float, alpha_max: float) -> float:
    """``α = min(α_max, sqrt(δ/q))``, and ``α = min(1, α_max)`` when ``q = 0`` (the update does not move the
    policy to second order, so there is nothing to scale against).

    KL is quadratic in α, hence the square root (the paper's text prints ``δ/q``).
    """
    if not math.isfinite(predicted_kl) or predicted_kl < 0:
        raise ValueError(f"predicted KL must be finite and ≥ 0, got {predicted_kl!r}")
    if predicted_kl == 0.0:
        return min(1.0, alpha_max)
    return min(alpha_max, math.sqrt(budget / predicted_kl))


def retry_alpha(
    alpha: float,
    realised: float,
    budget: float,
    alpha_max: float,
    largest_safe: tuple[float, float] | None = None,
    smallest_unsafe: tuple[float, float] | None = None,
) -> float:
    """The α of the realised-KL check's next try, after ``alpha`` moved the contexts by ``realised``;
    ``largest_safe`` / ``smallest_unsafe``: ``(α, realised KL)`` of the largest try measured within
    the budget's ceiling and of the smallest above it, if any.

    KL grows as α², so ``α sqrt(δ/realised)`` would land on the budget if the curvature held (at
    most ``alpha_max``). Where it does not (KL steeper than α², as when a token changes experts),
    that rescale can return to an α already measured unsafe, or below one measured safe: for ``KL
    = α⁴`` two tries alternate for ever. Once both kinds have been measured, the next α is
    interpolated between them in ``log KL`` against ``log α`` (exact for any power of α), and the
    bracket's geometric mean replaces an interpolation that does not fall strictly inside it.
    """
    if largest_safe is None or smallest_unsafe is None:
        return min(alpha_max, alpha * math.sqrt(budget / realised)) if realised > 0 else alpha
    (low, low_kl), (high, high_kl) = largest_safe, smallest_unsafe
    guess = math.sqrt(low * high)
    if 0 < low_kl < high_kl and low < high:
        power = math.log(high_kl / low_kl) / math.log(high / low)
        guess = low * (budget / low_kl) ** (1.0 / power)
    return guess if low < guess < high else math.sqrt(low * high)


@dataclass(frozen=True)
class CosineBudget:
    """The paper's schedule: ``δ_u = δ_min + ½(δ_max − δ_min)(1 + cos(π · min((u−1)/(H−1), 1)))``.

    Falls from ``delta_max`` at update 1 to ``delta_min`` at update ``horizon``, then holds.
    Defaults are the authors' main runs (2e-4 → 2e-5 over 300 updates).
    """

    delta_max: float = 2e-4
    delta_min: float = 2e-5
    horizon: int = 300

    def __post_init__(self):
        for name in ("delta_max", "delta_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
                raise ValueError(f"CosineBudget: {name} must be a positive finite number, got {value!r}")
        if isinstance(self.horizon, bool) or not isinstance(self.horizon, int) or self.horizon < 1:
            raise ValueError(f"CosineBudget: horizon must be an integer ≥ 1, got {self.horizon!r}")

    def __call__(self, update: int) -> float:
        progress = 1.0 if self.horizon == 1 else min((update - 1) / (self.horizon - 1), 1.0)
        return self.delta_min + 0.5 * (self.delta_max - self.delta_min) * (1.0 + math.cos(math.pi * max(progress, 0.0)))


def budget_at(kl_budget: float | Callable[[int], float], update: int) -> float:
    """``δ_u`` for update ``u`` (1-based) from a constant or a schedule; validated."""
    value = kl_budget(update) if callable(kl_budget) else kl_budget
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"kl_budget must be a positive number (or a schedule returning one); got {value!r} at update {update}"
        )
    return float(value)


def mismatch_sample(
    rollout_logps: torch.Tensor, trainer_logps: torch.Tensor, mask: torch.Tensor | None = None
) -> float | None:
    """``max(0, mean[log π_rollout(a) − log π_trainer(a)])`` over masked tokens: a Monte-Carlo
    estimate of KL(rollout ‖ trainer) from tokens the rollout engine sampled.

    Tokens whose log-probabilities are not finite are left out (vLLM reports NaN where it returned
    no log-prob). Returns ``None`` when no token is left, so the estimate is not dragged to zero.
    """
    total, count = mismatch_terms(rollout_logps, trainer_logps, mask)
    if count == 0:
        return None
    return max(0.0, total / count)


def mismatch_terms(
    rollout_logps: torch.Tensor, trainer_logps: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[float, int]:
    """``(Σ[log π_rollout(a) − log π_trainer(a)], count)`` over the masked tokens with finite
    log-probabilities: the parts of :func:`mismatch_sample`, which data-parallel ranks sum."""
    if rollout_logps.shape != trainer_logps.shape:
        raise ValueError(
            f"rollout_logps {tuple(rollout_logps.shape)} and trainer_logps {tuple(trainer_logps.shape)} differ in shape"
        )
    difference = rollout_logps.double() - trainer_logps.double()
    valid = torch.isfinite(difference)
    if mask is not None:
        if mask.shape != difference.shape:
            raise ValueError(f"mask {tuple(mask.shape)} does not match the log-probs {tuple(difference.shape)}")
        valid &= mask.bool()
    count = int(valid.sum())
    return (float(difference[valid].sum()) if count else 0.0), count


def effective_budget(budget: float, mismatch: float) -> float:
    """``δ_eff = max(δ_u − κ, ½ δ_u)``: the rollout policy already differs from the trainer by κ."""
    return max(budget - mismatch, 0.5 * budget)


def _check_temperature(temperature: float) -> None:
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
