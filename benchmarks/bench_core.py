"""Core benchmark: peak memory and step time of a LoGRA training step against dense AdamW.

The model is a Qwen2-architecture causal LM built from a ``Qwen2Config`` (random weights, fp32, SDPA
attention, nothing downloaded), trained on a fixed random token batch with the plain causal-LM loss.

Methods
    ``adamw-targets``  AdamW on exactly the LoGRA target weights (attention and MLP projections),
                       everything else frozen: the fair baseline, same trainable set as LoGRA.
    ``adamw-full``     AdamW on every parameter: what a dense fine-tune usually does.
    ``logra-sgd``      ``LoGRAOptimizer(patch_model(model), rank=--rank, optimizer="sgd")``.
    ``logra-rowadam``  the same with ``optimizer="rowadam"``, at ``--rank`` and every ``--ranks``.
    AdamW uses the paper's dense control settings (betas 0.9/0.95, lr 1e-6) and torch's default
    implementation for the device.

Default shapes
    hidden 1536 (head_dim 128, as Qwen2.5-1.5B), 4 layers, intermediate 4224 (2.75×), vocab 32000,
    batch 2 × seq 512. The 4 KV heads (k/v out 512) allow ranks up to 512. n = 1024 tokens per step is
    4× the headline rank, so a LoGRA backward's skipped ``d×k`` weight-gradient products show, and one
    process still finishes in about 1.5 minutes on 2 shared cores.

How it is measured, and why
    * Every configuration runs in a fresh process (this script re-invoked with ``--worker``), so that
      the peak memory of one cannot be inherited from another and allocator or thread-pool state
      does not leak between them. The worker prints one JSON object on stdout.
    * The configurations run round-robin, ``--rounds`` times, so that a change of the machine's
      load during the run is spread over all of them instead of landing on a few.
    * A step is a full training step: forward, ``loss.backward()``, ``opt.step()``,
      ``opt.zero_grad()``. Each process runs ``--warmup`` steps first (AdamW allocates its moments
      on its first step), then ``--runs`` timed steps. The steps of all rounds are pooled and their
      median is reported, with the median optimizer part (step + zero_grad), and the fastest step.
      The median, not the mean, because this 2-core machine is shared and outliers come from other
      processes; the fastest step too (and its ratios), because load from other processes only ever
      adds time, so the minimum is the best estimate of a quiet machine's step time when the load
      comes and goes.
    * Peak memory on CPU: the process's peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``) minus the
      RSS right after the imports, before the model is built; what remains is weights, optimizer
      state, gradients or sketches, and activations. The absolute peak is reported too. On CUDA:
      ``torch.cuda.max_memory_allocated`` (tensor memory only, so the baseline is zero). The highest
      peak over the rounds is kept.
    * Ratios are taken against both AdamW baselines measured in the same invocation; the column
      names say which one.

Run ``python benchmarks/bench_core.py --help`` for the options; the defaults are the README's run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from logra_optim.cli.measure import peak_rss_bytes

BASELINES = ("adamw-targets", "adamw-full")
METHODS = (*BASELINES, "logra-sgd", "logra-rowadam")
# The worker's shape and timing options, forwarded verbatim from the parent.
FORWARDED = (
    "hidden",
    "layers",
    "intermediate",
    "heads",
    "kv_heads",
    "vocab",
    "seq",
    "batch",
    "warmup",
    "runs",
    "threads",
    "device",
    "seed",
    "checkpointing",
)
GIB = 2**30


# --------------------------------------------------------------------------------------------------
# Worker: one configuration, one process


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = Qwen2ForCausalLM(config)
    if args.checkpointing:
        # As TRL's trainers do by default; recomputes each decoder layer's activations in backward.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(torch.float32).train()


def make_optimizer(model: torch.nn.Module, method: str, rank: int) -> torch.optim.Optimizer:
    """The optimizer of ``method``; freezes what the method does not train."""
    from logra_optim import LoGRAOptimizer, find_target_modules, patch_model

    if method.startswith("logra-"):
        return LoGRAOptimizer(patch_model(model), rank=rank, optimizer=method.removeprefix("logra-"))
    if method == "adamw-targets":
        targets = {id(module.weight) for _, module in find_target_modules(model)}
        for param in model.parameters():
            param.requires_grad_(id(param) in targets)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=1e-6, betas=(0.9, 0.95))


def random_batch(args: argparse.Namespace) -> torch.Tensor:
    generator = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator).to(args.device)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_step(model, optimizer, input_ids: torch.Tensor, device: str) -> tuple[float, float]:
    """One training step; returns (forward+backward seconds, step+zero_grad seconds)."""
    synchronize(device)
    start = time.perf_counter()
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    synchronize(device)
    middle = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad()
    synchronize(device)
    return middle - start, time.perf_counter() - middle


def run_worker(args: argparse.Namespace) -> dict:
    """Measure one configuration in this (fresh) process: raw step times and the memory peak."""
    # Everything the step uses is imported before the memory baseline is taken.
    from transformers import Qwen2ForCausalLM  # noqa: F401  (resolves transformers' lazy import)

    import logra_optim  # noqa: F401

    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    baseline = torch.cuda.memory_allocated() if cuda else peak_rss_bytes()

    model = build_model(args)
    optimizer = make_optimizer(model, args.worker, args.rank)
    input_ids = random_batch(args)
    for _ in range(args.warmup):
        timed_step(model, optimizer, input_ids, args.device)
    fwd_bwd, optim = zip(*(timed_step(model, optimizer, input_ids, args.device) for _ in range(args.runs)))

    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()
    return {
        "fwd_bwd_s": fwd_bwd,
        "optim_s": optim,
        "peak_bytes": peak - baseline,
        "peak_abs_bytes": peak,
        "trained_params": sum(p.numel() for group in optimizer.param_groups for p in group["params"]),
        "total_params": sum(p.numel() for p in model.parameters()),
    }


# --------------------------------------------------------------------------------------------------
# Parent: run every configuration, compare, report


@dataclass(frozen=True)
class Configuration:
    method: str
    rank: int

    @property
    def label(self) -> str:
        return self.method if self.method in BASELINES else f"{self.method} r={self.rank}"


def configurations(args: argparse.Namespace) -> list[Configuration]:
    """Baselines first, then LoGRA SGD at ``--rank``, then RowAdam at ``--rank`` and the sweep."""
    configs = []
    for method in args.methods:
        if method == "logra-rowadam":
            ranks = sorted({args.rank, *args.ranks})
        elif method == "logra-sgd":
            ranks = [args.rank]
        else:
            ranks = [0]
        configs += [Configuration(method, rank) for rank in ranks]
    return configs


def run_configuration(args: argparse.Namespace, config: Configuration) -> dict:
    """Run one configuration in a fresh subprocess and return the worker's JSON."""
    command = [sys.executable, __file__, "--worker", config.method, "--rank", str(config.rank)]
    for name in FORWARDED:
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    process = subprocess.run(command, capture_output=True, text=True, check=False)
    if process.returncode != 0:
        raise RuntimeError(f"{config.label} failed (exit {process.returncode}):\n{process.stderr[-4000:]}")
    return json.loads(process.stdout.strip().splitlines()[-1])


def summarize(config: Configuration, samples: list[dict]) -> dict:
    """Pool the steps of every round of one configuration: medians of the times, highest peak."""
    fwd_bwd = [t for s in samples for t in s["fwd_bwd_s"]]
    optim = [t for s in samples for t in s["optim_s"]]
    steps = [a + b for a, b in zip(fwd_bwd, optim)]
    return {
        "label": config.label,
        "method": config.method,
        "rank": config.rank if config.method not in BASELINES else None,
        "trained_params": samples[0]["trained_params"],
        "total_params": samples[0]["total_params"],
        "step_s": statistics.median(steps),
        "step_min_s": min(steps),
        "fwd_bwd_s": statistics.median(fwd_bwd),
        "optim_s": statistics.median(optim),
        "step_times_s": steps,
        "peak_bytes": max(s["peak_bytes"] for s in samples),
        "peak_abs_bytes": max(s["peak_abs_bytes"] for s in samples),
    }


def add_ratios(results: list[dict]) -> None:
    """Add ``mem_vs_<baseline>``, ``time_vs_<baseline>`` (median steps) and ``best_vs_<baseline>``
    (fastest steps) to every result, for each baseline that was run."""
    baselines = {r["method"]: r for r in results if r["method"] in BASELINES}
    for result in results:
        for name, base in baselines.items():
            result[f"mem_vs_{name}"] = result["peak_bytes"] / base["peak_bytes"]
            result[f"time_vs_{name}"] = result["step_s"] / base["step_s"]
            result[f"best_vs_{name}"] = result["step_min_s"] / base["step_min_s"]


def table_rows(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Column headers and formatted cells shared by the console and markdown tables."""
    baselines = [b for b in BASELINES if any(r["method"] == b for r in results)]
    headers = [
        "method",
        "trained params",
        "step s (median)",
        "step s (min)",
        "optim s (median)",
        "peak Δ GiB",
        "peak abs GiB",
    ]
    for base in baselines:
        headers += [f"mem / {base}", f"time / {base}", f"min time / {base}"]
    rows = []
    for r in results:
        row = [
            r["label"],
            f"{r['trained_params'] / 1e6:.1f} M",
            f"{r['step_s']:.2f}",
            f"{r['step_min_s']:.2f}",
            f"{r['optim_s']:.2f}",
            f"{r['peak_bytes'] / GIB:.2f}",
            f"{r['peak_abs_bytes'] / GIB:.2f}",
        ]
        for base in baselines:
            row += [f"{r[f'{kind}_vs_{base}']:.2f}×" for kind in ("mem", "time", "best")]
        rows.append(row)
    return headers, rows


def describe(meta: dict) -> str:
    shape = meta["shape"]
    return (
        f"Qwen2-architecture, {meta['total_params'] / 1e6:.0f} M parameters: hidden {shape['hidden']}, "
        f"{shape['layers']} layers, intermediate {shape['intermediate']}, {shape['heads']} heads / "
        f"{shape['kv_heads']} KV heads (head_dim {shape['hidden'] // shape['heads']}), vocab {shape['vocab']}; "
        f"batch {shape['batch']} × seq {shape['seq']} = {shape['batch'] * shape['seq']} tokens/step; fp32, SDPA; "
        f"gradient checkpointing {'on' if shape['checkpointing'] else 'off'}; "
        f"{meta['device']}, {shape['threads']} threads; medians of {shape['rounds'] * shape['runs']} steps "
        f"({shape['rounds']} fresh processes × {shape['runs']} steps after {shape['warmup']} warm-up)"
    )


def print_table(results: list[dict], meta: dict) -> None:
    headers, rows = table_rows(results)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(describe(meta))
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
        for line in [headers, ["-" * w for w in widths], *rows]:
            print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))
        return
    table = Table(title=describe(meta), title_justify="left")
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        table.add_row(*row)
    # A wide table: do not let a pipe's default 80 columns squeeze it.
    Console(width=None if sys.stdout.isatty() else 240).print(table)


def markdown(results: list[dict], meta: dict) -> str:
    headers, rows = table_rows(results)
    memory = "peak RSS" if meta["device"] == "cpu" else "torch.cuda.max_memory_allocated"
    lines = [
        f"{describe(meta)}.",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        (
            f"peak Δ: peak memory of the training process ({memory}) above what it held after its imports; "
            "`mem / X`, `time / X` and `min time / X` divide peak Δ, the median and the fastest step time "
            "by those of AdamW baseline X "
            "(`adamw-targets`: AdamW on the LoGRA target weights only, everything else frozen; "
            "`adamw-full`: AdamW on every parameter)."
        ),
    ]
    return "\n".join(lines) + "\n"


def environment(args: argparse.Namespace, argv: list[str]) -> dict:
    import transformers

    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    return {
        "command": " ".join(["python", "benchmarks/bench_core.py", *argv]),
        "device": device,
        "machine": platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "shape": {name: getattr(args, name) for name in (*FORWARDED, "rounds") if name != "device"},
    }


def run_parent(args: argparse.Namespace, argv: list[str]) -> None:
    """Run the configurations round-robin, ``--rounds`` times, so that a change in the machine's
    load over the run is spread over all of them instead of landing on a few."""
    meta = environment(args, argv)
    configs = configurations(args)
    samples: dict[Configuration, list[dict]] = {config: [] for config in configs}
    started = time.perf_counter()
    for round_index in range(1, args.rounds + 1):
        for config in configs:
            sample = run_configuration(args, config)
            samples[config].append(sample)
            step = statistics.median(a + b for a, b in zip(sample["fwd_bwd_s"], sample["optim_s"]))
            elapsed = time.perf_counter() - started
            print(
                f"round {round_index}/{args.rounds} {config.label}: {step:.2f} s/step, peak Δ "
                f"{sample['peak_bytes'] / GIB:.2f} GiB ({elapsed:.0f} s)",
                file=sys.stderr,
            )
    meta["total_wall_s"] = time.perf_counter() - started
    results = [summarize(config, runs) for config, runs in samples.items()]
    meta["total_params"] = results[0]["total_params"]
    add_ratios(results)
    print_table(results, meta)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results, meta))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=4224)
    p.add_argument("--heads", type=int, default=12, help="attention heads; head_dim = hidden / heads")
    p.add_argument("--kv-heads", type=int, default=4, help="KV heads (k/v out = kv_heads × head_dim must be ≥ rank)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rank", type=int, default=256, help="rank of the headline LoGRA SGD and RowAdam runs")
    p.add_argument(
        "--ranks",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[16, 64, 256, 512],
        help="RowAdam rank sweep, comma-separated",
    )
    p.add_argument(
        "--methods",
        type=lambda s: s.split(","),
        default=list(METHODS),
        help=f"comma-separated subset of {','.join(METHODS)}",
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--runs", type=int, default=3, help="timed steps per process")
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per configuration, run round-robin")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in each worker")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--checkpointing",
        type=int,
        choices=(0, 1),
        default=0,
        help="1: non-reentrant gradient checkpointing in every method (TRL trainers default to it)",
    )
    p.add_argument("--json", metavar="PATH", help="write the results and the environment as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write a markdown table for the README")
    p.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    if args.runs < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--runs and --rounds must be ≥ 1, --warmup ≥ 0")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args)))
    else:
        run_parent(args, argv)


if __name__ == "__main__":
    main()
