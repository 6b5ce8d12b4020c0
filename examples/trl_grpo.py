"""GRPO with TRL, trained by LoGRA: an ordinary ``GRPOTrainer`` script plus two lines (marked ``# LoGRA:``).

To run offline on a CPU in well under a minute, the policy is a tiny Qwen2 built from a config and
the tokenizer is a word-level one built in memory; with a real model you would load both with
``from_pretrained`` (or pass the model id to ``GRPOTrainer``) and change nothing else.

The task is verifiable: prompts are random words ``t0 … t59``, and a completion earns the fraction
of its words that are in an "allowed" set (every 4th word), so a random policy starts near 0.25.

LoGRA's settings here: rank 16 (targets from 32×64, k/v_proj, to 64×176, down_proj), a predicted-KL budget of 2e-2 per
update, and ``update_ratio=5e-2``, the relative step before KL control scales it by α ≤ ``alpha_max``:
the default (6e-5, the paper's, for billion-parameter models) would cap α long before this tiny
model reaches the budget. TRL's ``learning_rate`` is not used; its schedule scales ``update_ratio``.

    python examples/trl_grpo.py --steps 60
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer

from logra_optim.integrations.trl import attach_logra  # LoGRA: the TRL adapter

WORDS = [f"t{i}" for i in range(60)]
ALLOWED = set(WORDS[::4])


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {word: i for i, word in enumerate(WORDS)}
    vocab.update({"<pad>": 60, "<eos>": 61, "<unk>": 62, "<bos>": 63})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", bos_token="<bos>"
    )
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    return tokenizer


def build_model(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        initializer_range=0.1,
        pad_token_id=60,
        eos_token_id=61,
        bos_token_id=63,
    )
    return Qwen2ForCausalLM(config)


def build_dataset(n: int, seed: int) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, len(WORDS), (n, 4), generator=generator)
    return Dataset.from_dict({"prompt": [" ".join(WORDS[i] for i in row) for row in ids.tolist()]})


def allowed_words_reward(completions, **kwargs) -> list[float]:
    rewards = []
    for completion in completions:
        words = completion.split()
        rewards.append(sum(word in ALLOWED for word in words) / max(len(words), 1))
    return rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32, help="completions per step")
    parser.add_argument("--num-generations", type=int, default=4, help="completions per prompt")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--kl-budget", type=float, default=2e-2, help="predicted KL per update")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=None, help="default: a temporary directory")
    args = parser.parse_args()
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="trl_grpo_logra_")

    config = GRPOConfig(
        output_dir=output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        max_completion_length=8,
        lr_scheduler_type="constant",
        logging_steps=max(1, args.steps // 10),
        save_strategy="no",
        seed=args.seed,
        # CPU, offline:
        use_cpu=True,
        bf16=False,
        use_vllm=False,
        report_to="none",
    )
    trainer = GRPOTrainer(
        model=build_model(args.seed),
        reward_funcs=allowed_words_reward,
        args=config,
        train_dataset=build_dataset(256, args.seed),
        processing_class=build_tokenizer(),
    )
    attach_logra(trainer, rank=args.rank, kl_budget=args.kl_budget, update_ratio=5e-2)  # LoGRA: train with LoGRA
    trainer.train()

    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    if rewards:
        print(f"mean reward: first log {rewards[0]:.3f}, last log {rewards[-1]:.3f}")
    # The saved model is an ordinary checkpoint: AutoModelForCausalLM.from_pretrained loads it.
    trainer.save_model(os.path.join(output_dir, "final"))
    print(f"saved to {os.path.join(output_dir, 'final')}")


if __name__ == "__main__":
    main()
