"""Stacked expert weights of mixture-of-experts blocks as LoGRA targets.

In transformers 5.x a MoE block keeps its experts as 3-D parameters of one ``*Experts`` module
(``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``), run by an implementation chosen
per model (eager loop, ``grouped_mm``, ``batched_mm``). Autograd would give each of them a dense
``[E, d, k]`` gradient. A patched experts module instead runs, in training forwards, its own
routed computation, the same as the eager loop: the tokens routed to expert ``e`` (top-k weight
included in what flows back) go through ``W_e`` as a :class:`~.sketch.SketchedLinear`, whose
backward adds ``G_e Aᵀ`` into expert ``e``'s rows of the sketch. No expert gradient is formed.

One ``A`` per layer and weight serves all its experts: they share the input width ``k``, and the
``gate_up`` experts even share their input (the layer's hidden states), whose ``x Aᵀ`` is computed
once for all of them and gathered per expert. Each expert keeps its own sketch rows, unbiased as
before (``A`` is independent of the data), so the optimizer treats the stacked weight as the
``E·d × k`` matrix of its row-major layout: one target, one ``A``, one first-moment row (and
RowAdam row) per expert row.

Some models store each expert's matrix transposed (``is_transposed``: GPT-OSS's ``gate_up_proj``
``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``). Expert ``e`` is then the linear map ``W_e = weight[e]ᵀ``
(:func:`expert_matrices`, a view), and all of the above applies to it unchanged: the target is the
same ``E·d × k`` matrix of the ``W_e``, whose rows only are stored elsewhere
(:class:`~.distributed.WeightLayout`, :func:`~.updates.merge_transposed_experts_`).

Outside training forwards (evaluation, generation, no grad) the model's own implementation runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
import torch.nn.functional as F

from .probe import perturbed_product
from .sketch import GRAPH_ANCHOR, SketchedLinear

SUPPORTED_LAYOUTS = (
    "transformers' *Experts modules (use_experts_implementation: Qwen2/Qwen3/Qwen3.5-MoE, OLMoE, Mixtral, "
    "DeepSeek-V2/V3, …) storing gate_up_proj [E, 2I, H] (or up_proj [E, I, H] without a gate) and "
    "down_proj [E, H, I], or both transposed (is_transposed: [E, H, 2I] and [E, I, H], GPT-OSS), in "
    "fp32/bf16/fp16/fp64"
)


# The dtypes of expert weights LoGRA trains; anything else (uint8 blocks, float8) is quantized.
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def holds_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds stacked expert weights, recognised or not: parameters of its own with
    3 or more dimensions (packed quantized experts, e.g. mxfp4, have 4) in a module named ``*Experts``
    (as every transformers experts class is) or with ``num_experts``. Other 3-D parameters
    (convolutions of hybrid models) are not experts."""
    named = type(module).__name__.endswith("Experts") or hasattr(module, "num_experts")
    return named and any(p.dim() >= 3 for p in module.parameters(recurse=False))


def expert_weight_names(name: str, module: nn.Module) -> tuple[str, str]:
    """``(input weight, output weight)`` of an experts module LoGRA can target, e.g.
    ``("gate_up_proj", "down_proj")``; raises a ``ValueError`` naming the module otherwise."""

    def refuse(why: str) -> ValueError:
        return ValueError(
            f"experts module {name!r} ({type(module).__name__}): {why}. LoGRA targets {SUPPORTED_LAYOUTS}. "
            "Call patch_model(model, experts=False) (before attach_logra, with TRL) to leave the experts out "
            "(frozen, or trained densely by non_target_optimizer)"
        )

    # First, so that packed quantized experts (GPT-OSS's mxfp4: uint8 blocks) are named for what they are.
    quantized = [p.dtype for p in module.parameters(recurse=False) if p.dim() >= 3 and p.dtype not in WEIGHT_DTYPES]
    if quantized:
        raise refuse(f"quantized experts ({quantized[0]}) are not supported; load the model dequantized")
    if not all(hasattr(module, a) for a in ("num_experts", "has_gate", "is_transposed", "_apply_gate")):
        raise refuse("its layout is not recognised (not built by transformers' use_experts_implementation)")
    if getattr(module, "_is_expert_parallel", False):
        raise refuse("expert parallelism (experts on different ranks) is not supported")
    names = ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")
    weights = [getattr(module, n, None) for n in names]
    if not all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights):
        raise refuse(f"it lacks 3-D parameters {names[0]!r} and {names[1]!r}")
    first, second = (expert_matrices(w, module.is_transposed) for w in weights)
    width = first.shape[1] // 2 if module.has_gate else first.shape[1]
    if first.shape[0] != module.num_experts or second.shape != (module.num_experts, first.shape[2], width):
        stored = " and ".join(str(list(w.shape)) for w in weights)
        raise refuse(f"shapes {stored} (transposed: {bool(module.is_transposed)}) do not line up")
    return names


def expert_matrices(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The experts' matrices ``W_e`` (``[E, d, k]``: out × in, what ``F.linear`` takes) of a stacked
    weight: the weight itself, or, stored ``transposed`` (``[E, k, d]``), a view of it (no copy).

    Why a view suffices: ``x W_eᵀ`` is then ``x · weight[e]``, and a sketch, a probe or a merge only
    ever needs ``W_e`` as a linear map; which rows of ``W_e`` are gate and which up (GPT-OSS
    interleaves them) is the module's ``_apply_gate``'s business, as in its own forward."""
    return weight.transpose(1, 2) if transposed else weight


def routed_experts(
    module: nn.Module,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    linear: Callable[[int, int, torch.Tensor, torch.Tensor | None], torch.Tensor],
) -> torch.Tensor:
    """The experts' output for ``hidden`` (``n×H``) routed by ``top_k_index``/``top_k_weights``
    (``n×top_k``), as the eager implementation computes it; ``linear(which, expert, x, tokens)``
    is the product with the input (``which=0``, ``tokens``: the rows of ``hidden`` in ``x``) or the
    output weight (``which=1``) of ``expert``.

    Tokens are grouped by expert (one stable sort) and each expert that received any runs once;
    the outputs are summed back per token out of place, which forward-mode AD (the KL probe) also
    follows."""
    top_k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)
    counts = torch.bincount(expert_ids, minlength=module.num_experts).tolist()
    tokens_sorted = torch.div(order, top_k, rounding_mode="floor")
    weights_sorted = top_k_weights.reshape(-1)[order]
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        start += count
        tokens = tokens_sorted[rows]
        inner = linear(0, expert, hidden[tokens], tokens)
        inner = module._apply_gate(inner) if module.has_gate else module.act_fn(inner)
        outputs.append(linear(1, expert, inner, None) * weights_sorted[rows, None])
    result = torch.zeros_like(fwAD.unpack_dual(hidden).primal)
    if not outputs:
        return result
    return result.index_add(0, tokens_sorted[:start], torch.cat(outputs).to(result.dtype))


def _matrices(module: nn.Module, names: tuple[str, str], states) -> tuple[torch.Tensor, ...]:
    """The ``[E, d, k]`` experts' matrices of the input and output weight (:func:`expert_matrices`)."""
    return tuple(expert_matrices(getattr(module, name), state.transposed) for name, state in zip(names, states))


def _biases(module: nn.Module, names: tuple[str, str]) -> tuple[torch.Tensor | None, ...]:
    if not getattr(module, "has_bias", False):
        return (None, None)
    return tuple(getattr(module, name + "_bias", None) for name in names)


def sketching_linear(module: nn.Module, names: tuple[str, str], states, hidden: torch.Tensor):
    """``linear`` for :func:`routed_experts` in a training forward: each expert's product is a
    :class:`~.sketch.SketchedLinear` into its rows of the sketch. The input weight's ``x Aᵀ`` is
    computed once for all tokens and gathered per expert."""
    weights = _matrices(module, names, states)
    biases = _biases(module, names)
    sketches = tuple(state.sketch.view(w.shape[0], w.shape[1], -1) for state, w in zip(states, weights))
    projected_input = states[0].shared_projection.project(hidden)

    def linear(which: int, expert: int, x: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        projected = projected_input[tokens] if which == 0 else states[1].shared_projection.project(x)
        bias = None if biases[which] is None else biases[which][expert]
        sketch = sketches[which][expert]
        return SketchedLinear.apply(x, weights[which][expert], bias, projected, sketch, GRAPH_ANCHOR, states[which])

    return linear


def probing_linear(module: nn.Module, names: tuple[str, str], states):
    """``linear`` for :func:`routed_experts` while a KL probe runs: expert ``e``'s product with
    ``W_e`` plus the low-rank change ``−(x Aᵀ) F_eᵀ`` of the proposed update (as tangent or branch)."""
    weights = _matrices(module, names, states)
    biases = _biases(module, names)

    def linear(which: int, expert: int, x: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        state, weight = states[which], weights[which]
        bias = None if biases[which] is None else biases[which][expert]
        if state.probe_factor is None:
            return F.linear(x, weight[expert], bias)
        factor = state.probe_factor.view(weight.shape[0], weight.shape[1], -1)[expert]
        return perturbed_product(x, weight[expert], bias, state, factor)

    return linear
