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

# Where mixture-of-experts configs keep their expert count (Qwen-MoE; Mixtral, GPT-OSS; DeepSeek).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def expert_count(config) -> tuple[str, int] | None:
    """``(key, count)`` of a config's (a dict's or a ``PretrainedConfig``'s) experts, or ``None``."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    return next(((key, get(key)) for key in EXPERT_COUNT_KEYS if get(key)), None)


# Published Qwen2.5 shapes, as ``config.json`` keys; ``core`` is the memory and step-time
# benchmark's model (Qwen2.5-1.5B's width and head_dim, 4 layers, a 32k vocabulary: 201 M parameters, and
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
    # Mixture of experts (transformers' Qwen3-MoE): the published Qwen3-30B-A3B (48 layers of 128
    # experts, 8 routed per token), and ``moe-core``, its layer cut to what a 24 GiB CPU machine runs
    # with dense AdamW beside it: 32 of the 128 experts (8 routed), 2 layers, a 32k vocabulary (as
    # ``core``, so that dense AdamW's embeddings do not decide the ratios).
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        num_hidden_layers=48,
        tie_word_embeddings=False,
    ),
}
PRESETS["moe-core"] = {**PRESETS["qwen3-30b-a3b"], "num_experts": 32, "vocab_size": 32000, "num_hidden_layers": 2}

# How many decoder layers ``logra bench`` keeps of each preset by default: the full 24–28 of the
# Qwen2.5 models do not fit dense AdamW into a 24 GiB, 2-core machine. ``logra plan`` keeps them all.
DEFAULT_LAYERS = {
    "tiny": 2,
    "core": 4,
    "qwen2.5-0.5b": 2,
    "qwen2.5-1.5b": 2,
    "qwen2.5-7b": 1,
    "qwen3-30b-a3b": 1,
    "moe-core": 2,
}
# Presets of dense (Qwen2) models; the others name their ``model_type``.
DENSE_PRESETS = tuple(name for name, preset in PRESETS.items() if "model_type" not in preset)


def preset_config(name: str, **overrides):
    """The ``transformers`` config of preset ``name`` (Qwen2 unless it names a ``model_type``)."""
    from transformers import AutoConfig

    settings = {**PRESETS[name], **overrides}
    return AutoConfig.for_model(settings.pop("model_type", "qwen2"), **settings)


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
        config = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{file}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: a config.json holds one JSON object, got a {type(config).__name__}")
    return config


@dataclass(frozen=True)
class Shape:
    """A Llama/Qwen/Mistral-style decoder: attention q/k/v/o and a gated MLP per layer, or with
    ``experts`` > 0 a mixture-of-experts block in every layer (``experts`` gated MLPs of width
    ``expert_intermediate``, ``top_k`` of them per token; shared experts and dense layers between
    MoE layers are not modelled)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    experts: int = 0
    expert_intermediate: int = 0
    top_k: int = 0
    qk_norm: bool = False  # Qwen3's per-head RMSNorm of queries and keys
    attention_biases: int = 3  # q/k/v (Qwen2), 4 with o (attention_bias=True in Llama, Qwen3), or 0

    @classmethod
    def from_config(cls, config: dict) -> Shape:
        config = config.get("text_config") or config  # multimodal configs nest the language model
        if not isinstance(config, dict):
            raise ValueError(f"config: text_config must be a JSON object, got {type(config).__name__}")
        try:
            hidden = config["hidden_size"]
            heads = config["num_attention_heads"]
            for name in ("hidden_size", "num_attention_heads"):
                if isinstance(config[name], bool) or not isinstance(config[name], int) or config[name] < 1:
                    raise ValueError(f"config: {name} must be a positive integer, got {config[name]!r}")
            experts = (expert_count(config) or (None, None))[1]
            unmodelled = [
                key
                for key in ("shared_expert_intermediate_size", "n_shared_experts", "first_k_dense_replace")
                if config.get(key)
            ]
            unmodelled += ["mlp_only_layers"] if config.get("mlp_only_layers") else []
            unmodelled += ["decoder_sparse_step"] if (config.get("decoder_sparse_step") or 1) > 1 else []
            if experts and unmodelled:
                raise ValueError(
                    f"config has {', '.join(unmodelled)}: shared experts and dense layers between MoE layers are not "
                    "modelled yet (every layer is taken as one block of routed experts, as in Qwen3-MoE)"
                )
            model_type = str(config.get("model_type") or "qwen2")  # the presets are Qwen2-shaped
            if model_type.startswith("qwen2"):  # Qwen2 and Qwen2-MoE: biases on q, k and v by design
                attention_biases = 3
            else:  # Llama, Qwen3, …: on q, k, v and o where attention_bias says so
                attention_biases = 4 if config.get("attention_bias") else 0
            shape = cls(
                hidden=hidden,
                intermediate=config["intermediate_size"],
                layers=config["num_hidden_layers"],
                heads=heads,
                kv_heads=config.get("num_key_value_heads") or heads,
                head_dim=config.get("head_dim") or hidden // heads,
                vocab=config["vocab_size"],
                tied=bool(config.get("tie_word_embeddings", False)),
                experts=experts or 0,
                expert_intermediate=(config.get("moe_intermediate_size") or config["intermediate_size"])
                if experts
                else 0,
                top_k=(1 if config.get("num_experts_per_tok") is None else config["num_experts_per_tok"])
                if experts
                else 0,
                qk_norm=model_type.startswith("qwen3"),
                attention_biases=attention_biases,
            )
        except KeyError as missing:
            raise ValueError(
                f"config has no {missing.args[0]!r}: logra plan models Llama/Qwen/Mistral-style "
                "decoders (hidden_size, intermediate_size, num_hidden_layers, …)"
            ) from None
        may_be_zero = ("experts", "expert_intermediate", "top_k", "attention_biases")
        for name, value in vars(shape).items():
            if name in ("tied", "qk_norm"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name in may_be_zero else 1):
                kind = "a non-negative" if name in may_be_zero else "a positive"
                raise ValueError(f"config: {name} must be {kind} integer, got {value!r}")
        if shape.experts and not 1 <= shape.top_k <= shape.experts:
            raise ValueError(f"config: num_experts_per_tok {shape.top_k} must be in 1…{shape.experts}, the experts")
        return shape

    def targets(self) -> list[tuple[int, int, int]]:
        """(out d, in k, matrices) of one layer's LoGRA targets: q, k, v, o, gate, up, down (one
        matrix each), or q, k, v, o and the stacked experts' gate_up and down (``experts`` each)."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        attention = [(q, h, 1), (kv, h, 1), (kv, h, 1), (h, q, 1)]
        if self.experts:
            e, ie = self.experts, self.expert_intermediate
            return attention + [(2 * ie, h, e), (h, ie, e)]
        return attention + [(i, h, 1), (i, h, 1), (h, i, 1)]

    def projection_widths(self) -> list[int]:
        """In-width ``k`` of each projection ``A`` of one layer with shared projections (the
        default): one for q/k/v, o, one for gate/up (all experts' gate_up), down (all experts')."""
        down = self.expert_intermediate if self.experts else self.intermediate
        return [self.hidden, self.heads * self.head_dim, self.hidden, down]

    @property
    def max_rank(self) -> int:
        """The largest rank every target allows (LoGRA, LoRA and GaLore alike): the smallest dimension."""
        return min(min(d, k) for d, k, _ in self.targets())

    def max_rank_of(self, experts: bool) -> int:
        """The largest rank every linear target (``experts=False``) or every expert allows."""
        linear = 4 if self.experts else len(self.targets())  # attention, and a dense MLP
        chosen = self.targets()[linear:] if experts else self.targets()[:linear]
        return min(min(d, k) for d, k, _ in chosen)

    @property
    def target_params(self) -> int:
        return self.layers * sum(d * k * n for d, k, n in self.targets())

    @property
    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        norms = self.layers * (2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)) + self.hidden
        router = self.layers * self.experts * self.hidden
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        biases = self.layers * ((q + 2 * kv) if self.attention_biases >= 3 else 0)
        biases += self.layers * self.hidden if self.attention_biases == 4 else 0
        return self.target_params + embeddings + norms + biases + router
