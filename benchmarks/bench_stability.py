"""Long-run stability of LoGRA with KL control: GRPO for 1,000+ updates on the ``logra demo`` task.

One LoGRA run per seed on the demo's task, warm start and settings (``--policy``, default tiny;
``attach_logra`` with the demo's rank and ``update_ratio``, KL budget 1e-3 unless ``--kl-budget``)
with the realised-KL check on: after each merge the KL on the probe contexts is measured, and an
update that misses the budget by more than 10% is undone and redone with a rescaled α (at most 3
times). Three things are checked and reported per seed:

* **no collapse**: the sampled training reward of the last window is not below the best window by
  more than ``--collapse-tolerance``;
* **KL within budget**: the share of updates whose realised KL on the probe contexts exceeds the
  budget by more than the probe's tolerance (10%), and the largest realised/budget ratio;
* **no skipped updates**: non-finite sketches and non-finite predicted or realised KL.

Reported beside the verdict, not part of it: the same updates' KL on 8 sequences of the batch that
the probe did not read (``logra demo``'s meter), as median, 95th percentile and maximum over the
budget. The check holds the probe contexts to the budget by construction; this column says how far
that carries to the rest of the batch.

Writes ``stability.json`` (every per-update series), ``stability.md`` (the table) and
``stability.png`` (reward, realised KL against the budget, and α per update).

    python benchmarks/bench_stability.py --steps 1000 --output benchmarks/results/stability
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
from logra_optim.options import DIRECTIONS
from logra_optim.cli.arguments import device, int_list, positive_float, positive_int, writable_dir
from logra_optim.cli.measure import spread
from logra_optim.cli.runner import WorkerFailed

TOLERANCE = 0.1  # the KL controller's default realised_kl_tolerance


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_stability.py",
        description="GRPO with LoGRA for many updates: reward collapse, realised KL against the budget, skips.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = demo.DemoSettings(output="")
    parser.add_argument("--steps", type=positive_int, default=1000, help="GRPO updates per run")
    parser.add_argument("--seeds", type=int_list, default=[0], help="comma-separated")
    parser.add_argument(
        "--kl-budget", type=positive_float, default=1e-3, help="KL budget per update (the stored runs')"
    )
    parser.add_argument("--update-ratio", type=positive_float, default=defaults.update_ratio)
    parser.add_argument("--beta1", type=float, default=defaults.beta1, help="first-moment decay (0: none)")
    parser.add_argument(
        "--refresh-every", type=positive_int, default=defaults.refresh_every, help="updates per projection"
    )
    parser.add_argument("--rank", type=positive_int, default=defaults.rank)
    parser.add_argument(
        "--direction", choices=DIRECTIONS, default=defaults.direction, help="LoGRA's direction rule (direction=)"
    )
    parser.add_argument(
        "--policy", choices=sorted(demo.POLICIES), default="tiny", help="the demo's built-in policy to train"
    )
    parser.add_argument("--window", type=positive_int, default=50, help="updates per reward window")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="completions per microbatch")
    parser.add_argument("--accumulation", type=positive_int, default=1, help="microbatches per update")
    parser.add_argument("--warm-start-steps", type=int, default=1000, help="at most this many supervised steps")
    parser.add_argument(
        "--collapse-tolerance",
        type=positive_float,
        default=0.05,
        help="a run collapsed if its last window's reward is this far below its best window",
    )
    parser.add_argument("--device", type=device, default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--output", type=writable_dir, default="logra-stability")
    return parser


def windows(values: list[float], size: int) -> list[float]:
    """Means of consecutive windows of ``size`` (the last one may be shorter)."""
    return [sum(values[i : i + size]) / len(values[i : i + size]) for i in range(0, len(values), size)]


def summarise(record: dict, budget: float, window: int, collapse_tolerance: float) -> dict:
    """The stability verdict of one run from its per-update series."""
    rewards = record["train_rewards"]
    stats = record["logra_stats"]
    realised = [float(x) for x in stats.get("logra/realised_kl", [])]
    ratios = [x / budget for x in realised if math.isfinite(x)]
    means = windows(rewards, window)
    skips = {key: int(max(stats.get(f"logra/{key}", [0]) or [0])) for key in ("nonfinite_skips", "probe_skips")}
    over = sum(r > 1.0 + TOLERANCE for r in ratios)
    # The demo's meter: the same updates' KL on 8 sequences of the batch the probe did not read
    # (none, when the probe reads whole batches: then the column is left empty).
    metered = record.get("kl_per_update", []) if record.get("kl_meter_held_out") else []
    held_out = spread([float(x) / budget for x in metered]) or {}
    collapsed = bool(means) and means[-1] < max(means) - collapse_tolerance
    return {
        "updates": len(rewards),
        "reward_first_window": means[0] if means else None,
        "reward_best_window": max(means) if means else None,
        "reward_last_window": means[-1] if means else None,
        "greedy_before": record["before"]["reward"],
        "greedy_after": record["after"]["reward"],
        "collapsed": collapsed,
        "kl_measured": len(ratios),
        "kl_non_finite": len(realised) - len(ratios),
        "kl_over_budget": over,
        "kl_ratio_median": statistics.median(ratios) if ratios else None,
        "kl_ratio_max": max(ratios) if ratios else None,
        "held_out_kl_ratio_median": held_out.get("median"),
        "held_out_kl_ratio_p95": held_out.get("p95"),
        "held_out_kl_ratio_max": held_out.get("max"),
        **skips,
        "stable": not collapsed and over == 0 and len(ratios) == len(rewards) and not any(skips.values()),
    }


def markdown(report: dict) -> str:
    settings = report["settings"]
    lines = [
        "# Stability: LoGRA with KL control over a long GRPO run",
        "",
        f"Command: `{report['command']}`",
        "",
        f"{settings['steps']} updates of {settings['batch_size']} completions on `{settings['task']}`, rank "
        f"{settings['rank']}, KL budget {settings['kl_budget']:g} per update, update_ratio "
        f"{settings['update_ratio']:g}, first moment β1 {settings['beta1']:g} with `A` kept "
        f"{settings['refresh_every']} updates, {settings.get('direction', 'rowadam')} directions, realised-KL check "
        f"on (probe contexts, ±10%, up to 3 retries). A run "
        f"collapsed if its last {settings['window']}-update reward window is more than "
        f"{settings['collapse_tolerance']:g} below its best.",
        "",
        "| seed | reward: first / best / last window | greedy before → after | collapsed | realised/budget: "
        "median, max | updates over budget (+10%) | held-out realised/budget: median, p95, max | skips | stable |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for seed, s in report["seeds"].items():
        if "error" in s:
            lines.append(f"| {seed} | failed: {s['error']} | | | | | | | no |")
            continue
        ratio = f"{s['kl_ratio_median']:.2f}, {s['kl_ratio_max']:.2f}" if s["kl_measured"] else "not measured"
        held_out = (
            f"{s['held_out_kl_ratio_median']:.2f}, {s['held_out_kl_ratio_p95']:.2f}, {s['held_out_kl_ratio_max']:.2f}"
            if s.get("held_out_kl_ratio_median") is not None
            else "none held out"
        )
        lines.append(
            f"| {seed} | {s['reward_first_window']:.3f} / {s['reward_best_window']:.3f} / "
            f"{s['reward_last_window']:.3f} | {s['greedy_before']:.3f} → {s['greedy_after']:.3f} | "
            f"{'yes' if s['collapsed'] else 'no'} | {ratio} | {s['kl_over_budget']} of {s['kl_measured']} | "
            f"{held_out} | "
            f"{s['nonfinite_skips'] + s['probe_skips']} | {'yes' if s['stable'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict, output: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budget, window = report["settings"]["kl_budget"], report["settings"]["window"]
    figure, (reward_ax, kl_ax, alpha_ax) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for seed, record in report["records"].items():
        rewards = record["train_rewards"]
        smooth = [
            sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
            for i in range(len(rewards))
        ]
        reward_ax.plot(range(1, len(rewards) + 1), smooth, label=f"seed {seed}")
        stats = record["logra_stats"]
        kl = stats.get("logra/realised_kl", [])
        kl_ax.plot(range(1, len(kl) + 1), kl, ".", markersize=2, label=f"seed {seed}")
        alpha = stats.get("logra/alpha", [])
        alpha_ax.plot(range(1, len(alpha) + 1), alpha, linewidth=0.6)
    reward_ax.set_ylabel(f"sampled reward ({window}-update mean)")
    reward_ax.legend()
    kl_ax.axhline(budget, color="black", linewidth=1, label="budget")
    kl_ax.axhline(budget * (1 + TOLERANCE), color="black", linestyle=":", linewidth=1, label="budget +10%")
    kl_ax.set_yscale("log")
    kl_ax.set_ylabel("realised KL per update")
    kl_ax.legend()
    alpha_ax.set_ylabel("α")
    alpha_ax.set_xlabel("update")
    figure.tight_layout()
    path = output / "stability.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.warm_start_steps < 0:
        parser.error(f"--warm-start-steps must be ≥ 0, got {args.warm_start_steps}")
    if not 0.0 <= args.beta1 < 1.0:
        parser.error(f"--beta1 must be in [0, 1), got {args.beta1}")
    from rich.console import Console

    console = Console(stderr=True)
    device_name = demo.training_device(args.device)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    settings = demo.DemoSettings(
        output=str(output),
        policy=args.policy,
        steps=args.steps,
        rank=args.rank,
        kl_budget=args.kl_budget,
        update_ratio=args.update_ratio,
        beta1=args.beta1,
        refresh_every=args.refresh_every,
        direction=args.direction,
        seeds=args.seeds,
        batch_size=args.batch_size,
        accumulation=args.accumulation,
        probe_samples=32,
        probe_dtype=None,  # the realised-KL check compares fp32 logits
        warm_start_steps=args.warm_start_steps,
        methods=["logra"],
        device=args.device,
        realised_kl_check=True,
    )
    started = time.perf_counter()
    demo.prepare_warm_starts(settings, device_name, console)
    report = {
        "command": shlex.join(["python", "benchmarks/bench_stability.py", *argv]),
        "settings": {**asdict(replace(settings, output="")), "window": args.window},
        "seeds": {},
        "records": {},
    }
    report["settings"]["collapse_tolerance"] = args.collapse_tolerance
    for seed in args.seeds:
        try:
            record = demo.launch_worker(settings, "logra", seed, console, f"LoGRA, seed {seed}")
        except WorkerFailed as error:
            report["seeds"][str(seed)] = {"error": error.why}
            continue
        report["records"][str(seed)] = record
        report["seeds"][str(seed)] = summarise(record, args.kl_budget, args.window, args.collapse_tolerance)
    report["wall_seconds"] = time.perf_counter() - started
    (output / "stability.json").write_text(json.dumps(report, indent=1))
    (output / "stability.md").write_text(markdown(report))
    if report["records"]:
        plot(report, output)
    print(markdown(report))
    return 0 if all(s.get("stable") for s in report["seeds"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
