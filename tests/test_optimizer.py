"""``LoGRAOptimizer``: the merge against a dense float64 reference recomputed from the sketches,
projection refresh, the torch.optim API (state_dict, schedulers, zero_grad, accumulation), the
non-target optimizer, bad inputs and non-finite sketches."""

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

from logra_optim import LoGRAOptimizer, make_projection, patch_model, patched_modules, projection_seed
from tiny import OneLinear, TwoLinear, fixed_batch, sketches, sum_token_loss, tiny_qwen2

U32 = 2.0**-24
U16 = 2.0**-8


def targets(model):
    return patched_modules(model)


def backward_random(model, generator, k=12, d=7, rows=3):
    """One microbatch through a TwoLinear-shaped model with loss ⟨y, g⟩ for random g."""
    x = torch.randn(rows, k, generator=generator)
    g = torch.randn(rows, d, generator=generator)
    (model(x) * g).sum().backward()


def snapshot(model):
    """(W, S, A) per target, as float64 copies, taken right before a step."""
    return [
        (m.weight.detach().double().clone(), m._logra.sketch.double().clone(), m._logra.projection.double().clone())
        for _, m in targets(model)
    ]


def rowadam_reference_step(s, v, t, beta2=0.95, eps=1e-8):
    """METHOD.md §2 in float64; returns (U, v_new)."""
    v = beta2 * v + (1 - beta2) * (s**2).mean(dim=1)
    rho = torch.sqrt(v / (1 - beta2**t))
    den = rho + eps * rho.mean()
    u = s / den[:, None]
    return u * (torch.linalg.norm(s) / torch.linalg.norm(u)), v


def two_linear(model_seed=0, **kwargs):
    model = patch_model(TwoLinear(seed=model_seed), target_modules=["up", "down"])
    return model, LoGRAOptimizer(model, **kwargs)


# --------------------------------------------------------------------------------------------------
# The merge against a dense reference


@given(
    optimizer=st.sampled_from(["sgd", "rowadam"]),
    mode=st.sampled_from(["lr", "update_ratio"]),
    wire=st.sampled_from([None, torch.bfloat16]),
    refresh=st.booleans(),
    kind=st.sampled_from(["rademacher", "gaussian"]),
    rank=st.integers(1, 7),
    steps=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=60)
def test_merge_matches_dense_reference(optimizer, mode, wire, refresh, kind, rank, steps, seed):
    size = {"lr": 0.05, "update_ratio": 1e-2}[mode]
    model, opt = two_linear(
        model_seed=seed % 100,
        rank=rank,
        optimizer=optimizer,
        projection=kind,
        refresh=refresh,
        wire_dtype=wire,
        seed=seed,
        **{mode: size},
    )
    names = [n for n, _ in targets(model)]
    generator = torch.Generator().manual_seed(seed)
    moments = [torch.zeros(m.weight.shape[0], dtype=torch.float64) for _, m in targets(model)]
    for step in range(1, steps + 1):
        backward_random(model, generator)
        before = snapshot(model)
        for (name, _), (_, _, a) in zip(targets(model), before):
            index = step - 1 if refresh else 0
            assert torch.equal(a.float(), make_projection(projection_seed(seed, index, name), rank, a.shape[1], kind))
        opt.step()

        directions = []
        for i, (_, s, _) in enumerate(before):
            if optimizer == "sgd":
                directions.append(s)
            else:
                u, moments[i] = rowadam_reference_step(s, moments[i], step)
                directions.append(u)
        if mode == "lr":
            eta = size
        else:
            w_sq = sum(float(w.square().sum()) for w, _, _ in before)
            u_sq = sum(float((u @ a).square().sum()) for u, (_, _, a) in zip(directions, before))
            eta = size * math.sqrt(w_sq / u_sq)
        for (name, module), (w, _, a), u in zip(targets(model), before, directions):
            factor = eta * u
            relative_factor_error = 1e-5
            if wire is not None:
                factor = factor.float().to(wire).double()
                relative_factor_error += 2 * U16  # the fp32 factor may round to the neighbouring bf16 value
            expected = w - factor @ a
            bound = (a.shape[0] + 2) * U32 * (w.abs() + factor.abs() @ a.abs()) + relative_factor_error * (
                factor.abs() @ a.abs()
            )
            assert ((module.weight.double() - expected).abs() <= bound).all(), name
            if optimizer == "rowadam":
                state = opt.state[module.weight]
                torch.testing.assert_close(
                    state["row_second_moment"].double(), moments[names.index(name)], rtol=1e-5, atol=0
                )
            assert int(opt.state[module.weight]["step"]) == step
            assert not module._logra.sketch.any()  # cleared: it was expressed in the old basis
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
    model, opt = two_linear(rank=4, lr=0.05, optimizer="sgd", wire_dtype=wire)
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
@pytest.mark.parametrize("optimizer", ["sgd", "rowadam"])
def test_update_ratio_sets_the_relative_update_norm(wire, optimizer):
    ratio = 1e-3
    model = patch_model(tiny_qwen2())
    opt = LoGRAOptimizer(model, rank=8, optimizer=optimizer, update_ratio=ratio, wire_dtype=wire)
    model.train()
    for step in range(2):
        model(**fixed_batch(seed=step)).loss.backward()
        before = [m.weight.detach().double().clone() for _, m in targets(model)]
        opt.step()
        delta_sq = sum(float((m.weight.double() - w).square().sum()) for (_, m), w in zip(targets(model), before))
        weight_sq = sum(float(w.square().sum()) for w in before)
        # fp32 storage of W (~6e-8 relative to W) seen through a 1e-3 update: ~1e-4; bf16 factor: 2⁻⁸.
        assert math.isclose(math.sqrt(delta_sq / weight_sq), ratio, rel_tol=U16 if wire else 1e-3)


def test_rowadam_row_moment_survives_projection_refresh():
    """The moment is indexed by output rows, so a new A (a new sketch basis) must neither reset nor
    otherwise alter it: across refreshes it follows v ← β2 v + (1−β2) mean_j S_ij² exactly."""
    model, opt = two_linear(rank=5, optimizer="rowadam", update_ratio=1e-3, refresh=True)
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
            moments[i] = 0.95 * moments[i] + 0.05 * s.square().mean(dim=1)
            moment = opt.state[module.weight]["row_second_moment"]
            assert moment.shape == (module.weight.shape[0],) and moment.dtype == torch.float32
            torch.testing.assert_close(moment.double(), moments[i], rtol=1e-5, atol=0)


def test_projection_refresh_and_fixed_basis(tiny, batch):
    patch_model(tiny)
    opt = LoGRAOptimizer(tiny, rank=4, lr=1e-3, seed=9)
    fixed_model = patch_model(tiny_qwen2())
    fixed = LoGRAOptimizer(fixed_model, rank=4, lr=1e-3, seed=9, refresh=False)
    for model in (tiny, fixed_model):
        model.train()
    for update in range(3):
        for model, optimizer, index in ((tiny, opt, update), (fixed_model, fixed, 0)):
            assert optimizer.projection_index == index
            for name, module in targets(model):
                seed = projection_seed(9, index, name)
                assert torch.equal(module._logra.projection, make_projection(seed, 4, module.in_features))
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
        assert torch.equal(a._logra.projection, b._logra.projection)


# --------------------------------------------------------------------------------------------------
# torch.optim API


def assert_same_state(a, b, path="state_dict"):
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            assert_same_state(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), path
    else:
        assert a == b, path


def test_state_dict_round_trips_through_weights_only_load(tiny, batch):
    patch_model(tiny)
    opt = LoGRAOptimizer(tiny, rank=4, update_ratio=1e-3)
    tiny.train()
    for _ in range(2):
        tiny(**batch).loss.backward()
        opt.step()
    state = opt.state_dict()
    assert state["logra"]["update_index"] == 2
    # A is regenerated, never stored: per target only a step count and a d-vector of row moments.
    for index, (_, module) in enumerate(targets(tiny)):
        entry = state["state"][index]
        assert set(entry) == {"step", "row_second_moment"}
        assert entry["step"].numel() == 1
        assert entry["row_second_moment"].shape == (module.out_features,)
        assert entry["row_second_moment"].dtype == torch.float32
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert_same_state(loaded, state)

    other = patch_model(tiny_qwen2())
    resumed = LoGRAOptimizer(other, rank=4, update_ratio=1e-3)
    resumed.load_state_dict(loaded)
    assert_same_state(resumed.state_dict(), state)
    assert resumed.update_index == 2 and resumed.projection_index == 2
    assert all(
        torch.equal(a._logra.projection, b._logra.projection) for (_, a), (_, b) in zip(targets(tiny), targets(other))
    )


@pytest.mark.parametrize(
    "optimizer, dtype",
    [("rowadam", torch.float32), ("sgd", torch.float32), ("rowadam", torch.bfloat16)],
)
def test_resume_continues_bit_identically(tmp_path, optimizer, dtype):
    kwargs = dict(rank=4, optimizer=optimizer, update_ratio=1e-3)

    def steps(model, opt, first, count):
        model.train()
        for step in range(first, first + count):
            model(**fixed_batch(seed=step)).loss.backward()
            opt.step()
            opt.zero_grad()

    model = patch_model(tiny_qwen2(dtype=dtype))
    opt = LoGRAOptimizer(model, **kwargs)
    steps(model, opt, 0, 3)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    torch.save(opt.state_dict(), tmp_path / "optim.pt")
    steps(model, opt, 3, 3)

    # A fresh process would start from a differently initialised model and a new optimizer.
    resumed = tiny_qwen2(seed=123, dtype=dtype)
    resumed.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    patch_model(resumed)
    resumed_opt = LoGRAOptimizer(resumed, **kwargs)
    resumed_opt.load_state_dict(torch.load(tmp_path / "optim.pt", weights_only=True))
    steps(resumed, resumed_opt, 3, 3)
    for (name, a), (_, b) in zip(model.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), name

    # Without the optimizer state (A, moments, step count) the continuation differs: the check
    # above is not vacuous.
    restarted = tiny_qwen2(seed=123, dtype=dtype)
    restarted.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    patch_model(restarted)
    steps(restarted, LoGRAOptimizer(restarted, **kwargs), 3, 3)
    assert not torch.equal(restarted.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)


def test_load_state_dict_rejects_foreign_state(tiny):
    patch_model(tiny)
    opt = LoGRAOptimizer(tiny, rank=4, lr=1e-3)
    state = opt.state_dict()
    with pytest.raises(ValueError, match="'logra' section is missing"):
        opt.load_state_dict({k: v for k, v in state.items() if k != "logra"})
    other = patch_model(tiny_qwen2())
    with pytest.raises(ValueError, match="saved with rank=4.*rank=8"):
        LoGRAOptimizer(other, rank=8, lr=1e-3).load_state_dict(state)


@pytest.mark.parametrize("mode", ["update_ratio", "lr"])
def test_lr_scheduler_drives_the_step(mode):
    """torch schedulers write param_groups[i]["lr"]; in update_ratio mode that is ρ_upd (so
    ‖ΔW‖/‖W‖ follows the schedule), in lr mode the plain learning rate."""
    factors = [1.0, 0.5, 0.125, 2.0]
    base = 1e-2
    model, opt = two_linear(rank=4, optimizer="sgd", wire_dtype=None, **{mode: base})
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: factors[epoch])
    generator = torch.Generator().manual_seed(0)
    for factor in factors[:3]:
        assert opt.param_groups[0]["lr"] == pytest.approx(base * factor, rel=1e-12)
        backward_random(model, generator)
        before = snapshot(model)
        opt.step()
        scheduler.step()
        if mode == "update_ratio":
            delta_sq = sum(
                float((m.weight.double() - w).square().sum()) for (_, m), (w, _, _) in zip(targets(model), before)
            )
            weight_sq = sum(float(w.square().sum()) for w, _, _ in before)
            assert math.isclose(math.sqrt(delta_sq / weight_sq), base * factor, rel_tol=1e-4)
        else:
            for (_, m), (w, s, a) in zip(targets(model), before):
                torch.testing.assert_close(m.weight.double(), w - base * factor * s @ a, rtol=0, atol=1e-6)


def test_param_groups_hold_exactly_the_target_weights(tiny):
    patch_model(tiny)
    opt = LoGRAOptimizer(tiny, rank=4)
    assert len(opt.param_groups) == 1
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(m.weight) for _, m in targets(tiny)]
    assert opt.param_groups[0]["lr"] == 6e-5 and opt.param_groups[0]["lr_mode"] == "update_ratio"


def test_zero_grad_clears_the_sketches(tiny, batch):
    patch_model(tiny)
    opt = LoGRAOptimizer(tiny, rank=4, lr=1e-3)
    tiny.train()
    tiny(**batch).loss.backward()
    once = sketches(tiny)
    tiny(**batch).loss.backward()  # no zero_grad: accumulates
    for name, s in sketches(tiny).items():
        # addmm_ into a non-zero sketch rounds differently from 2·S: fp32-level agreement.
        torch.testing.assert_close(s, 2 * once[name], rtol=1e-5, atol=1e-6 * once[name].abs().max().item())
    opt.zero_grad()
    assert all(not s.any() for s in sketches(tiny).values())
    tiny(**batch).loss.backward()
    assert all(torch.equal(s, once[name]) for name, s in sketches(tiny).items())
    opt.zero_grad(set_to_none=False)
    assert all(not s.any() for s in sketches(tiny).values())


def test_gradient_accumulation_equals_one_concatenated_batch():
    batch = fixed_batch(batch=6)
    halves = [{k: v[:3] for k, v in batch.items()}, {k: v[3:] for k, v in batch.items()}]
    results = []
    for microbatches in ([batch], halves):
        model = patch_model(tiny_qwen2())
        opt = LoGRAOptimizer(model, rank=4, optimizer="rowadam", update_ratio=1e-3, wire_dtype=None)
        model.train()
        for microbatch in microbatches:
            sum_token_loss(model, microbatch).backward()
        results.append((sketches(model), model, opt))
    (single, model_a, opt_a), (accumulated, model_b, opt_b) = results
    for name in single:
        torch.testing.assert_close(
            accumulated[name], single[name], rtol=1e-5, atol=1e-5 * single[name].abs().max().item()
        )
    opt_a.step()
    opt_b.step()
    for (name, a), (_, b) in zip(targets(model_a), targets(model_b)):
        torch.testing.assert_close(a.weight, b.weight, rtol=1e-5, atol=1e-7, msg=name)


def test_step_with_closure(tiny, batch):
    patch_model(tiny)
    opt = LoGRAOptimizer(tiny, rank=4, lr=1e-2)
    tiny.train()
    before = tiny.model.layers[0].mlp.up_proj.weight.clone()

    def closure():
        loss = tiny(**batch).loss
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.item() > 0
    assert not torch.equal(tiny.model.layers[0].mlp.up_proj.weight, before)


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


# --------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(rank=0), ValueError, "rank must be a positive integer, got 0"),
        (dict(rank=-3), ValueError, "rank must be a positive integer, got -3"),
        (dict(rank=2.0), ValueError, "rank must be a positive integer"),
        (dict(rank=True), ValueError, "rank must be a positive integer"),
        (dict(optimizer="adam"), ValueError, r"optimizer must be one of .*'adam'"),
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
        (dict(eps=0), ValueError, "eps must be a positive"),
        (dict(wire_dtype=torch.int8), ValueError, "wire_dtype must be a floating"),
    ],
)
def test_bad_arguments_are_rejected_with_their_name(tiny, kwargs, error, match):
    patch_model(tiny)
    kwargs = {"rank": 4, **kwargs}
    with pytest.raises(error, match=match):
        LoGRAOptimizer(tiny, **kwargs)
    # A failed construction binds nothing: a valid optimizer can still be created.
    LoGRAOptimizer(tiny, rank=4)


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


def test_fp16_target_weights_warn():
    model = patch_model(OneLinear(8, 8).half(), target_modules=["proj"])
    with pytest.warns(UserWarning, match=r"'proj' is stored in float16"):
        LoGRAOptimizer(model, rank=2)


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
        return model, LoGRAOptimizer(model, rank=4, optimizer="rowadam", update_ratio=1e-3)

    def good_step(model, opt, seed):
        model(**fixed_batch(seed=seed)).loss.backward()
        opt.step()

    model, opt = build()
    good_step(model, opt, 0)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = copy.deepcopy(opt.state_dict())
    projections = [m._logra.projection.clone() for _, m in targets(model)]

    if poison == "inf_loss":
        (model(**fixed_batch(seed=1)).loss * float("inf")).backward()
    else:
        handle = poison_nan(model)
        model(**fixed_batch(seed=1)).loss.backward()
        handle.remove()
    assert not all(torch.isfinite(s).all() for s in sketches(model).values())
    with pytest.warns(RuntimeWarning, match="non-finite sketch .* at update 2"):
        opt.step()

    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert_same_state(opt.state_dict()["state"], state["state"])
    assert opt.update_index == 1
    assert opt.stats["nonfinite_skips"] == 1 and opt.stats["skipped"]
    assert all(torch.equal(m._logra.projection, a) for (_, m), a in zip(targets(model), projections))
    assert all(torch.isfinite(s).all() and not s.any() for s in sketches(model).values())
    assert opt.state_dict()["logra"]["nonfinite_skips"] == 1

    # The skip leaves no trace: training continues exactly as if the bad batch never happened.
    good_step(model, opt, 2)
    reference, reference_opt = build()
    good_step(reference, reference_opt, 0)
    good_step(reference, reference_opt, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


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


def test_zero_sketch_with_sgd_leaves_weights_unchanged(tiny, batch):
    patch_model(tiny)
    opt = LoGRAOptimizer(tiny, rank=4, optimizer="sgd", update_ratio=1e-3)
    weights = [p.detach().clone() for p in tiny.parameters()]
    tiny.train()
    (tiny(**batch).loss * 0.0).backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(tiny.parameters(), weights))
    assert opt.stats["eta"] == 0.0


def test_zero_sketch_with_rowadam_leaves_weights_finite_and_unchanged(tiny, batch):
    patch_model(tiny)
    opt = LoGRAOptimizer(tiny, rank=4, optimizer="rowadam", update_ratio=1e-3)
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
        model, rank=8, optimizer="sgd", lr=1.0, wire_dtype=None, stochastic_rounding=stochastic_rounding
    )
    generator = torch.Generator().manual_seed(0)
    model(torch.randn(16, k, generator=generator).bfloat16()).backward(
        torch.randn(16, d, generator=generator).bfloat16()
    )
    weight = model.proj.weight
    w0, s, a = (
        weight.detach().double().clone(),
        model.proj._logra.sketch.double(),
        model.proj._logra.projection.double(),
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
    low = (x.view(torch.int32) & -65536).view(torch.float32).double()
    high = ((x.view(torch.int32) & -65536) + 65536).view(torch.float32).double()
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
    opt = LoGRAOptimizer(model, rank=2, optimizer="rowadam", update_ratio=1e-2)
    model(torch.randn(4, 6)).square().sum().backward()
    assert not model.unused._logra.sketch.any() and model.used._logra.sketch.any()
    unused_before = model.unused.weight.detach().clone()
    opt.step()
    assert torch.isfinite(model.used.weight).all()
    assert torch.equal(model.unused.weight, unused_before)
