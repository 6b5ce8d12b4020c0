"""Model shapes: the presets that ``logra bench`` builds, ``logra plan`` predicts and the benchmarks
reuse, and :class:`Shape`, the few numbers of a decoder that memory and rank limits depend on.

Both commands name models the same way (a preset, a ``config.json`` or a directory holding one),
so the shapes live here and not in either command: a preset then means the same model everywhere,
and neither command imports the other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Published Qwen2.5 shapes, as ``config.json`` keys; ``core`` is the README's memory and step-time
# model (Qwen2.5-1.5B's width and head_dim, 4 layers, a 32k vocabulary: 201 M parameters, and
# 4 KV heads so that k/v allow ranks up to 512). Embeddings keep their real vocabulary: their
# memory is part of what every method pays.
PRESETS: dict[str, dict] = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=176,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=256,
        num_hidden_layers=2,
        tie_word_embeddings=False,
    ),
    "core": dict(
        hidden_size=1536,
        intermediate_size=4224,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
        num_hidden_layers=4,
        tie_word_embeddings=False,
    ),
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        num_hidden_layers=24,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        num_hidden_layers=28,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        num_hidden_layers=28,
        tie_word_embeddings=False,
    ),
}
# How many decoder layers ``logra bench`` keeps of each preset by default: the full 24–28 of the
# Qwen2.5 models do not fit dense AdamW into a 24 GiB, 2-core machine. ``logra plan`` keeps them all.
DEFAULT_LAYERS = {"tiny": 2, "core": 4, "qwen2.5-0.5b": 2, "qwen2.5-1.5b": 2, "qwen2.5-7b": 1}


def read_config(source: str) -> dict:
    """The ``config.json`` of ``source``: a preset name, a file, or a directory holding one."""
    if source in PRESETS and not Path(source).exists():
        return dict(PRESETS[source])
    file = Path(source)
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise ValueError(f"{source}: no config.json there (nor a preset: {', '.join(sorted(PRESETS))})")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{file}: not valid JSON ({error})") from None


@dataclass(frozen=True)
class Shape:
    """A Llama/Qwen/Mistral-style decoder: attention q/k/v/o and a gated MLP per layer."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, config: dict) -> Shape:
        config = config.get("text_config", config)  # multimodal configs nest the language model
        try:
            hidden = config["hidden_size"]
            heads = config["num_attention_heads"]
            return cls(
                hidden=hidden,
                intermediate=config["intermediate_size"],
                layers=config["num_hidden_layers"],
                heads=heads,
                kv_heads=config.get("num_key_value_heads") or heads,
                head_dim=config.get("head_dim") or hidden // heads,
                vocab=config["vocab_size"],
                tied=bool(config.get("tie_word_embeddings", False)),
            )
        except KeyError as missing:
            raise ValueError(
                f"config has no {missing.args[0]!r}: logra plan models Llama/Qwen/Mistral-style "
                "decoders (hidden_size, intermediate_size, num_hidden_layers, …)"
            ) from None

    def targets(self) -> list[tuple[int, int]]:
        """(out d, in k) of one layer's LoGRA targets: q, k, v, o, gate, up, down."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]

    def projection_widths(self) -> list[int]:
        """In-width ``k`` of each projection ``A`` of one layer with shared projections (the
        default): one for q/k/v, o, one for gate/up, down."""
        return [self.hidden, self.heads * self.head_dim, self.hidden, self.intermediate]

    @property
    def max_rank(self) -> int:
        """The largest rank every target allows (LoGRA, LoRA and GaLore alike): the smallest dimension."""
        return min(min(d, k) for d, k in self.targets())

    @property
    def target_params(self) -> int:
        return self.layers * sum(d * k for d, k in self.targets())

    @property
    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        norms = self.layers * 2 * self.hidden + self.hidden
        biases = self.layers * (self.heads + 2 * self.kv_heads) * self.head_dim  # q/k/v biases (Qwen2)
        return self.target_params + embeddings + norms + biases
