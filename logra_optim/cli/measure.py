"""How the CLI and the benchmarks measure: device choice, peak memory of the current process, units.

Peak memory on CPU is the process's peak resident set size (``getrusage``) minus the level taken
right after the imports, so what remains is the run's own weights, optimizer state, gradients or
sketches and activations. On CUDA it is ``torch.cuda.max_memory_allocated`` (tensor memory only, so
the baseline is the memory allocated when the run starts). Either way one process measures one
configuration: peaks cannot be reset, so a configuration run after another would inherit its peak
(``runner.run_fresh`` gives each its own process).
"""

from __future__ import annotations

import resource
import sys

import torch

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


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def memory_baseline(device: str) -> int:
    """The level :func:`peak_memory` is measured above; take it after the imports."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return peak_rss_bytes()


def peak_memory(device: str) -> int:
    return torch.cuda.max_memory_allocated(device) if device.startswith("cuda") else peak_rss_bytes()


def synchronize(device: str) -> None:
    """Wait for queued GPU work, so that a wall-clock time covers it (a no-op on CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def ratio(value: float, baseline: float) -> str:
    """``value / baseline`` as ``"0.42×"``; ``"n/a"`` when the baseline measured zero (a run so small
    that it never rose above the post-import RSS high-water mark)."""
    return f"{value / baseline:.2f}×" if baseline > 0 else "n/a"
