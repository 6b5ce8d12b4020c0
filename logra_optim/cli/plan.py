"""``logra plan``: predicted per-GPU training memory of dense AdamW, LoRA and LoGRA from a config.

The prediction counts bytes by component, from the shapes in ``config.json`` alone (Llama/Qwen/
Mistral-style decoders: attention q/k/v/o and a gated MLP per layer), for a per-GPU micro-batch of
``B × T`` tokens and ``N`` GPUs that shard (FSDP full shard / ZeRO-3) or replicate (DDP) the model:

* **weights**: ``P`` parameters at the model dtype, ``/ N`` when sharded.
* **dense AdamW**: gradients at the model dtype, two fp32 moments, an fp32 master copy when the
  model dtype is not fp32, all ``/ N`` when sharded. Fused AdamW (``--adamw fused``, the default:
  transformers' ``Trainer``, and so TRL, steps ``optim="adamw_torch_fused"``) updates in place;
  torch's foreach AdamW (``--adamw foreach``, ``torch.optim.AdamW``'s default on CUDA) adds one
  fp32 parameter-sized temporary (``sqrt`` of the second moment).
* **LoRA** (rank ``r`` on the same targets, fp32 adapters): per target ``(d + k) r`` adapter
  parameters with gradients and two moments; activations: the linear layers' inputs as in dense
  training (each adapter's ``lora_A`` keeps its input) plus the ``r``-wide adapter outputs.
* **LoGRA**: per target the fp32 sketch ``d × r``, the fp32 first moment of the same shape (the
  default ``beta1=0.9``; ``--no-first-moment`` for ``beta1=0``) and, with ``--direction rowadam``,
  one fp32 statistic per row (the default orthogonal directions keep none), replicated on every
  GPU (each rank sketches its own tokens, then they are averaged). The
  projections ``A`` are not kept: each is generated where it is used (forward, probe, merge)
  and freed, so what they add is a transient of at most two of them at once, counted as two fp32
  ``r × k`` of the widest input (q/k/v share one ``A``, gate/up share one: ``share_projections``,
  the default), plus each shared projection's fp32 ``r × r`` Gram matrix ``A Aᵀ`` (kept for the
  step size until ``A`` is redrawn); activations: ``x Aᵀ`` (``r`` wide) once per input instead of the input ``x``.
* **activations** per token and layer, in elements at the activation dtype (``H`` hidden, ``I``
  intermediate, ``q`` = heads × head_dim, ``kv`` the k/v width): two RMSNorms keep ``2H`` each when
  their weights train, ``H`` when frozen (LoRA, LoGRA); attention keeps q, k, v and its output
  (``2q + 2kv``, a fused kernel with no ``T × T`` scores); the linear layers' inputs (``H`` for
  q/k/v, ``q`` for o, ``H`` for gate/up, ``I`` for down; LoGRA keeps ``r`` per input instead); the
  gated activation ``3I``. With gradient checkpointing only each layer's input (``H``)
  plus one layer's full set stay. ``tests/test_cli.py`` checks these counts against the bytes
  autograd actually saves (``saved_tensors_hooks``) for all three methods.
* **logits**: at the start of backward the logits (kept by the model's output), the fp32
  log-softmax the loss saved, its gradient and the logits' gradient: ``(12 + a) V`` bytes per token.

The peak is not the sum of everything: activations and logits are gone by the time the optimizer
steps, and dense gradients are built up as they go. So ``peak = persistent + max(backward, step)``,
where *persistent* is weights and optimizer/LoGRA state, *backward* is activations + logits, and
*step* is dense gradients + the optimizer's temporaries.

What the model leaves out: allocator fragmentation and CUDA context (≈0.5–1 GiB per GPU), the KL
probe's forward (inference-mode, one layer at a time), communication buffers, and the rollout engine.
``logra bench`` measures the same components on a real step; ``--measured bench.json`` prints
prediction and measurement side by side.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from ..options import DIRECTIONS
from .arguments import positive_int
from .measure import GIB, model_parameters, ratio
from .shapes import Shape, read_config

METHODS = ("adamw", "lora", "logra")
ADAMW_STEPS = ("fused", "foreach")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Setting:
    rank: int = 256
    expert_rank: int | None = None  # LoGRA's and LoRA's rank on stacked experts (default: rank)
    dtype: str = "bf16"
    batch: int = 1
    seq: int = 4096
    gpus: int = 1
    sharded: bool = True
    checkpointing: bool = True
    first_moment: bool = True  # LoGRA's beta1 > 0 (its default)
    direction: str = "orthogonal"  # LoGRA's direction rule; "rowadam" keeps one statistic per row
    adamw: str = "fused"  # dense AdamW's step: "fused" (in place) or "foreach" (one fp32 temporary)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def rank_for(self, experts: int) -> int:
        return self.expert_rank if experts > 1 and self.expert_rank is not None else self.rank


def _layer_activations(shape: Shape, method: str, rank: int, expert_rank: int) -> int:
    """Elements kept per token by one decoder layer for the backward pass (see the module docstring)."""
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    # An RMSNorm keeps its input; its normalised output too when its weight needs a gradient.
    norms = 4 * h if method == "adamw" else 2 * h
    attention = 2 * q + 2 * kv
    if shape.qk_norm:  # Qwen3's RMSNorms of queries and keys, as the layer norms above
        attention += (2 if method == "adamw" else 1) * (q + kv)
    if shape.experts:
        return norms + attention + _routed_activations(shape, method, rank, expert_rank)
    gated = 3 * i
    linear_inputs = h + q + h + i  # inputs of q/k/v (shared), o, gate/up (shared), down
    if method == "logra":
        return norms + attention + gated + 4 * rank  # x Aᵀ instead of x: one per shared input
    if method == "lora":
        return norms + attention + gated + linear_inputs + 7 * rank  # + each adapter's r-wide output
    return norms + attention + gated + linear_inputs


def _routed_activations(shape: Shape, method: str, rank: int, expert_rank: int) -> int:
    """Elements kept per token by a mixture-of-experts layer besides its norms and attention (measured
    on transformers' eager experts and LoGRA's routed computation; ``tests/test_cli.py`` checks them).

    Per routed copy of a token (``top_k`` per token): dense training keeps the gate_up output
    (``2I``), the gated activation and the down input (``2I``), and three ``H``-wide tensors (the
    gate_up input, the down output the routing weight multiplies, the summed-back output). LoGRA
    keeps ``x Aᵀ`` (``r``) for both expert inputs instead of the inputs themselves (``I`` and ``H``
    less). Attention's inputs are as in a dense layer; the router keeps its ``E`` scores and
    ``top_k`` weights (and its input, when it is trained)."""
    h, q, k, ie = shape.hidden, shape.heads * shape.head_dim, shape.top_k, shape.expert_intermediate
    router = shape.experts + k + (h if method == "adamw" else 0)  # a trained router also keeps its input
    if method == "logra":
        return router + 2 * rank + k * (3 * ie + 2 * h + 2 * expert_rank)
    adapters = 4 * rank if method == "lora" else 0  # the attention adapters' r-wide outputs
    return router + h + q + adapters + k * (4 * ie + 3 * h)


def breakdown(shape: Shape, method: str, setting: Setting) -> dict[str, float]:
    """Predicted bytes per GPU by component for one training step of ``method``."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if setting.adamw not in ADAMW_STEPS:
        raise ValueError(f"adamw must be one of {ADAMW_STEPS}, got {setting.adamw!r}")
    a = DTYPE_BYTES[setting.dtype]
    shard = setting.gpus if setting.sharded else 1
    r = setting.rank
    parts = {"weights": a * shape.params / shard}
    if method == "adamw":
        master = 0 if setting.dtype == "fp32" else 4
        parts["gradients"] = a * shape.params / shard
        parts["optimizer state"] = (8 + master) * shape.params / shard
        if setting.adamw == "foreach":
            parts["optimizer step temporaries"] = 4 * shape.params / shard
    elif method == "lora":
        adapters = shape.layers * sum((d + k) * setting.rank_for(n) * n for d, k, n in shape.targets())  # per expert
        parts["adapters + gradients + moments"] = 16 * adapters / shard
    else:
        outs = shape.layers * sum(d * n for d, _, n in shape.targets())
        parts["sketches"] = 4 * shape.layers * sum(d * n * setting.rank_for(n) for d, _, n in shape.targets())
        if setting.first_moment:
            parts["first moments"] = parts["sketches"]
        parts["projections (transient)"] = 2 * 4 * _largest_projection(shape, setting)
        parts["projection Grams"] = 4 * shape.layers * sum(rank**2 for rank in _projection_ranks(shape, setting))
        if setting.direction == "rowadam":
            parts["row statistics"] = 4 * outs

    per_layer = _layer_activations(shape, method, r, setting.rank_for(2))
    if setting.checkpointing:
        kept = shape.layers * shape.hidden + per_layer
    else:
        kept = shape.layers * per_layer
    parts["activations"] = a * kept * setting.tokens
    if method == "lora" and shape.experts:
        # peft's LoRA on stacked experts (target_parameters) runs each layer on W + B A, formed whole
        # and kept for backward: one layer's expert weights per layer in flight.
        expert_params = sum(d * k * n for d, k, n in shape.targets() if n > 1)
        parts["activations"] += a * expert_params * (1 if setting.checkpointing else shape.layers)
    parts["logits"] = (12 + a) * shape.vocab * setting.tokens
    return parts


def _largest_projection(shape: Shape, setting: Setting) -> int:
    """Elements of the largest ``A`` of a layer (``r × k``; the experts' inputs at their own rank)."""
    return max(width * rank for width, rank in zip(shape.projection_widths(), _projection_ranks(shape, setting)))


def _projection_ranks(shape: Shape, setting: Setting) -> list[int]:
    """The rank of each shared projection of one layer, in ``shape.projection_widths()``'s order."""
    return [setting.rank] * 2 + [setting.rank_for(2 if shape.experts else 1)] * 2


# Which phase of a step holds each component (see the module docstring).
BACKWARD_PHASE = ("activations", "logits")
STEP_PHASE = ("gradients", "optimizer step temporaries")


def peak(parts: dict[str, float]) -> float:
    """``persistent + max(backward, step)`` bytes."""
    backward = sum(parts.get(name, 0) for name in BACKWARD_PHASE)
    step = sum(parts.get(name, 0) for name in STEP_PHASE)
    persistent = sum(value for name, value in parts.items() if name not in BACKWARD_PHASE + STEP_PHASE)
    return persistent + max(backward, step)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a config.json, a directory holding one, or a `logra bench` preset name")
    parser.add_argument("--rank", type=positive_int, default=256, help="LoGRA's and LoRA's rank")
    parser.add_argument(
        "--expert-rank", type=positive_int, help="mixture of experts: LoGRA's and LoRA's rank on the experts"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="weights and activations")
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences per GPU per micro-batch")
    parser.add_argument("--seq", type=positive_int, default=4096, help="tokens per sequence")
    parser.add_argument("--gpus", type=positive_int, default=1, help="data-parallel GPUs")
    parser.add_argument(
        "--replicated",
        action="store_true",
        help="DDP: every GPU holds everything (default: "
        "FSDP full shard / ZeRO-3 shard weights, gradients and optimizer state over --gpus)",
    )
    parser.add_argument("--no-checkpointing", action="store_true", help="keep every layer's activations")
    parser.add_argument(
        "--no-first-moment", action="store_true", help="LoGRA with beta1=0: no first moment in sketch space"
    )
    parser.add_argument(
        "--direction",
        choices=DIRECTIONS,
        default="orthogonal",
        help="LoGRA's direction rule: rowadam adds one fp32 statistic per row",
    )
    parser.add_argument(
        "--adamw",
        choices=ADAMW_STEPS,
        default="fused",
        help="dense AdamW's step: fused (Trainer's and TRL's default) updates in place; foreach "
        "(torch.optim.AdamW's default on CUDA) adds one fp32 parameter-sized temporary",
    )
    parser.add_argument("--layers", type=positive_int, help="override the config's layer count")
    parser.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU, for the 'fits' row")
    parser.add_argument("--measured", help="a `logra bench` bench.json to compare with (same shape and batch)")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    from rich.console import Console
    from rich.table import Table

    config = read_config(args.config)
    if args.layers:
        config = {**(config.get("text_config") or config), "num_hidden_layers": args.layers}
    shape = Shape.from_config(config)
    if args.expert_rank is not None and not shape.experts:
        parser.error("--expert-rank: the model has no mixture-of-experts blocks")
    # As the optimizer takes them: rank on the linear targets, expert_rank (default: rank) on the experts.
    limits = [("--rank", args.rank, shape.max_rank_of(experts=False))]
    if shape.experts:
        option = "--rank" if args.expert_rank is None else "--expert-rank"
        limits.append((option, args.expert_rank or args.rank, shape.max_rank_of(experts=True)))
    for option, rank, limit in limits:
        if rank > limit:
            parser.error(f"{option} {rank} exceeds the smallest dimension ({limit}) of the targets it applies to")
    setting = Setting(
        rank=args.rank,
        expert_rank=args.expert_rank,
        dtype=args.dtype,
        batch=args.batch,
        seq=args.seq,
        gpus=args.gpus,
        sharded=not args.replicated,
        checkpointing=not args.no_checkpointing,
        first_moment=not args.no_first_moment,
        direction=args.direction,
        adamw=args.adamw,
    )
    predictions = {method: breakdown(shape, method, setting) for method in METHODS}
    if args.gpu_memory <= 0:
        parser.error(f"--gpu-memory must be positive (GiB), got {args.gpu_memory}")
    measured, measured_params = (
        _measured_peaks(args.measured, args.rank, args.direction) if args.measured else ({}, (None, None))
    )
    if measured:
        meta = json.loads(Path(args.measured).read_text())["meta"]
        bench = {
            **meta,
            "checkpointing": bool(meta.get("checkpointing")),  # absent from older runs: off
            "adamw": "fused" if meta.get("torch_adamw", {}).get("fused") else None,
        }
        compared = (
            ("adamw", setting.adamw),
            ("batch", setting.batch),
            ("seq", setting.seq),
            ("layers", shape.layers),
            ("checkpointing", setting.checkpointing),
            ("accumulation", 1),  # one step of one microbatch, without the KL probe, is what plan models
            ("kl_budget", None),
            ("logra_first_moment", setting.first_moment),  # absent from runs before it was recorded
        )
        # Older runs hold None for the layers they ran and the AdamW they stepped (torch's
        # single-tensor loop on the CPU, whose temporary is one tensor's): nothing to compare.
        differ = {
            name: (bench.get(name), value)
            for name, value in compared
            if bench.get(name, value) != value and not (name in ("layers", "adamw") and bench.get(name) is None)
        }
        # Another model: LoGRA's rows train exactly the targets plan counts; the whole count is
        # plan's approximation (biases, norms by family), so it gets 1%.
        total, targets = measured_params
        if targets is not None and targets != shape.target_params:
            differ["target parameters"] = (targets, shape.target_params)
        if total is not None and abs(total - shape.params) > 0.01 * total:
            differ["parameters"] = (total, shape.params)
        # bench runs one process, with one rank for every target.
        for option, given in (
            ("--gpus", setting.gpus != 1),
            ("--replicated", args.replicated),
            ("--expert-rank", args.expert_rank is not None),
        ):
            if given:
                parser.error(f"--measured: {option} plans a setup `logra bench` does not run; leave it out")
        if differ or setting.dtype != "fp32":
            parser.error(
                f"--measured was run with other settings (bench, plan): {differ}; `logra bench` runs fp32, so "
                "plan it with --dtype fp32, --adamw fused, and --no-checkpointing unless it ran with --checkpointing"
            )

    layout = "sharded" if setting.sharded else "replicated"
    checkpointing = "on" if setting.checkpointing else "off"
    title = (
        f"{shape.params / 1e9:.2f} B parameters ({shape.target_params / 1e9:.2f} B in targets); {setting.dtype}; "
        f"{setting.batch}×{setting.seq} tokens per GPU; {setting.gpus} GPU(s), {layout}; "
        f"checkpointing {checkpointing}; rank {setting.rank}"
        + (f", experts rank {setting.expert_rank}" if setting.expert_rank is not None else "")
    )
    components = list(dict.fromkeys(c for parts in predictions.values() for c in parts))
    phase = {**dict.fromkeys(BACKWARD_PHASE, " (backward)"), **dict.fromkeys(STEP_PHASE, " (step)")}
    components.sort(key=lambda c: (c in BACKWARD_PHASE, c in STEP_PHASE))
    table = Table(title=title, title_justify="left")
    table.add_column("GiB per GPU")
    for method in METHODS:
        table.add_column(method, justify="right")
    for component in components:
        table.add_row(
            component + phase.get(component, ""), *(f"{predictions[m].get(component, 0) / GIB:.2f}" for m in METHODS)
        )
    totals = {m: peak(parts) for m, parts in predictions.items()}
    table.add_row("[bold]peak[/] = rest + max(backward, step)", *(f"[bold]{totals[m] / GIB:.2f}[/]" for m in METHODS))
    fits = ("yes" if totals[m] / GIB <= args.gpu_memory else "no" for m in METHODS)
    table.add_row(f"fits {args.gpu_memory:g} GiB", *fits)
    if measured:
        table.add_row("measured peak", *(f"{measured[m] / GIB:.2f}" if m in measured else "-" for m in METHODS))
        table.add_row(
            "predicted / measured", *(ratio(totals[m], measured[m]) if m in measured else "-" for m in METHODS)
        )
    console = Console(width=max(Console().width, 110))
    console.print(table)
    if args.measured and "logra" not in measured:
        console.print(
            f"no logra-{args.direction} row at rank {args.rank} in {args.measured}; pass the --direction it "
            "was measured with (logra bench --methods logra-rowadam, logra-orthogonal)",
            soft_wrap=True,
        )
    return {"shape": shape, "setting": setting, "predictions": predictions, "totals": totals, "measured": measured}


def _measured_peaks(path: str, rank: int, direction: str) -> tuple[dict[str, int], tuple[int | None, int | None]]:
    """Peaks of a ``logra bench`` run by plan method: dense AdamW, and LoRA and LoGRA (with
    ``direction``) at ``rank``; and the model's parameter count and LoGRA's targets' (``None``
    where no row says)."""
    try:
        results = json.loads(Path(path).read_text())["results"]
    except (OSError, json.JSONDecodeError, KeyError) as error:
        raise ValueError(f"--measured {path}: not a `logra bench` bench.json ({error})") from None
    chosen = {"adamw": "adamw", "lora": "lora", "logra": f"logra-{direction}"}
    peaks = {
        plan: r["peak_bytes"]
        for plan, bench in chosen.items()
        for r in results
        if r["method"] == bench and (bench == "adamw" or r["rank"] == rank)
    }
    # The model's own parameters, and LoGRA's targets' (older runs may lack a count).
    total = model_parameters(results) if all("total_params" in r for r in results) else None
    targets = next((r.get("trained_params") for r in results if r["method"].startswith("logra-")), None)
    return peaks, (total, targets)
