"""vLLM adapter: keep a rollout engine's weights in step with LoGRA by sending ``(F, seed)``.

Two halves, one per process:

* :class:`EngineUpdater` runs inside every vLLM worker, reached through
  :class:`LoGRAWorkerExtension` (``LLM(..., worker_extension_cls=EXTENSION)`` or
  ``python -m vllm.entrypoints.openai.api_server --worker-extension-cls
  logra_optim.integrations.vllm.LoGRAWorkerExtension``). It regenerates each target's ``A`` from
  the seed and applies ``W ← W − F A`` (METHOD.md §4).
* :class:`VLLMSync` runs beside the optimizer: it records what the optimizer merges, sends it as a
  :class:`~logra_optim.sync.SyncPayload`, and watches the drift between the two copies.

How the engine applies an update depends on where its weights live:

* **in place** (CUDA, unquantized): each target's rows of the loaded, possibly fused and
  tensor-parallel, parameter are updated directly. vLLM stacks ``q/k/v_proj`` into ``qkv_proj`` and
  ``gate/up_proj`` into ``gate_up_proj``: each member gets its own rows. A column-parallel layer
  holds a slice of the rows (its rows of ``F``), a row-parallel one (``o_proj``, ``down_proj``) a
  slice of the columns (its columns of ``A``): see :func:`column_parallel_placements`.
* **reload** (the CPU backend, which prepacks linears and leaves ``layer.weight`` empty; quantized
  layers): the extension keeps checkpoint-format shadow copies (fp32 by default) of every linear
  layer's tensors, updates those, and hands whole fused groups to vLLM's ``reload_weights``. fp32
  shadows mean the engine's bf16 weights are re-rounded from an exact copy each time, so rounding
  does not accumulate.

Server mode: vLLM's ``POST /collective_rpc`` (with ``VLLM_SERVER_DEV_MODE=1``) passes only strings,
so payloads travel as base64 of :meth:`SyncPayload.encode`.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from logra_optim.distributed import REPLICATED
from logra_optim.projection import canonical_name, projection_seed
from logra_optim.sync import (
    PayloadError,
    SyncPayload,
    UpdateRecorder,
    checksum_probe,
    from_bytes,
    projection_of,
    relative_drift,
    to_bytes,
    weight_checksum,
)
from logra_optim.updates import merge_low_rank_

__all__ = ["EXTENSION", "EngineUpdater", "LoGRAWorkerExtension", "Placement", "VLLMSync"]

EXTENSION = "logra_optim.integrations.vllm.LoGRAWorkerExtension"

# --------------------------------------------------------------------------------------------------
# Where a checkpoint matrix lives in the engine (pure functions of the layer geometry)


@dataclass(frozen=True)
class Placement:
    """Where the HF matrix ``name`` (``out_features × in_features``) lives on one engine rank.

    ``W_local[param_rows, :] ↔ W[factor_rows, projection_cols]``: the rank's update is
    ``W_local[param_rows] −= F[factor_rows] · A[:, projection_cols]``.
    """

    module: str
    out_features: int
    in_features: int
    factor_rows: slice
    param_rows: slice
    projection_cols: slice


def column_parallel_placements(
    module: str,
    members: list[str],
    out_features: list[int],
    local_sizes: list[int],
    shard_ranks: list[int],
    in_features: int,
) -> dict[str, Placement]:
    """Placements of the members of a (fused) column-parallel layer on one rank.

    Member ``i`` is an ``out_features[i] × in_features`` HF matrix. The local parameter stacks the
    members' local row blocks in order; member ``i`` holds rows
    ``[shard_ranks[i]·local_sizes[i], (shard_ranks[i]+1)·local_sizes[i])`` of its HF matrix. vLLM
    uses ``shard_rank = tp_rank`` except for the k/v blocks of ``qkv_proj`` when KV heads are
    replicated (``tp_rank // replicas``).
    """
    placements, offset = {}, 0
    for member, rows, size, shard in zip(members, out_features, local_sizes, shard_ranks):
        placements[member] = Placement(
            module=module,
            out_features=rows,
            in_features=in_features,
            factor_rows=slice(shard * size, (shard + 1) * size),
            param_rows=slice(offset, offset + size),
            projection_cols=slice(0, in_features),
        )
        offset += size
    return placements


def row_parallel_placement(module: str, out_features: int, in_per_rank: int, tp_rank: int, tp_size: int) -> Placement:
    """A row-parallel layer (input dim split): all rows, this rank's columns of ``A``."""
    return Placement(
        module=module,
        out_features=out_features,
        in_features=in_per_rank * tp_size,
        factor_rows=slice(0, out_features),
        param_rows=slice(0, out_features),
        projection_cols=slice(tp_rank * in_per_rank, (tp_rank + 1) * in_per_rank),
    )


def engine_placements(model: nn.Module) -> dict[str, Placement]:
    """Every linear weight of a vLLM model by its HF checkpoint name (``…q_proj.weight``)."""
    from vllm.model_executor.layers.linear import (
        LinearBase,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    packed = getattr(model, "packed_modules_mapping", {}) or {}
    placements: dict[str, Placement] = {}
    for name, layer in model.named_modules():
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
        placements.update(column_parallel_placements(name, members, full, local, shards, layer.input_size))
    return placements


# --------------------------------------------------------------------------------------------------
# Wire helpers: the server's /collective_rpc passes strings only


def _to_wire(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _from_wire(data: bytes | str) -> bytes:
    return base64.b64decode(data) if isinstance(data, str) else data


def _load(data: bytes | str):
    return from_bytes(_from_wire(data))


def _weights(weights) -> list[tuple[str, torch.Tensor]]:
    if isinstance(weights, (bytes, str)):
        weights = _load(weights)
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


# --------------------------------------------------------------------------------------------------
# Engine side


class EngineUpdater:
    """The engine side of the sync, one per vLLM worker (kept on the worker, see :func:`_updater`).

    ``state``: the update index the weights are at (``None`` until the first full sync, and after a
    failed reload), the mode and, in reload mode, the shadow copies. Every public method returns
    plain JSON-able values, so the server's RPC endpoint can carry them.
    """

    def __init__(self, worker):
        self.worker, self.model_runner = worker, worker.model_runner
        self._state = None

    def _engine_state(self) -> dict:
        state = self._state
        if state is None:
            from vllm.model_executor.layers.linear import UnquantizedLinearMethod

            model = self.model_runner.model
            placements = engine_placements(model)
            layers = dict(model.named_modules())
            # In place only where every linear holds its plain (unpacked, unquantized) weight shard.
            inplace = all(
                layers[p.module].weight.dim() == 2
                and layers[p.module].weight.numel() > 0
                and isinstance(getattr(layers[p.module], "quant_method", None), UnquantizedLinearMethod)
                for p in placements.values()
            )
            state = {
                "index": None,
                "mode": "inplace" if inplace else "reload",
                "placements": placements,
                "linear_modules": {p.module for p in placements.values()},
                "packed": getattr(model, "packed_modules_mapping", {}) or {},
                "shadows": {},
                "shadow_dtype": torch.float32,
            }
            self._state = state
        return state

    def _linear_module_of(self, name: str) -> str | None:
        """The engine linear module a checkpoint tensor loads into (fused groups: the fused one)."""
        state = self._engine_state()
        module_path, _, _ = name.rpartition(".")
        prefix, _, short = module_path.rpartition(".")
        short = next((fused for fused, members in state["packed"].items() if short in members), short)
        fused_name = f"{prefix}.{short}" if prefix else short
        return fused_name if fused_name in state["linear_modules"] else None

    def _reload(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        with _quiet_reload_logs():
            self.worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)

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
                state["shadows"][name] = tensor.detach().to("cpu", state["shadow_dtype"], copy=True)

    def full_sync(self, weights, update_index: int | str, shadow_dtype: str = "float32") -> dict:
        """Load full checkpoint-format weights (all of the model, or a subset) and mark the engine as
        being at ``update_index``. In reload mode, keep shadows of every linear layer's tensors."""
        state = self._engine_state()
        weights = _weights(weights)
        started = time.perf_counter()
        state["index"] = None  # until the load has succeeded
        if state["mode"] == "reload":
            state["shadow_dtype"] = getattr(torch, str(shadow_dtype))
            self._reload_with_groups(dict(weights))
        else:
            self.model_runner.model.load_weights(weights)
        state["index"] = int(update_index)
        return {"index": state["index"], "mode": state["mode"], "seconds": time.perf_counter() - started}

    def load(self, weights) -> dict:
        """Load some checkpoint-format tensors (e.g. trainable non-targets) without touching the index.
        In reload mode a linear layer's tensors also replace its shadows; send whole fused groups."""
        state = self._engine_state()
        if state["index"] is None:
            raise RuntimeError("LoGRA sync: the engine has no synced weights yet; run a full sync first")
        weights = _weights(weights)
        if state["mode"] == "reload":
            self._reload_with_groups(dict(weights))
        else:
            self.model_runner.model.load_weights(weights)
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
        payload = SyncPayload.decode(_from_wire(payload)) if isinstance(payload, (bytes, str)) else payload
        self._check(payload)
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

    def _apply_to_shadows(self, payload: SyncPayload) -> None:
        state = self._engine_state()
        staged: dict[str, torch.Tensor] = {}
        for update in payload.updates:
            for target in update.targets:
                if target.name not in staged:
                    staged[target.name] = state["shadows"][target.name].clone()
                merge_low_rank_(
                    staged[target.name], target.factor, projection_of(payload, target), stochastic_rounding=False
                )
        self._reload_with_groups(staged)

    def _apply_in_place(self, payload: SyncPayload) -> None:
        state = self._engine_state()
        layers = dict(self.model_runner.model.named_modules())
        for update in payload.updates:
            for target in update.targets:
                placement = state["placements"][target.name]
                weight = layers[placement.module].weight.data
                projection = projection_of(payload, target, device=weight.device)[:, placement.projection_cols]
                factor = target.factor.to(weight.device)[placement.factor_rows]
                merge_low_rank_(weight[placement.param_rows], factor, projection, stochastic_rounding=False)

    @torch.no_grad()
    def checksums(self, names: str, seed: int | str) -> str:
        """Checksums ``W p`` of the requested HF matrices, base64 of ``torch.save``: ``{"tp_size",
        "copy_dtype", "served_dtype", name: (row start, copy, served, partial)}``.

        ``copy``: float64 ``W p`` of the engine's own copy (the shadow in reload mode, the loaded
        rows in place), exact. ``served``: ``W p`` through the layer's forward kernel (its prepacked
        or quantized weights: what generation uses), in the engine's dtype, so it also catches a
        load that went wrong. ``partial``: a row-parallel rank's share, summed over the ranks."""
        state = self._engine_state()
        names, seed = json.loads(names), int(seed)
        layers = dict(self.model_runner.model.named_modules())
        dtype = self.worker.model_config.dtype
        result = {"tp_size": 1, "copy_dtype": str(state["shadow_dtype"]), "served_dtype": str(dtype)}
        for name in names:
            placement = state["placements"].get(name)
            if placement is None:
                raise PayloadError(f"LoGRA sync: {name!r} is not a linear weight of this engine")
            layer = layers[placement.module]
            result["tp_size"] = getattr(layer, "tp_size", 1)
            probe = checksum_probe(projection_seed(seed, 0, name), placement.in_features)[placement.projection_cols]
            if state["mode"] == "reload":
                copy = weight_checksum(state["shadows"][name], probe)
            else:
                weight = layer.weight.data[placement.param_rows]
                result["copy_dtype"] = str(weight.dtype)
                copy = weight_checksum(weight, probe).cpu()
            x = probe.to(device=layer.weight.device, dtype=dtype)
            served = layer.quant_method.apply(layer, x[None], bias=None)[0, placement.param_rows]
            partial = placement.projection_cols != slice(0, placement.in_features)
            result[name] = (placement.factor_rows.start, copy, served.double().cpu(), partial)
        return _to_wire(to_bytes(result))

    def status(self) -> dict:
        state = self._engine_state()
        shadow_bytes = sum(t.numel() * t.element_size() for t in state["shadows"].values())
        return {
            "index": state["index"],
            "mode": state["mode"],
            "shadow_bytes": shadow_bytes,
            "targets": len(state["placements"]),
            "dtype": str(self.worker.model_config.dtype),
        }


def _updater(worker) -> EngineUpdater:
    """The worker's :class:`EngineUpdater`. ``collective_rpc`` hands a callable either the worker or
    its wrapper (which forwards attribute reads to it); the updater is always kept on the worker."""
    worker = getattr(worker, "worker", None) or worker
    updater = getattr(worker, "_logra_updater", None)
    if updater is None:
        updater = EngineUpdater(worker)
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

    def logra_checksums(self, names, seed) -> str:
        return _updater(self).checksums(names, seed)

    def logra_status(self) -> dict:
        return _updater(self).status()


# --------------------------------------------------------------------------------------------------
# Trainer side: transports


class _Colocated:
    """An ``LLM`` object of this process; its engine may run here or in a process of its own."""

    def __init__(self, llm):
        self.llm = llm
        extension = llm.llm_engine.vllm_config.parallel_config.worker_extension_cls or ""
        # By name when the workers have the extension (works across processes); otherwise the
        # functions themselves, which vLLM runs only in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
        # TRL's colocate mode) unless VLLM_ALLOW_INSECURE_SERIALIZATION=1 lets it pickle them.
        self.by_name = extension == EXTENSION

    def call(self, method: str, *args) -> list:
        return self.llm.collective_rpc(method if self.by_name else getattr(LoGRAWorkerExtension, method), args=args)

    def wire(self, data: bytes):
        return data

    def wire_weights(self, weights: list[tuple[str, torch.Tensor]]) -> tuple[Any, int]:
        if self.by_name:  # possibly another process (vLLM's default): its RPC carries bytes, not tensors
            data = to_bytes(dict(weights))
            return data, len(data)
        return weights, sum(t.numel() * t.element_size() for _, t in weights)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


class _Server:
    """A vLLM OpenAI server started with ``--worker-extension-cls`` and ``VLLM_SERVER_DEV_MODE=1``."""

    def __init__(self, url: str, timeout: float = 600.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def _post(self, path: str, body: dict | None = None):
        request = urllib.request.Request(
            self.url + path,
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            detail = error.read().decode()[:2000]
            raise RuntimeError(f"vLLM server {self.url}{path}: HTTP {error.code}: {detail}") from error
        return json.loads(text) if text else None

    def call(self, method: str, *args) -> list:
        return self._post("/collective_rpc", {"method": method, "args": [str(a) for a in args]})["results"]

    def wire(self, data: bytes) -> str:
        return _to_wire(data)

    def wire_weights(self, weights: list[tuple[str, torch.Tensor]]) -> tuple[str, int]:
        data = _to_wire(to_bytes(dict(weights)))
        return data, len(data)

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache")


# --------------------------------------------------------------------------------------------------
# Trainer side: the sync


class VLLMSync:
    """Keeps a vLLM engine's weights equal to the trainer's, sending ``(F, seed)`` per update.

    Args:
        optimizer: the :class:`~logra_optim.LoGRAOptimizer` whose updates are sent.
        engine: an ``LLM`` (colocated), or the base URL of a vLLM server started with
            ``--worker-extension-cls`` and ``VLLM_SERVER_DEV_MODE=1``. An ``LLM`` whose engine runs
            in its own process (vLLM's default) needs ``worker_extension_cls=EXTENSION``; one
            running in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, TRL's colocate mode)
            works without it.
        named_parameters: ``() -> iterable of (checkpoint name, tensor)`` giving the full weights
            for a full sync (default: the optimizer's model, wrapper prefixes stripped). Under
            FSDP/ZeRO-3 pass one that gathers them (TRL's does).
        check_every: compare engine and trainer checksums every this many compressed syncs (0: never).
        drift_bound: a relative weight difference above this triggers a full sync.
        full_every: a full sync every this many syncs regardless (``None``: only when needed).
        shadow_dtype: dtype of the engine's shadow copies in reload mode.
        log: ``f(dict)`` called after every sync with its statistics (kind, bytes, seconds, drift).

    Call :meth:`sync` whenever the engine must catch up (before generating). The first call, a call
    after :meth:`mark_weights_discarded` (vLLM sleep level 2), every ``full_every``-th call and any
    call after a drift check failed send full weights; the others send the pending payload, or full
    weights when those would be smaller (many updates since the last sync).
    """

    def __init__(
        self,
        optimizer,
        engine,
        *,
        named_parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
        check_every: int = 10,
        drift_bound: float = 1e-3,
        full_every: int | None = None,
        shadow_dtype: torch.dtype = torch.float32,
        log: Callable[[dict], None] | None = None,
    ):
        if not isinstance(check_every, int) or check_every < 0:
            raise ValueError(f"check_every must be a non-negative integer, got {check_every!r}")
        if full_every is not None and (not isinstance(full_every, int) or full_every < 1):
            raise ValueError(f"full_every must be a positive integer or None, got {full_every!r}")
        if not drift_bound > 0:
            raise ValueError(f"drift_bound must be positive, got {drift_bound!r}")
        if check_every and any(layout.kind != REPLICATED for layout in optimizer._layouts):
            warnings.warn(
                "VLLMSync: the trainer's target weights are sharded (FSDP2/ZeRO-3); the drift check "
                "needs whole weights and is off (check_every=0)",
                stacklevel=2,
            )
            check_every = 0
        self.optimizer = optimizer
        self.engine = _Server(engine) if isinstance(engine, str) else _Colocated(engine)
        self.named_parameters = named_parameters or self._model_parameters
        self.check_every, self.drift_bound, self.full_every = check_every, drift_bound, full_every
        self.shadow_dtype = str(shadow_dtype).removeprefix("torch.")
        self.log = log
        self.recorder = UpdateRecorder(optimizer)
        self.needs_full = True
        self.syncs = 0
        self.compressed_since_check = 0
        self.stats: dict[str, Any] = {}
        self.history: list[dict] = []
        model = optimizer._model
        targets = {id(m.weight) for m in optimizer._modules}
        self._non_targets = [
            (canonical_name(n), p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in targets
        ]
        # What a full sync sends (every parameter, whole, as held): more pending update bytes → full.
        self._full_bytes = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters())
        self._target_names = [t.canonical_name + ".weight" for t in optimizer._targets]

    def _model_parameters(self):
        for name, parameter in self.optimizer._model.named_parameters():
            module, _, leaf = name.rpartition(".")
            yield (canonical_name(module) + "." + leaf if module else leaf), parameter.detach()

    def mark_weights_discarded(self) -> None:
        """The engine dropped its weights (``LLM.sleep(level=2)``): the next sync is a full one."""
        self.needs_full = True

    def close(self) -> None:
        self.recorder.close()

    def full_sync(self) -> dict:
        """Send every parameter; the engine is then at the optimizer's current update index."""
        started = time.perf_counter()
        # Copies: a gathering iterator (ZeRO-3, FSDP) frees a parameter's full data after yielding it.
        weights = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in self.named_parameters()]
        data, sent = self.engine.wire_weights(weights)
        self.needs_full = True  # until the engine has confirmed
        result = self.engine.call("logra_full_sync", data, self.optimizer.update_index, self.shadow_dtype)
        self.recorder.clear()
        self.needs_full = False
        self.compressed_since_check = 0
        return self._finish("full", sent, started, result[0]["seconds"])

    def sync(self) -> dict:
        """Bring the engine to the optimizer's current update (see the class docstring)."""
        self.syncs += 1
        if self.needs_full or (self.full_every is not None and self.syncs % self.full_every == 0):
            return self._logged(self.full_sync())
        if self.recorder.pending_bytes > self._full_bytes:
            return self._logged(self.full_sync())  # many updates since the last sync: full weights are smaller
        started = time.perf_counter()
        payload = self.recorder.drain()
        sent, engine_seconds = 0, 0.0
        self.needs_full = True  # until the engine has confirmed: a failed sync loses the drained updates
        if payload is not None:
            data = self.engine.wire(payload.encode())
            engine_seconds = self.engine.call("logra_apply", data)[0]["seconds"]
            sent += len(data)
        if self._non_targets:  # trainable non-targets (e.g. norms) are sent whole
            data, size = self.engine.wire_weights([(n, p.detach().to("cpu", copy=True)) for n, p in self._non_targets])
            self.engine.call("logra_load", data)
            sent += size
        self.needs_full = False
        stats = self._finish("compressed", sent, started, engine_seconds)
        self.compressed_since_check += 1
        if self.check_every and self.compressed_since_check >= self.check_every:
            self.compressed_since_check = 0
            measured = self.drift()
            stats.update(measured)
            if measured["drift"] > self.drift_bound or measured["served_drift"] > measured["served_bound"]:
                warnings.warn(
                    f"LoGRA sync: engine drift {measured} exceeds the bound; full sync", RuntimeWarning, stacklevel=2
                )
                stats = {**self.full_sync(), **{key + "_before": value for key, value in measured.items()}}
        return self._logged(stats)

    def _logged(self, stats: dict) -> dict:
        if self.log is not None:
            self.log(stats)
        return stats

    @torch.no_grad()
    def drift(self, seed: int | None = None) -> dict[str, float]:
        """Largest relative difference ``‖W_engine − W_trainer‖/‖W‖`` over the targets, estimated from
        one random matrix-vector product per target on each side (:func:`~logra_optim.sync.weight_checksum`):

        * ``drift``: the engine's own copy (fp32 shadows; in place: its loaded weights) against the
          trainer's weights rounded to that copy's dtype, so a bf16 engine's storage rounding cancels
          and what remains is what its merges lost or got wrong;
        * ``served_drift``: what the forward kernel computes with (prepacked weights included)
          against the trainer's weights, in the engine dtype. It catches a bad load but resolves only
          down to that dtype's rounding, so its bound is ``served_bound = max(drift_bound,
          4·eps(engine dtype))``.

        NaN when the engine runs tensor-parallel and only this process's rank answered (TRL's
        ``external_launcher``): a partial comparison would be meaningless."""
        seed = self.syncs if seed is None else seed
        results = [_load(r) for r in self.engine.call("logra_checksums", json.dumps(self._target_names), seed)]
        served_dtype = getattr(torch, results[0]["served_dtype"].removeprefix("torch."))
        copy_dtype = getattr(torch, results[0]["copy_dtype"].removeprefix("torch."))
        served_bound = max(self.drift_bound, 4 * torch.finfo(served_dtype).eps)
        if len(results) < results[0]["tp_size"]:
            return {"drift": math.nan, "served_drift": math.nan, "served_bound": served_bound}
        worst = {"drift": 0.0, "served_drift": 0.0}
        for name, module in zip(self._target_names, self.optimizer._modules):
            weight = module.weight.detach()
            probe = checksum_probe(projection_seed(seed, 0, name), weight.shape[1], device=weight.device)
            trainer = {
                "drift": weight_checksum(weight.to(copy_dtype), probe).cpu(),
                "served_drift": weight_checksum(weight.to(served_dtype), probe).cpu(),
            }
            engine = {key: torch.zeros_like(value) for key, value in trainer.items()}
            for result in results:
                start, copy, served, partial = result[name]
                rows = slice(start, start + copy.numel())
                for key, local in (("drift", copy), ("served_drift", served)):
                    if partial:
                        engine[key][rows] += local
                    else:
                        engine[key][rows] = local
            for key in worst:
                worst[key] = max(worst[key], relative_drift(engine[key], trainer[key]))
        return {**worst, "served_bound": served_bound}

    def _finish(self, kind: str, sent: int, started: float, engine_seconds: float) -> dict:
        """``seconds``: the whole sync as the trainer waits for it; ``engine_seconds``: the engine's
        part (decode, regenerate ``A``, merge, reload)."""
        self.engine.reset_prefix_cache()
        self.stats = {
            "kind": kind,
            "bytes": sent,
            "seconds": time.perf_counter() - started,
            "engine_seconds": engine_seconds,
            "update_index": self.optimizer.update_index,
        }
        self.history.append(self.stats)
        return self.stats
