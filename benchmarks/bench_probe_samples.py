"""What the KL probe's sample count buys and costs in ``logra demo``: time per update against the
KL each update moves sequences the probe did not read.

LoGRA's KL probe reads ``probe_samples`` sequences of every batch (a dual forward of them) and
scales the update so that its predicted KL on those sequences is the budget. The demo probes 8 of
its 32 completions; the optimizer's default is 2 (the paper's: 2 per data-parallel rank). On the
demo's small batches the probe is a large part of LoGRA's time per update, so fewer sequences are
faster; the step is then fitted to less of the batch, and the rest of it may move further.

For each seed: dense AdamW, LoGRA at each ``--probe-samples`` value, dense AdamW again, each in a
fresh process from the demo's warm start, with the demo's settings otherwise (policy, task, rank,
KL budget, update ratio, batch). AdamW runs first and last so that the machine's drift over the
runs shows beside the ratios; every time ratio divides by the mean of its seed's AdamW runs that
finished (both, unless one failed). Reported per run: seconds per update (the demo's: generation,
forward, backward and step, without greedy evaluations and the KL meter) and its ratio, LoGRA's
probe seconds per update, the sampled-reward AUC, the greedy reward after RL, and each update's KL
on the demo meter's held-out sequences over LoGRA's budget: median, 95th percentile and maximum over
updates, and the number of updates above ``--tail`` × the budget. The meter reads 8 rows of each
batch spread over those the run's probe did not read (``demo.held_out_rows``), so which 8 depends
on the probe count; AdamW's runs are metered as in the demo, on the rows an 8-sequence probe leaves.

Writes ``probe-samples.json`` (settings, summaries and every run's record) and ``probe-samples.md``.

    python benchmarks/bench_probe_samples.py --seeds 0 --output benchmarks/results/probe-samples
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from logra_optim.cli import demo
from logra_optim.cli.arguments import device, int_list, positive_float, positive_int, writable_dir
from logra_optim.cli.measure import spread
from logra_optim.cli.runner import WorkerFailed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_probe_samples.py",
        description="logra demo's LoGRA at several KL-probe sample counts beside dense AdamW: time per update "
        "against the KL on sequences the probe did not read.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = demo.DemoSettings(output="")
    parser.add_argument(
        "--probe-samples", type=int_list, default=[2, 4, 8, 16], help="comma-separated sequences per probe"
    )
    parser.add_argument("--seeds", type=int_list, default=[0], help="comma-separated")
    parser.add_argument("--steps", type=positive_int, default=defaults.steps, help="GRPO updates per run")
    parser.add_argument(
        "--policy", choices=sorted(demo.POLICIES), default=defaults.policy, help="the demo's built-in policy"
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=defaults.batch_size, help="completions per microbatch"
    )
    parser.add_argument(
        "--accumulation", type=positive_int, default=defaults.accumulation, help="microbatches per update"
    )
    parser.add_argument("--warm-start-steps", type=int, default=defaults.warm_start_steps, help="at most this many")
    parser.add_argument("--kl-budget", type=positive_float, default=defaults.kl_budget, help="LoGRA's KL per update")
    parser.add_argument("--tail", type=positive_float, default=5.0, help="count updates above this × the budget")
    parser.add_argument(
        "--kl-floor", type=positive_float, default=None, help="LoGRA's kl_floor (default: none, as in the demo)"
    )
    parser.add_argument("--device", type=device, default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--output", type=writable_dir, default="logra-probe-samples")
    return parser


def kl_summary(record: dict, budget: float, tail: float) -> dict:
    """The meter's KL per update over ``budget``: median, 95th percentile and maximum over updates,
    how many updates exceeded ``tail`` × the budget, and how many had no finite KL (``None``
    everywhere when the meter read the probed sequences)."""
    ratios = [float(x) / budget for x in record["kl_per_update"]]
    summary = spread(ratios) if record.get("kl_meter_held_out") else None
    if summary is None:
        return {"kl_median": None, "kl_p95": None, "kl_max": None, "kl_over_tail": None, "kl_non_finite": None}
    return {
        "kl_median": summary["median"],
        "kl_p95": summary["p95"],
        "kl_max": summary["max"],
        "kl_over_tail": sum(r > tail for r in ratios if math.isfinite(r)),
        "kl_non_finite": sum(not math.isfinite(r) for r in ratios),
    }


def summarise(record: dict, budget: float, tail: float, adamw_seconds: float | None) -> dict:
    """One run's row: time and its ratio to ``adamw_seconds`` (``None``: no AdamW run finished),
    learning, and the held-out KL."""
    probe = record.get("logra_stats", {}).get("logra/probe_seconds", [])
    rewards = record["train_rewards"]
    seconds = record["seconds_per_update"]
    return {
        "seconds_per_update": seconds,
        "time_ratio": None if adamw_seconds is None else seconds / adamw_seconds,
        "probe_seconds": statistics.median(probe) if probe else None,
        "reward_auc": sum(rewards) / len(rewards) if rewards else None,
        "greedy_after": record["after"]["reward"],
        "updates": len(rewards),
        **kl_summary(record, budget, tail),
    }


def _cell(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown(report: dict) -> str:
    settings = report["settings"]
    tail = settings["tail"]
    lines = [
        "# KL-probe samples: time per update against the KL on held-out sequences",
        "",
        f"Command: `{report['command']}`",
        "",
        f"`logra demo`'s `{settings['policy']}` policy on `{settings['task']}`, {settings['steps']} updates of "
        f"{settings['accumulation']} × {settings['batch_size']} completions, LoGRA rank {settings['rank']}, KL budget "
        f"{settings['kl_budget']:g} per update, {settings['direction']} directions"
        + (f", `kl_floor={settings['kl_floor']:g}`" if settings.get("kl_floor") else "")
        + ". KL per update on 8 sequences "
        "of each batch that LoGRA's probe did not read, over the budget. Time ratios against the mean of the "
        "seed's dense AdamW runs that finished (first and last).",
        "",
        f"| seed | run | s / update | time / AdamW | probe s | reward AUC | greedy after | KL: median | p95 | max "
        f"| updates > {tail:g}× |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for seed, rows in report["seeds"].items():
        for row in rows:
            if "error" in row:
                lines.append(f"| {seed} | {row['run']} | failed: {row['error']} | | | | | | | | |")
                continue
            over = "" if row["kl_over_tail"] is None else f"{row['kl_over_tail']} of {row['updates']}"
            if row.get("kl_non_finite"):
                over += f" ({row['kl_non_finite']} not finite)"
            ratio = "no AdamW run" if row["time_ratio"] is None else f"{row['time_ratio']:.2f}×"
            lines.append(
                f"| {seed} | {row['run']} | {row['seconds_per_update']:.3f} | {ratio} | "
                f"{_cell(row['probe_seconds'], '.3f')} | {_cell(row['reward_auc'], '.3f')} | "
                f"{row['greedy_after']:.3f} | {_cell(row['kl_median'], '.2f')} | {_cell(row['kl_p95'], '.2f')} | "
                f"{_cell(row['kl_max'], '.1f')} | {over} |"
            )
    return "\n".join(lines) + "\n"


def run_seed(settings: demo.DemoSettings, seed: int, samples: list[int], tail: float, console) -> tuple[list, dict]:
    """AdamW, LoGRA at each sample count, AdamW again; the rows (failed runs as errors) and records."""
    plan = [("adamw", "adamw (first)", settings)]
    plan += [("logra", f"logra, {n} probed", replace(settings, probe_samples=n)) for n in samples]
    plan += [("adamw", "adamw (last)", settings)]
    records, failures = {}, {}
    for method, label, run_settings in plan:
        try:
            records[label] = demo.launch_worker(run_settings, method, seed, console, f"{label}, seed {seed}")
        except WorkerFailed as error:
            failures[label] = error.why
    adamw = [records[label]["seconds_per_update"] for label in ("adamw (first)", "adamw (last)") if label in records]
    baseline = statistics.mean(adamw) if adamw else None
    rows = []
    for _, label, _ in plan:
        if label in failures:
            rows.append({"run": label, "error": failures[label]})
            continue
        rows.append({"run": label, **summarise(records[label], settings.kl_budget, tail, baseline)})
    return rows, records


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    defaults = demo.DemoSettings(output="")
    room = args.batch_size - demo.KL_METER_SAMPLES
    if room < 1:
        parser.error(
            f"--batch-size must be more than the KL meter's {demo.KL_METER_SAMPLES} held-out sequences, "
            f"got {args.batch_size}"
        )
    if args.batch_size % defaults.num_generations:
        parser.error(
            f"--batch-size must be a multiple of the demo's {defaults.num_generations} completions per prompt, "
            f"got {args.batch_size}"
        )
    if max(args.probe_samples) > room or min(args.probe_samples) < 1:
        parser.error(
            f"--probe-samples must be in 1…{room} (the batch of {args.batch_size} less the KL meter's "
            f"{demo.KL_METER_SAMPLES} held-out sequences), got {args.probe_samples}"
        )
    if args.kl_floor is not None and args.kl_floor > 1.0:
        parser.error(f"--kl-floor must be in (0, 1], got {args.kl_floor}")
    if args.warm_start_steps < 0:
        parser.error(f"--warm-start-steps must be ≥ 0, got {args.warm_start_steps}")
    from rich.console import Console

    console = Console(stderr=True)
    device_name = demo.training_device(args.device)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    settings = demo.DemoSettings(
        output=str(output),
        policy=args.policy,
        steps=args.steps,
        seeds=args.seeds,
        batch_size=args.batch_size,
        accumulation=args.accumulation,
        kl_budget=args.kl_budget,
        warm_start_steps=args.warm_start_steps,
        methods=["adamw", "logra"],
        device=args.device,
        kl_floor=args.kl_floor,
    )
    started = time.perf_counter()
    demo.prepare_warm_starts(settings, device_name, console)
    report = {
        "command": shlex.join(["python", "benchmarks/bench_probe_samples.py", *argv]),
        "settings": {**asdict(replace(settings, output="")), "tail": args.tail, "probe_samples": args.probe_samples},
        "seeds": {},
        "records": {},
    }
    for seed in args.seeds:
        rows, records = run_seed(settings, seed, args.probe_samples, args.tail, console)
        report["seeds"][str(seed)], report["records"][str(seed)] = rows, records
    report["wall_seconds"] = time.perf_counter() - started
    (output / "probe-samples.json").write_text(json.dumps(report, indent=1))
    (output / "probe-samples.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if all("error" not in row for rows in report["seeds"].values() for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
