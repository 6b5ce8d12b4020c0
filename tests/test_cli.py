"""The ``logra`` command: argument handling and bad input, a real ``--quick`` demo, ``bench`` on the
tiny preset, the fresh-process runner they share, and ``plan``'s memory model checked against real
models: parameter and target counts, LoGRA's sketch buffers, peft's adapters, and the bytes autograd
actually saves for backward."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import logra_optim
from logra_optim import patch_model
from logra_optim.patching import patched_modules
from logra_optim.cli import build_parser, main, measure, tasks
from logra_optim.cli import plan as plan_module
from logra_optim.cli.runner import WorkerFailed, run_fresh
from logra_optim.cli.shapes import PRESETS, Shape

TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=176,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    vocab_size=300,
    num_hidden_layers=2,
    tie_word_embeddings=False,
)
TARGET_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The real command in a fresh process, as a user runs it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "logra_optim.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def usage_error(capsys, *argv: str) -> str:
    """Run ``main`` on bad arguments: it must exit with status 2; returns its message."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# Arguments and bad input


def test_help_lists_the_three_commands(capsys):
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("demo", "bench", "plan"):
        assert command in result.stdout
        # Each option's default, where it has one; an unset one is said in the option's own text.
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert "(default: None)" not in text and "(default: " in text
        # Once per option, and a list as the option is written.
        for option in text.split("\n  -")[1:]:
            assert option.count("(default") + option.count("; default") <= 1 and "(default: [" not in option, option


@pytest.mark.parametrize("rank", ["0", "-3", "abc", "1.5"])
def test_invalid_rank_is_refused(capsys, rank, tmp_path):
    message = usage_error(capsys, "demo", "--rank", rank, "--output", str(tmp_path))
    assert "--rank" in message and "positive integer" in message


def test_missing_model_path_is_refused(capsys, tmp_path):
    message = usage_error(capsys, "demo", "--model", str(tmp_path / "nowhere"), "--output", str(tmp_path))
    assert "--model" in message and "no such directory" in message


def test_model_dir_without_config_is_refused(capsys, tmp_path):
    message = usage_error(capsys, "bench", "--model", str(tmp_path), "--output", str(tmp_path))
    assert "--model" in message and "no config.json" in message


@pytest.mark.parametrize("ranks", [["--rank", "64"], ["--rank", "8", "--ranks", "0"]])
def test_bench_refuses_ranks_the_model_does_not_allow(capsys, tmp_path, ranks):
    """Checked before any worker starts: the tiny preset's smallest target dimension is 32."""
    message = usage_error(capsys, "bench", "--preset", "tiny", *ranks, "--output", str(tmp_path))
    assert "--rank" in message and "1…32" in message


def test_a_failed_parse_creates_no_output_dir(capsys, tmp_path):
    output = tmp_path / "not-yet"
    usage_error(capsys, "demo", "--methods", "foo", "--output", str(output))
    assert not output.exists()


def test_unwritable_output_dir_is_refused(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    message = usage_error(capsys, "demo", "--output", str(blocker / "out"))
    assert "--output" in message and "cannot write there" in message


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["demo", "--kl-budget", "-1"], "--kl-budget"),
        (["demo", "--kl-budget", "nan"], "--kl-budget"),
        (["demo", "--device", "gpu"], "--device"),
        (["demo", "--task", "chess"], "--task"),
        (["demo", "--policy", "huge"], "--policy"),
        (["demo", "--eval-every", "-1"], "--eval-every"),
        (["demo", "--lora-lr", "0"], "--lora-lr"),
        (["demo", "--methods", "logra,sgd"], "--methods"),
        (["demo", "--seeds", "1,x"], "--seeds"),
        (["demo", "--seeds", "1,1"], "--seeds"),
        (["demo", "--warm-start-reward", "1.5"], "--warm-start-reward"),
        (["demo", "--warm-start-steps", "-1"], "--warm-start-steps"),
        (["demo", "--beta1", "1"], "--beta1"),
        (["demo", "--beta1", "-0.5"], "--beta1"),
        (["demo", "--refresh-every", "0"], "--refresh-every"),
        (["demo", "--accumulation", "0"], "--accumulation"),
        (["demo", "--threads", "0"], "--threads"),
        (["bench", "--methods", "adam"], "--methods"),
        (["bench", "--methods", "adamw,adamw"], "--methods"),
        (["demo", "--methods", "logra,logra"], "--methods"),
        (["bench", "--preset", "tiny", "--rank", "8", "--experts", "2"], "--experts 2: the model has no mixture"),
        (["bench", "--preset", "llama-70b"], "--preset"),
        (["plan"], "config"),
    ],
)
def test_bad_options_name_the_option(capsys, tmp_path, argv, expected):
    if argv[0] != "plan":
        argv = [*argv, "--output", str(tmp_path)]
    assert expected in usage_error(capsys, *argv)


def test_cuda_on_a_machine_without_one_is_a_clear_error(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["demo", "--device", "cuda", "--output", str(tmp_path)]) == 1
    assert "no CUDA device" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# Tasks


@pytest.mark.parametrize("task", sorted(tasks.TASKS))
@pytest.mark.parametrize("style", ["spaced", "text"])
def test_task_answers_score_one_and_wrong_answers_less(task, style):
    for problem in tasks.make_problems(task, 50, digits=2, style=style, seed=3):
        assert tasks.score(problem.answer, problem.answer) == 1.0
        assert len("".join(problem.answer.split())) <= tasks.answer_length(task, 2)
        assert tasks.score(problem.answer + " 9", problem.answer) < 1.0
    assert tasks.score("", "12") == 0.0
    assert tasks.score("1 3", "1 2") == 0.5
    assert tasks.reward(["4 2", "4"], answer=["4 2", "4 2"]) == [1.0, 0.5]


@pytest.mark.parametrize("task", sorted(tasks.TASKS))
def test_a_saved_tiny_policy_reloads_with_the_tokenizer_it_was_trained_with(task, tmp_path):
    """Workers reload the warm-started policy from disk: its prompts must tokenize as in training
    (AutoTokenizer would pick Qwen2Tokenizer from the model type and drop words such as "sort")."""
    from logra_optim.cli import demo

    tokenizer = demo.build_tokenizer()
    demo.build_policy(tokenizer, seed=0).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    _, reloaded = demo.load_policy(demo.DemoSettings(output=str(tmp_path)), str(tmp_path))
    for problem in tasks.make_problems(task, 20, digits=2, style="spaced", seed=1):
        assert reloaded(problem.prompt)["input_ids"] == tokenizer(problem.prompt)["input_ids"], problem.prompt


@pytest.mark.parametrize("size", ["small", "medium"])
def test_demo_policies_are_mostly_targets(size):
    """``--policy small`` and ``medium`` (the default): ≥ 10 M target parameters and ≥ 95% of the
    model, like a real LLM, so that gradients and optimizer state, not the interpreter, decide the
    demo's memory column."""
    from logra_optim import find_target_modules
    from logra_optim.cli import demo

    model = demo.build_policy(demo.build_tokenizer(), seed=0, size=size)
    targets = sum(module.weight.numel() for _, module in find_target_modules(model))
    assert targets >= 10_000_000 and targets >= 0.95 * sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="policy must be one of"):
        demo.build_policy(demo.build_tokenizer(), seed=0, size="huge")


def test_demo_learning_rates_default_to_the_policys():
    """Each built-in policy has its own swept learning rates; a given rate wins; ``--model`` takes
    the untuned defaults; an unknown policy is refused by name."""
    from logra_optim.cli import demo

    medium = demo.DemoSettings(output="")
    assert medium.policy == "medium"
    assert (medium.adamw_lr, medium.adamw_targets_lr, medium.lora_lr, medium.warm_start_lr) == (3e-5, 1e-4, 3e-4, 1e-3)
    assert (medium.learning_rate("adamw"), medium.learning_rate("adamw-targets")) == (3e-5, 1e-4)
    tiny = demo.DemoSettings(output="", policy="tiny", lora_lr=5e-4)
    assert (tiny.adamw_lr, tiny.lora_lr, tiny.warm_start_lr) == (3e-4, 5e-4, 2e-3)
    assert demo.DemoSettings(output="", model="/some/model").adamw_lr == demo.MODEL_RATES.adamw
    with pytest.raises(ValueError, match="policy must be one of tiny, small, medium"):
        demo.DemoSettings(output="", policy="huge")


def test_the_demo_names_the_settings_no_sweep_chose(tmp_path):
    """Beside tuned settings, the table names the untuned ones: GaLore's rate (matched by KL), LoGRA's
    budget under --quick (the medium policy's), every knob at a batch its sweep did not use; not the
    ones the user gave, and an explicit --steps wins over --quick's 60."""
    from logra_optim.cli import build_parser, demo

    parser = build_parser()

    def notes(*argv):
        settings = demo.settings_from(parser.parse_args(["demo", *argv, "--output", str(tmp_path)]), parser)
        return settings, settings.unswept

    assert notes()[1] == []  # the medium policy at the batch of its sweep
    quick, quick_notes = notes("--quick", "--steps", "80")
    assert quick.steps == 80 and quick_notes == [
        "LoGRA's KL budget 0.001 (not what a sweep chose for the tiny policy at 1 microbatch per update)"
    ]
    assert notes("--quick", "--kl-budget", "1e-3")[1] == []
    assert notes("--quick", "--policy", "medium")[1] == [  # the medium sweep at one microbatch chose 3e-5 here
        "AdamW on the targets' learning rate 0.0001 (not what a sweep chose for the medium policy at 1 microbatch "
        "per update)"
    ]
    assert notes("--methods", "logra,galore")[1] == [
        "GaLore's learning rate 0.0003 (matched by KL per update, not swept)"
    ]
    assert notes("--methods", "adamw", "--accumulation", "3")[1] == [
        "dense AdamW's learning rate 3e-05 (not what a sweep chose for the medium policy at 3 microbatches per update)"
    ]


def test_demo_batch_budget_and_rates_from_the_command_line(tmp_path):
    """By default an update is 2 microbatches at LoGRA's budget 3e-3; ``--quick`` keeps one
    microbatch at the budget swept for it; explicit values win either way, and each AdamW method's
    rate reaches its own setting."""
    import argparse

    from logra_optim.cli import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)

    def settings(*argv):
        return demo.settings_from(parser.parse_args([*argv, "--output", str(tmp_path)]), parser)

    default, quick = settings(), settings("--quick")
    assert (default.accumulation, default.kl_budget, default.steps) == (2, 3e-3, 100)
    assert (quick.accumulation, quick.kl_budget, quick.steps, quick.policy) == (1, demo.QUICK_KL_BUDGET, 60, "tiny")
    chosen = settings("--quick", "--accumulation", "3", "--kl-budget", "2e-3")
    assert (chosen.accumulation, chosen.kl_budget) == (3, 2e-3)
    rates = settings("--adamw-lr", "2e-5", "--adamw-targets-lr", "7e-5")
    assert (rates.learning_rate("adamw"), rates.learning_rate("adamw-targets")) == (2e-5, 7e-5)


def test_addition_answers_are_the_sums():
    for problem in tasks.make_problems("addition", 100, digits=3, style="text", seed=0):
        left, right = problem.prompt.rstrip("=").split("+")
        assert int(problem.answer) == int(left) + int(right)


# --------------------------------------------------------------------------------------------------
# The fresh-process runner (workers must be module-level: the child imports them from this file)


def echo_worker(spec: dict) -> dict:
    print("noise on stdout cannot corrupt the record")
    return {"spec": spec, "pid": os.getpid()}


def crashing_worker(spec: dict) -> dict:
    print(f"PROGRESS {spec['step']}", file=sys.stderr, flush=True)
    raise ValueError(f"worker broke on purpose at step {spec['step']}")


def silent_worker(spec: dict) -> None:
    return None


def test_run_fresh_returns_the_record_from_another_process():
    record = run_fresh(echo_worker, {"rank": 8, "method": "logra-sgd"}, label="echo")
    assert record["spec"] == {"rank": 8, "method": "logra-sgd"}
    assert record["pid"] != os.getpid()


def test_a_crashing_worker_is_a_clear_error_naming_it():
    claimed = []

    def claim_progress(line: str) -> bool:
        if line.startswith("PROGRESS"):
            claimed.append(line)
            return True
        return False

    with pytest.raises(WorkerFailed) as failure:
        run_fresh(crashing_worker, {"step": 3}, label="logra-rowadam r=64", on_line=claim_progress)
    message = str(failure.value)
    assert message.startswith("logra-rowadam r=64 failed (exit 1)")
    assert "ValueError: worker broke on purpose at step 3" in message  # the child's traceback
    assert claimed == ["PROGRESS 3\n"] and "PROGRESS" not in message  # claimed lines are left out
    with pytest.raises(WorkerFailed, match="silent failed .*without writing a result"):
        run_fresh(silent_worker, {}, label="silent")
    with pytest.raises(ValueError, match="module-level function"):
        run_fresh(lambda spec: spec, {}, label="lambda")


# --------------------------------------------------------------------------------------------------
# The demo and the benchmark, for real


def test_quick_demo_learns_and_reports(tmp_path):
    """The README's first command in its short form: all four methods train from one warm start,
    LoGRA's predicted KL per update holds on sequences its probe did not read, greedy
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
    # The probe's precision ("auto": fp32 on a CPU) is reported.
    assert runs["logra"]["probe_dtype"] is None and runs["adamw"]["probe_dtype"] is None
    # The probe ran on every update and measured a step wherever GRPO had a signal (an update whose
    # advantages are all zero has a zero sketch and a zero prediction).
    predictions = stats["logra/predicted_kl"]
    assert all(math.isfinite(q) and q >= 0.0 for q in predictions)
    assert sum(q > 0.0 for q in predictions) >= len(predictions) // 2
    assert all(tokens > 0 for tokens in stats["logra/probe_tokens"])
    # The meter measures on 8 sequences of the batch that LoGRA's probe did not read: where LoGRA
    # predicted a step, the prediction holds on them too, within a factor 2 in the median (on the
    # probed sequences themselves it would hold by construction; 1.2 measured here).
    pairs = [(r, p) for r, p in zip(runs["logra"]["kl_per_update"], stats["logra/predicted_step_kl"]) if p > 0]
    assert len(pairs) >= 10
    assert 0.5 <= statistics.median(r / p for r, p in pairs) <= 2.0
    for image in ("reward.png", "memory.png"):
        assert (tmp_path / image).read_bytes()[:8] == PNG_MAGIC


def git_output(directory: Path, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(directory), *arguments], capture_output=True, text=True)


def test_bench_on_the_tiny_preset(tmp_path):
    methods = "adamw,lora,galore,logra-sgd,logra-rowadam,logra-orthogonal"
    data = run_tiny_bench(tmp_path, methods, "--ranks", "4", "--seq", "64")
    # bench.json names the code that ran, as git itself reports it for the checkout that tracks the
    # imported package (none where none does).
    package = Path(logra_optim.__file__).resolve().parent
    tracked = git_output(package, "ls-files", "--error-unmatch", "__init__.py").returncode == 0
    meta = data["meta"]
    assert meta["version"] == logra_optim.__version__ and meta["torch"] == torch.__version__
    if tracked:
        changes = git_output(package, "status", "--porcelain", "--untracked-files=no").stdout.strip()
        assert meta["commit"] == git_output(package, "rev-parse", "HEAD").stdout.strip()
        assert meta["dirty"] == bool(changes)
    else:
        assert meta["commit"] is None and meta["dirty"] is None
    labels = [r["label"] for r in data["results"]]
    assert labels == [
        "adamw",
        "lora r=8",
        "galore r=8",
        "logra-sgd r=8",
        "logra-rowadam r=4",
        "logra-rowadam r=8",
        "logra-orthogonal r=8",
    ]
    by_label = {r["label"]: r for r in data["results"]}
    for r in data["results"]:
        # A model this small may never lift RSS above its post-import high-water mark: 0 is honest.
        assert r["peak_bytes"] >= 0 and r["step_s"] > 0
    # What each method trains: all parameters, the adapters, or LoGRA's target matrices.
    model = build_tiny_model(bench_preset("tiny"))
    assert by_label["adamw"]["trained_params"] == sum(p.numel() for p in model.parameters())
    targets = Shape.from_config(bench_preset("tiny")).target_params
    assert by_label["logra-sgd r=8"]["trained_params"] == targets
    assert "| adamw |" in (tmp_path / "bench.md").read_text()
    assert (tmp_path / "bench.png").read_bytes()[:8] == PNG_MAGIC
    if sys.platform.startswith("linux"):  # each CPU worker paged its code in before its baseline
        assert all(r["code_warmed"] for r in data["results"])
        assert all(isinstance(r["file_pages_paged_in_bytes"], int) for r in data["results"])

    config = write_config(tmp_path / "model", bench_preset("tiny"))

    def plan_against_the_bench(*options: str):
        common = ("--dtype", "fp32", "--batch", "2", "--seq", "64", "--no-checkpointing")
        return run_cli("plan", str(config), *common, *options, "--measured", str(tmp_path / "bench.json"))

    plan = plan_against_the_bench("--rank", "8")
    assert plan.returncode == 0, plan.stderr
    assert "measured peak" in plan.stdout and "predicted / measured" in plan.stdout
    assert "no logra-orthogonal row" not in plan.stdout  # the bench ran the default direction
    rowadam_plan = plan_against_the_bench("--rank", "4", "--direction", "rowadam")
    assert "no logra-rowadam row at rank 4" not in rowadam_plan.stdout  # --ranks 4 ran RowAdam
    sgd_plan = plan_against_the_bench("--rank", "4", "--direction", "sgd")
    assert "no logra-sgd row at rank 4" in sgd_plan.stdout
    foreach_plan = plan_against_the_bench("--rank", "8", "--adamw", "foreach")  # the bench stepped fused AdamW
    assert foreach_plan.returncode != 0 and "'adamw': ('fused', 'foreach')" in foreach_plan.stderr
    sharded_plan = plan_against_the_bench("--rank", "8", "--gpus", "2")  # a per-GPU share of another setup
    assert sharded_plan.returncode != 0 and "--gpus plans a setup" in sharded_plan.stderr
    config = write_config(tmp_path / "other", {**bench_preset("tiny"), "vocab_size": 512})  # another model
    other_plan = plan_against_the_bench("--rank", "8")
    assert other_plan.returncode != 0 and "'parameters': (" in other_plan.stderr


def test_source_revision_without_git_or_outside_a_checkout(monkeypatch, tmp_path):
    """No git on the path, or a copy of the package inside a repository (with a commit) that does
    not track it: no commit, no guess."""
    nothing = {"version": logra_optim.__version__, "torch": torch.__version__, "commit": None, "dirty": None}
    with monkeypatch.context() as patch:
        patch.setenv("PATH", str(tmp_path))  # an empty directory: git is not found
        assert measure.source_revision() == nothing
    repository = tmp_path / "repository"
    (repository / "logra_optim").mkdir(parents=True)
    (repository / "logra_optim" / "__init__.py").write_text("")
    git_output(tmp_path, "init", "-q", str(repository)).check_returncode()
    identity = ("-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false")
    git_output(repository, *identity, "commit", "-q", "--allow-empty", "-m", "init").check_returncode()
    monkeypatch.setattr(logra_optim, "__file__", str(repository / "logra_optim" / "__init__.py"))
    assert measure.source_revision() == nothing  # HEAD exists, but the package is not tracked there


def test_bench_peers_floor_and_accumulation(tmp_path):
    """APOLLO, APOLLO-Mini (rank 1 whatever --rank says), Flora and the frozen floor, with two
    microbatches per step, in workers whose glibc mmap threshold is fixed; each method's state and
    its peak above the floor plus that state."""
    methods = "adamw,apollo,apollo-mini,flora,frozen,logra-rowadam"
    data = run_tiny_bench(tmp_path, methods, "--accumulation", "2", "--malloc-threshold", "fixed", "--detail")
    labels = [r["label"] for r in data["results"]]
    assert labels == ["adamw", "apollo r=8", "apollo-mini r=1", "flora r=8", "frozen", "logra-rowadam r=8"]
    by_label = {r["label"]: r for r in data["results"]}
    model = build_tiny_model(bench_preset("tiny"))
    everything = sum(p.numel() for p in model.parameters())
    for label in ("adamw", "apollo r=8", "apollo-mini r=1", "flora r=8"):
        assert by_label[label]["trained_params"] == everything, label
    assert by_label["frozen"]["trained_params"] == 0
    assert data["meta"]["accumulation"] == 2 and "× 2 microbatches" in data["meta"]["title"]
    # Every worker ran with the threshold set (glibc reads it at start-up), and the run says so.
    assert data["meta"]["malloc_threshold"] == "fixed" and "mmap threshold fixed at 131072" in data["meta"]["title"]
    assert {r["malloc_mmap_threshold"] for r in data["results"]} == {str(128 * 1024)}
    # State: AdamW's two fp32 moments and a step count per parameter; LoGRA's fp32 sketch, first
    # moment and RowAdam's row second moment per target row (rank 8), a step count per target, and
    # the r×r fp32 Gram matrix of each projection (one per distinct input of a layer: q/k/v, o,
    # gate/up, down); the floor keeps none.
    assert by_label["adamw"]["state_bytes"] == 8 * everything + 4 * len(list(model.parameters()))
    targets = [module.weight for _, module in patched_modules(patch_model(model))]
    rows = sum(weight.shape[0] for weight in targets)
    grams = 4 * model.config.num_hidden_layers * 8 * 8 * 4
    assert by_label["logra-rowadam r=8"]["state_bytes"] == 4 * rows * (8 + 8 + 1) + 4 * len(targets) + grams
    assert by_label["frozen"]["state_bytes"] == 0
    floor, logra, adamw = (by_label[label] for label in ("frozen", "logra-rowadam r=8", "adamw"))
    share = (logra["peak_bytes"] - floor["peak_bytes"] - logra["state_bytes"]) / adamw["peak_bytes"]
    row = next(line for line in (tmp_path / "bench.md").read_text().splitlines() if line.startswith("| logra"))
    assert row.endswith(f"| {logra['state_bytes'] / 2**30:.3f} | {100 * share:.1f}% |")
    assert "| frozen |" in (tmp_path / "bench.md").read_text() and "| floor |" in (tmp_path / "bench.md").read_text()
    # --detail without KL control: the fastest step and the optimizer part, no probe column.
    assert "step s (min)" in (tmp_path / "bench.md").read_text()
    assert "probe" not in (tmp_path / "bench.md").read_text() and all(r["probe_s"] is None for r in data["results"])


@pytest.mark.parametrize("method", ["galore", "apollo"])
def test_state_bytes_counts_the_projectors_matrices(method):
    """GaLore and APOLLO keep their projection matrices in a projector object inside their state,
    not as tensors of it: the bench's state counts them too, each by the storage it keeps alive
    (GaLore's is a slice of its SVD's factor)."""
    from logra_optim.cli.bench import make_optimizer, method_available, state_bytes

    if method_available(method):
        pytest.skip(method_available(method))
    model, optimizer = make_optimizer(build_tiny_model(bench_preset("tiny")), method, 8)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    values = [value for state in optimizer.state.values() for value in state.values()]
    direct = sum(value.untyped_storage().nbytes() for value in values if isinstance(value, torch.Tensor))
    projectors = [value for value in values if not isinstance(value, torch.Tensor) and hasattr(value, "__dict__")]
    held = sum(
        t.untyped_storage().nbytes() for p in projectors for t in vars(p).values() if isinstance(t, torch.Tensor)
    )
    assert held > 0 and state_bytes(optimizer) == direct + held


@pytest.mark.parametrize("preset", ["core", "qwen2.5-1.5b", "moe-core"])
def test_the_warm_up_model_is_tiny_and_of_the_same_kind(preset):
    """A CPU worker pages its method's library code in on this model before its baseline: it must
    build, be small, and keep the benchmarked model's kind, attention grouping and experts."""
    from transformers import AutoConfig

    from logra_optim.cli.bench import build_model, warm_config

    settings = bench_preset(preset)
    config = AutoConfig.for_model(settings.pop("model_type", "qwen2"), **settings)
    warm = warm_config(config)
    model = build_model({}, "cpu", warm)
    assert type(model.config) is type(config) and warm.num_hidden_layers == 2
    assert sum(p.numel() for p in model.parameters()) < 1e6
    assert warm.vocab_size == 256 and warm.hidden_size == 16 * warm.num_attention_heads <= 128
    group = config.num_attention_heads // config.num_key_value_heads
    assert warm.num_attention_heads // warm.num_key_value_heads == group
    assert getattr(warm, "num_experts", None) == getattr(config, "num_experts", None)
    assert config.hidden_size > 128  # the benchmarked config is left as it was


def test_the_warm_up_handles_token_ids_past_its_vocabulary_and_ungrouped_heads():
    """Real configs carry token ids of their full vocabulary (Qwen2.5's pad id 151643), and some
    attend without grouping: the warm model must still build, and a worker must still run."""
    from transformers import AutoConfig

    from logra_optim.cli.bench import build_model, warm_config

    settings = bench_preset("tiny") | dict(num_key_value_heads=2, pad_token_id=151643, eos_token_id=151643)
    config = AutoConfig.for_model("qwen2", **settings)
    warm = warm_config(config)
    assert warm.num_attention_heads == warm.num_key_value_heads == 4
    assert warm.pad_token_id is None and warm.eos_token_id is None and config.pad_token_id == 151643
    build_model({}, "cpu", warm)


@pytest.mark.parametrize(
    ("vocabulary", "words", "top"), [(8192, "auto", 32), (8191, "auto", None), (300, 16, 8), (300, 200, 32)]
)
def test_the_warm_up_probe_reads_a_sample_of_words_where_the_run_does(vocabulary, words, top, tmp_path, monkeypatch):
    """The warm model's 256 words are below the threshold of probe_words="auto": where the run samples
    words, the warm-up must too, or the sample's kernels would be paged in during the measured steps."""
    from transformers import AutoConfig

    from logra_optim import probe
    from logra_optim.cli import bench

    path = tmp_path / "config.json"
    AutoConfig.for_model("qwen2", **(bench_preset("tiny") | dict(vocab_size=vocabulary))).to_json_file(path)
    calls = []
    sample = probe.sample_words
    monkeypatch.setattr(probe, "sample_words", lambda *a, **k: calls.append(a[1]) or sample(*a, **k))
    spec = dict(config=str(path), batch=2, seq=16, rank=8, method="logra-orthogonal", kl_budget=1e-3, probe_words=words)
    bench.warm_code_paths(spec)
    # The run's count, at most 64 (a quarter of the warm model's 256 words): half of it the top words.
    assert set(calls) == (set() if top is None else {top})


def test_bench_refuses_a_fixed_malloc_threshold_on_cuda(capsys, tmp_path, monkeypatch):
    from logra_optim.cli import bench

    monkeypatch.setattr(bench, "resolve_device", lambda device: "cuda")
    message = usage_error(capsys, "bench", "--malloc-threshold", "fixed", "--output", str(tmp_path))
    assert "--malloc-threshold fixed: CPU runs only" in message


def test_above_floor_subtracts_the_floor_and_each_state():
    from logra_optim.cli.bench import above_floor

    def result(method, peak, state=0):
        return {"label": method, "method": method, "peak_bytes": peak, "state_bytes": state}

    results = [result("adamw", 1000, 400), result("frozen", 300), result("logra-orthogonal", 360, 50)]
    assert above_floor(results) == {"adamw": 0.3, "logra-orthogonal": 0.01}
    assert above_floor(results[1:]) is None  # no dense AdamW to divide by
    assert above_floor([results[0], results[2]]) is None  # no floor


def test_rounds_rotate_and_paired_ratios_take_each_round_against_its_own():
    from logra_optim.cli.bench import paired_ratio, rotated

    configs = ["a", "b", "c"]
    orders = [rotated(configs, i) for i in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    # Over len(configs) rounds, every configuration runs once in every place.
    assert all(sorted(column) == configs for column in zip(*orders[:3]))
    # A machine twice as slow in the second round: the paired ratio sees 0.5 in both rounds, the
    # ratio of the overall medians (here, means of two) does not.
    method, reference = [1.0, 2.0], [2.0, 4.0]
    assert paired_ratio(method, reference) == 0.5
    assert paired_ratio([1.0, 4.0, 3.0], [2.0, 2.0, 2.0]) == 1.5  # the median of 0.5, 2 and 1.5
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])


def test_bench_rotates_its_rounds_and_tabulates_paired_ratios(tmp_path):
    data = run_tiny_bench(tmp_path, "adamw,frozen", "--rounds", "2", "--detail")
    assert data["meta"]["round_orders"] == [["adamw", "frozen"], ["frozen", "adamw"]]
    adamw, frozen = data["results"]
    # One timed step per round: each round's median is that round's step, in the order they ran.
    assert adamw["round_step_s"] == adamw["step_times_s"] and frozen["round_step_s"] == frozen["step_times_s"]
    assert len(adamw["round_step_s"]) == len(frozen["round_step_s"]) == 2
    paired = statistics.median(f / a for f, a in zip(frozen["round_step_s"], adamw["round_step_s"]))
    lines = (tmp_path / "bench.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| method"))
    column = [cell.strip() for cell in header.split("|")].index("paired time / AdamW")
    row = next(line for line in lines if line.startswith("| frozen"))
    assert [cell.strip() for cell in row.split("|")][column] == f"{paired:.2f}×"


def test_bench_of_lora_alone_from_a_config_and_plan_measured_against_it(tmp_path):
    """LoRA alone (whose parameter count includes its adapters) still gets a title and stored
    results; a run from ``--config`` records the layers it ran, so ``plan --measured`` can compare."""
    config = write_config(tmp_path / "model", {"model_type": "qwen2", **bench_preset("tiny")})
    result = run_cli(
        "bench", "--config", str(config), "--rank", "8", "--methods", "lora", "--rounds", "1", "--runs", "1",
        "--threads", "1", "--seq", "32", "--output", str(tmp_path / "out"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    model = build_tiny_model(bench_preset("tiny"))
    assert data["meta"]["layers"] == model.config.num_hidden_layers and data["meta"]["preset"] is None
    assert f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f} M params" in data["meta"]["title"]
    plan = run_cli(
        "plan", str(config), "--dtype", "fp32", "--batch", "2", "--seq", "32", "--no-checkpointing", "--rank", "8",
        "--measured", str(tmp_path / "out" / "bench.json"),
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    assert "measured peak" in plan.stdout


def test_probe_time_is_the_median_over_the_steps_that_probed():
    """A skipped update has no probe time; it neither counts nor hides the others'."""
    from logra_optim.cli.bench import median_probe_seconds

    assert median_probe_seconds([{"probe_s": [0.5, None, 0.9]}, {"probe_s": [0.6]}]) == 0.6
    assert median_probe_seconds([{"probe_s": [None, None]}, {"probe_s": [None]}]) is None  # no step probed


def test_bench_with_kl_control_and_a_bf16_probe(tmp_path, capsys):
    data = run_tiny_bench(tmp_path, "logra-rowadam", "--kl-budget", "1e-3", "--probe-dtype", "bfloat16")
    assert [r["label"] for r in data["results"]] == ["logra-rowadam r=8"]
    assert data["meta"]["kl_budget"] == 1e-3 and data["meta"]["probe_dtype"] == "bfloat16"
    message = usage_error(capsys, "bench", "--probe-dtype", "bfloat16", "--output", str(tmp_path / "no"))
    assert "--probe-dtype needs --kl-budget" in message
    message = usage_error(capsys, "bench", "--probe-positions", "8", "--output", str(tmp_path / "no"))
    assert "--probe-positions needs --kl-budget" in message
    message = usage_error(capsys, "bench", "--probe-words", "8", "--output", str(tmp_path / "no"))
    assert "--probe-words needs --kl-budget" in message
    message = usage_error(
        capsys, "bench", "--kl-budget", "1e-3", "--probe-words", "3", "--output", str(tmp_path / "no")
    )
    assert "expected auto, all or an integer of at least 4, got '3'" in message


def test_bench_with_kl_control_on_a_subset_of_positions_and_words(tmp_path):
    from logra_optim.cli.bench import make_optimizer

    data = run_tiny_bench(
        tmp_path,
        "adamw,logra-rowadam",
        "--kl-budget",
        "1e-3",
        "--probe-positions",
        "5",
        "--probe-words",
        "8",
        "--detail",
    )
    assert data["meta"]["probe_positions"] == 5 and data["meta"]["probe_words"] == 8
    # --detail: the probe's part of LoGRA's optimizer step (from its stats), none for AdamW.
    adamw, logra = data["results"]
    assert adamw["probe_s"] is None and 0 < logra["probe_s"] < logra["optimizer_s"]
    header, adamw_row, logra_row = (
        line for line in (tmp_path / "bench.md").read_text().splitlines() if line.startswith("| ")
    )
    column = header.split(" | ").index("of it probe s")
    assert adamw_row.split(" | ")[column] == "—" and logra_row.split(" | ")[column] == f"{logra['probe_s']:.3f}"
    _, optimizer = make_optimizer(
        build_tiny_model(bench_preset("tiny")), "logra-rowadam", 4, 1e-3, probe_positions=5, probe_words=8
    )
    assert optimizer.kl_control.options.probe_positions == 5
    assert optimizer.kl_control.options.probe_words == 8
    _, optimizer = make_optimizer(build_tiny_model(bench_preset("tiny")), "logra-rowadam", 4, 1e-3)
    assert optimizer.kl_control.options.probe_words == "auto"  # the optimizer's default
    assert build_parser().parse_args(["bench", "--probe-words", "all"]).probe_words is None  # every word


@pytest.mark.parametrize("method", ["apollo", "apollo-mini", "flora"])
def test_bench_peers_update_every_parameter(method):
    """A peer's step changes the weights it trains (targets and the rest alike)."""
    from logra_optim.cli.bench import make_optimizer

    model = build_tiny_model(bench_preset("tiny"))
    model, optimizer = make_optimizer(model, method, rank=4)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    input_ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight", "model.norm.weight"):
        assert not torch.equal(before[name], dict(model.named_parameters())[name]), name


def test_bench_frozen_floor_runs_backward_through_every_layer_without_weight_gradients():
    from logra_optim.cli.bench import make_optimizer

    model, optimizer = make_optimizer(build_tiny_model(bench_preset("tiny")), "frozen", rank=4)
    assert optimizer is None
    reached = []
    model.model.layers[0].register_full_backward_hook(lambda module, grad_in, grad_out: reached.append(module))
    input_ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    assert reached, "backward reached the first decoder layer"
    assert all(p.grad is None for p in model.parameters())


def run_tiny_bench(tmp_path, methods: str, *extra: str) -> dict:
    """``logra bench`` on the tiny preset at rank 8, one round of one timed step on one thread (the
    sequence length defaults to 32); returns ``bench.json``."""
    result = run_cli(
        "bench",
        "--preset",
        "tiny",
        "--rank",
        "8",
        "--methods",
        methods,
        "--rounds",
        "1",
        "--runs",
        "1",
        "--threads",
        "1",
        "--seq",
        "32",
        *extra,
        "--output",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((tmp_path / "bench.json").read_text())


# --------------------------------------------------------------------------------------------------
# plan's memory model against real models


def bench_preset(name: str) -> dict:
    return dict(PRESETS[name])


def build_tiny_model(config: dict, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(config)
    model_type = settings.pop("model_type", "qwen2")
    torch.manual_seed(0)
    built = AutoConfig.for_model(model_type, **settings, use_cache=False, attn_implementation="sdpa", **extra)
    model = AutoModelForCausalLM.from_config(built)
    if model_type == "qwen3_moe":
        model.config._experts_implementation = "eager"
    return model.train()


def write_config(directory, config: dict):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


SHAPES = [
    TINY_CONFIG,
    dict(
        hidden_size=128,
        intermediate_size=352,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=500,
        num_hidden_layers=3,
        tie_word_embeddings=True,
    ),
]
# A tiny Qwen3-MoE: 4 experts of width 48, 2 routed per token, in both layers.
MOE_CONFIG = dict(
    model_type="qwen3_moe",
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=48,
    num_experts=4,
    num_experts_per_tok=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=300,
    num_hidden_layers=2,
    tie_word_embeddings=False,
)
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def lora_model(config: dict, rank: int):
    """peft LoRA at ``rank`` on the targets of ``config``'s model (experts: ``target_parameters``)."""
    from peft import LoraConfig, get_peft_model

    moe = "num_experts" in config
    names = TARGET_NAMES[:4] if moe else TARGET_NAMES
    lora = LoraConfig(r=rank, target_modules=names, target_parameters=EXPERT_PARAMETERS if moe else None)
    return get_peft_model(build_tiny_model(config), lora)


@pytest.mark.parametrize("config", SHAPES)
def test_parameter_and_target_counts_match_the_real_model(config):
    from logra_optim import find_target_modules

    model = build_tiny_model(config)
    shape = Shape.from_config(config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    real_targets = [tuple(module.weight.shape) for _, module in find_target_modules(model)]
    assert sorted(real_targets) == sorted((d, k) for d, k, _ in shape.targets() * shape.layers)


@pytest.mark.parametrize(
    "kind", [dict(model_type="llama"), dict(model_type="llama", attention_bias=True), dict(model_type="qwen3")]
)
def test_parameter_counts_follow_each_family_s_attention_biases(kind):
    """Qwen2 adds biases to q/k/v by design; Llama and Qwen3 add them (to o too) only with
    ``attention_bias``."""
    config = {**TINY_CONFIG, **kind}
    model = build_tiny_model(config)
    assert Shape.from_config(config).params == sum(p.numel() for p in model.parameters())


def test_mixture_of_experts_counts_match_the_real_model():
    from logra_optim import LoGRAOptimizer, patch_model

    model = build_tiny_model(MOE_CONFIG)
    shape = Shape.from_config(MOE_CONFIG)
    assert (shape.experts, shape.expert_intermediate, shape.top_k) == (4, 48, 2)
    assert shape.params == sum(p.numel() for p in model.parameters())
    optimizer = LoGRAOptimizer(patch_model(model), rank=4)
    real = sorted((t.shape[0] // t.experts, t.shape[1], t.experts) for t in optimizer.targets)
    assert real == sorted(shape.targets() * shape.layers)
    assert shape.target_params == sum(t.weight.numel() for t in optimizer.targets)


@pytest.mark.parametrize("config", SHAPES + [MOE_CONFIG])
def test_logra_and_lora_state_match_the_real_optimizers(config):
    from logra_optim import LoGRAOptimizer, patch_model

    rank = 8
    setting = plan_module.Setting(rank=rank, dtype="fp32", batch=1, seq=8)
    shape = Shape.from_config(config)
    predicted = plan_module.breakdown(shape, "logra", setting)
    model = build_tiny_model(config)
    optimizer = LoGRAOptimizer(patch_model(model), rank=rank)
    assert predicted["sketches"] == sum(buffer.numel() * buffer.element_size() for buffer in optimizer.sketch_buffers())
    model(
        input_ids=torch.randint(0, config["vocab_size"], (1, 8)), labels=torch.randint(0, config["vocab_size"], (1, 8))
    )["loss"].backward()
    optimizer.step()  # the first moments exist from the first step
    moments = [optimizer.state[t.weight]["first_moment"] for t in optimizer.targets]
    assert predicted["first moments"] == sum(m.numel() * m.element_size() for m in moments)
    # The step size's Gram matrix A Aᵀ, kept per shared projection until A is redrawn.
    grams = {id(t.state.shared_projection): t.state.shared_projection.gram() for t in optimizer.targets}
    assert predicted["projection Grams"] == sum(g.numel() * g.element_size() for g in grams.values())
    without = plan_module.Setting(rank=rank, dtype="fp32", batch=1, seq=8, first_moment=False)
    assert "first moments" not in plan_module.breakdown(shape, "logra", without)
    assert set(optimizer.state[optimizer.targets[0].weight]) == {"step", "first_moment"}  # orthogonal: nothing per row
    assert "row statistics" not in predicted

    rowadam_model = build_tiny_model(config)
    rowadam = LoGRAOptimizer(patch_model(rowadam_model), rank=rank, direction="rowadam")
    rowadam_model(
        input_ids=torch.randint(0, config["vocab_size"], (1, 8)), labels=torch.randint(0, config["vocab_size"], (1, 8))
    )["loss"].backward()
    rowadam.step()
    rows = [rowadam.state[t.weight]["row_second_moment"] for t in rowadam.targets]
    with_rows = plan_module.breakdown(
        shape, "logra", plan_module.Setting(rank=rank, dtype="fp32", batch=1, seq=8, direction="rowadam")
    )
    assert with_rows["row statistics"] == sum(m.numel() * m.element_size() for m in rows)

    lora = lora_model(config, rank)
    adapters = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert plan_module.breakdown(shape, "lora", setting)["adapters + gradients + moments"] == 16 * adapters


def test_plan_shards_only_fully_sharded_runs_and_its_peak_takes_the_larger_phase():
    """DDP (``--replicated``) keeps whole weights, gradients and AdamW state on every GPU; FSDP/ZeRO-3
    divides them by the GPU count. Checkpointing keeps every layer's input and one layer's full set.
    The peak is what persists plus the larger of the backward's and the step's transients."""
    shape = Shape.from_config(SHAPES[0])
    replicated = plan_module.breakdown(shape, "adamw", plan_module.Setting(gpus=4, sharded=False, dtype="fp32"))
    sharded = plan_module.breakdown(shape, "adamw", plan_module.Setting(gpus=4, sharded=True, dtype="fp32"))
    assert replicated["weights"] == 4 * shape.params == 4 * sharded["weights"]
    assert replicated["optimizer state"] == 8 * shape.params == 4 * sharded["optimizer state"]

    setting = plan_module.Setting(rank=8, dtype="fp32", batch=1, seq=8)
    every_layer = plan_module.breakdown(shape, "logra", dataclasses.replace(setting, checkpointing=False))
    per_layer = every_layer["activations"] / (4 * setting.tokens * shape.layers)
    checkpointed = plan_module.breakdown(shape, "logra", setting)["activations"]
    assert checkpointed == 4 * setting.tokens * (shape.layers * shape.hidden + per_layer)

    step_heavy = {"weights": 1.0, "activations": 2.0, "logits": 1.0, "gradients": 5.0}
    backward_heavy = {"weights": 1.0, "activations": 2.0, "logits": 4.0, "gradients": 5.0}
    assert plan_module.peak(step_heavy) == 1.0 + 5.0
    assert plan_module.peak(backward_heavy) == 1.0 + 6.0


def saved_activation_bytes(model, input_ids) -> int:
    """Bytes autograd keeps for backward in one forward, excluding the parameters themselves, each
    storage counted once (views of one tensor share it)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=input_ids, labels=input_ids)
    return sum(storages.values())


@pytest.mark.parametrize("config", SHAPES + [MOE_CONFIG])
@pytest.mark.parametrize("method", plan_module.METHODS)
def test_activation_model_matches_what_autograd_saves(config, method):
    """The activation counts of ``plan`` (plus the fp32 log-softmax the loss keeps) are within 10%
    of the bytes autograd really saves for dense training, LoRA and LoGRA (mixture of experts too)."""
    from logra_optim import LoGRAOptimizer, patch_model

    rank, batch, seq = 8, 2, 48
    model = build_tiny_model(config)
    if method == "logra":
        optimizer = LoGRAOptimizer(patch_model(model), rank=rank)  # noqa: F841  (a released optimizer unbinds)
    elif method == "lora":
        model = lora_model(config, rank)
    input_ids = torch.randint(0, config["vocab_size"], (batch, seq))
    measured = saved_activation_bytes(model, input_ids)
    setting = plan_module.Setting(rank=rank, dtype="fp32", batch=batch, seq=seq, checkpointing=False)
    predicted = plan_module.breakdown(Shape.from_config(config), method, setting)
    predicted_saved = predicted["activations"] + 4 * config["vocab_size"] * batch * seq
    assert predicted_saved == pytest.approx(measured, rel=0.10)


def test_expert_rank_state_matches_the_real_optimizer():
    """With a rank of their own for the experts, plan's sketches are the bytes the optimizer holds
    and its projections the largest one it generates (twice: the most held at once)."""
    from logra_optim import LoGRAOptimizer, patch_model

    setting = plan_module.Setting(rank=8, expert_rank=4, dtype="fp32", batch=1, seq=8)
    predicted = plan_module.breakdown(Shape.from_config(MOE_CONFIG), "logra", setting)
    optimizer = LoGRAOptimizer(patch_model(build_tiny_model(MOE_CONFIG)), rank=8, expert_rank=4)
    assert predicted["sketches"] == sum(buffer.numel() * buffer.element_size() for buffer in optimizer.sketch_buffers())
    # A is generated where it is used, never kept: two of the largest at once at most.
    largest = max(t.state.shared_projection.spec.nbytes() for t in optimizer.targets)
    assert predicted["projections (transient)"] == 2 * largest


class _LargestOutput(TorchDispatchMode):
    """The most bytes any single operation returns in new storage (not one of its inputs')."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = lambda tree: [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]  # noqa: E731
        inputs = {t.untyped_storage().data_ptr() for t in tensors((args, kwargs or {}))}
        out = func(*args, **(kwargs or {}))
        new = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors(out)}
        self.largest = max(self.largest, sum(n for ptr, n in new.items() if ptr not in inputs))
        return out


@pytest.mark.parametrize("adamw", plan_module.ADAMW_STEPS)
def test_plan_counts_the_temporary_of_the_adamw_step_it_models(adamw):
    """``--adamw fused`` (Trainer's default) updates in place; ``foreach`` builds one fp32
    parameter-sized temporary in one call: what ``plan`` counts for each, measured on torch's step."""
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((64, 32), (32,), (16, 64))]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = torch.optim.AdamW(params, **{adamw: True})
    optimizer.step()  # the moments exist from here on
    with _LargestOutput() as mode:
        optimizer.step()
    count = sum(p.numel() for p in params)
    shape = Shape.from_config(TINY_CONFIG)
    parts = plan_module.breakdown(shape, "adamw", plan_module.Setting(dtype="fp32", adamw=adamw))
    assert mode.largest / (4 * count) == parts.get("optimizer step temporaries", 0) / (4 * shape.params)
    with pytest.raises(ValueError, match="adamw must be one of"):
        plan_module.breakdown(shape, "adamw", plan_module.Setting(adamw="sgd"))


def test_bench_reads_and_sets_every_kind_of_expert_count(tmp_path):
    """DeepSeek configs count their experts as ``n_routed_experts`` (Mixtral ``num_local_experts``):
    ``--experts`` sets that key, as plan reads it; a dense config is refused by name."""
    from transformers import DeepseekV3Config, MixtralConfig

    from logra_optim.cli.bench import model_config
    from logra_optim.cli.shapes import expert_count

    for config, key in ((DeepseekV3Config, "n_routed_experts"), (MixtralConfig, "num_local_experts")):
        directory = tmp_path / key
        groups = {"n_group": 1, "topk_group": 1} if key == "n_routed_experts" else {}
        config(**{key: 8}, **groups, num_experts_per_tok=2, hidden_size=32, num_hidden_layers=1).save_pretrained(
            directory
        )
        assert expert_count(model_config({"config": str(directory), "seq": 16}))[1] == 8
        assert getattr(model_config({"config": str(directory), "experts": 4, "seq": 16}), key) == 4
    grouped = tmp_path / "grouped"  # DeepSeek routes within n_group groups of experts
    DeepseekV3Config(n_routed_experts=16, n_group=4, topk_group=2, hidden_size=32, num_hidden_layers=1).save_pretrained(
        grouped
    )
    for experts in (6, 4):  # not a multiple; one expert per group
        with pytest.raises(ValueError, match=rf"--experts {experts}: must be a multiple of the config's n_group \(4\)"):
            model_config({"config": str(grouped), "experts": experts, "seq": 16})
    from transformers import AutoModelForCausalLM

    config = model_config({"config": str(grouped), "experts": 8, "seq": 16})
    model = AutoModelForCausalLM.from_config(config)
    model(input_ids=torch.randint(0, config.vocab_size, (1, 6)))  # the router of 4 groups of 2 runs
    dense = write_config(tmp_path / "dense", {**bench_preset("tiny"), "model_type": "qwen2"})
    with pytest.raises(ValueError, match="--experts 4: the model has no mixture-of-experts blocks"):
        model_config({"config": str(dense), "experts": 4, "seq": 16})


def test_plan_answers_the_moe_question(tmp_path):
    """Qwen3-30B-A3B on 8 sharded 80 GB GPUs: the table prints for all three methods with the
    experts' own rank, and dense AdamW fits there too (it does not at 4). MoE configs with parts the
    model does not count (shared experts) are refused."""
    result = run_cli("plan", "qwen3-30b-a3b", "--gpus", "8", "--rank", "256", "--expert-rank", "32")
    assert result.returncode == 0, result.stderr
    assert "30.53 B parameters" in result.stdout and "experts rank 32" in result.stdout
    fits = next(line for line in result.stdout.splitlines() if "fits 80 GiB" in line)
    assert [cell.strip() for cell in fits.split("│")[2:5]] == ["yes", "yes", "yes"]
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        Shape.from_config({**MOE_CONFIG, "shared_expert_intermediate_size": 64})
    result = run_cli("plan", "qwen3-30b-a3b", "--gpus", "4", "--rank", "256", "--expert-rank", "32")
    fits = next(line for line in result.stdout.splitlines() if "fits 80 GiB" in line)
    assert [cell.strip() for cell in fits.split("│")[2:5]] == ["no", "yes", "yes"]


def test_plan_answers_the_27b_question(tmp_path):
    """A 27B-class config on 4 sharded 80 GB GPUs: the table prints, and dense AdamW does not fit."""
    config = Path(__file__).parents[1] / "benchmarks" / "configs" / "dense-27b-class.json"  # docs/benchmarks.md
    for adamw in plan_module.ADAMW_STEPS:
        result = run_cli("plan", str(config), "--gpus", "4", "--rank", "256", "--adamw", adamw)
        assert result.returncode == 0, result.stderr
        assert "24.35 B parameters" in result.stdout
        fits = next(line for line in result.stdout.splitlines() if "fits 80 GiB" in line)
        assert [cell.strip() for cell in fits.split("│")[2:5]] == ["no", "yes", "yes"]


def test_plan_bad_config_names_what_is_missing(tmp_path, capsys):
    write_config(tmp_path, {"hidden_size": 64})
    assert main(["plan", str(tmp_path)]) == 1
    assert "intermediate_size" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "missing")]) == 1
    assert "no config.json" in capsys.readouterr().err
    write_config(tmp_path, TINY_CONFIG)
    assert "exceeds the smallest dimension" in usage_error(capsys, "plan", str(tmp_path), "--rank", "500")
    (tmp_path / "config.json").write_text("[1, 2]")
    assert main(["plan", str(tmp_path)]) == 1
    assert "holds one JSON object, got a list" in capsys.readouterr().err
    write_config(tmp_path, {**TINY_CONFIG, "intermediate_size": [96, 96]})
    assert main(["plan", str(tmp_path)]) == 1
    assert "intermediate must be a positive integer" in capsys.readouterr().err
    for key, value, message in (
        ("num_experts_per_tok", 9, "num_experts_per_tok 9 must be in 1…4"),
        ("num_experts_per_tok", 0, "num_experts_per_tok 0 must be in 1…4"),
        ("num_attention_heads", 0, "num_attention_heads must be a positive integer"),
        ("vocab_size", 0, "vocab must be a positive integer"),
        ("text_config", "llama", "text_config must be a JSON object"),
    ):
        write_config(tmp_path, {**MOE_CONFIG, key: value})
        assert main(["plan", str(tmp_path)]) == 1
        assert message in capsys.readouterr().err


def test_plan_checks_the_rank_and_the_expert_rank_against_their_own_targets(capsys, tmp_path):
    """As the optimizer takes them: ``--rank`` on the linear targets (k/v 32 wide here),
    ``--expert-rank`` (default: ``--rank``) on the experts (16 wide here)."""
    write_config(tmp_path, {**MOE_CONFIG, "moe_intermediate_size": 16})
    assert main(["plan", str(tmp_path), "--rank", "32", "--expert-rank", "8"]) == 0
    capsys.readouterr()
    assert "--rank 32 exceeds the smallest dimension (16)" in usage_error(capsys, "plan", str(tmp_path), "--rank", "32")
    assert "--rank 40 exceeds the smallest dimension (32)" in usage_error(
        capsys, "plan", str(tmp_path), "--rank", "40", "--expert-rank", "8"
    )
    assert "--expert-rank 20 exceeds" in usage_error(
        capsys, "plan", str(tmp_path), "--rank", "8", "--expert-rank", "20"
    )


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
