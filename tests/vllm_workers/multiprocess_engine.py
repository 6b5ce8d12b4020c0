"""VLLMSync against vLLM's default engine, which runs in a separate process (the README's example):
a full sync and 4 compressed ones; writes a JSON summary.

Usage: multiprocess_engine.py OUTPUT_DIR RESULT_JSON, with the repository root on PYTHONPATH."""

import json
import os
import sys

from tests.helpers import vllm_helpers  # noqa: F401  (sets the engine environment defaults; the next line undoes one)

os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)

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

if __name__ == "__main__":  # the engine process is spawned: keep module-level work out of its import
    output, result_path = sys.argv[1], sys.argv[2]
    llm = build_engine(trl_setup.save_policy(os.path.join(output, "policy")))
    model = patch_model(trl_setup.build_policy())
    optimizer = LoGRAOptimizer(model, rank=8, update_ratio=2e-2)
    sync = VLLMSync(optimizer, llm, check_every=2)
    kinds = [sync.sync()["kind"]]
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        train_step(model, optimizer, generator)
        stats = sync.sync()
        kinds.append(stats["kind"])
    json.dump(
        {
            "multiprocess": type(llm.llm_engine.engine_core).__name__,
            "kinds": kinds,
            "drift": stats["drift"],
            "engine_vs_trainer": max_difference(engine_logprobs(llm), trainer_logprobs(model)),
        },
        open(result_path, "w"),
    )
    # An explicit shutdown with time to finish: at interpreter exit vLLM gives the engine process 5 s,
    # then kills it, and the abandoned client thread aborts this process (seen in about 1 run of 3).
    llm.llm_engine.engine_core.shutdown(timeout=60)
