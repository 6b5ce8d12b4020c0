"""Tiny models built from configs (no download) for the tests."""

from __future__ import annotations

import torch


def tiny_qwen2(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    config.update(overrides)
    torch.manual_seed(seed)
    attn = config.pop("attn_implementation")
    model = Qwen2ForCausalLM(Qwen2Config(**config)).to(dtype)
    model.config._attn_implementation = attn
    return model


def fixed_batch(vocab_size: int = 128, batch: int = 4, seq: int = 12, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch, seq), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids.clone()}
