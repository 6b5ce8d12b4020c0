"""Worker for tests/test_distributed.py: TRL's GRPOTrainer on 2 ranks, under DDP or DeepSpeed ZeRO-2/3.

Run as ``torchrun --nproc_per_node 2 -m tests.distributed_workers.grpo_distributed ENGINE OUT`` from the
repository root, with ENGINE ``ddp``, ``zero2`` or ``zero3``. DDP: ``use_cpu=True`` under torchrun.
DeepSpeed, with the CPU workaround of docs/distributed.md: ``ACCELERATE_USE_DEEPSPEED=true``, a gloo
``PartialState`` created before the config, ``use_cpu=False`` and
``accelerator_config={"use_configured_state": True}``. The final norm is trained too (DDP and
DeepSpeed refuse a model without a trainable parameter): by LoGRA's ``non_target_optimizer`` under
DDP, by the engine's optimizer under DeepSpeed. Rank 0 writes what the test checks.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

if sys.argv[1].startswith("zero"):
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import PartialState  # noqa: E402

from logra_optim import canonical_name, patch_model, patched_modules  # noqa: E402
from logra_optim.integrations.trl import attach_logra  # noqa: E402
from tests.helpers import trl_setup as setup  # noqa: E402

STEPS = 3


def deepspeed_config(stage: int) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # really partition the tiny model
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",  # transformers fills it from max_grad_norm, which attach_logra disables
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def train(engine: str, output_dir: str, resume: str | None = None, **overrides):
    """A GRPO run on the toy task; returns (trainer, LoGRA's callback, initial and final target weights)."""
    from accelerate.state import AcceleratorState

    # accelerate allows one DeepSpeed Accelerator per process: forget the previous run's (the
    # process group and the gloo PartialState stay).
    AcceleratorState._reset_state()
    model = patch_model(setup.build_policy())
    model.model.norm.weight.requires_grad_(True)
    initial = {canonical_name(n): m.weight.detach().clone() for n, m in patched_modules(model)}
    if engine == "ddp":
        overrides.update(use_cpu=True)
    else:
        overrides.update(
            use_cpu=False,
            deepspeed=deepspeed_config(int(engine[-1])),
            accelerator_config={"use_configured_state": True},
        )
    trainer = setup.build_trainer(
        "grpo", model, output_dir, per_device_train_batch_size=4, max_steps=STEPS, **overrides
    )
    kwargs = dict(setup.LOGRA_KWARGS, non_target_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    if engine == "zero3":
        # ZeRO-3's module hooks have no forward-mode AD rule; ε near the expected α keeps the
        # finite difference inside the quadratic regime.
        kwargs.update(probe="finite_difference", fd_epsilon=0.25)
    callback = attach_logra(trainer, **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    if engine == "zero3":
        import deepspeed as ds

        gather = ds.zero.GatheredParameters(list(model.parameters()))
    else:
        gather = contextlib.nullcontext()
    with gather:
        final = {canonical_name(n): m.weight.detach().clone() for n, m in patched_modules(model)}
        final["model.norm.weight"] = model.model.norm.weight.detach().clone()
    return trainer, callback, initial, final, model


def main() -> None:
    engine, out = sys.argv[1], sys.argv[2]
    PartialState(backend="gloo")
    torch.set_num_threads(1)
    trainer, callback, initial, final, model = train(engine, os.path.join(out, "uninterrupted"))
    logs = [entry for entry in trainer.state.log_history if "logra/alpha" in entry]
    seen = {
        "update_index": callback.optimizer.update_index,
        "moved": min(float((final[n] - initial[n]).abs().max()) for n in initial),
        "weights": final,
        "alphas": [entry["logra/alpha"] for entry in logs],
        "predicted_kl": [entry["logra/predicted_kl"] for entry in logs],
        "zero3": any(hasattr(m.weight, "ds_tensor") for _, m in patched_modules(model)),
        "clipping": trainer.model_wrapped.gradient_clipping() if engine != "ddp" else None,
    }
    # Checkpoint every 2 steps; a fresh trainer resumes from checkpoint-2 and takes step 3.
    checkpointed = os.path.join(out, "checkpointed")
    train(engine, checkpointed, save_strategy="steps", save_steps=2)
    _, resumed, _, resumed_final, _ = train(
        engine, os.path.join(out, "resumed"), resume=os.path.join(checkpointed, "checkpoint-2")
    )
    seen["resumed_weights"] = resumed_final
    seen["resumed_update_index"] = resumed.optimizer.update_index
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    if dist.get_rank() == 0:
        torch.save(everyone, os.path.join(out, f"grpo-{engine}.pt"))
    dist.barrier()


if __name__ == "__main__":
    main()
