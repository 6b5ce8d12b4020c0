"""The JVP probe's chunked LM head is used only where it reproduces the model's own logits."""

from __future__ import annotations

import pytest
import torch

from logra_optim import LoGRAOptimizer, patch_model
from logra_optim.probe import jvp_predicted_kl
from tests.helpers.tiny import fixed_batch, tiny_qwen2


def _scaled_logits_model(multiplier: float):
    """A model that scales its logits in ``forward`` under a config name no list could know
    (as FalconH1's ``lm_head_multiplier`` does)."""
    model = tiny_qwen2(seed=5)
    model.config.some_head_multiplier = multiplier
    forward = model.forward

    def scaled_forward(*args, **kwargs):
        output = forward(*args, **kwargs)
        output.logits = output.logits * model.config.some_head_multiplier
        return output

    model.forward = scaled_forward
    return model


@pytest.mark.parametrize("multiplier", [1.0, 2.0])
def test_chunked_head_falls_back_when_it_misses_a_logit_multiplier(multiplier):
    model = patch_model(_scaled_logits_model(multiplier))
    opt = LoGRAOptimizer(model, rank=4, kl_budget=1e-4, direction="sgd", wire_dtype=None)
    model.train()
    model(**fixed_batch()).loss.backward()
    states = [t.state for t in opt.targets]
    factors = [s.sketch * 1e-1 for s in states]
    contexts = opt.kl_control.contexts()
    q_full, _, _ = jvp_predicted_kl(model, states, factors, contexts, keep_base=True)
    q_fast, _, base = jvp_predicted_kl(model, states, factors, contexts, keep_base=False)
    assert float(q_fast) == pytest.approx(float(q_full), rel=1e-5)
    assert (base is None) == (multiplier == 1.0)  # the chunked path only where it is exact
    assert torch.isfinite(q_full) and float(q_full) > 0
