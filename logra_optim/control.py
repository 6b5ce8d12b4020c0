"""Predicted-KL step control (docs/method.md §3): how far each update may move the policy.

The optimizer proposes the update ``D = −η U A`` of every target; :class:`KLController` predicts
the KL divergence ``q`` that the unit step would cause on a few probe contexts (the latest training
sequences, or ones given explicitly) and scales it by ``α = min(α_max, sqrt(δ/q))`` so that the
predicted KL of the applied step is the budget ``δ`` (less the rollout/trainer mismatch ``κ``).
Optionally it measures the true KL after the merge and retries with a rescaled α.

The controller never touches weights itself: the optimizer hands it ``apply(α)`` and ``undo()``
for the realised-KL retry, so where a weight lives (replicated, sharded) stays the optimizer's
business.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from . import distributed as dp
from .caller import warn

from .kl import budget_at, effective_budget, floored_kl, mismatch_sample, mismatch_terms, retry_alpha, step_scale
from .options import KLOptions, positive
from .patching import TargetState
from .probe import (
    ContextRecorder,
    ProbeContexts,
    contexts_from_batch,
    default_logits_fn,
    finite_difference_predicted_kl,
    jvp_predicted_kl,
    realised_kl,
    subsample_positions,
)


NO_CONTEXTS = (
    "KL control has no probe contexts: none were recorded from a training forward "
    "(call model(input_ids=..., attention_mask=..., labels=...) in train mode before step()), "
    "or give them with optimizer.set_probe_contexts(input_ids, attention_mask, probe_mask, temperature)"
)


class UpdateSkipped(Exception):
    """A KL measurement was not finite: the update must not be applied. ``reason`` is a short tag
    for ``stats["skipped"]``."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class StepChoice:
    """α for one update, with what the realised-KL check needs to measure it again."""

    alpha: float
    stats: dict[str, Any]
    contexts: ProbeContexts | None = None
    base_logits: torch.Tensor | None = None
    budget: float = 0.0  # effective budget δ_eff
    update: int = 0
    represented_tokens: int = 0  # this rank's probe positions the contexts (a subset of them) stand for


class KLController:
    """Chooses the step scale α of every update and keeps the mismatch estimate ``κ``.

    Args:
        model: the patched model the probes run.
        options: validated :class:`~logra_optim.options.KLOptions`; ``budget=None`` gives α = 1.
        ranks: the data-parallel ranks (``None`` in one process): KL sums and token counts are summed
            over them, so that every rank chooses the same α from the token-weighted mean of all
            ranks' probe positions, and every rank keeps the same κ.
        fsdp2: the modules ``fully_shard`` was applied to, resharded after every probe forward (FSDP2
            keeps the root unsharded after a forward outside backward; a merge writes into the shards).
        stored_low_precision: some target weights are stored in 16 bits.
        bound: whether the optimizer is still bound to the model's targets; while it is not
            (:func:`~logra_optim.unpatch_model`), the model's forwards are not recorded.
    """

    def __init__(
        self,
        model: nn.Module,
        options: KLOptions,
        ranks: dp.DataParallel | None,
        fsdp2: Sequence[nn.Module] = (),
        stored_low_precision: bool = False,
        bound: Callable[[], bool] | None = None,
    ):
        self.model = model
        self.options = options
        self.logits_fn = options.probe_logits_fn or default_logits_fn
        self.mismatch = 0.0  # κ
        # With kl_floor: the probes' q of the latest updates (every rank's the same).
        self.recent_kl: collections.deque[float] = collections.deque(maxlen=options.kl_floor_window)
        self._ranks, self._fsdp2 = ranks, list(fsdp2)
        self._explicit: ProbeContexts | None = None
        self._warned_precision = False
        self._stored_low_precision = stored_low_precision  # already warned about at construction
        self._recorder = (
            ContextRecorder(model, options.probe_samples, options.temperature, bound) if options.enabled else None
        )

    def close(self) -> None:
        """Stop recording contexts from the model's forwards."""
        if self._recorder is not None:
            self._recorder.remove()

    # ----------------------------------------------------------------------------------------------
    # Inputs: probe contexts and the rollout/trainer mismatch

    def contexts(self) -> ProbeContexts:
        """The contexts the next probe runs on: the explicit ones, else the latest recorded.

        Across ranks, recorded contexts without a probe position still take part: the probe's
        forward and its sums are collectives (FSDP2 gathers the weights layer by layer), which a
        rank that raised alone would leave the others waiting in. Such a rank adds no term and no
        token; only when no rank has a position does every rank raise (:meth:`choose`)."""
        contexts = self._explicit or (self._recorder.latest if self._recorder else None)
        if contexts is None or (contexts.tokens == 0 and self._ranks is None):
            raise RuntimeError(NO_CONTEXTS)
        return contexts

    def set_contexts(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        probe_mask: torch.Tensor | None = None,
        temperature: float | None = None,
        completion_mask: torch.Tensor | None = None,
    ) -> None:
        """See :meth:`LoGRAOptimizer.set_probe_contexts <logra_optim.LoGRAOptimizer.set_probe_contexts>`."""
        temperature = positive("temperature", self.options.temperature if temperature is None else temperature)
        for name, mask in (
            ("attention_mask", attention_mask),
            ("probe_mask", probe_mask),
            ("completion_mask", completion_mask),
        ):
            if mask is not None and mask.shape != input_ids.shape:
                raise ValueError(
                    f"set_probe_contexts: {name} {tuple(mask.shape)} must have the shape of input_ids "
                    f"{tuple(input_ids.shape)} (aligned with the full prompt + completion sequence)"
                )
        input_ids = input_ids.detach().clone()
        attention_mask = None if attention_mask is None else attention_mask.detach().clone()
        if probe_mask is None:
            contexts = contexts_from_batch(
                input_ids, attention_mask, completion_mask=completion_mask, temperature=temperature
            )
        else:
            contexts = ProbeContexts(input_ids, attention_mask, probe_mask.detach().bool().clone(), temperature)
        if contexts.tokens == 0:
            raise ValueError("set_probe_contexts: no probe positions (the masks select no generated token)")
        self._explicit = contexts

    def observe_mismatch(
        self, rollout_logps: torch.Tensor, trainer_logps: torch.Tensor, mask: torch.Tensor | None = None
    ) -> float:
        """``κ ← (1−w) κ + w · sample`` from one batch of sampled tokens (the token mean over every
        rank's tokens, so that all ranks keep the same κ); returns κ."""
        if self._ranks is None:
            sample = mismatch_sample(rollout_logps, trainer_logps, mask)
        else:
            total, count = self._reduce(*mismatch_terms(rollout_logps, trainer_logps, mask))
            sample = max(0.0, total / count) if count > 0 else None
        if sample is not None:  # no finite, selected token: nothing learned about κ
            weight = self.options.mismatch_ema
            self.mismatch = (1.0 - weight) * self.mismatch + weight * sample
        return self.mismatch

    def _reduce(self, *values: float) -> list[float]:
        return [float(v) for v in values] if self._ranks is None else self._ranks.sum(*values)

    # ----------------------------------------------------------------------------------------------
    # Choosing α

    def choose(self, targets: Sequence[TargetState], factors: Sequence[torch.Tensor], update: int) -> StepChoice:
        """α for update ``update`` (1-based) whose unit step is ``D = −F A`` per target, probed on
        the contexts (at most ``probe_positions`` of their positions per rank, drawn with ``update``
        as the seed; ``probe_tokens`` in the stats counts the positions probed).

        Raises :class:`UpdateSkipped` if the predicted KL is not a finite non-negative number.
        """
        if not self.options.enabled:
            return StepChoice(1.0, {})
        options = self.options
        every = self.contexts()
        contexts = subsample_positions(every, options.probe_positions, update)
        budget = budget_at(options.budget, update)
        budget_eff = effective_budget(budget, self.mismatch)
        started = time.perf_counter()
        if options.probe == "jvp":
            total, tokens, base = jvp_predicted_kl(
                self.model,
                targets,
                factors,
                contexts,
                self.logits_fn,
                keep_base=options.realised_kl_check,
                compute_dtype=options.probe_dtype,
                words=options.probe_words,
                seed=update,
            )
        else:
            total, tokens, base = finite_difference_predicted_kl(
                self.model, targets, factors, contexts, self.logits_fn, options.fd_epsilon
            )
        dp.reshard(self._fsdp2)
        # Each rank's subset mean stands for all of its positions, so that ranks keep their token
        # weights in the mean over every rank's positions (as without a subset).
        represented = total if contexts is every else float(total) * every.tokens / tokens
        total, represented_tokens, tokens = self._reduce(represented, every.tokens, tokens)
        if represented_tokens == 0:  # only across ranks: one process raised in contexts()
            raise RuntimeError(f"{NO_CONTEXTS} (no rank's latest contexts hold a probe position)")
        tokens = int(tokens)
        q = total / max(represented_tokens, 1)
        if not math.isfinite(q) or q < 0:
            raise UpdateSkipped(f"predicted KL q={q} at update {update}", "probe")
        self._warn_if_low_precision(targets)
        # The floor applies once a full window of updates has been probed. q = 0 (a zero sketch,
        # e.g. a batch of equal rewards) gives α = min(1, α_max) as without a floor, and says nothing about the
        # scale of q, so it is not kept either.
        q_used = q
        if options.kl_floor is not None and q > 0:
            if len(self.recent_kl) == self.recent_kl.maxlen:
                q_used = floored_kl(q, self.recent_kl, options.kl_floor)
            self.recent_kl.append(q)
        alpha = step_scale(q_used, budget_eff, options.alpha_max)
        stats = {
            "predicted_kl": q,
            "predicted_kl_used": q_used,
            "predicted_step_kl": alpha**2 * q,
            "kl_budget": budget,
            "kl_budget_effective": budget_eff,
            "mismatch": self.mismatch,
            "probe_tokens": tokens,
            "probe_seconds": time.perf_counter() - started,
        }
        return StepChoice(alpha, stats, contexts, base, budget_eff, update, every.tokens)

    def _warn_if_low_precision(self, targets: Sequence[TargetState]) -> None:
        """Once, if the probe forward computed in 16 bits while the weights are stored wider (e.g.
        FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``): a realistic step changes the logits by
        less than their rounding, which the finite-difference probe and the realised-KL check would
        measure instead of the step. (16-bit storage is warned about at construction.)"""
        if self._warned_precision or not (self.options.probe == "finite_difference" or self.options.realised_kl_check):
            return
        low = {t.probe_compute_dtype for t in targets} & {torch.bfloat16, torch.float16}
        if low and not self._stored_low_precision:
            self._warned_precision = True
            warn(
                f"LoGRA: the KL probe's forward computed in {sorted(map(str, low))} although the target weights are "
                "stored in higher precision (e.g. FSDP2 MixedPrecisionPolicy(param_dtype=bf16)): the finite-difference "
                "probe and the realised-KL check compare logits whose rounding is of the size of a small step's "
                "change. Prefer probe='jvp' without realised_kl_check, or compute in fp32",
                RuntimeWarning,
            )

    def check_realised(self, choice: StepChoice, apply: Callable[[float], None], undo: Callable[[], None]) -> float:
        """After ``apply(choice.alpha)``: measure the true KL on the probe contexts; while it misses the
        budget by more than the tolerance (above it, or below it with room under ``alpha_max``),
        ``undo()`` and ``apply`` again with the α of :func:`~logra_optim.kl.retry_alpha` (rescaled by
        ``sqrt(δ_eff / realised)``, or interpolated within the bracket of measured safe and unsafe α).
        Returns the α finally applied; updates ``choice.stats``.

        If the last attempt overshoots, the largest α measured within the budget (if any) is applied
        again: a retry never trades a safe step for an unsafe one. Raises :class:`UpdateSkipped`
        (the caller undoes) if the measured KL is not finite.
        """
        options, stats, alpha = self.options, choice.stats, choice.alpha
        ceiling = choice.budget * (1.0 + options.realised_kl_tolerance)
        best_safe = None  # (α, realised KL) of the largest α measured within the budget
        lowest_unsafe = None  # (α, realised KL) of the smallest α measured above it
        for retry in range(options.realised_kl_retries + 1):
            total, tokens = realised_kl(self.model, choice.contexts, choice.base_logits, self.logits_fn)
            # Weighted across ranks as the prediction was (:meth:`choose`): each rank's subset of
            # positions stands for all of them.
            if tokens and choice.represented_tokens != tokens:
                total = float(total) * choice.represented_tokens / tokens
            total, tokens = self._reduce(total, choice.represented_tokens)
            dp.reshard(self._fsdp2)
            realised = total / max(tokens, 1)
            if not math.isfinite(realised):
                raise UpdateSkipped(f"realised KL {realised} at update {choice.update}", "realised_kl")
            stats.update(realised_kl=realised, realised_kl_retries=retry)
            if realised <= ceiling and (best_safe is None or alpha > best_safe[0]):
                best_safe = (alpha, realised)
            if realised > ceiling and (lowest_unsafe is None or alpha < lowest_unsafe[0]):
                lowest_unsafe = (alpha, realised)
            rescaled = retry_alpha(alpha, realised, choice.budget, options.alpha_max, best_safe, lowest_unsafe)
            on_budget = abs(realised / choice.budget - 1.0) <= options.realised_kl_tolerance
            if on_budget or rescaled == alpha or retry == options.realised_kl_retries:
                break
            undo()
            alpha = rescaled
            apply(alpha)
        if realised > ceiling and best_safe is not None:
            undo()
            alpha, realised = best_safe
            apply(alpha)
            stats["realised_kl"] = realised
        elif realised > ceiling:
            warn(
                f"LoGRA: realised KL {realised:.3g} exceeds the budget {choice.budget:.3g} after "
                f"{options.realised_kl_retries} retries",
                RuntimeWarning,
            )
        stats["alpha_after_check"] = alpha
        stats["predicted_step_kl"] = alpha**2 * stats["predicted_kl"]
        return alpha
