"""Seeded random projections ``A ∈ R^{r×k}``, regenerated on demand and never stored.

Every party that needs ``A`` (the patched layer, the optimizer's merge, another data-parallel rank,
the rollout engine) rebuilds it from ``(base seed, update index, module name)``. That only works if
all of them get the *bit-identical* matrix, on any device and in any process. CUDA and CPU random
streams differ for the same seed, and vectorised float kernels may round differently from machine to
machine, so the randomness here comes from integer draws of a CPU ``torch.Generator`` (a serial
Mersenne Twister: exact everywhere) and the floats are derived from those integers in float64.
"""

from __future__ import annotations

import hashlib
import math
import re

import torch

PROJECTIONS = ("rademacher", "gaussian")

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
    instead of once per sibling, and one ``A`` in memory. The key depends on names only, so every
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
    """A 63-bit seed from ``(base seed, update index, canonical module name)``.

    A cryptographic hash rather than Python's ``hash`` so it is stable across processes
    (``PYTHONHASHSEED``) and Python versions.
    """
    key = f"logra/v1/{int(base_seed)}/{int(update_index)}/{canonical_name(name)}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def make_projection(
    seed: int,
    rank: int,
    in_features: int,
    kind: str = "rademacher",
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The projection ``A`` (``rank × in_features``) with ``E[AᵀA] = I``.

    ``"rademacher"``: entries ±1/√r with equal probability. ``"gaussian"``: N(0, 1/r) by Box–Muller.
    """
    if kind not in PROJECTIONS:
        raise ValueError(f"projection must be one of {PROJECTIONS}, got {kind!r}")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    count = rank * in_features
    if kind == "rademacher":
        # One random byte gives eight signs.
        packed = torch.empty((count + 7) // 8, dtype=torch.uint8).random_(0, 256, generator=generator)
        shifts = torch.arange(8, dtype=torch.uint8)
        bits = ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[:count]
        values = bits.to(torch.float32).mul_(2.0).sub_(1.0).mul_(1.0 / math.sqrt(rank))
    else:
        # 53-bit uniforms in (0, 1) from integer draws, then Box–Muller in float64.
        draws = torch.empty(2, count, dtype=torch.int64).random_(0, 2**53, generator=generator)
        uniform = (draws.to(torch.float64) + 0.5) * 2.0**-53
        radius = torch.sqrt(-2.0 * torch.log(uniform[0]))
        values = (radius * torch.cos(2.0 * math.pi * uniform[1]) / math.sqrt(rank)).to(torch.float32)
    return values.reshape(rank, in_features).to(device=device, dtype=dtype)
