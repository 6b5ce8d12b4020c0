"""Where a checkpoint matrix lives on one vLLM engine rank: pure geometry, no vLLM needed.

LoGRA updates a Hugging Face matrix ``W`` (``out_features × in_features``) by ``W ← W − F A``. An
engine rank does not hold ``W`` as such: vLLM stacks ``q/k/v_proj`` into one ``qkv_proj`` and
``gate/up_proj`` into one ``gate_up_proj``, and tensor parallelism gives each rank a slice. A
column-parallel layer holds a block of ``W``'s rows (so the rank needs its rows of ``F``); a
row-parallel one (``o_proj``, ``down_proj``) holds a block of its columns (its columns of ``A``).
A :class:`Placement` records which block, so the engine can apply its share of an update without
ever forming ``F A`` for the whole matrix. These functions take plain sizes, so the geometry can be
checked against a dense reference without starting an engine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Where the HF matrix ``name`` (``out_features × in_features``) lives on one engine rank.

    ``W_local[param_rows, :] ↔ W[factor_rows, projection_cols]``: the rank's update is
    ``W_local[param_rows] −= F[factor_rows] · A[:, projection_cols]``.
    """

    module: str
    out_features: int
    in_features: int
    factor_rows: slice
    param_rows: slice
    projection_cols: slice
    whole_only: bool = False  # see checkpoint_fused_placement

    def block_of(self, matrix):
        """This rank's block ``W[factor_rows, projection_cols]`` of the whole HF matrix ``matrix``
        (a reload-mode shadow): what ``W_local[param_rows]`` holds."""
        return matrix[self.factor_rows, self.projection_cols]


def checkpoint_fused_placement(module: str, out_features: int, in_features: int) -> Placement:
    """A matrix the checkpoint already stores fused (Phi-3's ``qkv_proj`` / ``gate_up_proj``,
    Falcon's ``query_key_value``) while the engine splits it into blocks of its own: which of its
    rows land where depends on the model's loader (Falcon's permutes them per head), so the engine
    cannot place a factor's rows. Such a matrix is only ever loaded whole."""
    empty = slice(0, 0)
    return Placement(module, out_features, in_features, empty, empty, empty, whole_only=True)


def column_parallel_placements(
    module: str,
    members: list[str],
    out_features: list[int],
    local_sizes: list[int],
    shard_ranks: list[int],
    in_features: int,
) -> dict[str, Placement]:
    """Placements of the members of a (fused) column-parallel layer on one rank.

    Member ``i`` is an ``out_features[i] × in_features`` HF matrix. The local parameter stacks the
    members' local row blocks in order; member ``i`` holds rows
    ``[shard_ranks[i]·local_sizes[i], (shard_ranks[i]+1)·local_sizes[i])`` of its HF matrix. vLLM
    uses ``shard_rank = tp_rank`` except for the k/v blocks of ``qkv_proj`` when KV heads are
    replicated (``tp_rank // replicas``).
    """
    placements, offset = {}, 0
    for member, rows, size, shard in zip(members, out_features, local_sizes, shard_ranks):
        placements[member] = Placement(
            module=module,
            out_features=rows,
            in_features=in_features,
            factor_rows=slice(shard * size, (shard + 1) * size),
            param_rows=slice(offset, offset + size),
            projection_cols=slice(0, in_features),
        )
        offset += size
    return placements


def row_parallel_placement(module: str, out_features: int, in_per_rank: int, tp_rank: int, tp_size: int) -> Placement:
    """A row-parallel layer (input dim split): all rows, this rank's columns of ``A``."""
    return Placement(
        module=module,
        out_features=out_features,
        in_features=in_per_rank * tp_size,
        factor_rows=slice(0, out_features),
        param_rows=slice(0, out_features),
        projection_cols=slice(tp_rank * in_per_rank, (tp_rank + 1) * in_per_rank),
    )


# --------------------------------------------------------------------------------------------------
# Mixture-of-experts: vLLM's fused experts layers


@dataclass(frozen=True)
class ExpertBlock:
    """One block of a stacked experts parameter: ``param[expert][param_rows, param_cols] ↔
    W[factor_rows, projection_cols]`` of the trainer's ``E·d × k`` matrix (experts stacked by rows)."""

    expert: int  # the engine's local index of the expert
    factor_rows: slice
    param_rows: slice
    param_cols: slice
    projection_cols: slice


@dataclass(frozen=True)
class ExpertsPlacement:
    """Where a Hugging Face stacked experts weight (``E × d × k``, e.g. ``…experts.gate_up_proj``)
    lives on one engine rank: in ``parameter`` (``w13_weight`` / ``w2_weight``) of ``module``, as
    ``blocks``. The trainer treats the weight as the ``E·d × k`` matrix of its row-major layout, so
    the rank's update is, per block, ``param[e][rows, cols] −= F[factor_rows] · A[:, projection_cols]``.
    """

    module: str
    parameter: str
    experts: int
    out_features: int  # E·d
    in_features: int  # k
    blocks: tuple[ExpertBlock, ...]
    whole_only: bool = False


def _tp_share(size: int, tp_rank: int, tp_size: int) -> slice:
    """The checkpoint rows/columns a rank loads along a sharded dimension, as vLLM's experts loader
    takes them: ``size // tp_size`` per rank from ``tp_rank·(size // tp_size)``, cut at ``size``."""
    per_rank = size // tp_size
    start = min(per_rank * tp_rank, size)
    return slice(start, min(start + per_rank, size))


def gate_up_placement(
    module: str,
    experts: dict[int, int],
    num_experts: int,
    intermediate: int,
    hidden: int,
    local_intermediate: int,
    tp_rank: int,
    tp_size: int,
) -> ExpertsPlacement:
    """``gate_up_proj`` (``E × 2I × H``: gate rows, then up rows) on a rank's ``w13_weight``
    (``E_local × 2·I_local × H_padded``: its gate block, then its up block, each ``I_local`` rows,
    zero padding after the loaded rows and columns). ``experts`` maps global to local expert
    indices (all of them without expert parallelism); ``local_intermediate`` is ``w13``'s rows / 2."""
    share = _tp_share(intermediate, tp_rank, tp_size)
    loaded = share.stop - share.start
    blocks = []
    for expert, local in sorted(experts.items()):
        for half in (0, 1):  # gate, up
            first = expert * 2 * intermediate + half * intermediate + share.start
            blocks.append(
                ExpertBlock(
                    expert=local,
                    factor_rows=slice(first, first + loaded),
                    param_rows=slice(half * local_intermediate, half * local_intermediate + loaded),
                    param_cols=slice(0, hidden),
                    projection_cols=slice(0, hidden),
                )
            )
    return ExpertsPlacement(module, "w13_weight", num_experts, num_experts * 2 * intermediate, hidden, tuple(blocks))


def down_placement(
    module: str, experts: dict[int, int], num_experts: int, intermediate: int, hidden: int, tp_rank: int, tp_size: int
) -> ExpertsPlacement:
    """``down_proj`` (``E × H × I``) on a rank's ``w2_weight`` (``E_local × H_padded × I_local``):
    row-parallel, so each rank holds all rows and its share of the columns (of ``A``)."""
    share = _tp_share(intermediate, tp_rank, tp_size)
    blocks = tuple(
        ExpertBlock(
            expert=local,
            factor_rows=slice(expert * hidden, (expert + 1) * hidden),
            param_rows=slice(0, hidden),
            param_cols=slice(0, share.stop - share.start),
            projection_cols=share,
        )
        for expert, local in sorted(experts.items())
    )
    return ExpertsPlacement(module, "w2_weight", num_experts, num_experts * hidden, intermediate, blocks)
