"""The demo's memory split into tensors and the rest: how much of each method's peak RSS is tensor
memory (what ``torch.cuda.max_memory_allocated`` counts on a GPU) and how much is the allocator's
and the interpreter's.

For each method, in a fresh process: ``logra demo``'s own worker (``demo.run_worker``) for
``--steps`` GRPO updates from the demo's warm start, with TRL's ``train()`` run under
``torch.profiler`` (``profile_memory=True``). The tensor peak is the running sum of the CPU
allocator's allocation events at its highest, plus the tensors alive when training started (the
weights, measured as the parameters' bytes). The profiler's own event buffers inflate RSS, so the
RSS column here is not comparable to the demo's: take that from ``summary.json``. The warm start
must exist: run ``logra demo`` with the same ``--output`` and seed first.

    python benchmarks/demo_tensor_memory.py --output benchmarks/results/demo --seed 1 --steps 6
"""

from __future__ import annotations

import argparse
import json

from logra_optim.cli import demo
from logra_optim.cli.measure import MIB
from logra_optim.cli.runner import run_fresh


def worker(spec: dict) -> dict:
    """One method's tensor peak during ``spec["steps"]`` updates of the demo's RL phase."""
    import trl
    from torch.profiler import ProfilerActivity, profile

    measured = {}
    train = trl.GRPOTrainer.train

    def profiled_train(trainer, *args, **kwargs):
        weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            result = train(trainer, *args, **kwargs)
        events = [e for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"]
        level = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            level += event.nbytes()
            peak = max(peak, level)
        measured.update(weights_bytes=weights, tensor_peak_bytes=weights + peak)
        return result

    trl.GRPOTrainer.train = profiled_train
    settings = {"output": spec["output"], "steps": spec["steps"], "eval_every": 0, "seeds": [spec["seed"]]}
    demo.run_worker({"settings": settings, "method": spec["method"], "seed": spec["seed"]})
    return {"method": spec["method"], **measured}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="benchmarks/results/demo", help="the demo run whose warm start to use")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--methods", nargs="+", default=list(demo.METHODS), choices=demo.METHODS)
    args = parser.parse_args(argv)
    rows = []
    for method in args.methods:
        spec = dict(output=args.output, seed=args.seed, steps=args.steps, method=method)
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
