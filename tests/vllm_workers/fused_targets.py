"""Sync of checkpoint-fused targets against a real in-process vLLM engine; writes a JSON summary.

A fresh process per model family: vLLM's engine state is per process, so a second in-process engine
after the first one shut down cannot start. Usage: fused_targets.py FAMILY MODEL_DIR RESULT_JSON, with
the repository root on PYTHONPATH."""

import json
import os
import sys
import warnings

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from logra_optim import LoGRAOptimizer, patch_model  # noqa: E402
from logra_optim.integrations.vllm import VLLMSync  # noqa: E402
from tests.helpers import trl_setup  # noqa: E402
from tests.helpers.vllm_helpers import (  # noqa: E402
    build_engine,
    engine_logprobs,
    max_difference,
    train_step,
    trainer_logprobs,
)

SPECIAL = dict(
    pad_token_id=trl_setup.SPECIAL["<pad>"],
    eos_token_id=trl_setup.SPECIAL["<eos>"],
    bos_token_id=trl_setup.SPECIAL["<bos>"],
)
COMMON = dict(vocab_size=trl_setup.VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, **SPECIAL)


def phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(
        Phi3Config(**COMMON, intermediate_size=128, num_key_value_heads=1, max_position_embeddings=64)
    )


def falcon():
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        **COMMON,
        new_decoder_architecture=True,  # grouped q/k/v rows per KV head, which vLLM's loader permutes
        num_kv_heads=1,
        bias=False,
        alibi=False,
        parallel_attn=True,
        max_position_embeddings=64,
    )
    return FalconForCausalLM(config)


def main(family: str, directory: str, result_path: str) -> None:
    torch.manual_seed(0)
    model = {"phi3": phi3, "falcon": falcon}[family]()
    model.save_pretrained(directory)
    trl_setup.build_tokenizer().save_pretrained(directory)
    llm = build_engine(directory)
    patch_model(model)
    optimizer = LoGRAOptimizer(model, rank=8, update_ratio=2e-2)
    sync = VLLMSync(optimizer, llm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = sync.sync()
    generator = torch.Generator().manual_seed(0)
    before = trainer_logprobs(model)
    kinds, differences = [first["kind"]], []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no drift warning, no fallback to a full sync
        for _ in range(3):
            train_step(model, optimizer, generator)
            kinds.append(sync.sync()["kind"])
            differences.append(max_difference(engine_logprobs(llm), trainer_logprobs(model)))
    result = {
        "sent_whole": sorted(name.rsplit(".", 2)[-2] for name in sync.sent_whole),
        "warnings": [str(w.message) for w in caught],
        "kinds": kinds,
        "engine_vs_trainer": differences,
        "moved": max_difference(before, trainer_logprobs(model)),
        "drift": sync.drift()["drift"],
    }
    with open(result_path, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(*sys.argv[1:4])
