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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .engine import EngineUpdater
from .plugin import PROTOCOL

__all__ = ["LoGRAInitInfo", "LoGRAUpdateInfo", "LoGRAWeightTransferEngine"]

KINDS = ("full", "load", "apply", "verify", "patch")


@dataclass
class LoGRAInitInfo(WeightTransferInitInfo):
    """``protocol``: the trainer's :data:`.plugin.PROTOCOL`. ``targets``: the checkpoint names it will
    update by factors, checked against the engine's linear layers once, before any update."""

    protocol: int
    targets: list[str] = field(default_factory=list)


@dataclass
class LoGRAUpdateInfo(WeightTransferUpdateInfo):
    """One update. ``kind``: ``"full"`` (checkpoint tensors; the engine is then at
    ``update_index``), ``"load"`` (some tensors, e.g. trainable non-targets), ``"apply"`` (a
    :class:`~logra_optim.sync.SyncPayload`) or ``"verify"`` (the trainer's checksums, seed and
    ``drift_bound``), or ``"patch"`` (a lossless sparse delta: changed entries and their indices, the
    baseline of ``benchmarks/bench_sync.py``). ``data``: the tensors, payload, checksums or patches as
    wire text."""

    kind: str
    data: str
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

    def parse_init_info(self, init_dict: dict) -> LoGRAInitInfo:
        if "master_address" in init_dict or "nccl_unique_id_b64" in init_dict:
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
        self.updater.check_targets(init_info.targets)
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
