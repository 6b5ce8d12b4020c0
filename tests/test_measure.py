"""How the CLI and the benchmarks measure peak memory on CPU (``logra_optim.cli.measure``)."""

from __future__ import annotations

import sys

import pytest

from logra_optim.cli.measure import peak_rss_bytes
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
