"""REINFORCE with a running reward baseline and LoGRA, in a plain PyTorch loop (the paper's setup:
one response per prompt, a global running baseline, predicted-KL step control).

A tiny Qwen2 built from a config (no download) learns a verifiable toy task: answer a prompt with
tokens from a fixed "allowed" set. The reward is the fraction of allowed tokens in the response, so
a random policy starts near |allowed|/vocab and learning is visible within a minute on a CPU.

    python examples/reinforce_tiny.py --steps 40
"""

from __future__ import annotations

import argparse

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from logra_optim import LoGRAOptimizer, patch_model


def build_policy(seed: int) -> Qwen2ForCausalLM:
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
    )
    return Qwen2ForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=32, help="prompts (= responses) per update")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--kl-budget", type=float, default=2e-2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = build_policy(args.seed)
    allowed = torch.arange(0, 64, 4)  # 16 of 64 tokens: a random policy earns about 0.25
    prompt_length, response_length = 6, 8

    # The two LoGRA lines.
    model = patch_model(model)
    optimizer = LoGRAOptimizer(model, rank=args.rank, kl_budget=args.kl_budget, update_ratio=5e-2, alpha_max=10.0)

    generator = torch.Generator().manual_seed(args.seed)
    baseline = None
    for step in range(1, args.steps + 1):
        prompts = torch.randint(0, 64, (args.prompts, prompt_length), generator=generator)
        model.eval()
        with torch.no_grad():
            sequences = model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=response_length,
                min_new_tokens=response_length,
                do_sample=True,
                top_k=0,
                pad_token_id=0,
            )
        response = sequences[:, prompt_length:]
        reward = torch.isin(response, allowed).float().mean(dim=1)
        mean_reward = float(reward.mean())
        baseline = mean_reward if baseline is None else 0.9 * baseline + 0.1 * mean_reward
        advantage = reward - baseline

        model.train()
        labels = sequences.clone()
        labels[:, :prompt_length] = -100  # tells the KL probe which positions predict generated tokens
        logits = model(input_ids=sequences, labels=labels).logits[:, prompt_length - 1 : -1]
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
        loss = -(advantage.unsqueeze(1) * logprobs).sum() / response.numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

        if step == 1 or step % 10 == 0:
            stats = optimizer.stats  # q: predicted KL of the nominal step; α scales it to the budget
            print(
                f"step {step:4d}  reward {mean_reward:.3f}  baseline {baseline:.3f}  "
                f"q {stats.get('predicted_kl', float('nan')):.2e}  alpha {stats.get('alpha', float('nan')):.3g}"
            )


if __name__ == "__main__":
    main()
