"""Worker for tests/test_distributed.py, run as
``torchrun --nproc_per_node 2 -m tests.distributed_workers.equivalence MODE OUT`` from the repository root.

MODE is ``ddp``, ``fsdp2``, ``zero1``, ``zero2`` or ``zero3`` (gloo, CPU). For every configuration of
``common.CONFIGS`` it trains ``common.STEPS`` LoGRA steps on half batches and writes, from rank 0, the
full final weights as every rank sees them; then it trains two steps, saves a checkpoint in the
engine's own format (torch.save for DDP, DCP for FSDP2, DeepSpeed's checkpoints for ZeRO), rebuilds
everything, resumes and trains the third step. The test compares with one process on the full batch.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

from logra_optim import LoGRAOptimizer
from tests.distributed_workers.common import (
    finish,
    CONFIGS,
    MOE_MODES,
    NON_TARGET_LR,
    STEPS,
    build_model,
    external_non_target,
    logra_kwargs,
    rows_of,
    trained_weights,
)

warnings.filterwarnings("ignore", category=UserWarning)
torch.set_num_threads(1)


def deepspeed_config(stage: int, persistent: bool = False) -> dict:
    zero = {"stage": stage}
    if stage == 3 and not persistent:
        zero["stage3_param_persistence_threshold"] = 0  # partition even the tiny model's weights
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


class Run:
    """One training setup: ``forward(batch) -> loss``, ``backward``, ``step``, ``weights``, ``save``/``load``."""

    def __init__(
        self, mode: str, config: str, root_only: bool = False, persistent: bool = False, moe: str | None = None
    ):
        self.mode, self.config = mode, config
        self.model = build_model(moe)
        kwargs = logra_kwargs(config, dist.get_world_size(), mode)
        sgd = lambda params: torch.optim.SGD(params, lr=NON_TARGET_LR)  # noqa: E731
        # Non-targets (the final norm): LoGRA's non_target_optimizer, or an SGD stepped after LoGRA's
        # step (the DeepSpeed engine's own optimizer under ZeRO).
        external = mode.startswith("zero") or external_non_target(config)
        kwargs["non_target_optimizer"] = "external" if external else sgd
        self.engine = self.external = None
        if mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.wrapped = DistributedDataParallel(self.model)
        elif mode == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            # root_only: one FSDP2 group holding every target, which FSDP2 keeps unsharded after a
            # forward (as it does for the root): the probe's forwards must not leave it stale.
            for layer in [] if root_only else self.model.model.layers:
                fully_shard(layer)
            self.wrapped = fully_shard(self.model)
        else:
            import deepspeed

            self.engine, *_ = deepspeed.initialize(
                model=self.model,
                optimizer=sgd([self.model.model.norm.weight]),
                config=deepspeed_config(int(mode[-1]), persistent),
            )
            self.wrapped = self.engine
        if external and self.engine is None:
            self.external = sgd([self.model.model.norm.weight])
        self.opt = LoGRAOptimizer(self.model, **kwargs)

    def train_step(self, rank: int) -> None:
        loss = self.wrapped(**rows_of(rank)).loss
        if self.engine is not None:
            self.engine.backward(loss)
            self.opt.step()
            self.engine.step()
        else:
            loss.backward()
            self.opt.step()
            if self.external is not None:
                self.external.step()
                self.external.zero_grad()
        self.opt.zero_grad()

    def weights(self) -> dict[str, torch.Tensor]:
        if self.mode == "fsdp2":
            from torch.distributed.tensor import DTensor

            with torch.no_grad():
                full = {}
                for name, tensor in trained_weights(self.model).items():
                    full[name] = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                return full
        if self.mode == "zero3":
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.model.parameters())):
                return trained_weights(self.model)
        return trained_weights(self.model)

    def save(self, directory: str) -> None:
        if self.mode == "ddp":
            if dist.get_rank() == 0:
                os.makedirs(directory, exist_ok=True)
                torch.save(
                    {"model": self.model.state_dict(), "optim": self.opt.state_dict()},
                    os.path.join(directory, "checkpoint.pt"),
                )
            dist.barrier()
        elif self.mode == "fsdp2":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            dcp.save({"model": get_model_state_dict(self.model), "optim": self.opt}, checkpoint_id=directory)
        else:
            self.engine.save_checkpoint(directory, tag="step", client_state={"logra": self.opt.state_dict()})

    def load(self, directory: str) -> None:
        if self.mode == "ddp":
            state = torch.load(os.path.join(directory, "checkpoint.pt"), weights_only=True)
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optim"])
        elif self.mode == "fsdp2":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

            state = {"model": get_model_state_dict(self.model), "optim": self.opt}  # the optimizer is Stateful
            dcp.load(state, checkpoint_id=directory)
            set_model_state_dict(self.model, state["model"])
        else:
            _, client = self.engine.load_checkpoint(directory, tag="step")
            self.opt.load_state_dict(client["logra"])


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if mode.startswith("zero"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()

    def trained(run: Run, with_state: bool = False) -> dict:
        """``STEPS`` training steps; the final weights and every step's α (and optimizer state)."""
        alphas = []
        for _ in range(STEPS):
            run.train_step(rank)
            alphas.append(run.opt.stats["alpha"])
        result = {"weights": run.weights(), "alphas": alphas}
        if with_state:
            result["state"] = run.opt.state_dict()
        return result

    results = {config: trained(Run(mode, config), with_state=True) for config in CONFIGS}
    if mode == "zero3":  # ZeRO-3's default: small parameters stay whole as well as partitioned
        results["kl-check-persistent"] = trained(Run(mode, "kl-check", persistent=True))
    if mode == "zero3":  # the JVP probe is refused clearly under ZeRO-3
        run = Run(mode, "plain")
        try:
            LoGRAOptimizer(run.model, rank=4, kl_budget=1e-3, non_target_optimizer="external")
        except ValueError as error:
            results["jvp_error"] = str(error)
        del run
    if mode in MOE_MODES:  # stacked experts: replicated (DDP) or sharded over experts (FSDP2)
        run = Run(mode, "kl", moe="qwen3_moe")
        results["moe"] = trained(run, with_state=True)
        layouts = [(t.layout.kind, t.layout.start, t.layout.stop) for t in run.opt.targets if t.experts > 1]
        results["moe_layouts"] = [None] * dist.get_world_size()
        dist.all_gather_object(results["moe_layouts"], layouts)
    if mode == "fsdp2":
        results["kl-check-root-only"] = trained(Run(mode, "kl-check", root_only=True))

    # Checkpoint: two steps, save, a fresh setup resumes and takes the third.
    checkpoint = os.path.join(out, f"{mode}-checkpoint")
    run = Run(mode, "kl")
    for _ in range(STEPS - 1):
        run.train_step(rank)
    run.save(checkpoint)
    del run
    resumed = Run(mode, "kl")
    resumed.load(checkpoint)
    resumed.train_step(rank)
    results["resumed"] = {"weights": resumed.weights(), "update_index": resumed.opt.update_index}

    # Every rank's view, so the test can check that replicated copies agree bit for bit.
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {k: v["weights"] for k, v in results.items() if isinstance(v, dict)})
    if rank == 0:
        results["per_rank"] = everyone
        torch.save(results, os.path.join(out, f"{mode}.pt"))
        print(json.dumps({"ok": mode}))
    finish()


if __name__ == "__main__":
    main()
