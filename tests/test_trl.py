"""The TRL adapter with the real trainers: ``GRPOTrainer`` and ``RLOOTrainer`` (trl 1.16) on the CPU,
a tiny Qwen2, a tokenizer built in memory and a verifiable toy reward (see ``tests/helpers/trl_setup.py``).

What is checked: training runs with LoGRA and changes exactly the target weights; no target ever
has a ``.grad``; LoGRA's statistics reach ``trainer.state.log_history``; a checkpoint resumes
bit-identically; saved models load in plain transformers; GRPO learns the toy task; the mismatch
``κ`` flows from GRPO batches into the step control; bad input fails clearly; the examples run.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments
from trl import GRPOTrainer

from logra_optim import LoGRAOptimizer, patched_modules
from logra_optim.integrations.trl import LoGRACallback, attach_logra
from tests.helpers import trl_setup as setup

REPO = Path(__file__).resolve().parents[1]
LOGGED_KEYS = ("logra/alpha", "logra/predicted_kl", "logra/kl_budget", "logra/mismatch")
TARGET_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def logra_optimizer(trainer) -> LoGRAOptimizer:
    """The LoGRAOptimizer inside the trainer's (accelerate-wrapped) optimizer."""
    optimizer = trainer.optimizer
    while not isinstance(optimizer, LoGRAOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def quiet_attach(trainer, **kwargs) -> LoGRACallback:
    """attach_logra without the expected max_grad_norm warning (tested on its own below)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="attach_logra: max_grad_norm")
        return attach_logra(trainer, **{**setup.LOGRA_KWARGS, **kwargs})


class GradWatch(TrainerCallback):
    """Records, at every point a callback can see during training, any target weight that has a
    ``.grad`` or requires grad, and any frozen parameter that acquired a gradient."""

    def __init__(self):
        self.checks = 0
        self.violations: list[str] = []

    def _check(self, event: str, model) -> None:
        targets = patched_modules(model)
        if not targets:
            self.violations.append(f"{event}: model not patched")
            return
        for name, module in targets:
            if module.weight.grad is not None:
                self.violations.append(f"{event}: {name}.weight.grad exists")
            if module.weight.requires_grad:
                self.violations.append(f"{event}: {name}.weight requires grad")
        for name, param in model.named_parameters():
            if param.grad is not None or param.requires_grad:
                self.violations.append(f"{event}: {name} has a grad or requires grad")
        self.checks += 1

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._check("on_step_begin", model)

    def on_substep_end(self, args, state, control, model=None, **kwargs):
        self._check("on_substep_end", model)  # after the backward of a non-final micro-batch

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self._check("on_pre_optimizer_step", model)  # all backwards of the step done

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        self._check("on_optimizer_step", model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._check("on_step_end", model)


# ---------------------------------------------------------------------------------------------------
# One short training run per trainer, shared by the tests that inspect its outcome.

RUNS = {
    # GRPO given a model object; two micro-batches per step (sketches accumulate across them).
    "grpo": dict(kind="grpo", from_path=False, config=dict(gradient_accumulation_steps=2, temperature=0.9)),
    # RLOO given a model path (the trainer builds the model; attach_logra patches that one), with
    # TRL's defaults of a reference model (beta=0.05) and activation checkpointing.
    "rloo": dict(kind="rloo", from_path=True, config=dict(gradient_checkpointing=True)),
}
STEPS = 3


@pytest.fixture(scope="module", params=sorted(RUNS))
def run(request, tmp_path_factory):
    spec = RUNS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    model = setup.save_policy(directory / "policy") if spec["from_path"] else setup.build_policy()
    watch = GradWatch()
    trainer = setup.build_trainer(
        spec["kind"], model, directory / "out", callbacks=[watch], max_steps=STEPS, **spec["config"]
    )
    before = setup.parameters(trainer.model)
    ref_before = setup.parameters(trainer.ref_model) if getattr(trainer, "ref_model", None) is not None else None
    callback = quiet_attach(trainer)
    trainer.train()
    return dict(
        name=request.param,
        trainer=trainer,
        watch=watch,
        callback=callback,
        before=before,
        ref_before=ref_before,
        directory=directory,
    )


def test_trainer_uses_logra_and_patches_its_own_model(run):
    trainer = run["trainer"]
    optimizer = logra_optimizer(trainer)
    assert optimizer.update_index == STEPS
    # The model the trainer trains (for RLOO: the one it loaded from the path) is the patched one.
    names = [name for name, _ in patched_modules(trainer.model)]
    assert len(names) == 2 * len(TARGET_SUFFIXES)
    assert {name.rsplit(".", 1)[-1] for name in names} == set(TARGET_SUFFIXES)
    assert optimizer.model is trainer.model
    # The probe temperature is the trainer's sampling temperature.
    assert optimizer.kl_control.contexts().temperature == pytest.approx(trainer.temperature)


def test_probe_positions_are_completion_tokens(run):
    # Every prompt is 4 words, so positions 0..2 predict prompt tokens and must not be probed;
    # position 3 predicts the first completion token, which every sequence has.
    contexts = logra_optimizer(run["trainer"]).kl_control.contexts()
    assert not contexts.probe_mask[:, :3].any()
    assert contexts.probe_mask[:, 3].all()
    assert contexts.tokens <= contexts.probe_mask.shape[0] * 8


def test_only_target_weights_change(run):
    trainer, before = run["trainer"], run["before"]
    after = setup.parameters(trainer.model)
    assert after.keys() == before.keys()
    targets = {name + ".weight" for name, _ in patched_modules(trainer.model)}
    for name in before:
        if name in targets:
            assert not torch.equal(before[name], after[name]), f"target {name} did not change"
        else:
            assert torch.equal(before[name], after[name]), f"non-target {name} changed"
    if run["name"] == "rloo":
        assert run["ref_before"] is not None  # beta=0.05: RLOO built a reference model
    if run["ref_before"] is not None:  # the reference model: untouched and unpatched
        assert not patched_modules(trainer.ref_model)
        ref_after = setup.parameters(trainer.ref_model)
        assert all(torch.equal(run["ref_before"][n], ref_after[n]) for n in ref_after)


def test_no_target_grad_at_any_point(run):
    watch, trainer = run["watch"], run["trainer"]
    assert watch.violations == []
    # on_step_begin, on_pre_optimizer_step, on_optimizer_step, on_step_end per step (+ substeps).
    assert watch.checks >= 4 * STEPS
    for name, param in trainer.model.named_parameters():
        assert param.grad is None, name
        assert not param.requires_grad, name


def test_logra_stats_in_log_history(run):
    trainer = run["trainer"]
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(steps) == STEPS
    for entry in steps:
        for key in LOGGED_KEYS:
            assert key in entry, f"{key} missing from {sorted(entry)}"
            assert math.isfinite(entry[key])
        assert entry["logra/kl_budget"] == pytest.approx(setup.LOGRA_KWARGS["kl_budget"])
        assert entry["logra/mismatch"] == 0.0  # no vLLM: no rollout log-probs
        assert 0 < entry["logra/alpha"] <= setup.LOGRA_KWARGS["alpha_max"]
        assert entry["logra/predicted_kl"] > 0
        # The chosen step lands on the budget (α below α_max): predicted step KL = δ.
        assert entry["logra/predicted_step_kl"] == pytest.approx(entry["logra/kl_budget"], rel=1e-6)
    # The summary entry at the end carries no LoGRA statistics.
    assert not any(key.startswith("logra/") for key in trainer.state.log_history[-1])
    assert run["callback"].pending == {}


@pytest.mark.parametrize("how", ["save_model", "save_pretrained"])
def test_saved_model_loads_in_plain_transformers(run, how, tmp_path):
    trainer = run["trainer"]
    if how == "save_model":
        trainer.save_model(str(tmp_path))
    else:
        trainer.model.save_pretrained(str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    reference = setup.build_policy()  # never patched
    assert list(loaded.state_dict()) == list(reference.state_dict())
    trained = trainer.model.state_dict()
    assert list(trained) == list(reference.state_dict())
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == trained[name].dtype
        assert torch.equal(tensor, trained[name]), name
    # No trace of the patch: plain modules, plain config, same file contents as an unpatched save.
    assert not patched_modules(loaded)
    assert not hasattr(loaded, "_logra_patch")
    assert "logra" not in (tmp_path / "config.json").read_text().lower()
    from safetensors import safe_open

    reference.save_pretrained(str(tmp_path / "reference"))
    with (
        safe_open(str(tmp_path / "model.safetensors"), "pt") as saved,
        safe_open(str(tmp_path / "reference" / "model.safetensors"), "pt") as plain,
    ):
        assert sorted(saved.keys()) == sorted(plain.keys())
    # Same function: the loaded model gives the trained model's logits.
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trainer.model(input_ids=ids).logits)


# ---------------------------------------------------------------------------------------------------
# Checkpoint and resume


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_resume_from_checkpoint_is_bit_identical(kind, tmp_path):
    """Train 4 steps saving every 2; a fresh trainer resumed from checkpoint-2 ends bit-identical
    to uninterrupted runs (with and without checkpointing), LoGRA's update index and state included.

    Bit-identical (not merely close) holds because every input to an update is restored exactly:
    weights (fp32 safetensors), LoGRA's row moments and update index (the projections ``A`` are
    regenerated from seed + update index), the LR schedule, the trainer's RNG states (sampling) and
    its position in the seeded data order; the computation itself is deterministic on the CPU.
    """
    path = setup.save_policy(tmp_path / "policy")
    config = dict(max_steps=4, gradient_accumulation_steps=2)

    def train(out, resume=None, **overrides):
        trainer = setup.build_trainer(kind, path, tmp_path / out, **config, **overrides)
        quiet_attach(trainer, refresh_every=3)  # a redraw after the resume: the first moment's carry
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    checkpointed = train("checkpointed", save_strategy="steps", save_steps=2)
    checkpoint = tmp_path / "checkpointed" / "checkpoint-2"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert saved["logra"]["update_index"] == 2

    resumed = train("resumed", resume=str(checkpoint))
    uninterrupted = train("uninterrupted")

    expected = setup.parameters(uninterrupted.model)
    for trainer in (checkpointed, resumed):
        got = setup.parameters(trainer.model)
        for name in expected:
            assert torch.equal(got[name], expected[name]), name
    reference = logra_optimizer(uninterrupted)
    for trainer in (checkpointed, resumed):
        optimizer = logra_optimizer(trainer)
        assert optimizer.update_index == reference.update_index == 4
        for mine, theirs in zip(optimizer.param_groups[0]["params"], reference.param_groups[0]["params"]):
            assert optimizer.state[mine].keys() == reference.state[theirs].keys()
            for key, value in optimizer.state[mine].items():
                assert torch.equal(value, reference.state[theirs][key]), key

    # The resumed run sampled the same completions: same rewards at steps 3 and 4.
    def rewards(trainer):
        return [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]

    assert rewards(resumed) == rewards(uninterrupted)


def test_a_mixture_of_experts_resumes_with_its_experts(tmp_path):
    """transformers writes the experts of a checkpoint per expert and its Trainer resumes them with
    ``load_state_dict``, which leaves the model's stacked expert weights as they were built
    (transformers#48805). attach_logra loads them through ``from_pretrained``: the resumed run ends
    bit-identical to the run that saved the checkpoint."""
    path = setup.save_policy(tmp_path / "policy", build=setup.build_moe_policy)
    config = dict(max_steps=4, gradient_accumulation_steps=2)

    def train(out, resume=None, **overrides):
        trainer = setup.build_trainer("grpo", path, tmp_path / out, **config, **overrides)
        quiet_attach(trainer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train(resume_from_checkpoint=resume)
        return trainer, [str(w.message) for w in caught if "the trainer's resume skips" in str(w.message)]

    checkpointed, none = train("checkpointed", save_strategy="steps", save_steps=2)
    assert not none
    resumed, loaded = train("resumed", resume=str(tmp_path / "checkpointed" / "checkpoint-2"))
    assert len(loaded) == 1 and "experts" in loaded[0]
    expected = setup.parameters(checkpointed.model)
    got = setup.parameters(resumed.model)
    assert any("experts" in name for name in expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name

    # A checkpoint without layer 0's experts in any layout: refused, naming the weight.
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "checkpointed" / "checkpoint-2" / "model.safetensors"
    stored = load_file(weights)
    save_file({k: v for k, v in stored.items() if "layers.0.mlp.experts." not in k}, weights, {"format": "pt"})
    with pytest.raises(RuntimeError, match=r"lack \['model.layers.0.mlp.experts"):
        train("refused", resume=str(tmp_path / "checkpointed" / "checkpoint-2"))


# ---------------------------------------------------------------------------------------------------
# Learning


def test_grpo_improves_reward_on_toy_task(tmp_path):
    """50 GRPO steps of 8 prompts × 4 completions: the mean reward of the last 5 logged steps beats
    the first 5 by a wide margin (seed 0 here: 0.26 → 0.95; seeds 1–4 gain 0.34–0.57 over 10-step
    windows; a random policy earns ≈ 0.25)."""
    trainer = setup.build_trainer(
        "grpo",
        setup.build_policy(),
        tmp_path,
        max_steps=50,
        per_device_train_batch_size=32,
        lr_scheduler_type="constant",
    )
    quiet_attach(trainer)
    trainer.train()
    first = setup.mean_logged(trainer.state.log_history, "reward", slice(None, 5))
    last = setup.mean_logged(trainer.state.log_history, "reward", slice(-5, None))
    print(f"mean reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert first < 0.4
    assert last > first + 0.2, (first, last)


def test_grpo_on_a_mixture_of_experts_model_trains_every_expert_and_learns(tmp_path):
    """The same two lines on a tiny Qwen3-MoE (4 experts, top-2), bf16 autocast as on a GPU: every
    expert of every layer moves and the reward rises (seed 0, the default orthogonal directions with
    their 16-bit floor: 0.26 → 0.88 over 50 steps; with RowAdam, the former default: seed 0 0.26 →
    0.90, seeds 1, 2: 0.25 → 0.90, 0.24 → 0.83; fp32 seed 0: 0.26 → 0.90)."""
    model = setup.build_moe_policy()
    before = {name: p.detach().clone() for name, p in model.named_parameters() if ".experts." in name}
    trainer = setup.build_trainer(
        "grpo", model, tmp_path, max_steps=50, per_device_train_batch_size=32, lr_scheduler_type="constant", bf16=True
    )
    callback = quiet_attach(trainer)
    trainer.train()
    assert sum(t.experts > 1 for t in callback.optimizer.targets) == 4
    for name, parameter in trainer.model.named_parameters():
        if name in before:
            moved = [not torch.equal(parameter[e], before[name][e]) for e in range(parameter.shape[0])]
            assert all(moved), (name, moved)
    first = setup.mean_logged(trainer.state.log_history, "reward", slice(None, 5))
    last = setup.mean_logged(trainer.state.log_history, "reward", slice(-5, None))
    print(f"mean reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert first < 0.4
    assert last > first + 0.3, (first, last)


# ---------------------------------------------------------------------------------------------------
# The rollout/trainer mismatch κ


SHIFT = 0.01  # log π_rollout − log π_trainer on every generated token


class GRPOWithRolloutLogps(GRPOTrainer):
    """The real GRPOTrainer whose batches also carry the rollout engine's log-probs of the sampled
    tokens, as GRPO puts them there with vLLM (``sampling_per_token_logps``): here the trainer's
    own log-probs shifted by ``SHIFT``, so the mismatch each update sees is exactly ``SHIFT``."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        output["sampling_per_token_logps"] = output["old_per_token_logps"] + SHIFT
        return output


def test_mismatch_from_grpo_batches_reaches_the_step_control(tmp_path):
    # num_iterations=2 makes GRPO compute old_per_token_logps (as it always does with vLLM).
    steps, w = 4, 0.3
    trainer = setup.build_trainer(
        "grpo",
        setup.build_policy(),
        tmp_path,
        trainer_cls=GRPOWithRolloutLogps,
        max_steps=steps,
        num_iterations=2,
        gradient_accumulation_steps=2,
    )
    quiet_attach(trainer, mismatch_ema=w)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "logra/mismatch" in entry]
    assert len(logged) == steps
    budget = setup.LOGRA_KWARGS["kl_budget"]
    for n, entry in enumerate(logged, start=1):
        kappa = SHIFT * (1 - (1 - w) ** n)  # EMA of a constant sample SHIFT, from κ = 0
        assert entry["logra/mismatch"] == pytest.approx(kappa, rel=1e-4)
        assert entry["logra/kl_budget_effective"] == pytest.approx(max(budget - kappa, budget / 2), rel=1e-4)
        assert entry["logra/predicted_step_kl"] == pytest.approx(entry["logra/kl_budget_effective"], rel=1e-6)
        assert "grad_norm" not in entry  # the norm of .grad, which the targets do not have
    assert logra_optimizer(trainer).mismatch == pytest.approx(SHIFT * (1 - (1 - w) ** steps), rel=1e-4)


class GRPOWithRolloutLogpsAlone(GRPOTrainer):
    """GRPO with vLLM as TRL runs it with ``vllm_importance_sampling_correction=False`` and one update
    per generation: the batches carry the rollout log-probs but not ``old_per_token_logps``."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        assert output.get("old_per_token_logps") is None
        output["sampling_per_token_logps"] = torch.zeros(output["completion_mask"].shape)
        return output


def test_rollout_logps_without_the_trainers_warn_that_the_mismatch_is_not_estimated(tmp_path):
    trainer = setup.build_trainer(
        "grpo", setup.build_policy(), tmp_path, trainer_cls=GRPOWithRolloutLogpsAlone, max_steps=1
    )
    quiet_attach(trainer)
    with pytest.warns(RuntimeWarning, match="mismatch κ is not estimated and stays 0"):
        trainer.train()
    assert [entry["logra/mismatch"] for entry in trainer.state.log_history if "logra/mismatch" in entry] == [0.0]


def test_callback_feeds_mismatch_samples_to_the_optimizer(tmp_path):
    trainer = setup.build_trainer("grpo", setup.build_policy(), tmp_path)
    callback = quiet_attach(trainer, mismatch_ema=0.5)
    # Logged statistics are averaged over the log's updates; the skip counters (running totals) not.
    callback.pending = {"logra/probe_skips": [0.0, 0.0, 1.0], "logra/alpha": [1.0, 2.0, 3.0]}
    assert callback.pop_logs() == {"logra/probe_skips": 1.0, "logra/alpha": 2.0} and not callback.pending
    trainer.create_optimizer()  # what train() does first: builds LoGRA through optimizer_cls_and_kwargs
    optimizer = logra_optimizer(trainer)
    assert callback.optimizer is optimizer
    generator = torch.Generator().manual_seed(0)
    # Two micro-batches of different completion lengths; masked-out tokens carry a huge difference
    # that must not count.
    samples, expected_sum, expected_count = [], 0.0, 0
    for length in (8, 5):
        trainer_logps = -5 * torch.rand(4, length, generator=generator)
        difference = 0.05 * torch.rand(4, length, generator=generator)
        mask = torch.rand(4, length, generator=generator) < 0.7
        rollout = trainer_logps + torch.where(mask, difference, torch.full_like(difference, 100.0))
        samples.append((rollout, trainer_logps, mask.int()))
        expected_sum += float(((rollout - trainer_logps).double() * mask).sum())
        expected_count += int(mask.sum())
    callback.mismatch_samples.extend(samples)
    callback.on_pre_optimizer_step(trainer.args, trainer.state, trainer.control)
    assert optimizer.mismatch == pytest.approx(0.5 * expected_sum / expected_count, rel=1e-5)
    assert callback.mismatch_samples == []  # consumed once per update
    callback.on_pre_optimizer_step(trainer.args, trainer.state, trainer.control)  # nothing new: κ unchanged
    assert optimizer.mismatch == pytest.approx(0.5 * expected_sum / expected_count, rel=1e-5)


# ---------------------------------------------------------------------------------------------------
# Other Trainer-based trainers attach the same way


def test_plain_transformers_trainer_trains_with_logra(tmp_path):
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, setup.N_WORDS, (16, 10), generator=generator).tolist()
    dataset = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=2,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=setup.build_policy(), args=args, train_dataset=dataset)
    before = setup.parameters(trainer.model)
    quiet_attach(trainer, temperature=1.0)
    trainer.train()
    after = setup.parameters(trainer.model)
    targets = {name + ".weight" for name, _ in patched_modules(trainer.model)}
    assert targets and all(torch.equal(before[n], after[n]) != (n in targets) for n in before)
    assert all(key in trainer.state.log_history[0] for key in LOGGED_KEYS)


# ---------------------------------------------------------------------------------------------------
# Bad input


def test_attach_to_trainer_with_an_optimizer_instance(tmp_path):
    model = setup.build_policy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = setup.build_trainer("grpo", model, tmp_path, optimizers=(optimizer, None))
    with pytest.raises(RuntimeError, match="already has an optimizer"):
        attach_logra(trainer, **setup.LOGRA_KWARGS)
    assert not patched_modules(trainer.model)  # nothing was changed


def test_attach_after_the_optimizer_was_built(tmp_path):
    trainer = setup.build_trainer("grpo", setup.build_policy(), tmp_path)
    trainer.create_optimizer()
    with pytest.raises(RuntimeError, match="already has an optimizer"):
        attach_logra(trainer, **setup.LOGRA_KWARGS)


def test_attach_twice_is_rejected(tmp_path):
    trainer = setup.build_trainer("grpo", setup.build_policy(), tmp_path)
    quiet_attach(trainer)
    with pytest.raises(RuntimeError, match="already"):
        quiet_attach(trainer)


def test_misspelt_option_fails_at_attach_time(tmp_path):
    trainer = setup.build_trainer("grpo", setup.build_policy(), tmp_path)
    with pytest.raises(TypeError, match="kl_budgt"):
        attach_logra(trainer, rank=4, kl_budgt=1e-3)
    # Nothing was changed on the way to the error.
    assert not patched_modules(trainer.model)


@pytest.mark.parametrize("thing", ["module", "loop", "none"])
def test_attach_to_something_that_is_not_a_trainer(thing):
    obj = {"module": setup.build_policy(), "loop": object(), "none": None}[thing]
    with pytest.raises(TypeError, match="transformers.Trainer"):
        attach_logra(obj, **setup.LOGRA_KWARGS)


def test_attach_to_peft_wrapped_model(tmp_path):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=setup.build_policy(),
        reward_funcs=setup.allowed_fraction_reward,
        args=setup.make_config("grpo", tmp_path),
        train_dataset=setup.prompt_dataset(),
        processing_class=setup.build_tokenizer(),
        peft_config=config,
    )
    with pytest.raises(ValueError, match="PEFT"):
        attach_logra(trainer, **setup.LOGRA_KWARGS)
    assert not patched_modules(trainer.model)


def test_max_grad_norm_warns_and_is_disabled(tmp_path):
    trainer = setup.build_trainer("grpo", setup.build_policy(), tmp_path, max_grad_norm=1.0)
    config = trainer.args  # the user's config object, which a baseline trainer may share
    with pytest.warns(UserWarning, match="max_grad_norm=1.0 disabled"):
        attach_logra(trainer, **setup.LOGRA_KWARGS)
    assert trainer.args.max_grad_norm == 0.0 and trainer.args.lr_scheduler_type == "constant"
    assert config.max_grad_norm == 1.0 and config.lr_scheduler_type == "linear"  # untouched

    trainer = setup.build_trainer("grpo", setup.build_policy(), tmp_path / "off", max_grad_norm=0.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="attach_logra: max_grad_norm")
        attach_logra(trainer, **setup.LOGRA_KWARGS)


# ---------------------------------------------------------------------------------------------------
# Examples


def run_example(script: str, *args: str, timeout: float = 300) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def test_example_trl_grpo_runs(tmp_path):
    out = run_example("trl_grpo.py", "--steps", "2", "--output-dir", str(tmp_path))
    assert "logra/alpha" in out
    assert (tmp_path / "final" / "model.safetensors").exists()


def test_example_trl_grpo_marks_the_two_logra_lines():
    import io
    import tokenize

    source = (REPO / "examples" / "trl_grpo.py").read_text()
    lines = source.splitlines()
    comments = [
        tok
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and tok.string.startswith("# LoGRA:")
    ]
    marked = [lines[tok.start[0] - 1] for tok in comments]
    assert len(marked) == 2, marked
    assert "import attach_logra" in marked[0] and "attach_logra(trainer" in marked[1]


def test_example_reinforce_tiny_runs():
    out = run_example("reinforce_tiny.py", "--steps", "3")
    assert "step    1" in out


def test_mismatch_mask_keeps_generated_tokens_of_completed_responses(tmp_path):
    from logra_optim.integrations.trl import mismatch_mask

    trainer = setup.build_trainer("grpo", setup.build_policy(), tmp_path)
    eos, pad = setup.SPECIAL["<eos>"], setup.SPECIAL["<pad>"]
    completion_ids = torch.tensor(
        [
            [5, eos, 7, 8],  # an EOS ends a tool-call turn, then the response was cut off: not completed
            [5, 6, eos, pad],  # ended with EOS, then padding: completed
            [5, 6, 7, 8],  # truncated: not completed
        ]
    )
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]])
    tool_mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1], [1, 1, 1, 1]])
    inputs = {"completion_ids": completion_ids, "completion_mask": completion_mask, "tool_mask": tool_mask}
    expected = torch.tensor([[0, 0, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(mismatch_mask(trainer, inputs), expected)


# ---------------------------------------------------------------------------------------------------
# The trainer's learning-rate schedule: update_ratio is the group's "lr", so the default linear decay
# would take LoGRA's step to zero by the end of training

NO_KL = dict(rank=16, kl_budget=None, update_ratio=5e-2)


def _logged_ratios(trainer) -> list[float]:
    return [entry["logra/update_ratio"] for entry in trainer.state.log_history if "logra/update_ratio" in entry]


def test_default_linear_decay_is_replaced_by_a_constant_schedule(tmp_path):
    trainer = setup.build_trainer("grpo", setup.build_policy(), tmp_path, max_steps=4)
    assert trainer.args.lr_scheduler_type == "linear"  # TrainingArguments' default
    with pytest.warns(UserWarning, match="using lr_scheduler_type='constant'"):
        attach_logra(trainer, **NO_KL)
    trainer.train()
    assert _logged_ratios(trainer) == pytest.approx([5e-2] * 4)


def test_an_explicit_schedule_is_kept_and_logged(tmp_path):
    trainer = setup.build_trainer("grpo", setup.build_policy(), tmp_path, max_steps=4)
    attach_logra(trainer, keep_lr_schedule=True, **NO_KL)
    trainer.train()
    ratios = _logged_ratios(trainer)
    assert ratios[0] == pytest.approx(5e-2)
    assert ratios == sorted(ratios, reverse=True) and ratios[-1] < ratios[0] / 2  # the linear decay, as asked

    trainer = setup.build_trainer("grpo", setup.build_policy(), tmp_path / "cosine", lr_scheduler_type="cosine")
    attach_logra(trainer, **NO_KL)
    assert trainer.args.lr_scheduler_type == "cosine"


def test_warmup_is_kept_when_the_decay_is_dropped(tmp_path):
    trainer = setup.build_trainer("grpo", setup.build_policy(), tmp_path, max_steps=4, warmup_steps=2)
    with pytest.warns(UserWarning, match="constant_with_warmup"):
        attach_logra(trainer, **NO_KL)
    trainer.train()
    ratios = _logged_ratios(trainer)
    assert ratios[0] < ratios[-1] == pytest.approx(5e-2)  # warming up, then constant


class _RoutingAndKL(TrainerCallback):
    """Around each optimizer step: the KL the update moved the probe contexts by (their mean over
    probe positions, as the budget is) and how many probe positions changed experts in any layer."""

    def __init__(self):
        self.trainer, self.updates = None, []

    def _run(self, contexts):
        from logra_optim.probe import inference_environment

        model, routes = self.trainer.model, []
        experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
        hooks = [m.register_forward_hook(lambda m, args, out: routes.append(args[1].sort(-1).values)) for m in experts]
        with inference_environment(model):
            logits = model(input_ids=contexts.input_ids, attention_mask=contexts.attention_mask, use_cache=False)
        for hook in hooks:
            hook.remove()
        return torch.log_softmax(logits.logits.double() / contexts.temperature, -1), routes

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.contexts = logra_optimizer(self.trainer).kl_control.contexts()
        self.before = self._run(self.contexts)

    def on_optimizer_step(self, args, state, control, **kwargs):
        (before, routes_before), (after, routes_after) = self.before, self._run(self.contexts)
        mask = self.contexts.probe_mask
        kl = (before.exp() * (before - after)).sum(-1)[mask].mean()
        moved = torch.stack([(b != a).any(-1).view(mask.shape) for b, a in zip(routes_before, routes_after)])
        self.updates.append((float(kl), int((moved.any(0) & mask).sum())))


def test_mixture_of_experts_routing_changes_escape_the_probe_and_the_realised_check_catches_them(tmp_path):
    """The JVP probe predicts the KL of a step with every token kept on its experts (top-k routing is
    piecewise constant). Over 8 GRPO updates of the tiny Qwen3-MoE at a budget of 1e-4, the updates
    where no probe position changed experts move the probe contexts by the budget, and at least one
    update reroutes a position and moves them far beyond it (docs/method.md, "Mixture of experts").
    With ``realised_kl_check`` every update stays within its tolerance. ``-s`` prints both runs."""
    budget = 1e-4
    runs = {}
    for check in (False, True):
        meter = _RoutingAndKL()
        trainer = setup.build_trainer(
            "grpo", setup.build_moe_policy(), tmp_path / f"check-{check}", callbacks=[meter], max_steps=8
        )
        meter.trainer = trainer
        quiet_attach(trainer, kl_budget=budget, realised_kl_check=check)
        trainer.train()
        runs[check] = meter.updates
        print(f"realised_kl_check={check}: (KL / budget, rerouted probe positions) per update:")
        print("  " + ", ".join(f"({kl / budget:.2f}, {moved})" for kl, moved in meter.updates))
    unchecked, checked = runs[False], runs[True]
    assert all(0.9 <= kl / budget <= 1.1 for kl, moved in unchecked if moved == 0)
    assert any(moved > 0 and kl / budget > 3 for kl, moved in unchecked)
    assert all(kl / budget <= 1.1 for kl, _ in checked)
