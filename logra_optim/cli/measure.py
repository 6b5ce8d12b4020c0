"""How the CLI and the benchmarks measure: device choice, peak memory of the current process, units.

Peak memory on CPU is the process's peak resident set size (Linux: ``VmHWM``) minus the level taken
right after the imports, so what remains is the run's own weights, optimizer state, gradients or
sketches and activations; ``logra bench`` lowers the high-water mark to the current level there
(``reset_peak``), as ``torch.cuda.reset_peak_memory_stats`` does on CUDA, where the peak is
``torch.cuda.max_memory_allocated`` (tensor memory only; the baseline is the memory allocated when
the run starts). Either way one process measures one configuration: a configuration run after
another would inherit its allocator's state and caches (``runner.run_fresh`` gives each its own
process).
"""

from __future__ import annotations

import ctypes
import math
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import torch

import logra_optim

MIB = 2**20
GIB = 2**30


def resolve_device(device: str) -> str:
    """``"auto"`` → ``"cuda"`` when a GPU is visible, else ``"cpu"``; otherwise checked and returned."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is visible here; use --device cpu or auto")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")
    return device


def auto_probe_dtype(device: str) -> str | None:
    """``"bfloat16"`` on CUDA GPUs that compute bf16 natively (Ampere on), else ``None`` (the
    weights' fp32).

    Not on CPUs, even with bf16 instructions: there the probe's bf16 products go through oneDNN,
    whose kernels and allocations kept the demo's resident memory about 30 MiB higher (LoGRA at
    0.54–0.55× dense AdamW's peak instead of 0.48×) to save 15–20 ms of a 0.35–0.40 s update
    (docs/benchmarks.md, "The probe's precision"); without bf16 instructions a bf16 product takes
    about 4× an fp32 one."""
    if device.startswith("cuda") and torch.cuda.is_bf16_supported(including_emulation=False):
        return "bfloat16"
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes.

    On Linux, ``VmHWM`` of ``/proc/self/status``, not ``getrusage``'s ``ru_maxrss``: Linux carries
    ``ru_maxrss`` over ``fork`` and ``exec``, so a worker started by a parent that had once used
    more memory (the demo's warm start) would report the parent's peak until its own exceeded it,
    and its measured peak above the post-import level would shrink by the difference. ``VmHWM``
    belongs to the new process image alone."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def resident_file_bytes() -> int | None:
    """This process's file-backed resident memory (Linux: ``RssFile``: mapped files, above all the
    code of shared libraries), in bytes; None where ``/proc/self/status`` does not say."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Lower this process's peak resident size (``VmHWM``) to its current one, through Linux's
    ``/proc/self/clear_refs``; False where that file cannot be written (the peak then stays)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def memory_baseline(device: str, reset_peak: bool = False) -> int:
    """The level :func:`peak_memory` is measured above; take it after the imports. On CUDA the peak
    statistics are reset here. On a CPU, with ``reset_peak``, the peak resident size is lowered to
    the current one (:func:`reset_peak_rss`), so that memory freed before (a warm-up) is not taken
    off the run's peak; without it the baseline is the peak so far."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    if reset_peak:
        reset_peak_rss()
    return peak_rss_bytes()


def release_freed_heap() -> bool:
    """Hand the heap memory glibc keeps after ``free`` back to the kernel (``malloc_trim(0)``), so
    that a baseline taken next counts only what is live. False where the C library has no such call."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    trim(0)
    return True


def peak_memory(device: str) -> int:
    return torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else peak_rss_bytes()


def synchronize(device: str) -> None:
    """Wait for queued GPU work, so that a wall-clock time covers it (a no-op on CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def model_parameters(results: list[dict]) -> int:
    """The benchmarked model's own parameter count from ``logra bench`` results: any row's but
    LoRA's, whose count adds its adapters (a LoRA-only run: its count less what it trains)."""
    return next(
        (r["total_params"] for r in results if r["method"] != "lora"),
        results[0]["total_params"] - results[0]["trained_params"],
    )


def ratio(value: float, baseline: float) -> str:
    """``value / baseline`` as ``"0.42×"``; ``"n/a"`` when the baseline measured zero (a run so small
    that it never rose above the post-import RSS high-water mark)."""
    return f"{value / baseline:.2f}×" if baseline > 0 else "n/a"


def percentile_95(values: list[float]) -> float:
    """The 95th percentile of ``values`` (linearly interpolated, NumPy's default); NaN if any is."""
    if any(math.isnan(v) for v in values):
        return math.nan
    return values[0] if len(values) == 1 else statistics.quantiles(values, n=20, method="inclusive")[-1]


def spread(values: list[float]) -> dict[str, float] | None:
    """``{"median", "p95", "max"}`` of the finite ``values`` (``None`` when none is finite): how a
    per-update series is summarised, its tail beside its middle."""
    finite = [float(v) for v in values if math.isfinite(v)]
    if not finite:
        return None
    return {"median": statistics.median(finite), "p95": percentile_95(finite), "max": max(finite)}


def source_revision() -> dict[str, str | bool | None]:
    """What code a measurement ran: the library's version, torch's, and, when the library is
    imported from a git checkout that tracks it, that checkout's commit and whether its tracked
    files had uncommitted changes. ``commit`` and ``dirty`` are ``None`` otherwise (an installed
    copy, even one inside some other repository; no git; git failing or slow). Never raises: a
    record of the code must not cost a run its results.

    ``--no-optional-locks`` keeps ``git status`` from refreshing the index, which would take its
    lock and could collide with the user's own git command in that checkout; the environment's
    ``GIT_DIR`` and the like (set inside git hooks) would point ``-C`` at another repository."""
    package = Path(logra_optim.__file__).resolve().parent
    revision = {"version": logra_optim.__version__, "torch": torch.__version__, "commit": None, "dirty": None}
    environment = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE")}

    def git(*arguments: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(
                ["git", "--no-optional-locks", "-C", str(package), *arguments],
                capture_output=True,
                stdin=subprocess.DEVNULL,
                encoding="utf-8",
                errors="replace",
                env=environment,
                timeout=10,
            )
        except (OSError, ValueError, subprocess.SubprocessError):
            return None

    tracked = git("ls-files", "--error-unmatch", "__init__.py")
    if tracked is None or tracked.returncode != 0:
        return revision  # no git, or not this package's checkout
    head = git("rev-parse", "HEAD")
    if head is None or head.returncode != 0:
        return revision
    status = git("status", "--porcelain", "--untracked-files=no")
    revision["commit"] = head.stdout.strip()
    revision["dirty"] = None if status is None or status.returncode != 0 else bool(status.stdout.strip())
    return revision
