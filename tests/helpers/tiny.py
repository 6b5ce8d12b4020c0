"""Tiny models built from configs (no download) for the tests."""

from __future__ import annotations

import torch
from logra_optim.patching import target_state


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


# ---------------------------------------------------------------------------------------------------
# Small stand-alone modules and helpers shared by the test files.


class OneLinear(torch.nn.Module):
    """A single target linear named ``proj``: the smallest model ``patch_model`` accepts."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.proj = torch.nn.Linear(in_features, out_features, bias=bias)

    def forward(self, x):
        return self.proj(x)


class TwoLinear(torch.nn.Module):
    """Two targets of different shapes (``up``: k→h, ``down``: h→d) with a nonlinearity between, so
    that a shared step size η and per-target state are both exercised."""

    def __init__(self, k: int = 12, h: int = 10, d: int = 7, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.up = torch.nn.Linear(k, h)
        self.down = torch.nn.Linear(h, d)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def sum_token_loss(model, batch) -> torch.Tensor:
    """Next-token cross entropy *summed* over tokens: additive over the rows of a batch, so a batch
    split into microbatches gives exactly the same total gradient."""
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float()
    targets = batch["input_ids"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


def sketches(model) -> dict[str, torch.Tensor]:
    """A copy of every target's current sketch, by module name."""
    from logra_optim import patched_modules

    return {name: target_state(module).sketch.clone() for name, module in patched_modules(model)}


def tiny_qwen3_moe(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A two-layer Qwen3-MoE (4 experts, top-2, every layer sparse) with transformers' eager experts."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    experts_implementation = overrides.pop("experts_implementation", "eager")
    config.update(overrides)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)).to(dtype)
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = experts_implementation
    return model


def tiny_gpt_oss(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A two-layer GPT-OSS (4 experts, top-2; a sliding-window layer then a full one, attention sinks)
    with eager attention and experts. Its experts are stored transposed (``gate_up_proj`` ``[E, H, 2I]``
    with gate and up interleaved, ``down_proj`` ``[E, I, H]``) with biases; experts and biases get
    std-0.2 weights so that biases and the gate's clamp matter."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = dict(
        vocab_size=128,
        hidden_size=16,
        intermediate_size=12,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        max_position_embeddings=131072,  # GPT-OSS's own: its YaRN factor 32 × 4096 (no cache is allocated)
        tie_word_embeddings=False,
    )
    experts_implementation = overrides.pop("experts_implementation", "eager")
    config.update(overrides)
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**config))
    for layer in model.model.layers:
        for parameter in layer.mlp.experts.parameters():
            torch.nn.init.normal_(parameter, std=0.2)
    model.to(dtype)
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = experts_implementation
    return model
