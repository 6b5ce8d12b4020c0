"""Data-parallel LoGRA on real ranks: ``torchrun --nproc_per_node 2`` over gloo on the CPU.

For DDP, FSDP2 and DeepSpeed ZeRO-1/2/3, a 2-rank run on half batches must end, after several
steps, with the weights of one process on the full batch (fp32), with and without KL control and
with the realised-KL check; a run resumed from the engine's own checkpoint (torch.save for DDP, DCP
for FSDP2, DeepSpeed's checkpoints) must end bit-identical to an uninterrupted one. Each mode is one
torchrun launch (several checks per launch: startup dominates). Also on real ranks: the consistency
guard and the clear errors, the token-weighted probe and mismatch sums, the number of collectives
per step, and TRL's GRPOTrainer under DDP and DeepSpeed ZeRO-2/3 (with checkpoint resume). Property
tests check the new math (ZeRO-3 partition merges, row shards, sharded norms) against dense float64
references.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from logra_optim import LoGRAOptimizer, patch_model
from logra_optim import distributed as dp
from logra_optim.updates import merge_low_rank_
from tests.distributed_workers.common import CONFIGS, MODES, MOE_MODES, build_model, reference, trained_weights
from tests.helpers.reference import merged
from tests.helpers.tiny import TwoLinear

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

deepspeed_available = pytest.mark.skipif(
    __import__("importlib").util.find_spec("deepspeed") is None, reason="needs deepspeed (the test extra)"
)


def torchrun(worker: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Launch ``tests.distributed_workers.<worker>`` on 2 local ranks (gloo); returns the finished process."""
    pythonpath = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore", PYTHONPATH=pythonpath)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        f"tests.distributed_workers.{worker}",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


# Two ranks and one process reduce in different orders (fp32 sums, gloo's all-reduce), and α comes
# from a probe on the result. With the default orthogonal directions the weights have agreed to
# 1.1e-6 of their largest entry (one run of the transposed-experts test; below 1e-6 with RowAdam),
# so 1e-6 sits at the rounding. Every target moves by more than 1e-4 of it (asserted beside each
# use), so a step built from the wrong tokens, or without a rank's, still fails.
WEIGHT_TOLERANCE = 1e-5


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


@functools.lru_cache(maxsize=None)
def _reference(config: str, mode: str, moe: str | None = None) -> dict:
    return reference(config, mode, moe=moe)


@pytest.mark.parametrize(
    "mode", [pytest.param(m, marks=deepspeed_available if m.startswith("zero") else ()) for m in MODES]
)
def test_two_ranks_on_half_batches_equal_one_process_on_the_full_batch(mode, tmp_path):
    result = torchrun("equivalence", mode, str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    results = torch.load(tmp_path / f"{mode}.pt", weights_only=False)
    initial = trained_weights(build_model())

    for config in CONFIGS:
        want, got = _reference(config, mode), results[config]
        for name, weight in want["weights"].items():
            # The check means something: every target moved far more than the tolerance.
            assert _relative_error(weight, initial[name]) > 1e-4, (config, name)
            assert _relative_error(got["weights"][name], weight) < WEIGHT_TOLERANCE, (config, name)
        assert got["alphas"] == pytest.approx(want["alphas"], rel=1e-5), config
        if "kl_budget" in CONFIGS[config]:
            assert any(alpha != 1.0 for alpha in got["alphas"])  # KL control chose the steps

    if mode == "zero3":
        assert "probe='finite_difference'" in results["jvp_error"]
    # FSDP2 with every target in the root's group, which stays unsharded after forwards; ZeRO-3 with
    # its default persistence threshold, which keeps this tiny model's weights whole as well.
    variant = {"fsdp2": "kl-check-root-only", "zero3": "kl-check-persistent"}.get(mode)
    if variant is not None:
        want, got = _reference("kl-check", mode), results[variant]
        for name, weight in want["weights"].items():
            assert _relative_error(got["weights"][name], weight) < WEIGHT_TOLERANCE, name
        assert got["alphas"] == pytest.approx(want["alphas"], rel=1e-5)

    if mode in MOE_MODES:  # mixture of experts: every expert of every layer, with the probe through them
        want, got = _reference("kl", mode, moe="qwen3_moe"), results["moe"]
        initial = trained_weights(build_model(moe="qwen3_moe"))
        assert sum(".experts." in name for name in want["weights"]) == 4
        for name, weight in want["weights"].items():
            assert _relative_error(weight, initial[name]) > 1e-4, name
            assert _relative_error(got["weights"][name], weight) < WEIGHT_TOLERANCE, name
        assert got["alphas"] == pytest.approx(want["alphas"], rel=1e-5)
        if mode == "fsdp2":  # uneven shards over experts: rank 0 holds experts 0–1, rank 1 expert 2
            first, second = results["moe_layouts"]
            assert {kind for kind, _, _ in first + second} == {"rows"}
            assert all(a[2] == b[1] and a[2] - a[1] == 2 * (b[2] - b[1]) for a, b in zip(first, second))

    # Every rank holds the same weights (replicated engines: its own copy; sharded: gathered).
    first, second = results["per_rank"]
    for config in first:
        for name in first[config]:
            assert torch.equal(first[config][name], second[config][name]), (config, name)

    # Checkpoint: two steps, save, a fresh setup loads and takes the third = three uninterrupted steps.
    assert results["resumed"]["update_index"] == 3
    for name, weight in results["kl"]["weights"].items():
        assert torch.equal(results["resumed"]["weights"][name], weight), name


def test_two_ranks_train_transposed_experts_as_one_process(tmp_path):
    """GPT-OSS's experts, stored transposed (``[E, in, out]``), under DDP (replicated) and FSDP2
    (sharded over experts: rank 0 holds experts 0–1, rank 1 expert 2, of the transposed storage):
    with KL control, 2 ranks on half batches end with the weights and α of one process on the full
    batch, every expert weight having moved."""
    result = torchrun("transposed_experts", str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    results = torch.load(tmp_path / "transposed_experts.pt", weights_only=False)
    initial = trained_weights(build_model(moe="gpt_oss"))
    for mode in MOE_MODES:
        want, got = _reference("kl", mode, moe="gpt_oss"), results[mode]
        assert sum(".experts." in name for name in want["weights"]) == 4
        for name, weight in want["weights"].items():
            assert _relative_error(weight, initial[name]) > 1e-4, (mode, name)
            assert _relative_error(got["weights"][name], weight) < WEIGHT_TOLERANCE, (mode, name)
        assert got["alphas"] == pytest.approx(want["alphas"], rel=1e-5), mode
    first, second = results["fsdp2"]["layouts"]
    assert {(kind, transposed) for kind, _, _, transposed in first + second} == {("rows", True)}
    assert all(a[2] == b[1] and a[2] - a[1] == 2 * (b[2] - b[1]) for a, b in zip(first, second))
    assert {kind for kind, *_ in results["ddp"]["layouts"][0]} == {"replicated"}


# ---------------------------------------------------------------------------------------------------
# Properties of the sharded math, against dense float64 references


@given(
    d=st.integers(1, 9),
    k=st.integers(1, 9),
    r=st.integers(1, 4),
    world=st.integers(1, 5),
    chunk_rows=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_zero3_partitions_merge_to_the_dense_update(d, k, r, world, chunk_rows, seed):
    """Each rank's flat partition (DeepSpeed's padded even split, ending mid-row, padding at the end)
    merged on its own concatenates to ``W − F A``; small chunks exercise the row chunking."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(d, k, generator=generator, dtype=torch.float64)
    factor = torch.randn(d, r, generator=generator, dtype=torch.float64)
    projection = torch.randn(r, k, generator=generator, dtype=torch.float64)
    partition = -(-d * k // world)  # ceil: DeepSpeed pads the flattened tensor to a multiple of world
    pieces = []
    for rank in range(world):
        start = min(rank * partition, d * k)
        stop = min(start + partition, d * k)
        flat = weight.reshape(-1)[start:stop].clone()
        dp.merge_flat_partition_(flat, start, factor, projection, chunk_bytes=8 * k * chunk_rows)
        pieces.append(flat)
    want = merged(weight, factor, projection)
    torch.testing.assert_close(torch.cat(pieces).reshape(d, k), want, rtol=1e-12, atol=1e-12)
    # The partitions' partial sums of squares add up to ‖W‖² (what η's all-gather sums).
    assert sum(float(p.square().sum()) for p in pieces) == pytest.approx(float(want.square().sum()), rel=1e-12)


@given(d=st.integers(1, 12), k=st.integers(1, 6), r=st.integers(1, 3), world=st.integers(1, 5), seed=st.integers(0, 99))
def test_row_shards_merge_and_norm_to_the_dense_values(d, k, r, world, seed):
    """FSDP2 row shards (torch.chunk's uneven split, empty shards included): merging each rank's rows
    with its rows of F gives the dense update, and the shards' partial Σw² add up to ‖W‖²."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(d, k, generator=generator, dtype=torch.float64)
    factor = torch.randn(d, r, generator=generator, dtype=torch.float64)
    projection = torch.randn(r, k, generator=generator, dtype=torch.float64)
    shards = list(torch.chunk(weight.clone(), world, dim=0)) + [weight[:0].clone()] * (
        world - len(torch.chunk(weight, world))
    )
    start, pieces, partial = 0, [], 0.0
    for shard in shards:
        stop = start + shard.shape[0]
        merge_low_rank_(shard, factor[start:stop], projection)
        pieces.append(shard)
        partial += float(shard.square().sum())
        start = stop
    want = merged(weight, factor, projection)
    torch.testing.assert_close(torch.cat(pieces), want, rtol=1e-12, atol=1e-12)
    assert partial == pytest.approx(float(want.square().sum()), rel=1e-12)


@given(
    d=st.integers(1, 40),
    k=st.integers(1, 40),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    transposed=st.booleans(),
    seed=st.integers(0, 99),
)
def test_local_sq_norm_is_the_sum_of_squares(d, k, dtype, transposed, seed):
    """``Σw²`` of a weight, against float64 of the same stored values: a dot product for contiguous
    fp32/fp64 data, ``vector_norm`` for other dtypes and for non-contiguous data (a transposed view)."""
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(d, k, generator=generator, dtype=torch.float64) * 3.0 + 0.5).to(dtype)
    if transposed:
        weight = weight.t()
    got = dp.local_sq_norm(weight, dp.weight_layout("w", weight))
    assert got.dtype == torch.float64 and got.dim() == 0
    exact = float(weight.double().square().sum())
    assert float(got) == pytest.approx(exact, rel=1e-12 if dtype == torch.float64 else 1e-5)


def test_merge_flat_partition_rejects_a_partition_outside_the_weight():
    with pytest.raises(ValueError, match="outside"):
        dp.merge_flat_partition_(torch.zeros(4), 10, torch.zeros(3, 1), torch.zeros(1, 4))
    with pytest.raises(ValueError, match="outside"):
        dp.merge_flat_partition_(torch.zeros(4), -1, torch.zeros(3, 1), torch.zeros(1, 4))


def test_guards_and_rank_summed_scalars(tmp_path):
    """On 2 real ranks: mismatched projections fail loudly on every rank (seeds at construction, a
    differing A or update index at the next step, naming the target or the settings); a NaN in one
    rank's sketch or in one rank's non-target gradient, or an average that overflows, skips the update
    on both, weights untouched, and
    the next update goes through; a rank whose probe rows hold no position takes part in the probe
    (every rank raises when none has one); Shard(1) and FSDP1 are refused clearly; the predicted KL
    is the token-weighted mean over every rank's probe positions (3 vs 32 here), also when each
    probes a subset of them, and κ the token mean over every rank's tokens."""
    result = torchrun("guards", str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    for rank, seen in enumerate(torch.load(tmp_path / "guards.pt", weights_only=False)):
        assert seen["seed"].startswith("RuntimeError") and "ranks [0, 1] disagree" in seen["seed"], rank
        assert "(0, 0, 0, 4, 4, 'rademacher'" in seen["seed"] and "(1, 0, 0, 4, 4, 'rademacher'" in seen["seed"]
        assert "projection of target 'model.layers.1.mlp.down_proj' differs" in seen["projection"], rank
        assert seen["update_index"].startswith("RuntimeError") and "update index" in seen["update_index"], rank
        assert "(0, 0, 0, 4, 4, 'rademacher'" in seen["update_index"]  # seed, projection index, update index
        assert "(0, 0, 1, 4, 4, 'rademacher'" in seen["update_index"]
        assert seen["shard1"].startswith("ValueError") and "'model.layers.0.self_attn.o_proj'" in seen["shard1"]
        assert "Shard(dim=1)" in seen["shard1"]
        assert seen["fsdp1"].startswith("ValueError") and "fully_shard" in seen["fsdp1"]
        assert seen["rows"]
        for case in ("", "_checked", "_fd", "_packed"):  # JVP, realised-KL check, finite differences; unreplayable
            one = seen[f"one_rank_without_positions{case}"]
            assert one["error"] is None and one["update_index"] == 1, (rank, case, one["error"])
            assert one["probe_tokens"] == 2 * 11  # rank 0's two rows of 12 tokens: 11 positions each
            assert torch.isfinite(one["weights"]).all()
        none = seen["no_rank_with_positions"]
        assert none["error"].startswith("RuntimeError") and "no rank's latest contexts" in none["error"], rank
        assert none["update_index"] == 0
        for case in (
            "nan_sketch_orthogonal",
            "nan_sketch_rowadam",
            "overflow_sketch_orthogonal",
            "nan_grad_sketch_orthogonal",
        ):
            skipped = seen[case]
            assert skipped["skips"] == 1 and skipped["unchanged"] and skipped["sketch_zero"], (rank, case, skipped)
            assert any("non-finite sketch" in message for message in skipped["warnings"]), (rank, case)
            assert skipped["next_update_index"] == 1, (rank, case)
        assert seen["probe_tokens"] == 35
        assert seen["q"] == pytest.approx(seen["q_reference"], rel=1e-9)
        q0, q1 = seen["q_subset_per_rank"]
        assert seen["probe_tokens_subset"] == 4 and abs(q0 - q1) > 0.1 * max(q0, q1)
        assert seen["q_subset"] == pytest.approx((3 * q0 + 32 * q1) / 35, rel=1e-9)
        realised, predicted, retries = seen["realised_subset"]
        print("realised_subset", rank, realised, predicted, retries, q0, q1)
        assert retries == 0 and realised == pytest.approx(predicted, rel=0.02)
        assert seen["mismatch"] == pytest.approx(0.3 * (4 * 0.1 + 8 * 0.4) / 12, rel=1e-6)
        # Not one collective per layer: one flat all-reduce (one buffer: all on one device), one
        # all-gather of scalars, and with KL control one all-reduce of the probe's sums.
        assert seen["sketch_buffers_plain"] == 1
        assert any("computed in ['torch.bfloat16']" in message for message in seen["fsdp2_bf16_compute"]), rank
        assert seen["collectives_plain"] == {"all_reduce": 1, "all_gather": 1}
        assert seen["collectives_kl"] == {"all_reduce": 2, "all_gather": 1}
    ranks = torch.load(tmp_path / "guards.pt", weights_only=False)
    # Both ranks applied the same update although only rank 0 probed.
    for case in ("", "_checked", "_fd"):
        key = f"one_rank_without_positions{case}"
        assert torch.equal(ranks[0][key]["weights"], ranks[1][key]["weights"]), case


@pytest.mark.parametrize(
    "engine",
    ["ddp", pytest.param("zero2", marks=deepspeed_available), pytest.param("zero3", marks=deepspeed_available)],
)
def test_grpo_trainer_on_two_ranks(engine, tmp_path):
    """TRL's GRPOTrainer under torchrun (gloo, CPU) with DDP or DeepSpeed ZeRO-2 / ZeRO-3, LoGRA
    attached with attach_logra: every update is applied on both ranks identically (ZeRO-3: into the
    partitions, gathered here), KL control runs (JVP; finite differences under ZeRO-3), its statistics
    reach the trainer's logs, and resuming from a checkpoint is bit-identical."""
    result = torchrun("grpo_distributed", engine, str(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    first, second = torch.load(tmp_path / f"grpo-{engine}.pt", weights_only=False)
    for seen in (first, second):
        assert seen["update_index"] == 3
        assert seen["zero3"] == (engine == "zero3")
        assert seen["clipping"] == (None if engine == "ddp" else 0.0)  # "auto": disabled with max_grad_norm
        assert seen["moved"] > 1e-4  # every target moved
        assert len(seen["alphas"]) == 3 and all(0 < a < 10 for a in seen["alphas"])
        assert all(q > 0 for q in seen["predicted_kl"])
    assert first["alphas"] == second["alphas"]
    for name, weight in first["weights"].items():
        assert torch.equal(weight, second["weights"][name]), name
    # Checkpoint every 2 steps (DDP: the trainer's optimizer.pt; DeepSpeed: its checkpoint + LoGRA's
    # state beside it); a fresh trainer
    # resumed from checkpoint-2 ends bit-identical to the uninterrupted run, the trained norm included.
    for seen in (first, second):
        assert seen["resumed_update_index"] == 3
        for name, weight in seen["weights"].items():
            assert torch.equal(seen["resumed_weights"][name], weight), name


# ---------------------------------------------------------------------------------------------------
# Single process: the new options


def test_single_process_options():
    with pytest.raises(RuntimeError, match="not initialised"):
        LoGRAOptimizer(patch_model(TwoLinear(), target_modules=["up", "down"]), rank=2, process_group=object())
    model = patch_model(TwoLinear(), target_modules=["up"])
    with pytest.raises(ValueError, match="'external'"):
        LoGRAOptimizer(model, rank=2, non_target_optimizer="adamw")
    model.down.weight.requires_grad_(True)  # trained by someone else: accepted, not stepped by LoGRA
    opt = LoGRAOptimizer(model, rank=2, non_target_optimizer="external", realised_kl_check=True, kl_budget=1e-3)
    assert opt.non_target_optimizer is None


def test_state_dict_lists_every_target_before_its_first_update():
    """So that template-based loaders (DCP) find every entry; loading it changes nothing."""

    def run(load_fresh_state: bool) -> dict[str, torch.Tensor]:
        model = patch_model(TwoLinear(), target_modules=["up", "down"])
        opt = LoGRAOptimizer(model, rank=2, update_ratio=1e-2)
        if load_fresh_state:
            state = opt.state_dict()
            assert set(state["state"]) == {0, 1}
            assert all(float(entry["first_moment"].abs().sum()) == 0 for entry in state["state"].values())
            opt.load_state_dict(state)
        for _ in range(2):
            model(torch.randn(5, 12, generator=torch.Generator().manual_seed(0))).square().sum().backward()
            opt.step()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    plain, loaded = run(False), run(True)
    for name in plain:
        assert torch.equal(plain[name], loaded[name]), name
