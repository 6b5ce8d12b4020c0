"""The trainer side of the vLLM sync: runs beside the optimizer, in the trainer process.

:class:`VLLMSync` records what the optimizer merges (an :class:`~logra_optim.sync.UpdateRecorder`),
sends it to the engine's workers as a :class:`~logra_optim.sync.SyncPayload` and watches the drift
between the two copies, falling back to full weights when that is smaller or safer. It reaches the
workers through one of two transports with the same methods (``full_sync``, ``update``, ``load``,
``patch``, ``whole_only``): :class:`_Colocated` for an ``LLM`` object of this process (the worker extension,
``collective_rpc``), :class:`VLLMServer` for a vLLM server with the ``logra`` weight-transfer backend
(vLLM's own ``/update_weights`` endpoints). Everything it needs from the optimizer comes from its public read-only view:
``optimizer.model`` and ``optimizer.targets``.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import torch

from logra_optim.distributed import REPLICATED
from logra_optim.projection import canonical_name, projection_seed
from logra_optim.sync import (
    SyncPayload,
    Update,
    UpdateRecorder,
    checksum_probe,
    to_bytes,
    weight_checksum,
)

from . import wire
from .engine import (
    DRIFT_MARKER,
    EXTENSION,
    LEGACY_EXTENSION,
    LoGRAWorkerExtension,
    compare_checksums,
    drift_exceeded,
)
from .plugin import BACKEND, PROTOCOL
from .transport import (
    DEFAULT_BUFFER_BYTES,
    TRANSPORTS,
    Link,
    LinkAbandoned,
    address_towards,
    describe,
    free_ports,
    send_tensors,
    split_tensors,
)

__all__ = ["ServerError", "VLLMServer", "VLLMSync", "server_backend"]


def _cpu_copies(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Detached CPU copies: a gathering iterator (ZeRO-3, FSDP) frees a parameter's full data after
    yielding it."""
    return [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in named_tensors]


class _Colocated:
    """An ``LLM`` object of this process; its engine may run here or in a process of its own.
    Reaches the workers through ``collective_rpc`` and the worker extension's methods."""

    def __init__(self, llm):
        self.llm = llm
        extension = llm.llm_engine.vllm_config.parallel_config.worker_extension_cls or ""
        # By name when the workers have the extension (works across processes); otherwise the
        # functions themselves, which vLLM runs only in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
        # TRL's colocate mode) unless VLLM_ALLOW_INSECURE_SERIALIZATION=1 lets it pickle them.
        self.by_name = extension in (EXTENSION, LEGACY_EXTENSION)

    def call(self, method: str, *args) -> list:
        return self.llm.collective_rpc(method if self.by_name else getattr(LoGRAWorkerExtension, method), args=args)

    def _weights(self, weights: list[tuple[str, torch.Tensor]]) -> tuple[Any, int]:
        if self.by_name:  # possibly another process (vLLM's default): its RPC carries bytes, not tensors
            data = to_bytes(dict(weights))
            return data, len(data)
        return weights, sum(t.numel() * t.element_size() for _, t in weights)

    def full_sync(self, weights, update_index: int, shadow_dtype: str) -> tuple[int, float]:
        data, sent = self._weights(weights)
        return sent, self.call("logra_full_sync", data, update_index, shadow_dtype)[0]["seconds"]

    def whole_only(self) -> set[str]:
        return set(self.call("logra_status")[0]["whole_only"])

    def unknown(self, names: list[str]) -> list[str]:
        return self.call("logra_unknown_targets", names)[0]

    def update(self, payload: SyncPayload | bytes | None, weights: list | None, index: int) -> tuple[int, float]:
        """One compressed sync: the payload's factors, then the tensors sent whole."""
        sent, seconds = 0, 0.0
        if payload is not None:
            payload = payload.encode() if isinstance(payload, SyncPayload) else payload
            sent, seconds = len(payload), self.call("logra_apply", payload)[0]["seconds"]
        if weights:
            sent += self.load(weights)
        return sent, seconds

    def load(self, weights) -> int:
        data, sent = self._weights(weights)
        self.call("logra_load", data)
        return sent

    def patch(self, patches: dict) -> tuple[int, float]:
        if self.by_name:
            data = to_bytes(patches)
            return len(data), self.call("logra_patch", data)[0]["seconds"]
        sent = sum(t.numel() * t.element_size() for pair in patches.values() for t in pair)
        return sent, self.call("logra_patch", patches)[0]["seconds"]

    def checksums(self, names: str, seed: int) -> list[dict]:
        return [wire.load(result) for result in self.call("logra_checksums", names, seed)]

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


class ServerError(RuntimeError):
    """An HTTP error from a vLLM server; ``message`` is the error's text (vLLM's JSON error body
    ``{"error": {"message": ...}}`` unpacked where it is one)."""

    def __init__(self, url: str, status: int, body: str):
        self.status = status
        try:
            self.message = str(json.loads(body)["error"]["message"])
        except (ValueError, KeyError, TypeError):
            self.message = body
        super().__init__(f"vLLM server {url}: HTTP {status}: {self.message[:4000]}")


# How to start a server that accepts LoGRA syncs (said by every error about a server that does not).
START_SERVER = (
    "start it with VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config "
    f"'{json.dumps({'backend': BACKEND})}'"
)


def server_backend(url: str, timeout: float = 60.0) -> str | None:
    """The weight-transfer backend a vLLM server runs (``None``: none configured); raises
    :class:`RuntimeError` when the server does not offer vLLM's weight-transfer endpoints."""
    return VLLMServer(url, [], timeout).config()[0]


def _chunks(weights: list[tuple[str, torch.Tensor]], limit: int) -> Iterable[list[tuple[str, torch.Tensor]]]:
    """``weights`` in consecutive lists of at most ``limit`` bytes, never splitting a decoder layer
    (``….layers.N.…``) or a module's tensors; a group larger than ``limit`` goes alone."""
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in weights:
        layer = re.match(r"(.*?\.layers\.\d+)\.", name)
        groups.setdefault(layer.group(1) if layer else name.rpartition(".")[0], []).append((name, tensor))
    chunk, size = [], 0
    for group in groups.values():
        group_size = sum(t.numel() * t.element_size() for _, t in group)
        if chunk and size + group_size > limit:
            yield chunk
            chunk, size = [], 0
        chunk, size = chunk + group, size + group_size
    if chunk:
        yield chunk


class VLLMServer:
    """A vLLM server with the ``logra`` weight-transfer backend, driven through vLLM's own endpoints
    (:mod:`.backend`): each sync is ``/start_weight_update``, one or two ``/update_weights`` and
    ``/finish_weight_update`` with the update index as the weight version (``GET /weight_info``
    reads it back). The endpoints return no data: the engine's timing is not known here, and the
    drift check runs on the engine (:meth:`verify`).

    ``transport``: where the updates' tensors travel. ``"request"``: inside the request (base64,
    any machine). ``"nccl"`` (GPUs) / ``"gloo"`` (CPUs): over a process group this trainer opens
    with the server's workers at :meth:`initialise`, in vLLM's packing, ``buffer_bytes`` per
    buffer (:mod:`.transport`); the workers must reach this machine at ``master_address`` (default:
    its address on the route to the server)."""

    def __init__(
        self,
        url: str,
        targets: list[str],
        timeout: float = 600.0,
        chunk_bytes: int = 256 * 2**20,
        *,
        transport: str = "request",
        master_address: str | None = None,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    ):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if transport == "nccl" and not torch.cuda.is_available():
            raise ValueError("transport='nccl' needs a GPU in the trainer process; use 'gloo' or 'request'")
        if not isinstance(buffer_bytes, int) or buffer_bytes < 1:
            raise ValueError(f"buffer_bytes must be a positive integer, got {buffer_bytes!r}")
        self.url, self.targets, self.timeout, self.chunk_bytes = url.rstrip("/"), targets, timeout, chunk_bytes
        self.transport, self.master_address, self.buffer_bytes = transport, master_address, buffer_bytes
        self.model_dtype: torch.dtype | None = None  # known once initialised
        self.link: Link | None = None  # the trainer's end of a process-group transport, once initialised
        self._agreed_buffer_bytes = buffer_bytes  # what the engine was told, used until the next initialise
        self._transfers, self._link_token = 0, None

    def _request(self, path: str, body: dict | None = None, method: str = "POST"):
        request = urllib.request.Request(
            self.url + path,
            data=None if method == "GET" else json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
            method=method,
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            raise ServerError(self.url + path, error.code, error.read().decode()) from error
        except urllib.error.URLError as error:
            raise RuntimeError(f"vLLM server {self.url}: cannot reach it ({error.reason})") from error
        return json.loads(text) if text else None

    def wait_until_up(self, timeout: float, alive: Callable[[], bool] = lambda: True) -> None:
        """Poll ``/health`` until the server answers (a server just started takes a while); raises
        :class:`RuntimeError` once ``alive()`` is false (its process exited) or after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return
            except OSError:
                if not alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM server {self.url} did not come up") from None
                time.sleep(1)

    def _server_config(self) -> dict:
        try:
            return self._request("/server_info?config_format=json", method="GET")["vllm_config"]
        except ServerError as error:
            raise RuntimeError(
                f"vLLM server {self.url} does not offer vLLM's weight-transfer endpoints (GET /server_info: HTTP "
                f"{error.status}); {START_SERVER}"
            ) from error

    def config(self) -> tuple[str | None, torch.dtype]:
        """The server's weight-transfer backend and model dtype (from ``/server_info``)."""
        return _backend_and_dtype(self._server_config())

    def initialise(self) -> None:
        """Check that the server runs the ``logra`` backend, then hand it the protocol version and the
        target names (the engine refuses names it cannot update by factors), and open the process
        group of a ``nccl``/``gloo`` transport. Once per server."""
        if self.model_dtype is not None:
            return
        config = self._server_config()
        backend, model_dtype = _backend_and_dtype(config)
        if backend != BACKEND:
            raise RuntimeError(
                f"vLLM server {self.url} runs weight-transfer backend {backend!r}, not {BACKEND!r}: LoGRA syncs need "
                f"logra-optim installed beside the server and {START_SERVER}"
            )
        self._drop_link()
        init = {"protocol": PROTOCOL, "targets": self.targets, "transport": self.transport}
        init["buffer_bytes"] = self._agreed_buffer_bytes = self.buffer_bytes
        # Without a rendezvous the engine checks everything else (and, for "request", is ready): a
        # refusal then never leaves this side waiting for workers that will not join.
        self._request("/init_weight_transfer_engine", {"init_info": init})
        if self.transport != "request":
            workers = _engine_workers(config["parallel_config"], self.url)
            host = self.master_address or address_towards(self.url)
            port, group_port = free_ports(host, 2)
            token = secrets.token_hex(8)  # names this group in every update: a stale trainer is refused
            init.update(master_address=host, master_port=port, group_port=group_port, world_size=1 + workers)
            init["link"] = token
            answer = _in_background(self._request, "/init_weight_transfer_engine", {"init_info": init})
            try:
                self.link = Link(self.transport, host, port, group_port, 0, 1 + workers, answered=answer.done)
            except LinkAbandoned:
                answer.result()  # the engine's reason
                raise
            answer.result()
            self._link_token = token
        self.model_dtype = model_dtype

    def _drop_link(self) -> None:
        if self.link is not None:
            self.link.destroy()
        self.link, self.model_dtype = None, None

    def close(self) -> None:
        """Close a process-group transport on both sides (the next update initialises the server again)."""
        had_link = self.link is not None
        self._drop_link()
        if had_link:
            try:
                self._request("/shutdown_weight_transfer_engine")
            except (RuntimeError, OSError):
                pass  # the server is gone, or in an update session: it closes the group at the next init

    def _info(self, kind: str, data, **fields) -> tuple[dict, list[torch.Tensor] | None]:
        """An update's info and, for a process-group transport, the tensors that travel beside it."""
        if self.transport == "request":
            return {"kind": kind, "data": wire.dump(data), **fields}, None
        skeleton, tensors = split_tensors(data)
        return {"kind": kind, "data": wire.dump(skeleton), "tensors": describe(tensors), **fields}, tensors

    def _send(self, info: dict, tensors: list[torch.Tensor] | None) -> int:
        """One ``/update_weights``; its tensors are broadcast while the workers receive them inside it,
        once they all said they are ready (an engine that refuses earlier answers instead)."""
        if tensors is None:
            self._request("/update_weights", {"update_info": info})
            return len(info["data"])
        self._transfers += 1
        info = {**info, "transfer": self._transfers, "link": self._link_token}
        answer = _in_background(self._request, "/update_weights", {"update_info": info})
        if not self.link.wait_ready(self._transfers, answered=answer.done):
            answer.result()  # the engine's refusal
            raise RuntimeError(f"vLLM server {self.url}: a worker refused the update's tensors")
        sent = send_tensors(self.link, tensors, self._agreed_buffer_bytes)
        answer.result()
        return len(info["data"]) + sent

    def _session(self, infos: Iterable[tuple[dict, list | None]], version: int | None = None) -> int:
        """One update session: ``/start_weight_update``, one ``/update_weights`` per info (made as it is
        sent), ``/finish_weight_update`` with ``version`` as vLLM's weight version; returns the bytes
        sent. After any failure, the start's included, the session is finished here where possible:
        vLLM ends it on a worker that refuses an update, but under tensor parallelism the others may
        not have refused (the drift check is per rank) and stay in it, and the next start would be
        refused on them for ever. Finishing a session a worker already ended only fails there. Either
        way the next call initialises the server again, which may have restarted."""
        self.initialise()
        sent = 0
        try:
            self._request("/start_weight_update")
            for info, tensors in infos:
                sent += self._send(info, tensors)
        except BaseException:
            self._drop_link()
            try:
                self._request("/finish_weight_update")
            except (RuntimeError, OSError):
                pass  # already ended on every worker, or the server is gone
            raise
        self._request("/finish_weight_update", {} if version is None else {"weight_version": str(version)})
        return sent

    def full_sync(self, weights, update_index: int, shadow_dtype: str) -> tuple[int, None]:
        """Full weights in requests of at most :attr:`chunk_bytes` (whole decoder layers or modules
        per request, so that the engine never reloads half of a fused layer), one session."""
        infos = (
            self._info("full", dict(chunk), update_index=update_index, shadow_dtype=shadow_dtype)
            for chunk in _chunks(weights, self.chunk_bytes)
        )
        return self._session(infos, update_index), None

    def whole_only(self) -> set[str]:
        return set()  # refused when the engine was initialised (see EngineUpdater.check_targets)

    def unknown(self, names: list[str]) -> list[str]:
        return []  # likewise

    def update(self, payload: SyncPayload | bytes | None, weights: list | None, index: int) -> tuple[int, None]:
        """One compressed sync in one session: the payload's factors, then the tensors sent whole."""
        infos = []
        if payload is not None:
            infos.append(self._info("apply", _decoded(payload).to_dict()))
        if weights:
            infos.append(self._info("load", dict(weights)))
        return self._session(infos, index), None

    def load(self, weights) -> int:
        return self._session([self._info("load", dict(weights))])

    def patch(self, patches: dict) -> tuple[int, None]:
        return self._session([self._info("patch", patches)]), None

    def verify(self, expected: dict, seed: int, drift_bound: float) -> dict | None:
        """``None`` when the engine found its weights within the bound; otherwise what it measured."""
        try:
            info = {"kind": "verify", "data": wire.dump(expected), "seed": seed, "drift_bound": drift_bound}
            self._session([(info, None)])  # small: always inside the request
        except ServerError as error:
            message = error.message
            if DRIFT_MARKER not in message:
                raise
            return json.JSONDecoder().raw_decode(message.split(DRIFT_MARKER, 1)[1])[0]
        return None

    def reset_prefix_cache(self) -> None:
        self._request("/reset_prefix_cache")


class VLLMSync:
    """Keeps a vLLM engine's weights equal to the trainer's, sending ``(F, seed)`` per update.

    Args:
        optimizer: the :class:`~logra_optim.LoGRAOptimizer` whose updates are sent.
        engine: an ``LLM`` (colocated), or the base URL of a vLLM server started with the ``logra``
            weight-transfer backend (``VLLM_SERVER_DEV_MODE=1 vllm serve MODEL
            --weight-transfer-config '{"backend": "logra"}'``; see :mod:`.backend`). An ``LLM``
            whose engine runs in its own process (vLLM's default) needs
            ``worker_extension_cls=EXTENSION``; one running in this process
            (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, TRL's colocate mode) works without it.
        named_parameters: ``() -> iterable of (checkpoint name, tensor)`` giving the full weights
            for a full sync (default: the optimizer's model, wrapper prefixes stripped). Under
            FSDP/ZeRO-3 pass one that gathers them (TRL's does).
        check_every: compare engine and trainer checksums every this many compressed syncs (0: never).
        drift_bound: a relative weight difference above this triggers a full sync.
        full_every: a full sync every this many syncs regardless (``None``: only when needed).
        shadow_dtype: dtype of the engine's shadow copies in reload mode.
        log: ``f(dict)`` called after every sync with its statistics (kind, bytes, seconds, drift).
        transport: for a server, where the tensors travel: ``"request"`` (inside vLLM's update
            requests), ``"nccl"`` (a process group with the server's GPU workers, as vLLM's own
            ``nccl`` backend) or ``"gloo"`` (the same on CPUs); see :class:`VLLMServer`.
        master_address: for ``"nccl"``/``"gloo"``: the address of this machine the server's workers
            connect to (default: its address on the route to the server).

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
        transport: str = "request",
        master_address: str | None = None,
    ):
        if not isinstance(check_every, int) or check_every < 0:
            raise ValueError(f"check_every must be a non-negative integer, got {check_every!r}")
        if full_every is not None and (not isinstance(full_every, int) or full_every < 1):
            raise ValueError(f"full_every must be a positive integer or None, got {full_every!r}")
        if not drift_bound > 0:
            raise ValueError(f"drift_bound must be positive, got {drift_bound!r}")
        transposed = [target.parameter_name for target in optimizer.targets if target.layout.transposed]
        if transposed:
            # Their updates are of the experts' W_e = weight[e]ᵀ, and vLLM's GPT-OSS keeps its experts in
            # a layout of its own (often mxfp4): no placement maps one onto the other.
            raise ValueError(
                f"VLLMSync: {len(transposed)} targets are experts stored transposed ([E, in, out], GPT-OSS), e.g. "
                f"{transposed[0]!r}; the sync does not map them onto vLLM's own layout of such experts (docs/sync.md, "
                "Limits). Leave them out of LoGRA's targets (patch_model(model, experts=False)) to sync the rest, or "
                "sync full weights (with TRL, attach_logra does, with a warning)"
            )
        if check_every and any(target.layout.kind != REPLICATED for target in optimizer.targets):
            warnings.warn(
                "VLLMSync: the trainer's target weights are sharded (FSDP2/ZeRO-3); the drift check "
                "needs whole weights and is off (check_every=0)",
                stacklevel=2,
            )
            check_every = 0
        self.optimizer = optimizer
        if isinstance(engine, str):
            targets = [target.parameter_name for target in optimizer.targets]
            self.engine = VLLMServer(engine, targets, transport=transport, master_address=master_address)
        elif transport != "request":
            raise ValueError(f"transport={transport!r} is for a vLLM server (a URL); an LLM object is reached directly")
        else:
            self.engine = _Colocated(engine)
        self.named_parameters = named_parameters or self._model_parameters
        self.check_every, self.drift_bound, self.full_every = check_every, drift_bound, full_every
        self.shadow_dtype = str(shadow_dtype).removeprefix("torch.")
        self.log = log
        self.recorder = UpdateRecorder(optimizer)
        # The update the engine last confirmed it holds; None (before the first sync, after a failed
        # one, after the engine discarded its weights) makes the next sync a full one.
        self.engine_index: int | None = None
        self.syncs = 0
        self.compressed_since_check = 0
        self.stats: dict[str, Any] = {}
        self.history: list[dict] = []
        model = optimizer.model
        targets = {id(target.weight) for target in optimizer.targets}
        # Sent whole at every sync: trainable non-targets (e.g. norms), and the targets the engine can
        # only load whole (asked for after the first full sync).
        self._non_targets = [
            (canonical_name(n), p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in targets
        ]
        self._whole: list[tuple[str, torch.Tensor]] | None = None
        self._sharded = any(target.layout.kind != REPLICATED for target in optimizer.targets)
        # What a full sync sends (every parameter, whole, as held): more pending update bytes → full.
        self._full_bytes = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters())

    @property
    def sent_whole(self) -> tuple[str, ...]:
        """Targets the engine can only load whole (known after the first full sync): the checkpoint
        stores them fused while the engine splits them its own way, so each sync sends them in full."""
        return tuple(name for name, _ in self._whole or ())

    def _model_parameters(self):
        """The default ``named_parameters``: the optimizer's model under checkpoint names."""
        for name, parameter in self.optimizer.model.named_parameters():
            yield canonical_name(name), parameter.detach()

    def mark_weights_discarded(self) -> None:
        """The engine dropped its weights (``LLM.sleep(level=2)``): the next sync is a full one."""
        self.engine_index = None

    def close(self) -> None:
        self.recorder.close()
        if isinstance(self.engine, VLLMServer):
            self.engine.close()

    def full_sync(self) -> dict:
        """Send every parameter; the engine is then at the optimizer's current update index."""
        started = time.perf_counter()
        weights = _cpu_copies(self.named_parameters())
        self.engine_index = None  # until the engine has confirmed
        sent, engine_seconds = self.engine.full_sync(weights, self.optimizer.update_index, self.shadow_dtype)
        self.recorder.clear()
        if self._whole is None:  # raises for targets the engine cannot place: the engine stays unsynced
            self._whole = self._targets_loaded_whole()
        self.engine_index = self.optimizer.update_index
        self.compressed_since_check = 0
        return self._finish("full", sent, started, engine_seconds)

    def _targets_loaded_whole(self) -> list[tuple[str, torch.Tensor]]:
        """Targets the engine can only load whole (asked once, after the first full sync). Targets it
        cannot place at all are an error now rather than at the first compressed sync."""
        unknown = self.engine.unknown([target.parameter_name for target in self.optimizer.targets])
        if unknown:
            raise ValueError(
                f"VLLMSync: the engine has no placement for {len(unknown)} targets, e.g. {unknown[0]!r}: its model "
                "stores them in a layout the sync does not map (docs/sync.md, Limits); leave them out of LoGRA's "
                "targets (mixture-of-experts weights: patch_model(model, experts=False)) or sync full weights"
            )
        whole = self.engine.whole_only()
        targets = [(t.parameter_name, t.weight) for t in self.optimizer.targets if t.parameter_name in whole]
        if targets:
            warnings.warn(
                f"LoGRA sync: {len(targets)} targets are stored fused in the checkpoint and split by the engine in "
                f"its own way (e.g. {targets[0][0]!r}); they are sent whole at every sync",
                RuntimeWarning,
                stacklevel=3,
            )
        return targets

    def _tensors_sent_whole(self) -> list[tuple[str, torch.Tensor]]:
        """CPU copies of what every sync sends whole. A sharded trainer (FSDP2, ZeRO-3) holds only
        shards or placeholders of them: they come through ``named_parameters``, which gathers."""
        wanted = self._non_targets + self._whole
        if not self._sharded:
            return _cpu_copies(wanted)
        names = {name for name, _ in wanted}
        return _cpu_copies((name, tensor) for name, tensor in self.named_parameters() if name in names)

    def sync(self) -> dict:
        """Bring the engine to the optimizer's current update (see the class docstring)."""
        self.syncs += 1
        if self.engine_index is None or (self.full_every is not None and self.syncs % self.full_every == 0):
            return self._logged(self.full_sync())
        if self.recorder.pending_bytes > self._full_bytes:
            return self._logged(self.full_sync())  # many updates since the last sync: full weights are smaller
        # An optimizer state loaded since the last sync (a resume, in this process) leaves pending updates
        # that do not lead from the engine's update to the optimizer's, or none where they differ.
        expected = self.engine_index + len(self.recorder.pending)
        if not self.recorder.consistent or self.optimizer.update_index != expected:
            return self._logged(self.full_sync())
        started = time.perf_counter()
        payload = _without(self.recorder.drain(), {name for name, _ in self._whole})
        self.engine_index = None  # until the engine has confirmed: a failed sync loses the drained updates
        whole = self._tensors_sent_whole() if self._non_targets or self._whole else None
        sent, engine_seconds = self.engine.update(payload, whole, self.optimizer.update_index)
        self.engine_index = self.optimizer.update_index
        stats = self._finish("compressed", sent, started, engine_seconds)
        self.compressed_since_check += 1
        if self.check_every and self.compressed_since_check >= self.check_every:
            self.compressed_since_check = 0
            measured = self.drift()
            stats.update(measured)
            if "drift" in measured and drift_exceeded(measured, self.drift_bound):
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
        ``external_launcher``): a partial comparison would be meaningless.

        A server (the ``logra`` backend) compares on its side, since vLLM's endpoints return no data:
        ``{"drift_within_bound": 1.0}`` when it found the weights within the bound, else what it
        measured (the same three numbers)."""
        seed = self.syncs if seed is None else seed
        whole = {name for name, _ in self._whole or ()}
        targets = [target for target in self.optimizer.targets if target.parameter_name not in whole]
        if isinstance(self.engine, VLLMServer):
            return self._drift_on_server(targets, seed)
        names = json.dumps([target.parameter_name for target in targets])
        results = self.engine.checksums(names, seed)
        served_dtype, copy_dtype = wire.dtype(results[0]["served_dtype"]), wire.dtype(results[0]["copy_dtype"])
        if len(results) < results[0]["tp_size"]:
            return {
                **compare_checksums([], served_dtype, self.drift_bound),
                "drift": math.nan,
                "served_drift": math.nan,
            }
        pairs = []
        for name, sums in _trainer_checksums(targets, seed, {copy_dtype, served_dtype}).items():
            engine = {
                "copy": torch.zeros_like(sums[str(copy_dtype)]),
                "served": torch.zeros_like(sums[str(served_dtype)]),
            }
            for result in results:  # every rank's rows (or, row-parallel, its share of the sum)
                start, copy, served, partial = result[name]
                rows = slice(start, start + copy.numel())
                for key, local in (("copy", copy), ("served", served)):
                    if local is None:  # stacked experts: no served product (EngineUpdater.checksum_table)
                        engine[key] = None
                    elif partial:
                        engine[key][rows] += local
                    else:
                        engine[key][rows] = local
            served = None if engine["served"] is None else (engine["served"], sums[str(served_dtype)])
            pairs.append(((engine["copy"], sums[str(copy_dtype)]), served))
        return compare_checksums(pairs, served_dtype, self.drift_bound)

    def _drift_on_server(self, targets, seed: int) -> dict[str, float]:
        """The trainer's checksums in each dtype the engine may hold the weights in (its shadows',
        its model's), compared by the engine with its own."""
        self.engine.initialise()
        expected = _trainer_checksums(targets, seed, {wire.dtype(self.shadow_dtype), self.engine.model_dtype})
        measured = self.engine.verify(expected, seed, self.drift_bound)
        return {"drift_within_bound": 1.0} if measured is None else measured

    def _finish(self, kind: str, sent: int, started: float, engine_seconds: float | None) -> dict:
        """``seconds``: the whole sync as the trainer waits for it; ``engine_seconds``: the engine's
        part (decode, regenerate ``A``, merge, reload), ``None`` where the engine cannot say (a server)."""
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


@torch.no_grad()
def _trainer_checksums(targets, seed: int, dtypes) -> dict[str, dict[str, torch.Tensor]]:
    """Per target, float64 ``W p`` of the trainer's weights rounded to each of ``dtypes`` (keyed by
    ``str(dtype)``), with the probe ``p`` the engine draws from the same seed."""
    sums = {}
    for target in targets:
        name, weight = target.parameter_name, target.weight.detach()
        weight = weight.reshape(-1, weight.shape[-1])  # stacked experts: their E·d × k matrix
        probe = checksum_probe(projection_seed(seed, 0, name), weight.shape[1], device=weight.device)
        sums[name] = {str(dtype): weight_checksum(weight.to(dtype), probe).cpu() for dtype in dtypes}
    return sums


def _backend_and_dtype(config: dict) -> tuple[str | None, torch.dtype]:
    """The weight-transfer backend and model dtype in a server's ``vllm_config``."""
    return (config.get("weight_transfer_config") or {}).get("backend"), wire.dtype(config["model_config"]["dtype"])


def _in_background(function: Callable, *args) -> Future:
    """``function(*args)`` on a daemon thread: a request left waiting on a stuck server must not
    keep the trainer's process from exiting."""
    future: Future = Future()

    def run():
        try:
            future.set_result(function(*args))
        except BaseException as error:
            future.set_exception(error)

    threading.Thread(target=run, daemon=True).start()
    return future


def _engine_workers(parallel: dict, url: str) -> int:
    """How many workers a server's ``collective_rpc`` reaches (vLLM's ``ParallelConfig``: TP × PP ×
    prefill-context parallel per data-parallel rank, every DP rank behind one API server)."""
    if parallel.get("data_parallel_size", 1) > 1 and (
        parallel.get("data_parallel_external_lb") or parallel.get("data_parallel_hybrid_lb")
    ):
        raise ValueError(
            f"vLLM server {url}: data parallelism with external or hybrid load balancing runs an engine per server; "
            "sync each server on its own, or use transport='request'"
        )
    sizes = ("tensor_parallel_size", "pipeline_parallel_size", "prefill_context_parallel_size", "data_parallel_size")
    return math.prod(parallel.get(size, 1) for size in sizes)


def _decoded(payload: SyncPayload | bytes) -> SyncPayload:
    return payload if isinstance(payload, SyncPayload) else SyncPayload.decode(payload)


def _without(payload: SyncPayload | None, names: set[str]) -> SyncPayload | None:
    """``payload`` less the targets in ``names`` (each update keeps its index)."""
    if payload is None or not names:
        return payload
    updates = tuple(Update(u.index, tuple(t for t in u.targets if t.name not in names)) for u in payload.updates)
    return SyncPayload(payload.rank, payload.projection, updates, payload.expert_rank)
