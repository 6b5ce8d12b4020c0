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
    mask=st.sampled_from(["none", "causal", "bool", "float", "padding"]),
    zero=st.sampled_from([None, 0, 1, 2]),
    block=st.integers(1, 64),
    scale=st.sampled_from([None, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_attention_and_tangent_equal_forward_ad_of_torch_attention(
    batch, kv_heads, groups, queries, extra_keys, mask, zero, block, scale, seed
):
    generator = torch.Generator().manual_seed(seed)
    keys = queries + (0 if mask == "causal" else extra_keys)
    heads = kv_heads * groups

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    query, key, value = draw(batch, heads, queries, 4), draw(batch, kv_heads, keys, 4), draw(batch, kv_heads, keys, 3)
    tangents = tuple(None if i == zero else draw(*x.shape) for i, x in enumerate((query, key, value)))
    options = dict(scale=scale, enable_gqa=groups > 1)
    if mask == "causal":
        options["is_causal"] = True
    elif mask == "bool":
        options["attn_mask"] = torch.rand(batch, 1, queries, keys, generator=generator) < 0.7
    elif mask == "float":
        options["attn_mask"] = draw(1, heads, queries, keys)
    elif mask == "padding":  # left padding: the first key hidden from every query, one row sees nothing
        allowed = torch.ones(batch, 1, queries, keys, dtype=torch.bool)
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
    with torch.no_grad(), fwAD.dual_level(), AttentionTangentMode():
        plain = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        assert not calls
        dual = F.scaled_dot_product_attention(fwAD.make_dual(query, tangent), key, value, is_causal=True)
        assert len(calls) == 1
        primal, out_tangent = fwAD.unpack_dual(dual)
        dropout = F.scaled_dot_product_attention(fwAD.make_dual(query, tangent), key, value, dropout_p=0.5)
        assert len(calls) == 1 and fwAD.unpack_dual(dropout).tangent is not None  # left to torch
    torch.testing.assert_close(primal, plain)
    expected, expected_tangent = _reference(
        query.double(), key.double(), value.double(), (tangent.double(), None, None), is_causal=True
    )
    torch.testing.assert_close(out_tangent, expected_tangent.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_are_computed_in_fp32_and_returned_in_their_dtype(dtype):
    query, key, value = (torch.randn(1, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    tangent = torch.randn_like(query)
    low = [x.to(dtype) for x in (query, key, value)]
    output, out_tangent = attention_with_tangent(*low, (tangent.to(dtype), None, None), is_causal=True)
    assert output.dtype == out_tangent.dtype == dtype
    expected, expected_tangent = _reference(
        *(x.double() for x in low), (tangent.to(dtype).double(), None, None), is_causal=True
    )
    torch.testing.assert_close(out_tangent.double(), expected_tangent, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(output.double(), expected, rtol=1e-2, atol=1e-2)
