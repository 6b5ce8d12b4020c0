"""``LoGRAOptimizer``: the bookkeeping of a LoGRA update around pure functions.

The optimizer binds to a model patched by :func:`~logra_optim.patch_model`. It owns the sketch
buffers and what determines the targets' projections (seed, rank, width, kind: ``A`` itself is
generated where it is used, in the forward, the probe, the step size and the merge, and never
stored) and runs one update per ``step()``: sketches → directions ``U`` (:mod:`.updates`) → step
size ``η`` → step scale α (:mod:`.control`) → merge ``W ← W − α η U A`` into wherever each weight
lives (:mod:`.distributed`). Its one param group holds the target weights so that torch LR
schedulers work unchanged; its state is tensors, numbers and strings only.
"""

from __future__ import annotations

import functools
import math
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from . import distributed as dp
from .caller import warn
from .control import KLController, UpdateSkipped
from .options import (
    KLOptions,
    StepOptions,
    check_non_target_optimizer,
    check_targets,
    refuse_fp16_storage,
    direction_option,
    param_group_defaults,
    upgrade_param_group,
)
from .patching import TargetState, patched_targets, target_state
from .probe import LogitsFn, outside_autocast
from .projection import GENERATOR, ProjectionSpec, projection_key, projection_seed
from .sketch import SharedProjection, SketchBank, generated
from .sync import TargetUpdate, Update, rounding_seed
from .target import Target
from .polar import POLAR_FLOOR, POLAR_FLOOR_16BIT
from .updates import (
    all_finite,
    basis_change,
    carry_first_moment,
    idle_still,
    low_rank_sq_norm,
    next_directions,
    step_sizes,
)


@dataclass
class TargetStep:
    """One target's share of an update: its direction ``U``, step size ``η`` and the optimizer state
    it commits."""

    index: int
    direction: torch.Tensor
    state: dict[str, torch.Tensor]
    eta: float = 0.0

    def factor(self, alpha: float = 1.0) -> torch.Tensor:
        """``F = α η U``."""
        return self.direction * (alpha * self.eta)


@dataclass
class StepPlan:
    """An update before it is applied: every target's direction and step size."""

    steps: list[TargetStep]
    polar_floor: float  # the orthogonal directions' floor, kept once the update is committed

    def factors(self) -> list[torch.Tensor]:
        """``F = η U`` per target: the unit step (α = 1) the KL probe measures."""
        return [step.factor() for step in self.steps]

    def finite(self) -> bool:
        """Every direction, step size and state to commit is finite. A finite sketch can still give
        a non-finite plan: SGD's direction is the sketch itself, and a huge one overflows the fp32
        Gram of ``‖U A‖²``, whose inf against the projection Gram's zeros is NaN, and so is ``η``;
        RowAdam's fp32 row moment overflows (its direction then comes out zero, and the inf moment
        would zero every later one). Every rank computes the same plan from the same averaged
        sketches, so every rank decides alike."""
        tensors = [step.direction for step in self.steps]
        tensors += [value for step in self.steps for value in step.state.values() if isinstance(value, torch.Tensor)]
        return all(math.isfinite(step.eta) for step in self.steps) and all_finite(tensors)

    @property
    def mean_eta(self) -> float:
        return sum(step.eta for step in self.steps) / max(1, len(self.steps))


class LoGRAOptimizer(torch.optim.Optimizer):
    """Low-rank gradient-sketch optimizer for a model patched with :func:`patch_model`.

    Args:
        model: the patched model (not its parameters).
        rank: sketch rank ``r``; at most every target's in and out size.
        expert_rank: sketch rank of stacked mixture-of-experts weights (default: ``rank``). Their
            sketches are ``E·d × r``, often the bulk of the sketch memory of a MoE model, and each
            expert sees only its routed tokens: a lower rank than attention's usually suits them.
        kl_budget: predicted-KL budget ``δ`` per update: a number, a schedule ``f(update) -> δ``
            (e.g. :class:`~logra_optim.kl.CosineBudget`), or ``None`` to turn KL control off (α = 1).
        direction: ``"orthogonal"`` (default: the polar factor of the first moment, or of the
            sketch without one: its singular values set to 1, so every direction the sketch sees
            moves the weights equally; no state beyond the first moment; it learned better than
            RowAdam on both toy policies and in the demo, docs/benchmarks.md), ``"rowadam"`` (one
            second moment per output row, docs/method.md §2; the former default, which a checkpoint
            saved with it keeps) or ``"sgd"``
            (``U = S``).
            (``optimizer=`` is the deprecated name of this option.)
        update_ratio: relative update norm ``ρ_upd``: at α = 1 every target moves by
            ``‖ΔW_i‖/‖W_i‖ = ρ_upd`` (``η_i = ρ_upd ‖W_i‖/‖U_i A_i‖``). Default 6e-5 (the paper's)
            unless ``lr`` is given. Stored as the group's ``"lr"``, so LR schedulers scale it.
        ratio_scope: ``"target"`` (default: ``ρ_upd`` per target, see
            :func:`~logra_optim.updates.step_sizes` for why) or ``"model"`` (one ``η`` for all
            targets, ``‖ΔW‖/‖W‖ = ρ_upd`` over all of them together: the rule before 0.3).
        lr: plain learning-rate mode instead: ``W ← W − lr · α · U A``, no normalisation.
        seed: base seed of the projections.
        projection: ``"rademacher"`` (±1/√r) or ``"gaussian"`` (N(0, 1/r)).
        refresh: draw new projections during training (default) or keep a fixed basis.
        refresh_every: with ``refresh``, draw a new ``A`` every this many applied updates (default
            10; the paper draws one after every update: 1). Between draws the updates share one
            basis, in which the first moment is exact.
        share_projections: one ``A`` for the siblings that read the same input (``q/k/v_proj``,
            ``gate/up_proj``; :data:`~logra_optim.projection.SHARED_INPUT_SIBLINGS`), so that ``x Aᵀ``
            is computed and saved once for them (default); each keeps its own unbiased sketch.
            ``False``: one ``A`` per target, as in the paper.
        alpha_max: upper bound on the step scale α chosen by KL control.
        beta1: decay of a first moment kept in sketch space (``d×r`` per target, like the sketch);
            default 0.9. A GRPO batch's gradient is mostly noise, and averaging over batches, as
            Adam does, is what brought LoGRA level with AdamW on the same weights in the demo
            (docs/benchmarks.md). 0 builds each direction from the latest sketch alone (the
            paper's rule, with ``refresh_every=1``). When ``A`` is redrawn the moment is carried
            into the new basis by least squares (:func:`~logra_optim.updates.basis_change`), which
            keeps little of it for an independent draw: keep ``refresh_every > 1`` with it. Coherent
            steps add up their KL, so a first moment wants a smaller ``kl_budget`` than one without.
        beta2, eps: RowAdam's second-moment decay and relative ε.
        wire_dtype: round ``F = α η U`` to this dtype before merging (default bf16, as the authors
            do), so the trainer merges exactly the factor a rollout engine is sent; ``None`` keeps fp32.
        stochastic_rounding: for bf16 weight storage, round merged weights stochastically so tiny
            updates survive on average (fp32 master weights are recommended).
        non_target_optimizer: ``callable(params) -> torch.optim.Optimizer`` for non-target
            parameters left trainable (``requires_grad=True``); stepped and zeroed with this one, but
            not scheduled by an LR scheduler built on this one (give it its own).
            ``"external"``: another optimizer updates them (e.g. a DeepSpeed engine's own).
        probe: ``"jvp"`` (exact forward-mode AD, one forward) or ``"finite_difference"``
            (``KL(θ ‖ θ+εD)/ε²``, two forwards, exact full-vocabulary KL).
        probe_samples: sequences of the latest training forward used as probe contexts, spread
            evenly over its batch (a batch grouped by prompt is not probed on one prompt alone).
        probe_positions: probe at most this many of those sequences' positions, a uniform random
            subset drawn afresh at every update (reproducibly: seeded by the update index), and
            only the sequences that keep one; default ``None``: all. The probe's LM head and its
            vocabulary arithmetic scale with the positions, its decoder with the sequences, so this
            bounds what a long completion or a large vocabulary costs. ``q`` is a mean over
            positions, which the subset estimates without bias (each rank's for all its positions),
            but ``α ∝ q̂^-½`` then overshoots the budget on average, more for smaller subsets
            (docs/benchmarks.md measures it); ``realised_kl_check`` measures on the same subset.
        probe_words: estimate each probed position's KL term from this many words of the
            vocabulary (at least 4): its most likely half exactly, the other half drawn from the rest
            in proportion to their probability (reproducibly: seeded by the update index), an
            unbiased estimate. The JVP probe's LM head then multiplies the primal only, and reads
            the tangent at these words by a dot product each, instead of a second product with the
            whole head and float64 arithmetic over every word. Default ``"auto"``: 64 words from a
            vocabulary of 8192 words on, every word below it. ``None``: every word (as with a
            vocabulary of at most ``probe_words`` words, or a head the probe cannot apply in chunks).
            An explicit count needs the JVP probe without ``realised_kl_check`` or
            ``probe_logits_fn``, which read the logits over every word.
        probe_dtype: ``None`` (the probe computes in the weights' precision) or ``torch.bfloat16``:
            the matrix products of the JVP probe's linear layers are bf16 (through one reusable
            bf16 copy of the weight being multiplied; the LM head cast once per probe), everything else keeps
            the weights' precision, the low-rank tangent term is fp32 and the KL arithmetic
            float64. Faster where bf16 products are (1.6–2.2× on a CPU with bf16 units,
            measured; GPUs not yet measured). The tangent is computed directly, not as a
            difference of rounded logits, so the prediction keeps its accuracy (docs/benchmarks.md
            measures it). JVP probe only, without ``realised_kl_check``.
        temperature: sampling temperature ``T`` of the policy (for recorded contexts).
        probe_logits_fn: ``f(model, contexts) -> logits`` for models whose forward does not
            return logits directly (default: ``model(input_ids, attention_mask).logits``).
        fd_epsilon: step ``ε`` of the finite-difference probe, as a multiple of ``D``.
        realised_kl_check: after merging, measure the true KL on the probe contexts; if it misses
            the budget by more than ``realised_kl_tolerance`` (relative, either way), undo the merge
            exactly (from a host copy of the targets) and retry with α rescaled by
            ``sqrt(δ/realised)``, at most ``realised_kl_retries`` times.
        mismatch_ema: EMA weight of the rollout/trainer mismatch ``κ`` (see :meth:`observe_mismatch`).
        kl_floor: floor the predicted KL of the unit step at this fraction of its median over the
            previous ``kl_floor_window`` updates (from the first full window on), so that α is at
            most ``1/sqrt(kl_floor)`` times what the recent median would give. Guards against a
            probe of few sequences that the step barely moves (docs/benchmarks.md measures the tail
            it causes). ``None`` (default): no floor. Not with ``realised_kl_check``.
        kl_floor_window: updates whose predicted KL the floor's median is taken over.
        process_group: the data-parallel group sketches are averaged over (default: the world group
            when ``torch.distributed`` runs several ranks). Every rank then computes the same update and
            merges it into the part of each weight it stores (replicated, FSDP2 row shard, ZeRO-3
            partition); ``step()``, the constructor, ``load_state_dict`` and ``observe_mismatch`` are
            collective calls.
    """

    # torch.amp.GradScaler then hands step() its scale instead of unscaling ``.grad`` itself: the
    # sketches are not ``.grad``, so the scaler could neither unscale them nor see an overflow.
    # step() refuses loss scaling with an error rather than letting a scaled update through.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        model: nn.Module,
        rank: int = 256,
        kl_budget: float | Callable[[int], float] | None = None,
        *,
        expert_rank: int | None = None,
        direction: str | None = None,
        optimizer: str | None = None,
        update_ratio: float | None = None,
        lr: float | None = None,
        ratio_scope: str = "target",
        seed: int = 0,
        projection: str = "rademacher",
        refresh: bool = True,
        refresh_every: int = 10,
        share_projections: bool = True,
        alpha_max: float = 3.0,
        beta1: float = 0.9,
        beta2: float = 0.95,
        eps: float = 1e-8,
        wire_dtype: torch.dtype | None = torch.bfloat16,
        stochastic_rounding: bool = True,
        non_target_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | str | None = None,
        probe: str = "jvp",
        probe_samples: int = 2,
        probe_positions: int | None = None,
        probe_words: int | str | None = "auto",
        probe_dtype: torch.dtype | None = None,
        temperature: float = 1.0,
        probe_logits_fn: LogitsFn | None = None,
        fd_epsilon: float = 1.0,
        realised_kl_check: bool = False,
        realised_kl_tolerance: float = 0.1,
        realised_kl_retries: int = 3,
        mismatch_ema: float = 0.3,
        kl_floor: float | None = None,
        kl_floor_window: int = 20,
        process_group: Any = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(
                "LoGRAOptimizer takes the patched model, e.g. LoGRAOptimizer(patch_model(model)), "
                f"not {type(model).__name__}"
            )
        defaults = param_group_defaults(
            direction_option(direction, optimizer), update_ratio, lr, beta2, eps, ratio_scope, beta1
        )
        options = StepOptions(
            rank=rank,
            expert_rank=expert_rank,
            seed=seed,
            projection=projection,
            refresh=refresh,
            refresh_every=refresh_every,
            share_projections=share_projections,
            wire_dtype=wire_dtype,
            stochastic_rounding=stochastic_rounding,
        )
        kl = KLOptions(
            budget=kl_budget,
            alpha_max=alpha_max,
            probe=probe,
            probe_samples=probe_samples,
            probe_positions=probe_positions,
            probe_words=probe_words,
            probe_dtype=probe_dtype,
            temperature=temperature,
            probe_logits_fn=probe_logits_fn,
            fd_epsilon=fd_epsilon,
            realised_kl_check=bool(realised_kl_check),
            realised_kl_tolerance=realised_kl_tolerance,
            realised_kl_retries=realised_kl_retries,
            mismatch_ema=mismatch_ema,
            kl_floor=kl_floor,
            kl_floor_window=kl_floor_window,
        )
        check_non_target_optimizer(non_target_optimizer, kl)
        found = patched_targets(model)
        if not found:
            raise ValueError("LoGRAOptimizer: the model has no LoGRA targets; call patch_model(model) first")
        dp.check_no_fsdp1(model)
        states = [target_state(m, a) for _, m, a in found]
        targets = tuple(
            Target(state.canonical_name, m, dp.weight_layout(name, getattr(m, a), state.transposed), a)
            for (name, m, a), state in zip(found, states)
        )
        check_targets(targets, options, kl)

        self.options = options
        self._model = model
        self._targets = targets
        self._weights = [dp.LocalWeight(t.weight, t.layout) for t in targets]
        group = dp.data_parallel_group(process_group)
        self._ranks = None if group is None else dp.DataParallel(group)
        self._fsdp2 = dp.fsdp2_modules(model)
        self._merge_hooks: OrderedDict[int, Callable[[LoGRAOptimizer, Update], None]] = OrderedDict()
        super().__init__([t.weight for t in targets], defaults)
        self.non_target_optimizer = self._build_non_target_optimizer(non_target_optimizer)
        stored_16_bit = any(t.weight.dtype in (torch.bfloat16, torch.float16) for t in targets)
        self.kl_control = KLController(
            model, kl, self._ranks, self._fsdp2, stored_16_bit, functools.partial(_all_bound, states)
        )

        self.update_index = 0  # applied updates so far
        self.nonfinite_skips = 0
        self.probe_skips = 0
        self.stats: dict[str, Any] = {}
        self._warned_eval_mode = False
        self._warned_eval_forward = False
        self._checked_reach = False
        self._bank = SketchBank(
            [(t.shape[0], options.rank_for(t.stacked)) for t in targets], [t.weight.device for t in targets]
        )
        for target, sketch in zip(targets, self._bank.views):
            target.state.sketch = sketch
            target.state.owner = weakref.ref(self)
            target.state.sketched_in_16_bit = target.state.sketched_in_fp16 = False
            target.state.forwarded = target.state.reached = target.state.backward_in_eval = False
        # Raised for good once 16-bit products reach the sketches: the first moment keeps their noise.
        self.polar_floor = POLAR_FLOOR
        self._bind_projections()
        if self._ranks is not None:
            self._ranks.check(self._fingerprint())
        # When the optimizer goes away the patched layers return to plain forwards (no sketch work,
        # no A or S kept alive) and the context recorder leaves the model.
        weakref.finalize(self, _release, [t.state for t in targets], self.kl_control)

    def _build_non_target_optimizer(self, factory) -> torch.optim.Optimizer | None:
        ours = {id(t.weight) for t in self._targets}
        others = [(n, p) for n, p in self._model.named_parameters() if p.requires_grad and id(p) not in ours]
        if others and factory is None:
            names = ", ".join(n for n, _ in others[:8]) + (" …" if len(others) > 8 else "")
            raise ValueError(
                f"parameters that are not LoGRA targets require grad ({names}) but nothing would update "
                "them: freeze them, or pass non_target_optimizer=lambda params: torch.optim.AdamW(params, ...)"
            )
        return factory([p for _, p in others]) if others and factory != "external" else None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.param_groups:
            raise ValueError(
                "LoGRAOptimizer has one param group, its targets; patch more modules before building it, or train "
                "other parameters with non_target_optimizer"
            )
        super().add_param_group(param_group)

    # ----------------------------------------------------------------------------------------------
    # Read-only views

    @property
    def model(self) -> nn.Module:
        """The patched model this optimizer drives."""
        return self._model

    @property
    def targets(self) -> tuple[Target, ...]:
        """Read-only views of the targets, in module order: name, module, weight, layout."""
        return self._targets

    rank = property(lambda self: self.options.rank, doc="The sketch rank ``r``.")
    expert_rank = property(
        lambda self: self.options.rank_for(True), doc="The sketch rank of stacked experts (``rank`` unless set)."
    )
    seed = property(lambda self: self.options.seed, doc="The base seed of the projections.")
    projection = property(lambda self: self.options.projection, doc="The projection kind.")
    refresh = property(lambda self: self.options.refresh, doc="Whether ``A`` is redrawn during training.")
    refresh_every = property(lambda self: self.options.refresh_every, doc="Applied updates per draw of ``A``.")
    mismatch = property(lambda self: self.kl_control.mismatch, doc="The rollout/trainer mismatch ``κ``.")

    @property
    def projection_index(self) -> int:
        """Index the current ``A`` is drawn with: update u (1-based) uses ``(u−1) // refresh_every``;
        0 for a fixed basis."""
        return self.update_index // self.refresh_every if self.refresh else 0

    def projection_seed(self, index: int, update_index: int | None = None) -> int:
        """Seed of target ``index``'s current projection ``A`` (what a rollout engine regenerates it
        from); siblings sharing ``A`` (``share_projections``) share it."""
        key = projection_key(self._targets[index].name, self.options.share_projections)
        return projection_seed(self.seed, self.projection_index if update_index is None else update_index, key)

    def projection_spec(self, index: int, update_index: int | None = None) -> ProjectionSpec:
        """What determines target ``index``'s current ``A`` (seed, rank, width, kind)."""
        target = self._targets[index]
        seed = self.projection_seed(index, update_index)
        return ProjectionSpec(seed, self.options.rank_for(target.stacked), target.shape[1], self.projection)

    def projection_for(self, index: int, update_index: int | None = None) -> torch.Tensor:
        """Generate ``A`` of target ``index`` (fp32, on its weight's device); nothing keeps it."""
        return self.projection_spec(index, update_index).generate(self._targets[index].weight.device)

    def _projections(self, indices) -> list[SharedProjection]:
        return [self._targets[index].state.shared_projection for index in indices]

    def sketch_buffers(self) -> list[torch.Tensor]:
        """The flat fp32 buffers holding every sketch (one per device), e.g. for an all-reduce."""
        return self._bank.flat_buffers()

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor this optimizer keeps between steps, for memory accounting: the sketch
        buffers, each target's state (first moment, RowAdam's row statistics, step count) and the
        ``r×r`` Gram matrices its current projections keep. Not a non-target optimizer's state."""
        grams = {id(p): p.kept_gram for p in self._projections(range(len(self._targets))) if p.kept_gram is not None}
        state = [value for entry in self.state.values() for value in entry.values() if isinstance(value, torch.Tensor)]
        return [*self.sketch_buffers(), *state, *grams.values()]

    # ----------------------------------------------------------------------------------------------
    # Inputs besides the sketches

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
        self.kl_control.set_contexts(input_ids, attention_mask, probe_mask, temperature, completion_mask)

    def observe_mismatch(
        self, rollout_logps: torch.Tensor, trainer_logps: torch.Tensor, mask: torch.Tensor | None = None
    ) -> float:
        """Feed log-probs of sampled tokens from the rollout engine and the trainer (same tokens,
        ``mask`` selecting generated tokens of completed responses). Updates and returns
        ``κ ← (1−w) κ + w · max(0, mean(log π_rollout − log π_trainer))`` (w = ``mismatch_ema``);
        the next update's budget becomes ``max(δ − κ, δ/2)``."""
        return self.kl_control.observe_mismatch(rollout_logps, trainer_logps, mask)

    def register_merge_hook(self, hook: Callable[[LoGRAOptimizer, Update], None]) -> RemovableHandle:
        """Call ``hook(optimizer, update)`` after every applied update with exactly what was merged:
        per target the HF parameter name, the projection seed and ``F = α η U`` (wire dtype). This is
        what a rollout engine needs (:mod:`.sync`). Returns a handle whose ``remove()`` detaches it."""
        handle = RemovableHandle(self._merge_hooks)
        self._merge_hooks[handle.id] = hook
        return handle

    # ----------------------------------------------------------------------------------------------
    # The update

    def _clear_sketches(self) -> None:
        self._bank.zero_()
        for target in self._targets:
            target.state.sketched_in_16_bit = target.state.sketched_in_fp16 = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the sketches (and the non-target optimizer's gradients)."""
        self._refuse_unpatched()
        self._clear_sketches()
        super().zero_grad(set_to_none=set_to_none)
        if self.non_target_optimizer is not None:
            self.non_target_optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Merge ``W ← W − α η U A`` for every target, then clear the sketches and, every
        ``refresh_every`` updates, draw a new ``A`` (carrying any first moment into it).

        The sketches are cleared because they hold this update's gradient (and, at a redraw, are
        expressed in the basis that was just replaced). A non-finite sketch, a non-finite direction,
        step size or state computed from it, or a non-finite predicted or realised KL, skips the
        update: weights and optimizer state stay untouched, a warning is issued and a counter in
        ``stats`` records it.
        """
        self._refuse_unpatched()
        self._refuse_loss_scaling()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._refuse_fp16()  # after the closure, which may have run the backward
        # Outside any autocast region the caller's step may sit in: the update's products (η's Gram
        # matrices, the merge) are float32 or float64 by design, never 16-bit casts of them.
        with outside_autocast(t.weight.device.type for t in self._targets):
            self._update()
        return loss

    def _update(self) -> None:
        """One update from the sketches (:meth:`step` less its closure)."""
        started = time.perf_counter()
        # A forward outside backward (evaluation, generation) can leave FSDP2's root unsharded; the
        # merge writes into the shards, which the next forward must gather again.
        dp.reshard(self._fsdp2)
        finite, sharded_sq, sixteen_bit = self._synchronise()
        if not finite:
            self.nonfinite_skips += 1
            self._skip(
                f"non-finite sketch (or non-target gradient) at update {self.update_index + 1}", "nonfinite_sketch"
            )
            return
        self._warn_if_eval_mode()
        self._warn_about_eval_forwards()
        self._warn_about_unreached_targets()
        # Raised for good once 16-bit products reach the first moment: by a committed update only.
        plan = self._plan(sharded_sq, POLAR_FLOOR_16BIT if sixteen_bit else self.polar_floor)
        if not plan.finite():
            self.nonfinite_skips += 1
            self._skip(
                f"non-finite direction, step size or optimizer state at update {self.update_index + 1}",
                "nonfinite_plan",
            )
            return
        try:
            alpha, kl_stats = self._apply(plan)
        except UpdateSkipped as skipped:
            self.probe_skips += 1
            self._skip(str(skipped), skipped.reason)
            return
        update = self._commit(plan)
        seconds = time.perf_counter() - started
        self.stats = {"alpha": alpha, "eta": plan.mean_eta, **kl_stats, "step_seconds": seconds, **self._counters()}
        for hook in list(self._merge_hooks.values()) if update is not None else ():
            hook(self, update)  # last: the step is complete whatever a hook does

    def _commit(self, plan: StepPlan) -> Update | None:
        """After a merge: the optimizer state, the next update's ``A``, empty sketches; returns what was
        merged when a hook listens."""
        group = self.param_groups[0]
        for step in plan.steps:
            self.state[group["params"][step.index]].update(step.state)
        self.polar_floor = plan.polar_floor
        update = self._merged_update() if self._merge_hooks else None
        for weight in self._weights:
            weight.forget_merge()
        previous_index = self.projection_index
        self.update_index += 1
        if self.projection_index != previous_index:
            old = [t.state.shared_projection for t in self._targets]
            self._bind_projections()
            self._carry_first_moments(old)
        self._clear_sketches()
        return update

    def _carry_first_moments(self, old_projections: list[SharedProjection]) -> None:
        """Express every first moment in the basis just drawn (one ``T`` per shared projection): the
        one place that needs two ``A`` at once, old and new, generated here and freed."""
        transfers = {}
        for target, old in zip(self._targets, old_projections):
            state = self.state.get(target.weight, {})
            if "first_moment" not in state:
                continue
            new = target.state.shared_projection
            key = (id(old), id(new))
            if key not in transfers:
                transfers[key] = basis_change(old.generate(), new.generate())
            state["first_moment"] = carry_first_moment(state["first_moment"], transfers[key])

    def _refuse_missing_moments(self, state_dict: dict[str, Any]) -> None:
        """A checkpoint loaded into a template (``torch.distributed.checkpoint``) built by an
        optimizer with other settings arrives without the moments the template had no entry for:
        RowAdam's row moments under another direction, the first moment under ``beta1=0``. Resuming
        would restart them from zero under a step count and bias correction that are not, so refuse."""
        group = state_dict["param_groups"][0]
        needed = {
            "row_second_moment": ("direction='rowadam'", group.get("direction") == "rowadam"),
            "first_moment": (f"beta1={group.get('beta1')}", float(group.get("beta1", 0.0)) > 0.0),
        }
        for index, entry in state_dict["state"].items():
            if float(entry.get("step", 0)) <= 0:
                continue
            for key, (setting, saved) in needed.items():
                if saved and key not in entry:
                    raise ValueError(
                        f"state_dict: target {self._targets[int(index)].name!r} was trained with {setting} but "
                        f"its {key} is missing (a checkpoint loaded into the template of an optimizer built with "
                        f"other settings drops it); build the optimizer with {setting} before loading this checkpoint"
                    )

    def _refuse_other_shapes(self, state_dict: dict[str, Any]) -> None:
        """A first moment of another shape than the target's sketch (a checkpoint of a stack of one
        expert sketched at ``rank`` before stacks took ``expert_rank`` whatever their count) would
        fail at the next step; refuse it here, naming the target."""
        for index, entry in state_dict["state"].items():
            moment, target = entry.get("first_moment"), self._targets[int(index)]
            if moment is not None and tuple(moment.shape) != tuple(target.state.sketch.shape):
                raise ValueError(
                    f"state_dict: target {target.name!r} has a first moment of shape {tuple(moment.shape)}, this "
                    f"optimizer sketches it as {tuple(target.state.sketch.shape)} (another rank or expert_rank)"
                )

    def _refuse_other_targets(self, saved: list[str] | None) -> None:
        """Per-target state is loaded by position, so a checkpoint of other targets (``k_proj``
        where this optimizer has ``v_proj``: in grouped-query attention their shapes agree) would
        steer one with another's moments. The names are the canonical ones (wrappers' prefixes
        stripped at patch time), which also seed each ``A``: a name that differs in any way would
        resume with other projections. Checkpoints from before the names were saved have none to
        compare."""
        if saved is None:
            return
        names = [target.name for target in self._targets]
        if len(saved) != len(names):
            raise ValueError(f"state_dict was saved with {len(saved)} targets, this optimizer has {len(names)}")
        for index, (theirs, ours) in enumerate(zip(saved, names)):
            if str(theirs) != ours:
                raise ValueError(
                    f"state_dict target {index} is {theirs!r}, this optimizer's is {ours!r}: a checkpoint of other "
                    "targets (patch_model's target_modules) cannot be resumed"
                )

    def _refuse_unpatched(self) -> None:
        """A model unpatched after this optimizer was built has no sketches to read or clear: say so,
        instead of failing in the first lookup of a target's state."""
        for target in self._targets:
            try:
                owner = target.state.owner
            except ValueError:  # the module is not patched any more
                owner = None
            if owner is None or owner() is not self:
                raise RuntimeError(
                    f"LoGRAOptimizer: target {target.name!r} is no longer bound to this optimizer (unpatch_model "
                    "was called on the model); build a new optimizer on a patched model"
                )

    def _refuse_loss_scaling(self) -> None:
        if not hasattr(self, "found_inf"):  # set by GradScaler.step for the duration of the call
            return
        del self.found_inf, self.grad_scale
        raise RuntimeError(
            "LoGRAOptimizer does not support fp16 loss scaling (torch.amp.GradScaler, Trainer/accelerate fp16=True): "
            "its sketches are not .grad, so the scaler can neither unscale them nor detect their overflow. Train "
            "with bf16 autocast (Trainer bf16=True) and fp32 master weights, which need no loss scaling"
        )

    def _refuse_fp16(self) -> None:
        """fp16 is refused where it shows: a target stored in fp16 since this optimizer was built
        (``model.half()``), and sketches of fp16 gradients (``torch.autocast(dtype=torch.float16)``
        without a scaler), which underflow at RL loss sizes with nothing to detect it."""
        for target in self._targets:
            refuse_fp16_storage(target)
        fp16 = [t.name for t in self._targets if t.state.sketched_in_fp16]
        if fp16:
            raise RuntimeError(
                f"LoGRAOptimizer: the sketches of {len(fp16)} targets (e.g. {fp16[0]!r}) were accumulated from "
                "float16 gradients (torch.autocast(dtype=torch.float16)). Without loss scaling, which cannot reach "
                "the sketches, small gradients underflow and the update is wrong with no sign of it. Train with "
                "torch.autocast(dtype=torch.bfloat16) and fp32 master weights; zero_grad() drops these sketches"
            )

    def _plan(self, sharded_sq: list[float] | None, polar_floor: float) -> StepPlan:
        """Directions and step sizes; mutates nothing. ``sharded_sq``: ``‖W_i‖²`` of each sharded
        weight in target order, summed over the ranks (distributed runs only)."""
        group = self.param_groups[0]
        directions = next_directions(
            group["direction"],
            [target.state.sketch for target in self._targets],
            [self.state.get(target.weight, {}) for target in self._targets],
            group["beta2"],
            group["eps"],
            group["beta1"],
            [target.state.experts for target in self._targets],
            polar_floor,
        )
        steps = [TargetStep(index, u, state, eta=group["lr"]) for index, (u, state) in enumerate(directions)]
        if group["lr_mode"] == "update_ratio":
            projections = self._projections(range(len(steps)))
            update_sq = _floats([low_rank_sq_norm(s.direction, p.gram()) for s, p in zip(steps, projections)])
            etas = step_sizes(group["lr"], self._weight_sq_norms(sharded_sq), update_sq, group["ratio_scope"])
            for step, eta in zip(steps, etas):
                step.eta = eta
        for step, target in zip(steps, self._targets):  # after η: idle weights do not enlarge the others' steps
            step.direction = idle_still(step.direction, target.state.sketch, target.state.experts)
        return StepPlan(steps, polar_floor)

    def _weight_sq_norms(self, sharded_sq: list[float] | None) -> list[float]:
        """``‖W_i‖²`` of every whole target: computed here where this rank stores all of it, taken
        from ``sharded_sq`` (already summed over the ranks) where it is sharded."""
        sharded = iter(sharded_sq or ())
        local = _floats([w.sq_norm() for w in self._weights if sharded_sq is None or not w.sharded])
        replicated = iter(local)
        return [next(sharded) if sharded_sq is not None and w.sharded else next(replicated) for w in self._weights]

    def _apply(self, plan: StepPlan) -> tuple[float, dict[str, Any]]:
        """Choose α and merge; raises :class:`UpdateSkipped` with the weights untouched."""
        control = self.kl_control
        factors = plan.factors() if control.options.enabled else []  # the unit step, for the probe only
        choice = control.choose([t.state for t in self._targets], factors, self.update_index + 1)
        # Only once the update is certain; the predicted KL covers the targets' update alone.
        if self.non_target_optimizer is not None:
            self.non_target_optimizer.step()
        if not control.options.realised_kl_check:
            self._merge(plan, choice.alpha)
            return choice.alpha, choice.stats
        backup = [weight.backup() for weight in self._weights]

        def undo() -> None:
            projections = generated(self._projections(range(len(self._weights))))
            for weight, saved, projection in zip(self._weights, backup, projections):
                weight.restore(saved, projection)

        try:  # leave no half-applied update behind
            self._merge(plan, choice.alpha)
            return control.check_realised(choice, lambda alpha: self._merge(plan, alpha), undo), choice.stats
        except BaseException:
            undo()
            for weight in self._weights:
                weight.forget_merge()
            raise

    def _merge(self, plan: StepPlan, alpha: float) -> None:
        # One factor and one A at a time: all of them would weigh as much as the sketches.
        projections = generated(self._projections(step.index for step in plan.steps))
        for step, projection in zip(plan.steps, projections):
            weight = self._weights[step.index]
            factor = step.factor(alpha)
            if self.options.wire_dtype is not None:
                factor = factor.to(self.options.wire_dtype)
            generator, local = None, weight.local()
            if local.dtype == torch.bfloat16 and self.options.stochastic_rounding:
                generator = torch.Generator(device=local.device)
                generator.manual_seed(self._rounding_seed(step.index))
            weight.merge_(
                factor.contiguous(),
                projection,
                keep=bool(self._merge_hooks),
                stochastic_rounding=self.options.stochastic_rounding,
                generator=generator,
            )

    def _merged_update(self) -> Update:
        """The update just merged (called before the update counter advances)."""
        targets = []
        for index, (target, weight) in enumerate(zip(self._targets, self._weights)):
            rounding = self._rounding(weight.local().dtype)
            seed = self._rounding_seed(index) if rounding == "stochastic" else None
            targets.append(
                TargetUpdate(
                    target.parameter_name,
                    self.projection_seed(index),
                    target.shape[1],
                    weight.last_factor,
                    rounding,
                    seed,
                )
            )
        return Update(self.update_index + 1, tuple(targets))

    def _rounding_seed(self, index: int) -> int:
        """Seed of target ``index``'s stochastic rounding in the update being merged; the sync
        payload carries it, so that a bf16 engine draws the same noise."""
        return rounding_seed(self.projection_seed(index), self.update_index + 1, self._targets[index].name)

    def _rounding(self, dtype: torch.dtype) -> str:
        """How a merge into a weight of ``dtype`` rounds (see :mod:`.sync`)."""
        if dtype in (torch.float32, torch.float64):
            return "exact"
        return "stochastic" if dtype == torch.bfloat16 and self.options.stochastic_rounding else "nearest"

    def _skip(self, why: str, reason: str) -> None:
        warn(f"LoGRA: {why}; update skipped, weights and optimizer state unchanged", RuntimeWarning)
        self.zero_grad()
        self.stats = {"skipped": reason, **self._counters()}

    def _counters(self) -> dict[str, Any]:
        return {
            "update_index": self.update_index,
            "nonfinite_skips": self.nonfinite_skips,
            "probe_skips": self.probe_skips,
        }

    def _warn_if_eval_mode(self) -> None:
        if self._warned_eval_mode or any(t.module.training for t in self._targets) or not self._bank.all_zero():
            return
        self._warned_eval_mode = True
        warn(
            "LoGRA: step() with empty sketches while the model is in eval mode: patched layers accumulate "
            "sketches only in train mode with grad enabled; call model.train() before the training forward",
            RuntimeWarning,
        )

    def _warn_about_eval_forwards(self) -> None:
        """Once: name the targets a backward went through in an eval-mode forward while some
        non-target is trainable. Their sketches got nothing from it, so a loss computed in eval mode
        (dropout off, a common RL habit) trained the non-targets alone, silently: an all-zero sketch
        is warned of above, a partial one would not be. Without a trainable non-target such a
        backward can only be a diagnostic (``torch.autograd.grad`` of an eval forward)."""
        if self._warned_eval_forward:
            return
        names = [t.name for t in self._targets if t.state.backward_in_eval]
        if not names or not any(p.requires_grad for p in self._model.parameters()):
            return
        self._warned_eval_forward = True
        warn(
            f"LoGRA: a backward went through an eval-mode forward of {len(names)} of {len(self._targets)} targets "
            f"({', '.join(names[:6])}{' …' if len(names) > 6 else ''}); it adds nothing to their sketches, and "
            "trained only the non-targets. Call model.train() before a training forward (to turn dropout off, set "
            "the dropout probabilities to 0 instead)",
            RuntimeWarning,
        )

    def _warn_about_unreached_targets(self) -> None:
        """Once, at the first update after a backward: name the targets that were forwarded but
        whose sketch no backward reached. No gradient reached them (a reentrant checkpoint whose
        inputs do not require grad, a module outside the loss's graph), so their weights would
        silently never train. Read from flags the patched layers set, so that a target no token
        reached (an idle expert, a vision tower on text) is not named. Stacked experts are not
        checked."""
        if self._checked_reach:
            return
        states = [t.state for t in self._targets]
        # Judged at the first update after a backward: forwards alone (generation, a rollout's
        # log-probs, both under no_grad) reach nothing. A backward shows in a reached target or in a
        # trainable non-target's gradient (every checkpointed block reentrant: no target is reached).
        if not any(state.forwarded for state in states) or not (
            any(state.reached for state in states)
            or any(p.grad is not None for p in self._model.parameters() if p.requires_grad)
        ):
            return
        self._checked_reach = True
        unreached = [t.name for t, state in zip(self._targets, states) if state.forwarded and not state.reached]
        if unreached:
            names = ", ".join(unreached[:6]) + (" …" if len(unreached) > 6 else "")
            warn(
                f"LoGRA: {len(unreached)} of {len(self._targets)} targets ran a training forward but received no "
                f"gradient ({names}), so their weights do not change. With reentrant gradient checkpointing, the "
                "checkpointed blocks' inputs must require grad (use use_reentrant=False, or transformers' "
                "gradient_checkpointing_enable); otherwise the loss does not depend on them",
                RuntimeWarning,
            )

    # ----------------------------------------------------------------------------------------------
    # Projections and data parallelism (see :mod:`.distributed`)

    def _bind_projections(self) -> None:
        """Give every target what determines its current ``A``, one :class:`SharedProjection` per group
        of siblings that share it (same seed, width and device: one ``A`` generated and one ``x Aᵀ``
        per forward between them). Nothing is generated here."""
        shared: dict[tuple, SharedProjection] = {}
        for index, target in enumerate(self._targets):
            key = (self.projection_spec(index), target.weight.device)
            if key not in shared:
                shared[key] = SharedProjection(*key)
            target.state.set_projection(shared[key])

    def _fingerprint(self) -> dp.ProjectionFingerprint:
        header = (
            self.seed,
            self.projection_index,
            self.update_index,
            self.rank,
            self.expert_rank,
            self.projection,
            self.refresh,
            self.refresh_every,
            self.options.share_projections,
            len(self._targets),
            GENERATOR,
        )
        return dp.ProjectionFingerprint(
            header,
            tuple(t.name for t in self._targets),
            tuple(dp.projection_identity(t.state.shared_projection.spec) for t in self._targets),
        )

    def _synchronise(self) -> tuple[bool, list[float] | None, bool]:
        """(the sketches, averaged over the ranks, and every rank's non-target gradients are finite,
        each sharded weight's ``‖W_i‖²`` or ``None`` in one process, a 16-bit product went into a
        sketch on some rank), averaging the sketches over the ranks on the way."""
        sixteen_bit = any(t.state.sketched_in_16_bit for t in self._targets)
        if self._ranks is None:
            return self._bank.all_finite() and self._local_all_finite(), None, sixteen_bit
        sharded = (
            _floats([w.sq_norm() for w in self._weights if w.sharded])
            if self.param_groups[0]["lr_mode"] == "update_ratio"
            else []
        )
        return self._ranks.synchronise(
            self._bank.flat_buffers(), self._fingerprint(), sharded, self._local_all_finite(), sixteen_bit
        )

    def _local_all_finite(self) -> bool:
        """Non-target gradients on this rank (FSDP2 shards: the local part)."""
        if self.non_target_optimizer is None:
            return True
        grads = [p.grad for g in self.non_target_optimizer.param_groups for p in g["params"] if p.grad is not None]
        grads = [grad.to_local() if dp.is_dtensor(grad) else grad for grad in grads]
        return all_finite(grads)

    # ----------------------------------------------------------------------------------------------
    # Checkpointing

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus ``"logra"`` (update index, seed, projection, κ, counters).

        Only tensors, numbers and strings: loadable with ``torch.load(weights_only=True)``. Every
        target has an entry, zeros before its first update (equivalent to none), so that formats
        which load into a template (``torch.distributed.checkpoint``) find all of them.
        """
        state = super().state_dict()
        group = self.param_groups[0]
        for index, target in enumerate(self._targets):
            if index not in state["state"]:
                sketch = target.state.sketch
                state["state"][index] = {"step": torch.tensor(0.0)}
                if group["direction"] == "rowadam":
                    state["state"][index]["row_second_moment"] = torch.zeros(sketch.shape[0], device=sketch.device)
                if group["beta1"] > 0.0:
                    state["state"][index]["first_moment"] = torch.zeros_like(sketch)
        state["logra"] = {
            "update_index": self.update_index,
            "seed": self.seed,
            "rank": self.rank,
            "expert_rank": self.expert_rank,
            "projection": self.projection,
            "refresh": self.refresh,
            "refresh_every": self.refresh_every,
            "share_projections": self.options.share_projections,
            "mismatch": self.mismatch,
            # A list, not a tensor: its length grows with the first updates, and
            # torch.distributed.checkpoint loads tensors into the shapes of a fresh optimizer's.
            "recent_kl": list(self.kl_control.recent_kl),
            "nonfinite_skips": self.nonfinite_skips,
            "probe_skips": self.probe_skips,
            "polar_floor": self.polar_floor,
            # Per-target state is stored by position; the names let a resume refuse other targets.
            "targets": [target.name for target in self._targets],
        }
        if self.non_target_optimizer is not None:
            state["non_target"] = self.non_target_optimizer.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: restores state and counters and binds the projections of the saved update index
        (generated when used), so training continues bit-identically."""
        state_dict = dict(state_dict)
        logra = state_dict.pop("logra", None)
        non_target = state_dict.pop("non_target", None)
        if logra is None:
            raise ValueError("not a LoGRAOptimizer state_dict: the 'logra' section is missing")
        if int(logra["rank"]) != self.rank:
            raise ValueError(f"state_dict was saved with rank={logra['rank']}, this optimizer has rank={self.rank}")
        saved_expert_rank = int(logra.get("expert_rank", logra["rank"]))
        if saved_expert_rank != self.expert_rank:
            raise ValueError(
                f"state_dict was saved with expert_rank={saved_expert_rank}, this optimizer has "
                f"expert_rank={self.expert_rank}"
            )
        if (non_target is None) != (self.non_target_optimizer is None):
            raise ValueError("state_dict and optimizer disagree on whether a non_target_optimizer is used")
        self._refuse_other_targets(logra.get("targets"))
        state_dict["param_groups"] = [upgrade_param_group(g) for g in state_dict["param_groups"]]
        self._refuse_missing_moments(state_dict)
        self._refuse_other_shapes(state_dict)
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter's dtype; the moments stay fp32, like the sketches.
        for index, target in enumerate(self._targets):
            saved = state_dict["state"].get(index, {})
            for key in ("row_second_moment", "first_moment"):
                if key in saved:
                    self.state[target.weight][key] = saved[key].to(target.weight.device, torch.float32)
        if non_target is not None:
            self.non_target_optimizer.load_state_dict(non_target)
        self.options = replace(
            self.options,
            seed=int(logra["seed"]),
            projection=str(logra["projection"]),
            refresh=bool(logra["refresh"]),
            refresh_every=int(logra.get("refresh_every", 1)),
            # A checkpoint from before shared projections drew one A per target.
            share_projections=bool(logra.get("share_projections", False)),
        )
        self.update_index = int(logra["update_index"])
        self.kl_control.mismatch = float(logra["mismatch"])
        self.kl_control.recent_kl.clear()
        self.kl_control.recent_kl.extend(float(q) for q in logra.get("recent_kl", []))
        self.nonfinite_skips = int(logra["nonfinite_skips"])
        self.probe_skips = int(logra["probe_skips"])
        self.polar_floor = float(logra.get("polar_floor", POLAR_FLOOR))
        self._clear_sketches()
        self._bind_projections()
        if self._ranks is not None:
            self._ranks.check(self._fingerprint())

    def __repr__(self) -> str:
        group = self.param_groups[0]
        return (
            f"LoGRAOptimizer(targets={len(self._targets)}, rank={self.rank}, direction={group['direction']!r}, "
            f"{group['lr_mode']}={group['lr']}, projection={self.projection!r}, "
            f"kl_budget={self.kl_control.options.budget})"
        )


def _floats(values: list[torch.Tensor]) -> list[float]:
    """Scalar tensors as floats, with one host sync per device (targets may sit on several devices)."""
    by_device: dict[torch.device, list[int]] = {}
    for position, value in enumerate(values):
        by_device.setdefault(value.device, []).append(position)
    result = [0.0] * len(values)
    for positions in by_device.values():
        for position, value in zip(positions, torch.stack([values[p] for p in positions]).tolist()):
            result[position] = float(value)
    return result


def _release(states: list[TargetState], control: KLController) -> None:
    for state in states:
        state.unbind()
    control.close()


def _all_bound(states: list[TargetState]) -> bool:
    """Whether every target is still bound to an optimizer (not after :func:`unpatch_model`)."""
    return all(state.owner is not None for state in states)
