"""Seeded random projections ``A ∈ R^{r×k}``, generated where they are used and never stored.

Every party that needs ``A`` (the patched layer's forward, the KL probe, the optimizer's merge,
another data-parallel rank, the rollout engine) generates it from ``(base seed, update index,
module name)`` and frees it after use. That only works if all of them get the *same* matrix, on any
device and in any process.

The randomness is a counter-based hash, SplitMix64's output function applied to
``seed + (c + 1)·γ`` for counter ``c`` (i.e. the ``c``-th output of SplitMix64 seeded with
``seed``), written as int64 torch operations. Integer arithmetic has one answer on every device
(two's-complement wrap-around, logical shifts emulated by masking), so the same kernels run on a
GPU, where ``A`` is needed, without a CPU Mersenne Twister and a host-to-device copy, and give the
same bits as on the CPU. What is guaranteed:

* the integer stream is bit-identical everywhere (pinned against a pure-Python SplitMix64 in the
  tests);
* ``"rademacher"`` entries (one hash bit each, ``±1/√r``) are therefore bit-identical everywhere;
* ``"gaussian"`` entries go through float64 ``log``, ``sqrt``, ``cos`` and ``sin`` (Box–Muller),
  whose last bit may differ between CPU and CUDA math libraries; the fp32 result then agrees
  except, rarely, in its last bit. Parties that must agree bit for bit (trainer and engine merging
  into copies of one weight) should generate on the same kind of device, or use Rademacher.

Entry ``e = i·k + j`` of ``A`` depends on ``(seed, e)`` only, so a row-major prefix of ``A`` does not
depend on ``k`` or ``r``, and generation runs in chunks of bounded size.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass

import torch

PROJECTIONS = ("rademacher", "gaussian")

# Names the stream in fingerprints and docs; change it with any change of the bits produced.
GENERATOR = "splitmix64/v1"

# Entries generated per chunk: bounds the temporaries of a generation (per entry about 6 bytes for
# Rademacher, 50 for Gaussian: 1.5 and 13 MiB) whatever the size of A.
_CHUNK = 1 << 18


# Prefixes that wrappers insert into module names; the seed must not depend on how a model is wrapped.
_WRAPPER_COMPONENTS = re.compile(r"(^|\.)(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")
# DDP and DeepSpeed engines put ``module.`` in front of every name, only at the start.
_LEADING_WRAPPER = re.compile(r"^module\.")


def canonical_name(name: str) -> str:
    """Strip wrapper components (FSDP1, activation checkpointing, ``torch.compile``, DDP's ``module.``)
    from a module name, so that ``A`` is the same however the model is wrapped."""
    previous = None
    while previous != name:
        previous, name = name, _LEADING_WRAPPER.sub("", _WRAPPER_COMPONENTS.sub(r"\1", name))
    return name


# Sibling linears that read the same input in the common architectures: attention's query, key and
# value projections, and the gated MLP's gate and up projections (Llama-style and Mixtral-style names).
SHARED_INPUT_SIBLINGS = (
    frozenset({"q_proj", "k_proj", "v_proj"}),
    frozenset({"query", "key", "value"}),
    frozenset({"gate_proj", "up_proj"}),
    frozenset({"w1", "w3"}),
)


def projection_key(name: str, shared: bool = True) -> str:
    """The name a target's projection is drawn for: its canonical module name, or with ``shared``, one
    name for the siblings that read the same input (``q/k/v_proj`` → ``…self_attn.{k_proj,q_proj,v_proj}``).

    Siblings with one ``A`` each keep their own sketch ``S_W = G_W Aᵀ``, unbiased as before (``A`` is
    independent of the data); what they share is ``x Aᵀ``, computed and saved once per forward
    instead of once per sibling, and one ``A`` generated. The key depends on names only, so every
    party (ranks, rollout engine) derives the same one, whichever siblings are actually targets."""
    name = canonical_name(name)
    if not shared:
        return name
    parent, _, leaf = name.rpartition(".")
    for siblings in SHARED_INPUT_SIBLINGS:
        if leaf in siblings:
            members = ",".join(sorted(siblings))
            return f"{parent}.{{{members}}}" if parent else f"{{{members}}}"
    return name


def projection_seed(base_seed: int, update_index: int, name: str) -> int:
    """A 63-bit seed from ``(base seed, update index, canonical module name)``."""
    return hashed_seed("logra", "v1", int(base_seed), int(update_index), canonical_name(name))


def hashed_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` joined by ``/``. A cryptographic hash rather than Python's
    ``hash`` so it is stable across processes (``PYTHONHASHSEED``) and Python versions."""
    key = "/".join(str(part) for part in parts).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def _int64(value: int) -> int:
    """An unsigned 64-bit constant as the signed int64 with the same bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


_GAMMA = _int64(0x9E3779B97F4A7C15)  # SplitMix64's increment (2⁶⁴/φ, odd)
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits: torch's ``>>`` is arithmetic, so mask the copied sign."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(seed: int, start: int, count: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Outputs ``start … start+count−1`` of SplitMix64 seeded with ``seed``, as int64 bit patterns.

    Output ``c`` is ``mix(seed + (c + 1)·γ)`` (mod 2⁶⁴): a pure function of ``(seed, c)``, so any
    range is generated independently, on any device, with identical bits."""
    z = torch.arange(start + 1, start + count + 1, dtype=torch.int64, device=device)
    z.mul_(_GAMMA).add_(_int64(seed))
    z = (z ^ _shift_right(z, 30)).mul_(_MIX1)
    z = (z ^ _shift_right(z, 27)).mul_(_MIX2)
    return z ^ _shift_right(z, 31)


def _rademacher(seed: int, start: int, count: int, scale: float, device) -> torch.Tensor:
    """Entries ``start … start+count−1``: bit ``b`` of hash ``w`` (least significant first) is entry
    ``64w + b``; set means ``+scale``. ``start`` is a multiple of 64."""
    words = splitmix64(seed, start // 64, (count + 63) // 64, device)
    # Bytes by arithmetic (not a reinterpreting view), so the order does not depend on endianness.
    octets = (words.unsqueeze(1) >> torch.arange(0, 64, 8, device=device)) & 0xFF
    # Each byte's eight signs looked up in a 256×8 table: the entries are copies of ±scale rounded
    # once to fp32 (a fill, no arithmetic), so the result is the same on every device.
    bits = (torch.arange(256, device=device).unsqueeze(1) >> torch.arange(8, device=device)) & 1
    magnitude = torch.full((256, 8), scale, dtype=torch.float32, device=device)
    table = torch.where(bits.bool(), magnitude, -magnitude)
    return table.index_select(0, octets.reshape(-1)).reshape(-1)[:count]


def _gaussian(seed: int, start: int, count: int, scale: float, device) -> torch.Tensor:
    """Entries ``start … start+count−1`` by Box–Muller: pair ``p`` (entries ``2p``, ``2p+1``) takes
    the 53-bit uniforms ``u₁, u₂ ∈ (0, 1)`` of hashes ``2p``, ``2p+1`` and gives
    ``√(−2 ln u₁)·(cos 2πu₂, sin 2πu₂)·scale``. ``start`` is even."""
    pairs = (count + 1) // 2
    draws = _shift_right(splitmix64(seed, start, 2 * pairs, device), 11).view(pairs, 2)
    uniform = (draws.to(torch.float64) + 0.5) * 2.0**-53
    radius = torch.sqrt(-2.0 * torch.log(uniform[:, 0])) * scale
    angle = 2.0 * math.pi * uniform[:, 1]
    values = torch.stack((radius * torch.cos(angle), radius * torch.sin(angle)), dim=1)
    return values.reshape(-1)[:count].to(torch.float32)


def make_projection(
    seed: int,
    rank: int,
    in_features: int,
    kind: str = "rademacher",
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The projection ``A`` (``rank × in_features``) with ``E[AᵀA] = I``, generated on ``device``.

    ``"rademacher"``: entries ±1/√r with equal probability. ``"gaussian"``: N(0, 1/r) by Box–Muller.
    The entries are computed in fp32 and then cast to ``dtype``, so ``dtype`` only casts.

    Traced by ``torch.compile`` (a compiled patched model), it runs eagerly: inductor cannot lower
    its integer arithmetic, and a fused kernel could round Box–Muller's fp32 otherwise than the eager
    generation every other party (ranks, rollout engine) runs. (Wrapped at trace time only:
    ``torch.compiler.disable`` at import would import dynamo with the package.)"""
    if torch.compiler.is_compiling():
        return torch.compiler.disable(make_projection)(seed, rank, in_features, kind, device, dtype)
    if kind not in PROJECTIONS:
        raise ValueError(f"projection must be one of {PROJECTIONS}, got {kind!r}")
    draw = _rademacher if kind == "rademacher" else _gaussian
    scale = 1.0 / math.sqrt(rank)
    count = rank * in_features
    if count <= _CHUNK:  # one chunk: no copy into a separate output
        return draw(seed, 0, count, scale, device).to(dtype).view(rank, in_features)
    out = torch.empty(count, dtype=dtype, device=device)
    for start in range(0, count, _CHUNK):  # _CHUNK is a multiple of 64: chunks start on a word
        stop = min(count, start + _CHUNK)
        out[start:stop] = draw(seed, start, stop - start, scale, out.device)
    return out.view(rank, in_features)


@dataclass(frozen=True)
class ProjectionSpec:
    """Everything that determines one ``A``: what is kept instead of the matrix (four numbers
    instead of ``r·k`` floats), compared across data-parallel ranks, and sent to a rollout engine."""

    seed: int
    rank: int
    in_features: int
    kind: str = "rademacher"

    def generate(self, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``A`` (``rank × in_features``), freshly generated on ``device``."""
        return make_projection(self.seed, self.rank, self.in_features, self.kind, device, dtype)

    def nbytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of ``A`` in ``dtype``: the transient a generation allocates (plus its chunk temporaries)."""
        return self.rank * self.in_features * torch.empty((), dtype=dtype).element_size()
