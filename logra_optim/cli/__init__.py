"""The ``logra`` command: ``demo`` (an RL run that visibly learns), ``bench`` (memory and step time
against dense AdamW, LoRA and GaLore) and ``plan`` (predicted training memory from a config).

This is the application layer: it uses the core and the TRL adapter; nothing in the core imports
it. Its heavier dependencies (trl, matplotlib, rich, peft, galore-torch) come with the ``cli`` extra
and are imported by the subcommand that needs them, so ``logra --help`` and argument errors cost
nothing. Argument errors exit with status 2 and a message naming the option and what is valid.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import tasks
from .arguments import choice_list, device, int_list, model_dir, positive_float, positive_int, writable_dir

# Top-level modules of the ``cli`` extra: a missing one is an installation problem, not a bug.
CLI_EXTRAS = {
    "transformers",
    "trl",
    "datasets",
    "accelerate",
    "tokenizers",
    "rich",
    "matplotlib",
    "peft",
    "galore_torch",
    "bitsandbytes",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="logra", description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench,plan}")

    from .demo import METHODS, DemoSettings

    DEFAULTS = DemoSettings(output="")
    demo = commands.add_parser(
        "demo",
        help="GRPO on a verifiable task with LoGRA and with dense AdamW, side by side",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="RL with verifiable rewards: warm-start a policy briefly, then train it with GRPO (TRL) "
        "once with LoGRA and once with dense AdamW; print a table and save reward and memory plots.",
    )
    demo.add_argument(
        "--model", type=model_dir, help="a local Hugging Face causal LM; without it, a tiny Qwen2 built here"
    )
    demo.add_argument("--task", choices=sorted(tasks.TASKS), default="addition", help="the verifiable task")
    demo.add_argument("--digits", type=positive_int, default=DEFAULTS.digits, help="operand digits (sort: digits+2)")
    demo.add_argument("--steps", type=positive_int, default=DEFAULTS.steps, help="GRPO updates per run")
    demo.add_argument("--rank", type=positive_int, default=DEFAULTS.rank, help="LoGRA sketch rank")
    demo.add_argument("--kl-budget", type=positive_float, default=DEFAULTS.kl_budget, help="LoGRA KL per update")
    demo.add_argument("--adamw-lr", type=positive_float, default=DEFAULTS.adamw_lr, help="dense AdamW learning rate")
    demo.add_argument(
        "--warm-start-steps",
        type=int,
        default=None,
        help="at most this many supervised steps before RL; unset: 1000, or 0 with --model",
    )
    demo.add_argument(
        "--warm-start-reward",
        type=float,
        default=DEFAULTS.warm_start_reward,
        help="stop the warm start once greedy validation reward reaches this",
    )
    demo.add_argument("--seeds", type=int_list, default=[0], help="comma-separated; several give mean ± std")
    demo.add_argument(
        "--methods",
        type=choice_list(METHODS),
        default=list(METHODS),
        help="comma-separated subset of " + ",".join(METHODS),
    )
    demo.add_argument("--device", type=device, default="auto", help="auto, cpu, cuda or cuda:N")
    demo.add_argument("--output", type=writable_dir, default="logra-demo", help="directory for plots and results")
    demo.add_argument("--quick", action="store_true", help="a short run: 60 updates of 32 completions")

    from .bench import add_arguments as add_bench_arguments
    from .plan import add_arguments as add_plan_arguments

    add_bench_arguments(
        commands.add_parser(
            "bench",
            help="peak memory and step time: dense AdamW, LoGRA, LoRA, GaLore, 8-bit AdamW",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
    )
    add_plan_arguments(
        commands.add_parser(
            "plan",
            help="predicted per-GPU training memory from a config.json",
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
    )
    return parser


def _demo_settings(args: argparse.Namespace, parser: argparse.ArgumentParser):
    from .demo import DemoSettings

    warm = args.warm_start_steps if args.warm_start_steps is not None else (0 if args.model else 1000)
    if warm < 0:
        parser.error(f"--warm-start-steps must be ≥ 0, got {warm}")
    if not 0.0 <= args.warm_start_reward <= 1.0:
        parser.error(f"--warm-start-reward must be in [0, 1] (rewards are), got {args.warm_start_reward}")
    settings = DemoSettings(
        output=os.path.abspath(args.output),
        task=args.task,
        digits=args.digits,
        steps=args.steps,
        rank=args.rank,
        kl_budget=args.kl_budget,
        adamw_lr=args.adamw_lr,
        warm_start_steps=warm,
        seeds=args.seeds,
        methods=args.methods,
        model=args.model,
        device=args.device,
        warm_start_reward=args.warm_start_reward,
    )
    if args.quick:
        settings.steps = min(settings.steps, 60)
        settings.batch_size = 32
    return settings


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Everything the commands need is local (built in memory or given by path): never wait on the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if args.command == "demo":
            from .demo import run

            run(_demo_settings(args, parser))
        elif args.command == "bench":
            from .bench import run as run_bench

            run_bench(args, parser)
        else:
            from .plan import run as run_plan

            run_plan(args, parser)
    except ImportError as error:
        if (error.name or "").split(".")[0] not in CLI_EXTRAS:
            raise
        print(
            f"logra {args.command}: {error.name} is not installed; "
            f"install the CLI's extras with  pip install 'logra-optim[cli]'",
            file=sys.stderr,
        )
        return 1
    except (ValueError, RuntimeError) as error:
        print(f"logra {args.command}: {error}", file=sys.stderr)
        return 1
    return 0
