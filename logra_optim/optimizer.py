"""``LoGRAOptimizer``: bookkeeping around the pure functions of :mod:`.updates` and :mod:`.kl`.

The optimizer binds to a model patched by :func:`~logra_optim.patch_model`. It owns the sketch
buffers and the projections of the targets (regenerated from the seed and the update index, never
stored), turns the accumulated sketches into directions, chooses the step (predicted-KL control)
and merges ``W ← W − α η U A`` into the weights. Its ``param_groups`` hold the target weights so
that torch LR schedulers work unchanged; its state is tensors, numbers and strings only.
"""

from __future__ import annotations

import itertools
import math
import numbers
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from . import distributed as dp
from .kl import budget_at, effective_budget, mismatch_sample, mismatch_terms, step_scale
from .patching import TargetState, patched_modules
from .probe import (
    ContextRecorder,
    LogitsFn,
    ProbeContexts,
    contexts_from_batch,
    default_logits_fn,
    finite_difference_predicted_kl,
    jvp_predicted_kl,
    realised_kl,
)
from .projection import PROJECTIONS, make_projection, projection_seed
from .sketch import SketchBank
from .sync import TargetUpdate, Update
from .target import Target
from .updates import low_rank_sq_norm, merge_low_rank_, relative_step_size, rowadam_direction

OPTIMIZERS = ("rowadam", "sgd")
PROBES = ("jvp", "finite_difference")
DEFAULT_UPDATE_RATIO = 6e-5


def _positive(name: str, value: float) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


class LoGRAOptimizer(torch.optim.Optimizer):
    """Low-rank gradient-sketch optimizer for a model patched with :func:`patch_model`.

    Args:
        model: the patched model (not its parameters).
        rank: sketch rank ``r``; at most every target's in and out size.
        kl_budget: predicted-KL budget ``δ`` per update: a number, a schedule ``f(update) -> δ``
            (e.g. :class:`~logra_optim.kl.CosineBudget`), or ``None`` to turn KL control off (α = 1).
        optimizer: ``"rowadam"`` (row second moment, METHOD.md §2) or ``"sgd"`` (``U = S``).
        update_ratio: relative update norm ``ρ_upd``: ``η = ρ_upd · sqrt(Σ‖W‖²/Σ‖UA‖²)`` so that
            ``‖ΔW‖/‖W‖ = ρ_upd`` at α = 1. Default 6e-5 (the paper's) unless ``lr`` is given. Stored
            as the group's ``"lr"``, so LR schedulers scale it.
        lr: plain learning-rate mode instead: ``W ← W − lr · α · U A``, no normalisation.
        seed: base seed of the projections.
        projection: ``"rademacher"`` (±1/√r) or ``"gaussian"`` (N(0, 1/r)).
        refresh: draw a new ``A`` after every applied update (default) or keep a fixed basis.
        alpha_max: upper bound on the step scale α chosen by KL control.
        beta2, eps: RowAdam's second-moment decay and relative ε.
        wire_dtype: round ``F = α η U`` to this dtype before merging (default bf16, as the authors
            do), so the trainer merges exactly the factor a rollout engine is sent; ``None`` keeps fp32.
        stochastic_rounding: for bf16 weight storage, round merged weights stochastically so tiny
            updates survive on average (fp32 master weights are recommended).
        non_target_optimizer: ``callable(params) -> torch.optim.Optimizer`` for non-target
            parameters left trainable (``requires_grad=True``); stepped and zeroed with this one.
            ``"external"``: another optimizer updates them (e.g. a DeepSpeed engine's own).
        probe: ``"jvp"`` (exact forward-mode AD, one forward) or ``"finite_difference"``
            (``KL(θ ‖ θ+εD)/ε²``, two forwards, exact full-vocabulary KL).
        probe_samples: sequences of the latest training forward used as probe contexts.
        temperature: sampling temperature ``T`` of the policy (for recorded contexts).
        probe_logits_fn: ``f(model, contexts) -> logits`` for models whose forward does not
            return logits directly (default: ``model(input_ids, attention_mask).logits``).
        fd_epsilon: step ``ε`` of the finite-difference probe, as a multiple of ``D``.
        realised_kl_check: after merging, measure the true KL on the probe contexts; if it misses
            the budget by more than ``realised_kl_tolerance`` (relative, either way), undo the merge
            exactly (from a host copy of the targets) and retry with α rescaled by
            ``sqrt(δ/realised)``, at most ``realised_kl_retries`` times.
        mismatch_ema: EMA weight of the rollout/trainer mismatch ``κ`` (see :meth:`observe_mismatch`).
        process_group: the data-parallel group sketches are averaged over (default: the world group
            when ``torch.distributed`` runs several ranks). Every rank then computes the same update and
            merges it into the part of each weight it stores (replicated, FSDP2 row shard, ZeRO-3
            partition); ``step()``, the constructor, ``load_state_dict`` and ``observe_mismatch`` are
            collective calls.
    """

    def __init__(
        self,
        model: nn.Module,
        rank: int = 256,
        kl_budget: float | Callable[[int], float] | None = None,
        *,
        optimizer: str = "rowadam",
        update_ratio: float | None = None,
        lr: float | None = None,
        seed: int = 0,
        projection: str = "rademacher",
        refresh: bool = True,
        alpha_max: float = 3.0,
        beta2: float = 0.95,
        eps: float = 1e-8,
        wire_dtype: torch.dtype | None = torch.bfloat16,
        stochastic_rounding: bool = True,
        non_target_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
        probe: str = "jvp",
        probe_samples: int = 2,
        temperature: float = 1.0,
        probe_logits_fn: LogitsFn | None = None,
        fd_epsilon: float = 1.0,
        realised_kl_check: bool = False,
        realised_kl_tolerance: float = 0.1,
        realised_kl_retries: int = 3,
        mismatch_ema: float = 0.3,
        process_group: Any = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(
                "LoGRAOptimizer takes the patched model, e.g. LoGRAOptimizer(patch_model(model)), "
                f"not {type(model).__name__}"
            )
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            raise ValueError(f"rank must be a positive integer, got {rank!r}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        if projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {projection!r}")
        if update_ratio is not None and lr is not None:
            raise ValueError("give either update_ratio (relative update norm) or lr (plain learning rate), not both")
        if lr is not None:
            lr, lr_mode = _positive("lr", lr), "lr"
        else:
            lr = _positive("update_ratio", DEFAULT_UPDATE_RATIO if update_ratio is None else update_ratio)
            lr_mode = "update_ratio"
        if kl_budget is not None and not callable(kl_budget):
            kl_budget = _positive("kl_budget", kl_budget)
        if probe not in PROBES:
            raise ValueError(f"probe must be one of {PROBES}, got {probe!r}")
        if not isinstance(probe_samples, int) or probe_samples < 1:
            raise ValueError(f"probe_samples must be a positive integer, got {probe_samples!r}")
        _positive("temperature", temperature)
        _positive("fd_epsilon", fd_epsilon)
        _positive("realised_kl_tolerance", realised_kl_tolerance)
        if not isinstance(realised_kl_retries, int) or realised_kl_retries < 0:
            raise ValueError(f"realised_kl_retries must be a non-negative integer, got {realised_kl_retries!r}")
        if not 0.0 < mismatch_ema <= 1.0:
            raise ValueError(f"mismatch_ema must be in (0, 1], got {mismatch_ema!r}")
        if realised_kl_check and kl_budget is None:
            raise ValueError("realised_kl_check needs a kl_budget to check against")
        if isinstance(non_target_optimizer, str) and non_target_optimizer != "external":
            raise ValueError(
                f"non_target_optimizer must be a callable, 'external' or None, got {non_target_optimizer!r}"
            )
        if realised_kl_check and callable(non_target_optimizer):
            raise ValueError(
                "realised_kl_check cannot be combined with non_target_optimizer: the measured KL would include "
                "the non-target update, which the retry can neither undo nor rescale"
            )
        alpha_max = _positive("alpha_max", alpha_max)
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"beta2 must be in [0, 1), got {beta2!r}")
        _positive("eps", eps)
        if wire_dtype is not None and not (isinstance(wire_dtype, torch.dtype) and wire_dtype.is_floating_point):
            raise ValueError(f"wire_dtype must be a floating torch.dtype or None, got {wire_dtype!r}")

        targets = patched_modules(model)
        if not targets:
            raise ValueError("LoGRAOptimizer: the model has no LoGRA targets; call patch_model(model) first")
        dp.check_no_fsdp1(model)
        layouts = [dp.weight_layout(name, module.weight) for name, module in targets]
        if kl_budget is not None and probe == "jvp" and any(layout.kind == dp.FLAT for layout in layouts):
            raise ValueError(
                "the JVP probe cannot run under DeepSpeed ZeRO-3: its module hooks wrap every output in an autograd "
                "Function without a forward-mode rule. Use probe='finite_difference' (with fd_epsilon large enough "
                "to be resolved, e.g. 1.0)"
            )
        for (name, module), layout in zip(targets, layouts):
            _check_target(name, module, rank, layout.shape)
        low_precision = any(m.weight.dtype in (torch.bfloat16, torch.float16) for _, m in targets)
        if kl_budget is not None and low_precision and (probe == "finite_difference" or realised_kl_check):
            warnings.warn(
                "16-bit target weights: the finite-difference probe and the realised-KL check compare logits "
                "whose rounding error is of the size of a small step's change; prefer probe='jvp' and fp32 "
                "master weights",
                stacklevel=2,
            )

        self._model = model
        self._targets: list[TargetState] = [m._logra for _, m in targets]
        self._modules: list[nn.Linear] = [m for _, m in targets]
        self._layouts = layouts
        self._target_views = tuple(
            Target(m._logra.canonical_name, m, layout) for (_, m), layout in zip(targets, layouts)
        )
        self._index_of = {id(m.weight): i for i, m in enumerate(self._modules)}
        self._group = dp.data_parallel_group(process_group)
        self._fsdp2 = dp.fsdp2_modules(model)
        self._merged_factors: dict[int, torch.Tensor] = {}  # the latest merge's F per ZeRO-3 target
        self._merge_hooks: OrderedDict[int, Callable[[LoGRAOptimizer, Update], None]] = OrderedDict()
        self._sent_factors: dict[int, torch.Tensor] = {}  # the latest merge's F per target, while hooks listen
        defaults = dict(lr=lr, lr_mode=lr_mode, optimizer=optimizer, beta2=beta2, eps=eps)
        super().__init__([m.weight for m in self._modules], defaults)

        target_weights = set(self._index_of)
        others = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in target_weights]
        if others and non_target_optimizer is None:
            names = ", ".join(n for n, _ in others[:8]) + (" …" if len(others) > 8 else "")
            raise ValueError(
                f"parameters that are not LoGRA targets require grad ({names}) but nothing would update "
                "them: freeze them, or pass non_target_optimizer=lambda params: torch.optim.AdamW(params, ...)"
            )
        external = non_target_optimizer == "external"
        self.non_target_optimizer = non_target_optimizer([p for _, p in others]) if others and not external else None

        self.rank = rank
        self.seed = int(seed)
        self.projection = projection
        self.refresh = bool(refresh)
        self.wire_dtype = wire_dtype
        self.stochastic_rounding = bool(stochastic_rounding)
        self.kl_budget = kl_budget
        self.alpha_max = alpha_max
        self.probe = probe
        self.probe_logits_fn = probe_logits_fn or default_logits_fn
        self.fd_epsilon = float(fd_epsilon)
        self.realised_kl_check = bool(realised_kl_check)
        self.realised_kl_tolerance = float(realised_kl_tolerance)
        self.realised_kl_retries = realised_kl_retries
        self.mismatch_ema = float(mismatch_ema)
        self.update_index = 0  # applied updates so far
        self.mismatch = 0.0  # κ
        self.nonfinite_skips = 0
        self.probe_skips = 0
        self.stats: dict[str, Any] = {}
        self._explicit_contexts: ProbeContexts | None = None
        self._recorder = ContextRecorder(model, probe_samples, temperature) if kl_budget is not None else None
        self._warned_eval_mode = False

        self._bank = SketchBank(
            [(layout.shape[0], rank) for layout in layouts], [m.weight.device for m in self._modules]
        )
        for target, sketch in zip(self._targets, self._bank.views):
            target.sketch = sketch
            target.owner = weakref.ref(self)
        self._checksums: list[float] = []
        self._regenerate_projections()
        if self._group is not None:
            self._check_consistency()
        # When the optimizer goes away the patched layers return to plain forwards (no sketch work,
        # no A or S kept alive) and the context recorder leaves the model.
        weakref.finalize(self, _release, self._targets, self._recorder)

    # ----------------------------------------------------------------------------------------------
    # Projections, sketches, probe inputs

    @property
    def model(self) -> nn.Module:
        """The patched model this optimizer drives."""
        return self._model

    @property
    def targets(self) -> tuple[Target, ...]:
        """Read-only views of the targets, in module order: name, module, weight, layout."""
        return self._target_views

    def projection_seed(self, index: int) -> int:
        """Seed of target ``index``'s current projection ``A`` (what a rollout engine regenerates it from)."""
        return projection_seed(self.seed, self.projection_index, self._targets[index].canonical_name)

    @property
    def projection_index(self) -> int:
        """Index the current ``A`` is drawn with: update u (1-based) uses u−1; 0 for a fixed basis."""
        return self.update_index if self.refresh else 0

    def projection_for(self, index: int, update_index: int | None = None) -> torch.Tensor:
        """Regenerate ``A`` of target ``index`` (fp32, on its weight's device)."""
        weight, target = self._modules[index].weight, self._targets[index]
        seed = projection_seed(
            self.seed, self.projection_index if update_index is None else update_index, target.canonical_name
        )
        return make_projection(seed, self.rank, self._layouts[index].shape[1], self.projection, device=weight.device)

    def _regenerate_projections(self) -> None:
        for index, target in enumerate(self._targets):
            target.set_projection(self.projection_for(index))
        if self._group is not None:
            self._checksums = [dp.projection_checksum(target.projection) for target in self._targets]

    # ----------------------------------------------------------------------------------------------
    # Data parallelism (see :mod:`.distributed`)

    def _fingerprint_header(self) -> tuple:
        return (self.seed, self.projection_index, self.rank, self.projection, self.refresh, len(self._targets))

    def _fingerprint(self) -> int:
        return dp.fingerprint(self._fingerprint_header(), self._checksums)

    def _check_consistency(self, gathered: torch.Tensor | None = None) -> None:
        """Fail loudly on every rank if the ranks' projections differ (seeds, update index, targets)."""
        if gathered is None:
            gathered = dp.gather_([self._fingerprint()], self._group, self._collective_device)[:, 0]
        names = [target.canonical_name for target in self._targets]
        dp.check_fingerprints(gathered, self._group, names, self._fingerprint_header(), self._checksums)

    @property
    def _collective_device(self) -> torch.device:
        return dp.collective_device(self._group)

    def _synchronise(self) -> tuple[bool, list[float]]:
        """Average the sketches over the ranks (one all-reduce per flat buffer), then one all-gather of
        ``[fingerprint, local non-finite flag, Σ‖W‖² of the locally stored part of sharded weights per
        group]``. Returns (all finite on every rank, per-group sharded ‖W‖² totals)."""
        dp.average_(self._bank.flat_buffers(), self._group)
        partials = []
        for group in self.param_groups:
            parts = []
            for weight in group["params"]:
                layout = self._layouts[self._index_of[id(weight)]]
                if group["lr_mode"] == "update_ratio" and layout.holders > 0:  # a sharded weight
                    parts.append(dp.local_sq_norm(weight, layout) / layout.holders)
            partials.append(_total(parts))
        local_finite = self._local_all_finite()
        gathered = dp.gather_(
            [self._fingerprint(), 0.0 if local_finite else 1.0, *partials], self._group, self._collective_device
        )
        self._check_consistency(gathered[:, 0])
        totals = gathered[:, 2:].sum(dim=0).tolist()
        return bool(gathered[:, 1].sum() == 0), totals

    def _reduce(self, *values: float) -> list[float]:
        """Sum scalars over the ranks (identity in a single process)."""
        if self._group is None:
            return [float(v) for v in values]
        return dp.sum_(values, self._group, self._collective_device)

    def sketch_buffers(self) -> list[torch.Tensor]:
        """The flat fp32 buffers holding every sketch (one per device), e.g. for an all-reduce."""
        return self._bank.flat_buffers()

    def set_probe_contexts(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        probe_mask: torch.Tensor | None = None,
        temperature: float | None = None,
        *,
        completion_mask: torch.Tensor | None = None,
    ) -> None:
        """Give the KL probe its contexts explicitly (they replace the recorded ones until changed).

        ``probe_mask[b, t]`` marks positions whose logits predict a generated token; without it,
        positions are chosen from ``attention_mask`` and ``completion_mask`` (aligned with
        ``input_ids``). ``temperature`` defaults to the optimizer's.
        """
        if temperature is None:
            temperature = self._recorder.temperature if self._recorder else 1.0
        _positive("temperature", temperature)
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
            contexts = ProbeContexts(input_ids, attention_mask, probe_mask.detach().bool().clone(), float(temperature))
        if contexts.tokens == 0:
            raise ValueError("set_probe_contexts: no probe positions (the masks select no generated token)")
        self._explicit_contexts = contexts

    def observe_mismatch(
        self, rollout_logps: torch.Tensor, trainer_logps: torch.Tensor, mask: torch.Tensor | None = None
    ) -> float:
        """Feed log-probs of sampled tokens from the rollout engine and the trainer (same tokens,
        ``mask`` selecting generated tokens of completed responses). Updates and returns
        ``κ ← (1−w) κ + w · max(0, mean(log π_rollout − log π_trainer))`` (w = ``mismatch_ema``);
        the next update's budget becomes ``max(δ − κ, δ/2)``."""
        if self._group is None:
            sample = mismatch_sample(rollout_logps, trainer_logps, mask)
        else:  # the token mean over every rank's tokens: all ranks keep the same κ
            total, count = self._reduce(*mismatch_terms(rollout_logps, trainer_logps, mask))
            sample = max(0.0, total / count) if count > 0 else None
        if sample is not None:  # no finite, selected token: nothing learned about κ
            self.mismatch = (1.0 - self.mismatch_ema) * self.mismatch + self.mismatch_ema * sample
        return self.mismatch

    def _probe_contexts(self) -> ProbeContexts:
        contexts = self._explicit_contexts or self._recorder.latest
        if contexts is None or contexts.tokens == 0:
            raise RuntimeError(
                "KL control has no probe contexts: none were recorded from a training forward "
                "(call model(input_ids=..., attention_mask=..., labels=...) in train mode before step()), "
                "or give them with optimizer.set_probe_contexts(input_ids, attention_mask, probe_mask, temperature)"
            )
        return contexts

    # ----------------------------------------------------------------------------------------------
    # torch.optim.Optimizer API

    def register_merge_hook(self, hook: Callable[[LoGRAOptimizer, Update], None]) -> RemovableHandle:
        """Call ``hook(optimizer, update)`` after every applied update with exactly what was merged:
        per target the HF parameter name, the projection seed and ``F = α η U`` (wire dtype). This is
        what a rollout engine needs (:mod:`.sync`). Returns a handle whose ``remove()`` detaches it."""
        handle = RemovableHandle(self._merge_hooks)
        self._merge_hooks[handle.id] = hook
        return handle

    def _merged_update(self) -> Update:
        """The update just merged (called before the update counter advances)."""
        targets = tuple(
            TargetUpdate(
                name=target.canonical_name + ".weight",
                seed=projection_seed(self.seed, self.projection_index, target.canonical_name),
                in_features=self._layouts[index].shape[1],
                factor=self._sent_factors[index],
            )
            for index, target in enumerate(self._targets)
        )
        return Update(self.update_index + 1, targets)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the sketches (and the non-target optimizer's gradients)."""
        self._bank.zero_()
        super().zero_grad(set_to_none=set_to_none)
        if self.non_target_optimizer is not None:
            self.non_target_optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Merge ``W ← W − α η U A`` for every target, then refresh ``A`` and clear the sketches.

        The sketches are cleared because they are expressed in the basis ``A`` that was just
        replaced. A non-finite sketch, or a non-finite predicted or realised KL, skips the update:
        weights and optimizer state stay untouched, a warning is issued and a counter in ``stats``
        records it.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        started = time.perf_counter()
        # A forward outside backward (evaluation, generation) can leave FSDP2's root unsharded; the
        # merge writes into the shards, which the next forward must gather again.
        dp.reshard(self._fsdp2)
        sharded_sq = None
        if self._group is not None:
            finite, sharded_sq = self._synchronise()
        else:
            finite = self._bank.all_finite() and self._local_all_finite()
        if not finite:
            self.nonfinite_skips += 1
            why = f"non-finite sketch (or non-target gradient) at update {self.update_index + 1}"
            self._skip(why, "nonfinite_sketch")
            return loss

        if not self._warned_eval_mode and not any(m.training for m in self._modules) and self._bank.all_zero():
            self._warned_eval_mode = True
            warnings.warn(
                "LoGRA: step() with empty sketches while the model is in eval mode: patched layers accumulate "
                "sketches only in train mode with grad enabled; call model.train() before the training forward",
                RuntimeWarning,
                stacklevel=2,
            )

        plans = [
            self._plan(group, None if sharded_sq is None else sharded_sq[i])
            for i, group in enumerate(self.param_groups)
        ]
        alpha, kl_stats, probe_result = 1.0, {}, None
        if self.kl_budget is not None:
            chosen = self._choose_alpha(plans)
            if chosen is None:
                return loss
            alpha, kl_stats, probe_result = chosen
        # Only once the update is certain; the predicted KL covers the targets' update alone.
        if self.non_target_optimizer is not None:
            self.non_target_optimizer.step()

        backup = None
        if self.kl_budget is not None and self.realised_kl_check:
            backup = self._backup()
        self._merge(plans, alpha)
        if backup is not None:
            try:
                alpha = self._check_realised_kl(plans, alpha, backup, probe_result, kl_stats)
            except BaseException:
                self._restore(backup)  # leave no half-applied update behind
                raise
            if alpha is None:
                return loss

        for _, entries, _ in plans:
            for module, _, _, new_state in entries:
                self.state[module.weight].update(new_state)
        update = self._merged_update() if self._merge_hooks else None
        self._sent_factors = {}
        self.update_index += 1
        self._merged_factors.clear()
        if self.refresh:
            self._regenerate_projections()
        self._bank.zero_()
        self.stats = {
            "alpha": alpha,
            "eta": plans[0][2],
            **kl_stats,
            "step_seconds": time.perf_counter() - started,
            **self._counters(),
        }
        # Last: the step is complete whatever a hook does.
        for hook in list(self._merge_hooks.values()) if update is not None else ():
            hook(self, update)
        return loss

    def _local_all_finite(self) -> bool:
        """Non-target gradients on this rank (FSDP2 shards: the local part)."""
        if self.non_target_optimizer is None:
            return True
        grads = [p.grad for g in self.non_target_optimizer.param_groups for p in g["params"] if p.grad is not None]
        grads = [grad.to_local() if dp.is_dtensor(grad) else grad for grad in grads]
        return all(bool(torch.isfinite(grad).all()) for grad in grads)

    def _local(self, index: int) -> torch.Tensor:
        """The part of target ``index``'s weight this rank stores (see :func:`.distributed.local_data`)."""
        return dp.local_data(self._modules[index].weight, self._layouts[index])

    def _gathered_copy(self, index: int) -> torch.Tensor | None:
        """A ZeRO-3 target's whole matrix while DeepSpeed holds it gathered (persistent small
        parameters, or ones its prefetcher keeps between forwards), else ``None``. A merge updates
        it together with the partition: the next forward uses it without gathering again."""
        weight, layout = self._modules[index].weight, self._layouts[index]
        if layout.kind == dp.FLAT and weight.data.numel() == layout.shape[0] * layout.shape[1]:
            return weight.data.view(layout.shape)
        return None

    def _backup(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Host copies of every target's local part (and of a ZeRO-3 gathered copy)."""
        backup = []
        for index in range(len(self._modules)):
            gathered = self._gathered_copy(index)
            backup.append(
                (self._local(index).to("cpu", copy=True), None if gathered is None else gathered.to("cpu", copy=True))
            )
        return backup

    def _plan(self, group: dict, sharded_sq: float | None = None):
        """``(group, [(module, target, U, state to commit)], η)``; mutates nothing. ``sharded_sq``:
        Σ‖W‖² of the group's sharded weights, summed over the ranks (distributed runs only)."""
        entries, weight_sq, update_sq = [], [], []
        for weight in group["params"]:
            index = self._index_of[id(weight)]
            module, target = self._modules[index], self._targets[index]
            direction, new_state = self._direction(group, weight, target.sketch)
            entries.append((module, target, direction, new_state))
            if group["lr_mode"] == "update_ratio":
                if sharded_sq is None or self._layouts[index].holders == 0:  # whole weight on this rank
                    weight_sq.append(
                        torch.linalg.vector_norm(self._local(index), dtype=torch.float32).double().square()
                    )
                update_sq.append(low_rank_sq_norm(direction, target.projection))
        if group["lr_mode"] == "lr":
            return group, entries, group["lr"]
        eta = relative_step_size(group["lr"], _total(weight_sq) + (sharded_sq or 0.0), _total(update_sq))
        return group, entries, eta

    def _direction(self, group: dict, weight: torch.Tensor, sketch: torch.Tensor):
        """``U`` for one target and the state it would commit (nothing is mutated here)."""
        state = self.state.get(weight, {})
        step = state.get("step", torch.tensor(0.0)) + 1
        if group["optimizer"] == "sgd":
            # U aliases the sketch: safe because every use (η, probe, merge) precedes zeroing it.
            return sketch, {"step": step}
        moment = state.get("row_second_moment")
        if moment is None:
            moment = torch.zeros(sketch.shape[0], dtype=torch.float32, device=sketch.device)
        direction, moment = rowadam_direction(sketch, moment, int(step), group["beta2"], group["eps"])
        return direction, {"step": step, "row_second_moment": moment}

    def _choose_alpha(self, plans):
        """Predicted-KL control: ``(α, stats, (contexts, base logits, δ_eff))`` with
        ``α = min(α_max, sqrt(δ_eff / q))``; ``None`` if the probe failed (step skipped)."""
        contexts = self._probe_contexts()
        budget = budget_at(self.kl_budget, self.update_index + 1)
        budget_eff = effective_budget(budget, self.mismatch)
        targets = [target for _, entries, _ in plans for _, target, _, _ in entries]
        factors = [direction * eta for _, entries, eta in plans for _, _, direction, _ in entries]
        started = time.perf_counter()
        if self.probe == "jvp":
            total, tokens, base = jvp_predicted_kl(
                self._model, targets, factors, contexts, self.probe_logits_fn, keep_base=self.realised_kl_check
            )
        else:
            total, tokens, base = finite_difference_predicted_kl(
                self._model, targets, factors, contexts, self.probe_logits_fn, self.fd_epsilon
            )
        dp.reshard(self._fsdp2)
        total, tokens = self._reduce(total, tokens)  # token-weighted mean over every rank's positions
        tokens = int(tokens)
        q = total / max(tokens, 1)
        if not math.isfinite(q) or q < 0:
            self.probe_skips += 1
            self._skip(f"predicted KL q={q} at update {self.update_index + 1}", "probe")
            return None
        alpha = step_scale(q, budget_eff, self.alpha_max)
        return (
            alpha,
            {
                "predicted_kl": q,
                "predicted_step_kl": alpha**2 * q,
                "kl_budget": budget,
                "kl_budget_effective": budget_eff,
                "mismatch": self.mismatch,
                "probe_tokens": tokens,
                "probe_seconds": time.perf_counter() - started,
            },
            (contexts, base, budget_eff),
        )

    def _merge(self, plans, alpha: float) -> None:
        for _, entries, eta in plans:
            for module, target, direction, _ in entries:
                index = self._index_of[id(module.weight)]
                layout, local = self._layouts[index], self._local(index)
                factor = direction * (alpha * eta)
                if self.wire_dtype is not None:
                    factor = factor.to(self.wire_dtype)
                generator = None
                if local.dtype == torch.bfloat16 and self.stochastic_rounding:
                    generator = torch.Generator(device=local.device)
                    generator.manual_seed(
                        projection_seed(self.seed, self.update_index, "rounding/" + target.canonical_name)
                    )
                options = dict(stochastic_rounding=self.stochastic_rounding, generator=generator)
                if layout.kind == dp.FLAT:  # only a ZeRO-3 restore may need to undo it (see _restore)
                    self._merged_factors[index] = factor
                if self._merge_hooks:
                    self._sent_factors[index] = factor.contiguous()
                gathered = self._gathered_copy(index)
                if gathered is not None:  # ZeRO-3 holds it whole too: update that, the partition is its slice
                    merge_low_rank_(gathered, factor, target.projection, **options)
                    local.copy_(gathered.view(-1)[layout.start : layout.stop])
                elif layout.kind == dp.FLAT:
                    dp.merge_flat_partition_(local, layout.start, factor, target.projection, **options)
                elif layout.kind == dp.ROWS:
                    merge_low_rank_(local, factor[layout.start : layout.stop], target.projection, **options)
                else:
                    merge_low_rank_(local, factor, target.projection, **options)

    def _check_realised_kl(self, plans, alpha: float, backup, probe_result, kl_stats: dict) -> float | None:
        """Measure the true KL after the merge; while it misses the budget by more than the
        tolerance (above it, or below it with room under ``alpha_max``), undo exactly and retry
        with α rescaled by ``sqrt(δ_eff / realised)``. Returns the α finally applied, or ``None``
        (weights restored) when the measured KL is not finite.

        If the last attempt overshoots, the largest α measured within the budget (if any) is
        merged again: a retry never trades a safe step for an unsafe one.
        """
        contexts, base, budget_eff = probe_result
        ceiling = budget_eff * (1.0 + self.realised_kl_tolerance)
        best_safe = None  # (α, realised KL) of the largest α measured within the budget
        for retry in range(self.realised_kl_retries + 1):
            total, tokens = self._reduce(*realised_kl(self._model, contexts, base, self.probe_logits_fn))
            dp.reshard(self._fsdp2)
            realised = total / max(tokens, 1)
            if not math.isfinite(realised):
                self._restore(backup)
                self.probe_skips += 1
                self._skip(f"realised KL {realised} at update {self.update_index + 1}", "realised_kl")
                return None
            kl_stats.update(realised_kl=realised, realised_kl_retries=retry)
            if realised <= ceiling and (best_safe is None or alpha > best_safe[0]):
                best_safe = (alpha, realised)
            # KL grows as α²: this rescale would land on the budget if the curvature held.
            rescaled = min(self.alpha_max, alpha * math.sqrt(budget_eff / realised)) if realised > 0 else alpha
            on_budget = abs(realised / budget_eff - 1.0) <= self.realised_kl_tolerance
            if on_budget or rescaled == alpha or retry == self.realised_kl_retries:
                break
            self._restore(backup)
            alpha = rescaled
            self._merge(plans, alpha)
        if realised > ceiling and best_safe is not None:
            self._restore(backup)
            alpha, realised = best_safe
            self._merge(plans, alpha)
            kl_stats["realised_kl"] = realised
        elif realised > ceiling:
            warnings.warn(
                f"LoGRA: realised KL {realised:.3g} exceeds the budget {budget_eff:.3g} after "
                f"{self.realised_kl_retries} retries",
                RuntimeWarning,
                stacklevel=3,
            )
        kl_stats["alpha_after_check"] = alpha
        kl_stats["predicted_step_kl"] = alpha**2 * kl_stats["predicted_kl"]
        return alpha

    def _restore(self, backup) -> None:
        for index, (local, gathered_backup) in enumerate(backup):
            self._local(index).copy_(local)
            gathered = self._gathered_copy(index)
            if gathered is None:
                continue
            if gathered_backup is not None:
                gathered.copy_(gathered_backup)
            else:  # gathered by DeepSpeed since the backup, from the merged partitions: undo the merge
                factor = self._merged_factors[index]
                merge_low_rank_(gathered, -factor, self._targets[index].projection, stochastic_rounding=False)
                layout = self._layouts[index]
                gathered.view(-1)[layout.start : layout.stop] = local  # this rank's part exactly

    def _skip(self, why: str, reason: str) -> None:
        warnings.warn(
            f"LoGRA: {why}; update skipped, weights and optimizer state unchanged", RuntimeWarning, stacklevel=3
        )
        self.zero_grad()
        self.stats = {"skipped": reason, **self._counters()}

    def _counters(self) -> dict[str, Any]:
        return {
            "update_index": self.update_index,
            "nonfinite_skips": self.nonfinite_skips,
            "probe_skips": self.probe_skips,
        }

    # ----------------------------------------------------------------------------------------------
    # Checkpointing

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus ``"logra"`` (update index, seed, projection, κ, counters).

        Only tensors, numbers and strings: loadable with ``torch.load(weights_only=True)``. Every
        target has an entry, zeros before its first update (equivalent to none), so that formats
        which load into a template (``torch.distributed.checkpoint``) find all of them.
        """
        state = super().state_dict()
        weights = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        indices = itertools.chain.from_iterable(g["params"] for g in state["param_groups"])
        rowadam = itertools.chain.from_iterable(
            [g["optimizer"] == "rowadam"] * len(g["params"]) for g in self.param_groups
        )
        for weight, param_index, has_moment in zip(weights, indices, rowadam):
            if param_index not in state["state"]:
                state["state"][param_index] = {"step": torch.tensor(0.0)}
                if has_moment:
                    sketch = self._targets[self._index_of[id(weight)]].sketch
                    state["state"][param_index]["row_second_moment"] = torch.zeros(
                        sketch.shape[0], device=sketch.device
                    )
        state["logra"] = {
            "update_index": self.update_index,
            "seed": self.seed,
            "rank": self.rank,
            "projection": self.projection,
            "refresh": self.refresh,
            "mismatch": self.mismatch,
            "nonfinite_skips": self.nonfinite_skips,
            "probe_skips": self.probe_skips,
        }
        if self.non_target_optimizer is not None:
            state["non_target"] = self.non_target_optimizer.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: restores state and counters and regenerates ``A`` for the saved update index,
        so training continues bit-identically."""
        state_dict = dict(state_dict)
        logra = state_dict.pop("logra", None)
        non_target = state_dict.pop("non_target", None)
        if logra is None:
            raise ValueError("not a LoGRAOptimizer state_dict: the 'logra' section is missing")
        if int(logra["rank"]) != self.rank:
            raise ValueError(f"state_dict was saved with rank={logra['rank']}, this optimizer has rank={self.rank}")
        if (non_target is None) != (self.non_target_optimizer is None):
            raise ValueError("state_dict and optimizer disagree on whether a non_target_optimizer is used")
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter's dtype; the row moments stay fp32.
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for index, weight in enumerate(params):
            saved = state_dict["state"].get(index, {})
            if "row_second_moment" in saved:
                self.state[weight]["row_second_moment"] = saved["row_second_moment"].to(weight.device, torch.float32)
        if non_target is not None:
            self.non_target_optimizer.load_state_dict(non_target)
        self.update_index = int(logra["update_index"])
        self.seed = int(logra["seed"])
        self.projection = str(logra["projection"])
        self.refresh = bool(logra["refresh"])
        self.mismatch = float(logra["mismatch"])
        self.nonfinite_skips = int(logra["nonfinite_skips"])
        self.probe_skips = int(logra["probe_skips"])
        self._bank.zero_()
        self._regenerate_projections()
        if self._group is not None:
            self._check_consistency()

    def __repr__(self) -> str:
        group = self.param_groups[0]
        return (
            f"LoGRAOptimizer(targets={len(self._targets)}, rank={self.rank}, optimizer={group['optimizer']!r}, "
            f"{group['lr_mode']}={group['lr']}, projection={self.projection!r}, kl_budget={self.kl_budget})"
        )


def _check_target(name: str, module: nn.Linear, rank: int, shape: tuple[int, int]) -> None:
    d, k = shape
    if rank > min(d, k):
        raise ValueError(f"rank={rank} is larger than target {name!r} allows ({d}×{k}: rank must be ≤ {min(d, k)})")
    owner = module._logra.owner() if module._logra.owner is not None else None
    if owner is not None:
        raise RuntimeError(
            f"target {name!r} is already driven by another LoGRAOptimizer; one optimizer per patched model "
            "(delete the old one, or unpatch_model + patch_model for a fresh start)"
        )
    if module.weight.requires_grad:
        raise ValueError(f"target {name!r} has requires_grad=True; LoGRA targets must stay frozen")
    if module.weight.dtype == torch.float16:
        warnings.warn(
            f"target {name!r} is stored in float16: updates below half an ulp are lost. "
            "Keep fp32 master weights (or bf16, which is stochastically rounded).",
            stacklevel=3,
        )


def _total(values: list[torch.Tensor]) -> float:
    """Sum of scalar tensors with one host sync per device (targets may sit on several devices)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for value in values:
        by_device.setdefault(value.device, []).append(value)
    return sum(float(torch.stack(group).sum()) for group in by_device.values())


def _release(targets: list[TargetState], recorder: ContextRecorder | None) -> None:
    for target in targets:
        target.set_projection(None)
        target.sketch = None
        target.owner = None
    if recorder is not None:
        recorder.remove()
