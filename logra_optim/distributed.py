"""Data parallelism for LoGRA (docs/method.md §5): reductions, sharded weight layouts, consistency guard.

Every data-parallel rank accumulates sketches of its own microbatches. ``step()`` averages them with
one all-reduce of the flat sketch buffer (per device), so every rank computes the same direction
``U``, the same ``η`` and the same ``α``; each rank then merges ``W ← W − α η U A`` into the part of
each weight it stores:

* replicated weights (DDP, DeepSpeed ZeRO-1/2, no wrapper): the whole matrix, on every rank;
* FSDP2 (``fully_shard``: a ``DTensor`` with ``Shard(0)``, uneven shards included): its local rows;
* DeepSpeed ZeRO-3: its flat partition ``ds_tensor`` of the row-major weight.

Scalars that need every rank (partial ``‖W_i‖²`` of each sharded weight, a non-finite flag, the
projection fingerprint; then the probe's KL sums and token counts) travel in small batched
collectives. Nothing here imports DeepSpeed: ZeRO-3 parameters are recognised by their ``ds_*``
attributes. torch is the only dependency.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from .updates import MERGE_CHUNK_BYTES, all_finite, merge_low_rank_, merge_transposed_experts_, stochastic_round_to_bf16

REPLICATED, ROWS, FLAT = "replicated", "rows", "flat"


def data_parallel_group(group=None):
    """The process group sketches are averaged over, or ``None`` for a single process.

    ``group`` defaults to the default (world) group when ``torch.distributed`` is initialised with
    more than one rank.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process_group was given but torch.distributed is not initialised")
        return None
    group = dist.group.WORLD if group is None else group
    return group if dist.get_world_size(group) > 1 else None


# --------------------------------------------------------------------------------------------------
# Where a rank's part of a weight lives


@dataclass(frozen=True)
class WeightLayout:
    """The part of a ``d×k`` target weight this rank stores.

    Stacked expert weights (``[E, d, k]``) are the matrix ``E·d × k`` of their row-major layout, so
    that a shard over experts (FSDP2 ``Shard(0)``) is a block of rows and a ZeRO-3 partition a range
    of elements, as for any other target. Experts stored ``transposed`` (``[E, k, d]``, GPT-OSS: expert
    ``e``'s matrix is ``weight[e]ᵀ``) are the same ``E·d × k`` matrix, whose rows are columns of the
    storage: a shard over experts is still a block of whole experts' rows, merged expert by expert.

    ``kind``: ``"replicated"`` (all of it), ``"rows"`` (rows ``[start, stop)``, FSDP2) or ``"flat"``
    (elements ``[start, stop)`` of the row-major flattening, DeepSpeed ZeRO-3). ``holders`` is how many
    ranks store the same elements, so that partial sums of squares divided by it add up to ‖W‖² over
    the world; 0 for a plain (replicated) tensor, whose norm every rank computes whole instead.
    """

    kind: str
    shape: tuple[int, int]
    start: int = 0
    stop: int = 0
    holders: int = 1
    transposed: bool = False


def is_zero3_param(weight: torch.Tensor) -> bool:
    return hasattr(weight, "ds_tensor") and hasattr(weight, "ds_shape")


def is_dtensor(weight: torch.Tensor) -> bool:
    return hasattr(weight, "placements") and hasattr(weight, "device_mesh") and hasattr(weight, "to_local")


def global_shape(weight: torch.Tensor) -> tuple[int, ...]:
    """The logical shape of a possibly sharded weight (a ZeRO-3 parameter's own ``shape`` is empty)."""
    if is_zero3_param(weight):
        return tuple(weight.ds_shape)
    return tuple(weight.shape)


def dtensor_rows(shape: Sequence[int], mesh, placements) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a ``shape`` tensor that this rank holds under ``placements``
    (``Shard(0)`` and ``Replicate`` only; uneven splits follow torch's chunking)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(tuple(shape), mesh, placements)
    return offset[0], offset[0] + local_shape[0]


def weight_layout(name: str, weight: torch.Tensor, transposed: bool = False) -> WeightLayout:
    """How this rank stores target ``name`` (``transposed``: stacked experts stored ``[E, k, d]``);
    raises for placements LoGRA cannot merge into."""
    stacked = global_shape(weight)
    if len(stacked) not in (2, 3):
        raise ValueError(f"target {name!r}: weight of shape {stacked} is neither a matrix nor stacked matrices")
    shape = matrix_shape(stacked, transposed)
    if is_zero3_param(weight):
        if transposed:
            raise ValueError(
                f"target {name!r}: experts stored transposed ([E, in, out], e.g. GPT-OSS) under DeepSpeed ZeRO-3, "
                "whose flat partition of that storage is no range of the experts' rows; LoGRA merges into such "
                "experts replicated (DDP; ZeRO-1/2, untested) or sharded over experts (FSDP2). Use one of those, or "
                "patch_model(model, experts=False)"
            )
        partition = weight.ds_tensor.ds_numel
        group = getattr(weight, "ds_process_group", None)
        rank = getattr(weight, "ds_zero_partition_rank", None)
        if rank is None:
            rank = dist.get_rank(group) if dist.is_initialized() else 0
        start = min(rank * partition, shape[0] * shape[1])
        stop = min(start + partition, shape[0] * shape[1])
        # Partitioned over ds_process_group; replicated across such groups (e.g. MiCS) otherwise.
        holders = 1
        if dist.is_initialized() and group is not None:
            holders = max(1, dist.get_world_size() // dist.get_world_size(group))
        return WeightLayout(FLAT, shape, start, stop, holders)
    if is_dtensor(weight):
        placements = tuple(weight.placements)
        holders = 1
        for size, placement in zip(weight.device_mesh.shape, placements):
            if placement.is_replicate():
                holders *= size
            elif not placement.is_shard(0):
                raise ValueError(
                    f"target {name!r} is a DTensor with placement {placement} (placements {placements}); LoGRA "
                    "merges only into row shards (Shard(0), as fully_shard makes) or replicated weights. Tensor "
                    "parallel (Shard(1)) and Partial placements are not supported"
                )
        if all(p.is_replicate() for p in placements):
            return WeightLayout(REPLICATED, shape, 0, shape[0], holders, transposed)
        start, stop = dtensor_rows(stacked, weight.device_mesh, placements)
        rows_per_slice = shape[0] // stacked[0]  # d for stacked experts (a shard holds whole experts), else 1
        return WeightLayout(ROWS, shape, start * rows_per_slice, stop * rows_per_slice, holders, transposed)
    return WeightLayout(REPLICATED, shape, 0, shape[0], 0, transposed)  # holders 0: not part of any partial sum


def matrix_shape(shape: Sequence[int], transposed: bool = False) -> tuple[int, int]:
    """The ``(rows, k)`` matrix a weight is merged as: itself, or ``E·d × k`` for ``[E, d, k]`` experts
    (``[E, k, d]`` when stored ``transposed``)."""
    if len(shape) == 2:
        return (shape[0], shape[1])
    experts, d, k = (shape[0], shape[2], shape[1]) if transposed else shape
    return (experts * d, k)


def local_data(weight: torch.Tensor, layout: WeightLayout) -> torch.Tensor:
    """The tensor a merge writes into: the whole matrix, the local rows (``d_local×k``) or the valid
    part of the flat partition (1-D). Stacked experts are viewed as rows (``E_local·d × k``), except
    transposed ones, whose rows are no view of their storage: those come as stored (``E_local×k×d``)."""
    if layout.kind == FLAT:
        return weight.ds_tensor.data.view(-1)[: layout.stop - layout.start]
    data = weight.to_local().data if is_dtensor(weight) else weight.data
    if layout.transposed:
        return data
    return data.flatten(0, 1) if data.dim() == 3 else data  # flatten: also a rank holding no expert


def local_sq_norm(weight: torch.Tensor, layout: WeightLayout) -> torch.Tensor:
    """``Σ w²`` over the elements this rank stores, float64 (a 0-d tensor on the weight's device);
    accumulated in fp32, or in fp64 for fp64 weights.

    fp32 and fp64 weights take a dot product of the elements with themselves: a BLAS reduction
    that reads them once, 2-3× faster on CPU than ``vector_norm`` and, in fp32, closer to the exact
    sum (relative error 1e-5 against 1e-4 on 2816×1024, 5e-4 against 4e-3 on 4096×8192).
    Other dtypes have no such dot product with an fp32 result and take ``vector_norm``."""
    data = local_data(weight, layout)
    if data.dtype in (torch.float32, torch.float64) and data.is_contiguous():
        flat = data.reshape(-1)
        return torch.dot(flat, flat).double()
    accumulate = torch.float64 if data.dtype == torch.float64 else torch.float32
    return torch.linalg.vector_norm(data, dtype=accumulate).double().square()


def check_no_fsdp1(model: nn.Module) -> None:
    """FSDP1 (``FullyShardedDataParallel``) flattens parameters into ``FlatParameter`` shards that no
    longer line up with a target's rows; LoGRA supports FSDP2 (``fully_shard``) instead."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return
    for name, module in model.named_modules():
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError(
                f"module {name or '<root>'!r} is wrapped in FSDP1 (FullyShardedDataParallel), whose flattened "
                "parameter shards LoGRA cannot merge into. Use FSDP2 instead: "
                "torch.distributed.fsdp.fully_shard(layer) for each decoder layer, then fully_shard(model) "
                "(accelerate: fsdp_version: 2)"
            )


def fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` was applied to (empty without FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return []
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def reshard(modules: Sequence[nn.Module]) -> None:
    """Free the unsharded parameters FSDP2 keeps after a forward outside backward (the root keeps
    them by default). A merge writes into the shards; a stale unsharded copy would be reused by the
    next forward."""
    for module in modules:
        module.reshard()


# --------------------------------------------------------------------------------------------------
# Merging into a rank's part of a weight


def merge_flat_partition_(
    flat: torch.Tensor,
    start: int,
    factor: torch.Tensor,
    projection: torch.Tensor,
    *,
    stochastic_rounding: bool = True,
    generator: torch.Generator | None = None,
    chunk_bytes: int = MERGE_CHUNK_BYTES,
) -> torch.Tensor:
    """``W ← W − F A`` restricted to elements ``[start, start + len(flat))`` of the row-major ``W``
    (``d×k`` with ``F`` d×r and ``A`` r×k), in place on ``flat`` (a ZeRO-3 partition).

    Only the rows the partition touches are formed, a chunk of rows at a time through an fp32
    temporary of at most ``chunk_bytes``.
    """
    if flat.dim() != 1 or factor.dim() != 2 or projection.dim() != 2 or factor.shape[1] != projection.shape[0]:
        raise ValueError(
            f"merge shapes do not line up: flat {tuple(flat.shape)}, factor {tuple(factor.shape)}, "
            f"projection {tuple(projection.shape)}"
        )
    k = projection.shape[1]
    stop = start + flat.numel()
    if start < 0 or stop > factor.shape[0] * k:
        raise ValueError(f"partition [{start}, {stop}) lies outside the {factor.shape[0]}×{k} weight")
    if flat.numel() == 0:
        return flat
    compute = torch.float64 if flat.dtype == torch.float64 else torch.float32
    projection = projection.to(compute)
    rows_per_chunk = max(1, chunk_bytes // (projection.element_size() * k))
    first_row, end_row = start // k, (stop - 1) // k + 1
    for row in range(first_row, end_row, rows_per_chunk):
        rows = slice(row, min(row + rows_per_chunk, end_row))
        lo, hi = max(start, rows.start * k), min(stop, rows.stop * k)  # elements of W in this chunk
        delta = (factor[rows].to(compute) @ projection).view(-1)[lo - rows.start * k : hi - rows.start * k]
        segment = flat[lo - start : hi - start]
        if flat.dtype == compute:
            segment.sub_(delta)
            continue
        updated = segment.float() - delta
        if stochastic_rounding and flat.dtype == torch.bfloat16:
            segment.copy_(stochastic_round_to_bf16(updated, generator))
        else:
            segment.copy_(updated.to(flat.dtype))
    return flat


class LocalWeight:
    """A target weight as this rank stores it: what a merge writes into, and how to undo a merge.

    Every rank computes the same update ``F A``; only where it lands differs. This type hides the
    difference: the whole matrix (replicated), the local rows (FSDP2) or a flat partition
    (ZeRO-3), which DeepSpeed may also hold gathered whole (persistent small parameters, or ones
    its prefetcher keeps between forwards). A merge then updates the gathered copy too, so that the
    next forward uses it without gathering again.
    """

    def __init__(self, weight: torch.Tensor, layout: WeightLayout):
        self.weight, self.layout = weight, layout
        # The factor of the latest merge, kept when asked (merge hooks) and for ZeRO-3 (see restore).
        self.last_factor: torch.Tensor | None = None

    @property
    def sharded(self) -> bool:
        """Whether other ranks store other parts of the weight (its ‖W‖² is a sum over ranks)."""
        return self.layout.holders > 0

    def local(self) -> torch.Tensor:
        return local_data(self.weight, self.layout)

    def gathered(self) -> torch.Tensor | None:
        """A ZeRO-3 weight's whole ``d×k`` matrix while DeepSpeed holds it gathered, else ``None``."""
        d, k = self.layout.shape
        if self.layout.kind == FLAT and self.weight.data.numel() == d * k:
            return self.weight.data.view(d, k)
        return None

    def sq_norm(self) -> torch.Tensor:
        """``Σ w²`` of the stored elements, float64, divided among the ranks holding the same ones."""
        local = local_sq_norm(self.weight, self.layout)
        return local / self.layout.holders if self.sharded else local

    def merge_(self, factor: torch.Tensor, projection: torch.Tensor, keep: bool = False, **rounding) -> None:
        """``W ← W − F A`` on the stored part (``rounding``: :func:`~.updates.merge_low_rank_` options);
        ``keep``: remember ``F`` as :attr:`last_factor` until :meth:`forget_merge`."""
        layout, local, gathered = self.layout, self.local(), self.gathered()
        if keep or layout.kind == FLAT:
            self.last_factor = factor
        if gathered is not None:  # the partition is a slice of the gathered matrix
            merge_low_rank_(gathered, factor, projection, **rounding)
            local.copy_(gathered.view(-1)[layout.start : layout.stop])
        elif layout.kind == FLAT:
            merge_flat_partition_(local, layout.start, factor, projection, **rounding)
        elif layout.transposed:  # the whole stack or a shard of whole experts, as stored
            merge_transposed_experts_(local, factor[layout.start : layout.stop], projection, **rounding)
        elif layout.kind == ROWS:
            merge_low_rank_(local, factor[layout.start : layout.stop], projection, **rounding)
        else:
            merge_low_rank_(local, factor, projection, **rounding)

    def backup(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Host copies of the stored part (and of a gathered copy), for :meth:`restore`."""
        gathered = self.gathered()
        return self.local().to("cpu", copy=True), None if gathered is None else gathered.to("cpu", copy=True)

    def restore(self, backup: tuple[torch.Tensor, torch.Tensor | None], projection: torch.Tensor) -> None:
        """Undo every merge since ``backup`` exactly."""
        local_backup, gathered_backup = backup
        self.local().copy_(local_backup)
        gathered = self.gathered()
        if gathered is None:
            return
        if gathered_backup is not None:
            gathered.copy_(gathered_backup)
        else:  # gathered by DeepSpeed since the backup, from the merged partitions: undo the merge
            merge_low_rank_(gathered, -self.last_factor, projection, stochastic_rounding=False)
            gathered.view(-1)[self.layout.start : self.layout.stop] = local_backup  # this rank's part exactly

    def forget_merge(self) -> None:
        self.last_factor = None


# --------------------------------------------------------------------------------------------------
# Collectives


def average_(buffers: Sequence[torch.Tensor], group) -> None:
    """Average each buffer over ``group`` in place: one all-reduce per buffer (gloo has no AVG)."""
    world = dist.get_world_size(group)
    for buffer in buffers:
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group)
        buffer.div_(world)


def sum_(values: Sequence[float | torch.Tensor], group, device=None) -> list[float]:
    """Sum a few scalars over ``group`` with one all-reduce (float64)."""
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor.tolist()


def gather_(values: Sequence[float], group, device=None) -> torch.Tensor:
    """All-gather a few float64 scalars from every rank: a ``(world, len(values))`` tensor."""
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor, group=group)
    return torch.stack(gathered).cpu()


def collective_device(group) -> torch.device:
    """Where this group's collectives take their tensors (NCCL: the current CUDA device)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class DataParallel:
    """The data-parallel ranks that one optimizer keeps in step.

    Every collective an update needs goes through here: averaging the sketches, the scalars of a
    step gathered at once (a non-finite flag, each sharded weight's ``‖W_i‖²``, the projection
    fingerprint), and the sums of the probe's KL terms.
    """

    def __init__(self, group):
        self.group = group
        self.device = collective_device(group)

    def sum(self, *values: float | torch.Tensor) -> list[float]:
        return sum_(values, self.group, self.device)

    def synchronise(
        self,
        buffers: Sequence[torch.Tensor],
        fingerprint_of: ProjectionFingerprint,
        sharded_sq: Sequence[float],
        finite: bool,
        sixteen_bit: bool = False,
    ) -> tuple[bool, list[float], bool]:
        """Average ``buffers`` over the ranks, then one all-gather of ``[fingerprint, non-finite flag,
        16-bit flag, *sharded ‖W_i‖²]``: returns (the averaged buffers and every rank's ``finite``
        are finite, each sharded weight's ``‖W_i‖²``, a 16-bit product on some rank: every rank then
        takes the same floor). ``finite``: this rank's other inputs (non-target gradients).

        The buffers are checked after the average: one rank's NaN or inf reaches every rank's
        average, and so does a sum that overflows. The flag goes through the all-gather all the same,
        so that the ranks skip together whatever their checks saw."""
        average_(buffers, self.group)
        finite = finite and all_finite(buffers)
        values = [fingerprint_of.value(), 0.0 if finite else 1.0, 1.0 if sixteen_bit else 0.0, *sharded_sq]
        gathered = gather_(values, self.group, self.device)
        self.check(fingerprint_of, gathered[:, 0])
        return bool(gathered[:, 1].sum() == 0), gathered[:, 3:].sum(0).tolist(), bool(gathered[:, 2].sum() > 0)

    def check(self, fingerprint_of: ProjectionFingerprint, gathered: torch.Tensor | None = None) -> None:
        """Fail loudly on every rank if the ranks' projections differ (seeds, update index, targets)."""
        if gathered is None:
            gathered = gather_([fingerprint_of.value()], self.group, self.device)[:, 0]
        check_fingerprints(
            gathered, self.group, fingerprint_of.names, fingerprint_of.header, fingerprint_of.projections
        )


@dataclass(frozen=True)
class ProjectionFingerprint:
    """What determines every target's projection: the settings (with the generator's name) and
    each target's :func:`projection_identity`."""

    header: tuple
    names: tuple[str, ...]
    projections: tuple[tuple, ...]

    def value(self) -> int:
        return fingerprint(self.header, self.projections)


# --------------------------------------------------------------------------------------------------
# Consistency guard


def projection_identity(spec) -> tuple:
    """What a rank compares of one target's ``A``: its :class:`~logra_optim.projection.ProjectionSpec`
    as a tuple. ``A`` is a pure function of it and of the generator (named in the header), so equal
    identities mean equal matrices, and checking costs no generation (it runs at every step)."""
    return (spec.seed, spec.rank, spec.in_features, spec.kind)


def fingerprint(header: Sequence, projections: Sequence[tuple]) -> int:
    """A 52-bit hash (exact in float64) of the settings that determine the projections and of
    every target's projection identity."""
    key = repr((tuple(header), tuple(projections))).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 12


def check_fingerprints(
    fingerprints: torch.Tensor, group, names: Sequence[str], header: Sequence, projections: Sequence[tuple]
) -> None:
    """Raise on every rank if the gathered fingerprints differ, naming the ranks and the first target
    whose projection differs (one more collective, on the error path only)."""
    values = [int(v) for v in fingerprints.tolist()]
    if len(set(values)) == 1:
        return
    mine = (tuple(header), list(names), list(projections))
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    differing = [rank for rank, entry in enumerate(everyone) if entry != reference]
    detail = ""
    for rank in differing:
        other = everyone[rank]
        if other[0] != reference[0]:
            detail = (
                "settings (seed, projection index, update index, rank, expert rank, kind, refresh, refresh_every, "
                "shared, targets, generator) "
                f"{reference[0]} on rank 0 vs {other[0]} on rank {rank}"
            )
            break
        if other[1] != reference[1]:
            detail = f"targets differ: rank 0 has {len(reference[1])}, rank {rank} has {len(other[1])}"
            break
        for name, ours, theirs in zip(reference[1], reference[2], other[2]):
            if ours != theirs:
                detail = f"projection of target {name!r} differs between rank 0 and rank {rank}"
                break
        if detail:
            break
    raise RuntimeError(
        f"LoGRA: data-parallel ranks {[0, *differing]} disagree on the projections ({detail}); every rank must use "
        "the same seed, projection settings, targets and update index (restore the same checkpoint on every rank)"
    )
