"""Driving a ``LoGRAOptimizer`` in the tests: a two-target model, random microbatches, float64
snapshots of what a step consumes, and an exact comparison of state dicts."""

from __future__ import annotations

import torch

from logra_optim import LoGRAOptimizer, patch_model, patched_modules
from tests.helpers.tiny import TwoLinear
from logra_optim.patching import target_state


def two_linear(model_seed: int = 0, **kwargs):
    """A patched :class:`TwoLinear` (targets ``up`` 12→10 and ``down`` 10→7) and its optimizer."""
    model = patch_model(TwoLinear(seed=model_seed), target_modules=["up", "down"])
    return model, LoGRAOptimizer(model, **kwargs)


def backward_random(model, generator: torch.Generator, k: int = 12, d: int = 7, rows: int = 3) -> None:
    """One microbatch through a TwoLinear-shaped model with loss ⟨y, g⟩ for random g."""
    x = torch.randn(rows, k, generator=generator)
    g = torch.randn(rows, d, generator=generator)
    (model(x) * g).sum().backward()


def snapshot(model) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(W, S, A) per target, as float64 copies, taken right before a step."""
    return [
        (
            m.weight.detach().double().clone(),
            target_state(m).sketch.double().clone(),
            target_state(m).generate_projection().double(),
        )
        for _, m in patched_modules(model)
    ]


def assert_same_state(a, b, path: str = "state_dict") -> None:
    """``a`` and ``b`` are equal: same nesting, keys in the same order, tensors of the same dtype
    and bit-identical values."""
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            assert_same_state(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    else:
        assert a == b, path
