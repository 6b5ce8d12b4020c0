"""``logra demo``'s memory-efficient peers, GaLore and APOLLO-Mini, trained by the demo's own worker
(a real TRL ``GRPOTrainer``, the tiny policy, 3 updates): each trains every parameter with its own
optimizer at the learning rate given, its low-rank rule on exactly LoGRA's target matrices; and the
options that choose them."""

from __future__ import annotations

import argparse
import io
from dataclasses import asdict

import pytest
import torch

from logra_optim import find_target_modules
from logra_optim.cli import demo
from tests.test_cli import usage_error

GALORE_LR, APOLLO_MINI_LR = 3e-3, 5e-4


@pytest.fixture(scope="module")
def warm_settings(tmp_path_factory):
    """Settings for 3 updates of the tiny policy, its warm start (20 supervised steps) prepared."""
    from rich.console import Console

    settings = demo.DemoSettings(
        output=str(tmp_path_factory.mktemp("demo")),
        policy="tiny",
        steps=3,
        eval_every=0,
        warm_start_steps=20,
        methods=["galore", "apollo-mini"],
        galore_lr=GALORE_LR,
        apollo_mini_lr=APOLLO_MINI_LR,
        device="cpu",
    )
    demo.prepare_warm_starts(settings, "cpu", Console(file=io.StringIO()))
    return settings


def run_observed(monkeypatch, settings: dict, method: str) -> tuple[dict, dict]:
    """The demo worker's record for ``method`` (seed 0), and what its trainer looked like: ``seen``
    holds the ``trainer`` and every parameter ``before`` training."""
    import trl

    seen = {}
    train = trl.GRPOTrainer.train

    def observed_train(trainer, *args, **kwargs):
        seen["before"] = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        seen["trainer"] = trainer
        return train(trainer, *args, **kwargs)

    monkeypatch.setattr(trl.GRPOTrainer, "train", observed_train)
    return demo.run_worker({"settings": settings, "method": method, "seed": 0}), seen


@pytest.mark.parametrize(
    "method, module, rank, lr",
    [("galore", "galore_torch", 32, GALORE_LR), ("apollo-mini", "apollo_torch", 1, APOLLO_MINI_LR)],
)
def test_demo_worker_trains_the_low_rank_peers(warm_settings, monkeypatch, method, module, rank, lr):
    record, seen = run_observed(monkeypatch, asdict(warm_settings), method)
    trainer = seen["trainer"]
    optimizer = trainer.optimizer.optimizer  # accelerate's wrapper around the one the worker passed
    assert type(optimizer).__module__.startswith(module + ".")
    assert record["optimizer"] == f"{type(optimizer).__module__}.AdamW"
    # TRL built its constant scheduler around the given optimizer: every group trained at the rate given.
    assert trainer.lr_scheduler.get_last_lr() == [lr, lr]
    assert [group["lr"] for group in optimizer.param_groups] == [lr, lr] and record["learning_rates"] == [lr]
    assert [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry] == [lr] * 3
    # The low-rank rule on exactly LoGRA's target matrices; plain AdamW on the rest: every parameter.
    model = trainer.model
    targets = find_target_modules(model)
    regular, projected = optimizer.param_groups
    assert {id(p) for p in projected["params"]} == {id(m.weight) for _, m in targets}
    assert projected["rank"] == rank and "rank" not in regular
    assert record["trained_params"] == sum(p.numel() for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())
    parameters = dict(model.named_parameters())
    for name, _ in targets:
        assert not torch.equal(seen["before"][f"{name}.weight"], parameters[f"{name}.weight"]), name
    assert not torch.equal(seen["before"]["model.norm.weight"], parameters["model.norm.weight"])
    assert record["method"] == method and len(record["train_rewards"]) == 3 and len(record["kl_per_update"]) == 3


def test_peers_are_opt_in_with_their_own_learning_rates(tmp_path):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--output", str(tmp_path)])
    settings = demo.settings_from(args, parser)
    assert settings.methods == list(demo.DEFAULT_METHODS) and "galore" not in settings.methods
    rates = demo.POLICY_RATES["medium"]
    assert (settings.galore_lr, settings.apollo_mini_lr) == (rates.galore, rates.apollo_mini)
    argv = ["--methods", "galore,apollo-mini", "--galore-lr", "1e-3", "--apollo-mini-lr", "2e-4", "--output", "x"]
    settings = demo.settings_from(parser.parse_args(argv), parser)
    assert settings.methods == ["galore", "apollo-mini"]
    assert (settings.learning_rate("galore"), settings.learning_rate("apollo-mini")) == (1e-3, 2e-4)
    assert settings.learning_rate("adamw") == rates.adamw and settings.learning_rate("lora") == rates.lora


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--methods", "logra,apollo"], "--methods"),
        (["--galore-lr", "0"], "--galore-lr"),
        (["--apollo-mini-lr", "-1e-4"], "--apollo-mini-lr"),
        (["--apollo-mini-lr", "inf"], "--apollo-mini-lr"),
        (["--probe-samples", "25"], "--probe-samples must be ≤ 24"),  # the KL meter needs 8 other rows
        (["--probe-samples", "0"], "--probe-samples"),
        (["--probe-dtype", "float16"], "--probe-dtype"),
        (["--peer-proj-gap", "0"], "--peer-proj-gap"),
    ],
)
def test_bad_peer_options_name_the_option(capsys, tmp_path, argv, expected):
    assert expected in usage_error(capsys, "demo", *argv, "--output", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_summaries_table_and_plots_take_the_peers(tmp_path):
    """The demo's summary, table and plots, and the learning benchmark's table, name the peers, in
    ``METHODS``' order, whatever order the runs came in."""
    from tests.helpers.scripts import load_script

    def record(method, seed):
        evaluation = {"reward": 0.5, "accuracy": 0.25}
        return {
            "method": method,
            "seed": seed,
            "before": evaluation,
            "after": evaluation,
            "train_rewards": [0.25, 0.5, 0.75],
            "evaluations": [[0, 0.5], [3, 0.5]],
            "kl_per_update": [1e-3, 2e-3, 3e-3],
            "peak_bytes": 2**20 * (2 if method == "adamw" else 1),
            "seconds_per_update": 0.1,
            "trained_params": 100,
        }

    records = [record(method, seed) for seed in (0, 1) for method in ("apollo-mini", "galore", "adamw")]
    rows = demo.summarize(records)
    assert [row["method"] for row in rows] == ["adamw", "galore", "apollo-mini"]
    headers, cells = demo.table_rows(rows)
    assert [cell[0] for cell in cells] == ["dense AdamW", "GaLore", "APOLLO-Mini"]
    assert cells[1][headers.index("memory / AdamW")] == "0.50×"
    # The KL column: the median over a run's updates and, in brackets, their 95th percentile.
    assert cells[0][headers.index("KL/update (p95)")] == "2.0e-03 (2.9e-03)"
    assert [path.name for path in demo.plot(records, rows, tmp_path)] == ["reward.png", "memory.png"]
    best = {"knob": "lr", "value": 1e-3, "seeds": [0], "failed_seeds": [], "auc": 0.5, "auc_std": 0.0}
    best |= dict.fromkeys(("final", "greedy_after", "kl_measured", "train_seconds"), 0.5)
    entries = {method: {"best": best, "sweep": [best]} for method in ("galore", "apollo-mini")}
    labels = [row[0] for row in load_script("bench_learning").table_rows({"methods": entries})]
    assert labels == ["GaLore", "APOLLO-Mini"]


@pytest.mark.parametrize("method, rank", [("galore", 32), ("apollo-mini", 1)])
def test_peer_scope_targets_trains_only_logra_targets(method, rank):
    """``--peer-scope targets``: the same trained set as LoGRA (everything else frozen), the low-rank
    rule on all of it, no AdamW group left over."""
    from logra_optim.cli.peers import low_rank_optimizer
    from tests.helpers.tiny import tiny_qwen2

    model = demo.prepare_model(tiny_qwen2(), method, rank=32, peer_scope="targets")
    targets = {id(module.weight) for _, module in find_target_modules(model)}
    assert {id(p) for p in model.parameters() if p.requires_grad} == targets
    optimizer = low_rank_optimizer(model, method, 32, lr=1e-3)
    (group,) = optimizer.param_groups
    assert {id(p) for p in group["params"]} == targets and group["rank"] == rank


@pytest.mark.parametrize("method", ["galore", "apollo-mini"])
def test_the_peers_refresh_their_projection_at_the_gap_asked_for(method):
    """``proj_gap`` (``--peer-proj-gap``) reaches the package's projector, which then refreshes on
    that schedule: with a gap of 2 the first two steps share a projection and the third draws
    another; with the READMEs' 200 it stays. Bad gaps are refused by name, in the settings and on the command line."""
    from logra_optim.cli.peers import low_rank_optimizer
    from tests.helpers.tiny import tiny_qwen2

    def projections(gap):
        torch.manual_seed(0)
        model = demo.prepare_model(tiny_qwen2(), method, rank=8, peer_scope="targets")
        optimizer = low_rank_optimizer(model, method, 8, gap, lr=1e-3)
        (group,) = optimizer.param_groups
        assert group["update_proj_gap"] == (200 if gap is None else gap)
        weight = group["params"][0]
        seen = []
        for _ in range(3):
            for param in group["params"]:
                param.grad = torch.randn_like(param)
            optimizer.step()
            projector = optimizer.state[weight]["projector"]
            seen.append(projector.ortho_matrix.clone())
        return seen

    refreshed, kept = projections(2), projections(None)
    assert not torch.equal(refreshed[1], refreshed[2]) and torch.equal(refreshed[0], refreshed[1])
    assert torch.equal(kept[0], kept[2])
    with pytest.raises(ValueError, match="proj_gap must be a positive integer"):
        low_rank_optimizer(tiny_qwen2(), method, 8, 0, lr=1e-3)
    with pytest.raises(ValueError, match="peer_proj_gap must be a positive integer"):
        demo.DemoSettings(output="unused", peer_proj_gap=0)


def test_a_bad_peer_scope_is_refused_by_name(capsys, tmp_path):
    with pytest.raises(ValueError, match="peer_scope must be one of all, targets, got 'some'"):
        demo.DemoSettings(output=str(tmp_path), peer_scope="some")
    assert "--peer-scope" in usage_error(capsys, "demo", "--peer-scope", "some", "--output", str(tmp_path / "out"))


def test_a_peer_without_trainable_targets_is_refused_by_name():
    from logra_optim.cli.peers import low_rank_optimizer
    from tests.helpers.tiny import tiny_qwen2

    model = tiny_qwen2().requires_grad_(False)
    model.lm_head.requires_grad_(True)
    with pytest.raises(ValueError, match="galore: the model has no trainable weight of LoGRA's target matrices"):
        low_rank_optimizer(model, "galore", 32, lr=1e-3)


@pytest.mark.parametrize("rate", [None, 2e-3])
def test_demo_worker_trains_logras_non_targets_with_adamw_on_request(warm_settings, monkeypatch, rate):
    """``logra_non_target_lr``: LoGRA on its targets and AdamW at that rate on every other parameter
    (embeddings, norms), through ``non_target_optimizer``; unset, the rest stays frozen bit for bit."""
    from logra_optim import LoGRAOptimizer

    record, seen = run_observed(monkeypatch, asdict(warm_settings) | {"logra_non_target_lr": rate}, "logra")
    trainer = seen["trainer"]
    optimizer = trainer.optimizer.optimizer
    assert isinstance(optimizer, LoGRAOptimizer)
    model = trainer.model
    targets = {f"{name}.weight" for name, _ in find_target_modules(model)}
    parameters = dict(model.named_parameters())
    others = [name for name in parameters if name not in targets]
    assert others and "model.embed_tokens.weight" in others
    for name in targets:
        assert not torch.equal(seen["before"][name], parameters[name]), name
    if rate is None:
        assert optimizer.non_target_optimizer is None
        assert all(torch.equal(seen["before"][name], parameters[name]) for name in others)
        assert record["trained_params"] == sum(parameters[name].numel() for name in targets)
        return
    inner = optimizer.non_target_optimizer
    assert type(inner) is torch.optim.AdamW and [group["lr"] for group in inner.param_groups] == [rate]
    assert rate in record["learning_rates"]
    assert {id(p) for p in inner.param_groups[0]["params"]} == {id(parameters[name]) for name in others}
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        assert not torch.equal(seen["before"][name], parameters[name]), name
    assert record["trained_params"] == sum(p.numel() for p in model.parameters())


def test_a_bad_logra_non_target_rate_is_refused_by_name(capsys, tmp_path):
    for rate in (0.0, -1e-3, float("nan")):
        with pytest.raises(ValueError, match="logra_non_target_lr must be a positive finite learning rate"):
            demo.DemoSettings(output=str(tmp_path), logra_non_target_lr=rate)
    with pytest.raises(ValueError, match="logra_non_target_lr cannot be combined with realised_kl_check"):
        demo.DemoSettings(output=str(tmp_path), logra_non_target_lr=1e-3, realised_kl_check=True)
    for argv in (["--logra-non-target-lr", "0"], ["--methods", "adamw,lora", "--logra-non-target-lr", "1e-3"]):
        assert "--logra-non-target-lr" in usage_error(capsys, "demo", *argv, "--output", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_demo_worker_runs_logra_with_the_direction_asked_for(warm_settings, monkeypatch):
    """``--direction orthogonal`` reaches the optimizer: its param group, and directions with unit
    singular values in its first update; a bad value is refused by name."""
    from logra_optim import updates

    calls = []
    original = updates.orthogonal_directions
    monkeypatch.setattr(
        updates,
        "orthogonal_directions",
        lambda numerators, *args: calls.extend(n.shape for n in numerators) or original(numerators, *args),
    )
    record, seen = run_observed(monkeypatch, asdict(warm_settings) | {"direction": "orthogonal"}, "logra")
    optimizer = seen["trainer"].optimizer.optimizer
    assert optimizer.param_groups[0]["direction"] == "orthogonal"
    assert len(calls) == 3 * len(optimizer.targets)  # every target, every one of the 3 updates
    with pytest.raises(ValueError, match="direction must be one of rowadam, orthogonal, sgd"):
        demo.DemoSettings(output="", direction="muon")


@pytest.mark.parametrize("choice, dtype", [("auto", None), ("float32", None), ("bfloat16", torch.bfloat16)])
def test_demo_worker_probes_in_the_dtype_asked_for(warm_settings, monkeypatch, tmp_path, choice, dtype):
    """``--probe-dtype``: float32 is the weights' own precision (no low-precision products), bfloat16
    the probe's bf16 products, auto fp32 on a CPU whatever its instructions (bf16 on CUDA GPUs); the
    record says which ran, and a bad value is refused by name."""
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert demo.settings_from(parser.parse_args(["--output", str(tmp_path)]), parser).probe_dtype == "auto"
    argv = ["--probe-dtype", choice, "--output", str(tmp_path)]
    assert demo.settings_from(parser.parse_args(argv), parser).probe_dtype == choice
    record, seen = run_observed(monkeypatch, asdict(warm_settings) | {"probe_dtype": choice}, "logra")
    optimizer = seen["trainer"].optimizer.optimizer
    assert optimizer.kl_control.options.probe_dtype is dtype
    assert record["probe_dtype"] == (None if dtype is None else "bfloat16")
    assert all(stats > 0 for stats in record["logra_stats"]["logra/probe_seconds"])
    with pytest.raises(ValueError, match="probe_dtype must be one of auto, float32, bfloat16 or None"):
        demo.DemoSettings(output="", probe_dtype="float16")


def test_auto_probe_dtype_is_bf16_on_native_bf16_gpus_only(monkeypatch):
    """``auto``: fp32 on every CPU (bf16 instructions or not), bf16 on a CUDA device that computes it
    natively, fp32 on one that would emulate it; bf16 is refused beside the realised-KL check."""
    from logra_optim.cli.measure import auto_probe_dtype

    assert auto_probe_dtype("cpu") is None
    for native, expected in ((True, "bfloat16"), (False, None)):
        asked = []
        monkeypatch.setattr(
            torch.cuda,
            "is_bf16_supported",
            lambda including_emulation=True: asked.append(including_emulation) or native,
        )
        assert auto_probe_dtype("cuda:1") == expected and asked == [False]
    with pytest.raises(ValueError, match="probe_dtype='bfloat16' cannot be combined with realised_kl_check"):
        demo.DemoSettings(output="", probe_dtype="bfloat16", realised_kl_check=True)
    assert demo.DemoSettings(output="", realised_kl_check=True).probe_dtype == "auto"


def test_auto_probe_dtype_stays_fp32_under_the_realised_kl_check(warm_settings, monkeypatch):
    """On a machine where ``auto`` would choose bf16 (here: told so), a run with the realised-KL
    check probes in fp32, which the check needs, instead of failing in the optimizer."""
    monkeypatch.setattr(demo, "auto_probe_dtype", lambda device: "bfloat16")
    record, seen = run_observed(monkeypatch, asdict(warm_settings) | {"realised_kl_check": True}, "logra")
    assert seen["trainer"].optimizer.optimizer.kl_control.options.probe_dtype is None
    assert record["probe_dtype"] is None
    record, seen = run_observed(monkeypatch, asdict(warm_settings), "logra")
    assert seen["trainer"].optimizer.optimizer.kl_control.options.probe_dtype is torch.bfloat16


@pytest.mark.parametrize("method", ["logra", "adamw"])
def test_demo_worker_accumulates_microbatches_into_one_update(warm_settings, monkeypatch, tmp_path, method):
    """``--accumulation 2``: every update trains on two microbatches (two forward+backward passes of
    TRL's trainer) before one optimizer step, and the run still makes ``steps`` updates."""
    import trl

    passes = []
    training_step = trl.GRPOTrainer.training_step
    monkeypatch.setattr(
        trl.GRPOTrainer, "training_step", lambda self, *a, **k: passes.append(1) or training_step(self, *a, **k)
    )
    record, seen = run_observed(monkeypatch, asdict(warm_settings) | {"accumulation": 2}, method)
    trainer = seen["trainer"]
    assert trainer.args.gradient_accumulation_steps == 2 and trainer.state.global_step == warm_settings.steps
    assert len(passes) == 2 * warm_settings.steps
    assert len(record["train_rewards"]) == warm_settings.steps
    if method == "logra":  # one probe, so one LoGRA update, per optimizer step
        assert len(record["logra_stats"]["logra/probe_seconds"]) == warm_settings.steps
    changed = [not torch.equal(p, seen["before"][name]) for name, p in trainer.model.named_parameters()]
    assert any(changed)
