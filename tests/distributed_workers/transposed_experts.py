"""Worker for tests/test_distributed.py, run as
``torchrun --nproc_per_node 2 -m tests.distributed_workers.transposed_experts OUT`` from the repository root.

GPT-OSS's experts are stored transposed (``[E, in, out]``). For DDP (replicated) and FSDP2 (sharded
over experts, unevenly: 3 experts on 2 ranks) it trains ``common.STEPS`` LoGRA steps with KL control
on half batches (the probe runs through the routed experts) and writes, from rank 0, the full final
weights and every step's α, and each rank's expert layouts. The test compares with one process on
the full batch.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

from tests.distributed_workers.common import MOE_MODES, STEPS, finish
from tests.distributed_workers.equivalence import Run

warnings.filterwarnings("ignore", category=UserWarning)
torch.set_num_threads(1)


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    for mode in MOE_MODES:
        run = Run(mode, "kl", moe="gpt_oss")
        alphas = []
        for _ in range(STEPS):
            run.train_step(rank)
            alphas.append(run.opt.stats["alpha"])
        layouts = [(t.layout.kind, t.layout.start, t.layout.stop, t.layout.transposed) for t in run.opt.targets]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, [layout for layout, t in zip(layouts, run.opt.targets) if t.experts > 1])
        results[mode] = {"weights": run.weights(), "alphas": alphas, "layouts": everyone}
        del run  # DDP's and FSDP2's state released before the next mode and before the group goes
    if rank == 0:
        torch.save(results, os.path.join(out, "transposed_experts.pt"))
        print(json.dumps({"ok": list(results)}))
    finish()


if __name__ == "__main__":
    main()
