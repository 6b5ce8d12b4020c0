"""The ``logra`` command: ``demo`` (an RL run that visibly learns), ``bench`` (memory and step time
against dense AdamW, LoRA and GaLore) and ``plan`` (predicted training memory from a config).

This is the application layer: it uses the core and the TRL adapter; nothing in the core imports
it. Each command is a module with ``add_arguments(parser)`` and ``run(args, parser)``; ``shapes``
(model presets), ``measure`` (devices, peak memory, units), ``runner`` (fresh worker processes) and
``arguments`` (option types) serve them. Their heavier dependencies (transformers, trl,
matplotlib, rich, peft, galore-torch, bitsandbytes) come with the ``cli`` extra and are imported
where a command uses them, so ``logra --help`` and argument errors work without them. Argument
errors exit with status 2 and a message naming the option and what is valid.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys

from . import bench, demo, plan

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
COMMANDS = {
    "demo": (demo, "GRPO on a verifiable task with LoGRA and its peers (dense AdamW, AdamW on its targets, LoRA)"),
    "bench": (bench, "peak memory and step time: LoGRA against dense AdamW and the memory-efficient peers"),
    "plan": (plan, "predicted per-GPU training memory from a config.json"),
}
DESCRIPTIONS = {
    "demo": "RL with verifiable rewards: warm-start a policy briefly, then train it with GRPO (TRL) "
    "once per method (LoGRA, dense AdamW, AdamW on LoGRA's targets, LoRA by default; GaLore and APOLLO-Mini on "
    "request) from the same warm start; print a table and save reward and memory plots.",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in ``--help``, once: an option whose text already states its default,
    or whose default is unset (``None``, where the text says what applies instead), is left as
    written; a list default reads as the comma-separated value the option takes."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or re.search(r"\(default\b|[;,] default\b", text):
            return action.help
        if isinstance(action.default, list | tuple):
            return f"{text} (default: {','.join(map(str, action.default))})"
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="logra", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, (module, help_text) in COMMANDS.items():
        module.add_arguments(
            commands.add_parser(
                name,
                help=help_text,
                description=DESCRIPTIONS.get(name),
                formatter_class=HelpFormatter,
            )
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["logra", *argv])  # recorded with the results
    # Everything the commands need is local (built in memory or given by path): never wait on the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        COMMANDS[args.command][0].run(args, parser)
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
