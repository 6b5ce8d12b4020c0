"""Verifiable tasks for ``logra demo``: prompts with known answers and a reward that checks them.

A task renders each problem in one of two styles. ``"spaced"`` puts a space between characters
(``"4 7 + 1 5 ="`` → ``"6 2"``), which the demo's word-level tokenizer maps one character to one
token; ``"text"`` is the compact form (``"47+15="`` → ``"62"``). The demo uses ``"spaced"`` for
every tokenizer (BPE tokenizers split it into single digits too); the reward ignores spaces, so the
same function scores both.

The reward gives partial credit per answer character, so a policy warm-started to the edge of the
task gets a graded signal instead of mostly zeros: ``correct characters at their position /
max(len(answer), len(completion))``, 1 only for an exact answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

# The demo tokenizer's vocabulary: every symbol a task can print, one token each.
SYMBOLS = [*"0123456789", "+", "=", "sort", ":"]


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def _render(parts: list[str], style: str) -> str:
    return " ".join(parts) if style == "spaced" else "".join(parts)


def addition_problem(rng: random.Random, digits: int, style: str) -> Problem:
    """``a + b =`` with ``a, b`` of up to ``digits`` digits; the answer is the decimal sum."""
    a, b = rng.randrange(10**digits), rng.randrange(10**digits)
    prompt = _render([*str(a), "+", *str(b), "="], style)
    return Problem(prompt, _render(list(str(a + b)), style))


def sort_problem(rng: random.Random, digits: int, style: str) -> Problem:
    """``sort d₁ … d_n :`` with ``n = digits + 2`` random digits; the answer is them in order."""
    values = [str(rng.randrange(10)) for _ in range(digits + 2)]
    head = ["sort", *values, ":"] if style == "spaced" else ["sort ", *values, ":"]
    return Problem(_render(head, style), _render(sorted(values), style))


TASKS: dict[str, Callable[[random.Random, int, str], Problem]] = {
    "addition": addition_problem,
    "sort": sort_problem,
}


def answer_length(task: str, digits: int) -> int:
    """The longest answer in characters: the completion budget is this plus an end token."""
    return digits + 1 if task == "addition" else digits + 2


def make_problems(task: str, n: int, *, digits: int, style: str, seed: int) -> list[Problem]:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    rng = random.Random(seed)
    return [TASKS[task](rng, digits, style) for _ in range(n)]


def score(completion: str, answer: str) -> float:
    """Partial-credit reward in [0, 1] (see the module docstring)."""
    predicted = "".join(completion.split())
    target = "".join(answer.split())
    if not predicted:
        return 0.0
    correct = sum(p == t for p, t in zip(predicted, target))
    return correct / max(len(target), len(predicted))


def reward(completions: list[str], answer: list[str], **_) -> list[float]:
    """The TRL reward function: the dataset's ``answer`` column arrives as a keyword argument."""
    return [score(completion, target) for completion, target in zip(completions, answer)]
