"""Distributed benchmark: what LoGRA's sketch reduction communicates, and its step time, on 2 ranks.

Two data-parallel ranks (``torchrun --nproc_per_node 2``, gloo on this CPU machine, NCCL with
``--device cuda``) train a Qwen2-architecture model built from a config (random fp32 weights, SDPA,
nothing downloaded) on fixed random tokens, each rank its own half of the batch.

Methods, under the same engine
    ``adamw-targets``  AdamW (0.9/0.95) on exactly LoGRA's target matrices, everything else frozen.
    ``logra``          ``LoGRAOptimizer(patch_model(model), rank=r, direction="rowadam")`` at every
                       ``--ranks`` (RowAdam: the stored results' direction, the default then).
    Both train the final norm too (AdamW): DDP refuses a model without a trainable parameter, and it
    is the same 1 × hidden vector for both.

Engines
    ``ddp``    ``DistributedDataParallel``: dense gradients all-reduced in buckets by DDP's reducer.
    ``fsdp2``  ``fully_shard`` on every decoder layer and the root: parameters all-gathered for
               forward and backward (the same for both methods), dense gradients reduce-scattered.
    ``zero2``, ``zero3`` (``--engines``, not in the default run)  DeepSpeed: the engine's optimizer
               is AdamW on the targets (dense) or on the norm (LoGRA, stepped beside the engine).

What is measured, and how
    * Bytes: every collective LoGRA issues goes through ``torch.distributed.all_reduce`` /
      ``all_gather``; the worker wraps those and records the bytes of the tensors passed, per step.
      DDP's gradient buckets go through a communication hook that issues the default all-reduce via
      ``torch.distributed.all_reduce``, so they are counted the same way. Under FSDP2 the parameter
      all-gathers are identical for both methods and not counted; the dense gradient reduce-scatter
      input (the trainable parameters' fp32 gradients) is computed from their sizes, marked
      ``computed`` in the results; the same for DeepSpeed, whose ZeRO-3 reductions on the CPU do not
      go through ``torch.distributed``. Bytes are what one rank hands to the collectives per step.
    * Time: every configuration in a fresh pair of processes (``runner.run_fresh`` under
      torchrun), ``--warmup`` steps, then ``--steps`` timed steps (forward, backward, optimizer
      step, zero_grad; a barrier before each, the slower rank's time); median reported. This 2-core
      machine is shared with other jobs: the load average at the start and end of the run is
      recorded with the results.

``python benchmarks/bench_distributed.py --help`` lists the options; the defaults are the run in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from logra_optim import LoGRAOptimizer, find_target_modules, patch_model
from logra_optim.cli.bench import TORCH_ADAMW
from logra_optim.cli.runner import WorkerFailed, run_fresh

METHODS = ("adamw-targets", "logra")
DIRECTION = "rowadam"  # the stored results' (the optimizer's default when they were measured)
ENGINES = ("ddp", "fsdp2", "zero2", "zero3")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", default=["ddp", "fsdp2"], choices=ENGINES)
    parser.add_argument("--ranks", nargs="+", type=int, default=[64, 256], help="LoGRA sketch ranks")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", help="write the results table here")
    return parser.parse_args(argv)


# --------------------------------------------------------------------------------------------------
# Worker: one configuration on one rank


class ByteCounter:
    """Records the bytes of tensors passed to ``torch.distributed`` collectives while active."""

    def __init__(self):
        self.bytes, self.calls, self.active = 0, 0, False
        # Which argument is the tensor this rank contributes (position, keyword).
        for name, position, keyword in (
            ("all_reduce", 0, "tensor"),
            ("all_gather", 1, "tensor"),
            ("all_gather_into_tensor", 1, "input_tensor"),
            ("reduce_scatter_tensor", 1, "input"),
        ):
            setattr(dist, name, self._wrap(getattr(dist, name), position, keyword))

    def _wrap(self, original, position: int, keyword: str):
        def counted(*args, **kwargs):
            if self.active:
                sent = args[position] if len(args) > position else kwargs[keyword]
                self.bytes += sent.numel() * sent.element_size()
                self.calls += 1
            return original(*args, **kwargs)

        return counted


def build(args, method: str, device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq, 64),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device)
    model.config._attn_implementation = "sdpa"
    if method == "logra":
        patch_model(model)
    else:
        targets = {id(m.weight) for _, m in find_target_modules(model)}
        for p in model.parameters():
            p.requires_grad_(id(p) in targets)
    model.model.norm.weight.requires_grad_(True)
    model.train()
    return model


def _train_step(wrapped, opt, engine_optimizer, input_ids) -> None:
    """Forward, backward, optimizer step, zero_grad; under DeepSpeed its engine steps (and LoGRA,
    when it trains the targets, beside it)."""
    loss = wrapped(input_ids=input_ids, labels=input_ids).loss
    if engine_optimizer is not None:  # DeepSpeed
        wrapped.backward(loss)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        wrapped.step()
        return
    loss.backward()
    opt.step()
    opt.zero_grad()


def worker(spec: dict) -> dict | None:
    """One configuration on this rank (torchrun starts one per rank); rank 0 returns the record."""
    args = SimpleNamespace(**spec)
    engine, method, rank_r = args.engine, args.method, args.rank
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(device)
    if engine.startswith("zero"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    else:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    counter = ByteCounter()
    model = build(args, method, device)
    adamw = lambda params: torch.optim.AdamW(params, **TORCH_ADAMW)  # noqa: E731
    computed_gradient_bytes = 0
    # Before any engine shards them.
    target_params = sum(module.weight.numel() for _, module in find_target_modules(model))
    if engine == "ddp":
        wrapped = DistributedDataParallel(model)
        # DDP's default bucket all-reduce, but issued through ``torch.distributed.all_reduce`` (so the
        # counter sees every gradient bucket) instead of from C++.
        wrapped.register_comm_hook(None, allreduce_hook)
    elif engine == "fsdp2":
        for layer in model.model.layers:
            fully_shard(layer)
        wrapped = fully_shard(model)
        computed_gradient_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    engine_optimizer = None
    if engine.startswith("zero"):
        import deepspeed

        # The engine wraps the optimizer of the trainable parameters: every target (dense) or the
        # final norm (LoGRA, which updates the targets beside it).
        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": int(engine[-1])},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        trainable = [p for p in model.parameters() if p.requires_grad]
        computed_gradient_bytes = sum(p.numel() * 4 for p in trainable)  # before ZeRO-3 partitions them
        wrapped, engine_optimizer, *_ = deepspeed.initialize(model=model, optimizer=adamw(trainable), config=config)
        opt = (
            LoGRAOptimizer(model, rank=rank_r, direction=DIRECTION, non_target_optimizer="external")
            if method == "logra"
            else None
        )
    elif method == "logra":
        opt = LoGRAOptimizer(model, rank=rank_r, direction=DIRECTION, non_target_optimizer=adamw)
    else:
        opt = adamw([p for p in model.parameters() if p.requires_grad])
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator).to(device)

    times, per_step_bytes = [], []
    for index in range(args.warmup + args.steps):
        dist.barrier()
        if args.device == "cuda":
            torch.cuda.synchronize()
        counter.bytes = counter.calls = 0
        counter.active = index >= args.warmup
        started = time.perf_counter()
        _train_step(wrapped, opt, engine_optimizer, input_ids)
        if args.device == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        counter.active = False
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if index >= args.warmup:
            times.append(float(elapsed))
            per_step_bytes.append(counter.bytes)
    record = None
    if dist.get_rank() == 0:
        sketch_bytes = sum(b.numel() * b.element_size() for b in opt.sketch_buffers()) if method == "logra" else 0
        record = {
            "engine": engine,
            "method": method,
            "rank": rank_r,
            "step_seconds": statistics.median(times),
            "step_seconds_all": times,
            "measured_bytes_per_step": statistics.median(per_step_bytes),
            "computed_dense_gradient_bytes": computed_gradient_bytes,
            "sketch_buffer_bytes": sketch_bytes,
            "target_params": target_params,
        }
    # Free the engine while the process group lives. A DDP reducer freed after
    # destroy_process_group destroys the group itself, joining gloo's threads with the GIL held,
    # which deadlocks when one of them still needs the GIL to release a tensor.
    del wrapped, engine_optimizer, opt, model
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return record


# --------------------------------------------------------------------------------------------------
# Driver


# torchrun's form of ``python -m``: two ranks on this machine, each running the worker module.
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--module")
SHAPE = ("hidden", "layers", "intermediate", "heads", "kv_heads", "vocab", "batch", "seq", "warmup", "steps", "device")


def run_configuration(args, engine: str, method: str, rank_r: int | None) -> dict:
    spec = {**{name: getattr(args, name) for name in SHAPE}, "engine": engine, "method": method, "rank": rank_r}
    label = f"{engine}/{method}/{rank_r}"
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    for attempt in (1, 2):  # one retry: a DeepSpeed ZeRO-3 worker was once seen to abort on this machine
        try:
            return {**run_fresh(worker, spec, label=label, env=env, launcher=TORCHRUN), "attempts": attempt}
        except WorkerFailed as failure:
            if attempt == 2:
                raise
            print(f"{failure} (attempt {attempt}, retrying)", file=sys.stderr)


def main(argv=None) -> None:
    args = parse_args(argv)
    load_before = os.getloadavg()
    rows = []
    for engine in args.engines:
        configurations = [("adamw-targets", None)] + [("logra", r) for r in args.ranks]
        for method, rank_r in configurations:
            row = run_configuration(args, engine, method, rank_r)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "step_seconds_all"}), flush=True)
    for row in rows:
        dense = next(r for r in rows if r["engine"] == row["engine"] and r["method"] == "adamw-targets")
        measured = row["engine"] == "ddp"
        dense_bytes = dense["measured_bytes_per_step"] if measured else dense["computed_dense_gradient_bytes"]
        if measured:
            own_bytes = row["measured_bytes_per_step"]
        elif row["method"] == "adamw-targets":
            own_bytes = row["computed_dense_gradient_bytes"]
        else:  # LoGRA's sketch all-reduce (measured) + the norm's gradient reduction (computed)
            own_bytes = row["measured_bytes_per_step"] + row["computed_dense_gradient_bytes"]
        row["gradient_bytes_per_step"] = own_bytes
        row["bytes_vs_dense"] = own_bytes / dense_bytes
        row["time_vs_dense"] = row["step_seconds"] / dense["step_seconds"]
    results = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "markdown")},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "rows": rows,
    }
    table = markdown(rows)
    print(table)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(table + "\n")


def markdown(rows) -> str:
    lines = [
        "| engine | method | gradient-reduction MB / step | vs dense | sketch / dense targets | step s "
        "| time vs dense |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        name = "AdamW (targets)" if row["method"] == "adamw-targets" else f"LoGRA r={row['rank']}"
        source = " (computed)" if row["engine"] != "ddp" and row["method"] == "adamw-targets" else ""
        ratio = "" if row["method"] != "logra" else f"{row['sketch_buffer_bytes'] / (4 * row['target_params']):.3f}"
        lines.append(
            f"| {row['engine']} | {name} | {row['gradient_bytes_per_step'] / 2**20:.2f}{source} | "
            f"{row['bytes_vs_dense']:.3f}× | {ratio} | {row['step_seconds']:.2f} | {row['time_vs_dense']:.2f}× |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
