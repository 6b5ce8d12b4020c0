"""Argument types shared by the ``logra`` subcommands: each turns a bad value into an
``argparse`` error naming what would be valid (argparse adds the option's name, exits with 2)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path


def probe_words(text: str) -> int | str | None:
    """``--probe-words``: ``auto``, ``all`` (every word: ``None``) or an integer of at least 4."""
    if text in ("auto", "all"):
        return None if text == "all" else text
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 4:
        raise argparse.ArgumentTypeError(f"expected auto, all or an integer of at least 4, got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite positive number, got {text}")
    return value


def int_list(text: str) -> list[int]:
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


def positive_float_list(text: str) -> list[float]:
    """Comma-separated, distinct, finite positive numbers (a sweep's learning rates or budgets)."""
    values = [positive_float(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected at least one positive number (an empty sweep)")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct values, got {text!r}")
    return values


def model_dir(text: str) -> str:
    """A local Hugging Face model directory: it must exist and hold a ``config.json``."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such directory (give a local Hugging Face model directory)")
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text}: not a Hugging Face model directory (no config.json in it)")
    return str(path)


def writable_dir(text: str) -> str:
    """An output directory that exists and is writable, or could be created: its nearest existing
    ancestor is a writable directory. Nothing is created while arguments are parsed."""
    path = Path(text).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: cannot write there ({existing} is not a directory)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot write there ({existing} is not writable)")
    return str(path)


def device(text: str) -> str:
    if text in ("auto", "cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """A type for comma-separated, non-empty subsets of ``choices`` (``--methods``)."""

    def parse(text: str) -> list[str]:
        values = [part.strip() for part in text.split(",") if part.strip()]
        unknown = sorted(set(values) - set(choices))
        if unknown or not values:
            raise argparse.ArgumentTypeError(f"unknown {unknown or 'empty list'}; choose from {','.join(choices)}")
        repeated = sorted({value for value in values if values.count(value) > 1})
        if repeated:
            raise argparse.ArgumentTypeError(f"{','.join(repeated)} given more than once")
        return values

    return parse
