"""The KL formulas of ``logra_optim.kl`` (docs/method.md §3) against float64 references: the
predicted-KL estimator (the softmax Fisher quadratic form), the exact KL, the step scale, budget
schedules and the rollout/trainer mismatch. The probe that feeds them is in test_probe.py, the step
control built on them in test_control.py."""

from __future__ import annotations

import math

from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from logra_optim import LoGRAOptimizer, patch_model
from logra_optim.kl import (
    CosineBudget,
    retry_alpha,
    WordSample,
    budget_at,
    effective_budget,
    exact_kl_terms,
    fisher_kl_terms,
    floored_kl,
    mismatch_sample,
    positions_per_chunk,
    sample_words,
    sampled_fisher_kl_terms,
    step_scale,
)
from tests.helpers import reference
from tests.helpers.tiny import tiny_qwen2


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
    logits, tangent = _random_logits(seed, positions, vocab, spread)
    expected = reference.fisher_quadratic_form(logits, tangent, temperature)
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


@settings(max_examples=30, deadline=None)
@given(**shapes, chunk=st.integers(1, 7))
def test_vocabulary_math_is_the_same_in_any_chunking(seed, positions, vocab, spread, temperature, chunk):
    # On a CPU the positions are taken `chunk` at a time (ragged last chunk included); each
    # position's terms must not depend on which others share its chunk.
    logits, tangent = _random_logits(seed, positions, vocab, spread)
    with patch("logra_optim.kl._CPU_CHUNK_ELEMENTS", chunk * vocab):
        assert positions_per_chunk(vocab, logits.device) == chunk
        fisher = fisher_kl_terms(logits, tangent, temperature)
        exact = exact_kl_terms(logits, logits + tangent, temperature)
    expected = reference.fisher_quadratic_form(logits, tangent, temperature)
    torch.testing.assert_close(fisher, expected, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(
        exact, reference.kl_divergence(logits, logits + tangent, temperature), rtol=1e-9, atol=1e-15
    )


# ------------------------------------------------------------------------------------------------
# The estimator from a sample of words (probe_words)


def _sampled_terms(logits, tangent, top, samples, seed, temperature=1.0):
    uniforms = torch.rand(logits.shape[0], samples, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    sample = sample_words(logits, top, uniforms, temperature)
    return sample, sampled_fisher_kl_terms(sample, tangent.gather(1, sample.indices), temperature)


@settings(max_examples=40, deadline=None)
@given(**shapes, extra=st.integers(0, 5), samples=st.integers(2, 6))
def test_sampled_terms_are_the_exact_ones_when_the_top_words_are_the_whole_vocabulary(
    seed, positions, vocab, spread, temperature, extra, samples
):
    logits, tangent = _random_logits(seed, positions, vocab, spread)
    sample, terms = _sampled_terms(logits, tangent, vocab + extra, samples, seed, temperature)
    assert sample.indices.shape == (positions, vocab)  # no word drawn: there is no rest
    assert float(sample.tail_mass.abs().max()) == 0.0
    expected = reference.fisher_quadratic_form(logits, tangent, temperature)
    torch.testing.assert_close(terms, expected, rtol=1e-9, atol=1e-14)


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(6, 40),
    spread=st.floats(0.1, 4.0),
    temperature=st.floats(0.5, 2.0),
    top=st.integers(1, 4),
    samples=st.integers(2, 4),
)
def test_sampled_terms_are_unbiased(seed, vocab, spread, temperature, top, samples):
    # One position, drawn 4000 times (as 4000 rows): the mean of the estimates is the exact term,
    # within five standard errors.
    logits, tangent = _random_logits(seed, 1, vocab, spread)
    draws = 4000
    _, terms = _sampled_terms(logits.expand(draws, -1), tangent.expand(draws, -1), top, samples, seed, temperature)
    expected = float(reference.fisher_quadratic_form(logits, tangent, temperature)[0])
    error = 5 * float(terms.std()) / math.sqrt(draws) + 1e-12 * expected
    assert abs(float(terms.mean()) - expected) <= error
    assert bool((terms >= 0).all())


@settings(max_examples=30, deadline=None)
@given(**shapes, top=st.integers(1, 4), samples=st.integers(2, 5))
def test_sampled_words_come_from_the_rest_in_proportion_to_their_probability(
    seed, positions, vocab, spread, temperature, top, samples
):
    logits, tangent = _random_logits(seed, positions, vocab, spread)
    sample, _ = _sampled_terms(logits, tangent, top, samples, seed, temperature)
    p = torch.softmax(logits / temperature, dim=-1)
    kept = min(top, vocab)
    # The top words are the most likely ones, their probabilities and the rest's mass exact.
    torch.testing.assert_close(sample.top_probabilities, p.topk(kept).values)
    torch.testing.assert_close(sample.tail_mass, 1 - sample.top_probabilities.sum(dim=1), rtol=0, atol=1e-12)
    if kept < vocab:
        drawn = sample.indices[:, kept:]
        assert not bool((drawn.unsqueeze(-1) == sample.indices[:, :kept].unsqueeze(1)).any())
        assert bool((p.gather(1, drawn) > 0).all())


def test_word_draws_follow_the_probabilities():
    # Inverse transform on the rest: each word's share of 20000 draws is its probability within the rest.
    logits = torch.tensor([[3.0, 1.0, 0.5, 0.0, -1.0]], dtype=torch.float64)
    uniforms = torch.rand(1, 20000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sample = sample_words(logits, 1, uniforms)
    counts = torch.bincount(sample.indices[0, 1:], minlength=5).double() / 20000
    rest = torch.softmax(logits[0], dim=0)[1:]
    torch.testing.assert_close(counts[1:], rest / rest.sum(), rtol=0, atol=0.015)
    assert counts[0] == 0


@pytest.mark.parametrize("samples", [0, 1])
def test_sampled_terms_need_two_draws(samples):
    logits, tangent = _random_logits(0, 2, 10, 1.0)
    with pytest.raises(ValueError, match="sample_words needs at least 2 sampled words"):
        _sampled_terms(logits, tangent, 3, samples, 0)
    sample, _ = _sampled_terms(logits, tangent, 3, 2, 0)
    one_draw = WordSample(sample.indices[:, :4], sample.top_probabilities, sample.tail_mass)
    with pytest.raises(ValueError, match="sampled_fisher_kl_terms needs at least 2 sampled words"):
        sampled_fisher_kl_terms(one_draw, tangent.gather(1, one_draw.indices))


def test_the_lm_head_chunk_holds_its_logits_bounded():
    from logra_optim.probe import head_chunk_positions

    assert head_chunk_positions(32_000) == 256  # 512-row products
    assert head_chunk_positions(151_936) == 64  # no more logits at once than 64 positions held before
    assert head_chunk_positions(256) == 256


def test_chunks_fit_a_cache_on_cpu_and_stay_large_elsewhere():
    cpu = torch.device("cpu")
    assert positions_per_chunk(32_000, cpu) == 32  # 8 MiB of float64 per array
    assert positions_per_chunk(151_936, cpu) == 6
    assert positions_per_chunk(3_000_000, cpu) == 1  # never zero
    assert positions_per_chunk(16, cpu) == 256  # capped: the temporaries stay bounded
    assert positions_per_chunk(151_936, torch.device("cuda")) == 256  # no device needed to ask


@settings(max_examples=40, deadline=None)
@given(**shapes, scale=st.floats(1e-3, 3.0))
def test_exact_kl_matches_the_float64_reference(seed, positions, vocab, spread, temperature, scale):
    logits, tangent = _random_logits(seed, positions, vocab, spread)
    perturbed = logits + scale * tangent
    expected = reference.kl_divergence(logits, perturbed, temperature)
    torch.testing.assert_close(exact_kl_terms(logits, perturbed, temperature), expected, rtol=1e-9, atol=1e-15)
    # From fp32 and bf16 logits too: the float64 conversion happens before the division by T.
    for dtype in (torch.float32, torch.bfloat16):
        a, b = logits.to(dtype), perturbed.to(dtype)
        torch.testing.assert_close(
            exact_kl_terms(a, b, temperature), reference.kl_divergence(a, b, temperature), rtol=1e-9, atol=1e-15
        )


@settings(max_examples=50, deadline=None)
@given(q=st.floats(1e-12, 1e3), budget=st.floats(1e-8, 1.0), alpha_max=st.floats(1e-2, 10.0))
def test_step_scale_lands_on_the_budget_or_the_cap(q, budget, alpha_max):
    alpha = step_scale(q, budget, alpha_max)
    assert alpha == pytest.approx(min(alpha_max, math.sqrt(budget / q)))
    assert alpha**2 * q <= budget * (1 + 1e-9)


@settings(max_examples=50, deadline=None)
@given(
    q=st.floats(1e-12, 1e3),
    recent=st.lists(st.floats(1e-12, 1e3), min_size=1, max_size=30),
    fraction=st.floats(1e-3, 1.0),
    budget=st.floats(1e-8, 1.0),
)
def test_the_kl_floor_caps_alpha_relative_to_the_recent_median(q, recent, fraction, budget):
    """Against a float64 median: the floor never lowers ``q``, leaves it where it is at least the
    floor, and bounds α at ``1/sqrt(fraction)`` times what the recent median ``q`` would give."""
    median = float(torch.tensor(recent, dtype=torch.float64).quantile(0.5))
    floored = floored_kl(q, recent, fraction)
    assert floored == pytest.approx(max(q, fraction * median), rel=1e-12)
    assert floored >= q and (floored == q or q < fraction * median)
    alpha = step_scale(floored, budget, alpha_max=1e9)
    assert alpha <= math.sqrt(budget / (fraction * median)) * (1 + 1e-9)
    assert alpha <= step_scale(q, budget, alpha_max=1e9) * (1 + 1e-12)


def test_no_recent_updates_no_floor():
    assert floored_kl(1e-9, [], 0.25) == 1e-9


def test_step_scale_edge_cases():
    assert step_scale(0.0, 1e-4, 3.0) == 1.0
    assert step_scale(0.0, 1e-4, 0.5) == 0.5  # alpha_max binds when nothing moves too
    assert step_scale(1e-12, 1e-4, 0.5) == 0.5
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


def test_mismatch_ignores_non_finite_log_probs_and_reports_nothing_when_empty():
    rollout = torch.tensor([[-1.0, float("nan"), -2.0]], dtype=torch.float64)
    trainer = torch.tensor([[-1.2, -1.0, -2.4]], dtype=torch.float64)
    assert mismatch_sample(rollout, trainer) == pytest.approx(0.3)
    assert mismatch_sample(rollout, trainer, torch.tensor([[0, 1, 0]])) is None
    model = patch_model(tiny_qwen2())
    opt = LoGRAOptimizer(model, rank=4, kl_budget=1e-3, mismatch_ema=0.5)
    assert opt.observe_mismatch(rollout, trainer) == pytest.approx(0.15)
    # No usable token: κ keeps its value instead of decaying towards zero.
    assert opt.observe_mismatch(rollout, trainer, torch.tensor([[0, 1, 0]])) == pytest.approx(0.15)


@settings(max_examples=300, deadline=None)
@given(
    steepness=st.floats(1.2, 8.0),
    scale=st.floats(1e-3, 1e3),
    start=st.floats(0.05, 20.0),
    tolerance=st.sampled_from([0.02, 0.1]),
)
def test_realised_kl_retries_converge_on_curves_steeper_or_flatter_than_quadratic(steepness, scale, start, tolerance):
    """The realised-KL check's tries, as ``KLController.check_realised`` makes them, on ``KL(α) =
    c α^k``: the α² rescale alone alternates between two values for ``k = 4`` and diverges beyond;
    with the bracket of measured safe and unsafe α the tries reach the budget, never measuring an α
    twice."""
    budget, alpha, safe, unsafe, tried = 1.0, start, None, None, []
    for _ in range(40):
        realised = scale * alpha**steepness
        if abs(realised / budget - 1.0) <= tolerance:
            break
        assert alpha not in tried
        tried.append(alpha)
        if realised <= budget * (1.0 + tolerance):
            safe = (alpha, realised) if safe is None else max(safe, (alpha, realised))
        else:
            unsafe = (alpha, realised) if unsafe is None else min(unsafe, (alpha, realised))
        alpha = retry_alpha(alpha, realised, budget, 1e12, safe, unsafe)
    assert abs(scale * alpha**steepness / budget - 1.0) <= tolerance, (len(tried), alpha)


@given(
    alpha=st.floats(1e-3, 10.0),
    realised=st.floats(0.0, 1e3),
    budget=st.floats(1e-6, 1e2),
    alpha_max=st.floats(1e-2, 10.0),
)
def test_the_rescaled_retry_never_exceeds_alpha_max(alpha, realised, budget, alpha_max):
    assert retry_alpha(min(alpha, alpha_max), realised, budget, alpha_max) <= alpha_max


@given(
    low=st.floats(1e-3, 10.0),
    ratio=st.floats(1.001, 100.0),
    low_kl=st.floats(0.0, 1.2),  # safe: within the budget's ceiling, up to 20% above it
    high_kl=st.floats(1.0001, 1e4),
)
def test_a_bracketed_retry_lies_strictly_inside_the_bracket_whatever_the_curve(low, ratio, low_kl, high_kl):
    """Once a safe and an unsafe α are measured, the next try lies strictly between them, also on
    curves that are no power of α (a kink, a plateau, a safe try above the budget but within its
    tolerance), where the log-log interpolation can land outside: the bracket then only shrinks, so
    the tries cannot alternate or leave it."""
    high = low * ratio
    following = retry_alpha(high, high_kl, 1.0, 1e12, (low, low_kl), (high, high_kl))
    assert low < following < high


def test_the_alpha_squared_rescale_alone_cycles_on_a_quartic_curve():
    """Why the bracket: without it, ``KL = α⁴`` from α = 2 alternates 2 → 0.5 → 2 (budget 1)."""
    assert retry_alpha(2.0, 16.0, 1.0, 10.0) == 0.5
    assert retry_alpha(0.5, 0.0625, 1.0, 10.0) == 2.0
    assert retry_alpha(0.5, 0.0625, 1.0, 10.0, largest_safe=(0.5, 0.0625), smallest_unsafe=(2.0, 16.0)) == 1.0
