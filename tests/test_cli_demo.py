"""``logra demo`` end to end, in a fresh process each (a file of its own so that a parallel test run
can schedule it beside tests/test_cli.py)."""

from __future__ import annotations

import json
import math
import statistics

from tests.test_cli import PNG_MAGIC, run_cli


def test_quick_demo_learns_and_reports(tmp_path):
    """The README's first command in its short form: all four methods train from one warm start,
    every LoGRA update moves the policy by its KL budget (or less, where ``alpha_max`` binds), greedy
    evaluations during RL are recorded, and table, JSON and plots exist. Whether a method learns is
    not asserted here: 60 updates of the tiny policy do not separate learning from noise (over six
    seeds LoGRA's greedy reward went from 0.550 to 0.551 ± 0.10), so the test runs 20 (of --quick's
    60); learning is what bench_learning.py and the demo's stored runs measure."""
    result = run_cli("demo", "--quick", "--steps", "20", "--eval-every", "10", "--output", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    for label in ("LoGRA", "dense AdamW", "AdamW on LoGRA's targets", "LoRA"):
        assert label in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    runs = {run["method"]: run for run in summary["runs"]}
    assert set(runs) == {"logra", "adamw", "adamw-targets", "lora"}
    for run in runs.values():
        assert len(run["train_rewards"]) == 20
        assert run["peak_bytes"] > 0 and run["seconds_per_update"] > 0
        assert 0.0 <= run["before"]["reward"] <= 1.0 and 0.0 <= run["after"]["reward"] <= 1.0
        assert [step for step, _ in run["evaluations"]] == [0, 10, 20]
        assert run["evaluations"][0][1] == run["before"]["reward"]
        assert run["evaluations"][-1][1] == run["after"]["reward"]
        assert 0.0 <= run["evaluations"][1][1] <= 1.0  # the evaluation during RL, at update 10
        # Every method starts from the same warm start.
        assert run["before"] == runs["logra"]["before"]
        # Every method's realised KL of every update, measured alike on its own batch.
        assert len(run["kl_per_update"]) == 20
        assert all(math.isfinite(kl) and kl >= 0.0 for kl in run["kl_per_update"])
    # LoRA trains adapters of rank r on the targets; AdamW on the targets exactly LoGRA's weights.
    assert runs["lora"]["trained_params"] < runs["adamw-targets"]["trained_params"] < runs["adamw"]["trained_params"]
    stats = runs["logra"]["logra_stats"]
    assert len(stats["logra/alpha"]) == 20, "LoGRA's stats reach the training logs"
    # The probe ran on every update and measured a step wherever GRPO had a signal (an update whose
    # advantages are all zero has a zero sketch and a zero prediction).
    predictions = stats["logra/predicted_kl"]
    assert all(math.isfinite(q) and q >= 0.0 for q in predictions)
    assert sum(q > 0.0 for q in predictions) >= len(predictions) // 2
    assert all(tokens > 0 for tokens in stats["logra/probe_tokens"])
    # The meter measures on the contexts LoGRA probes (8 sequences spread over the batch): where
    # LoGRA predicted a step, the realised KL is that prediction, to the quadratic model's accuracy.
    pairs = [(r, p) for r, p in zip(runs["logra"]["kl_per_update"], stats["logra/predicted_step_kl"]) if p > 0]
    assert len(pairs) >= 10
    assert 0.7 <= statistics.median(r / p for r, p in pairs) <= 1.3
    for image in ("reward.png", "memory.png"):
        assert (tmp_path / image).read_bytes()[:8] == PNG_MAGIC


def test_demo_with_a_local_model_path(tmp_path):
    """``--model PATH``: any saved causal LM and its tokenizer (here the demo's tiny policy, saved
    untrained), no warm start by default; LoGRA alone for a few updates."""
    from logra_optim.cli.demo import build_policy, build_tokenizer

    model_dir = tmp_path / "policy"
    tokenizer = build_tokenizer()
    build_policy(tokenizer, seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    result = run_cli(
        "demo",
        "--model",
        str(model_dir),
        "--steps",
        "3",
        "--methods",
        "logra",
        "--rank",
        "8",
        "--output",
        str(tmp_path / "out"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["settings"]["model"] == str(model_dir) and summary["settings"]["warm_start_steps"] == 0
    assert [run["method"] for run in summary["runs"]] == ["logra"]
    assert len(summary["runs"][0]["train_rewards"]) == 3
