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

The worker receives every tensor before it checks anything, so a refused update still drains the
stream and the next one starts in step. The request and the broadcast run concurrently: the
workers receive inside the request, the trainer broadcasts while it waits for the answer.
"""

from __future__ import annotations

import datetime
import math
import socket
import urllib.parse
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from . import wire

__all__ = ["TRANSPORTS", "GlooGroup", "join_tensors", "open_group", "receive_tensors", "send_tensors", "split_tensors"]

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
        if isinstance(value, (list, tuple)):
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
        if isinstance(value, (list, tuple)):
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


def send_tensors(group, tensors: list[torch.Tensor], buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> int:
    """Broadcast ``tensors`` from rank 0 in vLLM's packing; returns the bytes sent."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    items = ((str(i), t.detach().to(group.device)) for i, t in enumerate(tensors))
    sent = 0
    while True:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Tensor .* exceeds buffer_size_bytes")  # it goes alone: fine
            chunk = pack_tensors(items, lambda item: item[1], buffer_bytes)
        if chunk is None:
            break
        group.broadcast(chunk.packed_tensor, src=0)
        sent += chunk.packed_tensor.numel()
    if group.device.type == "cuda":  # NCCL reads the buffers asynchronously
        torch.cuda.current_stream(group.device).synchronize()
    return sent


def receive_tensors(group, meta: list, buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> list[torch.Tensor]:
    """The tensors :func:`send_tensors` broadcast, from their ``[dtype, shape]`` (:func:`describe`):
    the buffers are cut where the sender's ``pack_tensors`` cuts them (after the tensor that takes
    a buffer past ``buffer_bytes``)."""
    received: list[torch.Tensor] = []
    chunk: list[tuple[torch.dtype, list[int], int]] = []

    def flush():
        packed = torch.empty(sum(size for *_, size in chunk), dtype=torch.uint8, device=group.device)
        group.broadcast(packed, src=0)
        for (dtype, shape, _), piece in zip(chunk, packed.split([size for *_, size in chunk])):
            aligned = piece if piece.storage_offset() % dtype.itemsize == 0 else piece.clone()
            received.append(aligned.view(dtype).view(shape))
        chunk.clear()

    total = 0
    for dtype, shape in _parse(meta):
        size = math.prod(shape) * dtype.itemsize
        chunk.append((dtype, shape, size))
        total += size
        if total > buffer_bytes:
            flush()
            total = 0
    if chunk:
        flush()
    return received


class GlooGroup:
    """A gloo process group of the trainer (rank 0) and the engine's workers, on a TCP store of its
    own: not torch's default group, which vLLM's workers keep for themselves. ``broadcast`` has the
    signature of vLLM's ``PyNcclCommunicator.broadcast``."""

    device = torch.device("cpu")

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout: float = 300.0):
        limit = datetime.timedelta(seconds=timeout)
        self.store = dist.TCPStore(host, port, world_size, rank == 0, timeout=limit)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("logra", self.store), rank, world_size, limit)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = src, 0
        self.group.broadcast([tensor], options).wait()


def open_group(transport: str, host: str, port: int, rank: int, world_size: int):
    """The trainer's (rank 0) or a worker's end of the group for ``transport`` (``"nccl"``: vLLM's
    ``PyNcclCommunicator`` on this process's current GPU, as its ``nccl`` engine opens it)."""
    if transport == "gloo":
        return GlooGroup(host, port, rank, world_size)
    if transport == "nccl":
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

        return stateless_init_process_group(host, port, rank, world_size, torch.accelerator.current_device_index())
    raise ValueError(f"a process-group transport is one of {', '.join(TRANSPORTS[1:])}, got {transport!r}")


def address_towards(url: str) -> str:
    """This machine's address on the route to ``url``'s host: where the server's workers can reach
    the trainer's end of the group."""
    parsed = urllib.parse.urlsplit(url)
    with socket.create_connection((parsed.hostname, parsed.port or 80), timeout=30) as connection:
        return connection.getsockname()[0]


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
