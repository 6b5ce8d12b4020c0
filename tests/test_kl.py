"""Predicted-KL step control: the estimator against float64 references, the controller end to end
on a tiny Qwen2, budgets, mismatch, the realised-KL check and the failure paths."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from logra_optim import LoGRAOptimizer, patch_model
from logra_optim.kl import (
    CosineBudget,
    budget_at,
    effective_budget,
    exact_kl_terms,
    fisher_kl_terms,
    mismatch_sample,
    step_scale,
)
from logra_optim.probe import contexts_from_batch, finite_difference_predicted_kl, jvp_predicted_kl
from tiny import tiny_qwen2

# ------------------------------------------------------------------------------------------------
# The estimator


def _random_logits(seed, positions, vocab, spread):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(positions, vocab, generator=generator, dtype=torch.float64) * spread
    tangent = torch.randn(positions, vocab, generator=generator, dtype=torch.float64)
    return logits, tangent


shapes = dict(
    seed=st.integers(0, 2**31 - 1),
    positions=st.integers(1, 6),
    vocab=st.integers(2, 50),
    spread=st.floats(0.1, 5.0),
    temperature=st.floats(0.3, 2.0),
)


@settings(max_examples=60, deadline=None)
@given(**shapes)
def test_estimator_equals_fisher_quadratic_form(seed, positions, vocab, spread, temperature):
    # q_s = ½ żᵀ (diag p − p pᵀ) ż / T²: the Hessian of the KL is the softmax Fisher information.
    logits, tangent = _random_logits(seed, positions, vocab, spread)
    p = torch.softmax(logits / temperature, -1)
    fisher = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    expected = 0.5 * torch.einsum("sv,svw,sw->s", tangent, fisher, tangent) / temperature**2
    torch.testing.assert_close(fisher_kl_terms(logits, tangent, temperature), expected, rtol=1e-10, atol=1e-14)


@settings(max_examples=40, deadline=None)
@given(**shapes)
def test_estimator_matches_second_derivative_of_exact_kl(seed, positions, vocab, spread, temperature):
    # f(h) = KL(p(z) ‖ p(z + h ż)) has f(0) = f'(0) = 0 and f''(0) = 2q: central difference in float64.
    logits, tangent = _random_logits(seed, positions, vocab, spread)
    h = 1e-3
    forward = exact_kl_terms(logits, logits + h * tangent, temperature)
    backward = exact_kl_terms(logits, logits - h * tangent, temperature)
    expected = 2 * fisher_kl_terms(logits, tangent, temperature)
    torch.testing.assert_close((forward + backward) / h**2, expected, rtol=1e-4, atol=1e-9)


@settings(max_examples=30, deadline=None)
@given(**shapes, alpha=st.floats(1e-3, 1e3))
def test_estimator_scales_as_alpha_squared(seed, positions, vocab, spread, temperature, alpha):
    logits, tangent = _random_logits(seed, positions, vocab, spread)
    torch.testing.assert_close(
        fisher_kl_terms(logits, alpha * tangent, temperature),
        alpha**2 * fisher_kl_terms(logits, tangent, temperature),
        rtol=1e-9,
        atol=1e-300,
    )


def test_estimator_ignores_tangent_shifts_and_is_nonnegative():
    # Adding the same constant to every logit's tangent does not change the distribution.
    logits, tangent = _random_logits(3, 4, 20, 2.0)
    base = fisher_kl_terms(logits, tangent)
    torch.testing.assert_close(fisher_kl_terms(logits, tangent + 7.0), base)
    assert (base >= 0).all()


@settings(max_examples=50, deadline=None)
@given(q=st.floats(1e-12, 1e3), budget=st.floats(1e-8, 1.0), alpha_max=st.floats(1e-2, 10.0))
def test_step_scale_lands_on_the_budget_or_the_cap(q, budget, alpha_max):
    alpha = step_scale(q, budget, alpha_max)
    assert alpha == pytest.approx(min(alpha_max, math.sqrt(budget / q)))
    assert alpha**2 * q <= budget * (1 + 1e-9)


def test_step_scale_edge_cases():
    assert step_scale(0.0, 1e-4, 3.0) == 1.0
    for bad in (-1e-9, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="predicted KL"):
            step_scale(bad, 1e-4, 3.0)


# ------------------------------------------------------------------------------------------------
# Budgets and mismatch


def test_cosine_budget_follows_the_papers_schedule():
    schedule = CosineBudget(2e-4, 2e-5, 300)
    assert schedule(1) == pytest.approx(2e-4)
    assert schedule(150.5) == pytest.approx(1.1e-4)
    assert schedule(300) == pytest.approx(2e-5)
    assert schedule(5000) == pytest.approx(2e-5)
    values = [schedule(u) for u in range(1, 301)]
    assert all(a >= b for a, b in zip(values, values[1:]))


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(delta_max=0.0), "delta_max"), (dict(delta_min=-1.0), "delta_min"), (dict(horizon=0), "horizon")],
)
def test_cosine_budget_rejects_bad_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CosineBudget(**kwargs)


def test_budget_at_validates_schedules():
    assert budget_at(3e-4, 10) == 3e-4
    assert budget_at(lambda u: 1e-4 * u, 3) == pytest.approx(3e-4)
    with pytest.raises(ValueError, match="kl_budget"):
        budget_at(lambda u: -1.0, 1)


def test_mismatch_sample_and_effective_budget():
    rollout = torch.tensor([[-1.0, -2.0, -3.0]])
    trainer = torch.tensor([[-1.5, -2.5, -100.0]])
    mask = torch.tensor([[1, 1, 0]])
    assert mismatch_sample(rollout, trainer, mask) == pytest.approx(0.5)
    # The estimate is clipped at zero: a trainer more confident than the rollout is no mismatch.
    assert mismatch_sample(trainer[:, :2], rollout[:, :2]) == 0.0
    assert mismatch_sample(rollout, trainer, torch.zeros_like(mask)) is None
    assert effective_budget(1e-4, 2e-5) == pytest.approx(8e-5)
    assert effective_budget(1e-4, 9e-5) == pytest.approx(5e-5)
    with pytest.raises(ValueError, match="shape"):
        mismatch_sample(rollout, trainer[:, :2])
    with pytest.raises(ValueError, match="mask"):
        mismatch_sample(rollout, trainer, mask[:, :2])


def test_contexts_from_batch_selects_positions_predicting_trained_tokens():
    input_ids = torch.tensor([[5, 6, 7, 8, 0], [1, 2, 3, 4, 5]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    labels = torch.tensor([[-100, -100, 7, 8, -100], [-100, 2, 3, 4, 5]])
    contexts = contexts_from_batch(input_ids, attention_mask, labels, samples=2, temperature=0.7)
    # Logits at t predict token t+1: a position is probed when token t+1 is a real, trained token.
    expected = torch.tensor([[0, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    assert torch.equal(contexts.probe_mask, expected)
    assert contexts.tokens == 6 and contexts.temperature == 0.7
    assert contexts_from_batch(input_ids, attention_mask, labels, samples=1).input_ids.shape == (1, 5)


# ------------------------------------------------------------------------------------------------
# End to end on a tiny Qwen2


def _exact_kl_on(model_before, model_after, contexts):
    with torch.no_grad():
        before = model_before(input_ids=contexts.input_ids).logits[contexts.probe_mask]
        after = model_after(input_ids=contexts.input_ids).logits[contexts.probe_mask]
    return float(exact_kl_terms(before, after, contexts.temperature).mean())


@pytest.mark.parametrize("probe", ["jvp", "finite_difference"])
@pytest.mark.parametrize("budget", [1e-5, 5e-5, 1e-4, 2e-4])
def test_realised_kl_matches_the_budget(fitted_model, probe, budget):
    base, batch = fitted_model
    model = patch_model(copy.deepcopy(base))
    opt = LoGRAOptimizer(model, rank=16, kl_budget=budget, probe=probe, update_ratio=5e-3, alpha_max=100.0)
    contexts = contexts_from_batch(batch["input_ids"], labels=batch["labels"], samples=2)
    for _ in range(3):
        before = copy.deepcopy(model)
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        # Measured independently of the optimizer's own bookkeeping.
        ratio = _exact_kl_on(before, model, contexts) / budget
        assert 0.9 <= ratio <= 1.1, (probe, budget, ratio, opt.stats)
        assert opt.stats["alpha"] < 100.0
        assert opt.stats["predicted_step_kl"] == pytest.approx(budget)


def test_jvp_and_finite_difference_probes_agree(fitted_model):
    base, batch = fitted_model
    model = patch_model(copy.deepcopy(base))
    opt = LoGRAOptimizer(model, rank=16, kl_budget=1e-4, optimizer="sgd", wire_dtype=None)
    model(**batch).loss.backward()
    targets = opt._targets
    factors = [t.sketch * 1e-1 for t in targets]
    contexts = opt._probe_contexts()
    weights = [p.clone() for p in model.parameters()]
    q_jvp, n_jvp, _ = jvp_predicted_kl(model, targets, factors, contexts)
    q_fd, n_fd, _ = finite_difference_predicted_kl(model, targets, factors, contexts, epsilon=1e-2)
    assert n_jvp == n_fd == contexts.tokens
    assert float(q_fd) == pytest.approx(float(q_jvp), rel=2e-2)
    # The probes never touch the weights and leave the model in train mode.
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert model.training and all(m.training for m in model.modules())
    assert all(t.probe_factor is None for t in targets)


@pytest.mark.parametrize("setting", ["sdpa", "checkpointing", "autocast", "bf16"])
def test_probe_works_in_common_training_setups(fitted_model, setting):
    base, batch = fitted_model
    model = copy.deepcopy(base)
    if setting == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if setting == "bf16":
        model = model.to(torch.bfloat16)
    model.train()
    patch_model(model)
    opt = LoGRAOptimizer(model, rank=16, kl_budget=1e-4, update_ratio=5e-3, alpha_max=100.0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting == "autocast"):
        model(**batch).loss.backward()
    opt.step()
    stats = opt.stats
    assert stats["predicted_kl"] > 0 and stats["predicted_step_kl"] == pytest.approx(1e-4)
    assert stats["probe_tokens"] == 2 * 15
    assert model.config._attn_implementation == "sdpa" and model.training


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


def test_explicit_contexts_and_temperature(fitted_model):
    base, batch = fitted_model
    model = patch_model(copy.deepcopy(base))
    opt = LoGRAOptimizer(model, rank=16, kl_budget=1e-4, update_ratio=5e-3, alpha_max=100.0)
    probe_mask = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
    probe_mask[:, 8:12] = True
    opt.set_probe_contexts(batch["input_ids"], probe_mask=probe_mask, temperature=0.5)
    model(**batch).loss.backward()
    opt.step()
    assert opt.stats["probe_tokens"] == 4 * 4
    with pytest.raises(ValueError, match="probe_mask"):
        opt.set_probe_contexts(batch["input_ids"], probe_mask=probe_mask[:, :3])
    with pytest.raises(ValueError, match="temperature"):
        opt.set_probe_contexts(batch["input_ids"], temperature=0.0)
    with pytest.raises(ValueError, match="no probe positions"):
        opt.set_probe_contexts(batch["input_ids"], probe_mask=torch.zeros_like(probe_mask))


# ------------------------------------------------------------------------------------------------
# Failure paths


def test_missing_probe_contexts_say_how_to_give_them(fitted_model):
    base, batch = fitted_model
    model = patch_model(copy.deepcopy(base))
    opt = LoGRAOptimizer(model, rank=16, kl_budget=1e-4)
    # A forward from embeddings carries no token ids to probe with.
    embeds = model.get_input_embeddings()(batch["input_ids"])
    model(inputs_embeds=embeds, labels=batch["labels"]).loss.backward()
    with pytest.raises(RuntimeError, match="set_probe_contexts"):
        opt.step()


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
        (dict(kl_budget=1e-4, fd_epsilon=-1.0), "fd_epsilon"),
        (dict(kl_budget=1e-4, mismatch_ema=0.0), "mismatch_ema"),
    ],
)
def test_bad_kl_arguments_are_rejected(kwargs, message):
    model = patch_model(tiny_qwen2())
    with pytest.raises(ValueError, match=message):
        LoGRAOptimizer(model, rank=8, **kwargs)


def test_bad_schedule_value_is_rejected_at_step(fitted_model):
    base, batch = fitted_model
    model = patch_model(copy.deepcopy(base))
    opt = LoGRAOptimizer(model, rank=16, kl_budget=lambda update: 0.0)
    model(**batch).loss.backward()
    with pytest.raises(ValueError, match="kl_budget"):
        opt.step()


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


def test_chunked_lm_head_probe_equals_the_full_logits_probe(fitted_model, monkeypatch):
    """Without a realised-KL check the JVP probe applies the LM head a few positions at a time
    (no ``positions × vocabulary`` logits); it must predict the same KL as the full-logits path."""
    import logra_optim.probe as probe

    base, batch = fitted_model
    model = patch_model(copy.deepcopy(base))
    opt = LoGRAOptimizer(model, rank=16, kl_budget=1e-4, optimizer="sgd", wire_dtype=None)
    model(**batch).loss.backward()
    factors = [t.sketch * 1e-1 for t in opt._targets]
    contexts = opt._probe_contexts()
    assert probe._decoder_and_head(model) is not None, "the test model must take the chunked path"
    q_full, n_full, logits = jvp_predicted_kl(model, opt._targets, factors, contexts, keep_base=True)
    monkeypatch.setattr(probe, "HEAD_CHUNK_POSITIONS", 3)  # several chunks, a ragged last one
    q_chunked, n_chunked, none = jvp_predicted_kl(model, opt._targets, factors, contexts, keep_base=False)
    assert logits is not None and none is None
    assert n_chunked == n_full == contexts.tokens and n_full > 3
    assert float(q_chunked) == pytest.approx(float(q_full), rel=1e-6)
