"""Sketch accumulation inside backward: ``S += gᵀ (x Aᵀ)``, never forming ``G = gᵀ x``.

A patched linear runs :class:`SketchedLinear` instead of ``F.linear`` in training forwards. Its
forward saves only the projected input ``x Aᵀ`` (n×r, in the activation dtype) and the weight
itself (a parameter, so saving it costs nothing); its backward returns the input gradient
``g W`` as usual and, instead of a weight gradient, adds the d×r product ``gᵀ (x Aᵀ)`` into the
target's fp32 sketch. No d×k tensor is created for the weight during backward.

All sketches of a model live in one flat fp32 buffer (:class:`SketchBank`) so that data-parallel
ranks can average them with one collective, like a bucketed gradient all-reduce.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

from .projection import ProjectionSpec
from .updates import all_finite, gram

# An autograd Function's output requires grad only if one of its inputs does. With the embeddings
# frozen, the first patched layer's input may not, and then no backward would ever reach it. Passing
# this leaf as an extra input keeps every patched layer in the graph; its gradient is never computed.
GRAPH_ANCHOR = torch.zeros((), requires_grad=True)


class SharedProjection:
    """The projection of one or more targets, as what determines it (:class:`ProjectionSpec`) and
    the device it is generated on, plus the projected input ``x Aᵀ`` of the latest input.

    ``A`` itself is never kept: :meth:`project` generates it, multiplies and lets it go, so between
    uses a bound optimizer holds four numbers per group instead of ``r·k`` floats (and, once the
    step size has needed it, the ``r×r`` Gram matrix, :meth:`gram`). Siblings that
    read the same ``x`` (``q/k/v_proj``) and share one ``A`` get ``x Aᵀ`` computed, and ``A``
    generated, once: the first asks, the others find the product here. Only a weak reference to
    ``x`` is kept, and the product is dropped as soon as ``x`` is freed, so the cache holds no
    memory beyond the lifetime of the input it was computed from (autograd keeps what backward
    needs itself).
    """

    def __init__(self, spec: ProjectionSpec, device: torch.device | str | None = None):
        self.spec = spec
        self.device = torch.device("cpu" if device is None else device)
        # (weak reference to x, (x's version, A's dtype, autocast dtype), x Aᵀ), replaced as one.
        self._cached: tuple | None = None
        self._gram: torch.Tensor | None = None

    def gram(self) -> torch.Tensor:
        """``A Aᵀ`` (r×r, fp32), computed at the first call and kept while this projection is
        current: the step size needs ``‖U A‖²`` at every update, and ``r²`` numbers are kept instead of
        generating ``A`` for them each time (:func:`~logra_optim.updates.low_rank_sq_norm`)."""
        if self._gram is None:
            self._gram = gram(self.generate())
        return self._gram

    @property
    def kept_gram(self) -> torch.Tensor | None:
        """The Gram matrix if :meth:`gram` has computed and kept it, else ``None`` (computes nothing)."""
        return self._gram

    def generate(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``A`` on this projection's device, cast to ``dtype``: a new tensor at every call."""
        return self.spec.generate(self.device, dtype)

    def project(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x Aᵀ`` without autograd history (of the primal, for a forward-AD dual ``x``), ``A``
        generated in ``dtype`` (default ``x``'s; autocast applies as to any product) and freed,
        the product reused while the same unchanged ``x`` comes again."""
        projection_dtype = x.dtype if dtype is None else dtype
        device = x.device.type
        autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        key = (x._version, projection_dtype, autocast)
        cached = self._cached
        if cached is not None and cached[0]() is x and cached[1] == key:
            return cached[2]
        with torch.no_grad():
            primal = fwAD.unpack_dual(x).primal  # a forward-AD probe passes dual inputs
            projected = F.linear(primal if dtype is None else primal.to(dtype), self.generate(projection_dtype))
        self._cached = (weakref.ref(x, self._forget), key, projected)
        return projected

    @property
    def holds_product(self) -> bool:
        """Whether an ``x Aᵀ`` is cached (it is dropped when its input is freed)."""
        return self._cached is not None

    def _forget(self, reference: weakref.ref) -> None:
        if self._cached is not None and self._cached[0] is reference:
            self._cached = None


class SketchedLinear(torch.autograd.Function):
    """``y = x Wᵀ + b`` whose backward accumulates ``gᵀ (x Aᵀ)`` into ``sketch`` (d×r, fp32).

    ``x_projected`` (``x Aᵀ``, no autograd history) comes from :class:`SharedProjection`, so that
    siblings sharing ``x`` and ``A`` save one tensor between them; ``A`` is not needed here."""

    @staticmethod
    def forward(ctx, x, weight, bias, x_projected, sketch, anchor, state=None):
        y = F.linear(x, weight, bias)
        ctx.save_for_backward(x_projected, weight)
        ctx.sketch = sketch
        ctx.state = state
        ctx.x_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, grad_output):
        x_projected, weight = ctx.saved_tensors
        g = grad_output.reshape(-1, grad_output.shape[-1])
        xp = x_projected.reshape(-1, x_projected.shape[-1]).to(g.dtype)
        if ctx.state is not None:
            ctx.state.reached = True
        if g.dtype == ctx.sketch.dtype:
            ctx.sketch.addmm_(g.t(), xp)
        else:
            # A bf16/fp16 GEMM accumulates in fp32 internally but returns its d×r product rounded to
            # 16 bits; products of microbatches are then summed in fp32.
            ctx.sketch.add_(g.t() @ xp)
            if ctx.state is not None and g.dtype in (torch.bfloat16, torch.float16):
                ctx.state.sketched_in_16_bit = True  # its rounding noise: see polar.POLAR_FLOOR_16BIT
                ctx.state.sketched_in_fp16 |= g.dtype == torch.float16
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_output @ weight.to(grad_output.dtype)).to(ctx.x_dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = g.sum(0)
        return grad_x, None, grad_bias, None, None, None, None


def sketched_linear(x, weight, bias, projection: SharedProjection, sketch, state=None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` that sketches ``gᵀ (x Aᵀ)`` in backward; ``x Aᵀ`` is computed
    in the dtype of the main product (autocast applies to both), with ``A`` generated for it.
    ``state`` (the target's ``TargetState``) records a 16-bit product (``sketched_in_16_bit``)."""
    return SketchedLinear.apply(x, weight, bias, projection.project(x), sketch, GRAPH_ANCHOR, state)


class SketchBank:
    """One flat fp32 buffer per device holding the sketches of all targets, each a ``d×r`` view.

    ``flat_buffers()`` is what a data-parallel reduction averages; ``views[i]`` is target ``i``'s
    sketch ``S``.
    """

    def __init__(self, shapes: Sequence[tuple[int, int]], devices: Sequence[torch.device]):
        self.flat: dict[torch.device, torch.Tensor] = {}
        sizes: dict[torch.device, int] = {}
        offsets = []
        for (rows, cols), device in zip(shapes, devices):
            offsets.append(sizes.get(device, 0))
            sizes[device] = offsets[-1] + rows * cols
        for device, size in sizes.items():
            self.flat[device] = torch.zeros(size, dtype=torch.float32, device=device)
        self.views = [
            self.flat[device][offset : offset + rows * cols].view(rows, cols)
            for (rows, cols), device, offset in zip(shapes, devices, offsets)
        ]

    def flat_buffers(self) -> list[torch.Tensor]:
        return list(self.flat.values())

    def zero_(self) -> None:
        for buffer in self.flat.values():
            buffer.zero_()

    def all_zero(self) -> bool:
        return not any(bool(buffer.any()) for buffer in self.flat.values())

    def all_finite(self) -> bool:
        return all_finite(self.flat.values())


def generated(projections: Iterable[SharedProjection], dtype: torch.dtype = torch.float32) -> Iterator[torch.Tensor]:
    """``A`` of each projection in turn, generated once for a run of consecutive identical ones:
    targets come in module order, where siblings sharing ``A`` (``q/k/v``, ``gate/up``) are adjacent.
    Only the latest ``A`` is referenced here, so a loop over all targets holds one or two at a time."""
    current, tensor = None, None
    for projection in projections:
        if projection is not current:
            tensor = None  # let the previous group's A go before generating the next
            current, tensor = projection, projection.generate(dtype)
        yield tensor
