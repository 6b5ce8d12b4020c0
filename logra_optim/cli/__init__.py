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
from pathlib import Path

from . import tasks

# Top-level modules of the ``cli`` extra: a missing one is an installation problem, not a bug.
CLI_EXTRAS = {"transformers", "trl", "datasets", "accelerate", "tokenizers", "rich", "matplotlib", "peft",
              "galore_torch", "bitsandbytes"}  # fmt: skip


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite positive number, got {text}")
    return value


def _int_list(text: str) -> list[int]:
    """Comma-separated, distinct, non-negative integers (seeds, ranks)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    if min(values) < 0 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct non-negative integers, got {text!r}")
    return values


def _model_dir(text: str) -> str:
    """A local Hugging Face model directory: it must exist and hold a ``config.json``."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such directory (give a local Hugging Face model directory)")
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text}: not a Hugging Face model directory (no config.json in it)")
    return str(path)


def _writable_dir(text: str) -> str:
    """An output directory that exists and is writable, or could be created: its nearest existing
    ancestor is a writable directory. Nothing is created while arguments are parsed."""
    path = Path(text).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: cannot write there ({existing} is not a directory)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot write there ({existing} is not writable)")
    return str(path)


def _device(text: str) -> str:
    if text in ("auto", "cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="logra", description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench,plan}")

    from .demo import DemoSettings

    DEFAULTS = DemoSettings(output="")
    demo = commands.add_parser(
        "demo", help="GRPO on a verifiable task with LoGRA and with dense AdamW, side by side",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="RL with verifiable rewards: warm-start a policy briefly, then train it with GRPO (TRL) "
                    "once with LoGRA and once with dense AdamW; print a table and save reward and memory plots.",
    )  # fmt: skip
    demo.add_argument("--model", type=_model_dir,
                      help="a local Hugging Face causal LM; without it, a tiny Qwen2 built here")  # fmt: skip
    demo.add_argument("--task", choices=sorted(tasks.TASKS), default="addition", help="the verifiable task")
    demo.add_argument("--digits", type=_positive_int, default=DEFAULTS.digits, help="operand digits (sort: digits+2)")
    demo.add_argument("--steps", type=_positive_int, default=DEFAULTS.steps, help="GRPO updates per run")
    demo.add_argument("--rank", type=_positive_int, default=DEFAULTS.rank, help="LoGRA sketch rank")
    demo.add_argument("--kl-budget", type=_positive_float, default=DEFAULTS.kl_budget, help="LoGRA KL per update")
    demo.add_argument("--adamw-lr", type=_positive_float, default=DEFAULTS.adamw_lr, help="dense AdamW learning rate")
    demo.add_argument("--warm-start-steps", type=int, default=None,
                      help="at most this many supervised steps before RL; unset: 1000, or 0 with --model")
    demo.add_argument("--warm-start-reward", type=float, default=DEFAULTS.warm_start_reward,
                      help="stop the warm start once greedy validation reward reaches this")  # fmt: skip
    demo.add_argument("--seeds", type=_int_list, default=[0], help="comma-separated; several give mean ± std")
    demo.add_argument("--methods", default="logra,adamw", help="comma-separated subset of logra,adamw")
    demo.add_argument("--device", type=_device, default="auto", help="auto, cpu, cuda or cuda:N")
    demo.add_argument("--output", type=_writable_dir, default="logra-demo", help="directory for plots and results")
    demo.add_argument("--quick", action="store_true", help="a short run: 60 updates of 32 completions")

    from .bench import add_arguments as add_bench_arguments
    from .plan import add_arguments as add_plan_arguments

    add_bench_arguments(commands.add_parser(
        "bench", help="peak memory and step time: dense AdamW, LoGRA, LoRA, GaLore, 8-bit AdamW",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    ), model_dir=_model_dir, writable_dir=_writable_dir, positive_int=_positive_int, int_list=_int_list,
       device=_device)  # fmt: skip
    add_plan_arguments(commands.add_parser(
        "plan", help="predicted per-GPU training memory from a config.json",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    ), positive_int=_positive_int)  # fmt: skip
    return parser


def _demo_settings(args: argparse.Namespace, parser: argparse.ArgumentParser):
    from .demo import METHODS, DemoSettings

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        parser.error(f"--methods: unknown {unknown or 'empty list'}; choose from {','.join(METHODS)}")
    warm = args.warm_start_steps if args.warm_start_steps is not None else (0 if args.model else 1000)
    if warm < 0:
        parser.error(f"--warm-start-steps must be ≥ 0, got {warm}")
    if not 0.0 <= args.warm_start_reward <= 1.0:
        parser.error(f"--warm-start-reward must be in [0, 1] (rewards are), got {args.warm_start_reward}")
    settings = DemoSettings(
        output=os.path.abspath(args.output), task=args.task, digits=args.digits, steps=args.steps, rank=args.rank,
        kl_budget=args.kl_budget, adamw_lr=args.adamw_lr, warm_start_steps=warm, seeds=args.seeds,
        methods=methods, model=args.model, device=args.device, warm_start_reward=args.warm_start_reward,
    )  # fmt: skip
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
        print(f"logra {args.command}: {error.name} is not installed; "
              f"install the CLI's extras with  pip install 'logra-optim[cli]'", file=sys.stderr)  # fmt: skip
        return 1
    except (ValueError, RuntimeError) as error:
        print(f"logra {args.command}: {error}", file=sys.stderr)
        return 1
    return 0
