"""Predicted-KL step control end to end on a tiny Qwen2 (``kl_budget``, ``logra_optim.control``):
each update moves the policy by the budget, measured independently in float64; budgets and their
schedules, the mismatch κ, the realised-KL check and its retries, the failure paths and the options'
validation."""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
import torch.nn as nn

from logra_optim import LoGRAOptimizer, patch_model
from logra_optim.control import KLController, StepChoice
from logra_optim.options import KLOptions
from logra_optim.probe import ProbeContexts, contexts_from_batch
from tests.helpers.reference import measured_kl
from tests.helpers.tiny import tiny_qwen2


# ------------------------------------------------------------------------------------------------
# The step lands on the budget


@pytest.mark.parametrize(
    ("probe", "probe_dtype"), [("jvp", None), ("finite_difference", None), ("jvp", torch.bfloat16)], ids=str
)
@pytest.mark.parametrize("budget", [1e-5, 5e-5, 1e-4, 2e-4])
def test_realised_kl_matches_the_budget(fitted_model, probe, probe_dtype, budget):
    """Also with the JVP probe's products in bf16: the tangent is computed, not differenced, so
    16-bit products cost the prediction about a percent, not its meaning."""
    base, batch = fitted_model
    model = patch_model(copy.deepcopy(base))
    opt = LoGRAOptimizer(
        model, rank=16, kl_budget=budget, probe=probe, probe_dtype=probe_dtype, update_ratio=5e-3, alpha_max=100.0
    )
    contexts = contexts_from_batch(batch["input_ids"], labels=batch["labels"], samples=2)
    for _ in range(3):
        before = copy.deepcopy(model)
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        # Measured independently of the optimizer's own bookkeeping.
        ratio = measured_kl(before, model, contexts) / budget
        assert 0.9 <= ratio <= 1.1, (probe, budget, ratio, opt.stats)
        assert opt.stats["alpha"] < 100.0
        assert opt.stats["predicted_step_kl"] == pytest.approx(budget)


def _one_step_at_temperature(base, batch, budget, temperature, **options):
    """One LoGRA step probed at ``temperature``; returns the optimizer, the model before and after
    the step, and the probe contexts."""
    model = patch_model(copy.deepcopy(base))
    opt = LoGRAOptimizer(model, rank=16, kl_budget=budget, update_ratio=5e-3, alpha_max=100.0, **options)
    contexts = contexts_from_batch(batch["input_ids"], labels=batch["labels"], samples=2, temperature=temperature)
    opt.set_probe_contexts(contexts.input_ids, probe_mask=contexts.probe_mask, temperature=temperature)
    before = copy.deepcopy(model)
    model(**batch).loss.backward()
    opt.step()
    return opt, before, model, contexts


def test_realised_kl_matches_the_budget_at_a_sampling_temperature(fitted_model):
    # Sharper at T = 0.7, this over-fitted toy policy leaves the quadratic regime sooner (realised /
    # predicted 0.98 at 1e-6, 0.94 at 1e-5, 0.88 at 1e-4): test inside it.
    budget, temperature = 1e-5, 0.7
    _, before, after, contexts = _one_step_at_temperature(*fitted_model, budget, temperature)
    assert 0.9 <= measured_kl(before, after, contexts) / budget <= 1.1
    # Measured at T = 1 the same step is far off the budget: the temperature really is used.
    assert abs(measured_kl(before, after, contexts, temperature=1.0) / budget - 1.0) > 0.5


def test_mismatch_lowers_the_effective_budget_and_is_saved(fitted_model):
    base, batch = fitted_model
    model = patch_model(copy.deepcopy(base))
    opt = LoGRAOptimizer(model, rank=16, kl_budget=1e-4, update_ratio=5e-3, alpha_max=100.0)
    rollout = torch.full((2, 5), -1.0, dtype=torch.float64)
    trainer = torch.full((2, 5), -1.0 - 2e-5, dtype=torch.float64)
    assert opt.observe_mismatch(rollout, trainer) == pytest.approx(0.3 * 2e-5)
    kappa = 0.7 * 0.3 * 2e-5 + 0.3 * 2e-5
    assert opt.observe_mismatch(rollout, trainer) == pytest.approx(kappa)
    model(**batch).loss.backward()
    opt.step()
    assert opt.stats["mismatch"] == pytest.approx(kappa)
    assert opt.stats["kl_budget_effective"] == pytest.approx(1e-4 - kappa)
    assert opt.stats["predicted_step_kl"] == pytest.approx(1e-4 - kappa)
    state = opt.state_dict()
    assert state["logra"]["mismatch"] == pytest.approx(kappa) and state["logra"]["update_index"] == 1
    fresh = LoGRAOptimizer(patch_model(copy.deepcopy(base)), rank=16, kl_budget=1e-4)
    fresh.load_state_dict(state)
    assert fresh.mismatch == pytest.approx(kappa) and fresh.update_index == 1


# ------------------------------------------------------------------------------------------------
# The floor on the predicted KL


def test_the_kl_floor_takes_the_median_of_the_previous_window_and_resumes(fitted_model):
    """On a real model, update by update: ``q`` as the probe measured it, the floored ``q`` the step
    was scaled to (the median of the previous ``kl_floor_window`` updates' ``q`` times ``kl_floor``,
    from the first full window on), α from it; the window is saved and resumed. ``kl_floor=1`` puts
    the floor at the median itself, so that it binds on some of these updates."""
    import statistics

    base, batch = fitted_model
    model = patch_model(copy.deepcopy(base))
    options = dict(rank=16, kl_budget=1e-4, update_ratio=5e-3, alpha_max=100.0, kl_floor=1.0, kl_floor_window=3)
    opt = LoGRAOptimizer(model, **options)
    measured, bound = [], 0
    for update in range(8):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        q, used = opt.stats["predicted_kl"], opt.stats["predicted_kl_used"]
        expected = max(q, statistics.median(measured[-3:])) if update >= 3 else q
        assert used == pytest.approx(expected, rel=1e-12)
        assert opt.stats["alpha"] == pytest.approx(math.sqrt(1e-4 / used), rel=1e-9)
        assert opt.stats["predicted_step_kl"] == pytest.approx(opt.stats["alpha"] ** 2 * q, rel=1e-9)
        bound += used > q
        measured.append(q)
    assert bound >= 1  # the floor did bind (else this test would check nothing of it)
    state = opt.state_dict()
    assert state["logra"]["recent_kl"] == pytest.approx(measured[-3:], rel=1e-12)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    fresh = LoGRAOptimizer(patch_model(copy.deepcopy(base)), **options)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert list(fresh.kl_control.recent_kl) == pytest.approx(measured[-3:], rel=1e-12)


def test_a_resumed_run_floors_as_the_uninterrupted_one(fitted_model):
    """Checkpointed mid-run (model and optimizer through ``torch.load(weights_only=True)``), the
    resumed run takes the same α, floor and all, as the run that went on."""
    base, batch = fitted_model
    options = dict(rank=16, kl_budget=1e-4, update_ratio=5e-3, alpha_max=100.0, kl_floor=1.0, kl_floor_window=3)
    model = patch_model(copy.deepcopy(base))
    opt = LoGRAOptimizer(model, **options)

    def updates(model, opt, n):
        stats = []
        for _ in range(n):
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            stats.append((opt.stats["alpha"], opt.stats["predicted_kl"], opt.stats["predicted_kl_used"]))
        return stats

    updates(model, opt, 4)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    went_on = updates(model, opt, 4)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_model = patch_model(copy.deepcopy(base))
    resumed_model.load_state_dict(saved["model"])
    resumed = LoGRAOptimizer(resumed_model, **options)
    resumed.load_state_dict(saved["optimizer"])
    assert updates(resumed_model, resumed, 4) == went_on
    assert any(used > q for _, q, used in went_on)  # the floor bound after the checkpoint


# ------------------------------------------------------------------------------------------------
# Budgets


def test_a_budget_schedule_drives_successive_updates(fitted_model):
    from logra_optim import CosineBudget

    base, batch = fitted_model
    model = patch_model(copy.deepcopy(base))
    opt = LoGRAOptimizer(model, rank=16, kl_budget=CosineBudget(2e-4, 2e-5, 3), update_ratio=5e-3, alpha_max=100.0)
    budgets = []
    for _ in range(4):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        budgets.append(opt.stats["kl_budget"])
        assert opt.stats["predicted_step_kl"] == pytest.approx(budgets[-1])
    assert budgets == pytest.approx([2e-4, 1.1e-4, 2e-5, 2e-5])


def test_numpy_and_tensor_budgets_are_accepted(fitted_model):
    np = pytest.importorskip("numpy")
    base, batch = fitted_model
    for budget in (np.float32(1e-4), lambda update: torch.tensor(1e-4)):
        model = patch_model(copy.deepcopy(base))
        opt = LoGRAOptimizer(model, rank=16, kl_budget=budget, update_ratio=5e-3, alpha_max=100.0)
        model(**batch).loss.backward()
        opt.step()
        assert opt.stats["kl_budget"] == pytest.approx(1e-4)


def test_bad_schedule_value_is_rejected_at_step(fitted_model):
    base, batch = fitted_model
    model = patch_model(copy.deepcopy(base))
    opt = LoGRAOptimizer(model, rank=16, kl_budget=lambda update: 0.0)
    model(**batch).loss.backward()
    with pytest.raises(ValueError, match="kl_budget"):
        opt.step()


# ------------------------------------------------------------------------------------------------
# The realised-KL check


def test_realised_kl_check_retries_and_undoes_exactly(fitted_model):
    base, batch = fitted_model
    # A budget so large that the quadratic prediction is poor: the check must step in.
    config = dict(rank=16, kl_budget=0.5, update_ratio=5e-2, alpha_max=1e4, wire_dtype=None)
    model = patch_model(copy.deepcopy(base))
    opt = LoGRAOptimizer(model, **config, realised_kl_check=True, realised_kl_tolerance=0.05, realised_kl_retries=4)
    model(**batch).loss.backward()
    with warnings.catch_warnings():
        # Running out of retries warns; that outcome is covered by the assertion below.
        warnings.simplefilter("ignore", RuntimeWarning)
        opt.step()
    stats = opt.stats
    assert stats["realised_kl_retries"] >= 1
    assert stats["realised_kl"] <= 0.5 * 1.05 or stats["realised_kl_retries"] == 4
    # Undoing is exact: a twin whose α is capped at the final α from the start ends bit-identical.
    twin = patch_model(copy.deepcopy(base))
    twin_opt = LoGRAOptimizer(twin, **{**config, "kl_budget": 1e3, "alpha_max": stats["alpha_after_check"]})
    twin(**batch).loss.backward()
    twin_opt.step()
    assert twin_opt.stats["alpha"] == stats["alpha_after_check"]
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_the_realised_kl_check_keeps_the_largest_safe_step_when_its_retries_run_out():
    """A policy whose KL grows like α (flatter than α²) up to α = 0.2 and steeply beyond: the
    α² rescale climbs through three steps within the budget, then overshoots on the last retry. The
    step applied in the end is the largest α measured within the budget, not the first, and the
    realised KL reported is that step's. The controller is the real one; the policy is one scalar
    read by a ``probe_logits_fn`` (two words, the second's logit g(α))."""

    class Policy(nn.Module):
        def __init__(self):
            super().__init__()
            self.alpha = nn.Parameter(torch.zeros((), dtype=torch.float64), requires_grad=False)

    def logit(alpha: float) -> float:
        return math.sqrt(alpha) if alpha <= 0.2 else math.sqrt(0.2) + 20.0 * (alpha - 0.2)

    def logits(model, contexts):
        out = torch.zeros(*contexts.input_ids.shape, 2, dtype=torch.float64)
        out[..., 1] = logit(float(model.alpha))
        return out

    def kl(alpha: float) -> float:
        before, after = torch.tensor([0.0, 0.0]), torch.tensor([0.0, logit(alpha)], dtype=torch.float64)
        p = torch.softmax(before.double(), 0)
        return float((p * (p.log() - torch.log_softmax(after, 0))).sum())

    budget, tolerance = 0.03, 0.05
    options = KLOptions(
        budget=budget,
        realised_kl_check=True,
        realised_kl_tolerance=tolerance,
        realised_kl_retries=3,
        probe_logits_fn=logits,
    )
    policy = Policy()
    control = KLController(policy, options, None)
    contexts = ProbeContexts(torch.zeros(1, 3, dtype=torch.long), None, torch.ones(1, 3, dtype=torch.bool))
    applied = []

    def apply(alpha: float) -> None:
        policy.alpha.fill_(alpha)
        applied.append(alpha)

    choice = StepChoice(
        0.1, {"predicted_kl": 1.0}, contexts, logits(policy, contexts)[contexts.probe_mask], budget, 1, 3
    )
    apply(choice.alpha)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a safe step exists: no warning
        final = control.check_realised(choice, apply, lambda: policy.alpha.fill_(0.0))
    tries = applied[:-1]
    ceiling = budget * (1 + tolerance)
    safe = [alpha for alpha in tries if kl(alpha) <= ceiling]
    assert len(tries) == 4 and tries == sorted(tries) and len(safe) == 3 and kl(tries[-1]) > ceiling
    assert final == applied[-1] == max(safe) == float(policy.alpha)
    assert choice.stats["realised_kl"] == pytest.approx(kl(max(safe)), rel=1e-9)


def test_realised_kl_check_also_corrects_an_undershoot(fitted_model):
    """Outside the quadratic regime the prediction overshoots the true KL (here by ~12%); the check
    measures it and raises α until the step lands within the tolerance."""
    budget, temperature = 1e-4, 0.7
    opt, before, after, contexts = _one_step_at_temperature(
        *fitted_model, budget, temperature, realised_kl_check=True, realised_kl_tolerance=0.03
    )
    assert opt.stats["realised_kl_retries"] >= 1
    assert opt.stats["alpha"] > (budget / opt.stats["predicted_kl"]) ** 0.5  # raised above the prediction's α
    assert 0.97 <= measured_kl(before, after, contexts) / budget <= 1.03


def test_non_finite_realised_kl_restores_the_weights_and_skips(fitted_model):
    base, batch = fitted_model
    model = patch_model(copy.deepcopy(base))
    calls = []

    def logits_turning_nan(model, contexts):
        # The probe (first call) sees real logits; the realised-KL measurement after the merge does not.
        calls.append(1)
        logits = model(input_ids=contexts.input_ids).logits
        return logits if len(calls) == 1 else logits * float("nan")

    opt = LoGRAOptimizer(
        model,
        rank=16,
        kl_budget=1e-4,
        update_ratio=5e-3,
        alpha_max=100.0,
        realised_kl_check=True,
        probe_logits_fn=logits_turning_nan,
    )
    model(**batch).loss.backward()
    weights = [p.clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="realised KL nan") as caught:
        opt.step()
    assert caught[0].filename == __file__  # points at the caller's step()
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert opt.update_index == 0 and opt.stats["probe_skips"] == 1 and len(opt.state) == 0


# ------------------------------------------------------------------------------------------------
# Failure paths and options


def test_non_finite_prediction_skips_the_step(fitted_model):
    base, batch = fitted_model
    model = patch_model(copy.deepcopy(base))

    def nan_logits(model, contexts):
        return model(input_ids=contexts.input_ids).logits * float("nan")

    opt = LoGRAOptimizer(model, rank=16, kl_budget=1e-4, probe_logits_fn=nan_logits)
    model(**batch).loss.backward()
    weights = [p.clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="predicted KL"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert opt.stats["probe_skips"] == 1 and opt.update_index == 0 and len(opt.state) == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kl_budget=0.0), "kl_budget"),
        (dict(kl_budget=-1e-4), "kl_budget"),
        (dict(kl_budget=1e-4, temperature=0.0), "temperature"),
        (dict(kl_budget=1e-4, alpha_max=0.0), "alpha_max"),
        (dict(kl_budget=1e-4, probe="newton"), "probe"),
        (dict(kl_budget=1e-4, probe_samples=0), "probe_samples"),
        (dict(kl_budget=1e-4, probe_positions=0), "probe_positions must be a positive integer"),
        (dict(kl_budget=1e-4, probe_positions=2.5), "probe_positions must be a positive integer"),
        (dict(kl_budget=1e-4, fd_epsilon=-1.0), "fd_epsilon"),
        (dict(kl_budget=1e-4, mismatch_ema=0.0), "mismatch_ema"),
        (dict(kl_budget=1e-4, mismatch_ema=1.5), "mismatch_ema"),
        (dict(kl_budget=1e-4, realised_kl_check=True, realised_kl_tolerance=0.0), "realised_kl_tolerance"),
        (dict(kl_budget=1e-4, realised_kl_check=True, realised_kl_retries=-1), "realised_kl_retries"),
        (dict(kl_budget=1e-4, realised_kl_check=True, realised_kl_retries=1.5), "realised_kl_retries"),
        (dict(kl_budget=1e-4, kl_floor=0.0), "kl_floor must be None or in"),
        (dict(kl_budget=1e-4, kl_floor=1.5), "kl_floor must be None or in"),
        (dict(kl_budget=1e-4, kl_floor=True), "kl_floor must be None or in"),
        (dict(kl_budget=1e-4, kl_floor="0.25"), "kl_floor must be None or in"),
        (dict(kl_budget=1e-4, kl_floor_window=0), "kl_floor_window"),
        (dict(kl_budget=1e-4, kl_floor=0.25, realised_kl_check=True), "kl_floor cannot be combined"),
        (dict(kl_budget=1e-4, probe_dtype=torch.float64), "probe_dtype must be None or torch.bfloat16"),
        (dict(kl_budget=1e-4, probe_dtype=torch.float16), "probe_dtype must be None or torch.bfloat16"),
        (dict(kl_budget=1e-4, probe_dtype=torch.bfloat16, probe="finite_difference"), "probe_dtype.*needs probe='jvp'"),
        (dict(kl_budget=1e-4, probe_dtype=torch.bfloat16, realised_kl_check=True), "probe_dtype.*realised_kl_check"),
    ],
)
def test_bad_kl_arguments_are_rejected(kwargs, message):
    model = patch_model(tiny_qwen2())
    with pytest.raises(ValueError, match=message):
        LoGRAOptimizer(model, rank=8, **kwargs)


def test_realised_kl_check_needs_a_budget_and_no_non_target_optimizer():
    model = patch_model(tiny_qwen2())
    with pytest.raises(ValueError, match="realised_kl_check needs a kl_budget"):
        LoGRAOptimizer(model, rank=4, realised_kl_check=True)
    model.lm_head.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="realised_kl_check cannot be combined with non_target_optimizer"):
        LoGRAOptimizer(
            model,
            rank=4,
            kl_budget=1e-3,
            realised_kl_check=True,
            non_target_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        )
