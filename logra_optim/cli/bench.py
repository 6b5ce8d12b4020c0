"""``logra bench``: peak memory and step time of one training step, LoGRA against its peers.

Methods (all on the same model, batch and loss; ``--rank`` is shared by the low-rank ones)
    ``adamw``          ``torch.optim.AdamW`` on every parameter: the dense baseline of every ratio.
    ``adamw-targets``  AdamW on exactly LoGRA's target weights, everything else frozen: the
                       like-for-like reference (same trainable set as LoGRA; not run by default).
    ``adamw8bit``      bitsandbytes' ``AdamW8bit`` on every parameter (when bitsandbytes imports).
    ``lora``           peft LoRA (``r = rank``, ``lora_alpha = 2r``, no dropout) on LoGRA's target
                       modules, AdamW on the adapters, base weights frozen.
    ``galore``         ``galore_torch.GaLoreAdamW``: rank-``r`` GaLore on the target weights (projection
                       refreshed every 200 steps, scale 0.25, as its README), plain AdamW on the rest.
    ``apollo``         ``apollo_torch.APOLLOAdamW``: rank-``r`` APOLLO on the target weights (random
                       projection, channel-wise scaling, scale 1, refreshed every 200 steps, as its
                       README), plain AdamW on the rest.
    ``apollo-mini``    the same with APOLLO-Mini's settings: rank 1, tensor-wise scaling, scale 128.
    ``flora``          ``flora_opt``'s ``Flora`` (rank-``r`` compressed momentum, factorised second
                       moment) on every parameter.
    ``frozen``         the floor, not a method: the same forward and backward with every weight
                       frozen (input embeddings' output requires grad, so backward runs through
                       every layer), no weight gradient, no optimizer.
    ``logra-sgd``      ``LoGRAOptimizer(patch_model(model), rank=r, direction="sgd")``.
    ``logra-rowadam``  the same with RowAdam, at ``--rank`` and each rank of ``--ranks``.
    ``logra-orthogonal`` the same with orthogonal directions (the optimizer's default).
    Dense optimizers use the paper's control settings (lr 1e-6, betas 0.9/0.95).

How it is measured: each configuration runs in a fresh process (``runner.run_fresh``), so peaks
cannot leak between configurations; configurations run round-robin ``--rounds`` times, so a change
of the machine's load spreads over all of them, and each round starts one configuration later than
the one before (:func:`rotated`), so that none always runs first. A step is forward,
``loss.backward()``, ``step()``, ``zero_grad()``; with ``--accumulation N`` the step takes N
forward+backward microbatches of ``--batch``×``--seq`` before ``step()`` (``--checkpointing``:
non-reentrant gradient checkpointing, as TRL's trainers default to); ``--warmup`` steps first
(optimizers allocate state on their first step), then ``--runs`` timed steps. Reported: the median
over all timed steps, and the peak memory (RSS above the level when the run starts on CPU,
``max_memory_allocated`` on CUDA), highest over rounds. Before that level is taken, a CPU worker
runs its method for two steps on a model of the same kind shrunk to at most two layers, heads of 16
and 256 words (:func:`warm_code_paths`): RSS counts the library code a method pages in on its first
steps (about 25 MiB for LoGRA with the KL probe at h1024), which is not training memory.
``code_warmed`` in ``bench.json`` says whether it ran, and ``file_pages_paged_in_bytes`` how much
file-backed memory (``RssFile``) the measured steps still paged in. ``bench.json`` also keeps the
fastest step (load from other processes only ever adds time, so on a shared machine it is the best
estimate of a quiet one), the median optimizer part (``step`` + ``zero_grad``) and the absolute
peak; ``--detail`` puts them in the table too, with the paired time ratio (:func:`paired_ratio`: per
round, the configuration's median step over the reference's in the same round, then the median over
rounds). Ratios divide by dense AdamW, and by AdamW on the targets when it ran, measured in the same
invocation.

Above the floor: with ``frozen`` and ``adamw`` in the run, each method's peak minus the floor's and
minus the state its optimizer keeps between steps (:func:`state_bytes`), as a share of dense
AdamW's peak: what a method adds beyond the activations every method keeps and its own state
(transient buffers, the KL probe, allocator retention). LoRA's adapter weights and gradients are
not optimizer state, so they count above it.

CPU peaks are the process's RSS high-water mark, which counts what the C allocator keeps as well
as live tensors. glibc's ``malloc`` raises its mmap threshold (up to 32 MiB) each time a large
block is freed, after which blocks below it come from its heap, where freed memory stays resident
and fragmented; an RSS peak then grows over steps (the frozen floor's by 0.05 GiB over three steps
at the h1024 shape, docs/benchmarks.md). ``--malloc-threshold fixed`` starts every worker with
``MALLOC_MMAP_THRESHOLD_`` set to glibc's initial 128 KiB, which turns the adjustment off: each
tensor of 128 KiB or more is then a mapping of its own, returned when freed, and the peak counts
the tensors alive at once, as ``max_memory_allocated`` does on CUDA. Fresh mappings are zeroed by
the kernel, so step times may differ from the default's; every configuration runs alike. Other C
libraries ignore the variable.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib
import inspect
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from logra_optim import LoGRAOptimizer, patch_model
from logra_optim.probe import words_to_sample

from .arguments import (
    choice_list,
    device,
    int_list,
    model_dir,
    positive_float,
    positive_int,
    probe_words,
    writable_dir,
)
from .measure import (
    GIB,
    memory_baseline,
    model_parameters,
    peak_memory,
    ratio,
    release_freed_heap,
    reset_peak_rss,
    resident_file_bytes,
    resolve_device,
    source_revision,
    synchronize,
)
from .peers import (
    FIXED_RANKS,
    LOW_RANK_PEERS,
    PEER_MODULES,
    lora_model,
    low_rank_optimizer,
    train_only_targets,
    trainable,
)
from .runner import run_fresh
from .shapes import DEFAULT_LAYERS, PRESETS, Shape, expert_count, preset_config

METHODS = (
    "adamw",
    "adamw-targets",
    "adamw8bit",
    "lora",
    "galore",
    "apollo",
    "apollo-mini",
    "flora",
    "frozen",
    "logra-sgd",
    "logra-rowadam",
    "logra-orthogonal",
)
DEFAULT_METHODS = tuple(m for m in METHODS if m != "adamw-targets")
# Methods without a rank (``frozen`` is the floor), and the references whose ratios the table shows.
DENSE = ("adamw", "adamw-targets", "adamw8bit", "frozen")
REFERENCES = {"adamw": "AdamW", "adamw-targets": "AdamW targets"}
# The dense optimizers' settings (also the distributed benchmark's).
DENSE_ADAMW = dict(lr=1e-6, betas=(0.9, 0.95))
# torch's AdamW as transformers' Trainer (and so TRL) builds it by default, ``optim="adamw_torch_fused"``:
# its fused kernel, on the CPU too. Without it, torch steps CPU tensors one at a time, several
# times slower, which would flatter every method compared with dense AdamW.
TORCH_ADAMW = dict(DENSE_ADAMW, fused=True)
# --malloc-threshold: the workers' added environment (glibc reads it at start-up).
MALLOC_THRESHOLDS = {"dynamic": {}, "fixed": {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}}


@dataclass(frozen=True)
class Configuration:
    method: str
    rank: int

    @property
    def label(self) -> str:
        return self.method if self.method in DENSE else f"{self.method} r={self.rank}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-0.5b", help="a model shape")
    source.add_argument("--config", help="a config.json (or a directory holding one); random weights")
    source.add_argument("--model", type=model_dir, help="a local Hugging Face causal LM (its weights are loaded)")
    parser.add_argument("--layers", type=positive_int, help="keep this many decoder layers (default: the preset's)")
    parser.add_argument(
        "--experts", type=positive_int, help="mixture of experts: keep this many experts per layer (and top-k ≤ it)"
    )
    parser.add_argument("--rank", type=positive_int, default=64, help="rank of LoGRA, LoRA and GaLore")
    parser.add_argument("--ranks", type=int_list, default=[], help="extra LoGRA RowAdam ranks (comma-separated)")
    parser.add_argument(
        "--methods",
        type=choice_list(METHODS),
        default=list(DEFAULT_METHODS),
        help=f"comma-separated subset of {','.join(METHODS)}",
    )
    parser.add_argument(
        "--kl-budget",
        type=positive_float,
        default=None,
        help="run LoGRA with predicted-KL control (its JVP probe each step); unset: no KL control",
    )
    parser.add_argument(
        "--probe-dtype",
        choices=["bfloat16"],
        default=None,
        help="with --kl-budget: the JVP probe's products in this dtype (default: the weights' precision)",
    )
    parser.add_argument(
        "--probe-positions",
        type=positive_int,
        default=None,
        help="with --kl-budget: probe at most this many positions, a random subset (default: all)",
    )
    parser.add_argument(
        "--probe-words",
        type=probe_words,
        default="auto",
        help="with --kl-budget: estimate each probed position's KL term from this many words, or all of them "
        "(default: auto, the optimizer's: 64 from 8192 words on)",
    )
    parser.add_argument("--checkpointing", action="store_true", help="non-reentrant gradient checkpointing")
    parser.add_argument(
        "--accumulation", type=positive_int, default=1, help="microbatches (forward+backward) per optimizer step"
    )
    parser.add_argument("--batch", type=positive_int, default=2, help="sequences per microbatch")
    parser.add_argument("--seq", type=positive_int, default=512, help="tokens per sequence")
    parser.add_argument("--warmup", type=positive_int, default=1, help="untimed steps per process before the runs")
    parser.add_argument("--runs", type=positive_int, default=3, help="timed steps per process")
    parser.add_argument("--rounds", type=positive_int, default=3, help="fresh processes per configuration")
    parser.add_argument("--threads", type=positive_int, help="torch threads per worker (default: torch's)")
    parser.add_argument(
        "--malloc-threshold",
        choices=sorted(MALLOC_THRESHOLDS),
        default="dynamic",
        help="CPU workers: glibc's mmap threshold, dynamic (its default) or fixed at 128 KiB, so that the RSS "
        "peak counts live tensors rather than freed heap glibc keeps (see the module docstring)",
    )
    parser.add_argument("--device", type=device, default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--detail",
        action="store_true",
        help="also tabulate the fastest step, the optimizer part (with LoGRA's KL probe in it) and absolute peaks",
    )
    parser.add_argument("--output", type=writable_dir, default="logra-bench", help="directory for JSON, table, PNG")


# --------------------------------------------------------------------------------------------------
# Worker: one configuration in one fresh process


def model_config(spec: dict):
    """The ``transformers`` config of the benchmarked model (preset, config file or local model)."""
    from transformers import AutoConfig

    if spec.get("model") or spec.get("config"):
        config = AutoConfig.from_pretrained(spec.get("model") or spec["config"])
    else:
        config = preset_config(spec["preset"], max_position_embeddings=max(spec["seq"], 64))
    if spec.get("experts"):
        found = expert_count(config)
        if found is None:
            raise ValueError(f"--experts {spec['experts']}: the model has no mixture-of-experts blocks")
        groups = getattr(config, "n_group", None) or 1  # DeepSeek routes within groups of experts
        if groups > 1 and (spec["experts"] % groups or spec["experts"] // groups < 2):
            raise ValueError(
                f"--experts {spec['experts']}: must be a multiple of the config's n_group ({groups}) with at least "
                "two experts per group (its router takes the best two of each group)"
            )
        setattr(config, found[0], spec["experts"])
        reachable = spec["experts"] // groups * (getattr(config, "topk_group", None) or groups)
        config.num_experts_per_tok = min(config.num_experts_per_tok, spec["experts"], reachable)
    if spec.get("layers"):
        config.num_hidden_layers = spec["layers"]
        if getattr(config, "layer_types", None):  # per-layer attention kinds must match the count
            config.layer_types = config.layer_types[: spec["layers"]]
    config.use_cache = False
    return config


def build_model(spec: dict, device: str, config=None):
    """The benchmarked model (``config``: another config of the same kind instead of the spec's)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if spec.get("model") and config is None:
        model = AutoModelForCausalLM.from_pretrained(spec["model"], config=model_config(spec), dtype=torch.float32)
        model = model.to(device)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config or model_config(spec), dtype=torch.float32)
    if spec.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


# The sizes of the model that warms a CPU worker's code paths (those its config has); its kind,
# grouping of attention heads and experts stay the benchmarked model's.
WARM_SIZES = dict(
    intermediate_size=128,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    head_dim=16,
    vocab_size=256,
)
WARM_RANK = 8


def warm_config(config):
    """``config`` shrunk to a model of at most a few million parameters: at most two layers, every
    size of :data:`WARM_SIZES` it has, heads of 16 and query heads per key/value head as in
    ``config`` (one key/value head; four of each without grouping)."""
    warm = copy.deepcopy(config)
    for name, value in WARM_SIZES.items():
        if getattr(warm, name, None) is not None:
            setattr(warm, name, value)
    heads = getattr(warm, "num_attention_heads", None) or 4
    group = heads // (getattr(warm, "num_key_value_heads", None) or heads)
    warm.num_attention_heads, kv_heads = (group, 1) if group > 1 else (4, 4)
    if getattr(warm, "num_key_value_heads", None) is not None:
        warm.num_key_value_heads = kv_heads
    warm.hidden_size = WARM_SIZES["head_dim"] * warm.num_attention_heads
    warm.num_hidden_layers = min(warm.num_hidden_layers, 2)
    if getattr(warm, "layer_types", None):
        warm.layer_types = warm.layer_types[: warm.num_hidden_layers]
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids past the small vocabulary
        token = getattr(warm, name, None)
        if isinstance(token, int) and token >= warm.vocab_size:
            setattr(warm, name, None)
    return warm


def warm_code_paths(spec: dict) -> None:
    """Run the spec's method for two steps on :func:`warm_config`'s model, then free it all.

    A CPU peak is resident memory, which counts the pages of shared libraries a process has
    executed. The first steps of a method page in the kernels it uses: at the h1024 shape about
    25 MiB of mapped files for LoGRA with the KL probe, of which a warm-up on this model pages in
    all but 1.4 MiB (``benchmarks/results/bench-h1024-fixed-malloc/warm_rss.txt``). That is
    code, not training memory, and it differs between methods, so each worker pages its own in
    before the baseline. ``malloc_trim`` then returns the whole free pages of glibc's heap; what
    the warm-up leaves resident (one-time caches and what glibc keeps: 5 MiB there) is in the
    baseline.
    Only where the baseline can lower the peak to the current level (:func:`reset_peak_rss`):
    elsewhere the warm-up's own peak would be taken off the run's. Where the run's KL probe reads a
    sample of words, the warm-up's does too, at most a quarter of its 256 words."""
    config = model_config(spec)
    # The probe reads a sample of words where the run's does ("auto" samples only from 8192 words).
    words = words_to_sample(spec.get("probe_words", "auto"), getattr(config, "vocab_size", 0))
    warm = {**spec, "probe_words": None if words is None else min(words, WARM_SIZES["vocab_size"] // 4)}
    model, optimizer = spec_optimizer(build_model(spec, "cpu", warm_config(config)), warm, min(spec["rank"], WARM_RANK))
    input_ids = torch.randint(
        0, model.config.vocab_size, (spec["batch"], 16), generator=torch.Generator().manual_seed(1)
    )
    for _ in range(2):
        training_step(model, optimizer, input_ids, spec.get("accumulation", 1))
    del model, optimizer, input_ids
    gc.collect()
    release_freed_heap()


def training_step(model, optimizer, input_ids: torch.Tensor, accumulation: int, device: str = "cpu") -> float:
    """One step as the bench times it: ``accumulation`` forward+backward microbatches, then
    ``step()`` and ``zero_grad()`` (none for the floor). Returns when the optimizer part began."""
    for _ in range(accumulation):
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    synchronize(device)
    middle = time.perf_counter()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad()
    return middle


def make_optimizer(
    model,
    method: str,
    rank: int,
    kl_budget: float | None = None,
    **probe,
):
    """The optimizer of ``method`` (and the model it trains: LoRA wraps it); ``None`` for the
    ``frozen`` floor, whose step is forward and backward alone. ``probe``: LoGRA's probe options
    (``probe_dtype``, ``probe_positions``, ``probe_words``), its defaults where not given."""
    if method == "frozen":
        model.requires_grad_(False)
        model.enable_input_require_grads()
        return model, None
    if method.startswith("logra-"):
        optimizer = LoGRAOptimizer(
            patch_model(model),
            rank=rank,
            direction=method.removeprefix("logra-"),
            kl_budget=kl_budget,
            **probe,
        )
        return model, optimizer
    # Stacked experts (mixture of experts) are LoGRA's targets too (peers.py); Flora treats them as any
    # other parameter.
    if method == "adamw-targets":
        return model, torch.optim.AdamW(trainable(train_only_targets(model)), **TORCH_ADAMW)
    if method == "lora":
        model = lora_model(model, rank)
        return model, torch.optim.AdamW(trainable(model), **TORCH_ADAMW)
    if method in LOW_RANK_PEERS:
        return model, low_rank_optimizer(model, method, rank, **DENSE_ADAMW)
    if method == "flora":
        from flora_opt.optimizers.torch import Flora

        # beta1 turns on Flora's momentum, the state it compresses to rank r (without it, Flora is
        # Adafactor and ignores the rank).
        return model, Flora(model.parameters(), lr=DENSE_ADAMW["lr"], rank=rank, beta1=DENSE_ADAMW["betas"][0])
    if method == "adamw8bit":
        import bitsandbytes

        return model, bitsandbytes.optim.AdamW8bit(model.parameters(), **DENSE_ADAMW)
    return model, torch.optim.AdamW(model.parameters(), **TORCH_ADAMW)


def spec_optimizer(model, spec: dict, rank: int):
    """:func:`make_optimizer` with the spec's method and KL options, at ``rank``."""
    probe = {name: spec[name] for name in ("probe_positions", "probe_words") if name in spec}
    if spec.get("probe_dtype"):
        probe["probe_dtype"] = getattr(torch, spec["probe_dtype"])
    return make_optimizer(model, spec["method"], rank, spec.get("kl_budget"), **probe)


def run_worker(spec: dict) -> dict:
    """Measure one configuration in this (fresh) process: raw step times and the memory peak."""
    from transformers import AutoModelForCausalLM  # noqa: F401  (resolves transformers' lazy import)

    # Every import the step needs happens before the memory baseline: module code is not training
    # memory, and on a CPU neither is library code (warm_code_paths).
    device = spec["device"]
    if spec["method"] in PEER_MODULES:
        importlib.import_module(PEER_MODULES[spec["method"]])
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    warmed = device == "cpu" and reset_peak_rss()
    if warmed:
        warm_code_paths(spec)
    baseline = memory_baseline(device, reset_peak=True)
    files_before = resident_file_bytes() if device == "cpu" else None
    model, optimizer = spec_optimizer(build_model(spec, device), spec, spec["rank"])
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, model.config.vocab_size, (spec["batch"], spec["seq"]), generator=generator).to(device)
    steps, optimizer_parts, probe_parts = [], [], []
    for step in range(spec["warmup"] + spec["runs"]):
        synchronize(device)
        start = time.perf_counter()
        middle = training_step(model, optimizer, input_ids, spec.get("accumulation", 1), device)
        synchronize(device)
        end = time.perf_counter()
        if step >= spec["warmup"]:
            steps.append(end - start)
            optimizer_parts.append(end - middle)
            probe_parts.append(probe_seconds(optimizer))
    peak = peak_memory(device)
    files_after = resident_file_bytes() if files_before is not None else None
    return {
        "step_s": steps,
        "optimizer_s": optimizer_parts,
        "probe_s": probe_parts,
        "peak_bytes": peak - baseline,
        "peak_abs_bytes": peak,
        "state_bytes": state_bytes(optimizer),
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "code_warmed": warmed,
        # Mapped files paged in during the run (library code the warm-up missed, memory-mapped weights).
        "file_pages_paged_in_bytes": None if files_after is None else files_after - files_before,
        # LoGRA's targets take no .grad, so count what each optimizer updates, not requires_grad.
        "trained_params": 0
        if optimizer is None
        else sum(p.numel() for group in optimizer.param_groups for p in group["params"]),
        "total_params": sum(p.numel() for p in model.parameters()),
        "layers": model.config.num_hidden_layers,
        "experts": (expert_count(model.config) or (None, 0))[1],
        "top_k": getattr(model.config, "num_experts_per_tok", None) or 0,
    }


def probe_seconds(optimizer) -> float | None:
    """The part of the last ``step()`` LoGRA's KL probe took (its ``stats["probe_seconds"]``, a host
    clock: on CUDA it also counts GPU work queued before the probe that the probe waited for);
    ``None`` for other optimizers, for LoGRA without KL control and for a skipped update."""
    if not isinstance(optimizer, LoGRAOptimizer):
        return None
    return optimizer.stats.get("probe_seconds")


def state_bytes(optimizer) -> int:
    """Bytes of what ``optimizer`` keeps between steps, counted once per storage: LoGRA's
    :meth:`~logra_optim.LoGRAOptimizer.state_tensors` (sketches, per-target state, the projections'
    Gram matrices); for any other optimizer the tensors in its ``state``, and those one attribute
    down in objects there (GaLore's and APOLLO's projectors keep their matrices so). 0 for the
    ``frozen`` floor's ``None``."""
    if optimizer is None:
        return 0
    if isinstance(optimizer, LoGRAOptimizer):
        tensors = optimizer.state_tensors()
    else:
        values = [value for state in optimizer.state.values() for value in state.values()]
        tensors = [v for value in values for v in (value, *getattr(value, "__dict__", {}).values())]
    storages = {
        (t.device, t.untyped_storage().data_ptr()): t.untyped_storage().nbytes()
        for t in tensors
        if isinstance(t, torch.Tensor)
    }
    return sum(storages.values())


# --------------------------------------------------------------------------------------------------
# Parent


def method_available(method: str) -> str | None:
    """``None`` if ``method`` can run here, else why not (a missing optional package)."""
    module = PEER_MODULES.get(method)
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except Exception as error:  # an installed but broken package (e.g. a native library) is skipped too
        return f"{module} does not import ({type(error).__name__}: {error})"
    return None


def _check_ranks(spec: dict, ranks: list[int], parser: argparse.ArgumentParser) -> None:
    """Refuse a rank no target of the model allows before any worker starts (LoRA, GaLore and LoGRA
    share it)."""
    try:
        config = model_config(spec)
    except ValueError as error:  # e.g. --experts on a dense model
        parser.error(str(error))
    try:
        limit = Shape.from_config(config.to_dict()).max_rank
    except ValueError:
        return  # not a Llama-style config: the workers' own checks will name the module
    if ranks and (ranks[0] < 1 or ranks[-1] > limit):
        parser.error(
            f"--rank/--ranks {ranks}: every rank must be in 1…{limit}, the smallest target dimension of this model"
        )


def rotated(configs: list[Configuration], round_index: int) -> list[Configuration]:
    """The order of round ``round_index``: ``configs`` started ``round_index`` places later, so that
    over ``len(configs)`` rounds each configuration runs once in every place of the order, first
    (after the previous round's last process) included."""
    shift = round_index % len(configs)
    return configs[shift:] + configs[:shift]


def paired_ratio(rounds: list[float], reference_rounds: list[float]) -> float:
    """The median over rounds of ``rounds[i] / reference_rounds[i]``: a configuration's median step
    of each round against the reference's of the same round. A machine that runs faster in some
    rounds than in others moves both of a round's medians alike, and so this ratio less than the
    ratio of the two overall medians, which can each come from rounds of a different speed."""
    return statistics.median(a / b for a, b in zip(rounds, reference_rounds, strict=True))


def summarize(config: Configuration, samples: list[dict]) -> dict:
    steps = [t for sample in samples for t in sample["step_s"]]
    return {
        "label": config.label,
        "method": config.method,
        "rank": config.rank,
        "step_s": statistics.median(steps),
        "step_min_s": min(steps),
        "optimizer_s": statistics.median(t for sample in samples for t in sample["optimizer_s"]),
        "probe_s": median_probe_seconds(samples),
        "step_times_s": steps,
        "round_step_s": [statistics.median(sample["step_s"]) for sample in samples],
        "peak_bytes": max(s["peak_bytes"] for s in samples),
        "peak_abs_bytes": max(s["peak_abs_bytes"] for s in samples),
        "state_bytes": samples[0]["state_bytes"],
        "malloc_mmap_threshold": samples[0]["malloc_mmap_threshold"],
        "code_warmed": all(s["code_warmed"] for s in samples),
        "file_pages_paged_in_bytes": None
        if any(s["file_pages_paged_in_bytes"] is None for s in samples)
        else max(s["file_pages_paged_in_bytes"] for s in samples),
        "trained_params": samples[0]["trained_params"],
        "total_params": samples[0]["total_params"],
    }


def median_probe_seconds(samples: list[dict]) -> float | None:
    """The median probe time over the timed steps that probed (a skipped update has none)."""
    probed = [t for sample in samples for t in sample["probe_s"] if t is not None]
    return statistics.median(probed) if probed else None


def above_floor(results: list[dict]) -> dict[str, float] | None:
    """Per label, ``(peak − floor's peak − state) / dense AdamW's peak`` when ``frozen`` and
    ``adamw`` both ran (``None`` otherwise; the floor itself is left out)."""
    floor = next((r for r in results if r["method"] == "frozen"), None)
    dense = next((r for r in results if r["method"] == "adamw"), None)
    if floor is None or dense is None or dense["peak_bytes"] <= 0:
        return None
    return {
        r["label"]: (r["peak_bytes"] - floor["peak_bytes"] - r["state_bytes"]) / dense["peak_bytes"]
        for r in results
        if r is not floor
    }


def table(results: list[dict], detail: bool = False) -> tuple[list[str], list[list[str]]]:
    """Headers and cells shared by the console and markdown tables: ratios to each reference that
    ran; with ``detail`` also the fastest step, the optimizer part (and of it LoGRA's KL probe, where
    one ran), the absolute peak and the paired time ratios."""
    references = {name: r for name in REFERENCES for r in results if r["method"] == name}
    excess = above_floor(results)
    probed = detail and any(r["probe_s"] is not None for r in results)
    headers = ["method", "trained params", "peak GiB", "step s (median)"]
    if detail:
        headers += ["step s (min)", "optimizer s (median)"] + (["of it probe s"] if probed else []) + ["peak abs GiB"]
    for name in references:
        headers += [f"memory / {REFERENCES[name]}", f"time / {REFERENCES[name]}"]
        headers += [f"min time / {REFERENCES[name]}", f"paired time / {REFERENCES[name]}"] if detail else []
    headers += ["state GiB", "above floor + state / AdamW"] if excess is not None else []
    rows = []
    for r in results:
        row = [r["label"], f"{r['trained_params'] / 1e6:.2f} M", f"{r['peak_bytes'] / GIB:.3f}", f"{r['step_s']:.3f}"]
        if detail:
            row += [f"{r['step_min_s']:.3f}", f"{r['optimizer_s']:.3f}"]
            row += ["—" if r["probe_s"] is None else f"{r['probe_s']:.3f}"] if probed else []
            row += [f"{r['peak_abs_bytes'] / GIB:.3f}"]
        for base in references.values():
            row += [ratio(r["peak_bytes"], base["peak_bytes"]), ratio(r["step_s"], base["step_s"])]
            if detail:
                row += [ratio(r["step_min_s"], base["step_min_s"])]
                row += [f"{paired_ratio(r['round_step_s'], base['round_step_s']):.2f}×"]
        if excess is not None:
            share = excess.get(r["label"])
            row += [f"{r['state_bytes'] / GIB:.3f}", "floor" if share is None else f"{100 * share:.1f}%"]
        rows.append(row)
    return headers, rows


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in results]
    colors = ["tab:blue" if r["method"].startswith("logra") else "tab:gray" for r in results]
    fig, (memory, time_ax) = plt.subplots(1, 2, figsize=(11, 0.45 * len(results) + 1.8))
    memory.barh(labels, [r["peak_bytes"] / GIB for r in results], color=colors)
    memory.set_xlabel("peak training memory (GiB)")
    time_ax.barh(labels, [r["step_s"] for r in results], color=colors)
    time_ax.set_xlabel("seconds per step (median)")
    time_ax.set_yticklabels([])
    for ax in (memory, time_ax):
        ax.invert_yaxis()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _threshold_note(results: list[dict]) -> str:
    """The title's note when workers ran with glibc's mmap threshold set (by ``--malloc-threshold
    fixed``, or inherited from this process's environment), as each worker recorded it."""
    thresholds = sorted({r["malloc_mmap_threshold"] for r in results if r.get("malloc_mmap_threshold")})
    if not thresholds:
        return ""
    fixed = ", ".join(thresholds)
    return f"; glibc mmap threshold fixed at {fixed} bytes (step times not comparable with glibc's default)"


def configurations(args: argparse.Namespace, console) -> tuple[list[Configuration], dict[str, str]]:
    """What runs, in ``--methods`` order (RowAdam at ``--rank`` and every ``--ranks``), and which
    methods are skipped and why."""
    configs, skipped = [], {}
    for method in args.methods:
        reason = method_available(method)
        if reason:
            skipped[method] = reason
            continue
        ranks = sorted({args.rank, *args.ranks}) if method == "logra-rowadam" else [args.rank]
        configs += [Configuration(method, 0 if method in DENSE else FIXED_RANKS.get(method, rank)) for rank in ranks]
    for method, reason in skipped.items():
        console.print(f"[yellow]skipping {method}: {reason}[/]")
    if not configs:
        raise ValueError(f"none of --methods {','.join(args.methods)} can run here: {skipped}")
    return configs, skipped


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[dict]:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    if args.config and not Path(args.config).exists():
        parser.error(f"--config {args.config}: no such file")
    for option, default in (("probe_dtype", None), ("probe_positions", None), ("probe_words", "auto")):
        if getattr(args, option) != default and args.kl_budget is None:
            parser.error(f"--{option.replace('_', '-')} needs --kl-budget: without KL control no probe runs")
    device = resolve_device(args.device)
    if args.malloc_threshold != "dynamic" and device != "cpu":
        parser.error(
            f"--malloc-threshold {args.malloc_threshold}: CPU runs only (on {device} the peak is max_memory_allocated, "
            "which counts live tensors already)"
        )
    layers = args.layers or (None if (args.model or args.config) else DEFAULT_LAYERS[args.preset])
    if args.ranks and "logra-rowadam" not in args.methods:  # e.g. bench_core.py's fixed ranks, methods overridden
        Console(stderr=True).print(
            "[yellow]--ranks ignored: extra ranks apply to logra-rowadam, which --methods does not run[/]"
        )
    base_spec = dict(
        preset=None if (args.model or args.config) else args.preset,  # what ran, for bench.json
        config=args.config,
        model=args.model,
        layers=layers,
        experts=args.experts,
        batch=args.batch,
        seq=args.seq,
        warmup=args.warmup,
        runs=args.runs,
        threads=args.threads,
        device=device,
        kl_budget=args.kl_budget,
        probe_dtype=args.probe_dtype,
        probe_positions=args.probe_positions,
        probe_words=args.probe_words,
        checkpointing=args.checkpointing,
        accumulation=args.accumulation,
        malloc_threshold=args.malloc_threshold,
    )
    console = Console(stderr=True)
    configs, skipped = configurations(args, console)
    _check_ranks(base_spec, sorted({c.rank for c in configs if c.method not in DENSE}), parser)

    Path(args.output).mkdir(parents=True, exist_ok=True)
    samples: dict[Configuration, list[dict]] = {config: [] for config in configs}
    revision = source_revision()  # before the runs: the workers import the code as it is now
    started = time.perf_counter()
    with Progress(console=console) as progress:
        bar = progress.add_task("benchmark", total=len(configs) * args.rounds)
        orders = []
        for round_index in range(args.rounds):
            orders.append([])
            for config in rotated(configs, round_index):
                orders[-1].append(config.label)
                progress.update(bar, description=config.label)
                spec = {**base_spec, "method": config.method, "rank": config.rank}
                env = MALLOC_THRESHOLDS[args.malloc_threshold]  # "fixed" is refused off the CPU above
                samples[config].append(run_fresh(run_worker, spec, label=config.label, env=env))
                progress.advance(bar)
    results = [summarize(config, runs) for config, runs in samples.items()]
    source = args.model or args.config or f"preset {args.preset}"
    # The model's own parameters: LoRA adds its adapters (which are all it trains).
    base_params = model_parameters(results)
    first = samples[configs[0]][0]
    experts = f" of {first['experts']} experts (top-{first['top_k']})" if first.get("experts") else ""
    title = (
        f"{source}, {first['layers']} layers{experts}, {base_params / 1e6:.0f} M params; "
        f"batch {args.batch}×{args.seq}"
        + (f" × {args.accumulation} microbatches" if args.accumulation > 1 else "")
        + f"; {device}"
        + ("; gradient checkpointing" if args.checkpointing else "")
        + (_threshold_note(results) if device == "cpu" else "")
        + f"; median of {args.rounds}×{args.runs} steps"
    )
    headers, rows = table(results, args.detail)
    rich_table = Table(title=title, title_justify="left")
    for i, header in enumerate(headers):
        rich_table.add_column(header, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        rich_table.add_row(*row)
    Console(width=max(Console().width, 120, 16 * len(headers))).print(rich_table)  # --detail is wide

    output = Path(args.output)
    command = getattr(args, "command_line", "logra bench")  # set by cli.main
    meta = {
        "command": command,
        "title": title,
        "device": device,
        "machine": platform.machine(),
        "skipped": skipped,
        "seconds": time.perf_counter() - started,
        "round_orders": orders,  # as they ran
        "torch_adamw": {k: v for k, v in TORCH_ADAMW.items() if k != "betas"},  # AdamW, AdamW on targets, LoRA
        # LoGRA runs the optimizer's defaults: whether they keep a first moment (plan --measured reads it).
        "logra_first_moment": inspect.signature(LoGRAOptimizer).parameters["beta1"].default > 0,
        **revision,
        **base_spec,
        "layers": first["layers"],  # as run (--layers, or the model's own)
    }
    (output / "bench.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    markdown = [
        f"{title}.",
        "",
        f"Command: `{command}`",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
    (output / "bench.md").write_text("\n".join(markdown) + "\n")
    plot(results, output / "bench.png", title)
    console.print(f"results: {output / 'bench.json'}, {output / 'bench.md'}, {output / 'bench.png'}")
    return results
