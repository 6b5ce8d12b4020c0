"""The options of :class:`~logra_optim.LoGRAOptimizer`, validated once, here.

:func:`param_group_defaults` (the target group's step size and direction settings, which live in
the param group), :class:`StepOptions` (projections, rounding) and :class:`KLOptions` (how big an
update may be: predicted-KL control). Each checks its own values when built and raises a
``ValueError`` that names the option and what would be valid, so
that a misspelt or out-of-range setting fails at construction, never in the middle of training.
Checks that need the model (ranks against target shapes, probes against sharding) live in
:func:`check_targets`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import distributed as dp
from .caller import warn
from .probe import LogitsFn
from .projection import PROJECTIONS
from .target import Target
from .updates import DIRECTIONS, RATIO_SCOPES

PROBES = ("jvp", "finite_difference")
DEFAULT_UPDATE_RATIO = 6e-5


def positive(name: str, value: Any) -> float:
    """``value`` as a float, or a ``ValueError`` naming ``name`` unless it is a positive finite number."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def _non_negative_int(name: str, value: Any, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        kind = "positive" if minimum == 1 else "non-negative"
        raise ValueError(f"{name} must be a {kind} integer, got {value!r}")
    return value


def param_group_defaults(
    direction: str,
    update_ratio: float | None,
    lr: float | None,
    beta2: float,
    eps: float,
    ratio_scope: str = "target",
    beta1: float = 0.9,
) -> dict[str, Any]:
    """The target group's settings, which live in ``param_groups[0]`` (where LR schedulers and
    ``load_state_dict`` change them), validated: ``lr_mode`` is ``"update_ratio"`` (``lr`` is the
    relative update norm ``ρ_upd``: ``η_i`` makes ``‖η_i U_i A_i‖ = ρ_upd ‖W_i‖`` per target, or over
    all targets together with ``ratio_scope="model"``) or ``"lr"`` (``η = lr``)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if update_ratio is not None and lr is not None:
        raise ValueError("give either update_ratio (relative update norm) or lr (plain learning rate), not both")
    if lr is not None:
        step_size, lr_mode = positive("lr", lr), "lr"
    else:
        step_size = positive("update_ratio", DEFAULT_UPDATE_RATIO if update_ratio is None else update_ratio)
        lr_mode = "update_ratio"
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not isinstance(beta, numbers.Real) or isinstance(beta, bool) or not 0.0 <= beta < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta!r}")
    if ratio_scope not in RATIO_SCOPES:
        raise ValueError(f"ratio_scope must be one of {RATIO_SCOPES}, got {ratio_scope!r}")
    return dict(
        lr=step_size,
        lr_mode=lr_mode,
        direction=direction,
        beta1=float(beta1),
        beta2=float(beta2),
        eps=positive("eps", eps),
        ratio_scope=ratio_scope,
    )


# Dtypes a factor may be rounded to before it is merged and sent: bf16 keeps fp32's range.
WIRE_DTYPES = (torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class StepOptions:
    """The settings of every update that are not the param group's: the projections (rank, seed,
    kind, refresh, sharing between siblings) and how a factor is rounded and merged."""

    rank: int
    expert_rank: int | None = None
    seed: int = 0
    projection: str = "rademacher"
    refresh: bool = True
    refresh_every: int = 10
    share_projections: bool = True
    wire_dtype: torch.dtype | None = torch.bfloat16
    stochastic_rounding: bool = True

    def __post_init__(self) -> None:
        _non_negative_int("rank", self.rank, minimum=1)
        if self.expert_rank is not None:
            _non_negative_int("expert_rank", self.expert_rank, minimum=1)
        _non_negative_int("refresh_every", self.refresh_every, minimum=1)
        if not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))  # a NumPy integer too
        for name in ("refresh", "share_projections", "stochastic_rounding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {self.projection!r}")
        if self.wire_dtype is not None and self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(
                f"wire_dtype must be one of {WIRE_DTYPES} or None, got {self.wire_dtype!r}: float16's range "
                "overflows a large factor to inf and its subnormals keep a few bits of a small one"
            )

    def rank_for(self, stacked: bool) -> int:
        """The sketch rank of a target: ``expert_rank`` for a ``stacked`` experts weight (if set)."""
        return self.expert_rank if stacked and self.expert_rank is not None else self.rank


@dataclass(frozen=True)
class KLOptions:
    """Predicted-KL control: the budget ``δ`` per update and how the KL of a step is predicted and checked.

    ``budget=None`` turns control off (α = 1); every other option is still validated, so that
    turning it on later cannot surface a bad value.
    """

    budget: float | Callable[[int], float] | None = None
    alpha_max: float = 3.0
    probe: str = "jvp"
    probe_samples: int = 2
    probe_positions: int | None = None
    probe_words: int | str | None = "auto"
    probe_dtype: torch.dtype | None = None
    temperature: float = 1.0
    probe_logits_fn: LogitsFn | None = None
    fd_epsilon: float = 1.0
    realised_kl_check: bool = False
    realised_kl_tolerance: float = 0.1
    realised_kl_retries: int = 3
    mismatch_ema: float = 0.3
    kl_floor: float | None = None
    kl_floor_window: int = 20

    def __post_init__(self) -> None:
        if self.budget is not None and not callable(self.budget):
            object.__setattr__(self, "budget", positive("kl_budget", self.budget))
        if self.probe not in PROBES:
            raise ValueError(f"probe must be one of {PROBES}, got {self.probe!r}")
        _non_negative_int("probe_samples", self.probe_samples, minimum=1)
        if self.probe_positions is not None:
            _non_negative_int("probe_positions", self.probe_positions, minimum=1)
        words = self.probe_words
        if words not in ("auto", None) and (not isinstance(words, int) or isinstance(words, bool) or words < 4):
            raise ValueError(
                "probe_words must be 'auto', None (every word) or an integer ≥ 4 (half of the words are drawn, "
                f"and their variance needs two), got {words!r}"
            )
        if isinstance(words, int) and (
            self.probe != "jvp" or self.realised_kl_check or self.probe_logits_fn is not None
        ):
            raise ValueError(
                f"probe_words={words} needs the JVP probe without realised_kl_check and without a probe_logits_fn: "
                "the others read the logits over every word (use probe_words='auto' or None there)"
            )
        if self.probe_dtype is not None:
            if self.probe_dtype != torch.bfloat16:
                raise ValueError(
                    f"probe_dtype must be None or torch.bfloat16, got {self.probe_dtype!r} (fp16's range would "
                    "flush the tangent of a realistic step, about 6e-5 of the activations, towards its subnormals)"
                )
            if self.probe != "jvp":
                raise ValueError(
                    f"probe_dtype={self.probe_dtype} needs probe='jvp': the finite-difference probe takes the "
                    "difference of two forwards, which 16-bit rounding would swamp for a realistic step"
                )
            if self.realised_kl_check:
                raise ValueError(
                    f"probe_dtype={self.probe_dtype} cannot be combined with realised_kl_check: the check compares "
                    "the logits before and after the merge in the weights' precision, and the probe's 16-bit base "
                    "logits differ from those by their rounding"
                )
        positive("temperature", self.temperature)
        positive("fd_epsilon", self.fd_epsilon)
        positive("realised_kl_tolerance", self.realised_kl_tolerance)
        _non_negative_int("realised_kl_retries", self.realised_kl_retries)
        floor = self.kl_floor
        if floor is not None and (
            isinstance(floor, bool) or not isinstance(floor, numbers.Real) or not 0.0 < floor <= 1.0
        ):
            raise ValueError(
                "kl_floor must be None or in (0, 1] (a fraction of the recent median predicted KL), "
                f"got {self.kl_floor!r}"
            )
        _non_negative_int("kl_floor_window", self.kl_floor_window, minimum=1)
        if self.kl_floor is not None and self.realised_kl_check:
            raise ValueError(
                "kl_floor cannot be combined with realised_kl_check: the floor keeps some steps below the budget "
                "on the probe contexts, and the check would rescale them back up to it"
            )
        ema = self.mismatch_ema
        if isinstance(ema, bool) or not isinstance(ema, numbers.Real) or not 0.0 < ema <= 1.0:
            raise ValueError(f"mismatch_ema must be a number in (0, 1], got {ema!r}")
        if self.realised_kl_check and self.budget is None:
            raise ValueError("realised_kl_check needs a kl_budget to check against")
        object.__setattr__(self, "alpha_max", positive("alpha_max", self.alpha_max))

    @property
    def enabled(self) -> bool:
        return self.budget is not None


def check_non_target_optimizer(non_target_optimizer: Any, kl: KLOptions) -> None:
    if isinstance(non_target_optimizer, str) and non_target_optimizer != "external":
        raise ValueError(f"non_target_optimizer must be a callable, 'external' or None, got {non_target_optimizer!r}")
    if kl.realised_kl_check and callable(non_target_optimizer):
        raise ValueError(
            "realised_kl_check cannot be combined with non_target_optimizer: the measured KL would include "
            "the non-target update, which the retry can neither undo nor rescale"
        )


def check_targets(targets: Sequence[Target], step: StepOptions, kl: KLOptions) -> None:
    """Checks that need the model: each target can carry the rank, is free, frozen and mergeable,
    and the KL probe can run where the weights live."""
    if kl.enabled and kl.probe == "jvp" and any(t.layout.kind == dp.FLAT for t in targets):
        raise ValueError(
            "the JVP probe cannot run under DeepSpeed ZeRO-3: its module hooks wrap every output in an autograd "
            "Function without a forward-mode rule. Use probe='finite_difference' (with fd_epsilon large enough "
            "to be resolved, e.g. 1.0)"
        )
    for target in targets:
        d, k = target.shape[0] // target.experts, target.shape[1]  # per expert for stacked experts
        rank = step.rank_for(target.stacked)
        if rank > min(d, k):
            option = "expert_rank" if target.stacked and step.expert_rank is not None else "rank"
            hint = " per expert; set expert_rank for the experts" if target.stacked and option == "rank" else ""
            raise ValueError(
                f"{option}={rank} is larger than target {target.name!r} allows ({d}×{k}{hint}: it must be "
                f"≤ {min(d, k)})"
            )
        if target.state.owner is not None and target.state.owner() is not None:
            raise RuntimeError(
                f"target {target.name!r} is already driven by another LoGRAOptimizer; one optimizer per patched "
                "model (delete the old one, or unpatch_model + patch_model for a fresh start)"
            )
        if target.weight.requires_grad:
            raise ValueError(f"target {target.name!r} has requires_grad=True; LoGRA targets must stay frozen")
        refuse_fp16_storage(target)
    low_precision = any(t.weight.dtype == torch.bfloat16 for t in targets)
    if low_precision and not step.stochastic_rounding:
        warn(
            "bf16 target weights with stochastic_rounding=False: each merge rounds to nearest, and an update "
            "below half a bf16 ulp (about 2e-3 of a weight; RL steps move weights by about 6e-5) is lost, so most "
            "weights will not move. Keep stochastic_rounding=True, or fp32 master weights",
            RuntimeWarning,
        )
    if kl.enabled and low_precision and (kl.probe == "finite_difference" or kl.realised_kl_check):
        warn(
            "16-bit target weights: the finite-difference probe and the realised-KL check compare logits "
            "whose rounding error is of the size of a small step's change; prefer probe='jvp' and fp32 "
            "master weights"
        )


def refuse_fp16_storage(target: Target) -> None:
    """A target stored in float16 is refused, at construction and at every step (``model.half()``
    after the optimizer was built)."""
    if target.weight.dtype == torch.float16:
        raise ValueError(
            f"target {target.name!r} is stored in float16, which LoGRA does not train: updates below half an "
            "ulp are lost, and fp16 training needs loss scaling, which cannot reach LoGRA's sketches (they are "
            "not .grad). Keep fp32 master weights with bf16 autocast, or store the targets in bf16 (merged with "
            "stochastic rounding)"
        )


def direction_option(direction: str | None, optimizer: str | None) -> str:
    """``direction``, or the deprecated ``optimizer=`` spelling of it (it read oddly on an optimizer)."""
    if optimizer is None:
        return "orthogonal" if direction is None else direction
    if direction is not None:
        raise ValueError("give direction= only (optimizer= is its deprecated name), not both")
    if optimizer not in DIRECTIONS:
        raise ValueError(
            f"optimizer must be one of {DIRECTIONS}, got {optimizer!r} (and is deprecated: use direction=)"
        )
    warn(
        "LoGRAOptimizer(optimizer=...) is deprecated; use direction=... (same values: 'rowadam', 'orthogonal', 'sgd')",
        DeprecationWarning,
    )
    return optimizer


def upgrade_param_group(group: dict) -> dict:
    """A param group saved by an older version, with today's keys: ``optimizer`` was renamed
    ``direction``, a group without ``ratio_scope`` used one step size for all targets, and one
    without ``beta1`` had no first moment."""
    if "optimizer" in group and "direction" not in group:
        group = {("direction" if key == "optimizer" else key): value for key, value in group.items()}
    if "ratio_scope" not in group:
        group = {**group, "ratio_scope": "model"}
    if "beta1" not in group:
        group = {**group, "beta1": 0.0}
    return group
