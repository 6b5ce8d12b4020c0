"""Worker for tests/test_distributed.py: the guards and the rank-summed scalars, on 2 real ranks.

Run as ``torchrun --nproc_per_node 2 -m tests.distributed_workers.guards OUT`` from the repository
root; rank 0 writes ``OUT/guards.pt`` with what each check observed (error messages, values), and the
test asserts on it.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from dataclasses import replace

import torch
import torch.distributed as dist

from logra_optim import LoGRAOptimizer
from logra_optim import distributed as dp
from tests.distributed_workers.common import BATCH, build_model, finish
from logra_optim.patching import target_state
from logra_optim.sketch import SharedProjection

warnings.filterwarnings("ignore")
torch.set_num_threads(1)


def error_of(fn) -> str | None:
    try:
        fn()
    except (RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def frozen_model():
    model = build_model()
    model.model.norm.weight.requires_grad_(False)
    return model


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    local_group = [dist.new_group([r]) for r in range(2)][rank]  # a group of one: no reduction

    # Different seeds: caught when the optimizer is built, on every rank.
    results["seed"] = error_of(lambda: LoGRAOptimizer(frozen_model(), rank=4, seed=rank))

    # Same settings, but rank 1's projection of one target differs (as if regenerated differently,
    # or corrupted): caught at the next step, which fingerprints the projections in use, naming the target.
    model = frozen_model()
    opt = LoGRAOptimizer(model, rank=4, update_ratio=1e-2)
    if rank == 1:
        target = target_state(model.model.layers[1].mlp.down_proj)
        spec = target.shared_projection.spec
        target.set_projection(SharedProjection(replace(spec, seed=spec.seed ^ 1), target.shared_projection.device))
    model(**BATCH).loss.backward()
    results["projection"] = error_of(opt.step)
    del opt

    # A non-finite average skips the update on both ranks, with the weights untouched: rank 1's NaN
    # reaches both averages (orthogonal directions, the default, would fail in eigh on it, RowAdam
    # would merge it), and so does a sum that overflows although each rank's sketch is finite (only
    # a check after the average sees it).
    # So does a NaN in rank 1's gradient of a trainable non-target alone (not averaged by LoGRA): only
    # rank 1 sees it, and the ranks must still agree to skip.
    cases = (("nan", "orthogonal"), ("nan", "rowadam"), ("overflow", "orthogonal"), ("nan_grad", "orthogonal"))
    for case, direction in cases:
        model = frozen_model()
        trains_norm = {}
        if case == "nan_grad":
            model.model.norm.weight.requires_grad_(True)
            trains_norm["non_target_optimizer"] = lambda params: torch.optim.SGD(params, lr=0.1)
        opt = LoGRAOptimizer(model, rank=4, update_ratio=1e-2, direction=direction, **trains_norm)
        model(**BATCH).loss.backward()
        if case == "overflow":
            opt.sketch_buffers()[0][3] = 3e38
        elif case == "nan_grad":
            if rank == 1:
                model.model.norm.weight.grad[0] = float("nan")
        elif rank == 1:
            opt.sketch_buffers()[0][3] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        results[f"{case}_sketch_{direction}"] = {
            "skips": opt.nonfinite_skips,
            "unchanged": all(torch.equal(p, q) for p, q in zip(model.parameters(), before)),
            "warnings": [str(w.message) for w in caught],
            "sketch_zero": not any(bool(b.any()) for b in opt.sketch_buffers()),
        }
        # The next update, from a clean sketch, goes through on both ranks.
        model(**BATCH).loss.backward()
        opt.step()
        results[f"{case}_sketch_{direction}"]["next_update_index"] = opt.update_index
        del opt

    # Ranks restored from checkpoints one update apart, within one projection's lifetime (same A):
    # caught at the next step, which fingerprints the update index too.
    model = frozen_model()
    opt = LoGRAOptimizer(model, rank=4, update_ratio=1e-2)
    model(**BATCH).loss.backward()
    if rank == 1:
        opt.update_index += 1
    results["update_index"] = error_of(opt.step)
    del opt

    # A rank whose probe rows (rows 0 and 2 of 4, spread) hold no probe position takes part in the
    # probe with no terms instead of raising alone while the other waits in its collectives; with no
    # position on any rank, every rank raises.
    # So does a rank whose training forward the probe cannot replay (packed sequences): it is kept
    # with no probe position.
    no_positions = dict(BATCH, labels=BATCH["labels"].clone())
    no_positions["labels"][[0, 2]] = -100
    seq = BATCH["input_ids"].shape[1]
    packed = dict(BATCH, position_ids=torch.cat((torch.arange(5), torch.arange(seq - 5))).expand(4, seq))
    for case, empty_on, options, empty in (
        ("one_rank_without_positions", {1}, {}, no_positions),
        ("one_rank_without_positions_checked", {1}, {"realised_kl_check": True}, no_positions),
        ("one_rank_without_positions_fd", {1}, {"probe": "finite_difference"}, no_positions),
        ("one_rank_without_positions_packed", {1}, {}, packed),
        ("no_rank_with_positions", {0, 1}, {}, no_positions),
    ):
        model = frozen_model()
        opt = LoGRAOptimizer(model, rank=4, kl_budget=1e-3, update_ratio=1e-2, **options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the packed forward's "not recorded"
            model(**(empty if rank in empty_on else BATCH)).loss.backward()
        error = error_of(opt.step)
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        results[case] = {
            "error": error,
            "update_index": opt.update_index,
            "probe_tokens": opt.stats.get("probe_tokens"),
            "weights": weights,
        }
        del opt

    # Tensor parallel placements are refused, naming the parameter and the placement.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    model = frozen_model()
    proj = model.model.layers[0].self_attn.o_proj
    proj.weight = torch.nn.Parameter(distribute_tensor(proj.weight.detach(), mesh, [Shard(1)]), requires_grad=False)
    results["shard1"] = error_of(lambda: LoGRAOptimizer(model, rank=4))

    # FSDP1 is refused with a pointer to fully_shard.
    from torch.distributed.fsdp import FullyShardedDataParallel

    results["fsdp1"] = error_of(
        lambda: LoGRAOptimizer(FullyShardedDataParallel(frozen_model(), device_id=torch.device("cpu")), rank=4)
    )

    # Row ranges of Shard(0) match what distribute_tensor gives each rank, uneven and empty shards too.
    rows_ok = True
    for d in range(1, 8):
        full = torch.arange(d * 3, dtype=torch.float32).reshape(d, 3)
        sharded = distribute_tensor(full, mesh, [Shard(0)])
        start, stop = dp.dtensor_rows(full.shape, mesh, sharded.placements)
        rows_ok &= torch.equal(sharded.to_local(), full[start:stop])
    results["rows"] = rows_ok

    # The predicted KL is the token-weighted mean over every rank's probe positions (unequal
    # counts here), and κ the token mean over every rank's tokens.
    model = frozen_model()
    reference_model = copy.deepcopy(model)
    opt = LoGRAOptimizer(model, rank=4, kl_budget=1e-3, update_ratio=1e-2)
    ids = BATCH["input_ids"]
    masks = torch.zeros(2, *ids.shape, dtype=torch.bool)
    masks[0, 0, 2:5] = True  # rank 0: 3 positions
    masks[1, :, 1:9] = True  # rank 1: 32 positions
    opt.set_probe_contexts(ids, probe_mask=masks[rank])
    model(**BATCH).loss.backward()  # same batch on both ranks: the averaged sketch is this one
    logps = torch.full((2, 6), -1.0)
    trainer = logps - torch.tensor([0.1, 0.4])[rank]
    mask = torch.ones_like(logps, dtype=torch.bool)
    mask[:, 2 * rank + 2 :] = False  # rank 0: 4 tokens, rank 1: 8 tokens
    results["mismatch"] = opt.observe_mismatch(logps, logps - (logps - trainer), mask)
    opt.step()
    results["q"] = opt.stats["predicted_kl"]
    results["probe_tokens"] = opt.stats["probe_tokens"]

    # One process (a group of one), the union of the contexts.
    ref = LoGRAOptimizer(reference_model, rank=4, kl_budget=1e-3, update_ratio=1e-2, process_group=local_group)
    both = torch.cat([ids, ids])
    ref.set_probe_contexts(both, probe_mask=torch.cat([masks[0], masks[1]]))
    reference_model(**BATCH).loss.backward()
    ref.step()
    results["q_reference"] = ref.stats["predicted_kl"]

    # With probe_positions=2, each rank's subset mean stands for all of its positions: the mean over
    # the ranks keeps their token weights (3 and 32), not their subsets' (2 and 2).
    model = frozen_model()
    references = [copy.deepcopy(model) for _ in range(2)]
    opt = LoGRAOptimizer(model, rank=4, kl_budget=1e-3, update_ratio=1e-2, probe_positions=2)
    opt.set_probe_contexts(ids, probe_mask=masks[rank])
    model(**BATCH).loss.backward()
    opt.step()
    results["q_subset"] = opt.stats["predicted_kl"]
    results["probe_tokens_subset"] = opt.stats["probe_tokens"]
    # The realised-KL check measures the same weighted mean: in the quadratic regime of a small
    # step it finds what the probe predicted.
    model = frozen_model()
    opt = LoGRAOptimizer(model, rank=4, kl_budget=1e-5, update_ratio=1e-2, probe_positions=2, realised_kl_check=True)
    opt.set_probe_contexts(ids, probe_mask=masks[rank])
    model(**BATCH).loss.backward()
    opt.step()
    results["realised_subset"] = (
        opt.stats["realised_kl"],
        opt.stats["predicted_step_kl"],
        opt.stats["realised_kl_retries"],
    )
    results["q_subset_per_rank"] = []
    for mask, reference_model in zip(masks, references):  # each rank's contexts alone, in one process
        ref = LoGRAOptimizer(
            reference_model, rank=4, kl_budget=1e-3, update_ratio=1e-2, probe_positions=2, process_group=local_group
        )
        ref.set_probe_contexts(ids, probe_mask=mask)
        reference_model(**BATCH).loss.backward()
        ref.step()
        results["q_subset_per_rank"].append(ref.stats["predicted_kl"])

    # FSDP2 computing in bf16 over fp32 shards (MixedPrecisionPolicy): the finite-difference probe
    # would measure bf16 rounding, and says so although the stored weights are fp32.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = frozen_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = LoGRAOptimizer(model, rank=4, kl_budget=1e-3, update_ratio=1e-2, probe="finite_difference")
    model(**BATCH).loss.backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    results["fsdp2_bf16_compute"] = [str(w.message) for w in caught]
    del opt

    # Collectives per step: one all-reduce of the flat sketch buffer and one all-gather of the
    # scalars; KL control adds one all-reduce of (Σq, tokens). Counted by wrapping torch.distributed.
    counts = {}
    for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast", "reduce_scatter_tensor"):
        original = getattr(dist, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    for config, kwargs in (("plain", {}), ("kl", {"kl_budget": 1e-3})):
        model = frozen_model()
        opt = LoGRAOptimizer(model, rank=4, update_ratio=1e-2, **kwargs)
        model(**BATCH).loss.backward()
        counts.clear()
        opt.step()
        results[f"collectives_{config}"] = dict(counts)
        results[f"sketch_buffers_{config}"] = len(opt.sketch_buffers())

    everyone = [None] * 2
    dist.all_gather_object(everyone, results)
    if rank == 0:
        torch.save(everyone, os.path.join(out, "guards.pt"))
    finish()


if __name__ == "__main__":
    main()
