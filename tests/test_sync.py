"""The sync payload (format, validation, round trip), the optimizer's merge hook, the engine
placements of fused and tensor-parallel layers, and the drift checksum; float64 references.
No vLLM needed here: the engine tests are in test_vllm.py."""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from logra_optim import LoGRAOptimizer, make_projection, patch_model, projection_seed
from logra_optim.integrations.vllm import column_parallel_placements, row_parallel_placement
from logra_optim.sync import (
    PAYLOAD_VERSION,
    PayloadError,
    SyncPayload,
    TargetUpdate,
    Update,
    UpdateRecorder,
    checksum_probe,
    merge_like_trainer_,
    projection_of,
    projections_of,
    relative_drift,
    rounding_seed,
    sparse_delta,
    weight_checksum,
)
from logra_optim.updates import merge_low_rank_, merge_low_rank_blocks_
from tests.helpers.reference import merged
from tests.helpers.tiny import TwoLinear, tiny_qwen2
from logra_optim.patching import target_state


def _payload(first=1, updates=2, rank=3, shapes=((5, 7), (4, 6)), dtype=torch.bfloat16, seed=0) -> SyncPayload:
    generator = torch.Generator().manual_seed(seed)
    return SyncPayload(
        rank,
        "rademacher",
        tuple(
            Update(
                first + u,
                tuple(
                    TargetUpdate(
                        f"layer{i}.weight",
                        1000 * u + i,
                        k,
                        torch.randn(d, rank, generator=generator).to(dtype),
                        # every other target as a bf16 trainer's, with its rounding seed
                        *(("stochastic", rounding_seed(1000 * u + i, first + u, f"layer{i}")) if i % 2 else ()),
                    )
                    for i, (d, k) in enumerate(shapes)
                ),
            )
            for u in range(updates)
        ),
    )


# --------------------------------------------------------------------------------------------------
# Format


@given(
    first=st.integers(1, 10**6),
    updates=st.integers(1, 3),
    rank=st.integers(1, 4),
    shapes=st.lists(st.tuples(st.integers(1, 9), st.integers(4, 9)), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
)
def test_payload_round_trip_is_exact(first, updates, rank, shapes, dtype):
    payload = _payload(first, updates, rank, tuple(shapes), dtype)
    data = payload.encode()
    loaded = torch.load(io.BytesIO(data), weights_only=True)  # plain tensors, numbers and strings
    assert loaded["format"] == "logra-sync" and loaded["version"] == PAYLOAD_VERSION
    decoded = SyncPayload.decode(data)
    assert (decoded.rank, decoded.projection, decoded.first_index, decoded.last_index) == (
        rank,
        "rademacher",
        first,
        first + updates - 1,
    )
    for a, b in zip(payload.updates, decoded.updates):
        assert a.index == b.index
        for x, y in zip(a.targets, b.targets):
            assert (x.name, x.seed, x.in_features, x.rounding, x.rounding_seed) == (
                y.name,
                y.seed,
                y.in_features,
                y.rounding,
                y.rounding_seed,
            )
            assert x.factor.dtype == y.factor.dtype and torch.equal(x.factor, y.factor)
    # the factors dominate: metadata is a few hundred bytes per target plus a fixed header
    assert payload.factor_bytes < len(data) < payload.factor_bytes + 1500 + 400 * len(shapes) * updates


def test_projection_of_payload_is_the_seeded_projection():
    payload = _payload()
    target = payload.updates[1].targets[0]
    assert torch.equal(projection_of(payload, target), make_projection(target.seed, 3, 7, "rademacher"))


def test_projections_of_draw_a_shared_seed_once():
    """q/k/v of one layer carry one seed when the trainer shares their ``A``; the engine draws it once."""
    patched = patch_model(tiny_qwen2())
    optimizer = LoGRAOptimizer(patched, rank=3, lr=1e-3)
    seeds = {t.name: optimizer.projection_seed(i) for i, t in enumerate(optimizer.targets)}
    q, k, o = (f"model.layers.0.self_attn.{m}" for m in ("q_proj", "k_proj", "o_proj"))
    assert seeds[q] == seeds[k] != seeds[o]
    payload = _payload()
    projection = projections_of(payload)
    first, second = payload.updates[1].targets[0], payload.updates[0].targets[0]
    sibling = dataclasses.replace(second, seed=first.seed)
    drawn = projection(first)
    assert projection(sibling) is drawn  # the next target with the same seed: not drawn again
    assert torch.equal(drawn, projection_of(payload, first))
    assert not torch.equal(projection(second), drawn)
    again = projection(first)  # only the latest A is kept: a later repeat is drawn anew, identically
    assert again is not drawn and torch.equal(again, drawn)


def test_expert_factors_carry_their_own_rank():
    """Stacked experts may have a rank of their own (``expert_rank``): factors of either rank are
    valid, each target's ``A`` is drawn at its factor's rank, and the payload round-trips it."""
    payload = _payload(rank=3)
    experts = TargetUpdate("layer0.mlp.experts.down_proj", 77, 6, torch.randn(4 * 5, 2))
    mixed = SyncPayload(3, "rademacher", (Update(1, payload.updates[0].targets + (experts,)),), expert_rank=2)
    decoded = SyncPayload.decode(mixed.encode())
    assert (decoded.rank, decoded.expert_rank) == (3, 2)
    assert projection_of(decoded, decoded.updates[0].targets[-1]).shape == (2, 6)
    assert projection_of(decoded, decoded.updates[0].targets[0]).shape == (3, 7)
    assert SyncPayload(3, "rademacher", payload.updates).expert_rank == 3  # default: the rank
    with pytest.raises(PayloadError, match=r"expected \(d, r\), r in \[2, 3\]"):
        SyncPayload(3, "rademacher", (Update(1, (dataclasses.replace(experts, factor=torch.ones(20, 4)),)),), 2)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(version=PAYLOAD_VERSION + 1), "version"),
        (lambda d: d.update(version=1), "version 1 is not supported.*same release"),  # before rounding modes
        (lambda d: d["updates"][0]["targets"][0].update(rounding="floor"), "rounding must be one of"),
        (lambda d: d.update(format="something-else"), "not a LoGRA sync payload"),
        (lambda d: d["updates"][1].update(index=d["updates"][0]["index"] + 2), "skips from update 1 to 3"),
        (lambda d: d["updates"][0]["targets"][0].update(factor=torch.full((5, 3), float("nan"))), "not finite"),
        (lambda d: d["updates"][0]["targets"][0].update(factor=torch.ones(5, 2)), r"expected \(d, r\), r in \[3\]"),
        (lambda d: d.update(version=2), "version 2 is not supported"),  # before expert ranks
        # before the counter-based projections: its seeds would give another A
        (
            lambda d: d.update(version=3),
            "version 3 is not supported: this side reads version 5 only .*random generator",
        ),
        # before the rounding seeds travelled: siblings' noise was drawn from their shared projection seed
        (lambda d: d.update(version=4), "version 4 is not supported.*rounding otherwise"),
        (
            lambda d: d["updates"][0]["targets"][0].update(rounding_seed=5),
            "rounding_seed must be .* got 5 with rounding 'exact'",
        ),
        (lambda d: d["updates"][0]["targets"][0].pop("rounding_seed"), "missing or mistyped"),
        (lambda d: d.update(expert_rank=0), "expert_rank must be a positive integer"),
        (lambda d: d.pop("expert_rank"), "missing or mistyped"),
        (lambda d: d["updates"][0]["targets"][1].update(name="layer0.weight"), "names a target twice"),
        (lambda d: d["updates"][0]["targets"][0].update(seed=-1), "seed"),
        (lambda d: d["updates"][0]["targets"][0].update(seed=2**63), r"seed .* outside \[0, 2\*\*63\)"),
        (lambda d: d["updates"][0]["targets"][0].update(factor=torch.ones(0, 3)), r"expected \(d, r\)"),
        (lambda d: d["updates"][0]["targets"][0].update(in_features=2), "in_features 2 is below the rank 3"),
        (
            lambda d: d["updates"][0]["targets"][0].update(rounding="stochastic", rounding_seed=None),
            "rounding_seed must be an integer",
        ),
        (
            lambda d: d["updates"][0]["targets"][0].update(rounding="stochastic", rounding_seed=2**63),
            "rounding_seed must be an integer",
        ),
        (lambda d: d.update(projection="sparse"), "projection must be one of"),
        (lambda d: d.update(updates=[]), "no updates"),
        (lambda d: d["updates"][0]["targets"][0].pop("factor"), "missing or mistyped"),
    ],
)
def test_bad_payloads_are_rejected_with_the_reason(change, message):
    data = _payload().to_dict()
    change(data)
    buffer = io.BytesIO()
    torch.save(data, buffer)
    with pytest.raises(PayloadError, match=message):
        SyncPayload.decode(buffer.getvalue())


def test_corrupt_bytes_are_rejected():
    with pytest.raises(PayloadError, match="cannot be decoded"):
        SyncPayload.decode(b"not a payload")


# --------------------------------------------------------------------------------------------------
# The optimizer sends exactly what it merges


@pytest.mark.parametrize("wire_dtype", [torch.bfloat16, None])
def test_merge_hook_reports_exactly_the_merged_update(wire_dtype):
    model = patch_model(TwoLinear(), target_modules=["up", "down"])
    # A new A every update, so that each payload's seed is checked at a new projection index.
    optimizer = LoGRAOptimizer(model, rank=3, update_ratio=1e-2, wire_dtype=wire_dtype, seed=5, refresh_every=1)
    recorder = UpdateRecorder(optimizer)
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        before = {n: m.weight.detach().double().clone() for n, m in model.named_modules() if hasattr(m, "_logra")}
        model(torch.randn(6, 12, generator=generator)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        payload = recorder.drain()
        assert payload is not None and payload.first_index == payload.last_index == step + 1
        for target in payload.updates[0].targets:
            module = target.name.removesuffix(".weight")
            assert target.seed == projection_seed(5, step, module)
            assert target.factor.dtype == (wire_dtype or torch.float32)
            expected = merged(before[module], target.factor, projection_of(payload, target))
            weight = dict(model.named_modules())[module].weight.detach().double()
            torch.testing.assert_close(weight, expected, rtol=0, atol=1e-6)
    recorder.close()
    model(torch.randn(6, 12)).square().sum().backward()
    optimizer.step()
    assert recorder.drain() is None  # closed: its hook is gone, the step recorded nothing


def test_payload_names_the_projection_of_a_resumed_optimizer():
    """A recorder built before load_state_dict: the checkpoint's projection kind (Gaussian here) is
    the one the update is merged with, and the one its payload must name. Updates merged with
    different kinds cannot share a payload."""

    def fresh(**options):
        model = patch_model(TwoLinear(), target_modules=["up", "down"])
        return model, LoGRAOptimizer(model, rank=3, update_ratio=1e-2, **options)

    def step(model, optimizer):
        model(torch.randn(6, 12, generator=torch.Generator().manual_seed(0))).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    checkpoint = fresh(projection="gaussian")[1].state_dict()
    model, optimizer = fresh()
    recorder = UpdateRecorder(optimizer)
    optimizer.load_state_dict(checkpoint)
    assert optimizer.projection == "gaussian"
    before = {n: m.weight.detach().double().clone() for n, m in (("up", model.up), ("down", model.down))}
    step(model, optimizer)
    payload = recorder.drain()
    assert payload.projection == "gaussian"
    for target in payload.updates[0].targets:
        module = target.name.removesuffix(".weight")
        expected = merged(before[module], target.factor, projection_of(payload, target))
        torch.testing.assert_close(getattr(model, module).weight.detach().double(), expected, rtol=0, atol=1e-6)

    step(model, optimizer)  # merged with Gaussian projections
    optimizer.load_state_dict(fresh()[1].state_dict())  # back to Rademacher, this update still pending
    step(model, optimizer)
    assert not recorder.consistent  # VLLMSync sends the full weights instead
    with pytest.raises(ValueError, match=r"updates \[2, 1\] are not consecutive or were merged with different"):
        recorder.drain()
    recorder.clear()
    assert recorder.consistent and recorder.drain() is None
    step(model, optimizer)  # update 2, Rademacher
    optimizer.load_state_dict(fresh()[1].state_dict())  # the same kind, back to update 0
    step(model, optimizer)  # update 1 again: a gap the engine's index check would refuse
    assert [u.index for u in recorder.pending] == [2, 1] and not recorder.consistent

    # Consecutive indices, another projection kind: the checkpoint of a Gaussian run at update 1.
    gaussian_model, gaussian = fresh(projection="gaussian")
    step(gaussian_model, gaussian)
    model, optimizer = fresh()
    recorder = UpdateRecorder(optimizer)
    step(model, optimizer)  # update 1, Rademacher
    optimizer.load_state_dict(gaussian.state_dict())
    step(model, optimizer)  # update 2, Gaussian
    assert [u.index for u in recorder.pending] == [1, 2] and not recorder.consistent
    with pytest.raises(ValueError, match="merged with different"):
        recorder.drain()


def test_a_removed_merge_hook_is_not_called():
    model = patch_model(TwoLinear(), target_modules=["up", "down"])
    optimizer = LoGRAOptimizer(model, rank=3, update_ratio=1e-2)
    calls = []
    handle = optimizer.register_merge_hook(lambda opt, update: calls.append(update.index))
    for _ in range(2):
        model(torch.randn(6, 12)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        handle.remove()
    assert calls == [1]


def test_recorder_keeps_consecutive_updates_until_drained():
    model = tiny_qwen2()
    patch_model(model)
    optimizer = LoGRAOptimizer(model, rank=4, update_ratio=1e-3)
    recorder = UpdateRecorder(optimizer, rename=lambda name: "engine." + name)
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    payload = recorder.drain()
    assert [u.index for u in payload.updates] == [1, 2, 3]
    names = {t.name for t in payload.updates[0].targets}
    assert "engine.model.layers.0.self_attn.q_proj.weight" in names and len(names) == 14  # 7 families × 2 layers
    assert recorder.drain() is None


def test_skipped_step_sends_nothing():
    model = patch_model(TwoLinear(), target_modules=["up", "down"])
    optimizer = LoGRAOptimizer(model, rank=3, update_ratio=1e-2)
    recorder = UpdateRecorder(optimizer)
    model(torch.randn(6, 12)).square().sum().backward()
    target_state(model.up).sketch.fill_(float("nan"))
    with pytest.warns(RuntimeWarning, match="non-finite"):
        optimizer.step()
    assert recorder.drain() is None


# --------------------------------------------------------------------------------------------------
# Fused and tensor-parallel placements against a per-head reference


def _qkv_local_reference(q, k, v, heads, kv_heads, head_dim, tp_rank, tp_size):
    """vLLM's QKVParallelLinear shard of rank ``tp_rank``, built head by head: q heads split evenly,
    KV heads split evenly or, with fewer KV heads than ranks, each replicated on tp/KV ranks."""
    per_rank = heads // tp_size
    q_heads = range(tp_rank * per_rank, (tp_rank + 1) * per_rank)
    if tp_size >= kv_heads:
        kv_owned = [tp_rank // (tp_size // kv_heads)]
    else:
        kv_per_rank = kv_heads // tp_size
        kv_owned = range(tp_rank * kv_per_rank, (tp_rank + 1) * kv_per_rank)
    rows = lambda m, owned: torch.cat([m[h * head_dim : (h + 1) * head_dim] for h in owned])  # noqa: E731
    return torch.cat([rows(q, q_heads), rows(k, kv_owned), rows(v, kv_owned)])


@given(
    tp_size=st.sampled_from([1, 2, 4]),
    heads_per_rank=st.integers(1, 2),
    kv_heads=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([2, 3]),
    hidden=st.integers(4, 9),
    rank=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_fused_qkv_placements_match_dense_reference(tp_size, heads_per_rank, kv_heads, head_dim, hidden, rank, seed):
    heads = heads_per_rank * tp_size
    if kv_heads > heads or (tp_size >= kv_heads and tp_size % kv_heads) or (tp_size < kv_heads and kv_heads % tp_size):
        return  # not a valid attention geometry
    rank = min(rank, hidden)
    generator = torch.Generator().manual_seed(seed)
    dense = {
        m: torch.randn(n * head_dim, hidden, generator=generator, dtype=torch.float64)
        for m, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))
    }
    factors = {m: torch.randn(w.shape[0], rank, generator=generator, dtype=torch.float64) for m, w in dense.items()}
    projection = make_projection(seed, rank, hidden, "gaussian", dtype=torch.float64)
    updated = {m: merged(dense[m], factors[m], projection) for m in dense}
    kv_local = (1 if tp_size >= kv_heads else kv_heads // tp_size) * head_dim
    replicas = max(1, tp_size // kv_heads)
    for tp_rank in range(tp_size):
        local = _qkv_local_reference(*dense.values(), heads, kv_heads, head_dim, tp_rank, tp_size)
        placements = column_parallel_placements(
            "qkv_proj",
            ["q", "k", "v"],
            [w.shape[0] for w in dense.values()],
            [heads_per_rank * head_dim, kv_local, kv_local],
            [tp_rank, tp_rank // replicas, tp_rank // replicas],
            hidden,
        )
        for member, placement in placements.items():
            assert (placement.out_features, placement.in_features) == tuple(dense[member].shape)
            update = factors[member][placement.factor_rows] @ projection[:, placement.projection_cols]
            local[placement.param_rows] -= update
        expected = _qkv_local_reference(*updated.values(), heads, kv_heads, head_dim, tp_rank, tp_size)
        torch.testing.assert_close(local, expected, rtol=1e-12, atol=1e-12)


@given(tp_size=st.sampled_from([1, 2, 4]), rows=st.integers(1, 3), cols=st.integers(1, 3), seed=st.integers(0, 999))
def test_merged_and_row_parallel_placements_match_dense_reference(tp_size, rows, cols, seed):
    generator = torch.Generator().manual_seed(seed)
    intermediate, hidden, rank = rows * tp_size * 2, cols * tp_size * 2, 2
    gate, up = (torch.randn(intermediate, hidden, generator=generator, dtype=torch.float64) for _ in range(2))
    down = torch.randn(hidden, intermediate, generator=generator, dtype=torch.float64)
    f_gate, f_up = (torch.randn(intermediate, rank, generator=generator, dtype=torch.float64) for _ in range(2))
    f_down = torch.randn(hidden, rank, generator=generator, dtype=torch.float64)
    a_in = make_projection(seed, rank, hidden, "rademacher", dtype=torch.float64)
    a_mid = make_projection(seed + 1, rank, intermediate, "rademacher", dtype=torch.float64)
    new_gate, new_up, new_down = merged(gate, f_gate, a_in), merged(up, f_up, a_in), merged(down, f_down, a_mid)
    shard = intermediate // tp_size
    for tp_rank in range(tp_size):
        rows_of = slice(tp_rank * shard, (tp_rank + 1) * shard)
        local = torch.cat([gate[rows_of], up[rows_of]])
        placements = column_parallel_placements(
            "gate_up_proj", ["gate", "up"], [intermediate] * 2, [shard] * 2, [tp_rank] * 2, hidden
        )
        for member, factor in (("gate", f_gate), ("up", f_up)):
            p = placements[member]
            local[p.param_rows] -= factor[p.factor_rows] @ a_in[:, p.projection_cols]
        torch.testing.assert_close(local, torch.cat([new_gate[rows_of], new_up[rows_of]]), rtol=1e-12, atol=1e-12)
        p = row_parallel_placement("down_proj", hidden, shard, tp_rank, tp_size)
        local_down = down[:, rows_of].clone()
        local_down[p.param_rows] -= f_down[p.factor_rows] @ a_mid[:, p.projection_cols]
        torch.testing.assert_close(local_down, new_down[:, rows_of], rtol=1e-12, atol=1e-12)


def _assert_the_trainers_values(copy: torch.Tensor, trainer: torch.Tensor) -> None:
    """``copy`` holds ``trainer``'s bf16 values, but for an element whose fp32 product rounded
    differently in a block's matrix product than in the whole matrix's (a last bit, in about a third
    of the elements here): the same noise then gives another bf16 value for about one in 65,536 of
    those, by one ulp. Drawn as a matrix of its own, a block differs in about half its elements."""
    differ = copy != trainer
    assert differ.sum() <= 0.05 * differ.numel(), f"{int(differ.sum())} of {differ.numel()} elements differ"
    torch.testing.assert_close(copy.float(), trainer.float(), rtol=2**-6, atol=0)


@given(
    tp_size=st.sampled_from([2, 4]),
    rows=st.integers(1, 6),
    cols=st.integers(1, 6),
    chunk_rows=st.integers(1, 9),
    seed=st.integers(0, 2**20),
)
def test_tensor_parallel_blocks_follow_a_bf16_trainers_stochastic_rounding(tp_size, rows, cols, chunk_rows, seed):
    """Against a bf16 trainer (stochastic rounding), every tensor-parallel block of a column- or
    row-parallel layer, merged with ``merge_like_trainer_``, holds the trainer's merged values over
    several updates (see ``_assert_the_trainers_values``): each block takes its part of the noise the
    whole matrix draws, chunk by chunk. (Drawn as a matrix of its own, every rank but the first would
    drift from the trainer.)
    ``merge_low_rank_blocks_`` is checked directly, three blocks at once, at chunk sizes of a few rows too."""
    generator = torch.Generator().manual_seed(seed)
    d, k, rank = rows * tp_size, cols * tp_size, 3
    trainer = torch.randn(d, k, generator=generator).to(torch.bfloat16)
    column = [trainer[i * rows : (i + 1) * rows].clone() for i in range(tp_size)]
    row = [trainer[:, i * cols : (i + 1) * cols].clone() for i in range(tp_size)]
    for index in (1, 2, 3):
        projection = make_projection(seed + index, rank, k, "rademacher")
        factor = 1e-2 * torch.randn(d, rank, generator=generator)
        target = TargetUpdate("w", seed + index, k, factor, "stochastic", rounding_seed(seed + index, index, "w"))
        noise = torch.Generator().manual_seed(target.rounding_seed)
        merge_low_rank_(trainer, target.factor, projection, generator=noise)
        for tp_rank in range(tp_size):
            (placement,) = column_parallel_placements("w", ["w"], [d], [rows], [tp_rank], k).values()
            merge_like_trainer_(column[tp_rank], target, projection, None, placement.factor_rows)
            placement = row_parallel_placement("w", d, cols, tp_rank, tp_size)
            merge_like_trainer_(
                row[tp_rank], target, projection, None, placement.factor_rows, placement.projection_cols
            )
        _assert_the_trainers_values(torch.cat(column), trainer)
        _assert_the_trainers_values(torch.cat(row, dim=1), trainer)
    factor, projection = torch.randn(d, rank, generator=generator), make_projection(seed, rank, k, "rademacher")
    whole = trainer.clone()
    merge_low_rank_(
        whole, factor, projection, generator=torch.Generator().manual_seed(seed), chunk_bytes=4 * k * chunk_rows
    )
    # Several blocks of one matrix in one pass (a rank's experts): each takes its part of the noise.
    bounds = [sorted(torch.randint(0, d + 1, (2,), generator=generator).tolist()) for _ in range(3)]
    spans = [
        (slice(first, max(last, first + 1)), slice(cols * i, cols * (i + 1))) for i, (first, last) in enumerate(bounds)
    ]
    # An fp32 copy holds the same bf16 values.
    dtypes = (torch.bfloat16, torch.float32, torch.bfloat16)
    blocks = [(trainer[r, c].to(dtype), r, c) for (r, c), dtype in zip(spans, dtypes)]
    noise = torch.Generator().manual_seed(seed)
    merge_low_rank_blocks_(blocks, factor, projection, generator=noise, chunk_bytes=4 * k * chunk_rows)
    for (block, rows_of, cols_of), dtype in zip(blocks, dtypes):
        assert block.dtype == dtype
        _assert_the_trainers_values(block.to(torch.bfloat16), whole[rows_of, cols_of])


@given(tp_size=st.sampled_from([1, 2, 4]), rows=st.integers(1, 4), cols=st.integers(1, 4), seed=st.integers(0, 999))
def test_the_block_a_rank_checksums_of_a_whole_shadow_is_its_share(tp_size, rows, cols, seed):
    """In reload mode each rank's shadow holds the whole HF matrix, and the drift check compares the
    rank's block of it (``Placement.block_of``) with the trainer's rows from ``factor_rows.start``:
    column-parallel blocks are row ranges of ``W p``, row-parallel ones partial sums that add up to
    it over the ranks, each as long as the rows the rank serves."""
    d, k = rows * tp_size, cols * tp_size
    matrix = torch.randn(d, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    probe = checksum_probe(seed, k)
    whole = weight_checksum(matrix, probe)
    partials = torch.zeros_like(whole)
    for tp_rank in range(tp_size):
        (column,) = column_parallel_placements("w", ["w"], [d], [rows], [tp_rank], k).values()
        sums = weight_checksum(column.block_of(matrix), probe[column.projection_cols])
        start = column.factor_rows.start
        assert sums.numel() == column.param_rows.stop - column.param_rows.start
        torch.testing.assert_close(sums, whole[start : start + sums.numel()], rtol=0, atol=0)
        row = row_parallel_placement("w", d, cols, tp_rank, tp_size)
        sums = weight_checksum(row.block_of(matrix), probe[row.projection_cols])
        assert sums.numel() == row.param_rows.stop - row.param_rows.start == d
        partials += sums
    torch.testing.assert_close(partials, whole, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------------
# Drift checksum


@given(d=st.integers(1, 40), k=st.integers(1, 40), seed=st.integers(0, 2**20))
def test_weight_checksum_is_the_float64_matrix_vector_product(d, k, seed):
    weight = torch.randn(d, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    probe = checksum_probe(seed, k)
    assert probe.dtype == torch.float64 and torch.equal(probe, checksum_probe(seed, k))
    torch.testing.assert_close(weight_checksum(weight, probe), weight.double() @ probe, rtol=0, atol=0)


def test_relative_drift_estimates_the_relative_weight_difference():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 256, generator=generator, dtype=torch.float64)
    noisy = weight + 1e-3 * torch.randn(512, 256, generator=generator, dtype=torch.float64)
    truth = float(torch.linalg.norm(noisy - weight) / torch.linalg.norm(weight))

    def drift(engine, seed):
        probe = checksum_probe(seed, 256)
        return relative_drift(weight_checksum(engine, probe), weight_checksum(weight, probe))

    estimates = [drift(noisy, seed) for seed in range(8)]
    assert all(0.7 * truth < e < 1.3 * truth for e in estimates), (truth, estimates)
    assert drift(weight, 0) == 0
    assert 1e-4 < drift(weight.to(torch.bfloat16), 1) < 1e-2
    # An all-zero trainer weight: any engine difference is infinitely far off, none is no drift.
    zero = torch.zeros(3, dtype=torch.float64)
    assert relative_drift(torch.tensor([0.0, 1e-9, 0.0]), zero) == math.inf
    assert relative_drift(zero.clone(), zero) == 0.0


@given(
    d=st.integers(1, 30),
    k=st.integers(1, 30),
    step=st.floats(1e-6, 1e-1),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    seed=st.integers(0, 2**20),
)
def test_sparse_delta_is_exactly_what_changed_in_the_engine_dtype(d, k, step, dtype, seed):
    """Writing the delta's values at its indices into what was sent gives the current weights
    bit for bit, and it names no entry that did not change."""
    generator = torch.Generator().manual_seed(seed)
    master = torch.randn(d, k, generator=generator, dtype=torch.float64)
    sent = master.to(dtype)
    current = (master + step * torch.randn(d, k, generator=generator, dtype=torch.float64)).to(dtype)
    indices, values = sparse_delta(sent, current)
    assert indices.dtype == torch.int32 and values.dtype == dtype
    rebuilt = sent.clone()
    rebuilt.view(-1)[indices.long()] = values
    assert torch.equal(rebuilt, current)
    assert int((current != sent).sum()) == indices.numel()
    assert torch.equal(indices, torch.unique(indices))  # each once, in order


def test_sparse_delta_refuses_mismatched_tensors():
    with pytest.raises(ValueError, match="sent torch.bfloat16"):
        sparse_delta(torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"\(3, 2\)"):
        sparse_delta(torch.zeros(2, 3), torch.zeros(3, 2))
