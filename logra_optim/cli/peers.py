"""The ways to train a model that LoGRA is measured against, built one way for ``logra bench`` (memory and
speed of one step) and ``logra demo`` (the learning race): AdamW on exactly LoGRA's targets, LoRA on
the same target modules, and the memory-efficient low-rank peers GaLore, APOLLO and APOLLO-Mini.

Every function takes the model as built, decides what it trains (``requires_grad``, or peft's
wrapper) and, for the low-rank peers, builds the optimizer over LoGRA's target matrices
(:func:`logra_optim.find_target_modules`) with plain AdamW on every other parameter. The caller
gives the learning rate and AdamW's other settings: ``logra bench`` its fixed dense settings,
``logra demo`` those of TRL's ``GRPOConfig``.
"""

from __future__ import annotations

import functools

import torch

from logra_optim import find_experts_modules, find_target_modules

# GaLore's README settings (rank r on the target weights): projection refreshed every 200 steps, scale 0.25.
GALORE_SETTINGS = {"update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
# APOLLO's README settings: APOLLO (rank r, channel-wise) and APOLLO-Mini (rank 1, tensor-wise).
APOLLO_SETTINGS = {
    "apollo": {"proj": "random", "scale_type": "channel", "scale": 1, "update_proj_gap": 200, "proj_type": "std"},
    "apollo-mini": {"proj": "random", "scale_type": "tensor", "scale": 128, "update_proj_gap": 200, "proj_type": "std"},
}
# The low-rank peers: GaLore's or APOLLO's rule on the target matrices, plain AdamW on the rest.
LOW_RANK_PEERS = ("galore", *APOLLO_SETTINGS)
# APOLLO-Mini is rank 1 by definition, whatever the rank asked for.
FIXED_RANKS = {"apollo-mini": 1}


def expert_weights(model) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, weight)`` of every stacked mixture-of-experts weight (LoGRA's targets too)."""
    return [
        (f"{name}.{attribute}", getattr(module, attribute))
        for name, module, names in find_experts_modules(model)
        for attribute in names
    ]


def train_only_targets(model):
    """``adamw-targets``: freeze every parameter but the weights of LoGRA's targets (and stacked
    experts' weights, which LoGRA trains too); returns the model."""
    weights = {id(module.weight) for _, module in find_target_modules(model)}
    weights |= {id(weight) for _, weight in expert_weights(model)}
    for parameter in model.parameters():
        parameter.requires_grad_(id(parameter) in weights)
    return model


def lora_model(model, rank: int):
    """``lora``: peft LoRA (``r = rank``, ``lora_alpha = 2r``, no dropout) on LoGRA's target modules
    and stacked expert weights, base weights frozen; returns peft's wrapped model."""
    from peft import LoraConfig, get_peft_model

    names = sorted({name.rsplit(".", 1)[-1] for name, _ in find_target_modules(model)})
    # Stacked experts by their parameter path, e.g. mlp.experts.down_proj; None without experts.
    parameters = sorted({".".join(name.split(".")[-3:]) for name, _ in expert_weights(model)}) or None
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=names, target_parameters=parameters
    )
    return get_peft_model(model, config)


def trainable(model) -> list[torch.nn.Parameter]:
    """The parameters an optimizer over ``model`` takes: those that require grad."""
    return [p for p in model.parameters() if p.requires_grad]


# The package each peer comes from (optional extras: a method whose package is missing is skipped).
PEER_MODULES = {
    "lora": "peft",
    "galore": "galore_torch",
    "adamw8bit": "bitsandbytes",
    "apollo": "apollo_torch",
    "apollo-mini": "apollo_torch",
    "flora": "flora_opt",
}


def check_proj_gap(name: str, gap) -> None:
    """Refuse a projection refresh interval that is not a positive integer or None, naming it."""
    if gap is not None and (isinstance(gap, bool) or not isinstance(gap, int) or gap < 1):
        raise ValueError(f"{name} must be a positive integer or None, got {gap!r}")


def low_rank_optimizer(model, method: str, rank: int, proj_gap: int | None = None, **adamw) -> torch.optim.Optimizer:
    """The optimizer of a low-rank peer (one of ``LOW_RANK_PEERS``) over every trainable parameter
    of ``model``: GaLore's or APOLLO's rule on the weights of LoGRA's targets (rank ``rank``, or
    ``FIXED_RANKS[method]``), plain AdamW on the rest: after :func:`train_only_targets` only the
    stacked experts of a mixture-of-experts model, which neither package projects. ``proj_gap``:
    steps between projection refreshes (``update_proj_gap``; default their READMEs' 200, which a
    run of a few hundred updates refreshes once or twice, where LoGRA redraws its ``A`` every 10).
    ``adamw``: the optimizer's ``lr``, ``betas``, ``eps``, ``weight_decay``."""
    check_proj_gap("proj_gap", proj_gap)
    if method not in LOW_RANK_PEERS:
        raise ValueError(f"unknown low-rank peer {method!r}; choose from {', '.join(LOW_RANK_PEERS)}")
    low_rank = {id(module.weight) for _, module in find_target_modules(model)}
    parameters = trainable(model)
    projected = [p for p in parameters if id(p) in low_rank]
    regular = [p for p in parameters if id(p) not in low_rank]
    if not projected:  # it would be plain AdamW under the peer's name
        raise ValueError(
            f"{method}: the model has no trainable weight of LoGRA's target matrices for its low-rank rule "
            "(frozen, or no target found: see logra_optim.find_target_modules)"
        )
    if method == "galore":
        from galore_torch import GaLoreAdamW

        settings = {"rank": rank, **GALORE_SETTINGS}
        build = functools.partial(GaLoreAdamW, no_deprecation_warning=True)  # it asks for torch's: no GaLore there
    else:
        from apollo_torch import APOLLOAdamW as build

        settings = {"rank": FIXED_RANKS.get(method, rank), **APOLLO_SETTINGS[method]}
    if proj_gap is not None:
        settings["update_proj_gap"] = proj_gap
    groups = [{"params": regular}, {"params": projected, **settings}]
    return build([group for group in groups if group["params"]], **adamw)  # no empty group: nothing else trains
