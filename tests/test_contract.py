"""The torch.optim contract of ``LoGRAOptimizer``, for each of its variants: direction (RowAdam,
SGD) × projection (refreshed after every update, fixed) × step size (``lr``, ``update_ratio``).

Every variant must: continue bit-identically from a state_dict saved with torch.save and loaded with
``weights_only=True`` into a fresh optimizer; let a torch LR scheduler drive its step size; clear its
sketches in ``zero_grad``; and accumulate microbatches into the sketch of the concatenated batch.
Then the variant-free rest of the API: resuming in a fresh process (bf16 storage too), foreign
state, param groups, closures. KL control is off (``kl_budget=None``): test_control.py covers it.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

from logra_optim import LoGRAOptimizer, patch_model
from tests.helpers import reference
from tests.helpers.optim import assert_same_state, snapshot
from tests.helpers.reference import U32
from tests.helpers.tiny import fixed_batch, sketches, sum_token_loss, tiny_qwen2

RANK = 4
SIZES = {"lr": 1e-2, "update_ratio": 1e-3}
# The paper's rule (a new A every update, no first moment) in every combination, then the first
# moment and slower refresh (every 2 updates here, so that two steps cross a redraw) with RowAdam and
# with the default orthogonal directions (given by omission: the default is what runs).
VARIANTS = [
    pytest.param(
        dict(direction=direction, refresh=refresh, refresh_every=1, beta1=0.0, **{mode: SIZES[mode]}),
        id=f"{direction}-{'refresh' if refresh else 'fixed'}-{mode}",
    )
    for direction in ("rowadam", "sgd")
    for refresh in (True, False)
    for mode in ("lr", "update_ratio")
] + [
    pytest.param(
        dict(direction="rowadam", refresh=True, refresh_every=2, beta1=0.9, update_ratio=SIZES["update_ratio"]),
        id="rowadam-momentum-every2-update_ratio",
    ),
    pytest.param(
        dict(refresh=True, refresh_every=2, beta1=0.9, update_ratio=SIZES["update_ratio"]),
        id="orthogonal-default-momentum-every2-update_ratio",
    ),
]


def build(variant: dict, model=None, **overrides):
    """A patched tiny Qwen2 (or ``model``) and its optimizer of ``variant``."""
    model = patch_model(tiny_qwen2()) if model is None else model
    return model, LoGRAOptimizer(model, rank=RANK, **{**variant, **overrides})


def train(model, opt, seeds) -> None:
    """One full step (backward, step, zero_grad) per seed, each on its own fixed batch."""
    model.train()
    for seed in seeds:
        model(**fixed_batch(seed=seed)).loss.backward()
        opt.step()
        opt.zero_grad()


def weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same_weights(first, second) -> None:
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------------------------------
# Every variant


@pytest.mark.parametrize("variant", VARIANTS)
def test_state_dict_round_trip_continues_bit_identically(variant):
    model, opt = build(variant)
    train(model, opt, [0, 1])
    state = opt.state_dict()
    assert state["logra"]["update_index"] == 2
    # A is regenerated, never stored: per target a step count and, for RowAdam, one fp32 moment
    # per output row.
    moments = {"step", "row_second_moment"} if variant.get("direction", "orthogonal") == "rowadam" else {"step"}
    if variant.get("beta1"):  # and a d×r fp32 first moment, like the sketch
        moments.add("first_moment")
    for index, target in enumerate(opt.targets):
        entry = state["state"][index]
        assert set(entry) == moments and entry["step"].numel() == 1
        if "row_second_moment" in entry:
            assert entry["row_second_moment"].shape == (target.shape[0],)
            assert entry["row_second_moment"].dtype == torch.float32
        if "first_moment" in entry:
            assert entry["first_moment"].shape == (target.shape[0], RANK)
            assert entry["first_moment"].dtype == torch.float32
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert_same_state(loaded, state)

    twin = copy.deepcopy(model)  # a copy of a bound model is unbound (test_patching.py)
    _, resumed = build(variant, twin)
    resumed.load_state_dict(loaded)
    assert_same_state(resumed.state_dict(), state)
    expected_index = 2 // variant.get("refresh_every", 1) if variant["refresh"] else 0
    assert resumed.update_index == 2 and resumed.projection_index == expected_index
    for a, b in zip(opt.targets, resumed.targets):
        assert a.state.shared_projection.spec == b.state.shared_projection.spec, a.name
        assert torch.equal(a.state.generate_projection(), b.state.generate_projection()), a.name

    unloaded = copy.deepcopy(model)
    train(model, opt, [2, 3])
    train(twin, resumed, [2, 3])
    assert_same_weights(model, twin)
    assert_same_state(resumed.state_dict(), opt.state_dict())
    if variant.get("direction", "orthogonal") == "rowadam" or variant["refresh"]:
        # Where the state matters (moments, the update index that draws A), a fresh optimizer that
        # did not load it continues differently: the check above is not vacuous.
        train(unloaded, build(variant, unloaded)[1], [2, 3])
        assert not torch.equal(unloaded.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)


@pytest.mark.parametrize("variant", VARIANTS)
def test_lr_scheduler_drives_the_step(variant):
    """torch schedulers write ``param_groups[i]["lr"]``: in lr mode the step size η itself, in
    update_ratio mode ρ_upd (so that ‖ΔW‖/‖W‖ follows the schedule). Each step is checked against
    ``W − η U A`` with U and η from the float64 references."""
    factors = [1.0, 0.5, 0.125]
    model, opt = build(variant, wire_dtype=None)
    mode = "lr" if "lr" in variant else "update_ratio"
    base = variant[mode]
    assert opt.param_groups[0]["lr"] == base
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: factors[min(epoch, len(factors) - 1)])
    moments = [torch.zeros(t.shape[0], dtype=torch.float64) for t in opt.targets]
    first_moments = [torch.zeros(t.shape[0], RANK, dtype=torch.float64) for t in opt.targets]
    beta1, previous = variant.get("beta1", 0.0), None
    model.train()
    for step, factor in enumerate(factors, start=1):
        assert opt.param_groups[0]["lr"] == pytest.approx(base * factor, rel=1e-12)
        model(**fixed_batch(seed=step)).loss.backward()
        before = snapshot(model)
        opt.step()
        scheduler.step()

        directions = []
        for i, (_, s, a) in enumerate(before):
            numerator = None
            if beta1:
                if previous is not None and not torch.equal(previous[i][2], a):
                    first_moments[i] = reference.carried(first_moments[i], previous[i][2], a)
                numerator, first_moments[i] = reference.momentum_step(s, first_moments[i], step, beta1)
            u, moments[i] = reference.direction(
                variant.get("direction", "orthogonal"), s, moments[i], step, numerator=numerator
            )
            directions.append(u)
        previous = before
        if mode == "lr":
            etas = [base * factor] * len(before)
        else:
            weights, projections = [w for w, _, _ in before], [a for _, _, a in before]
            etas = reference.step_sizes(base * factor, weights, directions, projections)
            after = [t.weight for t in opt.targets]
            assert reference.relative_update_norm([w for w, _, _ in before], after) == pytest.approx(
                base * factor, rel=1e-4
            )
        for target, (w, _, a), u, eta in zip(opt.targets, before, directions, etas):
            update = (eta * u).abs() @ a.abs()
            # fp32 merge (r + 2 roundings) and an fp32 U and η (RowAdam, Gram norms) within 1e-5.
            bound = (RANK + 2) * U32 * (w.abs() + update) + 1e-5 * update
            assert ((target.weight.double() - reference.merged(w, eta * u, a)).abs() <= bound).all(), target.name


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero_grad_clears_the_sketches(variant):
    model, opt = build(variant)
    batch = fixed_batch()
    model.train()
    model(**batch).loss.backward()
    once = sketches(model)
    model(**batch).loss.backward()  # no zero_grad: accumulates
    for name, s in sketches(model).items():
        # addmm_ into a non-zero sketch rounds differently from 2·S: fp32-level agreement.
        torch.testing.assert_close(s, 2 * once[name], rtol=1e-5, atol=1e-6 * once[name].abs().max().item())
    opt.zero_grad()
    assert all(not s.any() for s in sketches(model).values())
    model(**batch).loss.backward()
    assert all(torch.equal(s, once[name]) for name, s in sketches(model).items())
    opt.zero_grad(set_to_none=False)
    assert all(not s.any() for s in sketches(model).values())

    # A step right after zero_grad has an empty sketch to apply: silently, the weights do not move.
    before = weights(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the optimizer warns of skips and eval mode so
        opt.step()
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert all(torch.isfinite(value).all() for state in opt.state.values() for value in state.values())


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_weight_no_gradient_reaches_does_not_move(variant):
    """After some updates, with or without a first moment: a step with every sketch empty (no
    backward, or a batch of equal rewards) moves no weight, and a backward that reaches only the
    first layer moves only its targets. With a first moment, η would otherwise scale its decaying
    momentum back to a full step at every update, for as long as the weight stays idle."""
    model, opt = build(variant)
    train(model, opt, seeds=[0, 1, 2])
    before = weights(model)
    opt.step()
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert opt.update_index == 4  # an update, in which nothing moved: its first moments decayed

    # hidden_states[1] is the first decoder layer's output: the second layer ran a forward, no backward.
    model(**fixed_batch(seed=3), output_hidden_states=True).hidden_states[1].square().mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # it names the unreached targets
        opt.step()
    moved = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert moved and all(name.startswith("model.layers.0.") for name in moved), moved
    assert len(moved) == 7  # every target of the first layer


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradient_accumulation_equals_one_concatenated_batch(variant):
    """Two backward passes on the halves of a batch, then a step, equal one backward on the whole
    batch (a token-summed loss, so that the halves add up): same sketches, same weights, over two
    steps (the second in a refreshed basis where the variant refreshes)."""
    batch = fixed_batch(batch=6)
    halves = [{k: v[:3] for k, v in batch.items()}, {k: v[3:] for k, v in batch.items()}]
    runs = []
    for microbatches in ([batch], halves):
        model, opt = build(variant, wire_dtype=None)
        model.train()
        seen = [(None, weights(model))]
        for _ in range(2):
            for microbatch in microbatches:
                sum_token_loss(model, microbatch).backward()
            sketched = sketches(model)
            opt.step()
            opt.zero_grad()
            seen.append((sketched, weights(model)))
        runs.append(seen)
    single_run, accumulated_run = runs
    for step in (1, 2):
        (single, single_weights), (accumulated, accumulated_weights) = single_run[step], accumulated_run[step]
        for name in single:
            atol = 1e-5 * single[name].abs().max().item()
            torch.testing.assert_close(accumulated[name], single[name], rtol=1e-5, atol=atol, msg=name)
        for name in single_weights:
            # The sketches agree to fp32 summation order (1e-5 of their largest entry, which depends
            # on the CPU's product kernels); so do the updates built from them, on top of the
            # weights' own rounding (1e-7: about ten ulps of these weights).
            change = (single_weights[name] - single_run[step - 1][1][name]).abs().max().item()
            atol = 1e-5 * change + 1e-7
            torch.testing.assert_close(accumulated_weights[name], single_weights[name], rtol=1e-5, atol=atol, msg=name)


# --------------------------------------------------------------------------------------------------
# The rest of the API


@pytest.mark.parametrize(
    "direction, dtype, momentum",
    [
        ("rowadam", torch.float32, {}),
        ("sgd", torch.float32, {}),
        ("rowadam", torch.bfloat16, {}),
        ("rowadam", torch.bfloat16, dict(beta1=0.9, refresh_every=2)),  # torch would cast M to bf16
        ("orthogonal", torch.bfloat16, dict(beta1=0.9, refresh_every=2)),
    ],
)
def test_resume_continues_bit_identically(tmp_path, direction, dtype, momentum):
    kwargs = dict(rank=4, direction=direction, update_ratio=1e-3, **momentum)

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
    assert_same_weights(model, resumed)

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


def test_param_groups_hold_exactly_the_target_weights(tiny):
    patch_model(tiny)
    opt = LoGRAOptimizer(tiny, rank=4)
    assert len(opt.param_groups) == 1
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(t.weight) for t in opt.targets]
    assert opt.param_groups[0]["lr"] == 6e-5 and opt.param_groups[0]["lr_mode"] == "update_ratio"


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
