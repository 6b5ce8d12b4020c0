"""The engine side of the vLLM sync: runs inside every vLLM worker process.

vLLM imports :class:`LoGRAWorkerExtension` by its dotted path, :data:`EXTENSION`
(``LLM(..., worker_extension_cls=EXTENSION)``; a server uses :mod:`.backend` instead), in each
worker; so this module imports only what applying an update needs, never the trainer side. Each
worker keeps one :class:`EngineUpdater`, which regenerates every target's ``A`` from the seed and
applies ``W ← W − F A`` (docs/method.md §4). How depends on where the engine's weights live:

* **in place** (CUDA, unquantized): each target's rows of the loaded, possibly fused and
  tensor-parallel, parameter are updated directly, as its :class:`~.placement.Placement` says;
  16-bit weights keep a compensation buffer of the same size (Kahan summation), without which
  every update below half an ulp, i.e. every RL update, would be rounded away.
* **reload** (the CPU backend, which prepacks linears and leaves ``layer.weight`` empty; quantized
  layers): the updater keeps checkpoint-format shadow copies (fp32 by default) of every linear
  layer's tensors, updates those, and hands whole fused groups to vLLM's ``reload_weights``. fp32
  shadows mean the engine's bf16 weights are re-rounded from an exact copy each time, so rounding
  does not accumulate.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn as nn

from logra_optim.projection import projection_seed
from logra_optim.updates import rounding_remainder
from logra_optim.sync import (
    PayloadError,
    SyncPayload,
    checksum_probe,
    merge_like_trainer_,
    projections_of,
    relative_drift,
    weight_checksum,
)

from . import wire
from .experts import experts_placements, experts_repacked, experts_rounding_remainder, merge_into_experts_
from .placement import (
    ExpertsPlacement,
    Placement,
    checkpoint_fused_placement,
    column_parallel_placements,
    row_parallel_placement,
)

__all__ = [
    "DRIFT_MARKER",
    "DriftError",
    "EXTENSION",
    "compare_checksums",
    "drift_exceeded",
    "EngineUpdater",
    "LoGRAWorkerExtension",
    "engine_placements",
]

# What vLLM imports in its workers: must name the class below (a test resolves it).
EXTENSION = "logra_optim.integrations.vllm.engine.LoGRAWorkerExtension"
# The same class by the path it had before the adapter became a package (still resolves).
LEGACY_EXTENSION = "logra_optim.integrations.vllm.LoGRAWorkerExtension"


# Starts the message of a failed engine-side drift check; the measurement follows as JSON.
DRIFT_MARKER = "LoGRA sync drift check failed: "


# What an engine may keep its copy in: an 8-bit float would round away every update.
SHADOW_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class DriftError(RuntimeError):
    """The engine's copy of the weights has drifted from the trainer's past the bound."""


def compare_checksums(pairs, served_dtype: torch.dtype, drift_bound: float) -> dict[str, float]:
    """The drift check's verdict from checksums, on whichever side compares them: ``pairs`` holds per
    target ``((engine copy, trainer copy), (engine served, trainer served))`` ``W p`` vectors. Returns
    the largest relative differences ``drift`` and ``served_drift`` and ``served_bound``: the served
    weights resolve only down to their dtype's rounding, so their bound is
    ``max(drift_bound, 4·eps(served dtype))``. ``served`` is ``None`` for weights the engine cannot
    read a served product of (stacked experts): their copy is compared alone."""
    worst = {"drift": 0.0, "served_drift": 0.0}
    for copies, served in pairs:
        worst["drift"] = max(worst["drift"], relative_drift(*copies))
        if served is not None:
            worst["served_drift"] = max(worst["served_drift"], relative_drift(*served))
    return {**worst, "served_bound": max(drift_bound, 4 * torch.finfo(served_dtype).eps)}


def drift_exceeded(measured: dict[str, float], drift_bound: float) -> bool:
    """Whether a :func:`compare_checksums` result fails the check (NaN, an unmeasurable comparison,
    does not)."""
    return measured["drift"] > drift_bound or measured["served_drift"] > measured["served_bound"]


def engine_placements(model: nn.Module) -> dict[str, Placement | ExpertsPlacement]:
    """Every linear weight of a vLLM model by its HF checkpoint name (``…q_proj.weight``), and every
    stacked experts weight of its fused mixture-of-experts layers (``…experts.gate_up_proj``)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import (
        LinearBase,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    packed = getattr(model, "packed_modules_mapping", {}) or {}
    placements: dict[str, Placement | ExpertsPlacement] = {}
    for name, layer in model.named_modules():
        if isinstance(layer, RoutedExperts):
            placements.update(experts_placements(name, layer))
        if not isinstance(layer, LinearBase):
            continue
        prefix, _, short = name.rpartition(".")
        members = [f"{prefix}.{m}.weight" if prefix else f"{m}.weight" for m in packed.get(short, [short])]
        tp_rank, tp_size = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
        if isinstance(layer, RowParallelLinear):
            placements[members[0]] = row_parallel_placement(
                name, layer.output_size, layer.input_size_per_partition, tp_rank, tp_size
            )
            continue
        if isinstance(layer, QKVParallelLinear):
            local = [
                layer.num_heads * layer.head_size,
                layer.num_kv_heads * layer.head_size,
                layer.num_kv_heads * layer.v_head_size,
            ]
            kv_shard = tp_rank // layer.num_kv_head_replicas
            shards = [tp_rank, kv_shard, kv_shard]
            full = [
                layer.total_num_heads * layer.head_size,
                layer.total_num_kv_heads * layer.head_size,
                layer.total_num_kv_heads * layer.v_head_size,
            ]
        elif isinstance(layer, MergedColumnParallelLinear):
            full = list(layer.output_sizes)
            local, shards = [size // tp_size for size in full], [tp_rank] * len(full)
        else:  # plain column-parallel or replicated
            full = [layer.output_size]
            local = list(getattr(layer, "output_partition_sizes", full))[:1]
            shards = [tp_rank if local[0] != full[0] else 0]
        if len(members) < len(full):  # one checkpoint matrix for several engine blocks
            placements[members[0]] = checkpoint_fused_placement(name, sum(full), layer.input_size)
            continue
        placements.update(column_parallel_placements(name, members, full, local, shards, layer.input_size))
    return placements


def _holds_plain_weights(layer: nn.Module, placement: Placement | ExpertsPlacement) -> bool:
    """Whether the engine computes with ``layer``'s weights as loaded (unpacked, unquantized, in
    vLLM's layout), so that they can be updated in place. Fused experts: only the Triton backend's
    (others reorder or prepack them)."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    method = getattr(layer, "quant_method", None)
    if isinstance(placement, ExpertsPlacement):
        weight = getattr(layer, placement.parameter)
        return (
            isinstance(method, UnquantizedFusedMoEMethod)
            and getattr(method, "unquantized_backend", None) == UnquantizedMoeBackend.TRITON
            and weight.dim() == 3
        )
    return layer.weight.dim() == 2 and layer.weight.numel() > 0 and isinstance(method, UnquantizedLinearMethod)


def _named_tensors(weights) -> list[tuple[str, torch.Tensor]]:
    """Checkpoint tensors however they were sent: wire bytes or text of a dict, a dict, or pairs."""
    if isinstance(weights, (bytes, str)):
        weights = wire.load(weights)
    return list(weights.items()) if isinstance(weights, dict) else list(weights)


@contextmanager
def _quiet_reload_logs():
    """A partial reload logs "Failed to load weights" for every layer it leaves alone (and puts back)."""
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class EngineUpdater:
    """The engine side of the sync, one per vLLM worker (kept on the worker, see :func:`_updater`).

    ``state``: the update index the weights are at (``None`` until the first full sync, and after a
    failed reload), the mode and, in reload mode, the shadow copies. Every public method returns
    plain JSON-able values, so the server's RPC endpoint can carry them. Two front ends drive it:
    :class:`LoGRAWorkerExtension` (``collective_rpc``) and the ``logra`` weight-transfer backend
    (:mod:`.backend`, vLLM's ``/update_weights``).

    Args:
        model: returns the engine's model (the worker's, or a weight-transfer engine's ``model``);
            called on use, so a model the worker replaces is followed.
        vllm_config: the engine's configuration (its model dtype; vLLM's reload needs it).
    """

    def __init__(self, model: Callable[[], nn.Module], vllm_config):
        self.model, self.vllm_config = model, vllm_config
        self._state = None

    def _engine_state(self) -> dict:
        """Built on first use, once the worker has loaded its model."""
        state = self._state
        if state is None:
            model = self.model()
            placements = engine_placements(model)
            layers = self._layers()
            # In place only where every layer computes with its plain (unpacked, unquantized) weights.
            inplace = all(_holds_plain_weights(layers[p.module], p) for p in placements.values())
            state = {
                "index": None,
                "mode": "inplace" if inplace else "reload",
                "placements": placements,
                "linear_modules": {p.module for p in placements.values()},
                "packed": getattr(model, "packed_modules_mapping", {}) or {},
                "shadows": {},
                "shadow_dtype": torch.float32,
                "compensation": {},  # 16-bit copies of fp32-master targets: what rounding dropped
            }
            self._state = state
        return state

    def _layers(self) -> dict[str, nn.Module]:
        return dict(self.model().named_modules())

    def _linear_module_of(self, name: str) -> str | None:
        """The engine linear module a checkpoint tensor loads into (fused groups: the fused one)."""
        state = self._engine_state()
        if name in state["placements"]:
            return state["placements"][name].module
        module_path, _, _ = name.rpartition(".")
        prefix, _, short = module_path.rpartition(".")
        short = next((fused for fused, members in state["packed"].items() if short in members), short)
        fused_name = f"{prefix}.{short}" if prefix else short
        return fused_name if fused_name in state["linear_modules"] else None

    def _reload(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's in-place reload, as its worker's ``reload_weights`` runs it, without the worker's
        resets of LoRA, encoder and multimodal caches (the weight-transfer backend has no worker;
        the sync is tested with text-only models, which have none of them)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        with _quiet_reload_logs(), set_current_vllm_config(self.vllm_config):
            with experts_repacked(self.model()):
                reload_weights(
                    self.vllm_config, self.model(), iter(weights), weights_path=None, is_checkpoint_format=True
                )

    def _reload_with_groups(self, new: dict[str, torch.Tensor]) -> None:
        """Reload ``new`` and, for every linear layer it touches, the layer's other tensors from the
        shadows: vLLM reprocesses a layer from what it is given, and a fused layer given only some
        of its tensors (``q_proj.bias`` alone) would keep uninitialised memory for the rest. Then
        the shadows take the new values. On failure the engine's index is dropped (it may hold part
        of the change; only a full sync can tell)."""
        state = self._engine_state()
        touched = {self._linear_module_of(name) for name in new} - {None}
        group = dict(new)
        for name, shadow in state["shadows"].items():
            if name not in group and self._linear_module_of(name) in touched:
                group[name] = shadow
        try:
            self._reload(list(group.items()))
        except BaseException:
            state["index"] = None
            raise
        for name, tensor in new.items():
            if self._linear_module_of(name) is not None:
                state["shadows"][name] = tensor.detach().to(
                    "cpu", state["shadow_dtype"], copy=True, memory_format=torch.contiguous_format
                )

    def _load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint-format tensors into the engine: through the shadows in reload mode. A 16-bit
        copy of a wider tensor keeps what the load rounded away as its compensation (see
        :func:`~logra_optim.updates.merge_low_rank_compensated_`); any other copy holds the loaded
        values exactly and needs none."""
        state = self._engine_state()
        for name, _ in weights:
            state["compensation"].pop(name, None)
        if state["mode"] == "reload":
            self._reload_with_groups(dict(weights))
        else:
            self.model().load_weights(weights)
        for name, tensor in weights:
            placement = state["placements"].get(name)
            if placement is None or placement.whole_only:
                continue
            copy = self._copy_of(name)
            if copy.element_size() < 4 and tensor.element_size() > copy.element_size():
                # A shadow holds the whole matrix; what is loaded in place is this rank's share of it.
                exact = tensor.detach().reshape(placement.out_features, placement.in_features)
                if state["mode"] == "reload":
                    state["compensation"][name] = rounding_remainder(exact, copy)
                elif isinstance(placement, ExpertsPlacement):
                    state["compensation"][name] = experts_rounding_remainder(exact, copy, placement)
                else:
                    exact = exact[placement.factor_rows, placement.projection_cols]
                    state["compensation"][name] = rounding_remainder(exact, copy)

    def _check_tensors(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """What can be checked before vLLM's loader runs: floating tensors, and the shape of every
        linear weight this engine places (names it does not place go to vLLM's loader as they are)."""
        placements = self._engine_state()["placements"]
        for name, tensor in weights:
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise PayloadError(f"LoGRA sync: {name!r} is not a floating-point tensor")
            placement = placements.get(name)
            if placement is None:
                continue
            expected = (placement.out_features, placement.in_features)
            if isinstance(placement, ExpertsPlacement):
                expected = (placement.experts, placement.out_features // placement.experts, placement.in_features)
            if tuple(tensor.shape) != expected:
                raise PayloadError(
                    f"LoGRA sync: {name!r} is {tuple(tensor.shape)}, the engine's is "
                    f"{expected}; the trainer's model does not map onto it"
                )

    def full_sync(self, weights, update_index: int | str, shadow_dtype: str = "float32") -> dict:
        """Load full checkpoint-format weights (all of the model, or a subset) and mark the engine as
        being at ``update_index``. In reload mode, keep shadows of every linear layer's tensors.
        Arguments and tensors are checked first; a load that fails inside vLLM leaves the engine
        unsynced (index ``None``), so no compressed update applies until a full sync succeeds."""
        state = self._engine_state()
        weights = _named_tensors(weights)
        index, dtype = int(update_index), wire.dtype(shadow_dtype)
        if dtype not in SHADOW_DTYPES:
            raise PayloadError(
                f"LoGRA sync: shadow_dtype must be a floating dtype of at least 16 bits "
                f"({', '.join(map(str, SHADOW_DTYPES))}), got {shadow_dtype!r}"
            )
        self._check_tensors(weights)
        started = time.perf_counter()
        state["index"] = None  # until the load has succeeded
        if state["mode"] == "reload":
            state["shadow_dtype"] = dtype
        self._load_weights(weights)
        state["index"] = index
        return {"index": state["index"], "mode": state["mode"], "seconds": time.perf_counter() - started}

    def load(self, weights) -> dict:
        """Load some checkpoint-format tensors (e.g. trainable non-targets) without touching the index.
        In reload mode a linear layer's tensors also replace its shadows; send whole fused groups. A
        load that fails inside vLLM leaves the engine unsynced, as for :meth:`full_sync`."""
        state = self._engine_state()
        if state["index"] is None:
            raise RuntimeError("LoGRA sync: the engine has no synced weights yet; run a full sync first")
        weights = _named_tensors(weights)
        self._check_tensors(weights)
        index, state["index"] = state["index"], None
        self._load_weights(weights)
        state["index"] = index
        return {"index": state["index"], "tensors": len(weights)}

    def _check(self, payload: SyncPayload) -> None:
        """Everything that can go wrong, checked before any weight changes."""
        state = self._engine_state()
        if state["index"] is None:
            raise PayloadError("LoGRA sync: the engine has no synced base weights; run a full sync first")
        if payload.first_index != state["index"] + 1:
            raise PayloadError(
                f"LoGRA sync: payload starts at update {payload.first_index} but the engine is at update "
                f"{state['index']} (expected {state['index'] + 1}); an update was skipped or repeated, run a full sync"
            )
        placements = state["placements"]
        for update in payload.updates:
            for target in update.targets:
                placement = placements.get(target.name)
                if placement is None:
                    known = ", ".join(sorted(placements)[:4])
                    raise PayloadError(
                        f"LoGRA sync: update {update.index} names {target.name!r}, which is not a linear weight of "
                        f"this engine (e.g. {known} …)"
                    )
                if placement.whole_only:
                    raise PayloadError(
                        f"LoGRA sync: update {update.index} names {target.name!r}, which the checkpoint stores fused "
                        "and the engine splits in its own way; it can only be loaded whole (VLLMSync sends it so)"
                    )
                experts = isinstance(placement, ExpertsPlacement)
                rank = payload.expert_rank if experts else payload.rank
                if target.rank != rank:
                    raise PayloadError(
                        f"LoGRA sync: update {update.index}, {target.name!r}: factor of rank {target.rank}, but the "
                        f"payload's rank for {'expert' if experts else 'linear'} weights is {rank}"
                    )
                if (target.out_features, target.in_features) != (placement.out_features, placement.in_features):
                    raise PayloadError(
                        f"LoGRA sync: update {update.index}, {target.name!r}: the payload is for a "
                        f"{target.out_features}×{target.in_features} matrix, the engine's is "
                        f"{placement.out_features}×{placement.in_features}"
                    )
                if state["mode"] == "reload" and target.name not in state["shadows"]:
                    raise PayloadError(f"LoGRA sync: no shadow copy of {target.name!r}; the full sync did not send it")

    def apply(self, payload) -> dict:
        """Apply a :class:`SyncPayload` (bytes, or base64 over the server's RPC): ``W ← W − F A`` per
        target and update, in order. A bad payload raises :class:`PayloadError` and changes nothing."""
        started = time.perf_counter()
        payload = SyncPayload.decode(wire.from_wire(payload)) if isinstance(payload, (bytes, str)) else payload
        self._check(payload)
        self._prepare_compensation(payload)
        state = self._engine_state()
        try:
            if state["mode"] == "reload":
                self._apply_to_shadows(payload)
            else:
                self._apply_in_place(payload)
        except BaseException:
            state["index"] = None  # possibly half applied: only a full sync can tell
            raise
        state["index"] = payload.last_index
        return {"index": state["index"], "mode": state["mode"], "seconds": time.perf_counter() - started}

    def patch(self, patches) -> dict:
        """Lossless sparse-delta sync, the baseline LoGRA's factors are measured against (as vLLM's
        ``sparse_nccl`` backend sends it): ``{name: (flat int32 indices, values)}`` write the changed
        entries of whole checkpoint matrices, which the engine then holds exactly. Checked first (names,
        index range, dtypes); a tensor-parallel engine is refused (its shards are not whole matrices)."""
        started = time.perf_counter()
        state = self._engine_state()
        patches = wire.load(patches) if isinstance(patches, (bytes, str)) else patches
        if state["index"] is None:
            raise PayloadError("LoGRA sync: the engine has no synced weights yet; run a full sync first")
        for name, (indices, values) in patches.items():
            placement = state["placements"].get(name)
            if placement is None or placement.whole_only or isinstance(placement, ExpertsPlacement):
                raise PayloadError(f"LoGRA sync: {name!r} is not a linear weight this engine can patch")
            if placement.projection_cols != slice(0, placement.in_features) or (
                placement.factor_rows != slice(0, placement.out_features)
            ):
                raise PayloadError(f"LoGRA sync: sparse patches need whole matrices; {name!r} is sharded here")
            numel = placement.out_features * placement.in_features
            if indices.dtype != torch.int32 or indices.dim() != 1 or indices.shape != values.shape:
                raise PayloadError(f"LoGRA sync: patch of {name!r} needs 1-D int32 indices and values of one length")
            if len(indices) and not (0 <= int(indices.min()) and int(indices.max()) < numel):
                raise PayloadError(f"LoGRA sync: patch of {name!r} indexes outside its {numel} entries")
            if not values.is_floating_point():
                raise PayloadError(f"LoGRA sync: patch of {name!r} has {values.dtype} values")
        staged = {}
        for name, (indices, values) in patches.items():
            # Reload mode: a staged copy of the shadow, reloaded below; in place: a view of the rows.
            copy = self._copy_of(name)
            target = copy.clone() if state["mode"] == "reload" else copy
            target.view(-1).index_copy_(0, indices.to(target.device, torch.long), values.to(target))
            if state["mode"] == "reload":
                staged[name] = target
            state["compensation"].pop(name, None)  # the engine now holds these values exactly
        if staged:
            self._reload_with_groups(staged)
        return {"index": state["index"], "seconds": time.perf_counter() - started}

    def _copy_of(self, name: str) -> torch.Tensor:
        """The engine's own copy of a target's rows: its shadow (reload mode) or its loaded rows."""
        state = self._engine_state()
        placement = state["placements"][name]
        if state["mode"] == "reload":  # experts: the E·d × k matrix of the stacked shadow
            return state["shadows"][name].view(placement.out_features, placement.in_features)
        if isinstance(placement, ExpertsPlacement):  # the whole local parameter; blocks index into it
            return getattr(self._layers()[placement.module], placement.parameter).data
        return self._layers()[placement.module].weight.data[placement.param_rows]

    def _prepare_compensation(self, payload: SyncPayload) -> None:
        """Allocate, before anything changes, the compensation buffers this payload needs: a 16-bit
        copy following an fp32-master trainer would otherwise round away every update below half an
        ulp (all of them, at RL step sizes). Kahan summation keeps them until they add up."""
        compensation = self._engine_state()["compensation"]
        for update in payload.updates:
            for target in update.targets:
                copy = self._copy_of(target.name)
                if target.rounding == "exact" and copy.element_size() < 4 and target.name not in compensation:
                    compensation[target.name] = torch.zeros_like(copy)

    def _apply_to_shadows(self, payload: SyncPayload) -> None:
        state = self._engine_state()
        staged: dict[str, torch.Tensor] = {}
        staged_compensation: dict[str, torch.Tensor] = {}
        projection = projections_of(payload)
        for update in payload.updates:
            for target in update.targets:
                if target.name not in staged:
                    staged[target.name] = state["shadows"][target.name].clone()
                    if target.name in state["compensation"]:
                        staged_compensation[target.name] = state["compensation"][target.name].clone()
                placement = state["placements"][target.name]
                merge_like_trainer_(
                    staged[target.name].view(placement.out_features, placement.in_features),  # experts: E·d × k
                    target,
                    projection(target),
                    staged_compensation.get(target.name),
                )
        self._reload_with_groups(staged)
        state["compensation"].update(staged_compensation)

    def _apply_in_place(self, payload: SyncPayload) -> None:
        state = self._engine_state()
        projections: dict[torch.device, Callable] = {}
        for update in payload.updates:
            for target in update.targets:
                placement = state["placements"][target.name]
                rows = self._copy_of(target.name)
                if rows.device not in projections:
                    projections[rows.device] = projections_of(payload, rows.device)
                projection = projections[rows.device](target)
                compensation = state["compensation"].get(target.name)
                if isinstance(placement, ExpertsPlacement):
                    merge_into_experts_(rows, placement, target, projection, compensation)
                    continue
                merge_like_trainer_(
                    rows,
                    target,
                    projection,
                    compensation,
                    placement.factor_rows,
                    placement.projection_cols,
                )

    def unknown_targets(self, names: list[str]) -> list[str]:
        """The ``names`` this engine has no placement for (its model does not map onto them)."""
        placements = self._engine_state()["placements"]
        return [name for name in names if name not in placements]

    def check_targets(self, names: list[str]) -> None:
        """Refuse, before any update, targets this engine cannot update by factors: names that are
        not one of its linear weights, and matrices it can only load whole (the weight-transfer
        backend has no channel to ask the trainer to send those whole, as the extension does)."""
        placements = self._engine_state()["placements"]
        unknown = [name for name in names if name not in placements]
        if unknown:
            known = ", ".join(sorted(placements)[:4])
            raise PayloadError(
                f"LoGRA sync: {len(unknown)} target names are not linear weights of this engine, e.g. "
                f"{unknown[0]!r} (the engine's are like {known} …); the trainer's model does not map onto it"
            )
        whole = [name for name in names if placements[name].whole_only]
        if whole:
            raise PayloadError(
                f"LoGRA sync: {whole[0]!r} and {len(whole) - 1} more are stored fused in the checkpoint and split by "
                "this engine its own way; they can only be loaded whole, which the worker extension path does "
                "(LLM(..., worker_extension_cls=EXTENSION))"
            )

    def verify(self, expected, seed: int, drift_bound: float) -> dict:
        """The drift check on the engine's side: ``expected`` (wire text of ``{name: {dtype name:
        W p}}``) is the trainer's float64 ``W p`` per target, its weights rounded to each dtype the
        engine may hold them in; the probe ``p`` is drawn from ``seed``. Measures what
        :meth:`checksums` returns to a trainer that can read results, and raises :class:`DriftError`
        (the measurement as JSON in its message) when the copy or the served weights drift past the
        bound (served: ``max(drift_bound, 4·eps)`` of the engine dtype). A row-parallel shard holds a
        partial product only; under tensor parallelism those layers are not checked here."""
        expected = wire.load(expected)
        result = self.checksum_table(sorted(expected), seed)
        copy_dtype, served_dtype = result["copy_dtype"], result["served_dtype"]
        pairs = []
        for name, sums in expected.items():
            start, copy, served, partial = result[name]
            if partial:
                continue
            if copy_dtype not in sums or served_dtype not in sums:
                raise PayloadError(f"LoGRA sync: verify sent no checksums in {copy_dtype}/{served_dtype} for {name!r}")
            rows = slice(start, start + copy.numel())
            served = None if served is None else (served, sums[served_dtype][rows])
            pairs.append(((copy, sums[copy_dtype][rows]), served))
        measured = compare_checksums(pairs, wire.dtype(served_dtype), drift_bound)
        if drift_exceeded(measured, drift_bound):
            raise DriftError(f"{DRIFT_MARKER}{json.dumps(measured)}")
        return measured

    def checksums(self, names: str, seed: int | str) -> str:
        """:meth:`checksum_table` as :func:`.wire.dump` text, for a trainer to compare."""
        return wire.dump(self.checksum_table(json.loads(names), int(seed)))

    @torch.no_grad()
    def checksum_table(self, names: list[str], seed: int) -> dict:
        """Checksums ``W p`` of the requested HF matrices:
        ``{"tp_size", "copy_dtype", "served_dtype", name: (row start, copy, served, partial)}``.

        ``copy``: float64 ``W p`` of the engine's own copy (the shadow in reload mode, the loaded
        rows in place), exact. ``served``: ``W p`` through the layer's forward kernel (its prepacked
        or quantized weights: what generation uses), in the engine's dtype, so it also catches a
        load that went wrong. ``partial``: a row-parallel rank's share, summed over the ranks.

        Stacked experts: ``W p`` of the ``E·d × k`` matrix; ``served`` is ``None`` (a fused experts
        kernel computes with all experts at once, through the router: there is no product to read
        one matrix's rows from). In place, a rank that holds a share of the matrix (tensor or expert
        parallelism) returns every row, zero where it holds nothing, as ``partial``."""
        state = self._engine_state()
        layers = self._layers()
        dtype = self.vllm_config.model_config.dtype
        result = {"tp_size": 1, "copy_dtype": str(state["shadow_dtype"]), "served_dtype": str(dtype)}
        for name in names:
            placement = state["placements"].get(name)
            if placement is None or placement.whole_only:
                raise PayloadError(f"LoGRA sync: {name!r} is not a linear weight this engine updates by factors")
            if isinstance(placement, ExpertsPlacement):
                result[name] = self._experts_checksum(name, placement, seed)
                result["copy_dtype"] = str(self._copy_of(name).dtype)
                parallel = layers[placement.module].moe_config.moe_parallel_config
                result["tp_size"] = parallel.tp_size * parallel.ep_size  # ranks that each hold a share
                continue
            layer = layers[placement.module]
            result["tp_size"] = getattr(layer, "tp_size", 1)
            probe = checksum_probe(projection_seed(seed, 0, name), placement.in_features)[placement.projection_cols]
            if state["mode"] == "reload":  # the shadow holds the whole matrix: check this rank's block of it
                copy = weight_checksum(placement.block_of(state["shadows"][name]), probe)
            else:
                weight = layer.weight.data[placement.param_rows]
                result["copy_dtype"] = str(weight.dtype)
                copy = weight_checksum(weight, probe).cpu()
            x = probe.to(device=layer.weight.device, dtype=dtype)
            served = layer.quant_method.apply(layer, x[None], bias=None)[0, placement.param_rows]
            partial = placement.projection_cols != slice(0, placement.in_features)
            result[name] = (placement.factor_rows.start, copy, served.double().cpu(), partial)
        return result

    def _experts_checksum(self, name: str, placement: ExpertsPlacement, seed: int) -> tuple:
        """:meth:`checksum_table`'s entry for stacked experts (no served product, see there)."""
        probe = checksum_probe(projection_seed(seed, 0, name), placement.in_features)
        copy = self._copy_of(name)
        if self._engine_state()["mode"] == "reload":
            return 0, weight_checksum(copy, probe), None, False
        sums = torch.zeros(placement.out_features, dtype=torch.float64)
        whole = sum(block.factor_rows.stop - block.factor_rows.start for block in placement.blocks)
        partial = whole != placement.out_features or any(
            block.projection_cols != slice(0, placement.in_features) for block in placement.blocks
        )
        for block in placement.blocks:
            held = copy[block.expert, block.param_rows, block.param_cols]
            sums[block.factor_rows] += weight_checksum(held, probe[block.projection_cols]).cpu()
        return 0, sums, None, partial

    def status(self) -> dict:
        state = self._engine_state()
        shadow_bytes = sum(t.numel() * t.element_size() for t in state["shadows"].values())
        return {
            "index": state["index"],
            "mode": state["mode"],
            "shadow_bytes": shadow_bytes,
            "targets": len(state["placements"]),
            "whole_only": sorted(name for name, p in state["placements"].items() if p.whole_only),
            "compensation_bytes": sum(t.numel() * t.element_size() for t in state["compensation"].values()),
            "dtype": str(self.vllm_config.model_config.dtype),
        }


def _updater(worker) -> EngineUpdater:
    """The worker's :class:`EngineUpdater`. ``collective_rpc`` hands a callable either the worker or
    its wrapper (which forwards attribute reads to it); the updater is always kept on the worker."""
    worker = getattr(worker, "worker", None) or worker
    updater = getattr(worker, "_logra_updater", None)
    if updater is None:
        updater = EngineUpdater(worker.model_runner.get_model, worker.vllm_config)
        worker._logra_updater = updater
    return updater


class LoGRAWorkerExtension:
    """Methods added to every vLLM worker by ``worker_extension_cls``; call them by name with
    ``collective_rpc("logra_apply", args=(payload,))`` etc. An engine in this process without the
    extension runs the same functions passed as callables (``collective_rpc`` gives them the worker,
    or its wrapper, as ``self``; :func:`_updater` accepts both)."""

    def logra_full_sync(self, weights, update_index, shadow_dtype="float32") -> dict:
        return _updater(self).full_sync(weights, update_index, shadow_dtype)

    def logra_load(self, weights) -> dict:
        return _updater(self).load(weights)

    def logra_apply(self, payload) -> dict:
        return _updater(self).apply(payload)

    def logra_patch(self, patches) -> dict:
        return _updater(self).patch(patches)

    def logra_checksums(self, names, seed) -> str:
        return _updater(self).checksums(names, seed)

    def logra_status(self) -> dict:
        return _updater(self).status()

    def logra_unknown_targets(self, names) -> list[str]:
        return _updater(self).unknown_targets(names)
