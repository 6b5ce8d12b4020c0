"""Learning benchmark: GRPO (TRL) on verifiable tasks, LoGRA and its peers, each at its best of an equal sweep.

Methods (all trained by the ``logra demo`` worker from the same warm start per task and seed, each
run in a fresh process through ``logra_optim.cli.runner``):

    ``adamw``          dense AdamW on every parameter;
    ``adamw-targets``  AdamW on exactly LoGRA's target matrices (``patch_model``'s choice), the rest frozen;
    ``lora``           peft LoRA on the same target modules, ``r = --rank``, ``lora_alpha = 2r``;
    ``logra``          ``attach_logra`` at ``--rank`` (with ``--logra-non-target-lr``, AdamW at that
                       rate on every other parameter beside it);

and on request (``--methods``), the memory-efficient low-rank peers, on every parameter as dense AdamW:

    ``galore``         GaLore (rank ``--rank``, scale 0.25) on the target matrices, AdamW on the rest;
    ``apollo-mini``    APOLLO-Mini (rank 1, tensor-wise scaling, scale 128) on them, AdamW on the rest.

Each method is swept over its own knob with the SAME number of values: the learning rate for the
AdamW-based methods; for LoGRA the KL budget per update (``--logra-knob kl_budget``, at
``update_ratio=--update-ratio``) or the relative step without KL control (``--logra-knob
update_ratio``, ``kl_budget=None``). A method's best setting is the one with the highest mean over
seeds of the sampled-reward AUC (the mean per-update training reward over the run). A setting with
a failed seed is only chosen when every setting of that method has a failure; failed runs are listed
(method, setting, seed, the error's last line) and never enter a mean.

Reported per task and method: AUC mean ± std over seeds, the mean sampled reward over the final
window of updates, the greedy evaluation reward after RL (256 held-out problems), the realised KL
per update of every method alike (``logra demo``'s meter: the KL between the policy before and
after the update on 8 sequences of its batch; LoGRA's own prediction is kept in the JSON) and the
training seconds per run. ``--output DIR`` gets ``learning.json`` (every setting of every sweep and
every run) and ``learning.md``.

    python benchmarks/bench_learning.py --output benchmarks/results/learning
    python benchmarks/bench_learning.py --quick --tasks addition --seeds 0 --output /tmp/learning
    python benchmarks/bench_learning.py --methods adamw,adamw-targets,lora,logra,galore,apollo-mini --output DIR
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import shlex
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from logra_optim import LoGRAOptimizer
from logra_optim.options import DIRECTIONS
from logra_optim.cli import demo, tasks
from logra_optim.cli.arguments import (
    choice_list,
    device,
    int_list,
    positive_float,
    positive_float_list,
    positive_int,
    writable_dir,
)
from logra_optim.cli.runner import WorkerFailed

DEFAULT_METHODS = ("adamw", "adamw-targets", "lora", "logra")
METHODS = (*DEFAULT_METHODS, "galore", "apollo-mini")
LOGRA_KNOBS = ("kl_budget", "update_ratio")
# The centre of each method's default sweep (values spaced by a factor of 3 around it); GaLore's and
# APOLLO-Mini's are the demo's rates for the tiny policy, this benchmark's default.
TINY = demo.POLICY_RATES["tiny"]
CENTRES = {
    "adamw": 3e-4,
    "adamw-targets": 3e-4,
    "lora": 1e-3,
    "galore": TINY.galore,
    "apollo-mini": TINY.apollo_mini,
    # LoGRA's budget with its default first moment: a decade below the paper rule's best, since
    # coherent steps add up their KL (docs/benchmarks.md, "The first moment on this benchmark").
    "kl_budget": 3e-3,
    "update_ratio": 5e-2,
}
# LoGRA's budget centre without a first moment (--beta1 0): the paper rule's best on this benchmark.
PAPER_RULE_BUDGET = 3e-2
SWEEP_FACTOR = 3.0
# The option holding each sweep's explicit values.
SWEEP_OPTIONS = {
    "adamw": "--adamw-lrs",
    "adamw-targets": "--adamw-targets-lrs",
    "lora": "--lora-lrs",
    "galore": "--galore-lrs",
    "apollo-mini": "--apollo-mini-lrs",
    "kl_budget": "--logra-budgets",
    "update_ratio": "--logra-ratios",
}
# The DemoSettings field of each learning-rate method's rate.
LR_FIELDS = {
    "adamw-targets": "adamw_targets_lr",
    "lora": "lora_lr",
    "galore": "galore_lr",
    "apollo-mini": "apollo_mini_lr",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_learning.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--tasks", type=choice_list(sorted(tasks.TASKS)), default=["addition", "sort"], help="comma-separated tasks"
    )
    parser.add_argument("--digits", type=positive_int, default=1, help="operand digits (sort: digits+2 values)")
    parser.add_argument("--seeds", type=int_list, default=None, help="comma-separated; default 0-4 (--quick: 0,1)")
    parser.add_argument("--steps", type=positive_int, default=300, help="GRPO updates per run")
    parser.add_argument(
        "--methods",
        type=choice_list(METHODS),
        default=list(DEFAULT_METHODS),
        help="comma-separated subset of " + ",".join(METHODS),
    )
    parser.add_argument(
        "--sweep-size",
        type=positive_int,
        default=None,
        help="values per method's sweep when no explicit list is given (default 3; --quick: 2)",
    )
    for key, option in SWEEP_OPTIONS.items():
        what = "learning rates of " + key if key in METHODS else f"LoGRA's {key} values"
        parser.add_argument(option, type=positive_float_list, default=None, help=f"comma-separated {what}")
    parser.add_argument("--logra-knob", choices=LOGRA_KNOBS, default="kl_budget", help="what LoGRA's sweep varies")
    parser.add_argument(
        "--update-ratio",
        type=positive_float,
        default=demo.DemoSettings(output="").update_ratio,
        help="LoGRA's relative step when the sweep varies kl_budget",
    )
    parser.add_argument("--rank", type=positive_int, default=32, help="rank of LoGRA, LoRA and GaLore")
    # LoGRAOptimizer's own defaults (a first moment, A kept 10 updates): this race measures what a user
    # of the optimizer gets; --beta1 0 --refresh-every 1 races the paper's rule.
    optimizer_defaults = inspect.signature(LoGRAOptimizer).parameters
    parser.add_argument(
        "--beta1", type=float, default=optimizer_defaults["beta1"].default, help="LoGRA's first-moment decay (0: none)"
    )
    parser.add_argument(
        "--direction",
        choices=DIRECTIONS,
        default=demo.DemoSettings(output="").direction,
        help="LoGRA's direction rule (direction=)",
    )
    parser.add_argument(
        "--refresh-every",
        type=positive_int,
        default=optimizer_defaults["refresh_every"].default,
        help="LoGRA updates per projection",
    )
    parser.add_argument(
        "--peer-scope",
        choices=demo.PEER_SCOPES,
        default="all",
        help="what GaLore and APOLLO-Mini train: all parameters, or only LoGRA's targets (the rest frozen)",
    )
    parser.add_argument(
        "--peer-proj-gap",
        type=positive_int,
        default=None,
        help="updates between GaLore's and APOLLO-Mini's projection refreshes (default: their READMEs' 200)",
    )
    parser.add_argument(
        "--logra-non-target-lr",
        type=positive_float,
        default=None,
        help="AdamW at this rate on every parameter that is not a LoGRA target, beside LoGRA (default: frozen)",
    )
    parser.add_argument(
        "--policy", choices=sorted(demo.POLICIES), default="tiny", help="the demo's built-in policy to train"
    )
    parser.add_argument(
        "--final-window", type=positive_int, default=None, help="updates in the final window (default: steps/5)"
    )
    # The stored results' settings; the demo's larger default policy takes fewer of each.
    parser.add_argument("--batch-size", type=positive_int, default=64, help="completions per microbatch")
    parser.add_argument(
        "--accumulation", type=positive_int, default=1, help="microbatches per update (generated together)"
    )
    parser.add_argument("--probe-samples", type=positive_int, default=32, help="LoGRA's probe sequences")
    parser.add_argument("--warm-start-steps", type=int, default=1000, help="at most this many supervised steps")
    parser.add_argument(
        "--warm-start-lr", type=positive_float, default=None, help="warm-start learning rate (default: the policy's)"
    )
    parser.add_argument("--warm-start-reward", type=float, default=0.45, help="greedy reward that ends the warm start")
    parser.add_argument("--device", type=device, default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--output", type=writable_dir, default="logra-learning", help="directory for the results")
    parser.add_argument("--quick", action="store_true", help="≤ 60 updates of 32 completions, 2 seeds, sweeps of 2")
    return parser


def default_sweep(centre: float, size: int) -> list[float]:
    """``size`` values spaced by ``SWEEP_FACTOR`` around ``centre`` (two significant digits)."""
    return [float(f"{centre * SWEEP_FACTOR ** (i - (size - 1) / 2):.2g}") for i in range(size)]


def sweeps_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, tuple[str, list[float]]]:
    """Per method: the knob it varies and its values; every sweep has the same size."""
    size = args.sweep_size or (2 if args.quick else 3)
    other = "update_ratio" if args.logra_knob == "kl_budget" else "kl_budget"
    if getattr(args, SWEEP_OPTIONS[other][2:].replace("-", "_")) is not None:
        parser.error(f"{SWEEP_OPTIONS[other]} sweeps {other}, but --logra-knob is {args.logra_knob}")
    sweeps = {}
    for method in args.methods:
        key = args.logra_knob if method == "logra" else method
        explicit = getattr(args, SWEEP_OPTIONS[key][2:].replace("-", "_"))
        knob = "lr" if method != "logra" else args.logra_knob
        centre = PAPER_RULE_BUDGET if key == "kl_budget" and args.beta1 == 0 else CENTRES[key]
        sweeps[method] = (knob, explicit if explicit is not None else default_sweep(centre, size))
    sizes = {method: len(values) for method, (_, values) in sweeps.items()}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{SWEEP_OPTIONS[args.logra_knob if m == 'logra' else m]} {n}" for m, n in sizes.items())
        parser.error(f"every method's sweep must have the same number of values (a fair race); got {listed}")
    return sweeps


def overrides(method: str, knob: str, value: float) -> dict:
    """The ``DemoSettings`` fields of one sweep setting."""
    if knob == "lr":
        return {LR_FIELDS.get(method, "adamw_lr"): value}
    if knob == "kl_budget":
        return {"kl_budget": value}
    return {"kl_budget": None, "update_ratio": value}  # a fixed relative step, no KL control


# --------------------------------------------------------------------------------------------------
# Metrics


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _spread(values: list[float]) -> float | None:
    return (statistics.stdev(values) if len(values) > 1 else 0.0) if values else None


def run_metrics(record: dict, window: int) -> dict:
    """One completed run's metrics."""
    rewards = record["train_rewards"]
    stats = record["logra_stats"]
    return {
        "auc": _mean(rewards),
        "final": _mean(rewards[-window:]),
        "greedy_before": record["before"]["reward"],
        "greedy_after": record["after"]["reward"],
        "exact_after": record["after"]["accuracy"],
        "kl_predicted": _mean(stats.get("logra/predicted_step_kl", [])),
        "kl_realised": _mean(stats.get("logra/realised_kl", [])),
        # Every method's realised KL per update, measured alike by the demo's meter (median of the run).
        "kl_measured": statistics.median(record["kl_per_update"]) if record.get("kl_per_update") else None,
        "train_seconds": record["seconds_per_update"] * len(rewards),
    }


def setting_summary(knob: str, value: float, runs: list[dict], failures: list[dict]) -> dict:
    """Means (± std for the AUC) over the completed seeds of one sweep setting; failed seeds listed."""
    done = [r["metrics"] for r in runs]

    def column(key):
        return [m[key] for m in done if m[key] is not None]

    return {
        "knob": knob,
        "value": value,
        "seeds": [r["seed"] for r in runs],
        "failed_seeds": [f["seed"] for f in failures],
        "auc": _mean(column("auc")),
        "auc_std": _spread(column("auc")),
        "final": _mean(column("final")),
        "greedy_after": _mean(column("greedy_after")),
        "greedy_before": _mean(column("greedy_before")),
        "kl_predicted": _mean(column("kl_predicted")),
        "kl_realised": _mean(column("kl_realised")),
        "kl_measured": _mean(column("kl_measured")),
        "train_seconds": statistics.median(column("train_seconds")) if done else None,
        "wall_seconds": statistics.median(r["wall_seconds"] for r in runs) if runs else None,
    }


def best_setting(sweep: list[dict]) -> dict | None:
    """The highest mean AUC among settings whose every seed completed; if each setting lost a seed,
    among those with any completed seed; ``None`` when every run failed."""
    complete = [s for s in sweep if s["seeds"] and not s["failed_seeds"]]
    candidates = complete or [s for s in sweep if s["seeds"]]
    return max(candidates, key=lambda s: s["auc"]) if candidates else None


def finite(value):
    """JSON-safe: non-finite floats become ``None``, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------------
# Tables


def _fmt(value, spec=".3f") -> str:
    return "—" if value is None else format(value, spec)


def _setting(s: dict) -> str:
    return f"{s['knob']}={s['value']:g}"


HEADERS = [
    "method",
    "best setting",
    "reward AUC (mean ± std)",
    "final window",
    "greedy eval",
    "KL/update",
    "s/run",
    "seeds",
]


def table_rows(result: dict) -> list[list[str]]:
    rows = []
    for method, entry in result["methods"].items():
        best = entry["best"]
        failed = sum(len(s["failed_seeds"]) for s in entry["sweep"])
        if best is None:
            rows.append([demo.LABELS[method], "all runs failed", "—", "—", "—", "—", "—", f"0 ok, {failed} failed"])
            continue
        kl = best["kl_measured"]
        seeds = f"{len(best['seeds'])} ok" + (f", {len(best['failed_seeds'])} failed" if best["failed_seeds"] else "")
        rows.append(
            [
                demo.LABELS[method],
                _setting(best),
                f"{best['auc']:.3f} ± {best['auc_std']:.3f}",
                _fmt(best["final"]),
                _fmt(best["greedy_after"]),
                _fmt(kl, ".2e"),
                _fmt(best["train_seconds"], ".1f"),
                seeds + (f" (sweep: {failed} failed)" if failed > len(best["failed_seeds"]) else ""),
            ]
        )
    return rows


def meter_rows(settings: dict) -> str:
    """Which sequences the demo's KL meter read (see ``demo.held_out_rows``)."""
    if settings.get("probe_samples", 0) < settings.get("batch_size", 0):
        return "that LoGRA's probe does not read"
    return "(LoGRA's probe reads whole batches here, so its KL is measured on probed sequences)"


def markdown(report: dict) -> str:
    lines = [
        "# Learning benchmark",
        "",
        f"Command: `{report['command']}`",
        "",
        f"GRPO, {report['settings']['steps']} updates per run, seeds {report['settings']['seeds']}, rank "
        f"{report['settings']['rank']}; each method at its best (highest mean sampled-reward AUC) of an equal "
        f"sweep of {report['settings']['sweep_size']} values. KL/update: the realised KL of an update on 8 "
        f"sequences of its batch {meter_rows(report['settings'])} (the median over the run, mean over seeds), "
        "measured alike for every method.",
    ]
    for task, result in report["tasks"].items():
        lines += ["", f"## {task}", "", "| " + " | ".join(HEADERS) + " |", "|---" * len(HEADERS) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in table_rows(result)]
        lines += ["", "Sweeps:", "", "| method | setting | AUC | final | greedy | seeds ok | failed seeds |"]
        lines += ["|---|---|---|---|---|---|---|"]
        for method, entry in result["methods"].items():
            for s in entry["sweep"]:
                auc = "—" if s["auc"] is None else f"{s['auc']:.3f} ± {s['auc_std']:.3f}"
                lines.append(
                    f"| {demo.LABELS[method]} | {_setting(s)} | {auc} | {_fmt(s['final'])} | "
                    f"{_fmt(s['greedy_after'])} | {len(s['seeds'])} | {s['failed_seeds'] or ''} |"
                )
    if report["failures"]:
        lines += ["", "## Failed runs", "", "| task | method | setting | seed | error |", "|---|---|---|---|---|"]
        for f in report["failures"]:
            error = f["error"].replace("|", "\\|")
            lines.append(
                f"| {f['task']} | {demo.LABELS[f['method']]} | {f['knob']}={f['value']:g} | {f['seed']} | {error} |"
            )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# Main


def last_line(error: WorkerFailed) -> str:
    lines = [line.strip() for line in error.output.splitlines() if line.strip()]
    return lines[-1] if lines else error.why


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.warm_start_steps < 0:
        parser.error(f"--warm-start-steps must be ≥ 0, got {args.warm_start_steps}")
    if not 0.0 <= args.warm_start_reward <= 1.0:
        parser.error(f"--warm-start-reward must be in [0, 1] (rewards are), got {args.warm_start_reward}")
    if not 0.0 <= args.beta1 < 1.0:
        parser.error(f"--beta1 must be in [0, 1), got {args.beta1}")
    if args.logra_non_target_lr is not None and "logra" not in args.methods:
        parser.error("--logra-non-target-lr sets LoGRA's AdamW on the rest, but --methods has no logra")
    sweeps = sweeps_from(args, parser)
    seeds = args.seeds if args.seeds is not None else ([0, 1] if args.quick else [0, 1, 2, 3, 4])
    steps = min(args.steps, 60) if args.quick else args.steps
    window = min(args.final_window or max(1, steps // 5), steps)

    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    device_name = demo.training_device(args.device)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report = {
        "command": shlex.join(["python", "benchmarks/bench_learning.py", *argv]),
        "settings": {
            "tasks": args.tasks,
            "seeds": seeds,
            "steps": steps,
            "methods": args.methods,
            "sweep_size": len(next(iter(sweeps.values()))[1]),
            "sweeps": {m: {"knob": k, "values": v} for m, (k, v) in sweeps.items()},
            "logra_knob": args.logra_knob,
            "update_ratio": args.update_ratio,
            "rank": args.rank,
            "policy": args.policy,
            "batch_size": 32 if args.quick else args.batch_size,
            "accumulation": args.accumulation,
            "probe_samples": args.probe_samples,
            "final_window": window,
            "digits": args.digits,
            "peer_scope": args.peer_scope,
            "peer_proj_gap": args.peer_proj_gap,
            "logra_non_target_lr": args.logra_non_target_lr,
            "device": device_name,
        },
        "tasks": {},
        "runs": [],
        "failures": [],
    }
    for task in args.tasks:
        base = demo.DemoSettings(
            output=str(output / task),
            policy=args.policy,
            task=task,
            digits=args.digits,
            steps=steps,
            rank=args.rank,
            update_ratio=args.update_ratio,
            beta1=args.beta1,
            refresh_every=args.refresh_every,
            direction=args.direction,
            warm_start_steps=args.warm_start_steps,
            warm_start_reward=args.warm_start_reward,
            seeds=seeds,
            methods=list(args.methods),
            device=args.device,
            batch_size=args.batch_size,
            accumulation=args.accumulation,
            probe_samples=args.probe_samples,
            probe_dtype=None,  # as the stored results were measured
            warm_start_lr=args.warm_start_lr,
            peer_scope=args.peer_scope,
            peer_proj_gap=args.peer_proj_gap,
            logra_non_target_lr=args.logra_non_target_lr,
        )
        if args.quick:
            base.batch_size = 32
        console.print(f"[bold]{task}[/]: warm start per seed, then {len(args.methods)} methods × sweeps × seeds")
        demo.prepare_warm_starts(base, device_name, console)
        runs, failures = [], []
        for seed in seeds:
            for method, (knob, values) in sweeps.items():
                for value in values:
                    settings = replace(base, **overrides(method, knob, value))
                    where = {"task": task, "method": method, "knob": knob, "value": value, "seed": seed}
                    description = f"{task}: {demo.LABELS[method]} {knob}={value:g}, seed {seed}"
                    launched = time.perf_counter()
                    try:
                        record = demo.launch_worker(settings, method, seed, console, description)
                    except WorkerFailed as error:
                        failures.append({**where, "error": last_line(error), "output": error.output[-3000:]})
                        console.print(f"[red]{description} failed[/]: {last_line(error)}")
                        continue
                    wall = time.perf_counter() - launched
                    runs.append(
                        {**where, "metrics": run_metrics(record, window), "wall_seconds": wall, "record": record}
                    )
        result = {"methods": {}}
        for method, (knob, values) in sweeps.items():
            sweep = [
                setting_summary(
                    knob,
                    value,
                    [r for r in runs if r["method"] == method and r["value"] == value],
                    [f for f in failures if f["method"] == method and f["value"] == value],
                )
                for value in values
            ]
            result["methods"][method] = {"knob": knob, "best": best_setting(sweep), "sweep": sweep}
        report["tasks"][task] = result
        report["runs"] += runs
        report["failures"] += failures

        table = Table(
            title=f"{task}: GRPO, {steps} updates; each method at its best of an equal sweep; seeds {seeds}",
            title_justify="left",
        )
        for i, header in enumerate(HEADERS):
            table.add_column(header, justify="left" if i < 2 else "right")
        for row in table_rows(result):
            table.add_row(*row)
        Console(width=max(Console().width, 140)).print(table)
    for failure in report["failures"]:
        print(
            f"FAILED {failure['task']} {failure['method']} {failure['knob']}={failure['value']:g} "
            f"seed {failure['seed']}: {failure['error']}"
        )
    report["wall_seconds"] = time.perf_counter() - started
    report = finite(report)
    (output / "learning.json").write_text(json.dumps(report, indent=2))
    (output / "learning.md").write_text(markdown(report))
    console.print(f"results: {output / 'learning.json'}, {output / 'learning.md'} ({report['wall_seconds']:.0f} s)")
    return 1 if not report["runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
