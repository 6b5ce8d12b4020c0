"""``LoGRAOptimizer``: the merge against a dense float64 reference recomputed from the sketches,
projection refresh, the non-target optimizer, bad inputs, the optimizer's lifetime, non-finite
sketches and bf16 storage. The torch.optim contract (state_dict, schedulers, zero_grad,
accumulation) is in test_contract.py."""

from __future__ import annotations

import copy
import gc
import io
import math
import warnings

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from logra_optim import LoGRAOptimizer, make_projection, patch_model, patched_modules, probe, projection_seed
from tests.helpers import reference
from tests.helpers.optim import assert_same_state, backward_random, snapshot, two_linear
from tests.helpers.recorders import OutputShapes
from tests.helpers.reference import U16, U32
from tests.helpers.tiny import OneLinear, TwoLinear, fixed_batch, sketches, tiny_qwen2
from logra_optim.polar import POLAR_FLOOR, POLAR_FLOOR_16BIT
from logra_optim.patching import target_state
from logra_optim.projection import projection_key


def targets(model):
    return patched_modules(model)


# --------------------------------------------------------------------------------------------------
# The merge against a dense reference


@given(
    direction=st.sampled_from(["sgd", "rowadam"]),
    mode=st.sampled_from(["lr", "update_ratio"]),
    wire=st.sampled_from([None, torch.bfloat16]),
    refresh=st.booleans(),
    kind=st.sampled_from(["rademacher", "gaussian"]),
    rank=st.integers(1, 7),
    steps=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
    scope=st.sampled_from(["target", "model"]),
    beta1=st.sampled_from([0.0, 0.9]),
    refresh_every=st.sampled_from([1, 2]),
)
@settings(max_examples=80)
def test_merge_matches_dense_reference(
    direction, mode, wire, refresh, kind, rank, steps, seed, scope, beta1, refresh_every
):
    size = {"lr": 0.05, "update_ratio": 1e-2}[mode]
    model, opt = two_linear(
        ratio_scope=scope,
        model_seed=seed % 100,
        rank=rank,
        direction=direction,
        projection=kind,
        refresh=refresh,
        refresh_every=refresh_every,
        beta1=beta1,
        wire_dtype=wire,
        seed=seed,
        **{mode: size},
    )
    names = [n for n, _ in targets(model)]
    generator = torch.Generator().manual_seed(seed)
    moments = [torch.zeros(m.weight.shape[0], dtype=torch.float64) for _, m in targets(model)]
    first_moments = [torch.zeros(m.weight.shape[0], rank, dtype=torch.float64) for _, m in targets(model)]
    previous = None
    for step in range(1, steps + 1):
        backward_random(model, generator)
        before = snapshot(model)
        for (name, _), (_, _, a) in zip(targets(model), before):
            index = (step - 1) // refresh_every if refresh else 0
            assert torch.equal(
                a.float(), make_projection(projection_seed(seed, index, projection_key(name)), rank, a.shape[1], kind)
            )
        if previous is not None and beta1 > 0:
            for i, ((name, module), (_, _, a_old), (_, _, a_new)) in enumerate(zip(targets(model), previous, before)):
                if not torch.equal(a_old, a_new):  # a new basis: the moment was carried into it
                    first_moments[i] = reference.carried(first_moments[i], a_old, a_new)
                scale = first_moments[i].abs().max().item()
                torch.testing.assert_close(
                    opt.state[module.weight]["first_moment"].double(), first_moments[i], rtol=1e-5, atol=1e-5 * scale
                )
        opt.step()

        directions = []
        for i, (_, s, _) in enumerate(before):
            numerator = None
            if beta1 > 0:
                numerator, first_moments[i] = reference.momentum_step(s, first_moments[i], step, beta1)
            u, moments[i] = reference.direction(direction, s, moments[i], step, numerator=numerator)
            directions.append(u)
        previous = before
        if mode == "lr":
            etas = [size] * len(before)
        else:
            weights, projections = [w for w, _, _ in before], [a for _, _, a in before]
            etas = reference.step_sizes(size, weights, directions, projections, scope)
        for (name, module), (w, _, a), u, eta in zip(targets(model), before, directions, etas):
            factor = eta * u
            relative_factor_error = 1e-5
            if wire is not None:
                factor = factor.float().to(wire).double()
                relative_factor_error += 2 * U16  # the fp32 factor may round to the neighbouring bf16 value
            expected = reference.merged(w, factor, a)
            bound = (a.shape[0] + 2) * U32 * (w.abs() + factor.abs() @ a.abs()) + relative_factor_error * (
                factor.abs() @ a.abs()
            )
            assert ((module.weight.double() - expected).abs() <= bound).all(), name
            if direction == "rowadam":
                state = opt.state[module.weight]
                torch.testing.assert_close(
                    state["row_second_moment"].double(), moments[names.index(name)], rtol=1e-5, atol=0
                )
            assert int(opt.state[module.weight]["step"]) == step
            assert not target_state(module).sketch.any()  # cleared: it was expressed in the old basis
        assert opt.update_index == step
        assert opt.stats["alpha"] == 1.0 and opt.stats["update_index"] == step


def recovered_factor(w_before, w_after, a):
    """F from ΔW = −F A (A has full row rank): F = −ΔW Aᵀ (A Aᵀ)⁻¹, in float64."""
    delta = w_after.double() - w_before.double()
    return -torch.linalg.solve(a @ a.t(), (delta @ a.t()).t()).t()


@pytest.mark.parametrize("wire", [None, torch.bfloat16])
def test_wire_dtype_rounds_the_merged_factor(wire):
    """The trainer must merge exactly the factor a rollout engine is sent: with bf16 on the wire,
    the F recovered from ΔW lies on the bf16 grid; without, it does not."""
    model, opt = two_linear(rank=4, lr=0.05, direction="sgd", wire_dtype=wire)
    backward_random(model, torch.Generator().manual_seed(0))
    before = snapshot(model)
    opt.step()
    for (_, module), (w, s, a) in zip(targets(model), before):
        factor = recovered_factor(w, module.weight, a)
        # ΔW is ~1e-2 of W, so fp32 storage of W perturbs the recovered F by ~1e-5 relative at most.
        torch.testing.assert_close(factor, 0.05 * s, rtol=2 * U16 if wire else 1e-4, atol=0)
        on_grid = (factor - factor.float().bfloat16().double()).abs() <= 1e-4 * factor.abs()
        assert on_grid.all() if wire else on_grid.float().mean() < 0.5


@pytest.mark.parametrize("wire", [None, torch.bfloat16])
@pytest.mark.parametrize("direction", ["sgd", "rowadam", "orthogonal"])
def test_update_ratio_sets_the_relative_update_norm(wire, direction):
    ratio = 1e-3
    model = patch_model(tiny_qwen2())
    opt = LoGRAOptimizer(model, rank=8, direction=direction, update_ratio=ratio, wire_dtype=wire)
    model.train()
    for step in range(2):
        model(**fixed_batch(seed=step)).loss.backward()
        before = [m.weight.detach().double().clone() for _, m in targets(model)]
        opt.step()
        after = [m.weight for _, m in targets(model)]
        # fp32 storage of W (~6e-8 relative to W) seen through a 1e-3 update: ~1e-4; bf16 factor: 2⁻⁸.
        assert math.isclose(reference.relative_update_norm(before, after), ratio, rel_tol=U16 if wire else 1e-3)


def test_ratio_scope_target_moves_every_target_by_the_same_relative_amount():
    """Default ``ratio_scope="target"``: each target moves by ρ of its own norm even when one layer's
    gradient is 1000× another's; with ``"model"`` and a direction that keeps the gradient's scale
    (RowAdam, SGD) the large-gradient layer takes nearly all the step."""
    ratio = 1e-3
    for scope in ("target", "model"):
        model, opt = two_linear(rank=4, update_ratio=ratio, wire_dtype=None, ratio_scope=scope, direction="rowadam")
        assert opt.param_groups[0]["ratio_scope"] == scope
        backward_random(model, torch.Generator().manual_seed(0))
        opt.targets[0].state.sketch.mul_(1000.0)  # a layer with a much larger gradient
        before = [m.weight.detach().double().clone() for _, m in targets(model)]
        opt.step()
        ratios = [reference.relative_update_norm([b], [m.weight]) for b, (_, m) in zip(before, targets(model))]
        after = [m.weight for _, m in targets(model)]
        assert math.isclose(reference.relative_update_norm(before, after), ratio, rel_tol=1e-3)
        if scope == "target":
            assert all(math.isclose(r, ratio, rel_tol=1e-3) for r in ratios), ratios
        else:
            assert ratios[1] < 1e-2 * ratios[0], ratios


def test_checkpoint_without_ratio_scope_resumes_with_one_step_size():
    """A state_dict saved before ``ratio_scope`` existed resumes with the rule it was trained with."""
    model, opt = two_linear(rank=4, update_ratio=1e-3)
    state = opt.state_dict()
    del state["param_groups"][0]["ratio_scope"]
    opt.load_state_dict(state)
    assert opt.param_groups[0]["ratio_scope"] == "model"


def test_rowadam_row_moment_survives_projection_refresh():
    """The moment is indexed by output rows, so a new A (a new sketch basis) must neither reset nor
    otherwise alter it: across refreshes it follows v ← β2 v + (1−β2) mean_j S_ij² exactly."""
    model, opt = two_linear(rank=5, direction="rowadam", update_ratio=1e-3, refresh_every=1, beta1=0.0)
    generator = torch.Generator().manual_seed(1)
    moments = [torch.zeros(m.weight.shape[0], dtype=torch.float64) for _, m in targets(model)]
    previous_projection = None
    for step in range(1, 5):
        backward_random(model, generator)
        before = snapshot(model)
        if previous_projection is not None:
            assert not torch.equal(before[0][2], previous_projection)  # really a new basis
        previous_projection = before[0][2]
        opt.step()
        for i, ((_, module), (_, s, _)) in enumerate(zip(targets(model), before)):
            _, moments[i] = reference.rowadam_step(s, moments[i], step)
            moment = opt.state[module.weight]["row_second_moment"]
            assert moment.shape == (module.weight.shape[0],) and moment.dtype == torch.float32
            torch.testing.assert_close(moment.double(), moments[i], rtol=1e-5, atol=0)


@pytest.mark.parametrize("refresh_every", [None, 2])
def test_projection_refresh_and_fixed_basis(tiny, batch, refresh_every):
    """A is redrawn after every ``refresh_every`` updates (default 10), never with ``refresh=False``."""
    patch_model(tiny)
    every = {} if refresh_every is None else {"refresh_every": refresh_every}
    opt = LoGRAOptimizer(tiny, rank=4, lr=1e-3, seed=9, **every)
    fixed_model = patch_model(tiny_qwen2())
    fixed = LoGRAOptimizer(fixed_model, rank=4, lr=1e-3, seed=9, refresh=False)
    for model in (tiny, fixed_model):
        model.train()
    period = refresh_every or 10
    for update in range(period + 1):
        for model, optimizer, index in ((tiny, opt, update // period), (fixed_model, fixed, 0)):
            assert optimizer.projection_index == index
            for name, module in targets(model):
                seed = projection_seed(9, index, projection_key(name))
                assert torch.equal(
                    target_state(module).generate_projection(), make_projection(seed, 4, module.in_features)
                )
            model(**batch).loss.backward()
            optimizer.step()


def test_projection_seed_ignores_wrapper_prefixes(batch):
    """A model wrapped by torch.compile (``_orig_mod.``) gets the same A as the bare model: a rollout
    engine that knows the bare names must regenerate it."""

    class Compiled(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    bare = patch_model(tiny_qwen2())
    wrapped = patch_model(Compiled(tiny_qwen2()))
    _bare_optimizer = LoGRAOptimizer(bare, rank=4, lr=1e-3)
    _wrapped_optimizer = LoGRAOptimizer(wrapped, rank=4, lr=1e-3)
    bare_names = [n for n, _ in targets(bare)]
    wrapped_targets = targets(wrapped)
    assert [n for n, _ in wrapped_targets] == ["_orig_mod." + n for n in bare_names]
    for (_, a), (_, b) in zip(targets(bare), wrapped_targets):
        assert torch.equal(target_state(a).generate_projection(), target_state(b).generate_projection())


# --------------------------------------------------------------------------------------------------
# Non-target parameters


def test_non_target_optimizer_trains_unfrozen_parameters(tiny, batch):
    patch_model(tiny)
    tiny.lm_head.weight.requires_grad_(True)
    tiny.model.norm.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*lm_head\.weight|lm_head\.weight.*model\.norm\.weight"):
        LoGRAOptimizer(tiny, rank=4, lr=1e-3)
    opt = LoGRAOptimizer(tiny, rank=4, lr=1e-3, non_target_optimizer=lambda params: torch.optim.SGD(params, lr=0.5))
    assert {id(p) for g in opt.non_target_optimizer.param_groups for p in g["params"]} == {
        id(tiny.lm_head.weight),
        id(tiny.model.norm.weight),
    }
    tiny.train()
    tiny(**batch).loss.backward()
    head, grad = tiny.lm_head.weight.detach().clone(), tiny.lm_head.weight.grad.clone()
    target_before = tiny.model.layers[0].self_attn.q_proj.weight.clone()
    opt.step()
    assert torch.equal(tiny.lm_head.weight, head.add(grad, alpha=-0.5))
    assert not torch.equal(tiny.model.layers[0].self_attn.q_proj.weight, target_before)
    assert all(m.weight.grad is None for _, m in targets(tiny))
    opt.zero_grad(set_to_none=False)
    assert torch.equal(tiny.lm_head.weight.grad, torch.zeros_like(grad))
    opt.zero_grad()
    assert tiny.lm_head.weight.grad is None


def test_non_target_optimizer_state_is_checkpointed(batch):
    def build():
        model = patch_model(tiny_qwen2())
        model.lm_head.weight.requires_grad_(True)
        return model, LoGRAOptimizer(
            model, rank=4, lr=1e-3, non_target_optimizer=lambda params: torch.optim.Adam(params, lr=1e-3)
        )

    model, opt = build()
    model.train()
    model(**batch).loss.backward()
    opt.step()
    state = opt.state_dict()
    assert "exp_avg" in state["non_target"]["state"][0]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    _, resumed = build()
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert_same_state(resumed.state_dict(), state)
    plain_model = patch_model(tiny_qwen2())
    with pytest.raises(ValueError, match="non_target_optimizer"):
        LoGRAOptimizer(plain_model, rank=4, lr=1e-3).load_state_dict(state)


@pytest.mark.parametrize("share_projections", [True, False])
def test_state_tensors_are_what_the_optimizer_keeps_between_steps(batch, share_projections):
    """Sketch buffers, each target's state and one ``r×r`` Gram matrix per distinct projection
    (four per layer when siblings share ``A``: q/k/v, o, gate/up, down; one per target otherwise)."""
    model = patch_model(tiny_qwen2())
    opt = LoGRAOptimizer(model, rank=4, update_ratio=1e-3, share_projections=share_projections)
    assert all(any(t is b for t in opt.state_tensors()) for b in opt.sketch_buffers())
    model.train()
    model(**batch).loss.backward()
    opt.step()
    kept = opt.state_tensors()
    grams = [t for t in kept if t.shape == (4, 4)]
    assert len(grams) == (8 if share_projections else len(opt.targets))
    moments = [opt.state[target.weight]["first_moment"] for target in opt.targets]
    assert all(any(t is m for t in kept) for m in moments)
    assert len(kept) == len(opt.sketch_buffers()) + sum(len(s) for s in opt.state.values()) + len(grams)


def test_state_dict_keeps_the_projection_sharing(batch):
    """``share_projections`` is part of what determines ``A``: a resume draws the projections the
    checkpoint was trained with, and a checkpoint from before the option (no key) drew one per target."""
    model = patch_model(tiny_qwen2())
    opt = LoGRAOptimizer(model, rank=4, lr=1e-3, share_projections=False)
    model.train()
    model(**batch).loss.backward()
    opt.step()
    state = opt.state_dict()
    assert state["logra"]["share_projections"] is False
    resumed = LoGRAOptimizer(patch_model(tiny_qwen2()), rank=4, lr=1e-3)  # default: shared
    resumed.load_state_dict(state)
    assert all(
        torch.equal(a.state.generate_projection(), b.state.generate_projection())
        for a, b in zip(opt.targets, resumed.targets)
    )
    del state["logra"]["share_projections"]
    shared = LoGRAOptimizer(patch_model(tiny_qwen2()), rank=4, lr=1e-3)
    shared.load_state_dict(state)
    assert not shared.options.share_projections
    assert len({id(t.state.shared_projection) for t in shared.targets}) == len(shared.targets)


# --------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(rank=0), ValueError, "rank must be a positive integer, got 0"),
        (dict(rank=-3), ValueError, "rank must be a positive integer, got -3"),
        (dict(rank=2.0), ValueError, "rank must be a positive integer"),
        (dict(rank=True), ValueError, "rank must be a positive integer"),
        (dict(direction="adam"), ValueError, r"direction must be one of .*'adam'"),
        (dict(optimizer="adam"), ValueError, r"optimizer must be one of .*'adam'"),  # the deprecated name
        (dict(projection="sparse"), ValueError, r"projection must be one of .*'sparse'"),
        (dict(kl_budget=0.0), ValueError, "kl_budget must be a positive"),
        (dict(kl_budget=-1e-3), ValueError, "kl_budget must be a positive"),
        (dict(kl_budget=float("nan")), ValueError, "kl_budget must be a positive"),
        (dict(update_ratio=0.0), ValueError, "update_ratio must be a positive"),
        (dict(update_ratio=-1e-4), ValueError, "update_ratio must be a positive"),
        (dict(update_ratio=float("inf")), ValueError, "update_ratio must be a positive"),
        (dict(lr=0), ValueError, "lr must be a positive"),
        (dict(lr=-0.1), ValueError, "lr must be a positive"),
        (dict(lr=float("nan")), ValueError, "lr must be a positive"),
        (dict(lr=1e-3, update_ratio=1e-4), ValueError, "either update_ratio .* or lr"),
        (dict(alpha_max=0), ValueError, "alpha_max must be a positive"),
        (dict(beta2=1.0), ValueError, "beta2 must be in"),
        (dict(beta1=1.0), ValueError, r"beta1 must be in \[0, 1\), got 1.0"),
        (dict(beta1=-0.1), ValueError, "beta1 must be in"),
        (dict(refresh_every=0), ValueError, "refresh_every must be a positive integer, got 0"),
        (dict(refresh_every=2.5), ValueError, "refresh_every must be a positive integer"),
        (dict(eps=0), ValueError, "eps must be a positive"),
        (dict(wire_dtype=torch.int8), ValueError, "wire_dtype must be one of"),
        (dict(wire_dtype=torch.float16), ValueError, "wire_dtype must be one of .*float16's range"),
        (dict(wire_dtype=torch.float8_e5m2), ValueError, "wire_dtype must be one of"),
        (dict(seed="abc"), ValueError, "seed must be an integer, got 'abc'"),
        (dict(seed=1.7), ValueError, "seed must be an integer, got 1.7"),
        (dict(seed=None), ValueError, "seed must be an integer, got None"),
        (dict(refresh="no"), ValueError, "refresh must be True or False, got 'no'"),
        (dict(share_projections=1), ValueError, "share_projections must be True or False, got 1"),
        (dict(stochastic_rounding="no"), ValueError, "stochastic_rounding must be True or False"),
    ],
)
def test_bad_arguments_are_rejected_with_their_name(tiny, kwargs, error, match):
    patch_model(tiny)
    kwargs = {"rank": 4, **kwargs}
    with pytest.raises(error, match=match):
        LoGRAOptimizer(tiny, **kwargs)
    # A failed construction binds nothing: a valid optimizer can still be created.
    LoGRAOptimizer(tiny, rank=4)


def test_a_numpy_or_negative_integer_seed_is_an_integer_seed(tiny):
    import numpy as np

    patch_model(tiny)
    for seed in (np.int64(7), -3):
        optimizer = LoGRAOptimizer(tiny, rank=4, seed=seed)
        assert optimizer.seed == int(seed) and type(optimizer.seed) is int
        tiny.train()
        tiny(**fixed_batch()).loss.backward()
        optimizer.step()
        assert optimizer.update_index == 1
        del optimizer
        gc.collect()


def test_rank_larger_than_a_target_names_the_module(tiny):
    patch_model(tiny)
    # q_proj is 64×64 but k_proj is 32×64 (one KV head of 32): the first target too small is named.
    with pytest.raises(ValueError, match=r"rank=33 .*'model\.layers\.0\.self_attn\.k_proj'.*32×64"):
        LoGRAOptimizer(tiny, rank=33)
    LoGRAOptimizer(tiny, rank=32)
    # Limited by the input side too.
    narrow = patch_model(OneLinear(4, 10), target_modules=["proj"])
    with pytest.raises(ValueError, match=r"rank=5 .*'proj'.*10×4"):
        LoGRAOptimizer(narrow, rank=5)


def test_model_must_be_patched_and_passed_whole(tiny):
    with pytest.raises(ValueError, match="no LoGRA targets; call patch_model"):
        LoGRAOptimizer(tiny, rank=4)
    patch_model(tiny)
    with pytest.raises(TypeError, match=r"takes the patched model, e\.g\. LoGRAOptimizer\(patch_model\(model\)\)"):
        LoGRAOptimizer(tiny.parameters(), rank=4)


def test_a_second_optimizer_on_a_bound_model_is_rejected(tiny):
    patch_model(tiny)
    opt = LoGRAOptimizer(tiny, rank=4)
    with pytest.raises(
        RuntimeError, match=r"'model\.layers\.0\.self_attn\.q_proj' is already driven by another LoGRAOptimizer"
    ):
        LoGRAOptimizer(tiny, rank=4)
    # Binding is released when the first optimizer goes away.
    del opt
    gc.collect()
    LoGRAOptimizer(tiny, rank=4)


def test_unfrozen_target_weight_is_rejected(tiny):
    patch_model(tiny)
    tiny.model.layers[1].mlp.gate_proj.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.gate_proj' has requires_grad=True"):
        LoGRAOptimizer(tiny, rank=4, non_target_optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


def test_fp16_target_weights_are_refused():
    model = patch_model(OneLinear(8, 8).half(), target_modules=["proj"])
    with pytest.raises(ValueError, match=r"'proj' is stored in float16.*bf16"):
        LoGRAOptimizer(model, rank=2)
    # Also when the model becomes fp16 after the optimizer was built: refused at the step, untouched.
    model = patch_model(OneLinear(8, 8), target_modules=["proj"])
    opt = LoGRAOptimizer(model, rank=2, update_ratio=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    model.half()
    before = model.proj.weight.detach().clone()
    with pytest.raises(ValueError, match=r"'proj' is stored in float16"):
        opt.step()
    assert torch.equal(model.proj.weight, before) and opt.update_index == 0


def test_sketches_of_fp16_gradients_are_refused_with_the_weights_untouched():
    """fp16 autocast without a scaler: gradients of a mean over many tokens underflow in fp16 and the
    sketch is wrong with no sign of it, so the step refuses it (bf16 autocast is what LoGRA takes)."""
    model, opt = two_linear(rank=6, kl_budget=None, update_ratio=6e-5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.autocast("cpu", dtype=torch.float16):
        model(torch.randn(4, 12)).sum().backward()
    with pytest.raises(RuntimeError, match=r"float16 gradients .*torch.autocast\(dtype=torch.bfloat16\)"):
        opt.step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()) and opt.update_index == 0
    opt.zero_grad()  # drops the fp16 sketches: bf16 autocast then steps
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(4, 12)).sum().backward()
    opt.step()
    assert opt.update_index == 1
    # A closure's backward is checked too: the step refuses what the closure sketched.
    after = {n: p.detach().clone() for n, p in model.named_parameters()}

    def closure():
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 12)).sum()
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="float16 gradients"):
        opt.step(closure)
    assert all(torch.equal(p, after[n]) for n, p in model.named_parameters()) and opt.update_index == 1


def test_bf16_targets_rounded_to_nearest_are_warned_about():
    model = patch_model(OneLinear(8, 8).to(torch.bfloat16), target_modules=["proj"])
    with pytest.warns(RuntimeWarning, match="stochastic_rounding=False.*most weights will not move") as caught:
        LoGRAOptimizer(model, rank=2, stochastic_rounding=False)
    assert caught[0].filename == __file__


def test_warnings_from_the_command_line_name_its_line():
    """``logra demo`` and ``logra bench`` call the library like a user's script: a warning names
    their line, not the library's frames below it nor the runner above."""
    from logra_optim.caller import warn

    namespace = {"__name__": "logra_optim.cli.example", "warn": warn}
    exec(compile("def run():\n    warn('from the CLI', RuntimeWarning)\n", "cli_example.py", "exec"), namespace)
    with pytest.warns(RuntimeWarning, match="from the CLI") as caught:
        namespace["run"]()
    assert caught[0].filename == "cli_example.py"


def test_warnings_during_step_name_the_callers_line_through_an_lr_scheduler():
    """An LR scheduler wraps ``step`` in one more frame (accelerate and TRL add theirs): the warning
    still names the line that called ``step()``."""
    model, opt = two_linear(rank=6, kl_budget=None, update_ratio=1e-3)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    (model(torch.randn(2, 12)) * float("nan")).sum().backward()
    with pytest.warns(RuntimeWarning, match="non-finite") as caught:
        opt.step()
    assert caught[0].filename == __file__


# --------------------------------------------------------------------------------------------------
# Lifetime and train mode


def test_releasing_the_optimizer_unbinds_the_model():
    model = patch_model(tiny_qwen2())
    model.train()
    opt = LoGRAOptimizer(model, rank=3, kl_budget=1e-3)
    hooks = len(model._forward_pre_hooks)
    del opt
    gc.collect()
    assert all(not target_state(m).bound and target_state(m).sketch is None for _, m in patched_modules(model))
    assert len(model._forward_pre_hooks) == hooks - 1  # the context recorder left too
    with OutputShapes() as ops:
        model(**fixed_batch())
    assert not ops.projected_inputs(3)  # plain forwards: no sketch work for an optimizer that is gone
    LoGRAOptimizer(model, rank=3)  # and the model can be bound again


def test_step_warns_once_when_the_training_forward_ran_in_eval_mode():
    model = patch_model(tiny_qwen2())
    model.lm_head.weight.requires_grad_(True)  # so that an eval-mode loss can be backpropagated
    opt = LoGRAOptimizer(model, rank=4, non_target_optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
    model.eval()
    for _ in range(2):
        model(**fixed_batch()).loss.backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        eval_warnings = [w for w in caught if "eval mode" in str(w.message)]
        assert len(eval_warnings) == (1 if _ == 0 else 0)
        assert all(w.filename == __file__ for w in eval_warnings)  # points at the caller's step()


def test_step_warns_once_of_an_eval_mode_microbatch_whose_backward_reached_no_sketch():
    """With a trainable non-target upstream (the embeddings), a loss computed in eval mode (dropout
    off, a common RL habit) backpropagates, trains the embeddings and adds nothing to the sketches.
    Beside a train-mode microbatch the sketches are not empty, so only this warning says so. An eval
    forward with grad enabled that no backward follows marks nothing."""
    model = patch_model(tiny_qwen2())
    model.model.embed_tokens.weight.requires_grad_(True)
    opt = LoGRAOptimizer(model, rank=4, non_target_optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
    for step in range(3):
        model.train()
        model(**fixed_batch(seed=0)).loss.backward()
        train_only = {name: s.clone() for name, s in sketches(model).items()}
        model.eval()
        loss = model(**fixed_batch(seed=1)).loss
        if step > 0:
            loss.backward()
        assert all(torch.equal(s, train_only[name]) for name, s in sketches(model).items())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        opt.zero_grad()
        named = [w for w in caught if "eval-mode forward of" in str(w.message)]
        assert len(named) == (1 if step == 1 else 0)
        assert all(w.filename == __file__ for w in named)
        assert all(
            str(w.message).startswith("LoGRA: a backward went through an eval-mode forward of 14 of 14") for w in named
        )


def test_a_gradient_taken_from_an_eval_forward_with_nothing_else_trainable_is_not_warned_of():
    """A diagnostic (``torch.autograd.grad`` of an eval forward's loss with respect to the input
    embeddings), as docs/api.md advises, with no trainable non-target: nothing is warned of."""
    model = patch_model(tiny_qwen2())
    opt = LoGRAOptimizer(model, rank=4)
    batch = fixed_batch(seed=0)
    model.eval()
    embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_()
    loss = model(inputs_embeds=embeds, labels=batch["labels"]).loss
    (gradient,) = torch.autograd.grad(loss, embeds)
    assert gradient.abs().sum() > 0
    model.train()
    model(**batch).loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        opt.step()


# --------------------------------------------------------------------------------------------------
# Non-finite and zero sketches


def poison_nan(model):
    """A NaN in one activation of the second layer, as an overflow in a real run would produce."""

    def hook(module, args, output):
        output = output.clone()
        output.view(-1)[7] = float("nan")
        return output

    return model.model.layers[1].mlp.up_proj.register_forward_hook(hook)


@pytest.mark.parametrize("poison", ["inf_loss", "nan_activation"])
def test_non_finite_sketch_skips_the_step_and_changes_nothing(poison):
    def build():
        model = patch_model(tiny_qwen2())
        model.train()
        return model, LoGRAOptimizer(model, rank=4, direction="rowadam", update_ratio=1e-3)

    def good_step(model, opt, seed):
        model(**fixed_batch(seed=seed)).loss.backward()
        opt.step()

    model, opt = build()
    good_step(model, opt, 0)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = copy.deepcopy(opt.state_dict())
    projections = [target_state(m).generate_projection() for _, m in targets(model)]

    if poison == "inf_loss":
        (model(**fixed_batch(seed=1)).loss * float("inf")).backward()
    else:
        handle = poison_nan(model)
        model(**fixed_batch(seed=1)).loss.backward()
        handle.remove()
    assert not all(torch.isfinite(s).all() for s in sketches(model).values())
    with pytest.warns(RuntimeWarning, match="non-finite sketch .* at update 2") as caught:
        opt.step()
    assert caught[0].filename == __file__  # points at the caller's step()

    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert_same_state(opt.state_dict()["state"], state["state"])
    assert opt.update_index == 1
    assert opt.stats["nonfinite_skips"] == 1 and opt.stats["skipped"]
    assert all(torch.equal(target_state(m).generate_projection(), a) for (_, m), a in zip(targets(model), projections))
    assert all(torch.isfinite(s).all() and not s.any() for s in sketches(model).values())
    assert opt.state_dict()["logra"]["nonfinite_skips"] == 1

    # The skip leaves no trace: training continues exactly as if the bad batch never happened.
    good_step(model, opt, 2)
    reference, reference_opt = build()
    good_step(reference, reference_opt, 0)
    good_step(reference, reference_opt, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


@pytest.mark.parametrize("direction", ["sgd", "rowadam"])
def test_finite_sketch_with_a_non_finite_plan_skips_the_step_and_changes_nothing(direction):
    """A finite but huge sketch. SGD's direction is the sketch itself: it overflows the fp32 Gram of
    ‖U A‖², whose inf against the projection Gram's zeros made η NaN, which was merged into every
    weight. RowAdam's fp32 row moment overflows: the direction came out zero and the inf moment was
    kept, zeroing every later direction of the target."""
    model = patch_model(tiny_qwen2())
    model.train()
    opt = LoGRAOptimizer(model, rank=4, direction=direction, update_ratio=1e-3)
    model(**fixed_batch(seed=0)).loss.backward()
    (buffer,) = opt.sketch_buffers()
    buffer.mul_(1e25 / buffer.abs().max())
    assert torch.isfinite(buffer).all()
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="non-finite direction, step size or optimizer state at update 1"):
        opt.step()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert opt.stats["skipped"] == "nonfinite_plan" and opt.nonfinite_skips == 1 and opt.update_index == 0
    assert not buffer.any()  # cleared, as after any skip
    model(**fixed_batch(seed=1)).loss.backward()
    opt.step()  # the next, ordinary, update goes through
    assert opt.update_index == 1 and all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(t).all() for entry in opt.state.values() for t in entry.values())
    before = {id(p): w for p, w in zip(model.parameters(), weights)}
    assert all(not torch.equal(m.weight, before[id(m.weight)]) for _, m in patched_modules(model))  # all moved


def test_non_finite_sketch_leaves_non_target_weights_untouched(tiny, batch):
    patch_model(tiny)
    tiny.lm_head.weight.requires_grad_(True)
    opt = LoGRAOptimizer(tiny, rank=4, lr=1e-3, non_target_optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    head = tiny.lm_head.weight.detach().clone()
    tiny.train()
    (tiny(**batch).loss * float("inf")).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        opt.step()
    assert torch.equal(tiny.lm_head.weight, head)


def test_a_non_finite_non_target_gradient_alone_skips_the_update(tiny, batch):
    """Finite sketches, one NaN in a trainable non-target's ``.grad``: the whole update is skipped,
    targets and non-targets untouched, the skip counted."""
    patch_model(tiny)
    tiny.lm_head.weight.requires_grad_(True)
    opt = LoGRAOptimizer(tiny, rank=4, lr=1e-3, non_target_optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    before = {name: p.detach().clone() for name, p in tiny.named_parameters()}
    tiny.train()
    tiny(**batch).loss.backward()
    assert all(torch.isfinite(s).all() for s in opt.sketch_buffers())
    tiny.lm_head.weight.grad[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()
    assert all(torch.equal(p, before[name]) for name, p in tiny.named_parameters())
    assert opt.nonfinite_skips == 1 and opt.update_index == 0


def test_a_skipped_probe_leaves_the_non_targets_untouched(tiny, batch):
    """The non-target optimizer steps only once the update is certain: after the probe, which
    would otherwise also see the non-targets already moved."""
    patch_model(tiny)
    tiny.lm_head.weight.requires_grad_(True)

    def nan_logits(model, contexts):
        return torch.full((*contexts.input_ids.shape, 128), float("nan"))

    opt = LoGRAOptimizer(
        tiny,
        rank=4,
        kl_budget=1e-3,
        probe="finite_difference",
        probe_logits_fn=nan_logits,
        non_target_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    before = {name: p.detach().clone() for name, p in tiny.named_parameters()}
    tiny.train()
    tiny(**batch).loss.backward()
    with pytest.warns(RuntimeWarning):
        opt.step()
    assert opt.probe_skips == 1 and opt.update_index == 0
    assert all(torch.equal(p, before[name]) for name, p in tiny.named_parameters())


def test_zero_sketch_with_sgd_leaves_weights_unchanged(tiny, batch):
    patch_model(tiny)
    opt = LoGRAOptimizer(tiny, rank=4, direction="sgd", update_ratio=1e-3)
    weights = [p.detach().clone() for p in tiny.parameters()]
    tiny.train()
    (tiny(**batch).loss * 0.0).backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(tiny.parameters(), weights))
    assert opt.stats["eta"] == 0.0


def test_zero_sketch_with_rowadam_leaves_weights_finite_and_unchanged(tiny, batch):
    patch_model(tiny)
    opt = LoGRAOptimizer(tiny, rank=4, direction="rowadam", update_ratio=1e-3)
    weights = [p.detach().clone() for p in tiny.parameters()]
    tiny.train()
    (tiny(**batch).loss * 0.0).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(tiny.parameters(), weights))


# --------------------------------------------------------------------------------------------------
# bf16 weight storage


@pytest.mark.parametrize("stochastic_rounding", [True, False])
def test_sub_ulp_updates_survive_bf16_storage_on_average(stochastic_rounding):
    """With bf16 weights an update of ~0.1 ulp per entry is lost by round-to-nearest. Stochastic
    rounding keeps it in expectation: the realised ΔW projected on the intended D = −F A has
    coefficient 1, with a standard error computed from the Bernoulli rounding of every entry."""
    d = k = 64
    model = patch_model(OneLinear(k, d, bias=False).bfloat16(), target_modules=["proj"])
    opt = LoGRAOptimizer(
        model, rank=8, direction="sgd", lr=1.0, wire_dtype=None, stochastic_rounding=stochastic_rounding
    )
    generator = torch.Generator().manual_seed(0)
    model(torch.randn(16, k, generator=generator).bfloat16()).backward(
        torch.randn(16, d, generator=generator).bfloat16()
    )
    weight = model.proj.weight
    w0, s, a = (
        weight.detach().double().clone(),
        target_state(model.proj).sketch.double(),
        target_state(model.proj).generate_projection().double(),
    )
    spacing = 2.0 ** (torch.floor(torch.log2(w0.abs().clamp_min(2.0**-126))) - 7)  # bf16 ulp of each entry
    intended = -(s @ a)
    # Scale the step (lr) so the typical entry moves by a tenth of its bf16 spacing.
    lr = 0.1 * float((spacing / intended.abs().clamp_min(1e-30)).median())
    opt.param_groups[0]["lr"] = lr
    intended = intended * lr
    opt.step()

    delta = weight.double() - w0
    coefficient = float((delta * intended).sum() / intended.square().sum())
    # Each entry rounds the fp32 value x between its bf16 neighbours (gap h) with p = (x − low)/h.
    x = (w0 + intended).float()
    low, high = reference.bf16_neighbours(x)
    p = (x.double() - low) / (high - low)
    variance = (high - low).square() * p * (1 - p)
    standard_error = float((intended.square() * variance).sum().sqrt() / intended.square().sum())
    assert standard_error < 0.1  # the test can tell 1 from 0
    if stochastic_rounding:
        assert abs(coefficient - 1.0) < 5 * standard_error
    else:
        assert coefficient < 0.5


def test_an_unused_target_does_not_poison_the_others():
    class TwoBranches(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.used = nn.Linear(6, 6)
            self.unused = nn.Linear(6, 6)

        def forward(self, x):
            return self.used(x) + 0.0 * self.unused(x)

    model = patch_model(TwoBranches(), target_modules=["used", "unused"])
    opt = LoGRAOptimizer(model, rank=2, direction="rowadam", update_ratio=1e-2)
    model(torch.randn(4, 6)).square().sum().backward()
    assert not target_state(model.unused).sketch.any() and target_state(model.used).sketch.any()
    unused_before = model.unused.weight.detach().clone()
    opt.step()
    assert torch.isfinite(model.used.weight).all()
    assert torch.equal(model.unused.weight, unused_before)


# --------------------------------------------------------------------------------------------------
# Deprecated spelling and the single param group


def test_deprecated_optimizer_option_still_works_and_warns():
    model_a, model_b = OneLinear(8, 6, seed=1), OneLinear(8, 6, seed=1)
    patch_model(model_a, target_modules=["proj"])
    patch_model(model_b, target_modules=["proj"])
    with pytest.warns(DeprecationWarning, match=r"optimizer=\.\.\.\) is deprecated; use direction=") as caught:
        old = LoGRAOptimizer(model_a, rank=2, optimizer="sgd", update_ratio=1e-2)
    assert caught[0].filename == __file__  # points at the caller
    new = LoGRAOptimizer(model_b, rank=2, direction="sgd", update_ratio=1e-2)
    assert old.param_groups[0]["direction"] == "sgd"
    x = torch.randn(5, 8)
    for model, opt in ((model_a, old), (model_b, new)):
        model(x).square().sum().backward()
        opt.step()
    assert torch.equal(model_a.proj.weight, model_b.proj.weight)
    with pytest.raises(ValueError, match="not both"):
        LoGRAOptimizer(patch_model(OneLinear(8, 6), target_modules=["proj"]), rank=2, direction="sgd", optimizer="sgd")


def test_the_default_direction_is_the_polar_factor_of_the_first_moment():
    """Without ``direction=``, every merged factor is ``η`` times the polar factor of the
    bias-corrected first moment (float64 reference: momentum of the sketches, SVD): all its
    singular values equal ``η``; the state is the step and the first moment, nothing per row."""
    model, opt = two_linear(rank=4, update_ratio=1e-2, wire_dtype=None)
    assert opt.param_groups[0]["direction"] == "orthogonal"
    factors = []
    opt.register_merge_hook(lambda _, update: factors.append([t.factor.double() for t in update.targets]))
    generator = torch.Generator().manual_seed(0)
    moments = [torch.zeros(m.weight.shape[0], 4, dtype=torch.float64) for _, m in targets(model)]
    for step in range(1, 4):
        backward_random(model, generator, rows=8)  # full-rank sketches: a well-defined polar factor
        before = snapshot(model)
        opt.step()
        for i, ((_, module), (_, sketch, _), factor) in enumerate(zip(targets(model), before, factors[-1])):
            numerator, moments[i] = reference.momentum_step(sketch, moments[i], step, 0.9)
            singular = torch.linalg.svdvals(factor)
            eta = float(singular.mean())
            torch.testing.assert_close(singular, torch.full_like(singular, eta), rtol=1e-5, atol=0)
            torch.testing.assert_close(factor, eta * reference.polar(numerator), rtol=0, atol=1e-5 * eta)
            assert set(opt.state[module.weight]) == {"step", "first_moment"}


def test_a_16bit_sketch_keeps_its_rounding_noise_small_in_the_orthogonal_direction():
    """Two tokens make a rank-2 sketch; under bf16 autocast its other directions are rounding noise
    at about 1e-3 of the signal. The backward records the 16-bit product, and the optimizer raises its
    floor for good (the first moment keeps that noise; checkpointed): those directions then keep
    about a tenth of the two signal directions' weight or less, where the fp32 floor would raise them
    to unit size. An fp32 or float64 backward records nothing."""
    model, opt = two_linear(rank=6, kl_budget=None, update_ratio=1e-3, wire_dtype=None, beta1=0.0)
    factors = []
    opt.register_merge_hook(lambda _, update: factors.append([t.factor.double() for t in update.targets]))
    generator = torch.Generator().manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        backward_random(model, generator, rows=2)
    assert all(t.state.sketched_in_16_bit for t in opt.targets) and opt.polar_floor == POLAR_FLOOR
    sketches = [t.state.sketch.double().clone() for t in opt.targets]
    opt.step()
    for sketch, factor in zip(sketches, factors[0]):
        noise = torch.linalg.svdvals(sketch)
        assert noise[2] > 1e-5 * noise[0]  # above the fp32 floor: without the record it would be 1
        singular = torch.linalg.svdvals(factor)
        assert singular[1] > 0.99 * singular[0] and singular[2] < 0.2 * singular[0], singular
    assert not any(t.state.sketched_in_16_bit for t in opt.targets)  # cleared with the sketches
    assert opt.polar_floor == POLAR_FLOOR_16BIT and opt.state_dict()["logra"]["polar_floor"] == POLAR_FLOOR_16BIT
    backward_random(model, generator, rows=2)  # fp32: nothing recorded, the floor stays raised
    assert not any(t.state.sketched_in_16_bit for t in opt.targets)
    opt.step()
    assert opt.polar_floor == POLAR_FLOOR_16BIT
    _, fresh = two_linear(rank=6, kl_budget=None, update_ratio=1e-3)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.polar_floor == POLAR_FLOOR_16BIT

    double = patch_model(TwoLinear().double(), target_modules=["up", "down"])
    double_opt = LoGRAOptimizer(double, rank=4, update_ratio=1e-3)
    (double(torch.randn(3, 12, dtype=torch.float64)) * torch.randn(3, 7, dtype=torch.float64)).sum().backward()
    assert not any(t.state.sketched_in_16_bit for t in double_opt.targets)
    double_opt.step()
    assert double_opt.polar_floor == POLAR_FLOOR


def test_a_skipped_16bit_update_leaves_the_floor_as_it_was():
    """A non-finite sketch skips the update with every piece of state as it was: the 16-bit floor
    too, which only noise that reached the first moment calls for."""
    model, opt = two_linear(rank=6, kl_budget=None, update_ratio=1e-3)
    with pytest.warns(RuntimeWarning, match="non-finite"), torch.autocast("cpu", dtype=torch.bfloat16):
        (model(torch.randn(2, 12)) * float("nan")).sum().backward()
        opt.step()
    assert opt.nonfinite_skips == 1 and opt.polar_floor == POLAR_FLOOR
    assert opt.state_dict()["logra"]["polar_floor"] == POLAR_FLOOR
    # A probe that skips the update (here: its logits are NaN) leaves the floor too.
    model = patch_model(tiny_qwen2()).train()
    nan_logits = lambda model, contexts: probe.default_logits_fn(model, contexts) * float("nan")  # noqa: E731
    opt = LoGRAOptimizer(model, rank=4, kl_budget=1e-3, probe="finite_difference", probe_logits_fn=nan_logits)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**fixed_batch()).loss.backward()
    with pytest.warns(RuntimeWarning, match="predicted KL q=nan"):
        opt.step()
    assert opt.probe_skips == 1 and opt.update_index == 0 and opt.polar_floor == POLAR_FLOOR


def test_a_rowadam_checkpoint_resumes_with_rowadam_under_the_orthogonal_default():
    """The direction is part of the param group: a checkpoint saved with ``direction="rowadam"``
    (the former default) continues as RowAdam in an optimizer built with today's default, bit for
    bit as the uninterrupted run."""
    generator = torch.Generator().manual_seed(3)
    batches = [(torch.randn(5, 12, generator=generator), torch.randn(5, 7, generator=generator)) for _ in range(3)]

    def update(model, opt, batch):
        (model(batch[0]) * batch[1]).sum().backward()
        opt.step()
        opt.zero_grad()

    model, opt = two_linear(rank=3, direction="rowadam", update_ratio=1e-2)
    update(model, opt, batches[0])
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    for batch in batches[1:]:
        update(model, opt, batch)

    resumed_model, resumed = two_linear(rank=3, update_ratio=1e-2)
    with torch.no_grad():
        for name, parameter in resumed_model.named_parameters():
            parameter.copy_(weights[name])
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.param_groups[0]["direction"] == "rowadam"
    for batch in batches[1:]:
        update(resumed_model, resumed, batch)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))
    assert_same_state(resumed.state_dict(), opt.state_dict())


def test_a_rowadam_checkpoint_through_a_template_loader_is_refused_not_reset(tmp_path):
    """``torch.distributed.checkpoint`` loads into the state_dict of the optimizer it resumes, whose
    template (the default direction) has no row moments: the RowAdam moments would be dropped and
    restart from zero, so loading is refused, naming the fix; built with RowAdam, it resumes."""
    import torch.distributed.checkpoint as dcp

    model, opt = two_linear(rank=3, direction="rowadam", update_ratio=1e-2)
    backward_random(model, torch.Generator().manual_seed(0))
    opt.step()
    dcp.save({"optim": opt}, checkpoint_id=str(tmp_path))
    _, default = two_linear(rank=3, update_ratio=1e-2)
    with pytest.raises(ValueError, match="direction='rowadam' before loading"):
        dcp.load({"optim": default}, checkpoint_id=str(tmp_path))
    _, rowadam = two_linear(rank=3, direction="rowadam", update_ratio=1e-2)
    dcp.load({"optim": rowadam}, checkpoint_id=str(tmp_path))
    loaded, saved = rowadam.state_dict()["state"], opt.state_dict()["state"]
    assert loaded.keys() == saved.keys()
    for index, entry in saved.items():
        assert entry.keys() == loaded[index].keys() and "row_second_moment" in entry
        assert all(torch.equal(loaded[index][key], value) for key, value in entry.items()), index


def test_a_first_moment_checkpoint_through_a_template_loader_is_refused_not_reset(tmp_path):
    """The same for the first moment: a ``beta1=0.9`` checkpoint loaded into the template of a
    ``beta1=0`` optimizer would drop it, while the loaded group's ``beta1`` and step count assume it;
    refused, naming the fix. Built with the saved ``beta1``, it resumes."""
    import torch.distributed.checkpoint as dcp

    model, opt = two_linear(rank=3, beta1=0.9, update_ratio=1e-2)
    backward_random(model, torch.Generator().manual_seed(0))
    opt.step()
    dcp.save({"optim": opt}, checkpoint_id=str(tmp_path))
    _, without = two_linear(rank=3, beta1=0.0, update_ratio=1e-2)
    with pytest.raises(ValueError, match=r"'up' was trained with beta1=0.9 but its first_moment is missing"):
        dcp.load({"optim": without}, checkpoint_id=str(tmp_path))
    _, resumed = two_linear(rank=3, beta1=0.9, update_ratio=1e-2)
    dcp.load({"optim": resumed}, checkpoint_id=str(tmp_path))
    assert_same_state(resumed.state_dict()["state"], opt.state_dict()["state"])


def test_a_checkpoint_saved_with_the_old_group_key_loads():
    model = patch_model(OneLinear(8, 6, seed=2), target_modules=["proj"])
    opt = LoGRAOptimizer(model, rank=2, direction="sgd", update_ratio=1e-2)
    model(torch.randn(5, 8)).square().sum().backward()
    opt.step()
    state = opt.state_dict()
    group = state["param_groups"][0]
    state["param_groups"][0] = {("optimizer" if k == "direction" else k): v for k, v in group.items()}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    fresh_model = patch_model(OneLinear(8, 6, seed=2), target_modules=["proj"])
    fresh = LoGRAOptimizer(fresh_model, rank=2, update_ratio=1e-2)  # orthogonal by default
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert fresh.param_groups[0]["direction"] == "sgd" and "optimizer" not in fresh.param_groups[0]
    assert fresh.update_index == 1


def test_a_second_param_group_is_refused():
    model = patch_model(OneLinear(8, 6), target_modules=["proj"])
    opt = LoGRAOptimizer(model, rank=2)
    with pytest.raises(ValueError, match="one param group.*non_target_optimizer"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})


def test_a_checkpoint_of_other_targets_is_refused_naming_them():
    """Per-target state loads by position: k_proj's moments must not steer v_proj (grouped-query
    attention gives both one shape). Names are compared exactly: they seed the projections too."""

    def optimizer(targets):
        model = patch_model(tiny_qwen2(), target_modules=targets)
        return model, LoGRAOptimizer(model, rank=4, update_ratio=1e-3)

    model, saved_opt = optimizer(["q_proj", "k_proj"])
    model.train()
    model(**fixed_batch(seed=0)).loss.backward()
    saved_opt.step()
    saved = saved_opt.state_dict()
    assert saved["logra"]["targets"][:2] == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]
    _, other = optimizer(["q_proj", "v_proj"])
    with pytest.raises(
        ValueError, match=r"target 1 is 'model.layers.0.self_attn.k_proj'.*'model.layers.0.self_attn.v_proj'"
    ):
        other.load_state_dict(saved)
    assert other.update_index == 0 and not other.state  # refused before anything was loaded
    prefixed = copy.deepcopy(saved)
    prefixed["logra"]["targets"] = ["base_model.model." + name for name in saved["logra"]["targets"]]
    with pytest.raises(ValueError, match="target 0 is 'base_model.model.model.layers.0.self_attn.q_proj'"):
        optimizer(["q_proj", "k_proj"])[1].load_state_dict(prefixed)
    _, same = optimizer(["q_proj", "k_proj"])
    same.load_state_dict(saved)
    assert same.update_index == 1
    legacy = copy.deepcopy(saved)
    del legacy["logra"]["targets"]  # a checkpoint from before the names were saved: nothing to compare
    _, old = optimizer(["q_proj", "k_proj"])
    old.load_state_dict(legacy)
    assert old.update_index == 1
