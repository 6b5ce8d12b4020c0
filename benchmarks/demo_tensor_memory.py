"""The demo's memory split into tensors and the rest: how much of each method's peak RSS is tensor
memory (what ``torch.cuda.max_memory_allocated`` counts on a GPU) and how much is the allocator's
and the interpreter's.

For each method, in a fresh process: ``logra demo``'s own worker (``demo.run_worker``) for
``--steps`` GRPO updates from the demo's warm start, with TRL's ``train()`` run under
``torch.profiler`` and its memory timeline (``export_memory_timeline``). The tensor peak is the
timeline's highest total: every tensor the profiler saw, those from before training (the weights)
included once an operator used them. The profiler's own event buffers inflate RSS, so the
RSS column here is not comparable to the demo's: take that from ``summary.json``. The warm start
must exist: run ``logra demo`` with the same ``--output`` and seed first.

    python benchmarks/demo_tensor_memory.py --output benchmarks/results/demo --seed 1 --steps 6
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from logra_optim.cli import demo
from logra_optim.cli.arguments import positive_float, positive_int
from logra_optim.cli.measure import MIB
from logra_optim.cli.runner import run_fresh


def worker(spec: dict) -> dict:
    """One method's tensor peak during ``spec["steps"]`` updates of the demo's RL phase."""
    import trl
    from torch.profiler import ProfilerActivity, profile

    measured = {}
    train = trl.GRPOTrainer.train
    timeline = Path(tempfile.mkdtemp()) / "memory.json"

    def profiled_train(trainer, *args, **kwargs):
        weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        activities = [ProfilerActivity.CPU]
        with profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True) as profiler:
            result = train(trainer, *args, **kwargs)
        # [times, sizes per category]: every tensor the profiler saw, including those allocated before
        # it started (the weights) once an operator used them.
        profiler.export_memory_timeline(str(timeline), device="cpu")
        _, sizes = json.loads(timeline.read_text())
        measured.update(weights_bytes=weights, tensor_peak_bytes=max(map(sum, sizes)))
        return result

    trl.GRPOTrainer.train = profiled_train  # the demo's worker builds and runs its own trainer
    settings = {
        "output": spec["output"],
        "steps": spec["steps"],
        "eval_every": 0,
        "seeds": [spec["seed"]],
        "accumulation": spec["accumulation"],
        "kl_budget": spec["kl_budget"],
    }
    demo.run_worker({"settings": settings, "method": spec["method"], "seed": spec["seed"]})
    return {"method": spec["method"], **measured}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="benchmarks/results/demo", help="the demo run whose warm start to use")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--methods", nargs="+", default=list(demo.DEFAULT_METHODS), choices=demo.METHODS)
    defaults = demo.DemoSettings(output="")
    parser.add_argument(
        "--accumulation", type=positive_int, default=defaults.accumulation, help="microbatches per update"
    )
    parser.add_argument("--kl-budget", type=positive_float, default=defaults.kl_budget, help="LoGRA's KL per update")
    args = parser.parse_args(argv)
    rows = []
    for method in args.methods:
        spec = {**vars(args), "method": method}  # output, seed, steps, accumulation, kl_budget
        rows.append(run_fresh(worker, spec, label=f"tensor memory ({method})"))
    adamw = next((r for r in rows if r["method"] == "adamw"), None)
    print("| method | weights MiB | tensor peak MiB | tensor peak / dense AdamW's |")
    print("|---|---|---|---|")
    for r in rows:
        share = f"{r['tensor_peak_bytes'] / adamw['tensor_peak_bytes']:.2f}×" if adamw else "n/a"
        print(f"| {r['method']} | {r['weights_bytes'] / MIB:.0f} | {r['tensor_peak_bytes'] / MIB:.0f} | {share} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
