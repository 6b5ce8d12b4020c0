"""``benchmarks/gpu_check.py``: the prepared GPU check runs end to end at tiny sizes on a CPU (so the
script a GPU session relies on cannot rot), and a check that crashes is reported as failed without
stopping the others."""

from __future__ import annotations

import json

from tests.helpers.scripts import load_script, run_script

gpu_check = load_script("gpu_check")


def test_quick_run_on_cpu_passes_every_check_it_can(tmp_path):
    output = tmp_path / "gpu-check.json"
    result = run_script("gpu_check", "--device", "cpu", "--quick", "--output", str(output))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(output.read_text())
    statuses = {name: check["status"] for name, check in report["checks"].items()}
    assert statuses == {
        "projections": "pass",
        "bf16 autocast": "pass",
        "probe": "pass",
        "directions": "pass",
        "memory": "pass",
        "vLLM sync": "skipped",
        "vLLM MoE sync": "skipped",
    }
    rows = report["checks"]["memory"]["rows"]
    assert {(row["method"], row["checkpointing"]) for row in rows} == {
        (method, checkpointing) for method in gpu_check.QUICK_MEMORY_METHODS for checkpointing in (False, True)
    }
    # The floor may not lift a tiny CPU run's RSS above its post-import level; the methods do.
    assert all(row["peak_bytes"] > 0 for row in rows if row["method"] != "frozen")
    assert all(row["peak_bytes"] >= 0 and row["state_bytes"] == 0 for row in rows if row["method"] == "frozen")
    for row in rows:  # each method's peak above the floor and its own state, as a share of AdamW's
        if row["method"] != "frozen":
            floor = next(r for r in rows if r["method"] == "frozen" and r["checkpointing"] == row["checkpointing"])
            adamw = next(r for r in rows if r["method"] == "adamw" and r["checkpointing"] == row["checkpointing"])
            expected = (row["peak_bytes"] - floor["peak_bytes"] - row["state_bytes"]) / adamw["peak_bytes"]
            assert row["above_floor_and_state"] == expected
    assert "above floor + state" in report["checks"]["memory"]["detail"]
    assert "| probe | pass |" in result.stdout


def test_a_crashing_check_is_a_failure_and_the_others_still_run(tmp_path, monkeypatch):
    def broken(device, quick):
        raise RuntimeError("no kernel for this")

    checks = {"projections": gpu_check.check_projections, "probe": broken}
    monkeypatch.setattr(gpu_check, "CHECKS", checks)
    report = gpu_check.main(["--device", "cpu", "--quick", "--output", str(tmp_path / "report.json")])
    assert report["checks"]["probe"] == {
        "status": "FAIL",
        "detail": "RuntimeError: no kernel for this",
        "seconds": report["checks"]["probe"]["seconds"],
    }
    assert report["checks"]["projections"]["status"] == "pass"
    assert json.loads((tmp_path / "report.json").read_text())["checks"]["probe"]["status"] == "FAIL"
