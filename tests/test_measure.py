"""How the CLI and the benchmarks measure peak memory on CPU (``logra_optim.cli.measure``)."""

from __future__ import annotations

import sys

import pytest

from logra_optim.cli.measure import memory_baseline, peak_memory, peak_rss_bytes
from logra_optim.cli.runner import run_fresh

MIB = 2**20


def child_peak(spec: dict) -> int:
    """Run in a fresh process: its peak RSS after touching ``spec["mib"]`` MiB."""
    block = bytearray(spec["mib"] * MIB)
    block[::4096] = b"\1" * len(block[::4096])
    return peak_rss_bytes()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux carries ru_maxrss over fork and exec")
def test_a_worker_reports_its_own_peak_not_its_parents():
    """The parent's high-water mark (here ≥ 768 MiB) must not become the worker's: the demo's
    workers run after a warm start in the parent, and their peaks above the post-import level
    were understated by the difference."""
    block = bytearray(768 * MIB)
    block[::4096] = b"\1" * len(block[::4096])
    parent = peak_rss_bytes()
    del block
    small = run_fresh(child_peak, {"mib": 16}, label="small worker")
    large = run_fresh(child_peak, {"mib": 256}, label="large worker")
    assert small < parent - 512 * MIB
    # The worker's own allocation shows up in full.
    assert large - small == pytest.approx(240 * MIB, rel=0.1)


def peak_after_freeing(spec: dict) -> int:
    """Run in a fresh process: touch and free ``spec["freed"]`` MiB, take the baseline, then touch
    ``spec["mib"]`` MiB; the peak above the baseline."""
    freed = bytearray(spec["freed"] * MIB)
    freed[::4096] = b"\1" * len(freed[::4096])
    del freed
    baseline = memory_baseline("cpu", reset_peak=True)
    block = bytearray(spec["mib"] * MIB)
    block[::4096] = b"\1" * len(block[::4096])
    return peak_memory("cpu") - baseline


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the peak is reset through /proc/self/clear_refs")
def test_memory_freed_before_the_baseline_is_not_room_for_the_run():
    """A warm-up's freed peak (here 256 MiB) must not hide the run's own 64 MiB, as a baseline at
    the high-water mark would (the run would then measure 0)."""
    peak = run_fresh(peak_after_freeing, {"freed": 256, "mib": 64}, label="worker")
    assert peak == pytest.approx(64 * MIB, rel=0.1)
