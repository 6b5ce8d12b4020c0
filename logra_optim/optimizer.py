"""``LoGRAOptimizer``: bookkeeping around the pure functions of :mod:`logra_optim.updates`.

The optimizer binds to a model patched by :func:`~logra_optim.patch_model`. It owns the sketch
buffers and the projections of the targets (regenerated from the seed and the update index, never
stored), turns the accumulated sketches into directions, chooses the step and merges
``W ← W − α η U A`` into the weights. Its ``param_groups`` hold the target weights so that torch LR
schedulers work unchanged; its state is tensors and numbers only.
"""

from __future__ import annotations

import itertools
import math
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from .patching import TargetState, patched_modules
from .projection import PROJECTIONS, make_projection, projection_seed
from .sketch import SketchBank
from .updates import low_rank_sq_norm, merge_low_rank_, relative_step_size, rowadam_direction

OPTIMIZERS = ("rowadam", "sgd")
DEFAULT_UPDATE_RATIO = 6e-5


def _positive(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


class LoGRAOptimizer(torch.optim.Optimizer):
    """Low-rank gradient-sketch optimizer for a model patched with :func:`patch_model`.

    Args:
        model: the patched model (not its parameters).
        rank: sketch rank ``r``; at most every target's in and out size.
        kl_budget: predicted-KL budget ``δ`` per update; ``None`` turns KL control off (α = 1).
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
    """

    def __init__(
        self,
        model: nn.Module,
        rank: int = 256,
        kl_budget: float | None = None,
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
        if kl_budget is not None:
            _positive("kl_budget", kl_budget)
            raise NotImplementedError(
                "kl_budget: predicted-KL step control is not available in this version; "
                "pass kl_budget=None (α = 1) and control the step with update_ratio or lr"
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
        for name, module in targets:
            d, k = module.weight.shape
            if rank > min(d, k):
                raise ValueError(
                    f"rank={rank} is larger than target {name!r} allows ({d}×{k}: rank must be ≤ {min(d, k)})"
                )
            owner = module._logra.owner() if module._logra.owner is not None else None
            if owner is not None:
                raise RuntimeError(
                    f"target {name!r} is already driven by another LoGRAOptimizer; one optimizer per "
                    "patched model (delete the old one, or unpatch_model + patch_model for a fresh start)"
                )
            if module.weight.requires_grad:
                raise ValueError(f"target {name!r} has requires_grad=True; LoGRA targets must stay frozen")
            if module.weight.dtype == torch.float16:
                warnings.warn(
                    f"target {name!r} is stored in float16: updates below half an ulp are lost. "
                    "Keep fp32 master weights (or bf16, which is stochastically rounded).",
                    stacklevel=2,
                )

        self._targets: list[TargetState] = [m._logra for _, m in targets]
        self._modules: list[nn.Linear] = [m for _, m in targets]
        self._index_of = {id(m.weight): i for i, m in enumerate(self._modules)}
        defaults = dict(lr=lr, lr_mode=lr_mode, optimizer=optimizer, beta2=beta2, eps=eps)
        super().__init__([m.weight for m in self._modules], defaults)

        target_weights = {id(m.weight) for m in self._modules}
        others = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in target_weights]
        if others and non_target_optimizer is None:
            names = ", ".join(n for n, _ in others[:8]) + (" …" if len(others) > 8 else "")
            raise ValueError(
                f"parameters that are not LoGRA targets require grad ({names}) but nothing would update "
                "them: freeze them, or pass non_target_optimizer=lambda params: torch.optim.AdamW(params, ...)"
            )
        self.non_target_optimizer = non_target_optimizer([p for _, p in others]) if others else None

        self.rank = rank
        self.seed = int(seed)
        self.projection = projection
        self.refresh = bool(refresh)
        self.kl_budget = kl_budget
        self.alpha_max = alpha_max
        self.wire_dtype = wire_dtype
        self.stochastic_rounding = bool(stochastic_rounding)
        self.update_index = 0  # applied updates so far
        self.nonfinite_skips = 0
        self.stats: dict[str, Any] = {}

        self._bank = SketchBank(
            [(m.weight.shape[0], rank) for m in self._modules], [m.weight.device for m in self._modules]
        )
        for target, sketch in zip(self._targets, self._bank.views):
            target.sketch = sketch
            target.owner = weakref.ref(self)
        self._regenerate_projections()

    # ----------------------------------------------------------------------------------------------
    # Projections and sketches

    @property
    def projection_index(self) -> int:
        """Index the current ``A`` is drawn with: update u (1-based) uses u−1; 0 for a fixed basis."""
        return self.update_index if self.refresh else 0

    def projection_for(self, target: TargetState, update_index: int | None = None) -> torch.Tensor:
        """Regenerate ``A`` of ``target`` (fp32, on its weight's device) for an update index."""
        index = self.projection_index if update_index is None else update_index
        weight = self._modules[self._targets.index(target)].weight
        seed = projection_seed(self.seed, index, target.canonical_name)
        return make_projection(seed, self.rank, weight.shape[1], self.projection, device=weight.device)

    def _regenerate_projections(self) -> None:
        for target in self._targets:
            target.set_projection(self.projection_for(target))

    def sketch_buffers(self) -> list[torch.Tensor]:
        """The flat fp32 buffers holding every sketch (one per device), e.g. for an all-reduce."""
        return self._bank.flat_buffers()

    # ----------------------------------------------------------------------------------------------
    # torch.optim.Optimizer API

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
        replaced. A non-finite sketch skips the update: weights and state stay untouched, a warning
        is issued and ``stats["nonfinite_skips"]`` counts it.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        started = time.perf_counter()
        if self.non_target_optimizer is not None:
            self.non_target_optimizer.step()

        if not self._bank.all_finite():
            self.nonfinite_skips += 1
            warnings.warn(
                f"LoGRA: non-finite sketch at update {self.update_index + 1}; update skipped, weights and "
                "optimizer state unchanged",
                RuntimeWarning,
                stacklevel=2,
            )
            self._bank.zero_()
            self.stats = {"skipped": "nonfinite", **self._counters()}
            return loss

        plans = []  # (group, [(module, target, direction, new_state)], eta)
        for group in self.param_groups:
            entries, weight_sq, update_sq = [], [], []
            for weight in group["params"]:
                index = self._index_of[id(weight)]
                module, target = self._modules[index], self._targets[index]
                direction, new_state = self._direction(group, weight, target.sketch)
                entries.append((module, target, direction, new_state))
                if group["lr_mode"] == "update_ratio":
                    weight_sq.append(torch.linalg.vector_norm(weight, dtype=torch.float32).double().square())
                    update_sq.append(low_rank_sq_norm(direction, target.projection))
            if group["lr_mode"] == "update_ratio":
                eta = relative_step_size(
                    group["lr"], float(torch.stack(weight_sq).sum()), float(torch.stack(update_sq).sum())
                )
            else:
                eta = group["lr"]
            plans.append((group, entries, eta))

        alpha = 1.0
        for group, entries, eta in plans:
            for module, target, direction, new_state in entries:
                factor = direction * (alpha * eta)
                if self.wire_dtype is not None:
                    factor = factor.to(self.wire_dtype)
                generator = None
                if module.weight.dtype == torch.bfloat16 and self.stochastic_rounding:
                    generator = torch.Generator(device=module.weight.device)
                    generator.manual_seed(projection_seed(self.seed, self.update_index, "rounding/" + target.canonical_name))
                merge_low_rank_(
                    module.weight.data, factor, target.projection,
                    stochastic_rounding=self.stochastic_rounding, generator=generator,
                )  # fmt: skip
                self.state[module.weight].update(new_state)

        self.update_index += 1
        if self.refresh:
            self._regenerate_projections()
        self._bank.zero_()
        self.stats = {
            "alpha": alpha,
            "eta": plans[0][2],
            "step_seconds": time.perf_counter() - started,
            **self._counters(),
        }
        return loss

    def _direction(self, group: dict, weight: torch.Tensor, sketch: torch.Tensor):
        """``U`` for one target and the state it would commit (nothing is mutated here)."""
        if group["optimizer"] == "sgd":
            step = self.state[weight].get("step", torch.tensor(0.0))
            return sketch, {"step": step + 1}
        state = self.state[weight]
        step = state.get("step", torch.tensor(0.0)) + 1
        moment = state.get("row_second_moment")
        if moment is None:
            moment = torch.zeros(weight.shape[0], dtype=torch.float32, device=sketch.device)
        direction, moment = rowadam_direction(sketch, moment, int(step), group["beta2"], group["eps"])
        return direction, {"step": step, "row_second_moment": moment}

    def _counters(self) -> dict[str, Any]:
        return {"update_index": self.update_index, "nonfinite_skips": self.nonfinite_skips}

    # ----------------------------------------------------------------------------------------------
    # Checkpointing

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus ``"logra"`` (update index, seed, projection kind, counters).

        Only tensors, numbers and strings: loadable with ``torch.load(weights_only=True)``.
        """
        state = super().state_dict()
        state["logra"] = {
            "update_index": self.update_index,
            "seed": self.seed,
            "rank": self.rank,
            "projection": self.projection,
            "refresh": self.refresh,
            "nonfinite_skips": self.nonfinite_skips,
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
        self.nonfinite_skips = int(logra["nonfinite_skips"])
        self._bank.zero_()
        self._regenerate_projections()

    def __repr__(self) -> str:
        group = self.param_groups[0]
        return (
            f"LoGRAOptimizer(targets={len(self._targets)}, rank={self.rank}, optimizer={group['optimizer']!r}, "
            f"{group['lr_mode']}={group['lr']}, projection={self.projection!r}, kl_budget={self.kl_budget})"
        )
