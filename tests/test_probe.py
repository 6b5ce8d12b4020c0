"""The KL probe (``logra_optim.probe``): which positions it probes and how it is given them, the
JVP and finite-difference predictions (against each other, the chunked LM head against the full
logits), and the training setups it must work in (SDPA, checkpointing, autocast, bf16)."""

from __future__ import annotations

import contextlib
import copy
import types
import warnings

import pytest
import torch
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st

from logra_optim import LoGRAOptimizer, attention, control, patch_model, probe, tangents, unpatch_model
from tests.helpers.recorders import OutputShapes
from logra_optim.probe import (
    ProbeContexts,
    compact_contexts,
    contexts_from_batch,
    finite_difference_predicted_kl,
    jvp_predicted_kl,
    spread_rows,
    subsample_positions,
)
from tests.helpers.tiny import fixed_batch, tiny_qwen2


# ------------------------------------------------------------------------------------------------
# Probe contexts


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


@given(groups=st.integers(1, 16), group_size=st.integers(1, 8), samples=st.integers(1, 40))
def test_spread_rows_take_one_row_per_group_before_a_second(groups, group_size, samples):
    """An RL batch holds each prompt's completions in consecutive rows: the probe's rows are
    distinct, in order, and cover min(samples, groups) different prompts."""
    batch = groups * group_size
    rows = torch.arange(batch)[spread_rows(batch, samples)]
    assert rows.numel() == min(samples, batch)
    assert torch.equal(rows, rows.unique(sorted=True))
    assert (rows // group_size).unique().numel() == min(samples, groups)


def test_contexts_select_rows_with_their_masks():
    input_ids = torch.arange(12).view(4, 3)
    attention_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 1]])
    contexts = contexts_from_batch(input_ids, attention_mask, temperature=0.5)
    picked = contexts.select(torch.tensor([1, 3]))
    assert picked.input_ids.tolist() == [[3, 4, 5], [9, 10, 11]]
    assert torch.equal(picked.attention_mask, attention_mask[[1, 3]])
    assert torch.equal(picked.probe_mask, contexts.probe_mask[[1, 3]]) and picked.temperature == 0.5
    replaced = torch.zeros_like(contexts.probe_mask)
    replaced[2, 1] = True
    assert contexts.select(replaced.any(dim=1), replaced).tokens == 1


def test_contexts_from_batch_spreads_samples_over_the_batch():
    input_ids = torch.arange(8).unsqueeze(1).repeat(1, 3)  # row i holds token i
    contexts = contexts_from_batch(input_ids, samples=2)
    assert contexts.input_ids[:, 0].tolist() == [0, 4]
    assert contexts_from_batch(input_ids, samples=None).input_ids.shape[0] == 8


@given(
    mask=st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1, max_size=5),
    limit=st.integers(1, 40),
    seed=st.integers(0, 2**31),
)
def test_subsample_positions_keeps_a_subset_of_the_asked_size_and_only_rows_that_keep_one(mask, limit, seed):
    probe_mask = torch.tensor(mask)
    input_ids = torch.arange(probe_mask.numel()).view(probe_mask.shape)  # each row identifiable
    attention_mask = torch.ones_like(input_ids)
    contexts = ProbeContexts(input_ids, attention_mask, probe_mask, temperature=0.7)
    subset = subsample_positions(contexts, limit, seed)
    if contexts.tokens <= limit:
        assert subset is contexts
        return
    assert subset.tokens == limit and subset.temperature == 0.7
    rows = subset.input_ids[:, 0] // probe_mask.shape[1]
    assert torch.equal(rows, rows.unique(sorted=True)) and bool(subset.probe_mask.any(dim=1).all())
    assert torch.equal(subset.input_ids, input_ids[rows]) and torch.equal(subset.attention_mask, attention_mask[rows])
    assert not bool((subset.probe_mask & ~probe_mask[rows]).any())  # kept positions were probe positions
    again = subsample_positions(contexts, limit, seed)
    assert torch.equal(again.probe_mask, subset.probe_mask) and torch.equal(again.input_ids, subset.input_ids)


@given(
    rows=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 1), st.lists(st.booleans(), min_size=5, max_size=5)),
        min_size=1,
        max_size=8,
    ),
    padded=st.booleans(),
    masked=st.booleans(),
    cut=st.booleans(),
)
def test_compact_contexts_keeps_every_prefix_term_with_its_multiplicity(rows, padded, masked, cut):
    """Any per-position quantity that depends on the position's prefix only (as a causal LM's KL term
    does) sums to the same total over the compact contexts, weighted, as over the full ones. Each
    distinct sequence that probes a position is kept once, in first-seen order (copies with other
    probe positions merged into it), and with ``cut`` no column after the last probe position."""
    input_ids = torch.tensor([[token, 1, token, 2, 3] for token, _, _ in rows])  # few tokens: duplicates
    attention_mask = torch.tensor([[1, 1, 1, 1, open_] for _, open_, _ in rows])
    probe_mask = torch.tensor([mask for _, _, mask in rows])
    if padded:  # columns no row probes, as right padding leaves them
        input_ids, attention_mask = (
            torch.cat((t, torch.zeros_like(t[:, :2])), dim=1) for t in (input_ids, attention_mask)
        )
        probe_mask = torch.cat((probe_mask, torch.zeros_like(probe_mask[:, :2])), dim=1)
    contexts = ProbeContexts(input_ids, attention_mask if masked else None, probe_mask, temperature=0.7)

    def prefix_terms(c: ProbeContexts) -> torch.Tensor:  # a float64 function of each position's prefix
        weights = torch.arange(1, c.input_ids.shape[1] + 1, dtype=torch.float64)
        attention = torch.ones_like(c.input_ids) if c.attention_mask is None else c.attention_mask
        mixed = (c.input_ids.double() * weights + attention.double() * weights.sqrt()).cumsum(dim=1)
        return torch.sin(mixed + torch.arange(c.input_ids.shape[1]))[c.probe_mask]

    compact, weights = compact_contexts(contexts, cut=cut)
    assert weights.dtype == torch.float64 and weights.numel() == compact.tokens
    assert float(weights.sum()) == contexts.tokens and compact.temperature == 0.7
    assert (compact.attention_mask is None) == (not masked)
    total = float(prefix_terms(contexts).sum())
    assert float((prefix_terms(compact) * weights).sum()) == pytest.approx(total, abs=1e-9)
    if not contexts.tokens:
        assert compact is contexts
        return
    probing = [(token, open_ if masked else None) for token, open_, mask in rows if any(mask)]
    distinct = list(dict.fromkeys(probing))
    assert compact.input_ids[:, 0].tolist() == [token for token, _ in distinct]  # once each, first-seen order
    assert bool(compact.probe_mask.any(dim=1).all())  # only sequences that probe
    last = int(probe_mask.any(dim=0).nonzero()[-1])
    assert compact.input_ids.shape[1] == (last + 1 if cut else input_ids.shape[1])


def test_subsample_positions_draws_every_position_alike():
    """A uniform subset: over many seeds every position is kept about ``limit / positions`` of the
    time (so the positions' mean is estimated without bias), whatever its row or place."""
    probe_mask = torch.ones(2, 8, dtype=torch.bool)
    draws = 2000
    counts = sum(_full_mask(probe_mask, 4, seed).float() for seed in range(draws))
    # Binomial(2000, 1/4) / 2000 has a standard deviation of 0.0097: 5 of them.
    assert torch.allclose(counts / draws, torch.full((2, 8), 0.25), atol=0.05)


def _full_mask(probe_mask: torch.Tensor, limit: int, seed: int) -> torch.Tensor:
    """The positions :func:`subsample_positions` keeps, on the full ``(rows, positions)`` grid."""
    rows = torch.arange(probe_mask.shape[0]).unsqueeze(1).expand_as(probe_mask)  # each row tagged
    subset = subsample_positions(ProbeContexts(rows, None, probe_mask), limit, seed)
    full = torch.zeros_like(probe_mask)
    full[subset.input_ids[:, 0]] = subset.probe_mask
    return full


def test_set_probe_contexts_validates_shapes_and_copies():
    model = patch_model(tiny_qwen2())
    opt = LoGRAOptimizer(model, rank=4, kl_budget=1e-3)
    input_ids = fixed_batch()["input_ids"]
    with pytest.raises(ValueError, match="completion_mask .* must have the shape of input_ids"):
        opt.set_probe_contexts(input_ids, completion_mask=torch.ones(input_ids.shape[0], 3))
    with pytest.raises(ValueError, match="attention_mask"):
        opt.set_probe_contexts(input_ids, attention_mask=torch.ones(1, input_ids.shape[1]))
    opt.set_probe_contexts(input_ids)
    before = opt.kl_control.contexts().input_ids.clone()
    input_ids.fill_(0)  # the caller reuses its buffer
    assert torch.equal(opt.kl_control.contexts().input_ids, before)


def test_forwards_the_probe_cannot_replay_are_not_recorded():
    """A 4-D attention mask or packed positions: the probe runs ``model(input_ids, attention_mask)``
    and would compute other logits (or fail). The training forward goes through; the contexts are
    cleared with a warning, so the step asks for explicit ones instead of probing an older batch."""
    model = patch_model(tiny_qwen2())
    model.train()
    opt = LoGRAOptimizer(model, rank=4, kl_budget=1e-3)
    batch = fixed_batch(batch=2)
    seq = batch["input_ids"].shape[1]
    model(**batch, position_ids=torch.arange(seq).expand(2, seq))  # the default positions: recorded
    assert torch.equal(opt.kl_control.contexts().input_ids, batch["input_ids"])
    causal = torch.ones(seq, seq).tril().bool().expand(2, 1, seq, seq)
    with pytest.warns(UserWarning, match="4-D attention_mask") as caught:
        model(**batch, attention_mask=causal).loss.backward()
    assert caught[0].filename == __file__
    with pytest.raises(RuntimeError, match="no probe contexts"):
        opt.kl_control.contexts()
    packed = torch.cat((torch.arange(5), torch.arange(seq - 5))).expand(2, seq)
    model(**batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(**batch, position_ids=packed)
    assert not [w for w in caught if "not recorded" in str(w.message)]  # warned once per recorder
    with pytest.raises(RuntimeError, match="no probe contexts"):
        opt.step()
    assert opt.update_index == 0
    # Left padding with positions counted from each row's first real token: off 0, 1, … by one
    # constant per row where attended, which rotary embeddings do not see: recorded.
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions)
    assert opt.kl_control.contexts().tokens > 0


def test_a_mask_per_layer_type_and_absolute_positions_off_zero_are_not_replayed():
    """transformers takes a dict of masks (one per layer type): the training forward goes through and
    is kept with no probe position, as a 4-D mask is. Positions off ``0, 1, …`` by a constant per row
    are recorded for rotary models only: a model with learned absolute positions (GPTBigCode) would
    replay other positions on left-padded rows, so such a forward is not recorded; its default
    positions are."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    model = patch_model(tiny_qwen2()).train()
    opt = LoGRAOptimizer(model, rank=4, kl_budget=1e-3)
    batch = fixed_batch(batch=2)
    seq = batch["input_ids"].shape[1]
    causal = {"full_attention": torch.ones(seq, seq).tril().bool().expand(2, 1, seq, seq)}
    with pytest.warns(UserWarning, match="an attention_mask of type dict"):
        model(input_ids=batch["input_ids"], attention_mask=causal, labels=batch["input_ids"]).loss.backward()
    with pytest.raises(RuntimeError, match="no probe contexts"):
        opt.kl_control.contexts()

    torch.manual_seed(0)
    config = GPTBigCodeConfig(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=True)
    absolute = patch_model(GPTBigCodeForCausalLM(config), target_modules=["c_attn", "c_fc"]).train()
    opt = LoGRAOptimizer(absolute, rank=4, kl_budget=1e-3)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    absolute(input_ids=ids, attention_mask=mask)  # default positions: recorded
    assert opt.kl_control.contexts().tokens > 0
    with pytest.warns(UserWarning, match="absolute position embeddings"):
        absolute(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0))
    with pytest.raises(RuntimeError, match="no probe contexts"):
        opt.kl_control.contexts()


def test_a_vision_language_forward_with_images_is_not_replayed_without_them():
    """A vision-language training forward (TRL's GRPO on image prompts) passes ``pixel_values`` and
    the image grid: the probe's forward of ``input_ids`` alone would measure the text without the
    images and miss the vision tower's targets, so it is kept with no probe position, with a warning."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2)
    config = Qwen2VLConfig(
        text_config=dict(**text, num_key_value_heads=1, rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14),
        image_token_id=100,
        video_token_id=101,
        vision_start_token_id=102,
        vision_end_token_id=103,
    )
    model = patch_model(Qwen2VLForConditionalGeneration(config)).train()
    opt = LoGRAOptimizer(model, rank=4, kl_budget=1e-3)
    ids = torch.tensor([[1, 2, 102, 100, 103, 5, 6, 7, 8, 9]] * 2)
    model(input_ids=ids, attention_mask=torch.ones_like(ids))  # text alone: recorded
    assert opt.kl_control.contexts().tokens > 0
    images = dict(
        pixel_values=torch.randn(8, 3 * 2 * 14 * 14),
        image_grid_thw=torch.tensor([[1, 2, 2]] * 2),
        mm_token_type_ids=(ids == 100).long(),
    )
    with pytest.warns(UserWarning, match=r"inputs the probe does not replay \(image_grid_thw, mm_token_type_ids"):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, **images).loss.backward()
    with pytest.raises(RuntimeError, match="no probe contexts"):
        opt.kl_control.contexts()
    # Images given as a list of tensors, one per image, count as well; other lists do not.
    recorder = probe.ContextRecorder(tiny_qwen2(), samples=None, temperature=1.0)
    recorder.record(recorder, (), {"input_ids": ids, "sizes": [1, 2]})
    assert recorder.latest.tokens > 0
    with pytest.warns(UserWarning, match=r"inputs the probe does not replay \(images;"):
        recorder.record(recorder, (), {"input_ids": ids, "images": [torch.ones(3, 4, 4)]})
    assert recorder.latest.tokens == 0
    recorder.remove()


def test_the_probe_switches_fused_attention_in_each_sub_config_and_restores_each():
    """A multimodal config may name a kernel per tower. Each (sub-)config that names one without
    forward-AD rules runs SDPA during the probe, and every config gets its own setting back
    (transformers' setter would write the top level's into every sub-config)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    config = LlavaConfig(text_config=LlamaConfig(vocab_size=32, **small), vision_config=CLIPVisionConfig(**small))
    model = nn.Linear(2, 2)
    model.config = config
    kernels = lambda: (  # noqa: E731
        config._attn_implementation,
        config.text_config._attn_implementation,
        config.vision_config._attn_implementation,
    )
    for before, during in (
        (("flex_attention", "flex_attention", "eager"), ("sdpa", "sdpa", "eager")),
        (("sdpa", "flex_attention", "eager"), ("sdpa", "sdpa", "eager")),
    ):
        for owner, kernel in zip((config, config.text_config, config.vision_config), before):
            owner._attn_implementation_internal = kernel
        with probe.inference_environment(model):
            assert kernels() == during
        assert kernels() == before


def test_positional_arguments_are_recorded_by_name_and_a_forward_without_ids_clears_the_contexts():
    model = patch_model(tiny_qwen2())
    model.train()
    opt = LoGRAOptimizer(model, rank=4, kl_budget=1e-3)  # probe_samples=2: both rows
    ids = fixed_batch(batch=2)["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    model(ids, mask)  # model(input_ids, attention_mask)
    contexts = opt.kl_control.contexts()
    assert torch.equal(contexts.attention_mask, mask)
    assert not contexts.probe_mask[0, :4].any() and contexts.tokens == 2 * (ids.shape[1] - 1) - 4
    model(inputs_embeds=model.get_input_embeddings()(ids))  # nothing the probe could replay
    with pytest.raises(RuntimeError, match="no probe contexts"):
        opt.kl_control.contexts()


class _Wrapper(nn.Module):
    """A wrapper whose forward takes ``*args`` (as torch.compile's module and DDP do)."""

    def __init__(self, model: nn.Module, attribute: str):
        super().__init__()
        setattr(self, attribute, model)
        self.attribute = attribute

    def forward(self, *args, **kwargs):
        return getattr(self, self.attribute)(*args, **kwargs)


def test_positional_arguments_through_a_wrapper_are_named_by_the_model_inside_or_not_recorded():
    ids = fixed_batch(batch=2)["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    for attribute, named in (("module", True), ("inner", False)):  # DDP's name is known; "inner" is not
        wrapper = _Wrapper(patch_model(tiny_qwen2()), attribute)
        wrapper.train()
        opt = LoGRAOptimizer(wrapper, rank=4, kl_budget=1e-3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapper(ids, mask)
        contexts = opt.kl_control.contexts() if named else None
        if named:
            assert torch.equal(contexts.attention_mask, mask) and not caught
        else:
            assert [str(w.message) for w in caught if "behind a wrapper's *args" in str(w.message)]
            with pytest.raises(RuntimeError, match="no probe contexts"):
                opt.kl_control.contexts()


def test_a_model_unpatched_under_a_live_optimizer_is_not_recorded_and_its_step_refused():
    model = patch_model(tiny_qwen2())
    model.train()
    opt = LoGRAOptimizer(model, rank=4, kl_budget=1e-3)
    first, second = fixed_batch(seed=1), fixed_batch(seed=2)
    model(**first)
    unpatch_model(model)
    model(**second)
    # The recorder stopped at the unpatch: the contexts are still the first batch's (rows 0 and 2 of 4).
    assert torch.equal(opt.kl_control.contexts().input_ids, first["input_ids"][[0, 2]])
    with pytest.raises(RuntimeError, match="no longer bound to this optimizer"):
        opt.step()


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


def test_missing_probe_contexts_say_how_to_give_them(fitted_model):
    base, batch = fitted_model
    model = patch_model(copy.deepcopy(base))
    opt = LoGRAOptimizer(model, rank=16, kl_budget=1e-4)
    # A forward from embeddings carries no token ids to probe with.
    embeds = model.get_input_embeddings()(batch["input_ids"])
    model(inputs_embeds=embeds, labels=batch["labels"]).loss.backward()
    with pytest.raises(RuntimeError, match="set_probe_contexts"):
        opt.step()


# ------------------------------------------------------------------------------------------------
# Predictions


def _sketched_probe_inputs(fitted_model, **options):
    """A copy of the fitted model, patched, one backward of its batch into a ``LoGRAOptimizer``
    (rank 16, KL budget 1e-4, fp32 factors, ``options``); returns ``(model, optimizer, targets,
    factors, contexts)`` with each target's factor a tenth of its sketch."""
    base, batch = fitted_model
    model = patch_model(copy.deepcopy(base))
    opt = LoGRAOptimizer(model, rank=16, kl_budget=1e-4, wire_dtype=None, **options)
    model(**batch).loss.backward()
    targets = [t.state for t in opt.targets]
    return model, opt, targets, [t.sketch * 1e-1 for t in targets], opt.kl_control.contexts()


def test_jvp_and_finite_difference_probes_agree(fitted_model):
    model, opt, targets, factors, contexts = _sketched_probe_inputs(fitted_model, direction="sgd")
    weights = [p.clone() for p in model.parameters()]
    q_jvp, n_jvp, _ = jvp_predicted_kl(model, targets, factors, contexts)
    q_fd, n_fd, _ = finite_difference_predicted_kl(model, targets, factors, contexts, epsilon=1e-2)
    assert n_jvp == n_fd == contexts.tokens
    assert float(q_fd) == pytest.approx(float(q_jvp), rel=2e-2)
    # The probes never touch the weights and leave the model in train mode.
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert model.training and all(m.training for m in model.modules())
    assert all(t.probe_factor is None for t in targets)


def test_probe_on_a_subset_of_positions_predicts_their_terms_exactly(fitted_model, monkeypatch):
    """Dropping the sequences with no kept position changes nothing: the subset's prediction is the
    full contexts' one restricted to the kept positions (float64 terms, summed); and the optimizer
    probes ``probe_positions`` of them, a new draw at each update."""
    model, opt, targets, factors, contexts = _sketched_probe_inputs(fitted_model, probe_samples=4, probe_positions=5)
    subset = subsample_positions(contexts, 5, seed=3)
    restricted = ProbeContexts(contexts.input_ids, contexts.attention_mask, _full_mask(contexts.probe_mask, 5, 3))
    q_subset, n_subset, _ = jvp_predicted_kl(model, targets, factors, subset)
    q_restricted, n_restricted, _ = jvp_predicted_kl(model, targets, factors, restricted)
    assert n_subset == n_restricted == 5
    assert float(q_subset) == pytest.approx(float(q_restricted), rel=1e-5)
    seeds = []
    monkeypatch.setattr(
        control, "subsample_positions", lambda c, n, seed: seeds.append(seed) or subsample_positions(c, n, seed)
    )
    for _ in range(2):
        opt.step()
        assert opt.stats["probe_tokens"] == 5
        opt.zero_grad()
        model(**fitted_model[1]).loss.backward()
    assert opt.update_index == 2 and seeds == [1, 2]  # a new draw at each update, seeded by its index
    assert not torch.equal(_full_mask(contexts.probe_mask, 5, 1), _full_mask(contexts.probe_mask, 5, 2))


def test_the_jvp_probe_computes_sdpa_attention_in_closed_form(fitted_model, monkeypatch):
    """Every attention call of the JVP probe of an ``sdpa`` model goes through the closed form, and
    the prediction equals forward AD through torch's math attention."""
    model, opt, targets, factors, contexts = _sketched_probe_inputs(fitted_model, direction="sgd")
    calls = []
    closed_form = attention.attention_with_tangent
    monkeypatch.setattr(attention, "attention_with_tangent", lambda *a, **k: calls.append(1) or closed_form(*a, **k))
    q_closed, _, _ = jvp_predicted_kl(model, targets, factors, contexts)
    assert len(calls) == model.config.num_hidden_layers
    monkeypatch.setattr(probe, "AttentionTangentMode", contextlib.nullcontext)
    q_op_by_op, _, _ = jvp_predicted_kl(model, targets, factors, contexts)
    assert len(calls) == model.config.num_hidden_layers
    assert float(q_closed) == pytest.approx(float(q_op_by_op), rel=1e-5)


def test_the_jvp_probe_takes_elementwise_tangents_directly(fitted_model, monkeypatch):
    """The probe's elementwise ops with one plain operand (RMSNorm weights, rotary tables, ``+ eps``)
    go through ``logra_optim.tangents``, and the prediction equals torch's forward AD alone."""
    model, opt, targets, factors, contexts = _sketched_probe_inputs(fitted_model, direction="sgd")
    calls = []
    direct = tangents.binary_with_plain_operand

    def counted(*args):
        result = direct(*args)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(tangents, "binary_with_plain_operand", counted)
    q_direct, _, _ = jvp_predicted_kl(model, targets, factors, contexts)
    assert sum(calls) >= 4 * model.config.num_hidden_layers  # two norms and rotary q, k per layer at least
    monkeypatch.setattr(probe, "ElementwiseTangentMode", contextlib.nullcontext)
    q_torch, _, _ = jvp_predicted_kl(model, targets, factors, contexts)
    assert float(q_direct) > 0
    assert float(q_direct) == pytest.approx(float(q_torch), rel=1e-6)


def test_chunked_lm_head_probe_equals_the_full_logits_probe(fitted_model, monkeypatch):
    """Without a realised-KL check the JVP probe applies the LM head a few positions at a time
    (no ``positions × vocabulary`` logits); it must predict the same KL as the full-logits path."""
    import logra_optim.probe as probe

    model, opt, targets, factors, contexts = _sketched_probe_inputs(fitted_model, direction="sgd")
    q_full, n_full, logits = jvp_predicted_kl(model, targets, factors, contexts, keep_base=True)
    monkeypatch.setattr(probe, "HEAD_CHUNK_POSITIONS", 3)  # several chunks, a ragged last one
    q_chunked, n_chunked, none = jvp_predicted_kl(model, targets, factors, contexts, keep_base=False)
    assert logits is not None and none is None
    assert n_chunked == n_full == contexts.tokens and n_full > 3
    assert float(q_chunked) == pytest.approx(float(q_full), rel=1e-6)


def test_probe_with_sampled_words_estimates_the_exact_prediction(fitted_model, monkeypatch):
    """``probe_words``: the head multiplies the primal only and each position's term comes from 8 of
    the 128 words. Over 60 draws the mean is the exact prediction, at a sampling temperature other
    than 1; one draw is reproducible from its seed; a vocabulary within ``words`` takes the exact path."""
    model, opt, targets, factors, contexts = _sketched_probe_inputs(fitted_model, direction="sgd", temperature=0.7)
    assert contexts.temperature == 0.7
    exact, tokens, _ = jvp_predicted_kl(model, targets, factors, contexts, keep_base=False)
    draws = torch.tensor(
        [
            float(jvp_predicted_kl(model, targets, factors, contexts, keep_base=False, words=8, seed=s)[0])
            for s in range(60)
        ],
        dtype=torch.float64,
    )
    assert float(draws.mean()) == pytest.approx(float(exact), abs=5 * float(draws.std()) / 60**0.5)
    assert float(draws.std()) > 0  # a sample, not the exact terms
    again = jvp_predicted_kl(model, targets, factors, contexts, keep_base=False, words=8, seed=7)
    assert float(again[0]) == float(draws[7]) and again[1] == tokens
    whole = jvp_predicted_kl(model, targets, factors, contexts, keep_base=False, words=128)
    assert float(whole[0]) == float(exact)
    # The optimizer draws with the update index as the seed.
    seeds = []
    jvp = control.jvp_predicted_kl
    monkeypatch.setattr(
        control, "jvp_predicted_kl", lambda *a, **k: seeds.append((k["words"], k["seed"])) or jvp(*a, **k)
    )
    model, opt, *_ = _sketched_probe_inputs(fitted_model, probe_words=8)
    opt.step()
    assert seeds == [(8, 1)] and opt.stats["predicted_kl"] > 0


@pytest.mark.parametrize("update", [0, 1, 2**32 - 1])
def test_word_draws_are_a_stream_apart_from_the_positions_draw(update):
    """Both are seeded by the update index; the words' uniforms must not repeat the permutation's
    (the CPU generator keeps a seed's low 32 bits only)."""
    words = probe.word_uniforms(40, 2, update).flatten()
    positions = torch.rand(80, generator=torch.Generator().manual_seed(update), dtype=torch.float64)
    assert not torch.equal(words, positions)
    assert torch.equal(words, probe.word_uniforms(40, 2, update).flatten())  # reproducible


@given(
    rows=st.integers(1, 9),
    words=st.integers(1, 6),
    hidden=st.integers(1, 5),
    chunk_rows=st.integers(1, 10),
    seed=st.integers(0, 2**16),
)
def test_word_tangents_are_the_tangent_logits_at_the_words(rows, words, hidden, chunk_rows, seed):
    """Every chunking of the gather (``chunk_rows`` positions, the last one short) gives
    ``(ḣ Wᵀ)[s, indices[s]]``, against a float64 reference."""
    generator = torch.Generator().manual_seed(seed)
    vocabulary = 7
    weight = torch.randn(vocabulary, hidden, generator=generator)
    tangent = torch.randn(rows, hidden, generator=generator)
    indices = torch.randint(0, vocabulary, (rows, words), generator=generator)
    expected = (tangent.double() @ weight.double().T).gather(1, indices)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(probe, "WORD_GATHER_BYTES", chunk_rows * words * hidden * 4)
        got = probe.word_tangents(tangent, weight, indices)
    assert got.dtype == weight.dtype and got.shape == (rows, words)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_sampled_words_do_not_depend_on_the_head_chunks(fitted_model, monkeypatch):
    """The uniforms are drawn for every position at once, so several chunks of the head (and of
    the gathered rows) give each position the same words and the same terms as one chunk."""
    model, opt, targets, factors, contexts = _sketched_probe_inputs(fitted_model, direction="sgd")
    one, _, _ = jvp_predicted_kl(model, targets, factors, contexts, keep_base=False, words=8, seed=3)
    monkeypatch.setattr(probe, "HEAD_CHUNK_POSITIONS", 3)  # 6-position chunks without the tangent half
    # 2 positions' gathered rows at a time (8 words of fp32 hidden states)
    monkeypatch.setattr(probe, "WORD_GATHER_BYTES", 2 * 8 * model.config.hidden_size * 4)
    several, _, _ = jvp_predicted_kl(model, targets, factors, contexts, keep_base=False, words=8, seed=3)
    assert contexts.tokens > 6
    assert float(several) == pytest.approx(float(one), rel=1e-12)


def test_sampled_words_with_bf16_products_predict_within_a_percent(fitted_model):
    model, opt, targets, factors, contexts = _sketched_probe_inputs(fitted_model, direction="sgd")
    fp32, _, _ = jvp_predicted_kl(model, targets, factors, contexts, keep_base=False, words=8, seed=5)
    bf16, _, _ = jvp_predicted_kl(
        model, targets, factors, contexts, keep_base=False, compute_dtype=torch.bfloat16, words=8, seed=5
    )
    assert float(bf16) == pytest.approx(float(fp32), rel=1e-2)


@pytest.mark.parametrize(("vocabulary", "sampled"), [(8192, True), (8191, False)])
def test_the_optimizer_samples_words_by_default_from_8192_words_on(vocabulary, sampled, monkeypatch):
    calls = []
    sample = probe.sample_words
    monkeypatch.setattr(probe, "sample_words", lambda *a, **k: calls.append(1) or sample(*a, **k))
    model = patch_model(tiny_qwen2(vocab_size=vocabulary, hidden_size=32, intermediate_size=32, head_dim=16))
    opt = LoGRAOptimizer(model, rank=4, kl_budget=1e-3, update_ratio=1e-2)
    batch = fixed_batch(vocab_size=vocabulary, batch=2, seq=8)
    model(**batch).loss.backward()
    opt.step()
    assert bool(calls) == sampled and opt.stats["predicted_kl"] > 0


@pytest.mark.parametrize(
    "setting", [dict(probe="finite_difference"), dict(realised_kl_check=True), dict(probe_logits_fn=lambda m, c: None)]
)
def test_an_explicit_word_count_is_refused_where_every_word_is_read(setting):
    model = patch_model(tiny_qwen2())
    with pytest.raises(ValueError, match="probe_words=16 needs the JVP probe"):
        LoGRAOptimizer(model, rank=4, kl_budget=1e-3, probe_words=16, **setting)
    LoGRAOptimizer(model, rank=4, kl_budget=1e-3, **setting)  # "auto" reads every word there


@pytest.mark.parametrize("words", [3, 0, 2.5, True, "all", "64"])
def test_probe_words_must_leave_two_draws(words):
    model = patch_model(tiny_qwen2())
    with pytest.raises(ValueError, match="probe_words must be 'auto', None"):
        LoGRAOptimizer(model, rank=4, kl_budget=1e-3, probe_words=words)


def test_probe_words_auto_samples_large_vocabularies_only():
    assert probe.words_to_sample("auto", 151_936) == probe.AUTO_WORDS == 64
    assert probe.words_to_sample("auto", probe.AUTO_WORDS_MIN_VOCABULARY) == 64
    assert probe.words_to_sample("auto", probe.AUTO_WORDS_MIN_VOCABULARY - 1) is None  # every word
    assert probe.words_to_sample(None, 151_936) is None
    assert probe.words_to_sample(16, 32_000) == 16
    assert probe.words_to_sample(128, 128) is None  # the sample would be every word: take them exactly
    assert LoGRAOptimizer(patch_model(tiny_qwen2()), rank=4, kl_budget=1e-3).kl_control.options.probe_words == "auto"


def test_probe_runs_once_per_distinct_sequence_and_predicts_the_same_kl(fitted_model):
    """Without a realised-KL check the probe's dual forward reads each distinct sequence once, up to
    its last probe position, and weights its terms: the prediction of contexts with repeated
    sequences and unprobed trailing columns is the full contexts' one (the uncompacted path with
    ``keep_base=True``), from a forward of fewer rows."""
    model, opt, targets, factors, contexts = _sketched_probe_inputs(fitted_model, direction="sgd")
    repeated = contexts.select(torch.tensor([0, 1, 0, 0, 1, 0]))  # four copies of one, two of the other
    probe_mask = repeated.probe_mask.clone()
    probe_mask[:, -3:] = False  # the last three columns predict no trained token
    repeated = ProbeContexts(repeated.input_ids, repeated.attention_mask, probe_mask)
    q_full, n_full, logits = jvp_predicted_kl(model, targets, factors, repeated, keep_base=True)
    shapes = OutputShapes()
    with shapes:
        q_compact, n_compact, none = jvp_predicted_kl(model, targets, factors, repeated, keep_base=False)
    assert logits is not None and none is None and n_compact == n_full == repeated.tokens
    assert float(q_compact) == pytest.approx(float(q_full), rel=1e-5)
    hidden = model.config.hidden_size
    width = repeated.input_ids.shape[1]

    def hidden_states(shapes):
        return [shape for shape in shapes.shapes if len(shape) == 3 and shape[-1] == hidden]

    assert (2, width - 3, hidden) in hidden_states(shapes)  # two distinct rows, three columns fewer
    assert not any(shape[0] == 6 or shape[1] == width for shape in hidden_states(shapes))
    # The two sequences' terms differ, so weights tied to the wrong one would change the sum (4:2).
    q_each = [float(jvp_predicted_kl(model, targets, factors, repeated.select([row]))[0]) for row in (0, 1)]
    assert abs(q_each[0] - q_each[1]) > 1e-3 * float(q_full)
    assert float(q_full) == pytest.approx(4 * q_each[0] + 2 * q_each[1], rel=1e-5)
    # Base logits (a realised-KL check) or a custom logits function: the contexts as given.
    for keep_base, logits_fn in ((True, probe.default_logits_fn), (False, lambda m, c: probe.default_logits_fn(m, c))):
        shapes = OutputShapes()
        with shapes:
            q, n, _ = jvp_predicted_kl(model, targets, factors, repeated, logits_fn, keep_base=keep_base)
        assert (6, width, hidden) in hidden_states(shapes) and n == repeated.tokens
        assert float(q) == pytest.approx(float(q_full), rel=1e-5)


def test_length_dependent_rotary_types_are_found_in_modules_and_configs():
    """Per-layer-type rotary names on a module (Gemma3's), a wrapper without a config around it (as
    DDP puts), or only a config's ``rope_parameters``: a "dynamic" or "longrope" type anywhere counts."""
    rotary = nn.Module()
    rotary.rope_type = {"full_attention": "dynamic", "sliding_attention": "default"}
    wrapper = nn.Module()
    wrapper.module = nn.Sequential(nn.Linear(2, 2), rotary)
    assert probe.positions_depend_on_length(wrapper)
    rotary.rope_type = {"full_attention": "default", "sliding_attention": "yarn"}
    assert not probe.positions_depend_on_length(wrapper)
    configured = nn.Linear(2, 2)
    configured.config = types.SimpleNamespace(rope_parameters={"rope_type": "longrope", "factor": 4.0})
    assert probe.positions_depend_on_length(configured)
    configured.config.rope_parameters = {"full_attention": {"rope_type": "dynamic"}}
    assert probe.positions_depend_on_length(configured)
    configured.config.rope_parameters = {"rope_type": "llama3", "factor": 8.0}
    assert not probe.positions_depend_on_length(configured)
    assert not probe.positions_depend_on_length(tiny_qwen2())


def test_probe_keeps_every_column_where_rotary_positions_depend_on_the_length(monkeypatch):
    """LongRoPE (Phi-3's long-context variants) and dynamic NTK choose their frequencies from the
    sequence's length, so cutting columns would change the logits before them: there the probe
    keeps every column (and still reads each distinct sequence once), and predicts the full KL."""
    from transformers import Phi3Config, Phi3ForCausalLM

    head_dim = 8
    torch.manual_seed(0)
    config = Phi3Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        original_max_position_embeddings=4,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * (head_dim // 2),
            "long_factor": [4.0] * (head_dim // 2),
            "original_max_position_embeddings": 4,
        },
    )
    model = patch_model(Phi3ForCausalLM(config))
    assert probe.positions_depend_on_length(model)
    opt = LoGRAOptimizer(model, rank=4, kl_budget=1e-4, direction="sgd", wire_dtype=None)
    input_ids = torch.randint(3, 32, (2, 10), generator=torch.Generator().manual_seed(1))
    probe_mask = torch.zeros(2, 10, dtype=torch.bool)
    probe_mask[:, 1:3] = True  # cut to 3 columns, LongRoPE would take its short factors (≤ 4), at 10 its long ones
    model.train()
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    states = [t.state for t in opt.targets]
    factors = [state.sketch * 1e-1 for state in states]
    contexts = ProbeContexts(input_ids[[0, 1, 0]], None, probe_mask[[0, 1, 0]])
    q_full, _, _ = jvp_predicted_kl(model, states, factors, contexts, keep_base=True)
    shapes = OutputShapes()
    with shapes:
        q_compact, _, _ = jvp_predicted_kl(model, states, factors, contexts, keep_base=False)
    assert (2, 10, config.hidden_size) in shapes.shapes  # two distinct rows, every column
    assert float(q_compact) == pytest.approx(float(q_full), rel=1e-5)
    monkeypatch.setattr(probe, "positions_depend_on_length", lambda model: False)
    q_cut, _, _ = jvp_predicted_kl(model, states, factors, contexts, keep_base=False)
    assert float(q_cut) != pytest.approx(float(q_full), rel=1e-3)  # what cutting would have predicted


# ------------------------------------------------------------------------------------------------
# Training setups and precision


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


@pytest.mark.parametrize("words", ["auto", 8])  # every word of the 128, and a sample of 8
def test_probe_inside_autocast_matches_fp32(fitted_model, words):
    base, batch = fitted_model
    predicted = []
    for autocast in (False, True):
        model = patch_model(copy.deepcopy(base))
        opt = LoGRAOptimizer(
            model, rank=16, kl_budget=1e-4, update_ratio=5e-3, alpha_max=100.0, wire_dtype=None, probe_words=words
        )
        model(**batch).loss.backward()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            opt.step()
        predicted.append(opt.stats["predicted_kl"])
    # bf16 activations in the probe forward: a few percent, not the orders of magnitude a lost
    # low-rank tangent (rounded to bf16 before it is added) would give.
    assert predicted[1] == pytest.approx(predicted[0], rel=0.1)


def test_finite_difference_probe_on_bf16_weights_warns():
    model = patch_model(tiny_qwen2(dtype=torch.bfloat16))
    with pytest.warns(UserWarning, match="16-bit target weights"):
        LoGRAOptimizer(model, rank=4, kl_budget=1e-3, probe="finite_difference")


# ------------------------------------------------------------------------------------------------
# The chunked LM head is used only where it reproduces the model's own logits


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
def test_chunked_head_falls_back_when_it_misses_a_logit_multiplier(multiplier, monkeypatch):
    chunked = []
    terms = probe._chunked_head_kl_terms
    monkeypatch.setattr(probe, "_chunked_head_kl_terms", lambda *a: chunked.append(1) or terms(*a))
    model = patch_model(_scaled_logits_model(multiplier))
    opt = LoGRAOptimizer(model, rank=4, kl_budget=1e-4, direction="sgd", wire_dtype=None)
    model.train()
    model(**fixed_batch()).loss.backward()
    states = [t.state for t in opt.targets]
    factors = [s.sketch * 1e-1 for s in states]
    contexts = opt.kl_control.contexts()
    q_full, _, _ = jvp_predicted_kl(model, states, factors, contexts, keep_base=True)
    q_fast, _, _ = jvp_predicted_kl(model, states, factors, contexts, keep_base=False)
    assert float(q_fast) == pytest.approx(float(q_full), rel=1e-5)
    assert bool(chunked) == (multiplier == 1.0)  # the chunked path only where it is exact
    assert torch.isfinite(q_full) and float(q_full) > 0


def test_probe_computes_x_projection_once_for_siblings_with_the_same_result(fitted_model):
    """Siblings (q/k/v, gate/up) share one ``A`` and the probe reuses ``x Aᵀ`` between them; giving
    every target its own copy of the same ``A`` (no reuse) must predict the same KL."""
    from logra_optim.sketch import SharedProjection

    base, batch = fitted_model
    model = patch_model(copy.deepcopy(base))
    opt = LoGRAOptimizer(model, rank=8, kl_budget=1e-4, direction="sgd", wire_dtype=None)
    model(**batch).loss.backward()
    targets = [t.state for t in opt.targets]
    assert len({id(t.shared_projection) for t in targets}) == 4 * model.config.num_hidden_layers
    factors = [t.sketch * 1e-1 for t in targets]
    contexts = opt.kl_control.contexts()
    with OutputShapes() as shared_run:
        shared = jvp_predicted_kl(model, targets, factors, contexts, keep_base=True)
    originals = [t.shared_projection for t in targets]
    for t in targets:
        t.set_projection(SharedProjection(t.shared_projection.spec, t.shared_projection.device))
    with OutputShapes() as separate_run:
        separate = jvp_predicted_kl(model, targets, factors, contexts, keep_base=True)
    products = tuple(contexts.input_ids.shape) + (8,)  # x Aᵀ: (sequences, positions, r)
    layers = model.config.num_hidden_layers
    assert shared_run.shapes.count(products) == 4 * layers  # one per shared input…
    assert separate_run.shapes.count(products) == 7 * layers  # …where separate A's need one per target
    for t, original in zip(targets, originals):
        t.set_projection(original)
    torch.testing.assert_close(shared[0], separate[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(shared[2], separate[2], rtol=0, atol=0)


def test_probe_in_bf16_runs_its_products_in_bf16_and_predicts_within_a_percent(fitted_model):
    """``probe_dtype=torch.bfloat16``: the weight products of the dual forward are bf16 (seen at the
    dispatcher), the prediction stays within 1% of the fp32 probe's, and the weights are untouched."""
    from tests.helpers.recorders import MatmulDtypes

    base, batch = fitted_model
    model = patch_model(copy.deepcopy(base))
    opt = LoGRAOptimizer(model, rank=16, kl_budget=1e-4, wire_dtype=None)
    model(**batch).loss.backward()
    targets = [t.state for t in opt.targets]
    factors = [t.sketch * 1e-2 for t in targets]
    contexts = opt.kl_control.contexts()
    weights = [p.clone() for p in model.parameters()]
    with MatmulDtypes() as fp32_run:
        q32, n32, _ = jvp_predicted_kl(model, targets, factors, contexts, keep_base=False)
    with MatmulDtypes() as bf16_run:
        q16, n16, _ = jvp_predicted_kl(model, targets, factors, contexts, keep_base=False, compute_dtype=torch.bfloat16)
    assert fp32_run.dtypes == {torch.float32, torch.float64}  # float64: the KL terms
    assert bf16_run.dtypes == {torch.bfloat16, torch.float32, torch.float64}  # fp32: −(x Aᵀ) Fᵀ
    assert n16 == n32 and float(q16) == pytest.approx(float(q32), rel=1e-2)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert not torch.is_autocast_enabled("cpu")
