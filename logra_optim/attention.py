"""Scaled dot-product attention with its forward-mode tangent, for the JVP probe.

Fused attention kernels have no forward-AD rule, so a dual forward through
``F.scaled_dot_product_attention`` falls back to torch's math implementation and differentiates
it op by op: six batched products, the tangent of a masked ("safe") softmax, and every score-sized
temporary that needs. The tangent has a short closed form instead. With ``S = s·q kᵀ + M``,
``P = softmax(S)`` and ``o = P v``:

    Ṡ = s·(q̇ kᵀ + q k̇ᵀ),   W = P ⊙ Ṡ,   ȯ = W v − rowsum(W) ⊙ o + P v̇

(the softmax's Jacobian applied to ``Ṡ`` is ``W − P ⊙ rowsum(W)``). That is four products, computed
here a block of queries at a time so the score-sized temporaries stay bounded at long contexts, and
with a causal mask only over the keys a block can see. :class:`AttentionTangentMode` routes every
dual call of ``F.scaled_dot_product_attention`` (what Hugging Face models call for ``sdpa``
attention) through :func:`attention_with_tangent`; other calls pass through unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# Score elements (batch × heads × queries × keys) of one block of queries.
BLOCK_SCORES = 1 << 22


def attention_with_tangent(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tangents: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    block_scores: int = BLOCK_SCORES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, ȯ)`` of ``F.scaled_dot_product_attention(query, key, value, attn_mask, 0, is_causal,
    scale, enable_gqa)`` and its tangent along ``tangents = (q̇, k̇, v̇)`` (``None``: zero).

    The arguments mean what they mean to torch's function (a boolean mask marks the keys a query
    may attend to, a float mask is added to the scores, ``is_causal`` is the top-left aligned lower
    triangle, and a query that may attend to no key gets a zero output and tangent, as torch's
    math implementation gives it). Computed in fp32 at least, returned in ``query``'s dtype, a block
    of queries at a time whose scores hold at most ``block_scores`` elements (at least one query)."""
    dtype = query.dtype
    work = torch.promote_types(dtype, torch.float32)
    heads, queries, keys = query.shape[-3], query.shape[-2], key.shape[-2]
    if enable_gqa and key.shape[-3] != heads:  # query head h reads key/value head h // (heads / kv heads)
        repeats = heads // key.shape[-3]
        key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
        tangents = (
            tangents[0],
            *(None if t is None else t.repeat_interleave(repeats, -3) for t in tangents[1:]),
        )
    query, key, value = (x.to(work) for x in (query, key, value))
    query_t, key_t, value_t = (None if t is None else t.to(work) for t in tangents)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if attn_mask is not None:  # a view: a float mask is converted a block at a time, like the scores
        attn_mask = attn_mask.expand(*attn_mask.shape[:-2], queries, keys)
    batch = math.prod(query.shape[:-2])
    block = max(1, min(queries, block_scores // max(1, batch * keys)))
    output = torch.empty(*query.shape[:-1], value.shape[-1], dtype=work, device=query.device)
    tangent = torch.empty_like(output)
    for start in range(0, queries, block):
        rows = slice(start, min(queries, start + block))
        seen = min(keys, rows.stop) if is_causal else keys  # the keys any query of the block sees
        k, v = key[..., :seen, :], value[..., :seen, :]
        scores = torch.matmul(query[..., rows, :], k.transpose(-1, -2)).mul_(scale)
        if is_causal:
            visible = torch.ones(rows.stop - rows.start, seen, dtype=torch.bool, device=query.device)
            scores.masked_fill_(~visible.tril_(rows.start), float("-inf"))
        elif attn_mask is not None:
            mask = attn_mask[..., rows, :]
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.to(work)
        probs = torch.softmax(scores, dim=-1)
        # A query that sees no key: zero, as torch's math implementation (its "safe" softmax) gives.
        probs = probs.masked_fill((scores == float("-inf")).all(dim=-1, keepdim=True), 0.0)
        out = torch.matmul(probs, v)
        score_t = _score_tangent(query[..., rows, :], k, query_t, key_t, rows, seen)
        if score_t is None:
            out_t = torch.zeros_like(out)
        else:
            weighted = score_t.mul_(scale).mul_(probs)
            out_t = torch.matmul(weighted, v).sub_(weighted.sum(dim=-1, keepdim=True) * out)
        if value_t is not None:
            out_t += torch.matmul(probs, value_t[..., :seen, :])
        output[..., rows, :], tangent[..., rows, :] = out, out_t
    return output.to(dtype), tangent.to(dtype)


def _score_tangent(query, key, query_t, key_t, rows: slice, seen: int) -> torch.Tensor | None:
    """``q̇ kᵀ + q k̇ᵀ`` for a block of queries (``None`` when both tangents are zero)."""
    score_t = None
    if query_t is not None:
        score_t = torch.matmul(query_t[..., rows, :], key.transpose(-1, -2))
    if key_t is not None:
        term = torch.matmul(query, key_t[..., :seen, :].transpose(-1, -2))
        score_t = term if score_t is None else score_t.add_(term)
    return score_t


class AttentionTangentMode(TorchFunctionMode):
    """While active, a call of ``F.scaled_dot_product_attention`` whose query, key or value carries
    a forward-AD tangent is computed by :func:`attention_with_tangent`, if grad mode is off (the
    closed form has no backward; the probe runs without an autograd graph), there is no dropout,
    and the call is of the shapes the closed form handles (see :func:`_sdpa_arguments`). Every
    other call runs as it would without the mode, so torch keeps its own errors and broadcasting."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            bound = _sdpa_arguments(*args, **kwargs)
            if bound is not None:
                return _dual_attention(**bound)
        return func(*args, **kwargs)


def _sdpa_arguments(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    """The call's arguments by name, or ``None`` where it is left to torch: no tangent, dropout,
    grad mode on, a mask together with ``is_causal`` (an error in torch), fewer than three
    dimensions, batch dimensions (heads too, without ``enable_gqa``) that differ between query, key
    and value (torch broadcasts them), or query heads that are no multiple of the key/value heads
    under ``enable_gqa``."""
    duals = [fwAD.unpack_dual(x) for x in (query, key, value)]
    if dropout_p != 0.0 or all(d.tangent is None for d in duals) or torch.is_grad_enabled():
        return None
    if (attn_mask is not None and is_causal) or query.dim() < 3 or not query.dim() == key.dim() == value.dim():
        return None
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        return None
    if key.shape[-3] != value.shape[-3] or (not enable_gqa and query.shape[-3] != key.shape[-3]):
        return None  # torch broadcasts heads (4-D) or the batch (3-D) of size 1
    if enable_gqa and query.shape[-3] % key.shape[-3] != 0:
        return None
    return dict(
        primals=[d.primal for d in duals],
        tangents=tuple(d.tangent for d in duals),
        attn_mask=attn_mask,
        is_causal=bool(is_causal),
        scale=scale,
        enable_gqa=bool(enable_gqa),
    )


def _dual_attention(primals, tangents, **options) -> torch.Tensor:
    """The dual output torch's attention would return: primal and tangent from the closed form."""
    output, tangent = attention_with_tangent(*primals, tangents, **options)
    return fwAD.make_dual(output, tangent)
