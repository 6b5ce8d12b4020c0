"""``benchmarks/bench_probe_samples.py``: its arithmetic on made-up runs, its usage errors, and a real
short run end to end."""

from __future__ import annotations

import json

import pytest

from tests.helpers.scripts import load_script, run_script

bench = load_script("bench_probe_samples")


def record(kl, seconds=0.5, held_out=True, probe=None, rewards=(0.2, 0.4)):
    return {
        "seconds_per_update": seconds,
        "train_rewards": list(rewards),
        "after": {"reward": 0.6},
        "kl_per_update": kl,
        "kl_meter_held_out": held_out,
        "logra_stats": {} if probe is None else {"logra/probe_seconds": probe},
    }


def test_the_held_out_kl_is_summarised_over_the_budget():
    summary = bench.kl_summary(record([0.005, 0.01, 0.02, 0.08, float("nan")]), 0.01, 5.0)
    assert summary["kl_median"] == pytest.approx(1.5)  # of 0.5, 1, 2, 8 (the non-finite one left out)
    assert summary["kl_p95"] == pytest.approx(7.1)  # linear interpolation, as numpy's default
    assert summary["kl_max"] == pytest.approx(8.0)
    assert summary["kl_over_tail"] == 1


def test_updates_without_a_finite_kl_are_counted_not_summarised():
    summary = bench.kl_summary(record([0.01, float("nan"), 0.07, float("inf")]), 0.01, 5.0)
    assert summary["kl_non_finite"] == 2 and summary["kl_over_tail"] == 1
    assert summary["kl_median"] == pytest.approx(4.0) and summary["kl_max"] == pytest.approx(7.0)


def test_a_meter_that_read_the_probed_sequences_is_not_summarised():
    summary = bench.kl_summary(record([0.01, 0.02], held_out=False), 0.01, 5.0)
    assert set(summary.values()) == {None}


def test_a_row_divides_by_the_adamw_time_and_reports_the_probe():
    row = bench.summarise(record([0.01, 0.01], seconds=0.6, probe=[0.1, 0.3, 0.2]), 0.01, 5.0, adamw_seconds=0.5)
    assert row["time_ratio"] == pytest.approx(1.2)
    assert row["probe_seconds"] == pytest.approx(0.2)
    assert row["reward_auc"] == pytest.approx(0.3)
    assert row["greedy_after"] == 0.6 and row["updates"] == 2
    assert bench.summarise(record([0.01]), 0.01, 5.0, 0.5)["probe_seconds"] is None  # AdamW has no probe


def test_failed_runs_are_rows_and_the_ratio_divides_by_the_adamw_runs_that_finished(monkeypatch):
    """The orchestration alone (every worker's record made up here; the end-to-end test below runs
    the real ones): a failed worker becomes a row with its error, and the time ratio divides by the
    AdamW runs that finished; with none, LoGRA's rows keep their measurements without a ratio."""
    from logra_optim.cli import demo
    from logra_optim.cli.runner import WorkerFailed

    def launch(failing):
        def launch_worker(settings, method, seed, console, description):
            if description.startswith(failing):
                raise WorkerFailed(description, "exit code 1", "")
            seconds = 0.4 if method == "adamw" else 0.3 + 0.01 * settings.probe_samples
            return record([0.001, 0.002], seconds=seconds, probe=[0.05] if method == "logra" else None)

        return launch_worker

    settings = demo.DemoSettings(output="")
    monkeypatch.setattr(demo, "launch_worker", launch(("adamw (last)", "logra, 4")))
    rows, records = bench.run_seed(settings, 0, [2, 4], 5.0, console=None)
    assert [row["run"] for row in rows] == ["adamw (first)", "logra, 2 probed", "logra, 4 probed", "adamw (last)"]
    assert rows[2] == {"run": "logra, 4 probed", "error": "exit code 1"} and "error" in rows[3]
    assert rows[1]["time_ratio"] == pytest.approx(0.32 / 0.4)  # the first AdamW run alone
    assert set(records) == {"adamw (first)", "logra, 2 probed"}

    monkeypatch.setattr(demo, "launch_worker", launch("adamw"))
    rows, _ = bench.run_seed(settings, 0, [2], 5.0, console=None)
    assert rows[1]["time_ratio"] is None and rows[1]["seconds_per_update"] == pytest.approx(0.32)
    assert "| 0 | logra, 2 probed | 0.320 | no AdamW run |" in bench.markdown(
        {"command": "", "settings": {**settings.__dict__, "tail": 5.0}, "seeds": {"0": rows}}
    )


def test_the_table_shows_failed_runs():
    report = {
        "command": "python benchmarks/bench_probe_samples.py",
        "settings": {
            "policy": "medium",
            "task": "addition",
            "steps": 2,
            "batch_size": 32,
            "accumulation": 2,
            "rank": 32,
            "kl_budget": 0.01,
            "direction": "orthogonal",
            "tail": 5.0,
        },
        "seeds": {
            "0": [
                {"run": "adamw (first)", **bench.summarise(record([0.01, 0.1]), 0.01, 5.0, 0.5)},
                {"run": "logra, 2 probed", "error": "exit code 1"},
            ]
        },
    }
    table = bench.markdown(report)
    assert "| 0 | adamw (first) | 0.500 | 1.00× |" in table
    assert "| 1 of 2 |" in table  # 10× the budget once
    assert "| 0 | logra, 2 probed | failed: exit code 1 |" in table


@pytest.mark.parametrize(
    "args, message",
    [
        (("--probe-samples", "25"), "--probe-samples must be in 1…24"),
        (("--probe-samples", "4", "--batch-size", "8"), "--batch-size must be more than the KL meter's 8"),
        (("--probe-samples", ""), "expected at least one integer"),
        (("--probe-samples", "0"), "--probe-samples must be in 1…24"),
        (("--batch-size", "20"), "--batch-size must be a multiple of the demo's 8"),
        (("--warm-start-steps", "-1"), "--warm-start-steps must be ≥ 0"),
    ],
)
def test_bad_options_are_refused_by_name(args, message, tmp_path):
    result = run_script("bench_probe_samples", *args, "--output", str(tmp_path))
    assert result.returncode == 2
    assert message in result.stderr


def test_short_run_end_to_end(tmp_path):
    """Real GRPO runs: AdamW, LoGRA probing 2 sequences, AdamW again; every row is measured and the
    held-out KL is summarised for each."""
    result = run_script(
        "bench_probe_samples",
        *("--policy", "tiny", "--steps", "3", "--probe-samples", "2", "--warm-start-steps", "10"),
        *("--output", str(tmp_path)),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "probe-samples.json").read_text())
    rows = report["seeds"]["0"]
    assert [row["run"] for row in rows] == ["adamw (first)", "logra, 2 probed", "adamw (last)"]
    for row in rows:
        assert row["updates"] == 3 and row["seconds_per_update"] > 0 and row["kl_median"] is not None
    assert rows[1]["probe_seconds"] > 0 and rows[0]["probe_seconds"] is None
    mean_adamw = (rows[0]["seconds_per_update"] + rows[2]["seconds_per_update"]) / 2
    assert rows[1]["time_ratio"] == pytest.approx(rows[1]["seconds_per_update"] / mean_adamw)
    assert (tmp_path / "probe-samples.md").read_text().count("| 0 |") == 3
