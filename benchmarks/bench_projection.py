"""Raw speed of generating one projection ``A`` (``make_projection``), as every use now does.

Since projections are generated where they are used and never kept, a training step generates each
group's ``A`` once per forward (per microbatch), once for the step sizes and once for the merge (one
more pair at a redraw with a first moment). This times one generation (median and fastest of ``--repeats``,
after one warm-up), for each kind and width at rank ``--rank``, on ``--device``::

    python benchmarks/bench_projection.py --threads 2 --output benchmarks/results/projection-cpu.json

With ``--config``, it also trains that model (random weights, fp32, LoGRA RowAdam at ``--rank``,
``--batch × --seq`` random tokens, ``--steps`` steps after one warm-up) and reports, per step, the
step time and the part of it spent generating ``A`` (every generation timed in the same process,
so both suffer the same machine load), and how many generations a step makes::

    python benchmarks/bench_projection.py --threads 2 --config benchmarks/configs/qwen2-h1024.json

It calls only ``make_projection(seed, rank, width, kind, device=...)``, so the same command times
another release's generator when that release is first on ``PYTHONPATH`` (the numbers in
docs/benchmarks.md compare the Mersenne Twister one this way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from logra_optim import make_projection


def seconds(rank: int, width: int, kind: str, device: str, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` generations (a new seed each time: nothing can be cached)."""
    make_projection(0, rank, width, kind, device=device)
    times = []
    for seed in range(1, repeats + 1):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        make_projection(seed, rank, width, kind, device=device)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return times


def step_share(config_path: str, rank: int, batch: int, seq: int, steps: int) -> dict:
    """Seconds per training step, and seconds and count of the generations of ``A`` inside it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import logra_optim
    from logra_optim import LoGRAOptimizer, patch_model

    config = AutoConfig.from_pretrained(config_path)
    config.use_cache = False
    torch.manual_seed(0)
    model = patch_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32)).train()
    optimizer = LoGRAOptimizer(model, rank=rank, direction="rowadam")  # as the stored results
    tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    spent = {"seconds": 0.0, "count": 0}

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return make_projection(*args, **kwargs)
        finally:
            spent["seconds"] += time.perf_counter() - started
            spent["count"] += 1

    # Every module that calls make_projection by name (also another release's, for a comparison).
    ours = [module for name, module in list(sys.modules.items()) if name.startswith(logra_optim.__name__)]
    callers = [module for module in ours if getattr(module, "make_projection", None) is make_projection]
    for module in callers:
        module.make_projection = timed
    try:
        rows = []
        for step in range(steps + 1):  # the first is a warm-up
            spent.update(seconds=0.0, count=0)
            started = time.perf_counter()
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step:
                rows.append((time.perf_counter() - started, spent["seconds"], spent["count"]))
    finally:
        for module in callers:
            module.make_projection = make_projection
    step_s, generation_s, count = (statistics.median(column) for column in zip(*rows))
    return {"step_s": step_s, "generation_s": generation_s, "generations": count, "steps": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--widths", default="1024,2816", help="in-widths k, comma-separated")
    parser.add_argument("--kinds", default="rademacher,gaussian")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--output", help="write the results as JSON here")
    parser.add_argument("--config", help="a config.json: also time the generations inside training steps")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for kind in args.kinds.split(","):
        for width in (int(w) for w in args.widths.split(",")):
            times = seconds(args.rank, width, kind, args.device, args.repeats)
            median, fastest = statistics.median(times), min(times)
            rows.append(
                {
                    "kind": kind,
                    "rank": args.rank,
                    "width": width,
                    "device": args.device,
                    "median_s": median,
                    "min_s": fastest,
                }
            )
            where = f"{kind:>10}  {args.rank}×{width:<6} {args.device}"
            print(f"{where}: median {median * 1e3:7.2f} ms, min {fastest * 1e3:7.2f} ms")
    result = {"results": rows}
    if args.config:
        share = step_share(args.config, args.rank, args.batch, args.seq, args.steps)
        result["step"] = {"config": args.config, "batch": args.batch, "seq": args.seq, **share}
        print(
            f"training step ({args.config}, {args.batch}×{args.seq}, r={args.rank}): median {share['step_s']:.3f} s, "
            f"of which generating A {share['generation_s']:.3f} s ({share['generation_s'] / share['step_s']:.1%}) "
            f"in {share['generations']:.0f} generations"
        )
    if args.output:
        meta = {"threads": torch.get_num_threads(), "torch": torch.__version__, "repeats": args.repeats}
        with open(args.output, "w") as handle:
            json.dump({"meta": meta, **result}, handle, indent=1)


if __name__ == "__main__":
    main()
