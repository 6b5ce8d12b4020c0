"""vLLM adapter: keep a rollout engine's weights in step with LoGRA by sending ``(F, seed)``.

The sync spans two processes, and the code is split the same way:

* :mod:`.engine` runs inside every vLLM worker: :class:`EngineUpdater` regenerates every target's
  ``A`` from the seed and applies ``W ← W − F A`` (docs/method.md §4). Two front ends hand it the
  updates: :class:`LoGRAWorkerExtension` for an ``LLM`` object
  (``LLM(..., worker_extension_cls=EXTENSION)``, ``collective_rpc``), and for a server the ``logra``
  backend of vLLM's weight-transfer API (:mod:`.backend`, registered by :mod:`.plugin`).
* :mod:`.trainer` runs beside the optimizer: :class:`VLLMSync` records what the optimizer merges,
  sends it as a :class:`~logra_optim.sync.SyncPayload` and watches the drift between the copies.
* :mod:`.placement` is the pure geometry both rely on: which rows and columns of a Hugging Face
  matrix a fused, tensor-parallel engine layer holds (experts included). :mod:`.experts` is the
  engine side of vLLM's fused mixture-of-experts layers. :mod:`.wire` is how values cross between
  the two sides (base64 text inside a server's update requests).

The names below are loaded on first use, so that a vLLM worker importing :mod:`.engine` (which
imports this package first) loads neither the trainer side nor anything else it does not need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plugin import BACKEND, PROTOCOL, register
    from .engine import EXTENSION, EngineUpdater, LoGRAWorkerExtension, engine_placements
    from .placement import Placement, column_parallel_placements, row_parallel_placement
    from .trainer import ServerError, VLLMServer, VLLMSync, server_backend

# Where each public name lives (``__all__`` below lists the same names, for readers and linters).
_HOMES = {
    "BACKEND": "plugin",
    "PROTOCOL": "plugin",
    "register": "plugin",
    "EXTENSION": "engine",
    "EngineUpdater": "engine",
    "LoGRAWorkerExtension": "engine",
    "engine_placements": "engine",
    "Placement": "placement",
    "column_parallel_placements": "placement",
    "row_parallel_placement": "placement",
    "VLLMSync": "trainer",
    "VLLMServer": "trainer",
    "ServerError": "trainer",
    "server_backend": "trainer",
}

__all__ = [
    "BACKEND",
    "PROTOCOL",
    "register",
    "EXTENSION",
    "EngineUpdater",
    "LoGRAWorkerExtension",
    "Placement",
    "ServerError",
    "VLLMServer",
    "VLLMSync",
    "column_parallel_placements",
    "engine_placements",
    "row_parallel_placement",
    "server_backend",
]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
