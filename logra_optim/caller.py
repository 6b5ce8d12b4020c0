"""Warnings that name the user's line.

A warning raised deep inside ``step()`` or ``patch_model`` helps only if it names the line of the
user's script that led to it. A fixed ``stacklevel`` cannot: an LR scheduler wraps
``optimizer.step`` in one more frame, accelerate's optimizer wrapper in another, and a TRL trainer
calls it from its own loop. So :func:`warn` skips the frames of logra-optim and of the libraries
that call into it, and names the first frame outside them.
"""

from __future__ import annotations

import sys
import warnings

# Top-level packages whose frames can sit between a user's line and logra-optim's own.
LIBRARIES = frozenset({"logra_optim", "torch", "transformers", "accelerate", "trl", "peft", "deepspeed"})


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)``, attributed to the first calling frame outside
    logra-optim and :data:`LIBRARIES`."""
    frame, stacklevel = sys._getframe(1), 2
    while frame is not None and _library(frame.f_globals.get("__name__", "")):
        frame, stacklevel = frame.f_back, stacklevel + 1
    warnings.warn(message, category, stacklevel=stacklevel)


def _library(module: str) -> bool:
    # logra-optim's command line (logra demo, bench) is a caller of the library like a user's script.
    return module.partition(".")[0] in LIBRARIES and not module.startswith("logra_optim.cli")
