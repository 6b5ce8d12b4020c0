"""The JVP probe's attention (``logra_optim.attention``): its output and tangent against torch's
own attention differentiated by forward-mode AD in float64, over shapes, masks, causality, grouped
query heads and blocks of queries; and the mode that routes dual calls to it."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

from logra_optim import attention
from logra_optim.attention import AttentionTangentMode, attention_with_tangent


def _reference(query, key, value, tangents, **options):
    """Torch's math attention differentiated op by op (forward AD), in float64."""
    with fwAD.dual_level(), sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        duals = [x if t is None else fwAD.make_dual(x, t) for x, t in zip((query, key, value), tangents)]
        primal, tangent = fwAD.unpack_dual(F.scaled_dot_product_attention(*duals, **options))
    return primal, torch.zeros_like(primal) if tangent is None else tangent


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    groups=st.integers(1, 3),
    queries=st.integers(1, 9),
    extra_keys=st.integers(0, 3),
    mask=st.sampled_from(["none", "causal", "bool", "float", "float -inf", "2-d", "one row", "padding"]),
    dims=st.sampled_from([3, 4, 5]),
    zero=st.sampled_from([None, 0, 1, 2]),
    block=st.integers(1, 64),
    scale=st.sampled_from([None, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_attention_and_tangent_equal_forward_ad_of_torch_attention(
    batch, kv_heads, groups, queries, extra_keys, mask, dims, zero, block, scale, seed
):
    generator = torch.Generator().manual_seed(seed)
    keys = max(1, queries + extra_keys - 2)  # fewer, as many or more keys than queries (causal too)
    heads = kv_heads * groups
    lead = {3: (), 4: (batch,), 5: (batch, 2)}[dims]  # [heads, T, D], [B, heads, T, D], [B, 2, heads, T, D]

    def draw(*shape):
        return torch.randn(*lead, *shape, generator=generator, dtype=torch.float64)

    query, key, value = draw(heads, queries, 4), draw(kv_heads, keys, 4), draw(kv_heads, keys, 3)
    tangents = tuple(
        None if i == zero else torch.randn(x.shape, generator=generator, dtype=x.dtype)
        for i, x in enumerate((query, key, value))
    )
    options = dict(scale=scale, enable_gqa=groups > 1)
    if mask == "causal":
        options["is_causal"] = True
    elif mask == "bool":
        options["attn_mask"] = torch.rand(*lead, 1, queries, keys, generator=generator) < 0.7
    elif mask == "float":
        options["attn_mask"] = draw(heads, queries, keys)
    elif mask == "float -inf":  # some scores removed, and every score of the first query
        scores = draw(1, queries, keys)
        scores[torch.rand(scores.shape, generator=generator) < 0.3] = float("-inf")
        scores[..., 0, :] = float("-inf")
        options["attn_mask"] = scores
    elif mask == "2-d":  # (queries, keys), broadcast over every leading dimension
        options["attn_mask"] = torch.rand(queries, keys, generator=generator) < 0.7
    elif mask == "one row":  # (…, 1, keys), broadcast over the queries
        options["attn_mask"] = draw(1, 1, keys)
    elif mask == "padding":  # left padding: the first key hidden from every query, one row sees nothing
        allowed = torch.ones(*lead, 1, queries, keys, dtype=torch.bool)
        allowed[..., 0] = False
        allowed[..., 0, :] = False
        options["attn_mask"] = allowed
    expected, expected_tangent = _reference(query, key, value, tangents, **options)
    # Blocks from one query (of one batch × heads slice) up to all of them.
    output, tangent = attention_with_tangent(query, key, value, tangents, block_scores=block, **options)
    assert output.dtype == tangent.dtype == torch.float64
    torch.testing.assert_close(output, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(tangent, expected_tangent, rtol=1e-10, atol=1e-12)


def test_mode_routes_dual_calls_and_leaves_the_rest_to_torch(monkeypatch):
    calls = []
    original = attention.attention_with_tangent
    monkeypatch.setattr(attention, "attention_with_tangent", lambda *a, **k: calls.append(1) or original(*a, **k))
    query, key, value = (torch.randn(1, 2, 5, 4) for _ in range(3))
    tangent = torch.randn_like(query)
    with torch.no_grad(), fwAD.dual_level(), sdpa_kernel(SDPBackend.MATH), AttentionTangentMode():
        plain = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        assert not calls
        dual = F.scaled_dot_product_attention(fwAD.make_dual(query, tangent), key, value, is_causal=True)
        assert len(calls) == 1
        primal, out_tangent = fwAD.unpack_dual(dual)
        dropout = F.scaled_dot_product_attention(fwAD.make_dual(query, tangent), key, value, dropout_p=0.5)
        assert len(calls) == 1 and fwAD.unpack_dual(dropout).tangent is not None  # left to torch
        flat = F.scaled_dot_product_attention(fwAD.make_dual(query[0, 0], tangent[0, 0]), key[0, 0], value[0, 0])
        assert len(calls) == 1 and fwAD.unpack_dual(flat).tangent is not None  # 2-D: left to torch
        with pytest.raises(RuntimeError, match="attn_mask"):  # torch's own error, not a mask ignored
            mask = torch.ones(5, 5, dtype=torch.bool)
            F.scaled_dot_product_attention(fwAD.make_dual(query, tangent), key, value, mask, is_causal=True)
        with torch.enable_grad():  # the closed form has no backward: a graph being built is left to torch
            F.scaled_dot_product_attention(fwAD.make_dual(query, tangent), key, value, is_causal=True)
        assert len(calls) == 1
        # One query head against two key/value heads, or a 3-D batch of one against two: torch
        # broadcasts them (the closed form would size its output from the query's).
        for one, two in (((1, 1, 5, 4), (1, 2, 5, 4)), ((1, 5, 4), (2, 5, 4))):
            single, pair = torch.randn(one), torch.randn(two)
            out = F.scaled_dot_product_attention(fwAD.make_dual(single, torch.randn(one)), pair, pair)
            assert len(calls) == 1 and fwAD.unpack_dual(out).primal.shape == two
    torch.testing.assert_close(primal, plain)
    expected, expected_tangent = _reference(
        query.double(), key.double(), value.double(), (tangent.double(), None, None), is_causal=True
    )
    torch.testing.assert_close(out_tangent, expected_tangent.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_are_computed_in_fp32_as_torch_does_and_returned_in_their_dtype(dtype):
    """Torch's math attention upcasts 16-bit inputs on CPU; the closed form computes in fp32 too, and
    agrees with it bit for bit (16-bit arithmetic inside would not)."""
    generator = torch.Generator().manual_seed(0)
    query, key, value, tangent = (torch.randn(1, 2, 6, 8, generator=generator).to(dtype) for _ in range(4))
    expected, expected_tangent = _reference(query, key, value, (tangent, None, None), is_causal=True)
    output, out_tangent = attention_with_tangent(query, key, value, (tangent, None, None), is_causal=True)
    assert output.dtype == out_tangent.dtype == dtype
    assert torch.equal(output, expected) and torch.equal(out_tangent, expected_tangent)
