"""Run one function in a fresh Python process: a JSON spec in, a JSON record out.

Why a fresh process: a process's peak memory cannot be reset, allocator and thread-pool state
carry over, and ``torch.distributed`` can be initialised once; so every measured configuration of
``logra bench``, every RL run of ``logra demo`` and every worker of ``benchmarks/*.py`` gets a
process of its own, started by :func:`run_fresh`.

The parent writes ``{"function": …, "spec": …}`` to a file and starts
``python -m logra_optim.cli.runner REQUEST RESULT`` (or a launcher such as torchrun's ``--module``
form, which starts one such process per rank). The child imports the function, calls it with the
spec and writes what it returns to ``RESULT`` (a distributed worker returns ``None`` on all ranks
but one). Files rather than stdout carry the spec and the record, so that whatever the libraries
print cannot corrupt them. The child's stdout and stderr are read line by line: a caller may claim
lines (progress reports) as they arrive, the rest is kept and, if the child fails, shown in the
error together with the label of what failed.

A function is found in the child by module name, or by file when its module cannot be imported
there: a ``benchmarks/*.py`` script run as ``__main__``, a test module. Loaded by file it is not
``__main__``, so the script's command-line entry point does not run again.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# ``python -m``: the default launcher; the runner's module name follows it.
PYTHON_MODULE = (sys.executable, "-m")
# How much of a failed child's output the error shows.
TAIL_LINES, TAIL_CHARS = 60, 6000


class WorkerFailed(RuntimeError):
    """A fresh-process worker exited with an error or without a record; the message names it and
    ends with its last output."""

    def __init__(self, label: str, why: str, output: str):
        self.label, self.why, self.output = label, why, output
        tail = output[-TAIL_CHARS:].rstrip()
        super().__init__(
            f"{label} failed ({why})" + (f"; its last output:\n{tail}" if tail else "; it printed nothing")
        )


def run_fresh(
    function: Callable[[dict], Any],
    spec: dict,
    *,
    label: str,
    env: dict[str, str] | None = None,
    launcher: Sequence[str] = PYTHON_MODULE,
    on_line: Callable[[str], bool] | None = None,
) -> Any:
    """``function(spec)`` in a new process; returns its JSON record.

    ``label`` names the worker in errors (``"lora r=64"``, ``"LoGRA run (seed 0)"``). ``env``
    entries are added to this process's environment. ``launcher`` is the command that runs a
    module (``python -m`` by default). ``on_line`` sees each output line as it arrives and
    returns ``True`` for a line it consumed, which is then left out of a failure's output.
    Raises :class:`WorkerFailed` when the child fails.
    """
    with tempfile.TemporaryDirectory(prefix="logra-worker-") as folder:
        request, result = Path(folder) / "request.json", Path(folder) / "result.json"
        request.write_text(json.dumps({"function": _reference(function), "spec": spec}))
        command = [*launcher, __name__, str(request), str(result)]
        kept: deque[str] = deque(maxlen=TAIL_LINES)
        with subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env={**os.environ, **(env or {})},
        ) as process:
            for line in process.stdout:
                if on_line is None or not on_line(line):
                    kept.append(line)
        output = "".join(kept)
        if process.returncode != 0:
            code = process.returncode
            raise WorkerFailed(label, f"exit {code}" if code > 0 else f"killed by signal {-code}", output)
        if not result.exists():
            raise WorkerFailed(label, "it exited without writing a result", output)
        return json.loads(result.read_text())


def _reference(function: Callable) -> dict:
    """Where the child finds ``function``: its module's name and file, and its name there."""
    name = getattr(function, "__qualname__", "")
    if not name or "<" in name:
        raise ValueError(f"run_fresh needs a module-level function, not {function!r}")
    module = sys.modules[function.__module__]
    return {"module": function.__module__, "file": getattr(module, "__file__", None), "name": name}


def _resolve(reference: dict) -> Callable:
    name, file = reference["module"], reference["file"]
    if name != "__main__" and _importable(name):
        module = importlib.import_module(name)
    elif file is not None:
        module_spec = importlib.util.spec_from_file_location(Path(file).stem, file)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module  # dataclasses and pickling look modules up here
        module_spec.loader.exec_module(module)
    else:
        raise ImportError(f"cannot find the worker's module {name!r} in this process")
    function = module
    for part in reference["name"].split("."):
        function = getattr(function, part)
    return function


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _child(request_path: str, result_path: str) -> None:
    request = json.loads(Path(request_path).read_text())
    record = _resolve(request["function"])(request["spec"])
    if record is not None:
        Path(result_path).write_text(json.dumps(record))


if __name__ == "__main__":
    _child(*sys.argv[1:3])
