"""``logra demo``'s KL meter: the rows it reads (never the ones LoGRA's KL probe reads while others
remain), the 95th percentile it reports, and the trainer callback itself on a real forward."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from logra_optim.cli import demo
from logra_optim.cli.measure import percentile_95, spread
from logra_optim.probe import spread_rows


@given(batch=st.integers(1, 96), probed=st.integers(1, 40), samples=st.integers(1, 12))
def test_the_kl_meter_reads_rows_the_probe_does_not(batch, probed, samples):
    """The meter's rows are distinct and in order; they avoid every row LoGRA's probe reads while
    any is left, take ``samples`` of the rest (all of it if fewer remain), and fall back to the
    probed rows only when the probe reads the whole batch."""
    rows = demo.held_out_rows(batch, probed, samples)
    probed_rows = set(torch.arange(batch)[spread_rows(batch, probed)].tolist())
    assert torch.equal(rows, rows.unique(sorted=True)) and 0 <= int(rows.min()) and int(rows.max()) < batch
    remaining = batch - len(probed_rows)
    if remaining:
        assert probed_rows.isdisjoint(rows.tolist())
        assert rows.numel() == min(samples, remaining)
    else:
        assert rows.numel() == min(samples, batch)


@given(values=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=50))
def test_the_kl_percentile_is_numpys(values):
    assert percentile_95(values) == pytest.approx(float(np.percentile(values, 95)), rel=1e-12, abs=1e-15)


def test_the_kl_percentile_of_a_run_with_a_missing_value_is_nan():
    assert math.isnan(percentile_95([1e-3, math.nan, 2e-3]))


@given(
    values=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=50),
    holes=st.lists(st.sampled_from([math.nan, math.inf, -math.inf]), max_size=5),
)
def test_a_series_spread_is_numpys_over_its_finite_values(values, holes):
    """Median, 95th percentile and maximum of a per-update series, its non-finite entries (a
    skipped or failed measurement) left out rather than poisoning the summary."""
    summary = spread(values + holes)
    assert summary["median"] == pytest.approx(float(np.median(values)), rel=1e-12, abs=1e-15)
    assert summary["p95"] == pytest.approx(float(np.percentile(values, 95)), rel=1e-12, abs=1e-15)
    assert summary["max"] == max(values)


def test_a_series_without_a_finite_value_has_no_spread():
    assert spread([]) is None and spread([math.nan, math.inf]) is None


def test_the_kl_meter_measures_the_rows_the_probe_does_not_read():
    """The trainer callback itself, on a real forward of 32 sequences: it measures the update's KL
    on 8 rows LoGRA's probe (8 spread rows) leaves alone, exactly the KL on those rows; a probe of
    whole batches leaves it none, and it says so."""
    from types import SimpleNamespace

    from logra_optim.probe import contexts_from_batch, default_logits_fn, inference_environment, realised_kl
    from tests.helpers.tiny import tiny_qwen2

    model, args = tiny_qwen2(), SimpleNamespace(temperature=1.0)
    input_ids = torch.randint(0, 128, (32, 6), generator=torch.Generator().manual_seed(0))
    meter, whole = demo.kl_meter("cpu", probed=8), demo.kl_meter("cpu", probed=32)
    for callback in (meter, whole):
        callback.on_train_begin(args, None, None, model=model)
    model.train()
    model(input_ids=input_ids).logits.sum().backward()  # a training forward: both meters record it
    for callback in (meter, whole):
        callback.on_pre_optimizer_step(args, None, None, model=model)
    assert len(meter.rows) == 8 and set(spread_rows(32, 8).tolist()).isdisjoint(meter.rows) and meter.held_out
    assert not whole.held_out
    expected = contexts_from_batch(input_ids[meter.rows])
    with inference_environment(model):
        base = default_logits_fn(model, expected)[expected.probe_mask]
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1e-2 * torch.randn_like(parameter))
    meter.on_optimizer_step(args, None, None, model=model)
    total, tokens = realised_kl(model, expected, base)
    assert meter.kls == [pytest.approx(float(total) / tokens, rel=1e-6)] and meter.kls[0] > 0.0
    for callback in (meter, whole):
        callback.on_train_end(args, None, None)
