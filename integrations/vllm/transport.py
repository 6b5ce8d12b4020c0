"""Tensors beside the request: a process group between the trainer and a vLLM server's workers.

By default an update's tensors travel inside vLLM's ``/update_weights`` request (``transport=
"request"``: base64 in JSON, :mod:`.wire`), which works on any machine but costs the server's HTTP
path a decode of every byte. With ``transport="nccl"`` (GPUs) or ``"gloo"`` (CPUs) the trainer
opens a process group with the workers when it initialises the backend, as vLLM's own ``nccl``
weight-transfer engine does (trainer rank 0, workers ``1 + their global rank``, over a TCP store of
its own, never torch's default group), and each update becomes:

* the request: the update's structure with every tensor replaced by a placeholder
  (:func:`split_tensors`), plus the dtype and shape of each tensor;
* the tensors: broadcast from rank 0 in vLLM's packing (``pack_tensors``, the layout its ``nccl``
  engine uses: tensors concatenated as bytes into buffers that close once they exceed
  ``buffer_bytes``), which both sides cut at the same tensors from the same metadata. The receiver
  unpacks it itself: vLLM 0.32's ``unpack_tensor`` views each slice in place, which fails when
  tensors of different element sizes leave one at a misaligned offset (a bf16 factor followed by
  an fp32 one; int32 indices beside bf16 values).

The request and the broadcast run concurrently: the workers receive inside the request, the
trainer broadcasts while it waits for the answer. It broadcasts only once every worker has said,
through the trainer's TCP store, that it checked the update's metadata and allocated its receive
buffers, and the workers enter the broadcasts only once the trainer has said go
(:meth:`Link.wait_ready`); an engine that refuses before that answers the request, and the trainer
raises its error instead of broadcasting to nobody (which would hang on NCCL).
"""

from __future__ import annotations

import datetime
import math
import socket
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from . import wire

__all__ = [
    "DEFAULT_BUFFER_BYTES",
    "TRANSPORTS",
    "Link",
    "address_towards",
    "describe",
    "LinkAbandoned",
    "free_ports",
    "join_tensors",
    "receive_buffers",
    "receive_tensors",
    "send_tensors",
    "split_tensors",
]

TRANSPORTS = ("request", "nccl", "gloo")
DEFAULT_BUFFER_BYTES = 256 * 2**20
_PLACEHOLDER = "__logra_tensor__"


def split_tensors(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """``obj`` (dicts, lists, tuples, numbers, strings, tensors) with every tensor replaced by
    ``{"__logra_tensor__": i}``, and the tensors in order of ``i``."""
    tensors: list[torch.Tensor] = []

    def visit(value):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return {_PLACEHOLDER: len(tensors) - 1}
        if isinstance(value, dict):
            if _PLACEHOLDER in value:
                raise ValueError(f"split_tensors: a dict key may not be {_PLACEHOLDER!r}")
            return {key: visit(item) for key, item in value.items()}
        if type(value) in (list, tuple):
            return type(value)(visit(item) for item in value)
        return value

    return visit(obj), tensors


def join_tensors(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`split_tensors`; every tensor must be used exactly once."""
    used = [False] * len(tensors)

    def visit(value):
        if isinstance(value, dict):
            if set(value) == {_PLACEHOLDER}:
                index = value[_PLACEHOLDER]
                if not isinstance(index, int) or not 0 <= index < len(tensors) or used[index]:
                    raise ValueError(f"LoGRA transport: placeholder {index!r} does not name an unused tensor")
                used[index] = True
                return tensors[index]
            return {key: visit(item) for key, item in value.items()}
        if type(value) in (list, tuple):
            return type(value)(visit(item) for item in value)
        return value

    joined = visit(skeleton)
    if not all(used):
        raise ValueError(f"LoGRA transport: {used.count(False)} received tensors are not in the update")
    return joined


def describe(tensors: Iterable[torch.Tensor]) -> list[list]:
    """What the receiving side needs to cut and view the bytes: ``[dtype name, shape]`` per tensor."""
    return [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]


def _parse(meta: list) -> list[tuple[torch.dtype, list[int]]]:
    try:
        parsed = [(wire.dtype(dtype), [int(n) for n in shape]) for dtype, shape in meta]
    except (TypeError, ValueError) as error:
        message = f"LoGRA transport: tensors must be a list of [dtype, shape] ({error}): {meta!r:.200}"
        raise ValueError(message) from error
    if any(n < 0 for _, shape in parsed for n in shape):
        raise ValueError("LoGRA transport: a tensor shape has a negative size")
    return parsed


def send_tensors(link: Link, tensors: list[torch.Tensor], buffer_bytes: int) -> int:
    """Broadcast ``tensors`` from rank 0 in vLLM's packing; returns the bytes sent."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    items = ((str(i), t.detach().to(link.device)) for i, t in enumerate(tensors))
    sent = 0
    while True:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Tensor .* exceeds buffer_size_bytes")  # it goes alone: fine
            chunk = pack_tensors(items, lambda item: item[1], buffer_bytes)
        if chunk is None:
            break
        link.broadcast(chunk.packed_tensor)
        sent += chunk.packed_tensor.numel()
    if link.device.type == "cuda":  # NCCL reads the buffers asynchronously
        torch.cuda.current_stream(link.device).synchronize()
    return sent


def receive_buffers(meta: list, buffer_bytes: int, device) -> list[tuple[torch.Tensor, list]]:
    """Empty receive buffers for the tensors ``meta`` describes (:func:`describe`), each with its
    tensors' ``(dtype, shape, bytes)``: cut where the sender's ``pack_tensors`` cuts (after the
    tensor that takes a buffer past ``buffer_bytes``). Allocated before the engine says it is ready,
    so that running out of memory refuses the update instead of stalling the sender."""
    buffers, chunk, total = [], [], 0
    for dtype, shape in _parse(meta):
        size = math.prod(shape) * dtype.itemsize
        chunk.append((dtype, shape, size))
        total += size
        if total > buffer_bytes:
            buffers.append((torch.empty(total, dtype=torch.uint8, device=device), chunk))
            chunk, total = [], 0
    if chunk:
        buffers.append((torch.empty(total, dtype=torch.uint8, device=device), chunk))
    return buffers


def receive_tensors(link: Link, buffers: list[tuple[torch.Tensor, list]]) -> list[torch.Tensor]:
    """Receive into :func:`receive_buffers`' buffers; the tensors, in order. A tensor left at an
    offset its element size does not divide is copied out (vLLM's own ``unpack_tensor`` fails there)."""
    received = []
    for packed, chunk in buffers:
        link.broadcast(packed)
        for (dtype, shape, _), piece in zip(chunk, packed.split([size for *_, size in chunk])):
            aligned = piece if piece.storage_offset() % dtype.itemsize == 0 else piece.clone()
            received.append(aligned.view(dtype).view(shape))
    return received


class LinkAbandoned(RuntimeError):
    """The engine answered (refused) while the trainer waited for its workers to join."""


class Link:
    """The trainer's (rank 0) or a worker's (``1 +`` its global rank) end of a process-group
    transport: a TCP store the trainer hosts at ``port``, for the rendezvous and the per-transfer
    handshake, and the group the tensors are broadcast over: ``"gloo"``, a torch gloo group on that
    store, not torch's default group (vLLM's workers keep that for themselves); ``"nccl"``, vLLM's
    ``PyNcclCommunicator`` on the current GPU over its own rendezvous at ``group_port``, as vLLM's
    ``nccl`` engine opens it (the trainer and the workers on different GPUs).

    The trainer's end waits for every worker to join the store before it enters the group, giving
    up (:class:`LinkAbandoned`) when ``answered()`` says the engine's init request returned first."""

    def __init__(
        self,
        kind: str,
        host: str,
        port: int,
        group_port: int | None,
        rank: int,
        world_size: int,
        timeout: float = 300.0,
        answered: Callable[[], bool] = lambda: False,
    ):
        if kind not in TRANSPORTS[1:]:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS[1:])} for a process group, got {kind!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"LoGRA transport: rank {rank} is outside a group of world_size {world_size}")
        limit = datetime.timedelta(seconds=timeout)
        self.kind, self.rank, self.world_size, self.group = kind, rank, world_size, None
        self.store = dist.TCPStore(host, port, world_size, rank == 0, timeout=limit, wait_for_workers=False)
        if rank == 0:
            joined = [f"joined/{worker}" for worker in range(1, world_size)]
            if not _wait_for(lambda: self.store.check(joined), answered):
                raise LinkAbandoned("LoGRA transport: the engine answered before its workers joined")
        else:
            self.store.set(f"joined/{rank}", "1")
        if kind == "gloo":
            self.group = dist.ProcessGroupGloo(dist.PrefixStore("group", self.store), rank, world_size, limit)
            self.device = torch.device("cpu")
            return
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        self.group = stateless_init_process_group(
            host, group_port, rank, world_size, torch.accelerator.current_device_index()
        )
        if getattr(self.group, "disabled", False):  # vLLM's communicator then broadcasts nothing
            raise RuntimeError(
                "LoGRA transport: vLLM's NCCL communicator is disabled in this process (VLLM_DISABLE_PYNCCL, or no "
                "libnccl); use transport='gloo' or 'request'"
            )
        self.device = self.group.device

    def broadcast(self, tensor: torch.Tensor) -> None:
        """From rank 0 to every rank, in place."""
        if self.kind == "gloo":
            options = dist.BroadcastOptions()
            options.rootRank, options.rootTensor = 0, 0
            self.group.broadcast([tensor], options).wait()
        else:
            with torch.cuda.device(self.device):
                self.group.broadcast(tensor, src=0)

    # The handshake of one transfer: each worker says "ready" (its buffers are allocated) or
    # "refused"; the trainer then decides "go" (everyone is ready) or "abort", which every worker
    # waits for before entering the broadcasts, so that no rank broadcasts while another left.

    def mark_ready(self, transfer: int) -> None:
        """A worker, once its buffers for ``transfer`` are allocated; returns when the trainer says go
        and raises when it aborted (another worker refused)."""
        self.store.set(f"ready/{transfer}/{self.rank}", "1")
        if self.store.get(f"decision/{transfer}") != b"go":
            raise RuntimeError(f"LoGRA transport: transfer {transfer} aborted (another worker refused it)")

    def refuse(self, transfer: int) -> None:
        """A worker that cannot receive ``transfer`` (its own error follows in the request's answer)."""
        self.store.set(f"refused/{transfer}/{self.rank}", "1")

    def wait_ready(self, transfer: int, answered: Callable[[], bool]) -> bool:
        """The trainer: ``True`` once every worker is ready for ``transfer`` (they are told to go);
        ``False`` when a worker refused or the request returned first (the engine refused before
        receiving; ready workers are told to abort), and nothing may be broadcast."""
        workers = range(1, self.world_size)
        ready = [f"ready/{transfer}/{rank}" for rank in workers]
        refused = [f"refused/{transfer}/{rank}" for rank in workers]
        everyone = _wait_for(
            lambda: self.store.check(ready), lambda: answered() or any(self.store.check([k]) for k in refused)
        )
        self.store.set(f"decision/{transfer}", "go" if everyone else "abort")
        return everyone

    def destroy(self) -> None:
        if self.kind == "nccl" and self.group is not None:
            self.group.destroy()
        self.group = None


def _wait_for(condition: Callable[[], bool], give_up: Callable[[], bool]) -> bool:
    """Poll until ``condition()`` (``True``) or ``give_up()`` (``False``, after a last look)."""
    while not condition():
        if give_up():
            return condition()
        time.sleep(0.002)
    return True


def address_towards(url: str) -> str:
    """This machine's address on the route to ``url``'s host: where the server's workers can reach
    the trainer's end of the group."""
    parsed = urllib.parse.urlsplit(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    with socket.create_connection((parsed.hostname, port), timeout=30) as connection:
        return connection.getsockname()[0]


def free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports nobody listens on at ``host`` now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
