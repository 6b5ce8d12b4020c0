"""Mixed precision as GPU users run it: the KL probes under accelerate's bf16 autocast wrapper.

accelerate's ``prepare_model`` (``mixed_precision="bf16"``, TRL's default ``bf16=True``) replaces
``model.forward`` on the model object itself with an autocast wrapper. A realistic step
(``update_ratio`` 6e-5) changes the logits by less than half a bf16 ulp, so a probe that ran
through that wrapper would measure rounding noise. These tests use the real accelerate wrapper.
"""

from __future__ import annotations

import pytest
import torch

from logra_optim import LoGRAOptimizer, patch_model
from logra_optim.updates import gram, low_rank_sq_norm, relative_step_size
from tests.helpers.tiny import fixed_batch, tiny_qwen2

accelerate = pytest.importorskip("accelerate")


@pytest.fixture
def bf16_accelerator():
    from accelerate.state import AcceleratorState

    # Whatever a test before this one left (a Trainer initialises the state for its own precision).
    AcceleratorState._reset_state(reset_partial_state=True)
    yield accelerate.Accelerator(mixed_precision="bf16", cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


def _unit_step_factors(opt: LoGRAOptimizer, update_ratio: float) -> list[torch.Tensor]:
    """``F = η S`` with η giving ‖ΔW‖/‖W‖ = update_ratio over all targets (SGD directions)."""
    states = [t.state for t in opt.targets]
    weight_sq = sum(float(t.weight.double().square().sum()) for t in opt.targets)
    update_sq = sum(float(low_rank_sq_norm(s.sketch, gram(s.generate_projection()))) for s in states)
    eta = relative_step_size(update_ratio, weight_sq, update_sq)
    return [s.sketch * eta for s in states]


@pytest.mark.parametrize("probe", ["jvp", "finite_difference"])
def test_probe_ignores_accelerate_bf16_autocast_wrapper(bf16_accelerator, probe):
    model = patch_model(tiny_qwen2(seed=3))
    # With the realised-KL check the JVP probe also runs the model's own forward (full logits),
    # which is what accelerate wraps; without it, it would call the decoder directly.
    opt = LoGRAOptimizer(model, rank=4, kl_budget=1e-4, probe=probe, wire_dtype=None, realised_kl_check=True)
    model.train()
    model(**fixed_batch()).loss.backward()
    factors = _unit_step_factors(opt, 6e-5)
    states = [t.state for t in opt.targets]

    reference = opt.kl_control.choose(states, factors, 1).stats["predicted_kl"]
    prepared = bf16_accelerator.prepare_model(model)
    assert prepared is model and "_original_forward" in model.__dict__  # the wrapper sits on the model itself
    with torch.no_grad():  # the wrapper really computes in bf16
        logits = model(input_ids=fixed_batch()["input_ids"]).logits
        assert logits.dtype == torch.float32
    wrapped = opt.kl_control.choose(states, factors, 1).stats["predicted_kl"]

    assert reference > 0
    assert wrapped == pytest.approx(reference, rel=1e-6)
    assert "_original_forward" in model.__dict__  # the wrapper is back in place after the probe


def test_realised_kl_check_stays_on_budget_under_bf16_wrapper(bf16_accelerator):
    model = patch_model(tiny_qwen2(seed=4))
    budget = 1e-7
    opt = LoGRAOptimizer(
        model,
        rank=4,
        kl_budget=budget,
        update_ratio=6e-5,
        alpha_max=100.0,
        realised_kl_check=True,
        probe="finite_difference",
    )
    bf16_accelerator.prepare_model(model)
    for _ in range(3):
        model.train()
        model(**fixed_batch()).loss.backward()
        opt.step()
        opt.zero_grad()
        assert "skipped" not in opt.stats
        assert opt.stats["realised_kl"] == pytest.approx(budget, rel=0.25)


def test_fp16_grad_scaler_is_refused_with_the_weights_untouched():
    model = patch_model(tiny_qwen2(seed=6))
    opt = LoGRAOptimizer(model, rank=4, update_ratio=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.train()
    scaler.scale(model(**fixed_batch()).loss).backward()
    with pytest.raises(RuntimeError, match="does not support fp16 loss scaling"):
        scaler.step(opt)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert opt.update_index == 0
    opt.zero_grad()
    model(**fixed_batch()).loss.backward()
    opt.step()  # without a scaler the optimizer works as before
    assert opt.update_index == 1


def test_attach_logra_refuses_fp16(tmp_path):
    pytest.importorskip("trl")
    from logra_optim.integrations.trl import attach_logra
    from tests.helpers import trl_setup as setup

    trainer = setup.build_trainer("grpo", setup.build_policy(), tmp_path, fp16=True)
    with pytest.raises(ValueError, match="fp16 mixed precision is not supported.*bf16=True"):
        attach_logra(trainer, **setup.LOGRA_KWARGS)


@pytest.mark.parametrize("probe", ["jvp", "finite_difference"])
def test_grpo_with_bf16_autocast_keeps_each_update_on_budget(tmp_path, probe):
    """TRL's bf16=True on CPU: accelerate wraps the forward in bf16 autocast; a realistic step
    (update_ratio 6e-5) is then below half a bf16 ulp of the logits."""
    pytest.importorskip("trl")
    from logra_optim.integrations.trl import attach_logra
    from tests.helpers import trl_setup as setup

    budget = 1e-5
    trainer = setup.build_trainer("grpo", setup.build_policy(), tmp_path, bf16=True, max_steps=3)
    attach_logra(
        trainer,
        rank=16,
        kl_budget=budget,
        update_ratio=6e-5,
        alpha_max=1e4,
        probe=probe,
        realised_kl_check=True,
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "logra/predicted_step_kl" in entry]
    assert len(logs) == 3
    for entry in logs:
        assert entry["logra/predicted_step_kl"] == pytest.approx(budget, rel=0.05)
        assert entry["logra/realised_kl"] == pytest.approx(budget, rel=0.15)


def _engine_copies(opt: LoGRAOptimizer, dtype: torch.dtype) -> dict:
    """16-bit engine copies of the targets, updated from the factors the trainer sends, with the
    function the vLLM engine applies them with (and, for comparison, rounded to nearest)."""
    from logra_optim.projection import make_projection
    from logra_optim.sync import merge_like_trainer_
    from logra_optim.updates import merge_low_rank_, rounding_remainder

    start = {t.parameter_name: t.weight.detach().float().clone() for t in opt.targets}
    engine = {name: w.to(dtype, copy=True) for name, w in start.items()}
    copies = {
        "start": start,
        "engine": engine,
        "nearest": {name: w.to(dtype, copy=True) for name, w in start.items()},
        # What the full load rounded away, as the engine keeps it (EngineUpdater._load_weights).
        "compensation": {name: rounding_remainder(w, engine[name]) for name, w in start.items()},
    }

    def apply(optimizer, update):
        for target in update.targets:
            projection = make_projection(target.seed, optimizer.rank, target.in_features, optimizer.projection)
            merge_like_trainer_(copies["engine"][target.name], target, projection, copies["compensation"][target.name])
            merge_low_rank_(copies["nearest"][target.name], target.factor, projection, stochastic_rounding=False)

    opt.register_merge_hook(apply)
    return copies


def _train(model, opt, steps: int) -> None:
    model.train()
    for step in range(steps):
        model(**fixed_batch(seed=step)).loss.backward()
        opt.step()
        opt.zero_grad()
    assert opt.update_index == steps


def test_bf16_engine_copy_follows_200_real_updates_of_fp32_masters():
    """An fp32-master trainer: rounded to nearest, updates of ~6e-5 of a weight (< half an ulp)
    vanish on a bf16 engine; with the compensation buffer, started at what the full load rounded
    away, the copy stays within one bf16 rounding of the trainer's weights."""
    model = patch_model(tiny_qwen2(seed=7))
    opt = LoGRAOptimizer(model, rank=4, update_ratio=6e-5)
    copies = _engine_copies(opt, torch.bfloat16)
    _train(model, opt, 200)
    for target in opt.targets:
        name, master = target.parameter_name, target.weight.detach()
        start = copies["start"][name]
        change = master - start
        # The engine knows the trainer's weights (weight + compensation, up to the compensation's own
        # roundings), and the weight itself is within one final bf16 rounding of them (half the
        # spacing of 8 significant bits; a little more where the compensation's rounding adds).
        reference = master.float()

        def half_ulp_of(x):
            return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 8)

        # The compensation's own roundings scale with the values the weight passed through, not with
        # where it ended: a weight that crossed zero ends far below them. The larger of both ends
        # stands in for the path (200 updates of ~6e-5 of the weight barely overshoot either end).
        compensation_error = half_ulp_of(torch.maximum(reference.abs(), start.abs())) / 4
        engine = copies["engine"][name].float()
        kept = engine + copies["compensation"][name].float()  # what the engine knows
        assert bool(((kept - reference).abs() <= compensation_error).all()), name
        assert bool(((engine - reference).abs() <= half_ulp_of(reference) + compensation_error).all()), name
        moved = (copies["nearest"][name].float() - start.bfloat16().float()).norm() / change.norm()
        assert moved < 0.5, f"{name}: rounding to nearest kept {moved:.0%} of the change"


@pytest.mark.parametrize("engine_dtype", [torch.bfloat16, torch.float32], ids=["bf16-copy", "fp32-shadow"])
def test_engine_copy_of_a_bf16_trainer_is_bit_identical(engine_dtype):
    """A trainer whose targets are stored in bf16 rounds every merge stochastically; the engine
    draws the same noise (seeded from the payload) and stays bit-identical, where an engine that
    tracked the exact sum would drift from it: a bf16 copy, and an fp32 shadow copy too."""
    model = patch_model(tiny_qwen2(seed=8, dtype=torch.bfloat16))
    opt = LoGRAOptimizer(model, rank=4, update_ratio=6e-5)
    copies = _engine_copies(opt, engine_dtype)
    _train(model, opt, 50)
    for target in opt.targets:
        name = target.parameter_name
        assert torch.equal(copies["engine"][name], target.weight.detach().to(engine_dtype)), name
        assert not bool(copies["compensation"][name].any())  # no compensation: the trainer rounds itself
    assert any(not torch.equal(copies["start"][t.parameter_name].bfloat16(), t.weight) for t in opt.targets)


def test_siblings_sharing_a_projection_round_with_their_own_noise():
    """q/k/v (and gate/up) share ``A`` and so its seed; a bf16 trainer's stochastic rounding must not
    share their noise too: k and v have one shape here, and one seed would give them the same
    uniforms, correlating their rounding errors. Each target carries a seed of its own in the payload
    (the bit-identical engine above draws from those), and the trainer rounds with it: redoing a
    sibling's merge with another target's seed gives other weights."""
    from logra_optim.projection import make_projection
    from logra_optim.updates import merge_low_rank_

    model = patch_model(tiny_qwen2(seed=8, dtype=torch.bfloat16))
    opt = LoGRAOptimizer(model, rank=4, update_ratio=6e-5)
    layer = model.model.layers[0].self_attn
    assert layer.k_proj.weight.shape == layer.v_proj.weight.shape  # the case a shared seed got wrong
    updates, before = [], {}
    opt.register_merge_hook(lambda _, update: updates.append(update))
    for step in range(3):
        before = {t.parameter_name: t.weight.detach().clone() for t in opt.targets}
        model(**fixed_batch(seed=step)).loss.backward()
        opt.step()
        opt.zero_grad()
    for update in updates:
        by_name = {t.name: t for t in update.targets}
        k, v = (by_name[f"model.layers.0.self_attn.{m}_proj.weight"] for m in ("k", "v"))
        assert k.seed == v.seed and k.rounding == v.rounding == "stochastic"
        seeds = [t.rounding_seed for t in update.targets]
        assert len(set(seeds)) == len(seeds), "two targets of one update round with the same noise"
    # The last update of v_proj, redone from its weights before it: its own seed gives the trainer's
    # result, k_proj's seed (the seed a shared projection seed used to give both) does not.
    name = "model.layers.0.self_attn.v_proj.weight"
    v = {t.name: t for t in updates[-1].targets}[name]
    k_seed = {t.name: t for t in updates[-1].targets}[name.replace("v_proj", "k_proj")].rounding_seed
    projection = make_projection(v.seed, opt.rank, v.in_features, opt.projection)
    after = dict(model.named_parameters())[name].detach()
    for seed, same in ((v.rounding_seed, True), (k_seed, False)):
        redone = before[name].clone()
        merge_low_rank_(redone, v.factor, projection, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(redone, after) is same


@pytest.mark.parametrize("kl_budget", [None, 1e-4])
def test_a_step_inside_an_autocast_region_computes_in_full_precision(kl_budget):
    """``opt.step()`` called inside ``torch.autocast`` (a training loop that wraps the whole
    iteration): the update's products (``η``'s Gram matrices, kept for the projection's lifetime;
    the merge) stay fp32/fp64, so the weights come out as from a step outside it, bit for bit."""
    batch = fixed_batch()
    weights = []
    for inside in (False, True):
        model = patch_model(tiny_qwen2())
        model.train()
        opt = LoGRAOptimizer(model, rank=4, kl_budget=kl_budget, update_ratio=6e-5)
        for _ in range(2):
            model(**batch).loss.backward()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=inside):
                opt.step()
            opt.zero_grad()
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))
