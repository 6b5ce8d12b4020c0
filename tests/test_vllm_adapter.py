"""The vLLM adapter's boundaries, without an engine: the worker-side module loads on its own, the
extension path vLLM imports names the class, and targets the sync cannot place (GPT-OSS's transposed
experts) are refused before any engine is reached. (That the trainer side reads only the optimizer's
public view is checked against a real engine in test_vllm.py.)"""

from __future__ import annotations

import importlib
import subprocess
import sys


import pytest

import logra_optim.integrations.vllm as adapter
from logra_optim import LoGRAOptimizer, patch_model
from logra_optim.integrations.vllm import EXTENSION, LoGRAWorkerExtension
from tests.helpers.tiny import tiny_gpt_oss


def _resolve(dotted: str):
    """What vLLM does with ``worker_extension_cls``."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_extension_path_names_the_worker_class():
    assert _resolve(EXTENSION) is LoGRAWorkerExtension
    # The path the adapter had before it became a package still works (documented for servers).
    assert _resolve("logra_optim.integrations.vllm.LoGRAWorkerExtension") is LoGRAWorkerExtension


def test_every_public_name_is_importable_from_the_package():
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


def test_sync_refuses_transposed_experts_by_name():
    """GPT-OSS's experts are targets stored transposed, and vLLM keeps them in a layout of its own
    (often mxfp4) that no placement maps: ``VLLMSync`` refuses them by name before reaching any
    engine, rather than place their updates wrong."""
    optimizer = LoGRAOptimizer(patch_model(tiny_gpt_oss()), rank=4)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj'.*experts=False"):
        adapter.VLLMSync(optimizer, engine=None)
