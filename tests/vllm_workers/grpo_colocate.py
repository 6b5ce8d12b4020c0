"""GRPO with ``use_vllm=True`` (colocate) and LoGRA on the toy task; writes a JSON summary.

Usage: grpo_colocate.py OUTPUT_DIR RESULT_JSON [POLICY [STEPS]], with the repository root on PYTHONPATH;
POLICY is ``dense`` (the tiny Qwen2, default) or ``moe`` (the tiny Qwen3-MoE with a dense MLP in its first
layer and experts in its second), STEPS 40 by default."""

import functools
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from logra_optim.integrations.trl import attach_logra  # noqa: E402
from tests.helpers import trl_setup  # noqa: E402
from tests.helpers.vllm_helpers import engine_logprobs, max_difference, trainer_logprobs  # noqa: E402

output, result_path = sys.argv[1], sys.argv[2]
policy = sys.argv[3] if len(sys.argv) > 3 else "dense"
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 40
build = {
    "dense": trl_setup.build_policy,
    "moe": functools.partial(trl_setup.build_moe_policy, mlp_only_layers=[0]),
}[policy]
path = trl_setup.save_policy(os.path.join(output, "policy"), build=build)
trainer = trl_setup.build_trainer(
    "grpo",
    path,
    os.path.join(output, "out"),
    use_vllm=True,
    vllm_mode="colocate",
    vllm_gpu_memory_utilization=0.1,
    vllm_max_model_length=64,
    max_steps=steps,
    per_device_train_batch_size=32,
    lr_scheduler_type="constant",
)
callback = attach_logra(trainer, **trl_setup.LOGRA_KWARGS)
trainer.train()
history = callback.vllm_sync["sync"].history
sync = callback.vllm_sync["sync"]
sync.sync()  # bring the engine to the final update, then compare
model = trainer.model
model.eval()
logs = trainer.state.log_history
rewards = [entry["reward"] for entry in logs if "reward" in entry]
differences = [
    entry["sampling/sampling_logp_difference/mean"]
    for entry in logs
    if "sampling/sampling_logp_difference/mean" in entry
]
with torch.no_grad():
    served, trained = engine_logprobs(trainer.vllm_generation.llm), trainer_logprobs(model)
    difference = max_difference(served, trained)
    per_token = torch.cat([(a - b).abs() for a, b in zip(served, trained)])
status = sync.engine.call("logra_status")[0]
json.dump(
    {
        "expert_targets": sum(target.experts > 1 for target in sync.optimizer.targets),
        "engine_dtype": status["dtype"],
        "engine_mode": status["mode"],
        "engine_index": status["index"],
        "trainer_index": sync.optimizer.update_index,
        **sync.drift(),
        "kinds": [h["kind"] for h in history],
        "full_bytes": history[0]["bytes"],
        "compressed_bytes": max(h["bytes"] for h in history[1:]),
        "engine_vs_trainer": difference,
        "engine_vs_trainer_median": float(per_token.median()),
        "sampling_logp_difference": max(differences),
        "first_reward": sum(rewards[:5]) / 5,
        "last_reward": sum(rewards[-5:]) / 5,
    },
    open(result_path, "w"),
)
