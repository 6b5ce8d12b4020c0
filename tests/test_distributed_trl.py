"""TRL's GRPOTrainer on real ranks: ``torchrun --nproc_per_node 2`` over gloo on the CPU, with DDP
and DeepSpeed ZeRO-2/3 (a file of its own so that a parallel test run can schedule it beside
tests/test_distributed.py)."""

from __future__ import annotations

import pytest
import torch

from tests.test_distributed import deepspeed_available, torchrun


@pytest.mark.parametrize(
    "engine",
    ["ddp", pytest.param("zero2", marks=deepspeed_available), pytest.param("zero3", marks=deepspeed_available)],
)
def test_grpo_trainer_on_two_ranks(engine, tmp_path):
    """TRL's GRPOTrainer under torchrun (gloo, CPU) with DDP or DeepSpeed ZeRO-2 / ZeRO-3, LoGRA
    attached with attach_logra: every update is applied on both ranks identically (ZeRO-3: into the
    partitions, gathered here), KL control runs (JVP; finite differences under ZeRO-3), its statistics
    reach the trainer's logs, and resuming from a checkpoint is bit-identical."""
    result = torchrun("grpo_distributed", engine, str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    first, second = torch.load(tmp_path / f"grpo-{engine}.pt", weights_only=False)
    for seen in (first, second):
        assert seen["update_index"] == 3
        assert seen["zero3"] == (engine == "zero3")
        assert seen["moved"] > 1e-4  # every target moved
        assert len(seen["alphas"]) == 3 and all(0 < a < 10 for a in seen["alphas"])
        assert all(q > 0 for q in seen["predicted_kl"])
    assert first["alphas"] == second["alphas"]
    for name, weight in first["weights"].items():
        assert torch.equal(weight, second["weights"][name]), name
    # Checkpoint every 2 steps (DDP: the trainer's optimizer.pt; DeepSpeed: its checkpoint + LoGRA's
    # state beside it); a fresh trainer
    # resumed from checkpoint-2 ends bit-identical to the uninterrupted run, the trained norm included.
    for seen in (first, second):
        assert seen["resumed_update_index"] == 3
        for name, weight in seen["weights"].items():
            assert torch.equal(seen["resumed_weights"][name], weight), name
