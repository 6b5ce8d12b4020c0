"""How values cross between the trainer and the vLLM workers; imported by both sides.

``collective_rpc`` on an ``LLM`` of this process passes Python objects, but a server's update
requests (vLLM's ``/update_weights``, :mod:`.backend`) carry JSON. So anything binary (a
:class:`~logra_optim.sync.SyncPayload`, a state dict, checksums) travels as base64 of
``torch.save`` bytes, and every receiving function accepts either the bytes or their base64 text.
Dtypes travel by name.
"""

from __future__ import annotations

import base64

import torch

from logra_optim.sync import from_bytes, to_bytes


def to_wire(data: bytes) -> str:
    """Bytes as text that survives a JSON body."""
    return base64.b64encode(data).decode("ascii")


def from_wire(data: bytes | str) -> bytes:
    """The bytes sent, whether they came as they are (in process) or as base64 (over HTTP)."""
    return base64.b64decode(data) if isinstance(data, str) else data


def dump(obj) -> str:
    """``torch.save`` of tensors, numbers, strings and containers of them, as wire text."""
    return to_wire(to_bytes(obj))


def load(data: bytes | str):
    """The inverse of :func:`dump` (also of plain :func:`~logra_optim.sync.to_bytes`), ``weights_only``."""
    return from_bytes(from_wire(data))


def dtype(name: str) -> torch.dtype:
    """A dtype from its name, with or without the ``torch.`` of ``str(dtype)``."""
    found = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return found
