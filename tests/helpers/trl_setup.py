"""Shared builders for the TRL integration tests: a tiny Qwen2 policy, a tokenizer built in memory,
a toy prompt dataset, a verifiable reward, and CPU trainer configs. Nothing is downloaded.

The toy task: prompts are 4 random tokens ``t0 … t59``; the reward of a completion is the fraction
of its tokens in ``ALLOWED`` (every 4th token, 15 of 60), so a random policy earns about 0.25 and
learning shows within a few dozen GRPO steps. ``initializer_range=0.1`` makes the attention/MLP
weights (the LoGRA targets) strong enough to move the logits while the frozen ``lm_head`` and
embeddings stay as initialised.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

N_WORDS = 60  # t0 … t59
SPECIAL = {"<pad>": 60, "<eos>": 61, "<unk>": 62, "<bos>": 63}
VOCAB_SIZE = N_WORDS + len(SPECIAL)
ALLOWED = frozenset(f"t{i}" for i in range(0, N_WORDS, 4))
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }} {% endfor %}{% if add_generation_prompt %}{% endif %}"
)

# LoGRA settings for the tiny model: rank ≤ min target size (64), a loose KL budget so that a
# handful of steps visibly moves the policy.
LOGRA_KWARGS = dict(rank=16, kl_budget=2e-2, update_ratio=5e-2, alpha_max=10.0)


def build_tokenizer():
    """A word-level tokenizer over ``t0 … t59`` plus pad/eos/unk/bos, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(N_WORDS)}
    vocab.update(SPECIAL)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", bos_token="<bos>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_policy(seed: int = 0):
    """The tiny Qwen2 policy (fp32, ~0.1 M parameters, targets 64×64 … 176×64)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        initializer_range=0.1,
        pad_token_id=SPECIAL["<pad>"],
        eos_token_id=SPECIAL["<eos>"],
        bos_token_id=SPECIAL["<bos>"],
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def build_moe_policy(seed: int = 0, **overrides):
    """The tiny Qwen3-MoE policy (fp32, 4 experts top-2 in both layers, eager experts): the same
    vocabulary and size class as :func:`build_policy`. ``overrides``: config fields (e.g.
    ``mlp_only_layers=[0]`` for a dense MLP in the first layer)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=176,
        moe_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        initializer_range=0.1,
        pad_token_id=SPECIAL["<pad>"],
        eos_token_id=SPECIAL["<eos>"],
        bos_token_id=SPECIAL["<bos>"],
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    model.config._experts_implementation = "eager"
    return model


def save_policy(directory, seed: int = 0, build=build_policy) -> str:
    """Save the policy (``build(seed)``) and tokenizer to ``directory`` (for trainers given a model
    path); returns it."""
    directory = str(directory)
    build(seed).save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return directory


def prompt_dataset(n: int = 64, length: int = 4, seed: int = 0):
    """``n`` prompts of ``length`` random words, in TRL's standard (non-conversational) format."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, N_WORDS, (n, length), generator=generator)
    return Dataset.from_dict({"prompt": [" ".join(f"t{int(i)}" for i in row) for row in ids]})


def allowed_fraction_reward(completions, **kwargs) -> list[float]:
    """The verifiable toy reward: fraction of completion words in ``ALLOWED`` (0 for an empty one)."""
    rewards = []
    for completion in completions:
        words = completion.split()
        rewards.append(sum(word in ALLOWED for word in words) / max(len(words), 1))
    return rewards


def make_config(kind: str, output_dir, **overrides):
    """A ``GRPOConfig`` (``kind="grpo"``) or ``RLOOConfig`` (``"rloo"``) for the CPU: small batches,
    seeded, no reporting, no vLLM, logs every step, no checkpoints unless asked."""
    from trl import GRPOConfig, RLOOConfig

    cls = {"grpo": GRPOConfig, "rloo": RLOOConfig}[kind]
    settings = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        use_vllm=False,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        # Plain forwards: the tiny model needs no activation checkpointing, and it only costs time.
        gradient_checkpointing=False,
        dataloader_num_workers=0,
    )
    settings.update(overrides)
    return cls(**settings)


def build_trainer(
    kind: str, model, output_dir, callbacks=None, optimizers=(None, None), trainer_cls=None, **config_overrides
):
    """A real ``GRPOTrainer`` / ``RLOOTrainer`` (or ``trainer_cls``, a subclass of the ``kind``) on the
    toy task; ``model`` is a model or a path."""
    from trl import GRPOTrainer, RLOOTrainer

    cls = trainer_cls or {"grpo": GRPOTrainer, "rloo": RLOOTrainer}[kind]
    return cls(
        model=model,
        reward_funcs=allowed_fraction_reward,
        args=make_config(kind, output_dir, **config_overrides),
        train_dataset=prompt_dataset(),
        processing_class=build_tokenizer(),
        callbacks=callbacks,
        optimizers=optimizers,
    )


def parameters(model) -> dict[str, torch.Tensor]:
    """A copy of every parameter, by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def mean_logged(log_history, key: str, steps) -> float:
    """Mean of ``key`` over the logged training steps ``steps`` (a slice of the entries having it)."""
    values = [entry[key] for entry in log_history if key in entry]
    chosen = values[steps]
    return sum(chosen) / len(chosen)
