"""``benchmarks/bench_stability.py``: the verdict's arithmetic on made-up runs (collapse, KL over
budget, skips, missing measurements), and a real short run end to end."""

from __future__ import annotations

import json

import pytest

from tests.helpers.scripts import load_script, run_script

bench = load_script("bench_stability")


def record(rewards, realised, nonfinite=0, probe=0):
    n = len(rewards)
    return {
        "train_rewards": rewards,
        "before": {"reward": 0.4},
        "after": {"reward": 0.6},
        "logra_stats": {
            "logra/realised_kl": realised,
            "logra/nonfinite_skips": [0.0] * (n - 1) + [float(nonfinite)],
            "logra/probe_skips": [0.0] * (n - 1) + [float(probe)],
        },
    }


def test_a_steady_run_is_stable():
    verdict = bench.summarise(record([0.3, 0.4, 0.5, 0.6], [0.01, 0.011, 0.009, 0.0105]), 0.01, 2, 0.05)
    assert verdict["stable"] and not verdict["collapsed"]
    assert verdict["reward_first_window"] == pytest.approx(0.35) and verdict["reward_last_window"] == pytest.approx(
        0.55
    )
    assert verdict["kl_over_budget"] == 0 and verdict["kl_ratio_max"] == pytest.approx(1.1)
    assert verdict["held_out_kl_ratio_median"] is None  # no meter series: reported as not measured


def test_the_held_out_kl_is_reported_not_judged():
    """The meter's KL on sequences the probe did not read: its median, 95th percentile and maximum
    relative to the budget; a held-out overshoot is reported, and does not decide the verdict."""
    metered = {"kl_per_update": [0.005, 0.01, 0.02, 0.04], "kl_meter_held_out": True}
    verdict = bench.summarise(record([0.3, 0.4, 0.5, 0.6], [0.01] * 4) | metered, 0.01, 2, 0.05)
    assert verdict["held_out_kl_ratio_median"] == pytest.approx(1.5)
    assert verdict["held_out_kl_ratio_p95"] == pytest.approx(3.7)
    assert verdict["held_out_kl_ratio_max"] == pytest.approx(4.0)
    assert verdict["stable"]
    # A meter that read the probed sequences (the probe took whole batches) is not held out.
    in_sample = bench.summarise(record([0.3] * 4, [0.01] * 4) | metered | {"kl_meter_held_out": False}, 0.01, 2, 0.05)
    assert in_sample["held_out_kl_ratio_median"] is None


@pytest.mark.parametrize(
    "run, key, value",
    [
        (record([0.5, 0.6, 0.3, 0.3], [0.01] * 4), "collapsed", True),  # last window 0.3, best 0.55
        (record([0.3, 0.4, 0.5, 0.6], [0.01, 0.02, 0.01, 0.01]), "kl_over_budget", 1),  # 2× the budget once
        (record([0.3, 0.4, 0.5, 0.6], [0.01, float("nan"), 0.01, 0.01]), "kl_non_finite", 1),
        (record([0.3, 0.4, 0.5, 0.6], [0.01] * 3), "kl_measured", 3),  # an update without a measurement
        (record([0.3, 0.4, 0.5, 0.6], [0.01] * 4, nonfinite=1), "nonfinite_skips", 1),
        (record([0.3, 0.4, 0.5, 0.6], [0.01] * 4, probe=2), "probe_skips", 2),
    ],
)
def test_every_failure_mode_makes_a_run_unstable(run, key, value):
    verdict = bench.summarise(run, 0.01, 2, 0.05)
    assert verdict[key] == value
    assert not verdict["stable"]


def test_short_run_end_to_end(tmp_path):
    """A real GRPO run with LoGRA and the realised-KL check: every update has a measured KL, and the
    table, JSON and plot are written."""
    result = run_script(
        "bench_stability",
        *("--steps", "6", "--window", "3", "--batch-size", "32", "--warm-start-steps", "20"),
        *("--output", str(tmp_path)),
    )
    assert result.returncode in (0, 1), result.stderr[-3000:]
    report = json.loads((tmp_path / "stability.json").read_text())
    verdict = report["seeds"]["0"]
    assert verdict["updates"] == 6 and verdict["kl_measured"] == 6
    # 32 completions, all probed (probe_samples=32): the meter has no held-out sequence to read.
    assert verdict["held_out_kl_ratio_median"] is None
    assert result.returncode == (0 if verdict["stable"] else 1)
    assert "| 0 |" in (tmp_path / "stability.md").read_text()
    assert (tmp_path / "stability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
