"""Running the model for KL control: probe contexts, the JVP probe, the finite-difference probe.

The proposed update of a target is ``D_W = −F A`` with ``F = η U`` (d×r). Neither probe touches
the weights: while a probe runs, each patched linear computes ``y = x Wᵀ + b`` as usual and adds
the low-rank term ``−(x Aᵀ) Fᵀ`` (fp32 products), either as the *tangent* of a forward-mode dual
(JVP probe: ``ż`` of all targets at once in one forward) or as a temporary *branch* on the primal
(finite-difference probe: the logits of ``θ + εD``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .attention import AttentionTangentMode
from .caller import warn
from .kl import exact_kl_terms, fisher_kl_terms, sample_words, sampled_fisher_kl_terms
from .sketch import SharedProjection
from .tangents import ElementwiseTangentMode

LogitsFn = Callable[[nn.Module, "ProbeContexts"], torch.Tensor]


@dataclass
class ProbeContexts:
    """Sequences to probe and, per position, whether its logits predict a generated token.

    ``probe_mask[b, t]`` marks the logits at position ``t`` (which predict token ``t+1``).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    probe_mask: torch.Tensor
    temperature: float = 1.0

    @property
    def tokens(self) -> int:
        return int(self.probe_mask.sum())

    def select(self, rows: torch.Tensor, probe_mask: torch.Tensor | None = None) -> ProbeContexts:
        """The contexts of sequences ``rows`` (a row index or boolean mask), with their rows of
        ``probe_mask`` if given (same shape as this one's) instead of their own."""
        mask = self.probe_mask if probe_mask is None else probe_mask
        attention_mask = None if self.attention_mask is None else self.attention_mask[rows]
        return ProbeContexts(self.input_ids[rows], attention_mask, mask[rows], self.temperature)


def contexts_from_batch(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    completion_mask: torch.Tensor | None = None,
    samples: int | None = None,
    temperature: float = 1.0,
) -> ProbeContexts:
    """Probe contexts from ``samples`` sequences of a training batch, spread evenly over it
    (:func:`spread_rows`).

    A position is probed when the token it predicts is real (attention mask) and, if given, is
    trained on (``labels != -100``, HF convention: aligned with ``input_ids``) and generated
    (``completion_mask``, aligned with ``input_ids``).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, sequence), got shape {tuple(input_ids.shape)}")
    rows = spread_rows(input_ids.shape[0], samples)
    input_ids = input_ids[rows]
    predicted_is_valid = torch.ones_like(input_ids, dtype=torch.bool)
    if attention_mask is not None:
        attention_mask = attention_mask[rows]
        predicted_is_valid &= attention_mask.bool()
    if labels is not None:
        predicted_is_valid &= labels[rows] != -100
    if completion_mask is not None:
        predicted_is_valid &= completion_mask[rows].bool()
    probe_mask = torch.zeros_like(predicted_is_valid)
    probe_mask[:, :-1] = predicted_is_valid[:, 1:]
    if attention_mask is not None:
        probe_mask &= attention_mask.bool()
    attention_mask = None if attention_mask is None else attention_mask.detach().clone()
    return ProbeContexts(input_ids.detach().clone(), attention_mask, probe_mask, float(temperature))


def spread_rows(batch: int, samples: int | None) -> torch.Tensor | slice:
    """``samples`` row indices spread evenly over ``batch`` rows (all rows when ``samples`` is
    ``None`` or at least ``batch``).

    Not the first rows: a batch grouped by prompt (the G completions of each prompt in
    consecutive rows, as a hand-written GRPO loop builds it) would then be probed on one prompt
    alone; evenly spaced rows cover ``samples`` prompts (for ``samples ≤`` the number of prompts)
    at the same cost. (TRL's GRPO and RLOO trainers shuffle the generation batch before training
    on it, so there the first rows were already a random sample.)"""
    if samples is None or samples >= batch:
        return slice(None)
    return torch.div(torch.arange(samples) * batch, samples, rounding_mode="floor")


def subsample_positions(contexts: ProbeContexts, limit: int | None, seed: int) -> ProbeContexts:
    """At most ``limit`` of the contexts' probe positions: a uniform random subset without
    replacement (drawn by a CPU generator seeded with ``seed``, so the same on every device), and
    only the sequences that keep a position. The contexts themselves when they have no more.

    ``q`` is the mean of the per-position terms, and the mean over a uniform random subset is an
    unbiased estimate of it (the controller scales it to all of a rank's positions, so that ranks
    keep their token weights). Random, not every n-th position: a stride can alias with the
    structure of the text (every digit, or every separator, of a list). Dropping a sequence with
    no kept position changes no other sequence's logits, for models whose sequences do not interact
    within a batch (not, for example, mixture-of-experts routing with a capacity limit)."""
    if limit is None or contexts.tokens <= limit:
        return contexts
    mask = contexts.probe_mask
    positions = mask.flatten().nonzero().squeeze(1)
    order = torch.randperm(positions.numel(), generator=torch.Generator().manual_seed(seed))
    kept = torch.zeros_like(mask).flatten()
    kept[positions[order[:limit].to(positions.device)]] = True
    kept = kept.view_as(mask)
    return contexts.select(kept.any(dim=1), kept)


def compact_contexts(contexts: ProbeContexts, cut: bool = True) -> tuple[ProbeContexts, torch.Tensor]:
    """``(contexts', weights)``: the contexts with each distinct sequence once (same tokens and
    attention), only those that hold a probe position, and with ``cut`` none of the columns after the
    last probe position; per probe position of ``contexts'`` (row-major, as ``probe_mask`` selects
    them) the number of the given sequences that probe it (float64; they sum to ``contexts.tokens``).

    Why: a causal LM's logits at a position depend on the tokens up to it only, and sequences do not
    interact within a batch, so identical sequences give identical KL terms at the positions they
    probe, and the columns after the last probe position change none of them. GRPO's groups repeat
    short answers often (the demo's 8 probed sequences hold 6.2 distinct ones on average), and a
    sequence's last column never predicts a token. ``Σ weights · q_s`` over the compact contexts is
    the full contexts' ``Σ q_s`` up to floating-point rounding (fewer, shorter rows in the products),
    at the cost of the distinct, shorter rows. Not for models whose sequences interact within a
    batch (mixture-of-experts routing with a capacity limit), as for :func:`subsample_positions`;
    ``cut=False`` for models whose positions are encoded by the sequence's length
    (:func:`positions_depend_on_length`)."""
    mask = contexts.probe_mask
    if contexts.tokens == 0:
        return contexts, torch.zeros(0, dtype=torch.float64, device=mask.device)
    width = int(mask.any(dim=0).nonzero()[-1]) + 1 if cut else mask.shape[1]
    probing = mask[:, :width].any(dim=1)
    ids, mask = contexts.input_ids[probing, :width], mask[probing, :width]
    attention = None if contexts.attention_mask is None else contexts.attention_mask[probing, :width]
    key = ids if attention is None else torch.cat((ids, attention.to(ids.dtype)), dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    groups = int(inverse.max()) + 1
    # One representative per distinct row, the first occurrence, in the batch's order; per position
    # the number of its copies that probe it.
    rows = torch.arange(ids.shape[0], device=ids.device)
    first = torch.full((groups,), ids.shape[0], dtype=rows.dtype, device=ids.device).scatter_reduce(
        0, inverse, rows, "amin"
    )
    order = first.argsort()
    counts = torch.zeros(groups, width, dtype=torch.float64, device=ids.device).index_add_(0, inverse, mask.double())
    counts, kept = counts[order], first[order]
    probe_mask = counts > 0
    compact = ProbeContexts(ids[kept], None if attention is None else attention[kept], probe_mask, contexts.temperature)
    return compact, counts[probe_mask]


# Hugging Face rotary types that set their frequencies from the sequence's length (``"su"``: LongRoPE's
# former name in Phi-3's remote code); any type whose name contains "dynamic" does too.
LENGTH_DEPENDENT_ROPE = ("longrope", "su")


def positions_depend_on_length(model: nn.Module) -> bool:
    """Whether a rotary embedding of ``model`` sets its frequencies from the sequence's length, so
    that cutting columns off a sequence could change the logits before them: Hugging Face's
    ``"dynamic"`` (NTK) and ``"longrope"`` rotary types (read from ``max(position_ids) + 1``). Read
    from every module's ``rope_type`` (a name, or one per layer type) and from the config's (or a
    wrapped model's config's, and its text config's) ``rope_parameters`` / ``rope_scaling``. A true
    answer where it does not matter only costs the probe the columns it keeps."""
    # An instance attribute in every Hugging Face rotary module: read from ``__dict__``, which costs
    # a few microseconds over a whole model where ``getattr``'s failing lookups cost a millisecond.
    kinds: list = [vars(module).get("rope_type") for module in model.modules()]
    configs = [getattr(model, "config", None), getattr(getattr(model, "module", None), "config", None)]
    for config in list(configs):
        try:
            configs.append(config.get_text_config(decoder=True))
        except (AttributeError, TypeError, ValueError):
            pass
    kinds += [getattr(config, name, None) for config in configs for name in ("rope_parameters", "rope_scaling")]

    def named(kind) -> bool:  # a type name anywhere in a (nested) dict of rotary settings
        if isinstance(kind, dict):
            return any(named(value) for value in kind.values())
        return isinstance(kind, str) and ("dynamic" in kind or kind in LENGTH_DEPENDENT_ROPE)

    return any(named(kind) for kind in kinds)


# Tensor arguments of a training forward that the probe replays (ids, mask, positions as checked by
# _unreplayable) or that do not change the logits; any other (pixel_values, image_grid_thw,
# token_type_ids, …) would be missing from the probe's forward.
REPLAYED = frozenset(
    {
        "input_ids",
        "attention_mask",
        "position_ids",
        "labels",
        "completion_mask",
        "cache_position",
        "logits_to_keep",
        "num_items_in_batch",
    }
)


def _holds_tensor(value) -> bool:
    """A tensor, or a list, tuple or dict of them (images passed one tensor per image)."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return any(isinstance(item, torch.Tensor) for item in value)
    return isinstance(value, torch.Tensor)


class ContextRecorder:
    """Keeps ``samples`` sequences (spread over the batch; ``None``: all) of a model's latest training forward.

    A forward pre-hook sees the batch (``input_ids``, ``attention_mask``, ``labels``) of every
    forward in train mode with grad enabled, so the two-line usage needs no extra call. ``active``
    says whether the optimizer is still bound to the model (not after
    :func:`~logra_optim.unpatch_model`); while it is not, nothing is recorded. A batch the probe
    could not run as the forward did (a 4-D attention mask, positions other than ``0, 1, …`` as in
    packed sequences, other tensor inputs such as a vision-language model's images) is not
    recorded: its contexts are kept with no probe position, with a warning once, so that no step
    probes an older batch instead.
    """

    def __init__(
        self, model: nn.Module, samples: int | None, temperature: float, active: Callable[[], bool] | None = None
    ):
        self.samples = samples
        self.temperature = temperature
        self.active = active or (lambda: True)
        self.latest: ProbeContexts | None = None
        self._warned = False
        # Rotary embeddings see only differences of positions; learned absolute ones see each.
        self._relative_positions = any("Rotary" in type(module).__name__ for module in model.modules())
        self.handle = model.register_forward_pre_hook(_RecordingHook(self, model), with_kwargs=True)

    def record(self, module: nn.Module, args, kwargs) -> None:
        """Record the probe contexts of one forward's arguments."""
        named = _named_arguments(module, args, kwargs) if len(args) > 1 else kwargs  # model(ids, mask, …)
        input_ids = (kwargs if named is None else named).get("input_ids", args[0] if args else None)
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            # A training forward the probe cannot replay (inputs_embeds): no older batch either.
            self.latest = None
            self._warn("no integer input_ids (inputs_embeds?)")
            return
        if named is None:
            unreplayable = "positional arguments behind a wrapper's *args, which cannot be read by name"
        elif extra := sorted(key for key, value in named.items() if key not in REPLAYED and _holds_tensor(value)):
            unreplayable = f"inputs the probe does not replay ({', '.join(extra)}; e.g. images)"
        else:
            unreplayable = _unreplayable(
                input_ids, named.get("attention_mask"), named.get("position_ids"), self._relative_positions
            )
        if unreplayable:
            # Kept, with no probe position: across ranks this rank still takes part in the probe's
            # collectives (and every rank raises together if none has a position); alone, the step
            # raises for want of contexts.
            contexts = contexts_from_batch(input_ids, samples=self.samples, temperature=self.temperature)
            self.latest = contexts.select(slice(None), torch.zeros_like(contexts.probe_mask))
            self._warn(unreplayable)
            return
        self.latest = contexts_from_batch(
            input_ids,
            named.get("attention_mask"),
            named.get("labels"),
            named.get("completion_mask"),
            self.samples,
            self.temperature,
        )

    def _warn(self, unreplayable: str) -> None:
        if self._warned:
            return
        self._warned = True
        warn(
            f"KL probe contexts: a training forward with {unreplayable} is not recorded, since the probe runs "
            "input_ids with a 2-D attention_mask and the default positions; give the contexts with "
            "optimizer.set_probe_contexts(input_ids, attention_mask, probe_mask)"
        )

    def remove(self) -> None:
        self.handle.remove()


def _named_arguments(module: nn.Module, args, kwargs) -> dict | None:
    """A forward's positional and keyword arguments by parameter name, or ``None`` where its
    signature cannot name them (a wrapper's ``forward(*args, **kwargs)``: ``torch.compile``'s
    module, DDP; the model inside is tried first)."""
    inner = getattr(module, "_orig_mod", None) or getattr(module, "module", None)
    forward = (inner if isinstance(inner, nn.Module) else module).forward
    try:
        bound = inspect.signature(forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    named = dict(bound.arguments)
    for name, parameter in bound.signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(name, {}))
        elif parameter.kind is inspect.Parameter.VAR_POSITIONAL and named.get(name):
            return None
    return named


def _unreplayable(input_ids: torch.Tensor, attention_mask, position_ids, relative: bool = True) -> str | None:
    """What of a forward's arguments the probe's ``model(input_ids, attention_mask)`` would not
    reproduce, or ``None``.

    Positions are replayed as ``0, 1, …``. Given ones that differ from those by one constant per row
    on the attended tokens (left padding with positions counted from the first real token, any
    value at padded positions) give the same logits where positions are ``relative`` (rotary
    embeddings, which see only their differences), not with learned absolute positions; positions
    that restart within a row (packed sequences) never do. Masks other than a 2-D tensor of
    ``input_ids``' shape (4-D, a dict of one per layer type) are not replayed either."""
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        return f"an attention_mask of type {type(attention_mask).__name__}"
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape != input_ids.shape:
        return f"a {attention_mask.dim()}-D attention_mask of shape {tuple(attention_mask.shape)}"
    if isinstance(position_ids, torch.Tensor):
        attended = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        try:
            offsets = position_ids.long() - torch.arange(input_ids.shape[1], device=position_ids.device)
            offsets, attended = torch.broadcast_tensors(offsets, attended.to(offsets.device))
        except RuntimeError:
            return f"position_ids of shape {tuple(position_ids.shape)}"
        big = torch.iinfo(torch.int64).max
        low = torch.where(attended, offsets, big).amin(-1)
        high = torch.where(attended, offsets, -big).amax(-1)
        if bool((high > low).any()):
            return "position_ids that restart within a row (packed sequences)"
        if not relative and bool((high != 0).any()):
            return "position_ids offset from 0, 1, … in a model with absolute position embeddings"
    return None


class _RecordingHook:
    """The forward pre-hook of a :class:`ContextRecorder`. A copy of the model (``copy.deepcopy``,
    pickle) gets an inert copy of it: the copy is a new, unbound model, whose forwards must not
    feed this optimizer's probe. It records only forwards of the model it was registered on (a
    shallow copy shares the hook)."""

    def __init__(self, recorder: ContextRecorder | None, model: nn.Module | None):
        self._recorder = None if recorder is None else weakref.ref(recorder)
        self._model = None if model is None else weakref.ref(model)

    def __call__(self, module, args, kwargs) -> None:
        recorder = None if self._recorder is None else self._recorder()
        if (
            recorder is not None
            and module is self._model()
            and module.training
            and torch.is_grad_enabled()
            and recorder.active()
        ):
            recorder.record(module, args, kwargs)

    def __reduce__(self):
        return _RecordingHook, (None, None)


def default_logits_fn(model: nn.Module, contexts: ProbeContexts) -> torch.Tensor:
    """``model(input_ids, attention_mask, use_cache=False).logits`` (or the output itself)."""
    output = model(input_ids=contexts.input_ids, attention_mask=contexts.attention_mask, use_cache=False)
    return output if isinstance(output, torch.Tensor) else output.logits


def low_rank_delta(x: torch.Tensor, projection: SharedProjection, factor: torch.Tensor) -> torch.Tensor:
    """``−(x Aᵀ) Fᵀ`` in fp32 (also inside an autocast region): the output change of
    ``W → W − F A`` for input ``x`` (its primal if ``x`` is dual). ``x Aᵀ`` is computed once for
    siblings sharing ``x`` and ``A``."""
    with torch.autocast(x.device.type, enabled=False):
        return -F.linear(projection.project(x, torch.float32), factor.float())


def perturbed_linear(module: nn.Linear, x: torch.Tensor, target) -> torch.Tensor:
    """The forward of a patched linear while a probe runs (see the module docstring)."""
    return perturbed_product(x, module.weight, module.bias, target, target.probe_factor)


def perturbed_product(x: torch.Tensor, weight: torch.Tensor, bias, target, factor: torch.Tensor) -> torch.Tensor:
    """``x Wᵀ + b`` with the change ``−(x Aᵀ) Fᵀ`` of the proposed update, as the tangent or the
    branch ``target.probe_mode`` says (``A``, mode and products from the target's record)."""
    target.probe_compute_dtype = fwAD.unpack_dual(x)[0].dtype
    if target.probe_mode == "branch":
        y = F.linear(x, weight, bias)
        return y + low_rank_delta(x, target.shared_projection, factor).to(y.dtype)
    primal_x, tangent_x = fwAD.unpack_dual(x)
    y, tangent = _primal_and_tangent(primal_x, tangent_x, weight, bias, target.probe_products)
    delta = low_rank_delta(x, target.shared_projection, factor).to(y.dtype)
    return fwAD.make_dual(y, delta if tangent is None else tangent + delta)


class LowPrecisionProducts:
    """The matrix products of a probe's linear layers in ``dtype`` (bf16): the input cast, the
    weight copied into one reusable buffer per device (and not copied again while the buffer
    still holds it: the LM head over successive chunks of positions), the product returned in the
    input's dtype.

    Not autocast: autocast would cast every weight into a fresh temporary (a weight-sized allocation
    per layer, which the allocator may keep) and would also run norms, attention and activations in
    16 bits. Here only the products are 16-bit; everything else keeps the weights' precision, and
    the extra memory is one 16-bit copy of the largest weight multiplied."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._held: dict[torch.device, tuple] = {}  # (weight, its version, its 16-bit copy)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ`` with a 16-bit product, returned in ``x``'s dtype."""
        return F.linear(x.to(self.dtype), self._cast(weight)).to(x.dtype)

    def _cast(self, weight: torch.Tensor) -> torch.Tensor:
        held = self._held.get(weight.device)
        if held is not None and held[0] is weight and held[1] == weight._version:
            return held[2]
        buffer = self._buffers.get(weight.device)
        if buffer is None or buffer.numel() < weight.numel():
            buffer = torch.empty(weight.numel(), dtype=self.dtype, device=weight.device)
            self._buffers[weight.device] = buffer
        low = buffer[: weight.numel()].view(weight.shape).copy_(weight)
        self._held[weight.device] = (weight, weight._version, low)
        return low


def _primal_and_tangent(
    x: torch.Tensor,
    tangent_x: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    products: LowPrecisionProducts | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x Wᵀ + b, ẋ Wᵀ)`` from one matrix product over ``[x; ẋ]``: with few probe tokens a
    product is bound by reading ``W``, which this reads once instead of twice. ``products``: compute
    the product in low precision."""
    stacked = x if tangent_x is None else torch.stack((x, tangent_x.to(x.dtype)))
    both = F.linear(stacked, weight) if products is None else products.linear(stacked, weight)
    if tangent_x is None:
        return (both if bias is None else both + bias), None
    return (both[0] if bias is None else both[0] + bias), both[1]


def _linear_with_tangent(module: nn.Linear, x: torch.Tensor, products: LowPrecisionProducts | None = None):
    primal_x, tangent_x = fwAD.unpack_dual(x)
    y, tangent = _primal_and_tangent(primal_x, tangent_x, module.weight, module.bias, products)
    return y if tangent is None else fwAD.make_dual(y, tangent)


@contextlib.contextmanager
def _frozen_linears_with_tangents(model: nn.Module, products: LowPrecisionProducts | None = None) -> Iterator[None]:
    """Forward AD's rule for ``linear`` also multiplies by a materialised zero tangent of the weight
    on CPU (three GEMMs instead of two); for the frozen non-target linears (``lm_head`` above all),
    compute ``ẏ = ẋ Wᵀ`` directly. Modules that already carry an instance ``forward`` (accelerate
    hooks, LoGRA targets) are left alone. ``products`` serve every such linear except the output
    embedding, whose 16-bit copy would be vocabulary-sized."""
    replaced = [m for m in model.modules() if type(m) is nn.Linear and "forward" not in m.__dict__]
    head = output_embedding(model)
    try:
        for module in replaced:
            low = None if module is head else products
            module.forward = types.MethodType(functools.partial(_linear_with_tangent, products=low), module)
        yield
    finally:
        for module in replaced:
            del module.forward


def output_embedding(model: nn.Module) -> nn.Module | None:
    """``model.get_output_embeddings()`` where the model has one (the LM head), else ``None``."""
    getter = getattr(model, "get_output_embeddings", None)
    try:
        return getter() if callable(getter) else None
    except (AttributeError, NotImplementedError):
        return None


@contextlib.contextmanager
def _probe_targets(
    targets: Sequence, factors: Sequence[torch.Tensor], mode: str, products: LowPrecisionProducts | None = None
) -> Iterator[None]:
    try:
        for target, factor in zip(targets, factors):
            target.probe_factor, target.probe_mode, target.probe_products = factor, mode, products
        yield
    finally:
        for target in targets:
            target.probe_factor = target.probe_products = None


@contextlib.contextmanager
def inference_environment(model: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout, no gradient checkpointing), no autograd graph, attention kernels
    with forward-AD formulas (the math SDPA backend; fused kernels such as CPU flash SDPA have
    none), and the weights' own precision. The model's train/eval flags, attention setting and
    forward are restored afterwards.

    Precision: a realistic step changes the logits by about ``update_ratio · ‖y‖`` (6e-5), below
    half a bf16 ulp. Under mixed precision the master weights are fp32 but the forward runs in a
    bf16/fp16 autocast region, where such a change is lost in rounding: the finite-difference
    probe and the realised-KL check would measure rounding noise. So the probe leaves autocast
    (any outer region) and bypasses accelerate's autocast wrapper of ``model.forward`` (installed on
    the model object itself when ``mixed_precision`` is bf16/fp16; it keeps the original forward as
    ``_original_forward``)."""
    training = {module: module.training for module in model.modules()}
    # Only a kernel without forward-AD support is switched (flash, flex, …), in each (sub-)config
    # that names one, and only there restored.
    settings = _attention_settings(getattr(model, "config", None))
    switched = [(config, kernel) for config, kernel in settings if kernel not in (None, "eager", "sdpa")]
    wrapped_forward = model.__dict__.get("forward") if "_original_forward" in model.__dict__ else None
    try:
        model.eval()
        for config, _ in switched:
            _set_attention(config, "sdpa")
        if wrapped_forward is not None:
            model.forward = model.__dict__["_original_forward"]
        with contextlib.ExitStack() as stack:
            stack.enter_context(outside_autocast(p.device.type for p in model.parameters()))
            stack.enter_context(torch.no_grad())
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
            yield
    finally:
        for module, flag in training.items():
            module.training = flag
        for config, kernel in switched:
            _set_attention(config, kernel)
        if wrapped_forward is not None:
            model.forward = wrapped_forward


def _attention_settings(config) -> list[tuple[object, str | None]]:
    """``(config, attention kernel)`` of a model's config and of every sub-config under it (a
    multimodal model's text and vision towers may name their own), each config once."""
    found, seen, pending = [], set(), [config]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen or not hasattr(current, "_attn_implementation"):
            continue
        seen.add(id(current))
        found.append((current, current._attn_implementation))
        pending += [getattr(current, name, None) for name in getattr(current, "sub_configs", None) or ()]
    return found


def _set_attention(config, kernel) -> None:
    """Set one config's attention kernel alone: transformers' setter also writes it into every
    sub-config, whose own settings must stay as they are."""
    if "_attn_implementation_internal" in vars(config):
        config._attn_implementation_internal = kernel
    else:
        config._attn_implementation = kernel


# Device types that torch.autocast accepts (an autocast region elsewhere is not possible).
AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu")


@contextlib.contextmanager
def outside_autocast(device_types: Iterable[str]) -> Iterator[None]:
    """Leave any autocast region on the CPU and on ``device_types`` (where torch.autocast exists)."""
    with contextlib.ExitStack() as stack:
        for device_type in sorted({"cpu", *device_types} & set(AUTOCAST_DEVICE_TYPES)):
            stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def _probe_logits(model, contexts, logits_fn) -> torch.Tensor:
    return logits_fn(model, contexts)[contexts.probe_mask]


# Probe positions whose logits (primal and tangent) exist at once on the chunked path: at most
# HEAD_CHUNK_POSITIONS, and at most HEAD_CHUNK_LOGITS logits per half unless that leaves fewer than
# 64 positions (256 positions at 32k words, 64 at 152k). Stacked, 256 positions make a product of
# 512 rows: at 128 rows it ran at two thirds of the throughput on a 2-core CPU.
HEAD_CHUNK_POSITIONS = 256
HEAD_CHUNK_LOGITS = 1 << 23


def head_chunk_positions(vocabulary: int) -> int:
    """Probe positions per chunk of the LM head at ``vocabulary`` words."""
    return min(HEAD_CHUNK_POSITIONS, max(64, HEAD_CHUNK_LOGITS // max(vocabulary, 1)))


def _decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """``(decoder, lm_head)`` when the model's logits are exactly ``lm_head(decoder(...)[0])``, so
    the probe can apply the head a chunk of probe positions at a time instead of materialising
    ``positions × vocabulary`` logits twice (primal and tangent); ``None`` otherwise.

    Not taken for heads with logit soft-capping or scaling, or whose parameters are sharded (FSDP2
    DTensors, ZeRO-3 partitions): the root module's hooks gather those, and calling the decoder
    directly would bypass them."""
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    head, decoder = get_head(), get_decoder()
    config = getattr(model, "config", None)
    if type(head) is not nn.Linear or decoder is None or decoder is model:
        return None
    if any(getattr(config, name, None) for name in ("final_logit_softcapping", "logit_scale", "logits_scaling")):
        return None
    if any(type(p).__name__ == "DTensor" or hasattr(p, "ds_tensor") for p in model.parameters()):
        return None
    return decoder, head


# Whether a model's logits are exactly ``lm_head(decoder(x)[0])``, checked once per model.
_HEAD_REPRODUCES_LOGITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _chunkable_head(model: nn.Module, contexts: ProbeContexts) -> tuple[nn.Module, nn.Linear] | None:
    """:func:`_decoder_and_head`, kept only if the head applied to the decoder's output reproduces
    ``model(x).logits`` at one position. Models scale or cap logits in places no config name
    reveals (FalconH1's ``lm_head_multiplier``, a composite config's ``text_config``); the chunked
    path would then miss the factor, squared, in ``q``. Checked once per model, on a few tokens."""
    split = _decoder_and_head(model)
    if split is None:
        return None
    if model not in _HEAD_REPRODUCES_LOGITS:
        decoder, head = split
        # One sequence, compared at a position it attends from (padding can sit on either side).
        row = 0 if contexts.attention_mask is None else int(contexts.attention_mask.any(dim=1).int().argmax())
        mask = None if contexts.attention_mask is None else contexts.attention_mask[row : row + 1]
        one = ProbeContexts(contexts.input_ids[row : row + 1], mask, contexts.probe_mask[row : row + 1])
        if mask is not None and not bool(mask.any()):
            return None  # nothing attended anywhere: no position to compare, take the full path
        position = int(mask[0].nonzero()[-1]) if mask is not None else -1
        with inference_environment(model):
            logits = default_logits_fn(model, one)[0, position].float()
            output = decoder(input_ids=one.input_ids, attention_mask=one.attention_mask, use_cache=False)
            hidden = output if isinstance(output, torch.Tensor) else output[0]
            chunked = F.linear(hidden[0, position], head.weight, head.bias).float()
        scale = float(logits.abs().max()) or 1.0
        _HEAD_REPRODUCES_LOGITS[model] = chunked.shape == logits.shape and bool(
            (chunked - logits).abs().max() <= 1e-3 * scale
        )
    return split if _HEAD_REPRODUCES_LOGITS[model] else None


def _chunked_head_kl_terms(
    decoder,
    head: nn.Linear,
    contexts: ProbeContexts,
    products: LowPrecisionProducts | None = None,
    words: int | str | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """Per-position ``q_s`` with the LM head applied :func:`head_chunk_positions` positions at a time
    (with ``products``, in 16 bits: the head cast once, for all chunks; the only vocabulary-sized
    16-bit copy the probe makes, and only for the probe's duration).

    ``words``: estimate each ``q_s`` from that many words (:func:`words_to_sample`,
    :func:`word_tangents`) instead of the whole vocabulary; the head's product then runs on the
    primal alone."""
    output = decoder(input_ids=contexts.input_ids, attention_mask=contexts.attention_mask, use_cache=False)
    hidden = output if isinstance(output, torch.Tensor) else output[0]
    primal, tangent = fwAD.unpack_dual(hidden)
    if tangent is None:
        raise RuntimeError("KL probe: the hidden states carry no tangent; no patched target was on the path to them")
    primal, tangent = primal[contexts.probe_mask], tangent[contexts.probe_mask]
    words = words_to_sample(words, head.weight.shape[0])
    # The more likely half exactly, the other half drawn (one uniform per drawn word).
    uniforms = None if words is None else word_uniforms(primal.shape[0], words // 2, seed).to(primal.device)
    terms = [torch.zeros(0, dtype=torch.float64, device=primal.device)]
    # Without the tangent half, twice the positions make a product of the same rows and logits.
    step = head_chunk_positions(head.weight.shape[0]) * (1 if uniforms is None else 2)
    for start in range(0, primal.shape[0], step):
        rows = slice(start, start + step)
        if uniforms is None:
            logits, tangent_logits = _primal_and_tangent(primal[rows], tangent[rows], head.weight, head.bias, products)
            terms.append(fisher_kl_terms(logits, tangent_logits, contexts.temperature))
        else:
            logits, _ = _primal_and_tangent(primal[rows], None, head.weight, head.bias, products)
            sample = sample_words(logits, words - words // 2, uniforms[rows], contexts.temperature)
            del logits
            word_tangent = word_tangents(tangent[rows], head.weight, sample.indices)
            terms.append(sampled_fisher_kl_terms(sample, word_tangent, contexts.temperature))
    return torch.cat(terms)


# probe_words="auto": a sample of AUTO_WORDS words per position from AUTO_WORDS_MIN_VOCABULARY words on.
# Below that the head's tangent product and the float64 terms over every word are a small part of
# the probe (the break-even of one tangent product against 64 gathered rows per position is near
# 2k words on a 2-core CPU), and the exact terms cost little more.
AUTO_WORDS = 64
AUTO_WORDS_MIN_VOCABULARY = 8192


def words_to_sample(words: int | str | None, vocabulary: int) -> int | None:
    """The words per position the probe reads for ``probe_words=words`` at ``vocabulary`` words;
    ``None``: every word (``words`` is ``None``, or the vocabulary holds no more than ``words``)."""
    if words == "auto":
        words = AUTO_WORDS if vocabulary >= AUTO_WORDS_MIN_VOCABULARY else None
    return None if words is None or vocabulary <= words else int(words)


# Added to the update index (mod 2³²) to seed the word draws: a stream apart from the positions'
# draw (subsample_positions), which the update index seeds itself. The CPU generator's Mersenne
# Twister keeps only a seed's low 32 bits, so the offset must change those.
WORD_STREAM = 0x9E3779B9


def word_uniforms(positions: int, draws: int, seed: int) -> torch.Tensor:
    """The uniforms (``positions × draws``) that draw each position's sampled words, from a CPU
    generator seeded with ``seed`` (the update index) plus :data:`WORD_STREAM`, so that every device
    draws the same uniforms, independent of the positions' draw."""
    generator = torch.Generator().manual_seed((seed + WORD_STREAM) % 2**32)
    return torch.rand(positions, draws, generator=generator, dtype=torch.float64)


# Bytes of head rows word_tangents gathers at a time on a CPU (16 positions of 64 fp32 words at 1024
# hidden units): one buffer, reused for every chunk and small enough to stay in cache for the
# product that reads it. Gathering a chunk of logits' worth (32 MiB) into a fresh tensor each time
# took 2.1-2.6x as long at the h1024 probe's shape on a 2-core AMD EPYC (word_gather_micro.py in
# benchmarks/results/bench-h1024-acc4-kl-epyc/): an allocation that size is mapped anew and faulted
# in page by page. Elsewhere (CUDA's caching allocator reuses its blocks, and each chunk is two
# kernel launches) the chunks stay a chunk of logits' worth, HEAD_CHUNK_LOGITS.
WORD_GATHER_BYTES = 1 << 22


def word_tangents(tangent: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``ż`` of each position at its words: ``ḣ · W_v`` for ``v`` in its row of ``indices`` (the
    head's bias has no tangent), one dot product per word instead of a product with all of ``W``."""
    rows, words = indices.shape
    hidden = weight.shape[1]
    out = tangent.new_empty((rows, words), dtype=weight.dtype)
    tangent = tangent.to(weight.dtype)
    budget = WORD_GATHER_BYTES if weight.device.type == "cpu" else HEAD_CHUNK_LOGITS * weight.element_size()
    step = max(1, budget // (words * hidden * weight.element_size()))
    gathered = weight.new_empty((min(step, rows) * words, hidden))
    for start in range(0, rows, step):
        chunk = indices[start : start + step].reshape(-1)
        rows_of_words = torch.index_select(weight, 0, chunk, out=gathered[: chunk.numel()])
        out[start : start + step] = torch.bmm(
            rows_of_words.view(-1, words, hidden), tangent[start : start + step, :, None]
        )[..., 0]
    return out


def jvp_predicted_kl(
    model,
    targets,
    factors,
    contexts: ProbeContexts,
    logits_fn: LogitsFn = default_logits_fn,
    keep_base: bool = True,
    compute_dtype: torch.dtype | None = None,
    words: int | str | None = None,
    seed: int = 0,
):
    """``(Σ_s q_s, |P|, base logits at P)`` for the update ``D_W = −F A``, from one dual forward.

    With ``keep_base=False`` (the base logits are only needed by a realised-KL check) and the
    default ``logits_fn``, the LM head runs a chunk of positions at a time where the model allows
    it (see ``_chunkable_head``), and the base logits returned are ``None``: the full
    ``positions × vocabulary`` logits, twice over, would otherwise set the probe's memory peak at
    large vocabularies. The forward then runs on :func:`compact_contexts` (each distinct sequence
    once, cut after its last probe position unless the model's positions depend on the sequence's
    length), its terms weighted by how many of the given sequences probe each position.

    ``compute_dtype`` (bf16): the linear layers' primal and tangent products are 16-bit
    (:class:`LowPrecisionProducts`; the output embedding's excepted), everything else keeps the
    weights' precision, the low-rank term ``−(x Aᵀ) Fᵀ`` is fp32 and the KL terms float64.
    ``None``: the weights' own precision throughout. Either way outside any autocast region.

    ``words`` (on the chunked path only): estimate each position's term from that many words, the
    more likely half exactly and the other half drawn with ``seed`` (:func:`.kl.sample_words`), or
    ``"auto"`` (:func:`words_to_sample`); ``None`` or a vocabulary of at most ``words`` words: every
    word."""
    weights, split, tokens = None, None, contexts.tokens
    # Not with base logits (returned per position of the contexts as given) or a custom logits_fn
    # (which may pair each row with inputs of its own).
    if not keep_base and logits_fn is default_logits_fn:
        contexts, weights = compact_contexts(contexts, cut=not positions_depend_on_length(model))
        split = _chunkable_head(model, contexts)
    products = None if compute_dtype is None else LowPrecisionProducts(compute_dtype)
    with (
        inference_environment(model),
        fwAD.dual_level(),
        _probe_targets(targets, factors, "tangent", products),
        _frozen_linears_with_tangents(model, products),
        AttentionTangentMode(),
        ElementwiseTangentMode(),
    ):
        if split is not None:
            terms, base = _chunked_head_kl_terms(*split, contexts, products, words, seed), None
        else:
            logits = logits_fn(model, contexts)
            primal, tangent = fwAD.unpack_dual(logits)
            if tangent is None:
                raise RuntimeError("KL probe: the logits carry no tangent; no patched target was on the path to them")
            base = primal[contexts.probe_mask]
            terms = fisher_kl_terms(base, tangent[contexts.probe_mask], contexts.temperature)
    if weights is None:
        return terms.sum(), tokens, base
    return (terms * weights).sum(), tokens, None


def finite_difference_predicted_kl(model, targets, factors, contexts, logits_fn=default_logits_fn, epsilon=1.0):
    """``(Σ_s KL_s(θ ‖ θ+εD)/ε², |P|, base logits at P)``: two forwards, exact full-vocabulary KL,
    ``εD`` applied as a temporary low-rank branch so the weights stay bit-exact."""
    with inference_environment(model):
        base = _probe_logits(model, contexts, logits_fn)
        with _probe_targets(targets, [f * epsilon for f in factors], "branch"):
            perturbed = _probe_logits(model, contexts, logits_fn)
    terms = exact_kl_terms(base, perturbed, contexts.temperature) / epsilon**2
    return terms.sum(), terms.numel(), base


def realised_kl(model, contexts, base_logits, logits_fn=default_logits_fn):
    """``(Σ_s KL_s(π_before ‖ π_now), |P|)`` on the probe contexts, with the model as it is now."""
    with inference_environment(model):
        now = _probe_logits(model, contexts, logits_fn)
    terms = exact_kl_terms(base_logits, now, contexts.temperature)
    return terms.sum(), terms.numel()
