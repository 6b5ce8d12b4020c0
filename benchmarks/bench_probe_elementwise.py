"""The JVP probe with and without its elementwise tangents (``logra_optim.tangents``).

One whole probe (``jvp_predicted_kl``) of the demo's medium policy (the Qwen2 shape of ``logra
demo``: hidden 1024, intermediate 2816, 2 layers, built from a config, nothing downloaded), patched
and bound to a ``LoGRAOptimizer`` (rank 32), with random factors, on probe contexts of each size
asked for. The two variants run alternately in one process, ``--repeats`` times each, so that the
CPU's speed drifting over minutes weighs on both alike; the table gives the median and the fastest
of each, and how many calls the mode computed per probe.

    python benchmarks/bench_probe_elementwise.py --json benchmarks/results/probe-elementwise.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import torch

from logra_optim import LoGRAOptimizer, patch_model, probe, tangents
from logra_optim.cli.demo import build_policy, build_tokenizer
from logra_optim.probe import ProbeContexts, jvp_predicted_kl

VARIANTS = {"with the mode": tangents.ElementwiseTangentMode, "torch's forward AD alone": contextlib.nullcontext}


def counted_calls(run) -> int:
    """How many calls one probe computes through the mode."""
    direct, taken = tangents.binary_with_plain_operand, []

    def counting(*args):
        result = direct(*args)
        taken.append(result is not None)
        return result

    tangents.binary_with_plain_operand = counting
    try:
        run()
    finally:
        tangents.binary_with_plain_operand = direct
    return sum(taken)


def main() -> None:
    parser = argparse.ArgumentParser(description="The JVP probe with and without its elementwise tangents")
    parser.add_argument("--contexts", default="8x7,2x256", help="comma-separated SEQUENCESxLENGTH probe sizes")
    parser.add_argument("--repeats", type=int, default=15, help="timed probes per variant and size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=str)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = build_tokenizer()
    model = build_policy(tokenizer, seed=0, size="medium")
    patch_model(model)
    optimizer = LoGRAOptimizer(model, rank=32, kl_budget=1e-3)
    generator = torch.Generator().manual_seed(0)
    targets = [target.state for target in optimizer.targets]
    factors = [torch.randn(t.shape[0], 32, generator=generator) * 1e-3 for t in optimizer.targets]

    rows = []
    for size in args.contexts.split(","):
        sequences, length = (int(n) for n in size.split("x"))
        ids = torch.randint(0, len(tokenizer), (sequences, length), generator=generator)
        contexts = ProbeContexts(ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))

        def run():
            return jvp_predicted_kl(model, targets, factors, contexts)[0]

        values, times = {}, {name: [] for name in VARIANTS}
        for _ in range(args.repeats + 1):  # the first round warms up
            for name, mode in VARIANTS.items():
                probe.ElementwiseTangentMode = mode
                started = time.perf_counter()
                values[name] = float(run())
                times[name].append(time.perf_counter() - started)
        probe.ElementwiseTangentMode = VARIANTS["with the mode"]
        row = {
            "contexts": size,
            "calls_taken": counted_calls(run),
            "relative_difference": abs(values["with the mode"] / values["torch's forward AD alone"] - 1),
        }
        for name in VARIANTS:
            row[name] = {"median_s": statistics.median(times[name][1:]), "min_s": min(times[name][1:])}
        rows.append(row)
        print(f"{size}: {json.dumps(row)}", file=sys.stderr)

    print(
        f"\nthe demo's medium policy, rank 32, fp32, {args.threads} threads, {args.repeats} alternating probes each\n"
    )
    print(
        "| probe contexts | calls taken | with the mode (median / fastest) | torch alone (median / fastest) "
        "| saved (median) | q agrees to |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        mode, alone = row["with the mode"], row["torch's forward AD alone"]
        print(
            f"| {row['contexts']} | {row['calls_taken']} | {mode['median_s'] * 1e3:.0f} / {mode['min_s'] * 1e3:.0f} ms "
            f"| {alone['median_s'] * 1e3:.0f} / {alone['min_s'] * 1e3:.0f} ms "
            f"| {(alone['median_s'] - mode['median_s']) * 1e3:.0f} ms ({1 - mode['median_s'] / alone['median_s']:.0%}) "
            f"| {row['relative_difference']:.0e} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
