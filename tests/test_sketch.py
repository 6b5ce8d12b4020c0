"""Sketch accumulation inside backward (docs/method.md §1): ``S += gᵀ (x Aᵀ)`` equals ``G Aᵀ`` with
``G = gᵀ x`` computed densely in float64, without ever saving ``x`` or forming a d×k gradient."""

from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from logra_optim import LoGRAOptimizer, make_projection, patch_model, projection_seed
from logra_optim.projection import ProjectionSpec
from logra_optim.sketch import GRAPH_ANCHOR, SharedProjection, SketchBank, generated, sketched_linear
from tests.helpers.recorders import OutputShapes, SavedTensors
from tests.helpers.reference import U16, U32, dense_gradient, dense_sketch
from tests.helpers.tiny import OneLinear, fixed_batch, tiny_qwen2
from logra_optim.patching import target_state

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sketch_error_bound(g, x, a, dtype, n, k):
    """Elementwise forward-error bound for ``S = gᵀ (x Aᵀ)``: the rounding errors of both products
    are bounded by ``γ · |g|ᵀ |x| |A|ᵀ``. fp32: ``γ = (n + k + 2)·u``. bf16: inputs, ``A`` cast to
    bf16, ``x Aᵀ`` and the d×r product are each rounded once to bf16 (fp32 accumulation inside the
    GEMMs), so ``γ ≈ 4·u_bf16`` on top of the fp32 accumulation term."""
    scale = g.abs().t() @ (x.abs() @ a.abs().t())
    gamma = (n + k + 2) * U32 + (4 * U16 if dtype == torch.bfloat16 else 0.0)
    return gamma * scale


def random_problem(b, t, k, d, generator, dtype):
    """Activations (with a spread of per-feature scales) and output gradients, already in ``dtype``
    so that their float64 copies are exactly the values the kernel sees."""
    x = (torch.randn(b, t, k, generator=generator) * torch.exp(torch.randn(1, 1, k, generator=generator))).to(dtype)
    g = torch.randn(b, t, d, generator=generator).to(dtype)
    return x, g


@given(
    b=st.integers(1, 3),
    t=st.integers(1, 6),
    k=st.integers(1, 24),
    d=st.integers(1, 24),
    r=st.integers(1, 16),
    bias=st.booleans(),
    kind=st.sampled_from(["rademacher", "gaussian"]),
    dtype=st.sampled_from(list(DTYPES)),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=80)
def test_sketched_linear_matches_dense_float64(b, t, k, d, r, bias, kind, dtype, seed):
    dtype = DTYPES[dtype]
    generator = torch.Generator().manual_seed(seed)
    x, g = random_problem(b, t, k, d, generator, dtype)
    x.requires_grad_(True)
    weight = (torch.randn(d, k, generator=generator) / math.sqrt(k)).to(dtype)
    bias_t = torch.randn(d, generator=generator).to(dtype).requires_grad_(True) if bias else None
    shared = SharedProjection(ProjectionSpec(seed, r, k, kind))
    a = make_projection(seed, r, k, kind)
    sketch = torch.zeros(d, r)

    y = sketched_linear(x, weight, bias_t, shared, sketch)
    assert torch.equal(y, F.linear(x, weight, bias_t))  # the forward is the plain linear, bit for bit
    y.backward(g)

    n = b * t
    x64, g64, a64, w64 = x.detach().double().reshape(n, k), g.double().reshape(n, d), a.double(), weight.double()
    expected = dense_sketch(g64, x64, a64)
    assert sketch.dtype == torch.float32
    assert ((sketch.double() - expected).abs() <= sketch_error_bound(g64, x64, a64, dtype, n, k)).all()
    assert weight.grad is None

    # Input and bias gradients are the ordinary ones.
    grad_x = x.grad.double().reshape(n, k)
    gamma = (d + 2) * U32 + (2 * U16 if dtype == torch.bfloat16 else 0.0)
    assert x.grad.dtype == dtype
    assert ((grad_x - g64 @ w64).abs() <= gamma * (g64.abs() @ w64.abs())).all()
    if bias:
        gamma = (n + 2) * U32 + (2 * U16 if dtype == torch.bfloat16 else 0.0)
        assert ((bias_t.grad.double() - g64.sum(0)).abs() <= gamma * g64.abs().sum(0)).all()


@given(
    n=st.integers(2, 40),
    k=st.integers(1, 20),
    d=st.integers(1, 20),
    r=st.integers(1, 10),
    cuts=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=5),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=60)
def test_microbatch_accumulation_equals_one_batch(n, k, d, r, cuts, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=generator)
    g = torch.randn(n, d, generator=generator)
    weight = torch.randn(d, k, generator=generator)
    spec = ProjectionSpec(seed, r, k, "gaussian")
    a = spec.generate()
    bounds = sorted({0, n, *(int(c * n) for c in cuts)})

    accumulated = torch.zeros(d, r)
    for start, stop in zip(bounds, bounds[1:]):
        sketched_linear(x[start:stop], weight, None, SharedProjection(spec), accumulated).backward(g[start:stop])
    single = torch.zeros(d, r)
    sketched_linear(x, weight, None, SharedProjection(spec), single).backward(g)

    expected = dense_sketch(g, x, a)
    bound = sketch_error_bound(g.double(), x.double(), a.double(), torch.float32, n, k)
    assert ((accumulated.double() - expected).abs() <= bound).all()
    assert ((accumulated.double() - single.double()).abs() <= 2 * bound).all()


@given(
    d=st.integers(1, 16),
    k=st.integers(1, 16),
    r_fraction=st.floats(0.0, 1.0),
    microbatches=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 5)), min_size=1, max_size=4),
    kind=st.sampled_from(["rademacher", "gaussian"]),
    dtype=st.sampled_from(list(DTYPES)),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=40)
def test_patched_linear_with_optimizer_accumulates_dense_reference(d, k, r_fraction, microbatches, kind, dtype, seed):
    """The public path: patch_model on a named nn.Linear, LoGRAOptimizer binding A (seeded from
    the module name, update index 0) and several backward calls before any step."""
    dtype = DTYPES[dtype]
    r = 1 + int(r_fraction * (min(d, k) - 1))
    model = OneLinear(k, d, seed=seed % 1000).to(dtype)
    patch_model(model, target_modules=["proj"])
    _optimizer = LoGRAOptimizer(model, rank=r, projection=kind, lr=1.0, seed=seed)
    target = target_state(model.proj)
    assert torch.equal(target.generate_projection(), make_projection(projection_seed(seed, 0, "proj"), r, k, kind))

    generator = torch.Generator().manual_seed(seed)
    dense_grad = torch.zeros(d, k, dtype=torch.float64)
    bound = torch.zeros(d, r, dtype=torch.float64)
    a64 = target.generate_projection().double()
    for b, t in microbatches:
        x, g = random_problem(b, t, k, d, generator, dtype)
        model(x).backward(g)
        x64, g64 = x.double().reshape(-1, k), g.double().reshape(-1, d)
        dense_grad += dense_gradient(g64, x64)
        bound += sketch_error_bound(g64, x64, a64, dtype, b * t, k)
    assert model.proj.weight.grad is None and model.proj.bias.grad is None
    assert ((target.sketch.double() - dense_grad @ a64.t()).abs() <= bound).all()


@pytest.mark.parametrize("kind", ["rademacher", "gaussian"])
def test_sketch_reconstruction_is_unbiased(kind):
    """E[S A] = G: average the reconstruction over M independently seeded projections and compare
    every entry with G in units of its standard error. For one draw,
    Var[(S A)_ab] = (‖G_a‖² + (κ − 1) G_ab²) / r with κ = 0 (Rademacher) or 2 (Gaussian); the mean of
    M draws has 1/M of it. Bonferroni over the d·k entries at |z| < 5, plus the mean z² ≈ 1, which
    fails if the projection is mis-scaled (biased) or the spread is not the predicted one.

    Two siblings read the same ``x`` and share one ``A`` per draw (``share_projections``): each
    one's reconstruction must be unbiased on its own."""
    d, k, r, m, n = 12, 40, 4, 300, 30
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, k, generator=generator)
    gs = [torch.randn(n, d, generator=generator) for _ in range(2)]
    weights = [torch.randn(d, k, generator=generator) for _ in range(2)]
    dense_grads = [dense_gradient(g, x) for g in gs]

    totals = [torch.zeros(d, k, dtype=torch.float64) for _ in range(2)]
    for i in range(m):
        shared = SharedProjection(ProjectionSpec(projection_seed(0, i, "model.layers.0.mlp.up_proj"), r, k, kind))
        a = shared.generate()
        sketches = [torch.zeros(d, r) for _ in range(2)]
        outputs = [sketched_linear(x, w, None, shared, s) for w, s in zip(weights, sketches)]
        torch.autograd.backward(outputs, gs)
        for total, sketch in zip(totals, sketches):
            total += sketch.double() @ a.double()

    kappa = 0.0 if kind == "rademacher" else 2.0
    for total, dense_grad in zip(totals, dense_grads):
        mean = total / m
        row_sq = dense_grad.square().sum(dim=1, keepdim=True)
        variance = (row_sq + (kappa - 1.0) * dense_grad.square()) / (r * m)
        z = (mean - dense_grad) / variance.sqrt()
        assert z.abs().max() < 5.0
        assert 0.75 < z.square().mean() < 1.25


# --------------------------------------------------------------------------------------------------
# What is saved for backward, and what backward forms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_patched_linear_saves_only_the_projected_input_and_its_weight(dtype):
    n_tokens, k, d, r = 5, 12, 7, 3  # distinct sizes so shapes identify tensors
    model = OneLinear(k, d).to(dtype)
    reference = OneLinear(k, d).to(dtype)
    x = torch.randn(1, n_tokens, k, dtype=dtype, requires_grad=True)

    # The unpatched layer saves x itself: the check below can see it.
    with SavedTensors() as unpatched:
        reference(x)
    assert any(t.shape[-1] == k and t.numel() == n_tokens * k for t in unpatched.saved)

    patch_model(model, target_modules=["proj"])
    _optimizer = LoGRAOptimizer(model, rank=r, lr=1.0)
    with SavedTensors() as patched:
        y = model(x)
    shapes = sorted(tuple(t.shape) for t in patched.saved)
    assert shapes == sorted([(1, n_tokens, r), (d, k)])
    projected = next(t for t in patched.saved if t.shape[-1] == r)
    assert projected.dtype == dtype  # activation dtype, not fp32
    saved_weight = next(t for t in patched.saved if t.shape == (d, k))
    assert saved_weight.data_ptr() == model.proj.weight.data_ptr()  # the parameter, not a copy
    y.sum().backward()
    assert target_state(model.proj).sketch.abs().sum() > 0


def test_no_target_input_is_saved_in_a_training_forward_of_qwen2():
    """In a whole decoder, no tensor that is the input of a target may be saved for backward (other
    ops legitimately save same-shaped tensors, so storage identity, not shape, is checked)."""
    batch = fixed_batch()

    def target_inputs_and_saved(model):
        inputs, handles = [], []
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}:
                handles.append(module.register_forward_pre_hook(lambda m, args: inputs.append(args[0])))
        with SavedTensors() as recorder:
            model(**batch).loss.backward()
        for handle in handles:
            handle.remove()
        # Storage identity: linear may save a reshaped view of its input rather than the input.
        saved = {t.untyped_storage().data_ptr() for t in recorder.saved}
        return [t.untyped_storage().data_ptr() in saved for t in inputs]

    plain = tiny_qwen2()
    for p in plain.parameters():
        p.requires_grad_(False)
    for name, p in plain.named_parameters():
        if "layers" in name and "norm" not in name:
            p.requires_grad_(True)
    plain.train()
    found = target_inputs_and_saved(plain)
    assert len(found) == 14 and all(found)  # an ordinary model saves every target's input

    patched = patch_model(tiny_qwen2())
    _optimizer = LoGRAOptimizer(patched, rank=4, lr=1.0)
    patched.train()
    found = target_inputs_and_saved(patched)
    assert len(found) == 14 and not any(found)
    assert all(m.weight.grad is None for m in patched.modules() if hasattr(m, "_logra"))


def test_shared_projection_reuses_a_product_only_for_the_same_unchanged_input():
    """``x Aᵀ`` is reused for the same tensor while it is unchanged and computed in the same dtype;
    an in-place change, another autocast state or another tensor recomputes it, and it is dropped
    when its input is freed."""
    generator = torch.Generator().manual_seed(0)
    shared = SharedProjection(ProjectionSpec(3, 4, 12))
    a = make_projection(3, 4, 12)
    x = torch.randn(5, 12, generator=generator)
    first = shared.project(x)
    assert shared.project(x) is first and torch.equal(first, x @ a.t())
    x.mul_(2.0)  # in place: the version changes, with the product of the old values cached
    assert torch.equal(shared.project(x), x @ a.t()) and not torch.equal(first, x @ a.t())
    second = shared.project(x)
    assert shared.project(x.clone()) is not second  # equal values, another tensor
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert shared.project(x).dtype == torch.bfloat16
    assert shared.project(x).dtype == torch.float32
    assert shared.project(x, torch.float64).dtype == torch.float64  # the probe's fp32/float64 request
    assert shared.holds_product
    del x
    gc.collect()
    assert not shared.holds_product  # nothing kept past the input's lifetime


@pytest.mark.parametrize("share", [True, False])
def test_siblings_share_one_projection_and_one_saved_product(share):
    """With ``share_projections`` q/k/v and gate/up each hold one ``A`` and one ``x Aᵀ`` per forward,
    computed once and saved once: 4 products per decoder layer instead of 7 (o and down read
    inputs of their own). Without it, one per target, as in the paper."""
    rank = 5  # no dimension of the tiny model
    model = patch_model(tiny_qwen2())
    optimizer = LoGRAOptimizer(model, rank=rank, lr=1.0, share_projections=share)
    layers = model.config.num_hidden_layers
    distinct = {id(t.state.shared_projection) for t in optimizer.targets}
    assert len(distinct) == (4 if share else 7) * layers
    attention = model.model.layers[0].self_attn
    same = target_state(attention.q_proj).shared_projection is target_state(attention.k_proj).shared_projection
    assert same == share
    model.train()
    with SavedTensors() as saved, OutputShapes() as produced:
        loss = model(**fixed_batch()).loss
    saved_products = {t.untyped_storage().data_ptr() for t in saved.saved if t.dim() and t.shape[-1] == rank}
    assert len(saved_products) == (4 if share else 7) * layers
    products = [shape for shape in produced.projected_inputs(rank) if len(shape) == 3]  # not Aᵀ views
    assert len(products) == (4 if share else 7) * layers  # computed once, too
    loss.backward()
    assert all(bool(t.state.sketch.any()) for t in optimizer.targets)


class CountingGenerations:
    """Counts every ``A`` generated (through :meth:`ProjectionSpec.generate`) while active."""

    def __init__(self, monkeypatch):
        self.specs: list[ProjectionSpec] = []
        original = ProjectionSpec.generate

        def generate(spec, *args, **kwargs):
            self.specs.append(spec)
            return original(spec, *args, **kwargs)

        monkeypatch.setattr(ProjectionSpec, "generate", generate)


@pytest.mark.parametrize("share", [True, False])
def test_a_forward_generates_each_projection_once_and_nothing_keeps_it(monkeypatch, share):
    """``A`` is generated in the forward, once per group of siblings sharing it (4 per decoder layer
    shared, 7 separate), and no tensor of ``A``'s size outlives its use: the bound optimizer keeps
    what determines ``A``, not ``A``."""
    rank = 5
    model = patch_model(tiny_qwen2())
    optimizer = LoGRAOptimizer(model, rank=rank, lr=1e-3, share_projections=share)
    counter = CountingGenerations(monkeypatch)
    model.train()
    model(**fixed_batch()).loss.backward()
    layers = model.config.num_hidden_layers
    assert len(counter.specs) == (4 if share else 7) * layers
    assert len(set(counter.specs)) == len(counter.specs)
    projections = {id(t.state.shared_projection): t.state.shared_projection for t in optimizer.targets}.values()
    assert all(not projection.holds_product for projection in projections)
    for projection in projections:
        assert not any(isinstance(value, torch.Tensor) for value in vars(projection).values())
    widths = {t.shape[1] for t in optimizer.targets}
    held = [o for o in gc.get_objects() if type(o) is torch.Tensor and o.dim() == 2 and o.shape[0] == rank]
    assert not [o for o in held if o.shape[1] in widths]


def test_a_step_generates_each_projection_for_the_merge_and_once_for_its_gram(monkeypatch):
    """Outside the forward, ``A`` is generated where it is used: once per group for the merge, and
    for the step sizes (``‖U A‖²`` from ``A Aᵀ``) only at a projection's first update, whose ``r×r``
    Gram matrix the projection keeps until it is redrawn (one more pair of old and new ``A`` at a
    redraw with a first moment to carry)."""
    model = patch_model(tiny_qwen2())
    rank = 4
    optimizer = LoGRAOptimizer(model, rank=rank, update_ratio=1e-3, refresh_every=2)
    model.train()
    groups = 4 * model.config.num_hidden_layers
    counter = CountingGenerations(monkeypatch)
    for update, expected in enumerate([2 * groups, groups, 2 * groups]):
        model(**fixed_batch()).loss.backward()
        counter.specs.clear()
        optimizer.step()
        optimizer.zero_grad()
        redraw = 2 * groups if update == 1 else 0  # after the second update: old and new A per group
        assert len(counter.specs) == expected + redraw
    grams = {id(t.state.shared_projection): t.state.shared_projection.gram() for t in optimizer.targets}
    assert all(g.shape == (rank, rank) and g.dtype == torch.float32 for g in grams.values())


def test_generated_reuses_a_for_consecutive_members_of_a_group():
    first, second = SharedProjection(ProjectionSpec(1, 3, 8)), SharedProjection(ProjectionSpec(2, 3, 8))
    tensors = list(generated([first, first, second, first]))
    assert tensors[0] is tensors[1] and tensors[2] is not tensors[1] and tensors[3] is not tensors[0]
    assert torch.equal(tensors[3], tensors[0]) and torch.equal(tensors[2], make_projection(2, 3, 8))


def test_backward_forms_no_weight_sized_tensor():
    """No d×k tensor is created in a target's backward (fp32, no autocast); the same recorder sees
    one for an ordinary trainable linear, so the check can fail."""
    d, k, n, r = 11, 7, 13, 3
    model = patch_model(OneLinear(k, d, bias=False), target_modules=["proj"])
    _optimizer = LoGRAOptimizer(model, rank=r, lr=1.0)
    x = torch.randn(n, k, requires_grad=True)
    loss = model(x).square().sum()
    with OutputShapes() as ops:
        loss.backward()
    assert (d, k) not in ops.shapes and (k, d) not in ops.shapes
    assert (d, r) in ops.shapes  # the sketch product

    plain = OneLinear(k, d, bias=False)
    loss = plain(torch.randn(n, k, requires_grad=True)).square().sum()
    with OutputShapes() as ops:
        loss.backward()
    assert (d, k) in ops.shapes or (k, d) in ops.shapes


# --------------------------------------------------------------------------------------------------
# Graph and gradients


def test_input_gradients_match_an_unpatched_model():
    batch = fixed_batch()
    patched = patch_model(tiny_qwen2())
    _optimizer = LoGRAOptimizer(patched, rank=4, lr=1.0)
    plain = tiny_qwen2()
    grads = []
    for model in (patched, plain):
        model.train()
        embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_(True)
        model(inputs_embeds=embeds, labels=batch["labels"]).loss.backward()
        grads.append(embeds.grad)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_graph_exists_with_everything_below_the_first_target_frozen():
    # The input does not require grad and no parameter does either.
    model = patch_model(OneLinear(6, 5), target_modules=["proj"])
    _optimizer = LoGRAOptimizer(model, rank=2, lr=1.0)
    x = torch.randn(3, 6)
    y = model(x)
    assert y.requires_grad
    y.sum().backward()
    assert target_state(model.proj).sketch.abs().sum() > 0
    assert GRAPH_ANCHOR.grad is None  # the anchor only makes the graph exist; it collects nothing


def test_frozen_embeddings_still_sketch_the_first_layer():
    model = patch_model(tiny_qwen2())
    _optimizer = LoGRAOptimizer(model, rank=4, lr=1.0)
    assert not model.get_input_embeddings().weight.requires_grad
    model.train()
    model(**fixed_batch()).loss.backward()
    first = model.model.layers[0].self_attn.q_proj
    assert target_state(first).sketch.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------------------------------
# SketchBank


def test_sketch_bank_views_share_one_flat_buffer():
    bank = SketchBank([(3, 2), (4, 2), (1, 5)], [torch.device("cpu")] * 3)
    (flat,) = bank.flat_buffers()
    assert flat.dtype == torch.float32 and flat.numel() == 6 + 8 + 5
    for i, view in enumerate(bank.views):
        view.fill_(i + 1)
    assert torch.equal(flat, torch.tensor([1.0] * 6 + [2.0] * 8 + [3.0] * 5))
    assert bank.all_finite() and any(b.ne(0).any() for b in bank.flat_buffers())
    bank.views[1][2, 1] = float("nan")
    assert not bank.all_finite()
    bank.zero_()
    assert bank.all_finite() and not any(b.ne(0).any() for b in bank.flat_buffers())
