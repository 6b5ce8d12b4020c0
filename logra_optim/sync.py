"""The sync payload: what a rollout engine needs to follow LoGRA's updates without full weights.

docs/method.md §4. A LoGRA update of a target is ``W ← W − F A`` with ``F = α η U`` (d×r) and ``A``
(r×k) regenerated from a seed. A rollout engine holding its own copy of ``W`` needs only ``F`` and
the seed: ``d·r`` numbers instead of ``d·k``, i.e. ``r/k`` of a full sync. The trainer merges the
very factor it sends (``LoGRAOptimizer(wire_dtype=torch.bfloat16)`` rounds ``F`` before merging), so
both sides apply the same update; the remaining difference is the arithmetic of the two merges and
the engine's storage dtype, which :func:`weight_checksum` lets a caller measure.

Format, version 3 (``PAYLOAD_VERSION``). :meth:`SyncPayload.encode` writes a plain dict with
``torch.save``; only tensors, numbers and strings, so ``torch.load(weights_only=True)`` reads it::

    {
      "format": "logra-sync", "version": 3,
      "rank": r, "expert_rank": r_e,     # factor columns of linear / of stacked experts weights
      "projection": "rademacher" | "gaussian",
      "updates": [                       # consecutive update indices, oldest first
        {"index": u,                     # the optimizer's update counter after this update (1-based)
         "targets": [
           {"name": "model.layers.0.self_attn.q_proj.weight",  # the HF parameter name
            "seed": s,                   # projection seed of this target for this update (63-bit)
            "in_features": k,
            "factor": F,                 # d×r (E·d × r_e for E stacked experts, by expert), the wire
                                         # dtype (bf16 by default), contiguous
            "rounding": "exact" | "stochastic" | "nearest"},  # how the trainer's copy absorbed it

           ...]},
        ...]
    }

``A = make_projection(seed, r, in_features, projection)``: bit-identical on every machine (see
:mod:`.projection`), so the seed is all the engine needs to rebuild it.

``rounding`` says how the trainer's own copy of the weight absorbed the update, so that an engine
holding 16-bit weights can follow it (:func:`merge_like_trainer_`): ``"exact"`` (fp32 master
weights: the engine keeps a compensation buffer so that nothing is rounded away), ``"stochastic"``
(bf16 weights rounded stochastically with the seed :func:`rounding_seed`: the engine draws the
same noise) or ``"nearest"``. Older versions are refused (1 had no ``rounding``, 2 no
``expert_rank``).

A stacked mixture-of-experts weight (``[E, d, k]``, e.g. ``…experts.gate_up_proj``) is one target:
the ``E·d × k`` matrix of its row-major layout, as the optimizer treats it, so ``F`` stacks the
experts' factors by rows and all of them share the target's ``A``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .projection import PROJECTIONS, make_projection
from .updates import merge_low_rank_, merge_low_rank_compensated_

PAYLOAD_FORMAT = "logra-sync"
PAYLOAD_VERSION = 3
ROUNDINGS = ("exact", "stochastic", "nearest")
_MAX_SEED = 2**63


class PayloadError(ValueError):
    """A sync payload that is malformed or does not fit the weights it is applied to."""


@dataclass(frozen=True)
class TargetUpdate:
    """One target's share of one update: ``W[name] ← W[name] − factor · A(seed)``."""

    name: str
    seed: int
    in_features: int
    factor: torch.Tensor
    rounding: str = "exact"

    @property
    def out_features(self) -> int:
        return self.factor.shape[0]

    @property
    def rank(self) -> int:
        return self.factor.shape[1]


@dataclass(frozen=True)
class Update:
    """Everything one optimizer step changed; ``index`` is the update counter after it (1-based)."""

    index: int
    targets: tuple[TargetUpdate, ...]


@dataclass(frozen=True)
class SyncPayload:
    """Consecutive updates for an engine whose weights are at update ``updates[0].index − 1``."""

    rank: int
    projection: str
    updates: tuple[Update, ...]
    expert_rank: int | None = None  # the rank of stacked experts weights (default: ``rank``)

    def __post_init__(self) -> None:
        if self.expert_rank is None:
            object.__setattr__(self, "expert_rank", self.rank)
        _validate(self)

    @property
    def first_index(self) -> int:
        return self.updates[0].index

    @property
    def last_index(self) -> int:
        return self.updates[-1].index

    @property
    def factor_bytes(self) -> int:
        """Bytes of the factors alone (the encoded payload adds a little metadata)."""
        return factor_bytes(self.updates)

    def to_dict(self) -> dict:
        return {
            "format": PAYLOAD_FORMAT,
            "version": PAYLOAD_VERSION,
            "rank": self.rank,
            "expert_rank": self.expert_rank,
            "projection": self.projection,
            "updates": [
                {
                    "index": u.index,
                    "targets": [
                        {
                            "name": t.name,
                            "seed": t.seed,
                            "in_features": t.in_features,
                            "factor": t.factor,
                            "rounding": t.rounding,
                        }
                        for t in u.targets
                    ],
                }
                for u in self.updates
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> SyncPayload:
        if not isinstance(data, dict) or data.get("format") != PAYLOAD_FORMAT:
            raise PayloadError(f"not a LoGRA sync payload: expected format {PAYLOAD_FORMAT!r}")
        if data.get("version") != PAYLOAD_VERSION:
            raise PayloadError(
                f"sync payload version {data.get('version')!r} is not supported: this side reads version "
                f"{PAYLOAD_VERSION}; update logra-optim on the trainer and the engine to the same release"
            )
        try:
            updates = tuple(
                Update(
                    int(u["index"]),
                    tuple(
                        TargetUpdate(
                            str(t["name"]), int(t["seed"]), int(t["in_features"]), t["factor"], str(t["rounding"])
                        )
                        for t in u["targets"]
                    ),
                )
                for u in data["updates"]
            )
            return cls(int(data["rank"]), str(data["projection"]), updates, int(data["expert_rank"]))
        except (KeyError, TypeError) as error:
            raise PayloadError(f"malformed sync payload: missing or mistyped field ({error})") from error

    def encode(self) -> bytes:
        return to_bytes(self.to_dict())

    @classmethod
    def decode(cls, data: bytes) -> SyncPayload:
        try:
            loaded = from_bytes(data)
        except Exception as error:  # torch raises several types for corrupt archives
            raise PayloadError(f"sync payload cannot be decoded: {error}") from error
        return cls.from_dict(loaded)


def to_bytes(obj) -> bytes:
    """``torch.save`` into bytes (tensors, numbers, strings and containers of them)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes):
    """The inverse of :func:`to_bytes`, safely: ``weights_only=True``, tensors on the CPU."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def factor_bytes(updates) -> int:
    """Bytes of the factors of these updates."""
    return sum(t.factor.numel() * t.factor.element_size() for u in updates for t in u.targets)


def _validate(payload: SyncPayload) -> None:
    """Everything that can be checked without the engine's weights."""
    for field in ("rank", "expert_rank"):
        value = getattr(payload, field)
        if not isinstance(value, int) or value <= 0:
            raise PayloadError(f"sync payload {field} must be a positive integer, got {value!r}")
    if payload.projection not in PROJECTIONS:
        raise PayloadError(f"sync payload projection must be one of {PROJECTIONS}, got {payload.projection!r}")
    if not payload.updates:
        raise PayloadError("sync payload has no updates")
    for previous, update in zip(payload.updates, payload.updates[1:]):
        if update.index != previous.index + 1:
            raise PayloadError(f"sync payload skips from update {previous.index} to {update.index}")
    for update in payload.updates:
        names = [t.name for t in update.targets]
        if len(set(names)) != len(names):
            raise PayloadError(f"update {update.index} names a target twice")
        for target in update.targets:
            factor = target.factor
            where = f"update {update.index}, target {target.name!r}"
            if not isinstance(factor, torch.Tensor) or not factor.is_floating_point() or factor.dim() != 2:
                raise PayloadError(f"{where}: factor must be a 2-D floating tensor")
            if factor.shape[1] not in (payload.rank, payload.expert_rank) or factor.shape[0] == 0:
                ranks = sorted({payload.rank, payload.expert_rank})
                raise PayloadError(f"{where}: factor has shape {tuple(factor.shape)}, expected (d, r), r in {ranks}")
            if target.in_features < factor.shape[1]:
                raise PayloadError(f"{where}: in_features {target.in_features} is below the rank {factor.shape[1]}")
            if not 0 <= target.seed < _MAX_SEED:
                raise PayloadError(f"{where}: seed {target.seed} is outside [0, 2**63)")
            if not bool(torch.isfinite(factor).all()):
                raise PayloadError(f"{where}: factor is not finite")
            if target.rounding not in ROUNDINGS:
                raise PayloadError(f"{where}: rounding must be one of {ROUNDINGS}, got {target.rounding!r}")


def projection_of(payload: SyncPayload, target: TargetUpdate, device=None) -> torch.Tensor:
    """``A`` (r×k, fp32) of one target update: the matrix the trainer merged with."""
    return make_projection(target.seed, target.rank, target.in_features, payload.projection, device=device)


def projections_of(payload: SyncPayload, device=None) -> Callable[[TargetUpdate], torch.Tensor]:
    """:func:`projection_of` that draws ``A`` once for consecutive targets with the same seed and
    width: siblings that share ``A`` on the trainer (``share_projections``: q/k/v, gate/up) carry one
    seed and come one after another in a payload. Only the latest ``A`` is kept, so memory stays at
    one projection whatever the payload's length."""
    latest: list = [None, None]  # (seed, width), A

    def projection(target: TargetUpdate) -> torch.Tensor:
        key = (target.seed, target.rank, target.in_features)
        if latest[0] != key:
            latest[:] = [key, projection_of(payload, target, device)]
        return latest[1]

    return projection


def rounding_seed(projection_seed: int, update_index: int) -> int:
    """Seed of the stochastic rounding of one target's merge in update ``update_index`` (1-based):
    derived from what the payload carries, so that an engine can draw the trainer's noise.

    Siblings sharing ``A`` share the projection seed and hence this one: where their shapes agree
    (k/v, gate/up) their bf16 roundings use the same uniforms. Each rounding stays unbiased; their
    errors are correlated, which matters only at second order (a bf16 ulp squared) and only for
    bf16-stored trainer weights (fp32 masters round nothing)."""
    return (projection_seed * 0x9E3779B97F4A7C15 + update_index * 0xBF58476D1CE4E5B9) % _MAX_SEED


def merge_like_trainer_(
    weight: torch.Tensor,
    target: TargetUpdate,
    projection: torch.Tensor,
    update_index: int,
    compensation: torch.Tensor | None = None,
    factor_rows: slice = slice(None),
) -> None:
    """Apply one target update to an engine's copy of (rows of) the weight as the trainer applied it
    to its own: ``W[rows] ← W[rows] − F[factor_rows] A``.

    Against an ``"exact"`` (fp32-master) trainer, a 32/64-bit copy merges exactly and a 16-bit copy
    keeps ``compensation`` (same shape and dtype as ``weight``; required then): Kahan summation, so
    that no update is rounded away. Against a bf16 trainer, any copy repeats the trainer's rounding
    to bf16 (stochastic with the same seed, or to nearest), so that it holds the trainer's values:
    bit-identical when the copy holds the whole matrix on the same kind of device.
    """
    factor = target.factor.to(weight.device)[factor_rows]
    if target.rounding == "exact":
        if weight.element_size() >= 4:
            merge_low_rank_(weight, factor, projection)
        elif compensation is None:
            raise ValueError(f"{target.name!r}: a 16-bit copy of an fp32-master trainer needs a compensation buffer")
        else:
            merge_low_rank_compensated_(weight, compensation, factor, projection)
        return
    generator = None
    if target.rounding == "stochastic":
        generator = torch.Generator(device=weight.device)
        generator.manual_seed(rounding_seed(target.seed, update_index))
    copy = weight if weight.dtype == torch.bfloat16 else weight.to(torch.bfloat16)
    merge_low_rank_(copy, factor, projection, stochastic_rounding=target.rounding == "stochastic", generator=generator)
    if copy is not weight:
        weight.copy_(copy)


def full_sync_bytes(shapes: list[tuple[int, int]], dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of a full sync of matrices of these shapes in ``dtype`` (the comparison for ``r/k``)."""
    return sum(d * k for d, k in shapes) * torch.empty((), dtype=dtype).element_size()


def sparse_delta(sent: torch.Tensor, current: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries of ``current`` that differ from ``sent`` (both as the engine holds them, e.g. bf16),
    as flat int32 indices and their values: one matrix's share of a lossless sparse-delta sync, the
    baseline LoGRA's factors are compared with (``2 + 4`` bytes per changed bf16 entry, against
    ``2·r/k`` bytes per entry for the factors)."""
    if sent.shape != current.shape or sent.dtype != current.dtype:
        raise ValueError(
            f"sparse_delta: sent {sent.dtype}{tuple(sent.shape)} vs current {current.dtype}{tuple(current.shape)}"
        )
    if current.numel() >= 2**31:
        raise ValueError(f"sparse_delta: {current.numel()} entries do not fit int32 indices")
    indices = (current != sent).reshape(-1).nonzero().squeeze(1)
    return indices.to(torch.int32), current.reshape(-1)[indices]


# --------------------------------------------------------------------------------------------------
# Drift: a cheap fingerprint of a weight, comparable across processes


def checksum_probe(seed: int, in_features: int, device=None) -> torch.Tensor:
    """A fixed Gaussian vector ``p ∈ R^k`` (float64) with ``E[ppᵀ] = I``."""
    return make_projection(seed, 1, in_features, "gaussian", device=device).double().reshape(-1)


def weight_checksum(weight: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    """``W p`` in float64: one matrix-vector product instead of moving ``W``.

    For two copies ``W``, ``W'`` of a weight, ``‖(W − W') p‖ / ‖W p‖`` is an unbiased estimate (in
    the squared sense) of the relative Frobenius difference ``‖W − W'‖ / ‖W‖``.
    """
    return weight.to(torch.float64) @ probe.to(weight.device)


def relative_drift(engine: torch.Tensor, trainer: torch.Tensor) -> float:
    """``‖c_engine − c_trainer‖ / ‖c_trainer‖`` for two checksums of the same weight."""
    reference = float(torch.linalg.vector_norm(trainer))
    difference = float(torch.linalg.vector_norm(engine.to(trainer.dtype).cpu() - trainer.cpu()))
    return difference / reference if reference > 0 else (0.0 if difference == 0 else math.inf)


# --------------------------------------------------------------------------------------------------
# Trainer side: collect the updates since the last sync


class UpdateRecorder:
    """Collects every update a :class:`~logra_optim.LoGRAOptimizer` merges, until :meth:`drain`.

    Args:
        optimizer: the optimizer to listen to (via ``register_merge_hook``).
        rename: maps the trainer's parameter names to the engine's checkpoint names (e.g. strips a
            wrapper prefix); applied when recording.
    """

    def __init__(self, optimizer, rename=None):
        self.rank, self.expert_rank = optimizer.rank, optimizer.expert_rank
        self.projection = optimizer.projection
        self.rename = rename or (lambda name: name)
        self.pending: list[Update] = []
        self._handle = optimizer.register_merge_hook(self._record)

    def _record(self, optimizer, update: Update) -> None:
        targets = tuple(
            TargetUpdate(self.rename(t.name), t.seed, t.in_features, t.factor.detach().to("cpu"), t.rounding)
            for t in update.targets
        )
        self.pending.append(Update(update.index, targets))

    @property
    def pending_bytes(self) -> int:
        return factor_bytes(self.pending)

    def drain(self) -> SyncPayload | None:
        """The pending updates as one payload (``None`` if there are none); clears them."""
        if not self.pending:
            return None
        payload = SyncPayload(self.rank, self.projection, tuple(self.pending), self.expert_rank)
        self.pending = []
        return payload

    def clear(self) -> None:
        """Forget pending updates (a full sync has superseded them)."""
        self.pending = []

    def close(self) -> None:
        self._handle.remove()
        self.pending = []
