"""Targets the checkpoint already stores fused (Phi-3's ``qkv_proj`` / ``gate_up_proj``, Falcon's
``query_key_value``) against a real vLLM engine: vLLM splits them into blocks of its own (Falcon's
loader also permutes rows per head), so the sync sends them whole and everything else as factors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "family, fused", [("phi3", ["gate_up_proj", "qkv_proj"]), ("falcon", ["query_key_value"])], ids=["phi3", "falcon"]
)
def test_checkpoint_fused_targets_are_synced_whole_and_the_rest_compressed(family, fused, tmp_path):
    result_path = tmp_path / "result.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=ROOT)
    process = subprocess.run(
        [sys.executable, "-m", "tests.vllm_workers.fused_targets", family, str(tmp_path / "model"), str(result_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-5000:]
    result = json.loads(result_path.read_text())
    assert set(result["sent_whole"]) == set(fused)  # every layer's fused matrices, nothing else
    assert any("sent whole at every sync" in message for message in result["warnings"])
    assert result["kinds"] == ["full", "compressed", "compressed", "compressed"]
    assert max(result["engine_vs_trainer"]) < 1e-4  # the engine follows the trainer exactly (fp32)
    assert result["moved"] > 1e-3  # while the updates moved the policy
    assert result["drift"] < 1e-5
