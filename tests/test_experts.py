"""Mixture-of-experts weights as LoGRA targets (logra_optim/experts.py): per-expert sketches equal the
dense per-expert gradients times ``Aᵀ`` (float64, any routing), the routed computation equals
transformers' eager and grouped implementations, no dense expert gradient is ever allocated, and the
optimizer, the KL probe and checkpoints cover every expert. Experts stored transposed (GPT-OSS:
``[E, in, out]``, gate/up interleaved, with biases) get the same checks, plus the merge into their
storage, whole or sharded over experts."""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from logra_optim import LoGRAOptimizer, patch_model, patched_targets, unpatch_model
from logra_optim.distributed import REPLICATED, ROWS, LocalWeight, WeightLayout, weight_layout
from logra_optim.experts import expert_matrices
from logra_optim.patching import target_state
from logra_optim.projection import ProjectionSpec
from logra_optim.sketch import SharedProjection
from logra_optim.probe import contexts_from_batch, jvp_predicted_kl
from logra_optim.polar import POLAR_FLOOR, POLAR_FLOOR_16BIT
from logra_optim.updates import merge_transposed_experts_
from tests.helpers.reference import U16, kl_divergence, merged
from tests.helpers.tiny import fixed_batch, tiny_gpt_oss, tiny_qwen3_moe


class ExpertsOnly(nn.Module):
    """A transformers experts module beside one linear (``patch_model`` wants a linear):
    ``Qwen3MoeExperts``, or ``GptOssExperts`` (``family="gpt_oss"``: stored transposed, gate/up
    interleaved, clamped gate, biases)."""

    def __init__(self, experts: int, hidden: int, inner: int, dtype=torch.float64, seed: int = 0, family="qwen3_moe"):
        super().__init__()
        if family == "gpt_oss":
            from transformers import GptOssConfig
            from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as Experts

            config = GptOssConfig(num_local_experts=experts, hidden_size=hidden, intermediate_size=inner)
        else:
            from transformers import Qwen3MoeConfig
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as Experts

            config = Qwen3MoeConfig(num_experts=experts, hidden_size=hidden, moe_intermediate_size=inner)
        config._experts_implementation = "eager"
        torch.manual_seed(seed)
        self.experts = Experts(config)
        for weight in self.experts.parameters():  # GPT-OSS: its biases too
            nn.init.normal_(weight, std=0.3)
        self.o_proj = nn.Linear(hidden, hidden)
        self.to(dtype)

    def forward(self, hidden, top_k_index, top_k_weights):
        return self.experts(hidden, top_k_index, top_k_weights)


def routing(tokens: int, experts: int, top_k: int, mode: str, generator: torch.Generator):
    """``(top_k_index, top_k_weights)`` with distinct experts per token. ``mode``: ``"random"``,
    ``"one"`` (expert 0 is every token's first choice), ``"unused"`` (the last expert gets nothing)."""
    pool = experts - 1 if mode == "unused" else experts
    rows = []
    for _ in range(tokens):
        choice = torch.randperm(pool, generator=generator)[:top_k]
        if mode == "one" and 0 not in choice:
            choice[0] = 0
        elif mode == "one":
            choice = torch.cat([torch.tensor([0]), choice[choice != 0]])[:top_k]
        rows.append(choice)
    index = torch.stack(rows)
    weights = torch.rand(tokens, top_k, generator=generator, dtype=torch.float64).softmax(-1)
    return index, weights


def bind(module: nn.Module, rank: int, seed: int = 0) -> list[torch.Tensor]:
    """Give a patched experts module projections and float64 sketches, as an optimizer would;
    returns the projections (input weight, output weight)."""
    patch = module._logra_experts
    projections = []
    for i, (attribute, state) in enumerate(zip(patch.names, patch.ordered())):
        weight = expert_matrices(getattr(module, attribute), state.transposed)  # [E, d, k]
        spec = ProjectionSpec(seed * 2 + i, rank, weight.shape[2])
        a = spec.generate()
        state.set_projection(SharedProjection(spec))
        state.sketch = torch.zeros(weight.shape[0] * weight.shape[1], rank, dtype=torch.float64)
        projections.append(a)
    return projections


def dense_reference(model: ExpertsOnly, hidden, index, weights, cotangent):
    """Output, input gradient and the dense gradients ``G_e`` (``[E, d, k]``, of ``W_e`` as a linear
    map: the stored gradient transposed for GPT-OSS) of transformers' eager experts, float64."""
    reference = copy.deepcopy(model)
    for weight in (reference.experts.gate_up_proj, reference.experts.down_proj):
        weight.requires_grad_(True)
    x = hidden.clone().requires_grad_(True)
    out = reference(x, index, weights)
    out.backward(cotangent)
    transposed = reference.experts.is_transposed
    grads = [expert_matrices(w.grad, transposed) for w in (reference.experts.gate_up_proj, reference.experts.down_proj)]
    return out.detach(), x.grad, grads


@settings(max_examples=25, deadline=None)
@given(
    experts=st.integers(1, 5),
    top_k=st.integers(1, 3),
    tokens=st.integers(1, 9),
    rank=st.integers(1, 4),
    mode=st.sampled_from(["random", "one", "unused"]),
    seed=st.integers(0, 2**16),
)
def test_expert_sketches_equal_dense_per_expert_gradients(experts, top_k, tokens, rank, mode, seed):
    """``S_e = G_e Aᵀ`` for every expert, exactly (float64), with the top-k weights inside ``G_e``;
    outputs and input gradients equal transformers' eager loop; an expert without tokens has a zero
    sketch."""
    check_expert_sketches("qwen3_moe", experts, top_k, tokens, rank, mode, seed)


@settings(max_examples=10, deadline=None)
@given(
    experts=st.integers(3, 5),
    top_k=st.integers(2, 3),
    tokens=st.integers(1, 9),
    rank=st.integers(1, 4),
    mode=st.sampled_from(["random", "unused"]),
    seed=st.integers(0, 2**16),
)
def test_gpt_oss_expert_sketches_equal_dense_per_expert_gradients(experts, top_k, tokens, rank, mode, seed):
    """GPT-OSS (stored transposed, gate/up interleaved, clamped gate, biases): ``S_e = G_e Aᵀ`` with
    ``G_e`` the gradient of ``W_e = weight[e]ᵀ``, exactly (float64), top-k > 1; outputs and input
    gradients equal its eager loop; an expert without tokens has a zero sketch."""
    check_expert_sketches("gpt_oss", experts, top_k, tokens, rank, mode, seed)


def check_expert_sketches(family: str, experts: int, top_k: int, tokens: int, rank: int, mode: str, seed: int):
    top_k = min(top_k, experts - 1 if mode == "unused" and experts > 1 else experts)
    if mode == "unused" and experts == 1:
        mode = "random"
    generator = torch.Generator().manual_seed(seed)
    model = ExpertsOnly(experts, hidden=6, inner=5, seed=seed, family=family)
    hidden = torch.randn(tokens, 6, generator=generator, dtype=torch.float64)
    index, weights = routing(tokens, experts, top_k, mode, generator)
    cotangent = torch.randn(tokens, 6, generator=generator, dtype=torch.float64)
    out_ref, grad_ref, dense = dense_reference(model, hidden, index, weights, cotangent)

    patch_model(model)
    projections = bind(model.experts, rank, seed)
    x = hidden.clone().requires_grad_(True)
    out = model(x, index, weights)
    out.backward(cotangent)

    torch.testing.assert_close(out.detach(), out_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, grad_ref, rtol=1e-12, atol=1e-12)
    for state, a, grad in zip(model.experts._logra_experts.ordered(), projections, dense):
        sketch = state.sketch.view(experts, -1, rank)
        expected = grad @ a.double().t()  # [E, d, k] @ [k, r]
        torch.testing.assert_close(sketch, expected, rtol=1e-10, atol=1e-12)
    if mode == "unused":
        assert not any(s.sketch.view(experts, -1, rank)[-1].any() for s in model.experts._logra_experts.ordered())


def test_expert_sketches_are_unbiased_over_seeds():
    """``E_A[S_e A] = G_e`` per expert with one ``A`` shared by all experts of a weight: the mean
    reconstruction over M seeds is within 6 standard errors of ``G_e`` everywhere, and the mean z²
    over both weights is ≈ 1 (Rademacher: Var[(S A)_ab] = (‖G_a‖² − G_ab²)/r per draw)."""
    experts, hidden_size, inner, rank, draws = 3, 24, 16, 3, 600
    generator = torch.Generator().manual_seed(0)
    model = ExpertsOnly(experts, hidden_size, inner)
    hidden = torch.randn(12, hidden_size, generator=generator, dtype=torch.float64)
    index, weights = routing(12, experts, 2, "random", generator)
    cotangent = torch.randn(12, hidden_size, generator=generator, dtype=torch.float64)
    _, _, dense = dense_reference(model, hidden, index, weights, cotangent)
    patch_model(model)
    totals = [torch.zeros_like(g) for g in dense]
    for draw in range(draws):
        projections = bind(model.experts, rank, seed=1000 + draw)
        model(hidden.clone().requires_grad_(True), index, weights).backward(cotangent)
        for total, state, a in zip(totals, model.experts._logra_experts.ordered(), projections):
            total += state.sketch.view(experts, -1, rank) @ a.double()
    zs = []
    for total, grad in zip(totals, dense):
        variance = (grad.square().sum(dim=-1, keepdim=True) - grad.square()) / (rank * draws)
        zs.append(((total / draws - grad) / variance.sqrt()).flatten())
    z = torch.cat(zs)
    # All experts of a weight share each draw of A, so the entries' errors are correlated and their
    # extremes come in clusters: a looser bound on the largest than for independent entries.
    assert z.abs().max() < 6.0
    assert 0.8 < float(z.square().mean()) < 1.2


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_patched_experts_compute_what_the_models_implementation_computes(implementation):
    """Training forward (LoGRA's routed computation) and its input gradients equal the model's own
    experts implementation; in eval mode the model's implementation itself runs."""
    batch = fixed_batch(batch=2, seq=10)
    reference = tiny_qwen3_moe(experts_implementation=implementation)
    model = copy.deepcopy(reference)
    for m in (reference, model):
        m.train()
    expected = reference(**batch)
    expected.loss.backward()
    optimizer = LoGRAOptimizer(patch_model(model), rank=4)
    got = model(**batch)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    got.loss.backward()
    assert optimizer.sketch_buffers()[0].abs().sum() > 0
    # Evaluation: the model's own implementation runs, and nothing is sketched.
    sketches = [buffer.clone() for buffer in optimizer.sketch_buffers()]
    model.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, reference(**batch).logits, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(sketches, optimizer.sketch_buffers()))
    model.train()
    # A non-target's gradient downstream of the experts agrees: the input gradients through them do.
    embedding_grad = reference.model.embed_tokens.weight.grad
    model.model.embed_tokens.weight.requires_grad_(True)
    model.zero_grad()
    model(**batch).loss.backward()
    torch.testing.assert_close(model.model.embed_tokens.weight.grad, embedding_grad, rtol=1e-4, atol=1e-6)


class LargestBackwardTensor(TorchDispatchMode):
    """Records the largest tensor any op produces while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_no_dense_expert_gradient_is_allocated():
    """Every tensor the backward creates is smaller than one expert's ``d×k`` matrix; autograd on the
    same experts (the control) creates the whole ``[E, d, k]`` gradient."""
    experts, hidden_size, inner, tokens = 4, 64, 48, 8
    model = ExpertsOnly(experts, hidden_size, inner, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    index, weights = routing(tokens, experts, 2, "random", generator)
    weights = weights.float()
    smallest_expert_matrix = hidden_size * inner

    control = copy.deepcopy(model)
    control.experts.down_proj.requires_grad_(True)
    out = control(hidden.clone().requires_grad_(True), index, weights)
    with LargestBackwardTensor() as recorded:
        out.sum().backward()
    assert recorded.largest >= experts * hidden_size * inner  # the dense gradient the control forms

    patch_model(model)
    bind(model.experts, rank=4)
    for state in model.experts._logra_experts.ordered():
        state.sketch = state.sketch.float()
    out = model(hidden.clone().requires_grad_(True), index, weights)
    with LargestBackwardTensor() as recorded:
        out.sum().backward()
    assert 0 < recorded.largest < smallest_expert_matrix
    assert model.experts.gate_up_proj.grad is None and model.experts.down_proj.grad is None


def avoid_last_expert(model):
    """Forward hooks that reroute every router's choices away from the last expert (edge case: an
    expert that receives no token)."""
    handles = []
    for layer in model.model.layers:
        router = layer.mlp.router if hasattr(layer.mlp, "router") else layer.mlp.gate  # GPT-OSS, Qwen3-MoE
        last = router.num_experts - 1

        def hook(module, args, output, last=last):
            logits, scores, indices = output
            return logits, scores, torch.where(indices == last, (indices + 1) % (last + 1), indices)

        handles.append(router.register_forward_hook(hook))
    return handles


@pytest.mark.parametrize("direction", ["rowadam", "orthogonal"])
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_optimizer_trains_every_routed_expert_and_leaves_unrouted_ones_untouched(precision, direction):
    """At the realistic step size (update_ratio 6e-5), fp32 and under bf16 autocast: every expert that
    received tokens moves, the one that received none is bit-identical (zero sketch rows → zero
    direction, no NaN), and ‖ΔW‖/‖W‖ of each stacked weight is the update ratio times α."""
    model = tiny_qwen3_moe()
    avoid_last_expert(model)
    optimizer = LoGRAOptimizer(patch_model(model), rank=4, kl_budget=None, update_ratio=6e-5, direction=direction)
    experts = [t for t in optimizer.targets if t.experts > 1]
    assert [t.name.rsplit(".", 1)[-1] for t in experts] == ["gate_up_proj", "down_proj"] * 2
    before = {t.name: t.weight.detach().clone() for t in experts}
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
        loss = model(**fixed_batch(batch=4, seq=12)).loss
    loss.backward()
    # The experts' backward records a 16-bit product exactly when one went into their sketch rows.
    assert all(t.state.sketched_in_16_bit == (precision != "fp32") for t in experts)
    optimizer.step()
    assert optimizer.polar_floor == (POLAR_FLOOR if precision == "fp32" else POLAR_FLOOR_16BIT)
    assert optimizer.stats["update_index"] == 1
    for target in experts:
        weight, old = target.weight.detach(), before[target.name]
        assert torch.isfinite(weight).all()
        moved = [not torch.equal(weight[e], old[e]) for e in range(target.experts)]
        assert moved == [True, True, True, False], target.name
        ratio = float((weight - old).norm() / old.norm())
        assert ratio == pytest.approx(6e-5, rel=0.02)


def test_orthogonal_directions_orthogonalise_each_expert_on_its_own():
    """``direction="orthogonal"``: the merged factor of a stacked-experts target is, expert by
    expert, a multiple (``α η``, one per target) of that expert's own polar factor; the unrouted
    expert's block stays zero."""
    model = tiny_qwen3_moe()
    avoid_last_expert(model)
    optimizer = LoGRAOptimizer(
        patch_model(model), rank=4, kl_budget=None, update_ratio=6e-5, direction="orthogonal", wire_dtype=None
    )
    merged_updates = []
    optimizer.register_merge_hook(lambda opt, update: merged_updates.append(update))
    model.train()
    model(**fixed_batch(batch=4, seq=12)).loss.backward()
    optimizer.step()
    experts = {t.name: t.experts for t in optimizer.targets if t.experts > 1}
    for update in merged_updates[0].targets:
        if update.name not in experts:
            continue
        blocks = update.factor.double().split(update.out_features // experts[update.name])
        grams = [block.T @ block for block in blocks[:-1]]
        scale = grams[0].diagonal().mean()
        for gram in grams:  # every routed expert: Fᵀ F = (α η)² I, the same multiple
            torch.testing.assert_close(gram / scale, torch.eye(gram.shape[0], dtype=torch.float64), atol=1e-4, rtol=0)
        assert torch.equal(blocks[-1], torch.zeros_like(blocks[-1])), update.name


@pytest.mark.parametrize("direction", ["orthogonal", "rowadam"])
def test_an_expert_that_stops_receiving_tokens_stops_moving(direction):
    """With the default first moment, an expert routed no token keeps a decaying momentum. Orthogonal
    directions would raise it back to unit singular values: full steps along a stale direction, for
    as long as the expert stays idle, that the KL probe cannot see; and η would scale RowAdam's decaying
    step back up with the stack's. So an idle expert's block is zero (``updates.idle_still``), under
    either direction. Every other expert keeps moving."""
    model = tiny_qwen3_moe()
    optimizer = LoGRAOptimizer(patch_model(model), rank=4, kl_budget=None, update_ratio=6e-5, direction=direction)
    target = next(t for t in optimizer.targets if t.experts > 1)
    model.train()
    model(**fixed_batch(batch=4, seq=12, seed=0)).loss.backward()
    optimizer.step()
    avoid_last_expert(model)
    steps = []
    for seed in range(1, 11):
        before = target.weight.detach().clone()
        model(**fixed_batch(batch=4, seq=12, seed=seed)).loss.backward()
        optimizer.step()
        change = target.weight.detach() - before
        steps.append([float(change[e].norm() / before[e].norm()) for e in range(target.experts)])
    # The routed experts keep moving. Under orthogonal directions by the update ratio: η is set before
    # the idle block is zeroed, so an idle expert does not enlarge the others' steps (by √(4/3) here).
    low, high = (5.4e-5, 6.6e-5) if direction == "orthogonal" else (1e-5, 1.0)
    assert all(low < ratio < high for step in steps for ratio in step[:-1]), steps
    assert [step[-1] for step in steps] == [0.0] * 10


def test_a_backward_through_an_eval_mode_forward_names_every_stacked_weight():
    """Both stacked weights of each experts block (and every linear target) are named when a
    backward goes through an eval-mode forward while the embeddings train."""
    model = patch_model(tiny_qwen3_moe())
    model.model.embed_tokens.weight.requires_grad_(True)
    optimizer = LoGRAOptimizer(model, rank=2, non_target_optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
    model.eval()
    model(**fixed_batch(batch=2, seq=8, seed=0)).loss.backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    named = [str(w.message) for w in caught if "eval-mode forward of" in str(w.message)]
    total = len(optimizer.targets)
    assert any(t.experts > 1 for t in optimizer.targets)
    assert len(named) == 1 and f"forward of {total} of {total} targets" in named[0], named


@pytest.mark.parametrize("build", [tiny_qwen3_moe, tiny_gpt_oss], ids=["qwen3_moe", "gpt_oss"])
def test_kl_probe_includes_expert_updates(build):
    """The JVP probe's predicted KL of an update that moves only experts equals the exact KL of the
    model with that update merged densely into the 3-D weights, divided by ε² (float64); for GPT-OSS
    through its transposed storage (``weight[e] −= ε (F_e A)ᵀ``).

    The exact side is the mean over ``±ε``, which cancels the ε³ term of the expansion, at ε = 1e-3:
    small enough that no token's top-k routing flips (GPT-OSS's does from 3e-3), large enough that
    float64 rounding stays far below the tolerance. A one-sided ε = 1e-4 sat at the edge of both:
    its KL of about 1e-11 carries about 1e-3 relative rounding, which passes or fails by CPU."""
    model = build(dtype=torch.float64)
    optimizer = LoGRAOptimizer(patch_model(model, target_modules=["o_proj"]), rank=4)
    generator = torch.Generator().manual_seed(3)
    factors = [
        torch.randn(t.shape[0], 4, generator=generator, dtype=torch.float64) * 0.05 * (t.experts > 1)
        for t in optimizer.targets
    ]
    batch = fixed_batch(batch=2, seq=10)
    contexts = contexts_from_batch(batch["input_ids"])
    predicted, tokens, _ = jvp_predicted_kl(model, [t.state for t in optimizer.targets], factors, contexts)
    assert predicted > 0

    def exact_kl(epsilon: float) -> float:
        merged = copy.deepcopy(model)
        unpatch_model(merged)
        with torch.no_grad():
            for target, factor in zip(optimizer.targets, factors):
                if target.experts > 1:
                    matrices = expert_matrices(merged.get_parameter(target.parameter_name), target.layout.transposed)
                    delta = factor @ target.state.generate_projection().double()  # [E·d, k]
                    matrices -= epsilon * delta.view(matrices.shape)  # through the view into the storage
            model.eval(), merged.eval()
            before = model(input_ids=batch["input_ids"]).logits[contexts.probe_mask]
            after = merged(input_ids=batch["input_ids"]).logits[contexts.probe_mask]
        return float(kl_divergence(before, after).sum()) / epsilon**2

    epsilon = 1e-3
    exact = (exact_kl(epsilon) + exact_kl(-epsilon)) / 2
    assert float(predicted) == pytest.approx(exact, rel=1e-3)


@pytest.mark.parametrize("build", [tiny_qwen3_moe, tiny_gpt_oss], ids=["qwen3_moe", "gpt_oss"])
def test_state_dict_resumes_every_expert_bit_identically(build):
    """Save after one update (``torch.load(weights_only=True)``), resume in a copy, and the next
    update matches the uninterrupted run exactly, experts included (GPT-OSS: stored transposed)."""
    model = build()
    optimizer = LoGRAOptimizer(patch_model(model), rank=4, kl_budget=None, update_ratio=1e-3)
    model.train()

    def update(m, opt, seed):
        m(**fixed_batch(batch=2, seq=10, seed=seed)).loss.backward()
        opt.step()
        opt.zero_grad()

    update(model, optimizer, 1)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    moment = state["state"][len(optimizer.targets) - 1]["first_moment"]  # the last layer's down_proj
    assert moment.shape == (4 * model.config.hidden_size, 4)  # E·d rows, r columns
    resumed_model = copy.deepcopy(model)
    unpatch_model(resumed_model)
    resumed = LoGRAOptimizer(patch_model(resumed_model), rank=4, kl_budget=None, update_ratio=1e-3)
    resumed.load_state_dict(state)
    resumed_model.train()
    update(model, optimizer, 2)
    update(resumed_model, resumed, 2)
    for (name, a), b in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(a, b), name


def test_unsupported_experts_layouts_are_refused_by_name():
    """A module with stacked weights in an unknown layout, expert parallelism and transposed experts
    whose shapes do not line up are clear errors naming the module; ``experts=False`` leaves them
    frozen with a warning, and unpatching restores every flag."""

    class MyExperts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2, 3, 4))
            self.o_proj = nn.Linear(4, 4)

    with pytest.raises(ValueError, match=r"experts module '' \(MyExperts\).*experts=False"):
        patch_model(MyExperts())
    model = MyExperts()
    with pytest.warns(UserWarning, match="froze 1 stacked expert weights"):
        patch_model(model, experts=False)
    assert [a for _, _, a in patched_targets(model)] == ["weight"]
    unpatch_model(model)
    assert model.w.requires_grad

    class Hybrid(nn.Module):  # a convolution's 3-D weight is not an expert: frozen, no error, no warning
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(4, 4, 3)
            self.o_proj = nn.Linear(4, 4)

    hybrid = Hybrid()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        patch_model(hybrid)
    assert not hybrid.conv.weight.requires_grad

    parallel = tiny_qwen3_moe()
    parallel.model.layers[1].mlp.experts._is_expert_parallel = True
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.*expert parallelism"):
        patch_model(parallel)
    assert not patched_targets(parallel)  # nothing changed

    mismatched = tiny_gpt_oss()
    experts = mismatched.model.layers[0].mlp.experts
    wrong = experts.down_proj.detach().transpose(1, 2).contiguous()  # [E, H, I]: GPT-OSS stores [E, I, H]
    experts.down_proj = nn.Parameter(wrong)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts' \(GptOssExperts\): shapes \[4, 16, 24\] and "
                       r"\[4, 16, 12\] \(transposed: True\) do not line up"):  # fmt: skip
        patch_model(mismatched)
    assert not patched_targets(mismatched)


def _patched_beside(reference):
    """A patched copy of ``reference`` (a float64 MoE model) and its rank-4 optimizer, beside the
    reference's own training forward and backward on a fixed batch: ``(model, batch, reference's
    output, optimizer, expert targets)``."""
    model = copy.deepcopy(reference)
    batch = fixed_batch(batch=2, seq=10)
    reference.train(), model.train()
    expected = reference(**batch)
    expected.loss.backward()
    optimizer = LoGRAOptimizer(patch_model(model), rank=4)
    return model, batch, expected, optimizer, [target for target in optimizer.targets if target.experts > 1]


def test_gpt_oss_experts_are_targets_with_exact_sketches():
    """GPT-OSS stores its experts transposed (``[E, in, out]``, gate and up interleaved) with biases:
    both stacked weights of every layer become targets, each the ``E·d × k`` matrix of its experts'
    ``W_e = weight[e]ᵀ``; the biases stay non-targets (frozen with the other non-targets); the
    training forward and the gradients flowing through the experts equal the unpatched model's eager
    ones; each sketch equals the dense gradient of the ``W_e`` times ``Aᵀ`` (float64 model, fp32
    sketches); in eval mode the model's own implementation runs and nothing is sketched."""
    reference = tiny_gpt_oss(dtype=torch.float64)
    model, batch, expected, optimizer, experts = _patched_beside(reference)
    names = [f"model.layers.{layer}.mlp.experts.{w}" for layer in (0, 1) for w in ("gate_up_proj", "down_proj")]
    assert [target.parameter_name for target in experts] == names
    # gate_up: d = 2I = 24 rows per expert over k = H = 16; down: d = H = 16 over k = I = 12.
    assert [(target.shape, target.layout.transposed) for target in experts] == [((96, 16), True), ((64, 12), True)] * 2
    biases = [p for n, p in model.named_parameters() if n.endswith("_proj_bias")]
    assert len(biases) == 4 and not any(p.requires_grad for p in biases)
    model.model.embed_tokens.weight.requires_grad_(True)  # what flows back through the experts
    got = model(**batch)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-12, atol=1e-12)
    got.loss.backward()
    torch.testing.assert_close(
        model.model.embed_tokens.weight.grad, reference.model.embed_tokens.weight.grad, rtol=1e-10, atol=1e-12
    )
    dense = dict(reference.named_parameters())
    for target in experts:
        gradient = expert_matrices(dense[target.parameter_name].grad, transposed=True)  # G_e: [E, d, k]
        expected_sketch = gradient.reshape(target.shape) @ target.state.generate_projection().double().T
        error = (target.state.sketch.double() - expected_sketch).norm() / expected_sketch.norm()
        assert error < 1e-6, (target.name, float(error))
    sketches = [buffer.clone() for buffer in optimizer.sketch_buffers()]
    model.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, reference(**batch).logits, rtol=1e-12, atol=1e-12)
    assert all(torch.equal(a, b) for a, b in zip(sketches, optimizer.sketch_buffers()))


def test_gpt_oss_update_lands_in_the_transposed_storage():
    """One update moves expert ``e``'s stored weight to exactly ``weight[e] − (F_e A)ᵀ`` (float64
    reference ``W_e − F_e A`` on ``W_e = weight[e]ᵀ``), with ``F`` the factor the merge hook reports
    and ``A`` the target's projection; the expert that received no token is bit-identical; each
    stacked weight moves by ``‖ΔW‖/‖W‖ = ρ_upd`` (η does not see the transposition); the first moment
    has one row per expert row; the biases (non-targets, frozen) do not move."""
    model = tiny_gpt_oss(dtype=torch.float64)
    avoid_last_expert(model)
    optimizer = LoGRAOptimizer(patch_model(model), rank=4, kl_budget=None, update_ratio=1e-3, wire_dtype=None)
    factors = {}
    optimizer.register_merge_hook(lambda _, update: factors.update({t.name: t.factor for t in update.targets}))
    experts = [target for target in optimizer.targets if target.experts > 1]
    before = {target.name: target.weight.detach().clone() for target in experts}
    biases = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("_proj_bias")}
    model.train()
    model(**fixed_batch(batch=4, seq=12)).loss.backward()
    optimizer.step()
    assert optimizer.stats["update_index"] == 1
    for target in experts:
        weight, old = target.weight.detach(), before[target.name]
        factor, projection = factors[target.parameter_name], target.state.generate_projection()
        d = target.shape[0] // target.experts
        for e in range(target.experts):
            want = merged(old[e].T, factor[e * d : (e + 1) * d], projection).T
            torch.testing.assert_close(weight[e], want, rtol=1e-13, atol=1e-15)
        moved = [not torch.equal(weight[e], old[e]) for e in range(target.experts)]
        assert moved == [True, True, True, False], target.name
        assert float((weight - old).norm() / old.norm()) == pytest.approx(1e-3, rel=1e-5)
        assert optimizer.state[target.weight]["first_moment"].shape == (target.shape[0], 4)
    for name, parameter in model.named_parameters():
        if name in biases:
            assert torch.equal(parameter, biases[name]), name


@settings(max_examples=15, deadline=None)
@given(
    experts=st.integers(1, 4),
    d=st.integers(1, 5),
    k=st.integers(1, 5),
    r=st.integers(1, 3),
    world=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_transposed_experts_merge_into_their_storage_whole_or_sharded_over_experts(experts, d, k, r, world, seed):
    """Experts stored ``[E, k, d]``: merging the ``E·d × k`` update ``F A`` leaves ``stored[e] =
    (W_e − F_e A)ᵀ`` (float64 reference), replicated or split over ranks by whole experts (FSDP2's
    ``Shard(0)``, torch's uneven chunks, a rank may hold none), and the ranks' ``‖·‖²`` shares sum to
    ``‖W‖²``; bf16 storage (nearest rounding) is within its rounding of the reference."""
    generator = torch.Generator().manual_seed(seed)
    stored = torch.randn(experts, k, d, generator=generator, dtype=torch.float64)
    factor = torch.randn(experts * d, r, generator=generator, dtype=torch.float64)
    projection = torch.randn(r, k, generator=generator, dtype=torch.float64)
    want = torch.stack([merged(stored[e].T, factor[e * d : (e + 1) * d], projection).T for e in range(experts)])

    whole = LocalWeight(stored.clone(), WeightLayout(REPLICATED, (experts * d, k), 0, experts * d, 0, True))
    whole.merge_(factor, projection)
    torch.testing.assert_close(whole.weight, want, rtol=1e-12, atol=1e-12)

    per_rank = -(-experts // world)  # torch.chunk's split of Shard(0)
    shards, sq_norm = [], 0.0
    for rank in range(world):
        first, last = min(rank * per_rank, experts), min((rank + 1) * per_rank, experts)
        layout = WeightLayout(ROWS, (experts * d, k), first * d, last * d, 1, True)
        shard = LocalWeight(stored[first:last].clone(), layout)
        sq_norm += float(shard.sq_norm())
        shard.merge_(factor, projection)
        shards.append(shard.weight)
    torch.testing.assert_close(torch.cat(shards), want, rtol=1e-12, atol=1e-12)
    assert sq_norm == pytest.approx(float(stored.square().sum()), rel=1e-12)

    low = merge_transposed_experts_(stored.bfloat16(), factor, projection, stochastic_rounding=False)
    torch.testing.assert_close(low.double(), want, rtol=2 * U16, atol=2 * U16 * float(want.abs().max()))


def test_transposed_experts_under_zero3_are_refused_by_name():
    """DeepSpeed ZeRO-3 partitions the ``[E, k, d]`` storage flat, which is no range of the experts'
    rows: the layout is refused naming the target (recognised, as DeepSpeed's parameters are, by
    their ``ds_*`` attributes)."""
    weight = nn.Parameter(torch.zeros(0))
    weight.ds_tensor, weight.ds_shape = torch.zeros(6), (2, 3, 4)
    with pytest.raises(ValueError, match=r"target 'layer.experts.down_proj': experts stored transposed .*ZeRO-3"):
        weight_layout("layer.experts.down_proj", weight, transposed=True)


def test_a_rank_holding_no_expert_merges_nothing():
    """FSDP2 with fewer experts than ranks leaves some ranks an empty ``[0, d, k]`` shard: its matrix
    view is ``0 × k`` and the merge and norm are no-ops, not errors."""
    from logra_optim.distributed import ROWS, LocalWeight, WeightLayout

    weight = LocalWeight(torch.zeros(0, 3, 4), WeightLayout(ROWS, (6, 4), 6, 6, 1))
    assert weight.local().shape == (0, 4)
    weight.merge_(torch.ones(6, 2), torch.ones(2, 4))
    assert float(weight.sq_norm()) == 0.0


def test_quantized_experts_are_refused():
    model = tiny_qwen3_moe()
    experts = model.model.layers[0].mlp.experts
    experts.down_proj = nn.Parameter(experts.down_proj.detach().to(torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.*quantized experts \(torch.float8_e4m3fn\)"):
        patch_model(model)


def test_gpt_oss_in_mxfp4_is_refused_not_left_untrained():
    """transformers' mxfp4 GPT-OSS experts pack their weights as 4-D uint8 blocks, already frozen: they
    must be refused by name, not skipped (which would train attention alone without a word)."""
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts

    model = tiny_gpt_oss(hidden_size=32, intermediate_size=32)
    model.model.layers[1].mlp.experts = Mxfp4GptOssExperts(model.config)
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.*quantized experts \(torch.uint8\).*dequantized"):
        patch_model(model)


def test_unpatch_restores_the_experts_module():
    model = tiny_qwen3_moe()
    experts = model.model.layers[0].mlp.experts
    patch_model(model)
    assert "forward" in experts.__dict__ and not experts.gate_up_proj.requires_grad
    assert target_state(experts, "down_proj").experts == 4
    unpatch_model(model)
    assert "forward" not in experts.__dict__ and not hasattr(experts, "_logra_experts")
    assert experts.gate_up_proj.requires_grad and experts.down_proj.requires_grad
    assert all(p.requires_grad for p in model.parameters())
    # A stacked weight frozen before patching is frozen after unpatching.
    experts.down_proj.requires_grad_(False)
    patch_model(model)
    unpatch_model(model)
    assert experts.gate_up_proj.requires_grad and not experts.down_proj.requires_grad


def test_expert_rank_is_the_experts_own_and_is_checkpointed():
    """``expert_rank`` sizes the experts' sketches and projections (attention keeps ``rank``), is
    saved in the state_dict and checked on load, and a too-large one names the option."""
    model = tiny_qwen3_moe()
    optimizer = LoGRAOptimizer(patch_model(model), rank=8, expert_rank=2, kl_budget=1e-3)
    ranks = {t.name.rsplit(".", 1)[-1]: t.state.sketch.shape[1] for t in optimizer.targets}
    assert ranks == {"q_proj": 8, "k_proj": 8, "v_proj": 8, "o_proj": 8, "gate_up_proj": 2, "down_proj": 2}
    assert all(t.state.shared_projection.spec.rank == ranks[t.name.rsplit(".", 1)[-1]] for t in optimizer.targets)
    model.train()
    model(**fixed_batch(batch=2, seq=10)).loss.backward()
    optimizer.step()
    assert optimizer.stats["update_index"] == 1 and math.isfinite(optimizer.stats["predicted_kl"])
    state = optimizer.state_dict()
    assert state["logra"]["expert_rank"] == 2

    other = tiny_qwen3_moe()
    with pytest.raises(ValueError, match="expert_rank=2, this optimizer has expert_rank=8"):
        LoGRAOptimizer(patch_model(other), rank=8).load_state_dict(state)
    with pytest.raises(ValueError, match=r"expert_rank=25 is larger than target .*down_proj.*\(32×24"):
        LoGRAOptimizer(patch_model(tiny_qwen3_moe()), rank=8, expert_rank=25)
    # A stack of one expert is still a stack: sketched at expert_rank, as the sync payload says.
    single = LoGRAOptimizer(
        patch_model(tiny_qwen3_moe(num_experts=1, num_experts_per_tok=1)), rank=8, expert_rank=2, kl_budget=None
    )
    ranks = {t.name.rsplit(".", 1)[-1]: t.state.sketch.shape[1] for t in single.targets}
    assert ranks["gate_up_proj"] == ranks["down_proj"] == 2 and ranks["q_proj"] == 8
    # A checkpoint whose moments have another shape (such a stack saved before, at rank 8) is refused.
    state = single.state_dict()
    index = next(i for i, t in enumerate(single.targets) if t.stacked)
    rows = single.targets[index].state.sketch.shape[0]
    state["state"][index] = {"step": torch.tensor(1.0), "first_moment": torch.zeros(rows, 8)}
    with pytest.raises(ValueError, match=rf"has a first moment of shape \({rows}, 8\), this optimizer sketches it"):
        single.load_state_dict(state)


def test_the_router_trains_with_a_non_target_optimizer():
    """The router stays a non-target: frozen by default, or trained densely when unfrozen and given a
    ``non_target_optimizer`` (its gradient flows through the routing weights of the routed computation)."""
    model = patch_model(tiny_qwen3_moe())
    routers = [layer.mlp.gate.weight for layer in model.model.layers]
    assert not any(router.requires_grad for router in routers)
    for router in routers:
        router.requires_grad_(True)
    before = [router.detach().clone() for router in routers]
    optimizer = LoGRAOptimizer(model, rank=4, non_target_optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    model.train()
    model(**fixed_batch(batch=2, seq=10)).loss.backward()
    assert all(router.grad is not None and router.grad.abs().sum() > 0 for router in routers)
    optimizer.step()
    assert all(not torch.equal(router, old) for router, old in zip(routers, before))


def _tiny_family(family: str):
    """A two-layer float64 model of a mixture-of-experts family (4 experts, top-2, eager experts),
    with its shared experts / dense layers where the family has them."""
    import transformers

    common = dict(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    configs = {
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
            num_local_experts=4, num_experts_per_tok=2, intermediate_size=24,
        )),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=24)),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=16,
            intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[],
        )),
        "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
            intermediate_size=48, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8, num_key_value_heads=4,
        )),
        "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=16,
            head_dim=8, linear_conv_kernel_dim=2, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"],
        )),
    }  # fmt: skip
    config_class, model_class, extra = configs[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**common, **extra})).double()
    for name, parameter in model.named_parameters():
        if "experts" in name and parameter.dim() == 3:
            nn.init.normal_(parameter, std=0.2)
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"
    return model


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "qwen3_5_moe"])
def test_other_families_experts_are_targets_with_exact_sketches(family):
    """Beyond Qwen3-MoE, transformers' experts of Mixtral, OLMoE, Qwen2-MoE (with its shared expert),
    Qwen3.5-MoE (linear-attention layers) and DeepSeek-V3 (shared experts, a dense first layer,
    grouped routing): every stacked experts weight becomes a target, the training forward equals the
    model's own, and each sketch equals the dense gradient of the model's eager experts times ``Aᵀ``
    (float64 model, fp32 sketches); a step moves them (and works on float64 weights)."""
    reference = _tiny_family(family)
    model, batch, expected, optimizer, experts = _patched_beside(reference)
    stacked = [name for name, p in reference.named_parameters() if "experts" in name and p.dim() == 3]
    assert sorted(target.parameter_name for target in experts) == sorted(stacked) and stacked
    got = model(**batch)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-10, atol=1e-10)
    got.loss.backward()
    dense = dict(reference.named_parameters())
    for target in experts:
        gradient = dense[target.parameter_name].grad
        expected_sketch = gradient.reshape(-1, gradient.shape[-1]) @ target.state.generate_projection().double().T
        error = (target.state.sketch.double() - expected_sketch).norm() / expected_sketch.norm()
        assert error < 1e-6, (target.name, float(error))
    before = {target.name: target.weight.detach().clone() for target in experts}
    optimizer.step()
    for target in experts:
        assert not torch.equal(target.weight, before[target.name]), target.name


def test_experts_can_be_the_only_targets():
    """Stacked experts are targets whatever ``target_modules`` says; ``target_modules=[]`` leaves
    them as the only targets, and they train. A selection that names linears and matches none is
    still an error (a misspelled name must not train the experts alone)."""
    model = patch_model(tiny_qwen3_moe(), target_modules=[])
    optimizer = LoGRAOptimizer(model, rank=4, kl_budget=None, update_ratio=6e-5)
    assert optimizer.targets and all(t.experts > 1 for t in optimizer.targets)
    before = [t.weight.detach().clone() for t in optimizer.targets]
    model.train()
    model(**fixed_batch(batch=4, seq=12)).loss.backward()
    optimizer.step()
    assert all(not torch.equal(t.weight, old) for t, old in zip(optimizer.targets, before))
    with pytest.raises(ValueError, match="no LoGRA target modules found"):
        patch_model(tiny_qwen3_moe(), target_modules=["q_prj", "v_prj"])
    with pytest.raises(
        ValueError, match=r"target_modules=\[\] selects no linear layer, and no stacked experts are targets"
    ):
        patch_model(tiny_qwen3_moe(), target_modules=[], experts=False)
