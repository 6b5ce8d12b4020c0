"""The ``logra`` backend of vLLM's weight-transfer API: runs inside every vLLM worker process.

vLLM (0.32+) updates a serving engine's weights through a registry of weight-transfer engines
chosen with ``--weight-transfer-config '{"backend": ...}'`` and driven through its own endpoints
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``; vLLM mounts them with ``VLLM_SERVER_DEV_MODE=1``). This module adds
``logra`` to that registry. Installing logra-optim registers it through vLLM's plugin entry point
(``vllm.general_plugins`` → :func:`.plugin.register`, run in every vLLM process before a worker builds its
engine), so a stock server accepts LoGRA syncs::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "logra"}'

No worker extension is needed: the backend hands every update to the same :class:`~.engine.EngineUpdater`
the extension uses, so "apply a payload" has one implementation. The transport is the update
request itself: each ``update_info`` carries a ``kind`` and its data as wire text (base64 of
``torch.save``, :mod:`.wire`), which works on any machine; :class:`~.trainer.VLLMSync` is the
sender. The endpoints return no data, so the drift check runs here (``kind="verify"``): the
trainer sends its own checksums and the engine refuses when its copy has drifted past the bound.

With ``transport="nccl"`` or ``"gloo"`` in the init info, the tensors of each update come over a
process group with the trainer instead, in vLLM's packing, and the request carries the rest
(:mod:`.transport`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import vllm.envs as envs
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from logra_optim.sync import SyncPayload

from . import transport, wire
from .engine import EngineUpdater
from .plugin import PROTOCOL
from .transport import DEFAULT_BUFFER_BYTES

__all__ = ["LoGRAInitInfo", "LoGRAUpdateInfo", "LoGRAWeightTransferEngine"]

KINDS = ("full", "load", "apply", "verify", "patch")
TENSOR_KINDS = ("full", "load", "apply", "patch")  # the kinds whose tensors may come over a process group


@dataclass
class LoGRAInitInfo(WeightTransferInitInfo):
    """``protocol``: the trainer's :data:`.plugin.PROTOCOL`. ``targets``: the checkpoint names it will
    update by factors, checked against the engine's linear layers once, before any update.
    ``transport``: where updates' tensors travel (:mod:`.transport`); for ``"nccl"`` and ``"gloo"``
    the packing's ``buffer_bytes`` and the rendezvous: the trainer's TCP store at ``master_address``
    and ``master_port``, NCCL's own at ``group_port``, ``world_size`` = 1 + the engine's workers.
    Without the rendezvous, an init only checks (the trainer asks that first, so that a refusal
    never leaves it waiting for workers that will not come)."""

    protocol: int
    targets: list[str] = field(default_factory=list)
    transport: str = "request"
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    master_address: str | None = None
    master_port: int | None = None
    group_port: int | None = None
    world_size: int | None = None
    link: str | None = None


@dataclass
class LoGRAUpdateInfo(WeightTransferUpdateInfo):
    """One update. ``kind``: ``"full"`` (checkpoint tensors; the engine is then at
    ``update_index``), ``"load"`` (some tensors, e.g. trainable non-targets), ``"apply"`` (a
    :class:`~logra_optim.sync.SyncPayload`) or ``"verify"`` (the trainer's checksums, seed and
    ``drift_bound``), or ``"patch"`` (a lossless sparse delta: changed entries and their indices, the
    baseline of ``benchmarks/bench_sync.py``). ``data``: the tensors, payload, checksums or patches as
    wire text; with a process-group transport, without its tensors, which follow over the group as
    ``tensors`` (``[dtype, shape]`` each) describes, as transfer number ``transfer`` of the group
    the trainer opened under the token ``link``."""

    kind: str
    data: str
    tensors: list | None = None
    transfer: int = 0
    link: str | None = None
    update_index: int | None = None
    shadow_dtype: str = "float32"
    seed: int = 0
    drift_bound: float = 1e-3


class LoGRAWeightTransferEngine(WeightTransferEngine[LoGRAInitInfo, LoGRAUpdateInfo]):
    """Applies LoGRA syncs sent through vLLM's weight-transfer endpoints (see the module docstring).

    Every update is applied in place or through vLLM's own reload as it arrives
    (:class:`~.engine.EngineUpdater`), checked before anything changes, so ``start_weight_update``
    and ``finish_weight_update`` have nothing to do."""

    init_info_cls = LoGRAInitInfo
    update_info_cls = LoGRAUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.updater = EngineUpdater(lambda: self.model, vllm_config)
        self.initialised = False
        self.link: transport.Link | None = None
        self.link_token: str | None = None
        self.buffer_bytes = DEFAULT_BUFFER_BYTES

    def parse_init_info(self, init_dict: dict) -> LoGRAInitInfo:
        if "protocol" not in init_dict and ("master_address" in init_dict or "nccl_unique_id_b64" in init_dict):
            raise ValueError(
                "LoGRA weight transfer: this server runs the logra backend, and an NCCL client (TRL's VLLMClient) "
                "tried to open an NCCL group with it; import logra_optim.integrations.trl before building the "
                "trainer, or sync with logra_optim.integrations.vllm.VLLMSync"
            )
        return super().parse_init_info(init_dict)

    def init_transfer_engine(self, init_info: LoGRAInitInfo) -> None:
        if init_info.protocol != PROTOCOL:
            raise ValueError(
                f"LoGRA weight transfer: the trainer speaks protocol {init_info.protocol}, this engine's logra-optim "
                f"speaks {PROTOCOL}; install the same logra-optim version in the trainer and the vLLM server"
            )
        kind = init_info.transport
        if kind not in transport.TRANSPORTS:
            raise ValueError(
                f"LoGRA weight transfer: transport must be one of {', '.join(transport.TRANSPORTS)}, got {kind!r}"
            )
        if not isinstance(init_info.buffer_bytes, int) or init_info.buffer_bytes < 1:
            raise ValueError(
                f"LoGRA weight transfer: buffer_bytes must be a positive integer, got {init_info.buffer_bytes!r}"
            )
        if kind == "nccl" and self.device.type != "cuda":
            raise ValueError(
                f"LoGRA weight transfer: transport 'nccl' needs GPU workers, this one runs on {self.device}"
            )
        if kind == "nccl" and envs.VLLM_DISABLE_PYNCCL:
            raise ValueError(
                "LoGRA weight transfer: transport 'nccl' needs vLLM's NCCL, off here (VLLM_DISABLE_PYNCCL)"
            )
        self.updater.check_targets(init_info.targets)
        rendezvous = (init_info.master_address, init_info.master_port, init_info.world_size)
        if kind != "request" and None in rendezvous:
            return  # checks only
        parallel = self.parallel_config
        rank = 1 + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.shutdown()
        if kind != "request":
            self.link = transport.Link(
                kind, init_info.master_address, init_info.master_port, init_info.group_port, rank, init_info.world_size
            )
            self.buffer_bytes, self.link_token = init_info.buffer_bytes, init_info.link
        self.initialised = True

    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict) -> None:
        # The base class synchronises ``torch.accelerator``, which raises on a CPU-only build.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: LoGRAUpdateInfo) -> None:
        if not self.initialised:
            raise RuntimeError("LoGRA weight transfer: not initialised; call /init_weight_transfer_engine first")
        kind, data = update_info.kind, update_info.data
        if update_info.tensors is not None:
            if self.link is None:
                raise RuntimeError(
                    "LoGRA weight transfer: this update's tensors come over a process group, but none is open "
                    "(the engine was initialised again since); the trainer must initialise it again"
                )
            if update_info.link != self.link_token:
                raise RuntimeError(
                    "LoGRA weight transfer: this update was sent over another trainer's group (the engine was "
                    "initialised again since); that trainer must initialise it again"
                )
            if kind not in TENSOR_KINDS:
                raise ValueError(f"LoGRA weight transfer: a {kind!r} update carries no tensors over the group")
            try:
                buffers = transport.receive_buffers(update_info.tensors, self.buffer_bytes, self.link.device)
            except BaseException:
                self.link.refuse(update_info.transfer)
                raise
            self.link.mark_ready(update_info.transfer)  # returns when the trainer says go
            received = transport.receive_tensors(self.link, buffers)
            data = transport.join_tensors(wire.load(data), received)
            if kind == "apply":
                data = SyncPayload.from_dict(data)
        if kind == "full":
            if update_info.update_index is None:
                raise ValueError("LoGRA weight transfer: a full update needs update_index")
            self.updater.full_sync(data, update_info.update_index, update_info.shadow_dtype)
        elif kind == "load":
            self.updater.load(data)
        elif kind == "apply":
            self.updater.apply(data)
        elif kind == "patch":
            self.updater.patch(data)
        elif kind == "verify":
            self.updater.verify(data, update_info.seed, update_info.drift_bound)
        else:
            raise ValueError(f"LoGRA weight transfer: update kind must be one of {', '.join(KINDS)}, got {kind!r}")

    def shutdown(self) -> None:
        self.initialised = False
        if self.link is not None:
            self.link.destroy()
        self.link, self.link_token = None, None
