"""The engine side of the sync for vLLM's fused mixture-of-experts layers (``RoutedExperts``).

A stacked experts weight (``[E, d, k]``: transformers' ``…mlp.experts.gate_up_proj`` /
``…down_proj``) is one LoGRA target, the ``E·d × k`` matrix of its row-major layout. vLLM keeps a
block's experts in one fused layer, ``w13_weight`` (each rank's gate rows, then its up rows) and
``w2_weight``, sliced by tensor parallelism, distributed by expert parallelism and possibly padded.
:func:`experts_placements` reads that layout from a layer (the geometry itself is pure:
:mod:`.placement`); :func:`merge_into_experts_` applies an update through it in place, starting
from :func:`experts_rounding_remainder` for 16-bit copies; :func:`experts_repacked` works around
vLLM 0.32's CPU experts around a reload. :class:`~.engine.EngineUpdater` uses them.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
import torch.nn as nn

from logra_optim.sync import TargetUpdate, merge_blocks_like_trainer_, merge_like_trainer_
from logra_optim.updates import rounding_remainder

from .placement import ExpertsPlacement, down_placement, gate_up_placement

__all__ = ["experts_placements", "experts_repacked", "experts_rounding_remainder", "merge_into_experts_"]


def experts_placements(name: str, layer) -> dict[str, ExpertsPlacement]:
    """The stacked HF weights of one of vLLM's fused experts layers (``RoutedExperts``), under the
    names transformers gives them (``<experts module>.gate_up_proj`` ``[E, 2I, H]``,
    ``.down_proj`` ``[E, H, I]``), which vLLM's loader also accepts. Layouts this mapping does not
    cover (non-gated experts, other checkpoint names, redundant experts, padded tensor-parallel
    shards, experts that EPLB may move between slots, checkpoints that store the stacked weights
    transposed) get no placement, so a payload naming them is refused by name."""
    config = layer.moe_config
    names = (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name)
    if (
        not config.is_act_and_mul
        or names != ("gate_proj", "up_proj", "down_proj")
        or config.num_experts != config.num_logical_experts
        or config.moe_parallel_config.enable_eplb
        or config.tp_shard_with_padding
        or getattr(layer, "is_fused_checkpoint_transposed", False)
    ):
        return {}
    experts, intermediate = config.num_logical_experts, config.intermediate_size
    hidden = config.hidden_dim_unpadded or config.hidden_dim
    local = {e: layer.expert_map_manager.map_global_to_local(e) for e in range(experts)}
    local = {e: int(index) for e, index in local.items() if int(index) >= 0}
    tp_rank, tp_size = config.moe_parallel_config.tp_rank, config.moe_parallel_config.tp_size
    prefix = layer.layer_name
    return {
        f"{prefix}.gate_up_proj": gate_up_placement(
            name, local, experts, intermediate, hidden, layer.w13_weight.shape[1] // 2, tp_rank, tp_size
        ),
        f"{prefix}.down_proj": down_placement(name, local, experts, intermediate, hidden, tp_rank, tp_size),
    }


@contextmanager
def experts_repacked(model: nn.Module):
    """Works around vLLM 0.32's CPU experts after an in-place reload: the fused-MoE method sets up
    its kernel's weight format (the CPU backend's prepacking) only at the first load, so reloaded
    experts would be left unpacked and computed with as if packed (served log-probs off by ~0.1).
    For every experts layer whose kernel has a weight-format step of its own, counts during the
    reload the calls of the layer's ``process_weights_after_loading`` and of the kernel's step;
    once the reload has succeeded, makes the kernel's step for each layer that was processed
    without it. A vLLM that makes the call itself, or that rebuilt the kernel, is left alone."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExpertsModular
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    base = FusedMoEExpertsModular.process_weights_after_loading
    watched = []
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        kernel = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if not isinstance(layer, RoutedExperts) or kernel is None:
            continue
        if type(kernel).process_weights_after_loading is base:
            continue
        calls = {"layer": 0, "kernel": 0}

        def counting(owner, key, _calls=calls):
            own = type(owner).process_weights_after_loading

            def counted(target):
                _calls[key] += 1
                return own(owner, target)

            owner.process_weights_after_loading = counted  # an instance attribute, removed below

        counting(method, "layer")
        counting(kernel, "kernel")
        watched.append((layer, method, kernel, calls))

    def restore():
        for _, method, kernel, _ in watched:
            method.__dict__.pop("process_weights_after_loading", None)
            kernel.__dict__.pop("process_weights_after_loading", None)

    try:
        yield
        restore()
        for layer, method, kernel, calls in watched:
            if calls["layer"] and not calls["kernel"] and method.moe_kernel.fused_experts is kernel:
                kernel.process_weights_after_loading(layer)
    finally:
        restore()


def _as_whole_matrix(param: torch.Tensor, placement: ExpertsPlacement) -> torch.Tensor | None:
    """``param`` as the trainer's ``E·d × k`` matrix, where its blocks are exactly that matrix's
    rows in place (every expert local at its own index, no slicing, no padding); else ``None``."""
    d, k = placement.out_features // placement.experts, placement.in_features
    if tuple(param.shape) != (placement.experts, d, k) or not param.is_contiguous():
        return None
    for block in placement.blocks:
        if (
            block.factor_rows.start != block.expert * d + block.param_rows.start
            or block.factor_rows.stop - block.factor_rows.start != block.param_rows.stop - block.param_rows.start
            or block.param_cols != slice(0, k)
            or block.projection_cols != slice(0, k)
        ):
            return None
    held = sum(block.factor_rows.stop - block.factor_rows.start for block in placement.blocks)
    return param.view(placement.out_features, k) if held == placement.out_features else None


def experts_rounding_remainder(exact: torch.Tensor, param: torch.Tensor, placement: ExpertsPlacement) -> torch.Tensor:
    """What loading the ``E·d × k`` matrix ``exact`` into a rank's 16-bit stacked parameter rounded
    away, block by block (zero in padding): the compensation :func:`merge_into_experts_` starts from."""
    compensation = torch.zeros_like(param)
    for block in placement.blocks:
        where = (block.expert, block.param_rows, block.param_cols)
        part = exact[block.factor_rows, block.projection_cols].to(param.device)
        compensation[where] = rounding_remainder(part, param[where])
    return compensation


def merge_into_experts_(
    param: torch.Tensor,
    placement: ExpertsPlacement,
    target: TargetUpdate,
    projection: torch.Tensor,
    compensation: torch.Tensor | None = None,
) -> None:
    """One target update applied in place to a rank's stacked experts parameter (``w13_weight`` /
    ``w2_weight``, ``E_local × rows × cols``), block by block as ``placement`` says: the rank's
    share of ``W ← W − F A`` for the trainer's ``E·d × k`` matrix, padding left untouched.

    Where the rank holds the whole matrix unpadded (no tensor or expert parallelism), it is merged
    as one matrix, as the trainer merged it, so that a bf16 trainer's stochastic rounding draws the
    same noise and the copy stays bit-identical; block by block, each block takes its part of the
    noise the whole matrix draws, in one pass for all of them (:func:`~logra_optim.sync.merge_blocks_like_trainer_`)."""
    target = dataclasses.replace(target, factor=target.factor.to(param.device))  # once, not per block
    rows = _as_whole_matrix(param, placement)
    if rows is not None:
        whole_compensation = None if compensation is None else compensation.view_as(rows)
        merge_like_trainer_(rows, target, projection, whole_compensation)
        return
    wheres = [(block.expert, block.param_rows, block.param_cols) for block in placement.blocks]
    if target.rounding == "stochastic":  # one pass over the trainer's noise for every block
        parts = [
            (param[where], block.factor_rows, block.projection_cols) for where, block in zip(wheres, placement.blocks)
        ]
        merge_blocks_like_trainer_(parts, target, projection)
        return
    for where, block in zip(wheres, placement.blocks):
        merge_like_trainer_(
            param[where],
            target,
            projection,
            None if compensation is None else compensation[where],
            block.factor_rows,
            block.projection_cols,
        )
