"""``benchmarks/bench_learning.py``: bad input, the choice of a best setting, a real end-to-end run of
all four methods, and a run that really fails inside its worker."""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers.scripts import load_script, run_script

# The smallest run: 3 updates of 32 completions, one seed, one task, a short warm start.
SMALL = ["--quick", "--steps", "3", "--seeds", "0", "--tasks", "addition", "--warm-start-steps", "20"]

bench = load_script("bench_learning")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--methods", "adamw,sgd"], "--methods"),
        (["--tasks", "chess"], "--tasks"),
        (["--adamw-lrs", ""], "--adamw-lrs"),
        (["--adamw-lrs", ","], "--adamw-lrs"),
        (["--lora-lrs", "0"], "--lora-lrs"),
        (["--adamw-targets-lrs", "-3e-4"], "--adamw-targets-lrs"),
        (["--logra-budgets", "0"], "--logra-budgets"),
        (["--logra-budgets", "1e-2,-1"], "--logra-budgets"),
        (["--logra-budgets", "nan"], "--logra-budgets"),
        (["--logra-knob", "update_ratio", "--logra-ratios", "0"], "--logra-ratios"),
        (["--logra-knob", "rank"], "--logra-knob"),
        (["--sweep-size", "0"], "--sweep-size"),
        (["--logra-ratios", "0.1"], "--logra-ratios"),  # the default knob is kl_budget
        (["--adamw-lrs", "1e-4,3e-4", "--lora-lrs", "1e-3"], "same number of values"),
        (["--seeds", "0,0"], "--seeds"),
        (["--methods", "adamw,apollo"], "--methods"),
        (["--galore-lrs", "0"], "--galore-lrs"),
        (["--galore-lrs", ""], "--galore-lrs"),
        (["--apollo-mini-lrs", "1e-4,-1e-3"], "--apollo-mini-lrs"),
        (["--methods", "adamw,galore", "--galore-lrs", "1e-3,3e-3"], "same number of values"),
        (["--methods", "galore,apollo-mini", "--apollo-mini-lrs", "1e-4"], "--apollo-mini-lrs 1"),
        (["--beta1", "1.0"], "--beta1"),
        (["--refresh-every", "0"], "--refresh-every"),
        (["--logra-non-target-lr", "0"], "--logra-non-target-lr"),
        (["--methods", "adamw", "--logra-non-target-lr", "1e-3"], "--logra-non-target-lr"),
    ],
)
def test_bad_input_is_a_usage_error_naming_the_option(capsys, tmp_path, argv, expected):
    with pytest.raises(SystemExit) as exit_info:
        bench.main([*argv, "--output", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_sweeps_have_equal_sizes_by_default():
    parser = bench.build_parser()
    for argv, size in ([[], 3], [["--quick"], 2], [["--sweep-size", "4"], 4]):
        sweeps = bench.sweeps_from(parser.parse_args(argv), parser)
        assert set(sweeps) == set(bench.DEFAULT_METHODS)
        assert {len(values) for _, values in sweeps.values()} == {size}
        assert all(v > 0 for _, values in sweeps.values() for v in values)
    sweeps = bench.sweeps_from(parser.parse_args(["--logra-knob", "update_ratio"]), parser)
    assert sweeps["logra"][0] == "update_ratio" and sweeps["adamw"][0] == "lr"
    # GaLore and APOLLO-Mini race on request, with sweeps of the same size centred on the demo's rate
    # for the tiny policy (this benchmark's).
    assert set(bench.DEFAULT_METHODS) < set(bench.METHODS)
    sweeps = bench.sweeps_from(parser.parse_args(["--methods", ",".join(bench.METHODS)]), parser)
    assert {len(values) for _, values in sweeps.values()} == {3}
    rates = bench.demo.POLICY_RATES["tiny"]
    for method, rate in (("galore", rates.galore), ("apollo-mini", rates.apollo_mini)):
        assert sweeps[method][0] == "lr" and sweeps[method][1] == pytest.approx([rate / 3, rate, rate * 3], rel=0.05)
    argv = ["--methods", "galore,apollo-mini", "--galore-lrs", "1e-3,3e-3", "--apollo-mini-lrs", "1e-4,2e-4"]
    sweeps = bench.sweeps_from(parser.parse_args(argv), parser)
    assert sweeps == {"galore": ("lr", [1e-3, 3e-3]), "apollo-mini": ("lr", [1e-4, 2e-4])}
    assert bench.overrides("logra", "update_ratio", 0.1) == {"kl_budget": None, "update_ratio": 0.1}


def test_logra_budget_sweep_follows_the_first_moment():
    """The optimizer's defaults (a first moment) race around a budget a decade below the paper's rule,
    whose sweep (``--beta1 0``) centres on its own best."""
    parser = bench.build_parser()
    args = parser.parse_args([])
    assert (args.beta1, args.refresh_every) == (0.9, 10)  # LoGRAOptimizer's defaults
    assert bench.sweeps_from(args, parser)["logra"] == ("kl_budget", [1e-3, 3e-3, 9e-3])
    args = parser.parse_args(["--beta1", "0", "--refresh-every", "1"])
    assert bench.sweeps_from(args, parser)["logra"] == ("kl_budget", [1e-2, 3e-2, 9e-2])


def test_each_sweep_value_reaches_its_own_method():
    """A setting of one method's sweep sets that method's learning rate alone (LoRA's not AdamW's,
    dense AdamW's not AdamW on the targets'), and the worker's trainer gets the learning rate of the
    method it runs."""
    from dataclasses import replace

    from logra_optim.cli import demo

    base = demo.DemoSettings(output="unused")
    methods = ("adamw", "adamw-targets", "lora", "galore", "apollo-mini")
    for method in methods:
        settings = replace(base, **bench.overrides(method, "lr", 7e-5))
        for runner in methods:
            rate = demo._grpo_config(settings, runner, 0, "cpu").learning_rate
            assert (rate == 7e-5) == (runner == method), (method, runner)
    assert bench.overrides("logra", "kl_budget", 0.02) == {"kl_budget": 0.02}


def test_failed_seeds_never_enter_a_mean_and_complete_settings_win():
    def run(seed, auc):
        metrics = dict.fromkeys(("final", "greedy_after", "greedy_before", "train_seconds"), 0.5)
        return {
            "seed": seed,
            "wall_seconds": 1.0,
            "metrics": {**metrics, "auc": auc, "kl_predicted": None, "kl_realised": None, "kl_measured": 1e-3},
        }

    # lr 1e-3 has the higher AUC on the seed that completed, but lost seed 1: lr 3e-4 (all seeds) wins.
    partial = bench.setting_summary("lr", 1e-3, [run(0, 0.9)], [{"seed": 1, "error": "RuntimeError: nan"}])
    complete = bench.setting_summary("lr", 3e-4, [run(0, 0.4), run(1, 0.6)], [])
    assert partial["auc"] == 0.9 and partial["failed_seeds"] == [1] and partial["seeds"] == [0]
    assert complete["auc"] == pytest.approx(0.5) and complete["auc_std"] > 0
    assert bench.best_setting([partial, complete]) is complete
    assert bench.best_setting([partial]) is partial  # every setting lost a seed: the best of what ran
    failed = bench.setting_summary("lr", 1.0, [], [{"seed": 0, "error": "x"}])
    assert failed["auc"] is None and bench.best_setting([failed]) is None
    rows = bench.table_rows({"methods": {"adamw": {"best": complete, "sweep": [partial, complete]}}})
    assert "1 failed" in rows[0][-1]


def test_all_four_methods_end_to_end(tmp_path):
    """One setting per method, one seed: every method completes, has one best setting, finite metrics."""
    one_each = ["--adamw-lrs", "3e-4", "--adamw-targets-lrs", "3e-4", "--lora-lrs", "1e-3", "--logra-budgets", "1e-2"]
    result = run_script("bench_learning", *SMALL, *one_each, "--output", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    for label in ("dense AdamW", "AdamW on LoGRA's targets", "LoRA", "LoGRA"):
        assert label in result.stdout
    report = json.loads((tmp_path / "learning.json").read_text())
    assert (tmp_path / "learning.md").read_text().startswith("# Learning benchmark")
    assert report["failures"] == []
    methods = report["tasks"]["addition"]["methods"]
    assert set(methods) == set(bench.DEFAULT_METHODS)
    for method, entry in methods.items():
        best = entry["best"]
        assert len(entry["sweep"]) == 1 and best["value"] == entry["sweep"][0]["value"]
        for key in ("auc", "auc_std", "final", "greedy_after", "train_seconds", "wall_seconds"):
            assert best[key] is not None and math.isfinite(best[key]), (method, key)
        assert 0.0 <= best["auc"] <= 1.0 and 0.0 <= best["greedy_after"] <= 1.0
        assert (best["kl_predicted"] is not None) == (method == "logra")
        assert best["kl_measured"] is not None and best["kl_measured"] >= 0.0  # every method's, alike
    records = {run["method"]: run["record"] for run in report["runs"]}
    assert len(records["adamw"]["train_rewards"]) == 3
    # AdamW on the targets trains exactly what LoGRA does; LoRA far less; dense AdamW a little more.
    assert records["adamw-targets"]["trained_params"] == records["logra"]["trained_params"]
    assert records["lora"]["trained_params"] < records["logra"]["trained_params"] < records["adamw"]["trained_params"]


def test_a_run_that_fails_is_reported_and_kept_out_of_the_mean(tmp_path):
    """A real failure: at lr 1e30 AdamW's first update overflows the weights, and sampling the next
    group raises inside the worker. The sweep's other value completes and is the best setting."""
    result = run_script(
        "bench_learning", *SMALL, "--methods", "adamw", "--adamw-lrs", "3e-4,1e30", "--output", str(tmp_path)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "learning.json").read_text())
    (failure,) = report["failures"]
    assert (failure["method"], failure["value"], failure["seed"]) == ("adamw", 1e30, 0)
    assert "Error" in failure["error"]
    assert f"FAILED addition adamw lr=1e+30 seed 0: {failure['error']}" in result.stdout
    entry = report["tasks"]["addition"]["methods"]["adamw"]
    failed = next(s for s in entry["sweep"] if s["value"] == 1e30)
    assert failed["seeds"] == [] and failed["failed_seeds"] == [0] and failed["auc"] is None
    assert entry["best"]["value"] == 3e-4 and entry["best"]["seeds"] == [0]
    assert "Failed runs" in (tmp_path / "learning.md").read_text()


def test_the_report_says_which_sequences_the_kl_meter_read():
    """The meter reads sequences LoGRA's probe did not, unless the probe took whole batches (as with --quick)."""
    assert "does not read" in bench.meter_rows({"probe_samples": 32, "batch_size": 64})
    assert "measured on probed sequences" in bench.meter_rows({"probe_samples": 32, "batch_size": 32})
