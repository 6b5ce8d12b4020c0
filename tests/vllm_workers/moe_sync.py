"""Compressed sync of mixture-of-experts targets against a real in-process vLLM engine (its fused
experts layers); writes a JSON summary. A fresh process, as for fused_targets.py. Usage:
moe_sync.py MODEL_DIR RESULT_JSON, with the repository root on PYTHONPATH."""

import json
import sys
import warnings

import torch

from tests.helpers.vllm_helpers import (  # first: sets up vLLM for an engine in this process
    build_engine,
    engine_logprobs,
    max_difference,
    train_step,
    trainer_logprobs,
)
from logra_optim import LoGRAOptimizer, patch_model
from logra_optim.integrations.vllm import VLLMSync
from logra_optim.sync import PayloadError, SyncPayload, TargetUpdate, Update
from tests.helpers import trl_setup
from tests.helpers.tiny import tiny_qwen3_moe


def refused(llm, payload: SyncPayload) -> str:
    """The engine's error for ``payload``, after checking that it changed nothing."""
    before = engine_logprobs(llm), llm.collective_rpc("logra_status")[0]["index"]
    try:
        llm.collective_rpc("logra_apply", args=(payload.encode(),))
    except PayloadError as error:
        message = str(error)
    else:
        raise AssertionError("the engine applied a bad payload")
    after = engine_logprobs(llm), llm.collective_rpc("logra_status")[0]["index"]
    assert after[1] == before[1] and max_difference(after[0], before[0]) == 0.0, "a refused payload changed the engine"
    return message


def experts_placements(worker) -> dict:
    """The engine's own placements of its stacked experts weights (run on the worker)."""
    from dataclasses import asdict

    from logra_optim.integrations.vllm.engine import _updater
    from logra_optim.integrations.vllm.placement import ExpertsPlacement

    placements = _updater(worker)._engine_state()["placements"]
    return {
        name: {
            **asdict(p),
            "blocks": [
                {k: [v.start, v.stop] if isinstance(v, slice) else v for k, v in asdict(b).items()} for b in p.blocks
            ],
        }
        for name, p in placements.items()
        if isinstance(p, ExpertsPlacement)
    }


def main(directory: str, result_path: str) -> None:
    model = tiny_qwen3_moe(
        0,
        head_dim=32,  # vLLM's CPU attention needs head_dim ≥ 32
        moe_intermediate_size=32,  # a multiple of the CPU experts kernel's alignment (else it pads)
        vocab_size=trl_setup.VOCAB_SIZE,
        pad_token_id=trl_setup.SPECIAL["<pad>"],
        eos_token_id=trl_setup.SPECIAL["<eos>"],
        bos_token_id=trl_setup.SPECIAL["<bos>"],
    )
    model.save_pretrained(directory)
    trl_setup.build_tokenizer().save_pretrained(directory)
    llm = build_engine(directory)
    patch_model(model)
    optimizer = LoGRAOptimizer(model, rank=8, expert_rank=4, update_ratio=2e-2)
    sync = VLLMSync(optimizer, llm, check_every=2)
    first = sync.sync()
    status = llm.collective_rpc("logra_status")[0]
    placements = llm.collective_rpc(experts_placements)[0]
    unknown = sync.engine.unknown(["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.w13"])
    generator = torch.Generator().manual_seed(0)
    before = trainer_logprobs(model)
    experts_before = {t.name: t.weight.detach().clone() for t in optimizer.targets if t.experts > 1}
    kinds, differences, expert_factor_bytes = [first["kind"]], [], 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no drift warning, no fallback to a full sync
        for _ in range(4):
            train_step(model, optimizer, generator)
            pending = sync.recorder.pending[-1]
            expert_factor_bytes += sum(
                t.factor.numel() * t.factor.element_size() for t in pending.targets if "experts" in t.name
            )
            kinds.append(sync.sync()["kind"])
            differences.append(max_difference(engine_logprobs(llm), trainer_logprobs(model)))
    experts_moved = {
        name: [float((t.weight.detach() - experts_before[name])[e].norm()) for e in range(t.experts)]
        for name, t in ((t.name, t) for t in optimizer.targets if t.experts > 1)
    }

    # Bad payloads naming expert weights: refused before anything changes
    train_step(model, optimizer, generator)
    good = sync.recorder.drain()
    update = good.updates[0]
    experts_at = next(i for i, t in enumerate(update.targets) if t.name.endswith("experts.gate_up_proj"))

    def with_target(**fields):
        targets = list(update.targets)
        targets[experts_at] = TargetUpdate(**{**targets[experts_at].__dict__, **fields})
        return SyncPayload(good.rank, good.projection, (Update(update.index, tuple(targets)),), good.expert_rank)

    expert_factor = update.targets[experts_at].factor
    messages = {
        "linear rank": refused(llm, with_target(factor=torch.zeros(expert_factor.shape[0], good.rank))),
        "rows": refused(llm, with_target(factor=torch.zeros(expert_factor.shape[0] + 1, good.expert_rank))),
        "name": refused(llm, with_target(name="model.layers.0.mlp.experts.gate_proj")),
    }
    llm.collective_rpc("logra_apply", args=(good.encode(),))
    llm.reset_prefix_cache()
    result = {
        "mode": status["mode"],
        "kinds": kinds,
        "engine_vs_trainer": differences,
        "after_bad_payloads": max_difference(engine_logprobs(llm), trainer_logprobs(model)),
        "moved": max_difference(before, trainer_logprobs(model)),
        "experts_moved": experts_moved,
        "drift": sync.drift(),
        "compressed_bytes": [h["bytes"] for h in sync.history[1:]],
        "full_bytes": sync.history[0]["bytes"],
        "expert_factor_bytes": expert_factor_bytes,
        "refusals": messages,
        "expert_targets": sorted(t.parameter_name for t in optimizer.targets if t.experts > 1),
        "placements": placements,
        "unknown": unknown,
    }
    with open(result_path, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(*sys.argv[1:3])
