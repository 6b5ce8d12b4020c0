"""Find the target linears (and stacked experts) of a model and patch them to accumulate sketches.

Patching keeps each target an ordinary ``nn.Linear`` with the same parameters: only an
instance-level ``forward`` and a ``_logra`` record are added, so ``state_dict`` keys,
``save_pretrained`` output and ``isinstance`` checks elsewhere (HF, DeepSpeed, vLLM loaders) are
exactly those of the unpatched model. Mixture-of-experts blocks are patched the same way: an
instance-level ``forward`` and a ``_logra_experts`` record on the ``*Experts`` module
(:mod:`.experts`). :func:`unpatch_model` removes all of it and restores every ``requires_grad``
flag it changed.
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .caller import warn
from .experts import (
    WEIGHT_DTYPES,
    expert_weight_names,
    holds_experts,
    probing_linear,
    routed_experts,
    sketching_linear,
)
from .probe import output_embedding, perturbed_linear
from .projection import canonical_name
from .sketch import SharedProjection, sketched_linear

# Attention and MLP projections of the common decoder families: Llama, Qwen2/3, Mistral, Gemma
# (q/k/v/o, gate/up/down), Phi-3 (fused qkv_proj, gate_up_proj), OPT/BART (out_proj, fc1, fc2),
# GPT-NeoX/Falcon (query_key_value, dense*), Mixtral experts (w1, w2, w3).
DEFAULT_TARGET_NAMES = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "qkv_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "gate_up_proj",
        "out_proj",
        "fc1",
        "fc2",
        "query_key_value",
        "dense",
        "dense_h_to_4h",
        "dense_4h_to_h",
        "w1",
        "w2",
        "w3",
    }
)


@dataclass(eq=False)
class TargetState:
    """What a patched linear carries: its names, the flags to restore, and, while an optimizer is
    bound, what determines its current projection ``A`` (possibly shared with sibling targets; ``A``
    is generated where it is used, never kept) and its sketch view ``S``."""

    name: str
    canonical_name: str
    weight_requires_grad: bool
    experts: int = 1  # matrices stacked in the weight: E for a mixture-of-experts weight [E, d, k]
    transposed: bool = False  # stacked experts stored [E, k, d] (GPT-OSS): expert e's matrix is weight[e]ᵀ
    shared_projection: SharedProjection | None = None
    sketch: torch.Tensor | None = None
    owner: weakref.ref | None = None
    # Set only while a KL probe runs: the proposed update is ``−probe_factor · A``.
    probe_factor: torch.Tensor | None = None
    probe_mode: str = "tangent"
    probe_products: object | None = None  # low-precision products of the JVP probe (probe_dtype)
    # The dtype the latest probe forward computed this layer in (its input's): under FSDP2's
    # MixedPrecisionPolicy it is bf16 although the stored weight is fp32.
    probe_compute_dtype: torch.dtype | None = None
    # Set by a backward whose sketch product was bf16/fp16 (autocast, bf16 weights, FSDP2's bf16
    # compute) since the sketch was last cleared; the optimizer then raises its orthogonal floor.
    sketched_in_16_bit: bool = False
    sketched_in_fp16: bool = False  # fp16 in particular, which the optimizer refuses
    # Set by a train-mode forward (of at least one row) and by a backward into the sketch, while
    # bound: a target forwarded but never reached gets no gradient (see the optimizer's first update).
    forwarded: bool = False
    reached: bool = False
    # Set by a backward through an eval-mode forward of this target: it reached no sketch (see the
    # optimizer's step).
    backward_in_eval: bool = False

    @property
    def bound(self) -> bool:
        """Whether an optimizer is bound (a projection and a sketch to accumulate into)."""
        return self.shared_projection is not None

    def generate_projection(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The current ``A``, generated now on the optimizer's device for this target: a new tensor
        that nothing else keeps (call it where ``A`` is needed, let it go after)."""
        return self.shared_projection.generate(dtype)

    def set_projection(self, projection: SharedProjection | None) -> None:
        """Bind the projection (one :class:`SharedProjection` object for siblings sharing ``A``)."""
        self.shared_projection = projection

    def unbind(self) -> None:
        """Release the optimizer: plain forwards from now on, no ``A`` or ``S`` kept alive."""
        self.shared_projection = None
        self.sketch = None
        self.owner = None

    def __reduce__(self):
        # A copied or pickled model is a new, unbound model: it must not sketch into this
        # optimizer's buffers (and a weak reference to the optimizer cannot be pickled).
        return TargetState, (self.name, self.canonical_name, self.weight_requires_grad, self.experts, self.transposed)


@dataclass(eq=False)
class ExpertsPatch:
    """What a patched experts module carries: its two target weights' names (input side first) and
    their records."""

    names: tuple[str, str]
    states: dict[str, TargetState]

    def ordered(self) -> tuple[TargetState, TargetState]:
        return self.states[self.names[0]], self.states[self.names[1]]


@dataclass(eq=False)
class PatchRecord:
    """Model-level record of a patch: the requires_grad flags of non-targets it froze, and hooks."""

    frozen: dict[str, bool] = field(default_factory=dict)
    hooks: list = field(default_factory=list)


def _patched_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    target: TargetState = self._logra
    if target.probe_factor is not None:
        return perturbed_linear(self, input, target)
    # Sketch work only where a backward can follow: train mode with grad enabled, optimizer bound.
    if not target.bound or not self.training:
        output = F.linear(input, self.weight, self.bias)
        if target.bound and output.requires_grad:
            _flag_backward_in_eval(output, [target])
        return output
    target.forwarded = target.forwarded or input.numel() > 0
    if not torch.is_grad_enabled():
        return F.linear(input, self.weight, self.bias)
    _check_device(target, self.weight)
    return sketched_linear(input, self.weight, self.bias, target.shared_projection, target.sketch, target)


def _patched_experts_forward(self: nn.Module, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
    patch: ExpertsPatch = self._logra_experts
    states = patch.ordered()
    if any(state.probe_factor is not None for state in states):
        return routed_experts(
            self, hidden_states, top_k_index, top_k_weights, probing_linear(self, patch.names, states)
        )
    if not states[0].bound or not (self.training and torch.is_grad_enabled()):
        output = type(self).forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        if states[0].bound and isinstance(output, torch.Tensor) and output.requires_grad and not self.training:
            _flag_backward_in_eval(output, states)
        return output
    _check_device(states[0], getattr(self, patch.names[0]))
    linear = sketching_linear(self, patch.names, states, hidden_states)
    return routed_experts(self, hidden_states, top_k_index, top_k_weights, linear)


def _flag_backward_in_eval(output: torch.Tensor, states: list[TargetState]) -> None:
    """Mark ``states`` once a backward goes through ``output`` of an eval-mode forward: it adds
    nothing to their sketches. A hook on the output, so that an eval forward no backward follows
    (evaluation with grad enabled, under gradient checkpointing's input hook) marks nothing."""

    def mark(grad: torch.Tensor) -> None:
        for state in states:
            state.backward_in_eval = True

    output.register_hook(mark)


def _check_device(target: TargetState, weight: torch.Tensor) -> None:
    """The sketch (and the device ``A`` is generated on) was placed where the weight was when the
    optimizer was built; a model moved since would sketch across devices."""
    if target.sketch.device != weight.device:
        raise RuntimeError(
            f"LoGRA target {target.name!r}: weight is on {weight.device} but the optimizer's sketch and "
            f"projection are on {target.sketch.device}. Move the model before creating LoGRAOptimizer, as with "
            "any torch optimizer."
        )


def _is_gpt2_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _matches(name: str, target_modules) -> bool:
    if target_modules is None:
        return name.rsplit(".", 1)[-1] in DEFAULT_TARGET_NAMES
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith("." + t) for t in target_modules)


def find_target_modules(
    model: nn.Module, target_modules: str | Iterable[str] | None = None, *, required: bool = True
) -> list[tuple[str, nn.Linear]]:
    """The ``(name, module)`` pairs :func:`patch_model` would patch (the linear ones; stacked
    experts are found by :func:`find_experts_modules`). None found is an error if ``required``.

    ``target_modules``: ``None`` for the default attention/MLP projections, a list of names
    (a module matches if its name equals one or ends with ``"." + name``), a regular expression
    matched against the full module name, or ``"all-linear"`` (every ``nn.Linear`` except the
    output embedding), as in peft.
    """
    if target_modules is not None and not isinstance(target_modules, str):
        if not isinstance(target_modules, Iterable):
            raise TypeError(
                f"target_modules must be None, 'all-linear', a regular expression or a list of module names, "
                f"got {type(target_modules).__name__}"
            )
        target_modules = list(target_modules)
        if not target_modules or not all(isinstance(t, str) for t in target_modules):
            raise ValueError(f"target_modules must be None, a string or a list of names, got {target_modules!r}")
    head = output_embedding(model)
    all_linear = target_modules == "all-linear"
    # nn.MultiheadAttention reads its out_proj's weight without calling its forward: unsketchable.
    unsketchable = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    named = not all_linear and target_modules is not None  # the user's own selection
    found, linears, skipped = [], [], []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            linears.append(name)
            if module is head or name.rsplit(".", 1)[-1] == "lm_head":
                continue
            if not (all_linear or _matches(name, target_modules)):
                continue
            if id(module) in unsketchable:
                skipped.append(name)
            elif module.weight.dtype not in WEIGHT_DTYPES:
                raise ValueError(
                    f"target module {name!r} ({type(module).__name__}) stores a {module.weight.dtype} weight: "
                    "quantized linears cannot be patched; load the model in fp32/bf16 or choose other targets"
                )
            elif _own_forward(module) and named:
                raise ValueError(
                    f"target module {name!r} is a {type(module).__name__}, an nn.Linear subclass with a forward of "
                    "its own, which LoGRA's sketching forward would replace (changing its output); choose "
                    "target_modules without it"
                )
            elif _own_forward(module):  # swept up, e.g. a router under "all-linear"
                skipped.append(name)
            else:
                found.append((name, module))
        elif (
            _is_gpt2_conv1d(module) and not all_linear and target_modules is not None and _matches(name, target_modules)
        ):
            raise ValueError(
                f"target module {name!r} is a GPT-2 Conv1D (weight stored in×out); LoGRA patches "
                "torch.nn.Linear only. Convert the model to nn.Linear layers or choose other targets."
            )
    if named and not isinstance(target_modules, str):
        names = [name for name, _ in model.named_modules()]
        unmatched = [t for t in target_modules if not any(_matches(name, [t]) for name in names)]
        if unmatched and found:  # none found at all is the error below
            warn(
                f"patch_model: target_modules names {unmatched} match no module of the model (a misspelled name?); "
                "a name matches a module whose name is it or ends with '.' + it",
                RuntimeWarning,
            )
    if skipped:
        warn(
            f"patch_model: {', '.join(skipped[:3])}{' …' if len(skipped) > 3 else ''} left out of LoGRA's targets: "
            "an nn.MultiheadAttention's out_proj (used without calling the layer, so no sketch could see its "
            "gradient) or an nn.Linear subclass with a forward of its own (e.g. a router), which the sketching "
            "forward would replace. They stay non-targets (frozen under freeze_non_targets, or trained by "
            "non_target_optimizer)",
            RuntimeWarning,
        )
    if not found and required:
        seen = ", ".join(linears[:20]) + (" …" if len(linears) > 20 else "") or "none"
        conv1d = any(_is_gpt2_conv1d(m) for m in model.modules())
        hint = " The model uses GPT-2 Conv1D layers, which are not supported." if conv1d else ""
        if isinstance(target_modules, str) and target_modules != "all-linear":
            hint += (
                " A string is a regular expression matched against the full module name (e.g. r'.*\\.q_proj');"
                " a list of names (['q_proj']) matches by the name's last parts."
            )
        raise ValueError(
            f"no LoGRA target modules found for target_modules={target_modules!r}. "
            f"Linear modules in the model: {seen} (the output embedding is never a target).{hint}"
        )
    return found


# nn.Linear subclasses whose forward computes exactly F.linear(x, weight, bias).
PLAIN_LINEAR_SUBCLASSES = frozenset({"FalconLinear"})


def _own_forward(module: nn.Linear) -> bool:
    """Whether ``module``'s forward is other than the plain linear the sketching forward computes."""
    return type(module).forward is not nn.Linear.forward and type(module).__name__ not in PLAIN_LINEAR_SUBCLASSES


class _InputsRequireGradUnderCheckpointing:
    """Reentrant gradient checkpointing only builds a graph for a block whose *inputs* require grad;
    with frozen embeddings nothing would (HF's ``enable_input_require_grads`` remedy). Without
    checkpointing the sketched layers keep the graph alive themselves, and making the embedding
    output require grad would only add a backward through layer 0's inputs that nobody uses.

    A forward hook of the input embedding that reads the model's ``is_gradient_checkpointing``. A
    deep copy or a pickled copy of the model gets one that reads the copy (pickle creates the model
    before its modules' state, so the reference back to it resolves)."""

    def __init__(self, model: nn.Module | None):
        self._model = None if model is None else weakref.ref(model)

    def __call__(self, module, args, output) -> None:
        model = None if self._model is None else self._model()
        if (
            model is not None
            and getattr(model, "is_gradient_checkpointing", False)
            and torch.is_grad_enabled()
            and isinstance(output, torch.Tensor)
            and not output.requires_grad
        ):
            output.requires_grad_(True)

    def __deepcopy__(self, memo) -> _InputsRequireGradUnderCheckpointing:
        model = None if self._model is None else self._model()
        return _InputsRequireGradUnderCheckpointing(memo.get(id(model), model))

    def __reduce__(self):
        return _InputsRequireGradUnderCheckpointing, (None if self._model is None else self._model(),)


def find_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module, tuple[str, str]]]:
    """``(name, module, (input weight, output weight))`` of every mixture-of-experts ``*Experts``
    module of ``model``; raises a ``ValueError`` naming any module with stacked weights whose layout
    LoGRA does not support (see :mod:`.experts`)."""
    return [
        (name, module, expert_weight_names(name, module))
        for name, module in model.named_modules()
        if holds_experts(module)
    ]


def patch_model(
    model: nn.Module,
    target_modules: str | Iterable[str] | None = None,
    *,
    freeze_non_targets: bool = True,
    experts: bool = True,
) -> nn.Module:
    """Patch ``model`` in place so its target linears accumulate LoGRA sketches; returns ``model``.

    Target weights are frozen (``requires_grad=False``): no ``.grad`` is ever allocated for them,
    while input gradients flow through them as usual. With ``freeze_non_targets`` (default) every
    other parameter is frozen too, as in the paper (embeddings, norms, ``lm_head``, biases stay
    fixed); unfreeze some and pass ``non_target_optimizer`` to :class:`LoGRAOptimizer` to train
    them densely. Patching an already patched model adds any new targets and changes nothing else;
    while an optimizer drives its targets, adding any is refused (it would never train them).

    ``experts`` (default): the stacked expert weights of mixture-of-experts blocks are targets too
    (per-expert sketches, :mod:`.experts`); a module with stacked weights in a layout LoGRA does not
    support is an error. ``False`` leaves experts out (frozen with a warning under
    ``freeze_non_targets``). The router stays a non-target (frozen, or trained by
    ``non_target_optimizer``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch_model expects a torch.nn.Module, got {type(model).__name__}")
    if hasattr(model, "peft_config"):
        raise ValueError(
            "patch_model got a PEFT-wrapped model; LoGRA trains the base weights directly. "
            "Merge or drop the adapters first (model.merge_and_unload() or model.unload()): the base model of a "
            "PeftModel still holds the injected LoRA layers."
        )
    expert_modules = find_experts_modules(model) if experts else []
    # Stacked experts are targets whatever target_modules says. They may be the only ones: with the
    # default selection where no linear matches it, or with target_modules=[]; a selection that
    # names linears and matches none is an error either way (a misspelled name).
    experts_only = isinstance(target_modules, list | tuple) and not target_modules
    if experts_only and not expert_modules:
        raise ValueError(
            "target_modules=[] selects no linear layer, and no stacked experts are targets (experts=False, or the "
            "model has none)"
        )
    required = not expert_modules or target_modules is not None
    targets = [] if experts_only else find_target_modules(model, target_modules, required=required)
    owners = {id(getattr(module, attribute)): name for name, module, attribute in patched_targets(model)}
    for name, module in targets:  # validate everything before changing anything
        if hasattr(module, "_logra"):
            continue
        owner = owners.setdefault(id(module.weight), name)
        if owner != name:
            raise ValueError(
                f"target modules {owner!r} and {name!r} share one weight tensor: LoGRA would merge two updates into "
                "it and could not restore its requires_grad; choose target_modules with one of them"
            )
        if "forward" in module.__dict__:
            raise ValueError(
                f"target module {name!r} already has an instance-level forward (e.g. accelerate's device_map/offload "
                "hooks); LoGRA would replace it. Load the model without device_map/offloading or choose other targets"
            )
    for name, module, _ in expert_modules:
        if "forward" in module.__dict__ and not hasattr(module, "_logra_experts"):
            raise ValueError(
                f"experts module {name!r} already has an instance-level forward (e.g. accelerate's device_map/offload "
                "hooks); LoGRA would replace it. Load the model without device_map/offloading, or pass experts=False"
            )
    new = [name for name, module in targets if not hasattr(module, "_logra")]
    new += [name for name, module, _ in expert_modules if not hasattr(module, "_logra_experts")]
    if new and any(target_state(module, attribute).bound for _, module, attribute in patched_targets(model)):
        raise RuntimeError(
            f"patch_model: this model's targets are driven by a LoGRAOptimizer, which would never train the new "
            f"targets {new[:3]}{' …' if len(new) > 3 else ''} (they would only be frozen); patch every target "
            "before building the optimizer, or drop it (del, then gc.collect() if it is in a reference cycle) and "
            "build a new one after patching"
        )
    record: PatchRecord | None = getattr(model, "_logra_patch", None)
    first_patch = record is None
    if first_patch:
        record = PatchRecord()
        try:
            embedding = model.get_input_embeddings()
        except (AttributeError, NotImplementedError):  # not a transformers model, or one without
            embedding = None
        if isinstance(embedding, nn.Module):
            record.hooks.append(embedding.register_forward_hook(_InputsRequireGradUnderCheckpointing(model)))
        model._logra_patch = record
    for name, module in targets:
        if hasattr(module, "_logra"):
            continue
        module._logra = TargetState(
            name=name,
            canonical_name=canonical_name(name),
            weight_requires_grad=module.weight.requires_grad,
        )
        module.weight.requires_grad_(False)
        module.forward = functools.partial(_patched_forward, module)
    for name, module, names in expert_modules:
        if hasattr(module, "_logra_experts"):
            continue
        states = {}
        for attribute in names:
            weight = getattr(module, attribute)
            full_name = f"{name}.{attribute}"
            states[attribute] = TargetState(
                full_name, canonical_name(full_name), weight.requires_grad, weight.shape[0], module.is_transposed
            )
            weight.requires_grad_(False)
        module._logra_experts = ExpertsPatch(names, states)
        module.forward = functools.partial(_patched_experts_forward, module)
    if freeze_non_targets and first_patch:  # a second call leaves flags the user changed since alone
        target_weights = {id(getattr(m, attribute)) for _, m, attribute in patched_targets(model)}
        for name, param in model.named_parameters():
            if id(param) not in target_weights and param.requires_grad:
                record.frozen.setdefault(name, True)
                param.requires_grad_(False)
        _warn_about_frozen_experts(model, record.frozen)
    return model


def _warn_about_frozen_experts(model: nn.Module, frozen: dict[str, bool]) -> None:
    """Stacked expert weights (``[E, out, in]``, transformers' ``*Experts`` modules) hold most of a
    mixture-of-experts model's parameters; a user who left them out (``experts=False``) would
    otherwise train only attention without noticing, so say which ones were frozen."""
    experts = [
        (f"{prefix}.{name}" if prefix else name, tuple(param.shape))
        for prefix, module in model.named_modules()
        if holds_experts(module)
        for name, param in module.named_parameters(recurse=False)
        if param.dim() == 3 and (f"{prefix}.{name}" if prefix else name) in frozen
    ]
    if experts:
        name, shape = experts[0]
        warn(
            f"patch_model froze {len(experts)} stacked expert weights left out of LoGRA's targets (mixture-of-"
            f"experts, experts=False, e.g. {name!r} {list(shape)}): they will not be trained. To train them with "
            "LoGRA, patch with experts=True (the default); to train them densely, set their requires_grad back to "
            "True and pass non_target_optimizer=... to LoGRAOptimizer"
        )


def patched_modules(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The patched target linears of ``model`` in module order (empty if it is not patched)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(getattr(m, "_logra", None), TargetState)]


def patched_targets(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """Every patched target weight of ``model`` in module order, as ``(name, module, attribute)``:
    ``(module name, linear, "weight")`` or ``(parameter name, experts module, "down_proj")``."""
    found = []
    for name, module in model.named_modules():
        if isinstance(getattr(module, "_logra", None), TargetState):
            found.append((name, module, "weight"))
        patch = getattr(module, "_logra_experts", None)
        if isinstance(patch, ExpertsPatch):
            found.extend((state.name, module, attribute) for attribute, state in zip(patch.names, patch.ordered()))
    return found


def target_state(module: nn.Module, attribute: str = "weight") -> TargetState:
    """The LoGRA record of a patched linear (or of an experts module's ``attribute`` weight); raises
    for a module :func:`patch_model` did not patch."""
    patch = getattr(module, "_logra_experts", None)
    state = patch.states.get(attribute) if isinstance(patch, ExpertsPatch) else getattr(module, "_logra", None)
    if not isinstance(state, TargetState):
        raise ValueError(f"{type(module).__name__} module is not a patched LoGRA target (call patch_model first)")
    return state


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model`: original forwards, ``requires_grad`` flags and no LoGRA state on the
    modules. An optimizer built on the model keeps its forward pre-hook on it until the optimizer is
    released; unbound, the hook records nothing."""
    for _, module in patched_modules(model):
        target: TargetState = module._logra
        module.weight.requires_grad_(target.weight_requires_grad)
        target.unbind()  # an optimizer still alive stops recording this model's forwards
        del module.forward
        del module._logra
    for _, module in model.named_modules():
        patch = getattr(module, "_logra_experts", None)
        if isinstance(patch, ExpertsPatch):
            for attribute, state in patch.states.items():
                getattr(module, attribute).requires_grad_(state.weight_requires_grad)
                state.unbind()
            del module.forward
            del module._logra_experts
    record: PatchRecord | None = getattr(model, "_logra_patch", None)
    if record is not None:
        params = dict(model.named_parameters())
        for name, flag in record.frozen.items():
            if name in params:
                params[name].requires_grad_(flag)
        for hook in record.hooks:
            hook.remove()
        del model._logra_patch
    return model
