"""Shared pieces of the vLLM tests: a real in-process engine on the tiny policy, log-prob readers
for engine and trainer, and real LoGRA updates to sync."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: ~3 s to start
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch

from tests.helpers import trl_setup

PROMPTS = [[3, 7, 11, 2, 40, 41, 9, 12, 30, 5], [20, 21, 22, 23, 24, 25, 26], [59, 0, 58, 1, 57, 2]]


def build_engine(path: str, **overrides):
    from vllm import LLM

    from logra_optim.integrations.vllm import EXTENSION

    options = dict(
        model=path, dtype="float32", enforce_eager=True, max_model_len=64, seed=0, worker_extension_cls=EXTENSION
    )
    options.update(overrides)
    return LLM(**options)


def engine_logprobs(llm, prompts=PROMPTS) -> list[torch.Tensor]:
    """Log-probability the engine gives each prompt token after the first."""
    from vllm import SamplingParams

    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )
    return [
        torch.tensor(
            [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])], dtype=torch.float64
        )
        for out, prompt in zip(outputs, prompts)
    ]


@torch.no_grad()
def trainer_logprobs(model, prompts=PROMPTS) -> list[torch.Tensor]:
    result = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
        result.append(logprobs[torch.arange(len(prompt) - 1), ids[0, 1:]])
    return result


def max_difference(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(first, second))


def train_step(model, optimizer, generator: torch.Generator) -> None:
    """One real LoGRA update: next-token loss on random sequences of the toy vocabulary."""
    model.train()
    ids = torch.randint(0, trl_setup.N_WORDS, (4, 12), generator=generator)
    logits = model(input_ids=ids).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
