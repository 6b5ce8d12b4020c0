"""What the 2-rank workers and the 1-process references share: the model, the batch, the settings.

A 2-rank run gives each rank half of ``BATCH`` (rank r: rows 2r, 2r+1); its reference is one process
on the whole batch. The losses are means over each rank's tokens (equal halves, every token valid),
so the average over the ranks is the full batch's mean and the two runs must agree to fp32 rounding.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from logra_optim import LoGRAOptimizer, patch_model, patched_targets
from tests.helpers.tiny import fixed_batch, tiny_gpt_oss, tiny_qwen2, tiny_qwen3_moe

WORLD = 2
STEPS = 3
NON_TARGET_LR = 0.1
BATCH = fixed_batch(batch=4, seq=12)
# fp32 end to end (no bf16 wire rounding, which would turn fp32 reduction-order noise into bf16 ulps).
# The default first moment with A redrawn after every 2 updates: the 3 steps cross one redraw, so the
# moment's carry into the new basis runs sharded too.
COMMON = dict(rank=8, wire_dtype=None, update_ratio=2e-2, seed=3, refresh_every=2)
CONFIGS = {
    "plain": dict(COMMON),
    "kl": dict(COMMON, kl_budget=1e-3, alpha_max=10.0),
    "kl-check": dict(COMMON, kl_budget=1e-3, alpha_max=10.0, realised_kl_check=True, realised_kl_tolerance=0.02),
}
MODES = ("ddp", "fsdp2", "zero1", "zero2", "zero3")
# Modes that also run the mixture-of-experts model (config "kl": the probe goes through the experts).
MOE_MODES = ("ddp", "fsdp2")


def external_non_target(config: str) -> bool:
    """Whether the final norm's SGD is stepped outside LoGRA (after its step) rather than by LoGRA's
    ``non_target_optimizer``: always under DeepSpeed (the engine's optimizer), and with the realised-KL
    check, which must measure the targets' update alone."""
    return config == "kl-check"


# Mixture-of-experts models by name, 3 experts per layer, so that FSDP2's shards over experts
# (``Shard(0)`` of ``[E, d, k]``, or of GPT-OSS's transposed ``[E, k, d]``) are uneven.
MOE_MODELS = {
    "qwen3_moe": lambda: tiny_qwen3_moe(num_experts=3),
    "gpt_oss": lambda: tiny_gpt_oss(num_local_experts=3),
}


def build_model(moe: str | None = None) -> torch.nn.Module:
    """The tiny Qwen2, patched, with the final norm trainable (DDP and DeepSpeed refuse a model
    without a trainable parameter). ``intermediate_size=97`` gives gate/up odd row counts (uneven
    FSDP2 shards) and ZeRO-3 partitions that end mid-row. ``moe``: a model of :data:`MOE_MODELS` instead."""
    model = patch_model(MOE_MODELS[moe]() if moe else tiny_qwen2(intermediate_size=97))
    model.model.norm.weight.requires_grad_(True)
    return model.train()


def rows_of(rank: int, batch=BATCH) -> dict[str, torch.Tensor]:
    per_rank = batch["input_ids"].shape[0] // WORLD
    return {key: value[rank * per_rank : (rank + 1) * per_rank] for key, value in batch.items()}


def logra_kwargs(config: str, world: int, mode: str) -> dict:
    kwargs = dict(CONFIGS[config])
    if "kl_budget" in kwargs:
        kwargs["probe_samples"] = BATCH["input_ids"].shape[0] // world  # the union of contexts is the batch
        if mode == "zero3":  # ZeRO-3's module hooks have no forward-mode AD rule
            kwargs["probe"] = "finite_difference"
    return kwargs


def reference(config: str, mode: str, steps: int = STEPS, moe: str | None = None) -> dict:
    """One process, the full batch, the same settings as ``mode``'s: final weights and per-step α."""
    model = build_model(moe)
    kwargs = logra_kwargs(config, 1, mode)
    norm_sgd = torch.optim.SGD([model.model.norm.weight], lr=NON_TARGET_LR)
    if external_non_target(config):
        kwargs["non_target_optimizer"] = "external"
    else:
        kwargs["non_target_optimizer"] = lambda params: torch.optim.SGD(params, lr=NON_TARGET_LR)
    opt = LoGRAOptimizer(model, **kwargs)
    alphas = []
    for _ in range(steps):
        model(**BATCH).loss.backward()
        opt.step()
        if external_non_target(config):
            norm_sgd.step()
            norm_sgd.zero_grad()
        opt.zero_grad()
        alphas.append(opt.stats["alpha"])
    return {"weights": trained_weights(model), "alphas": alphas}


def trained_weights(model) -> dict[str, torch.Tensor]:
    """Target weights (stacked experts included) and the final norm, by canonical name (plain tensors)."""
    from logra_optim import canonical_name

    out = {canonical_name(name): getattr(m, a).detach().clone() for name, m, a in patched_targets(model)}
    out["model.norm.weight"] = model.model.norm.weight.detach().clone()
    return out


def finish() -> None:
    """End a worker rank once everything is saved: wait for every rank, take the group down, and
    leave without running native destructors. Threads of the communication backends (gloo's,
    DeepSpeed's) have aborted a rank at interpreter exit once in many runs ("terminate called
    without an active exception"), after the work had passed."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
