"""The vLLM adapter's boundaries, without an engine: the worker-side module loads on its own, the
extension path vLLM imports names the class, and the trainer side reads only the optimizer's public
view (a stand-in transport plays the engine)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import torch
import torch.nn as nn

from logra_optim import LoGRAOptimizer, patch_model
from logra_optim.projection import projection_seed
from logra_optim.sync import SyncPayload, checksum_probe, projection_of, weight_checksum
from logra_optim.updates import merge_low_rank_

import logra_optim.integrations.vllm as adapter
from logra_optim.integrations.vllm import EXTENSION, LoGRAWorkerExtension, VLLMSync, wire


def _resolve(dotted: str):
    """What vLLM does with ``worker_extension_cls``."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_extension_path_names_the_worker_class():
    assert _resolve(EXTENSION) is LoGRAWorkerExtension
    # The path the adapter had before it became a package still works (documented for servers).
    assert _resolve("logra_optim.integrations.vllm.LoGRAWorkerExtension") is LoGRAWorkerExtension


def test_every_public_name_is_importable_from_the_package():
    assert sorted(adapter.__all__) == sorted(adapter._HOMES)
    for name in adapter.__all__:
        assert getattr(adapter, name) is not None


def test_a_worker_loads_the_engine_side_only():
    code = (
        "import importlib, sys\n"
        f"module, _, name = {EXTENSION!r}.rpartition('.')\n"
        "getattr(importlib.import_module(module), name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('logra_optim.integrations')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = eval(out.strip().splitlines()[-1])
    assert "logra_optim.integrations.vllm.engine" in loaded
    assert "logra_optim.integrations.vllm.trainer" not in loaded
    assert "logra_optim.integrations.trl" not in loaded


# --------------------------------------------------------------------------------------------------
# The trainer side against a stand-in engine


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(12, 16), nn.Linear(16, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.down(torch.tanh(self.up(x))) * self.scale


class _Wrapped(nn.Module):
    """Puts ``module.`` in front of every name, as DDP does; the engine must not see it."""

    def __init__(self, inner):
        super().__init__()
        self.module = inner

    def forward(self, x):
        return self.module(x)


class _PublicOnly:
    """An optimizer whose private attributes cannot be read."""

    def __init__(self, optimizer):
        self._wrapped = optimizer

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AssertionError(f"the adapter read the optimizer's private attribute {name!r}")
        return getattr(self._wrapped, name)


class _LoopbackEngine:
    """A transport whose engine is a dict of fp32 weights in this process, updated like the shadows."""

    def __init__(self):
        self.weights: dict[str, torch.Tensor] = {}

    def call(self, method, *args):
        if method in ("logra_full_sync", "logra_load"):
            self.weights.update({name: tensor.float() for name, tensor in args[0]})
        elif method == "logra_apply":
            payload = SyncPayload.decode(args[0])
            for update in payload.updates:
                for target in update.targets:
                    weight = self.weights[target.name]
                    merge_low_rank_(weight, target.factor, projection_of(payload, target), stochastic_rounding=False)
        elif method == "logra_checksums":
            names, seed = json.loads(args[0]), int(args[1])
            result = {"tp_size": 1, "copy_dtype": "torch.float32", "served_dtype": "torch.float32"}
            for name in names:
                weight = self.weights[name]
                probe = checksum_probe(projection_seed(seed, 0, name), weight.shape[1])
                checksum = weight_checksum(weight, probe)
                result[name] = (0, checksum, checksum, False)
            return [wire.dump(result)]
        return [{"seconds": 0.0}]

    def wire(self, data):
        return data

    def wire_weights(self, weights):
        return weights, sum(t.numel() * t.element_size() for _, t in weights)

    def reset_prefix_cache(self):
        pass


def test_trainer_side_keeps_a_copy_in_step_through_the_public_view_only():
    torch.manual_seed(0)
    model = patch_model(_Wrapped(_Net()), target_modules=["up", "down"])
    model.module.scale.requires_grad_(True)
    optimizer = LoGRAOptimizer(
        model, rank=3, update_ratio=1e-2, seed=5, non_target_optimizer=lambda params: torch.optim.SGD(params, lr=0.1)
    )
    sync = VLLMSync(_PublicOnly(optimizer), "http://127.0.0.1:9", check_every=2)
    engine = sync.engine = _LoopbackEngine()
    assert sync.sync()["kind"] == "full"
    assert set(engine.weights) == {"up.weight", "up.bias", "down.weight", "down.bias", "scale"}
    for _ in range(4):
        model(torch.randn(6, 12)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        stats = sync.sync()
        assert stats["kind"] == "compressed" and stats["bytes"] > 0
    assert stats["drift"] < 1e-6 and stats["served_drift"] < 1e-6
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(engine.weights[name.removeprefix("module.")], parameter.detach(), rtol=0, atol=1e-6)
    sync.close()
