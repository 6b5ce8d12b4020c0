"""Worker for tests/test_distributed.py: TRL's GRPOTrainer with DeepSpeed ZeRO-2 or ZeRO-3 on 2 ranks.

Run as ``torchrun --nproc_per_node 2 grpo_deepspeed.py STAGE OUT``. CPU workaround from
ENVIRONMENT.md: ``ACCELERATE_USE_DEEPSPEED=true``, a gloo ``PartialState`` created before the config,
``use_cpu=False`` and ``accelerator_config={"use_configured_state": True}``. The final norm is trained
by the engine's optimizer (DeepSpeed builds no engine without a trainable parameter); LoGRA trains
every attention/MLP matrix beside it. Rank 0 writes what the test checks.
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import PartialState  # noqa: E402

import trl_setup as setup  # noqa: E402
from logra_optim import canonical_name, patch_model, patched_modules  # noqa: E402
from logra_optim.integrations.trl import attach_logra  # noqa: E402

STEPS = 3


def main() -> None:
    stage, out = int(sys.argv[1]), sys.argv[2]
    PartialState(backend="gloo")
    torch.set_num_threads(1)
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # really partition the tiny model
    deepspeed = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    model = patch_model(setup.build_policy())
    model.model.norm.weight.requires_grad_(True)
    initial = {canonical_name(n): m.weight.detach().clone() for n, m in patched_modules(model)}
    trainer = setup.build_trainer(
        "grpo", model, os.path.join(out, f"grpo-zero{stage}"), use_cpu=False, deepspeed=deepspeed,
        accelerator_config={"use_configured_state": True}, per_device_train_batch_size=4, max_steps=STEPS,
    )  # fmt: skip
    kwargs = dict(setup.LOGRA_KWARGS, non_target_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    if stage == 3:
        # ZeRO-3's module hooks have no forward-mode AD rule; ε near the expected α keeps the
        # finite difference inside the quadratic regime.
        kwargs.update(probe="finite_difference", fd_epsilon=0.25)
    callback = attach_logra(trainer, **kwargs)
    trainer.train()

    optimizer = callback.optimizer
    params = list(model.parameters())
    if stage == 3:
        import deepspeed as ds

        gather = ds.zero.GatheredParameters(params)
    else:
        import contextlib

        gather = contextlib.nullcontext()
    with gather:
        final = {canonical_name(n): m.weight.detach().clone() for n, m in patched_modules(model)}
    logs = [entry for entry in trainer.state.log_history if "logra/alpha" in entry]
    seen = {
        "update_index": optimizer.update_index,
        "moved": min(float((final[n] - initial[n]).abs().max()) for n in final),
        "weights": final,
        "alphas": [entry["logra/alpha"] for entry in logs],
        "predicted_kl": [entry["logra/predicted_kl"] for entry in logs],
        "zero3": any(hasattr(m.weight, "ds_tensor") for _, m in patched_modules(model)),
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    if dist.get_rank() == 0:
        torch.save(everyone, os.path.join(out, f"grpo-zero{stage}.pt"))
    dist.barrier()


if __name__ == "__main__":
    main()
