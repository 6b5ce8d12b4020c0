"""Recorders that see what autograd and the dispatcher really do: the shape of every tensor an aten
op produces, and every tensor saved for backward."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class OutputShapes(TorchDispatchMode):
    """Records the shape of every tensor any aten op produces: sees the x Aᵀ product even when
    autograd keeps nothing of it."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def projected_inputs(self, rank):
        # ``rank`` is chosen to be no dimension of the tiny model, so a trailing ``rank`` is x Aᵀ.
        return [shape for shape in self.shapes if shape and shape[-1] == rank]


class SavedTensors:
    """Records every tensor autograd saves for backward while active."""

    def __init__(self):
        self.saved: list[torch.Tensor] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor):
        self.saved.append(tensor)
        return tensor

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class MatmulDtypes(TorchDispatchMode):
    """Records the dtype of every matrix product (``mm``, ``addmm``, ``bmm``) the dispatcher runs."""

    PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm")

    def __init__(self):
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name in self.PRODUCTS:
            self.dtypes.add(out.dtype)
        return out
