"""TRL adapter: train a ``GRPOTrainer`` / ``RLOOTrainer`` (or any ``transformers.Trainer``) with LoGRA.

The two lines added to an existing TRL script::

    model = patch_model(model)                                  # optional: attach_logra patches too
    attach_logra(trainer, rank=256, kl_budget=2e-4)             # after the trainer, before train()

``attach_logra`` does not hand the trainer an optimizer instance (DeepSpeed silently replaces one and
FSDP rejects it); it sets ``trainer.optimizer_cls_and_kwargs`` to a factory, which every backend
honours when the trainer builds its optimizer. Around that it wires what the trainer does not know
about: the KL probe's temperature and contexts (recorded from the training forward: prompt +
completion, probe positions = completion tokens; the probe runs a plain logits forward, not TRL's
fused log-prob head), the rollout/trainer mismatch ``κ`` from GRPO's vLLM log-probs, and LoGRA's
statistics in the trainer's logs (``logra/alpha``, ``logra/predicted_kl``, …).

Under DeepSpeed the engine wraps the trainer's optimizer in its ZeRO optimizer, which handles only
parameters that require grad (LoGRA's targets do not) and builds no engine without one: there the
trainer's optimizer is the one of the trainable non-targets (``non_target_optimizer``), and LoGRA runs
beside the engine, built when training starts and stepped from the callback; its state is saved as
``logra_optimizer.pt`` in each checkpoint and restored on resume.

With vLLM, ``use_vllm=True``: colocated, the engine's sync becomes the compressed one. In server mode
(``vllm_mode="server"``) against a vLLM server running the ``logra`` weight-transfer backend, too:
importing this module teaches TRL's ``VLLMClient`` that backend (:func:`_teach_trl_the_logra_backend`;
the trainer opens its weight channel when it is built, after the imports and before ``attach_logra``).
Against a server with TRL's ``nccl`` backend nothing changes and TRL's full sync is kept, with a warning.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
import warnings
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import SchedulerType

from logra_optim import LoGRAOptimizer, patch_model, patched_targets
from logra_optim.caller import warn
from logra_optim.distributed import REPLICATED
from logra_optim.integrations.vllm.plugin import BACKEND
from logra_optim.integrations.vllm.trainer import START_SERVER, VLLMServer, server_backend

__all__ = ["attach_logra", "LoGRACallback", "mismatch_mask"]

LOGRA_STATE_NAME = "logra_optimizer.pt"  # LoGRA's state in a checkpoint, under DeepSpeed

# Optimizer statistics forwarded to the logs, and their names there.
_LOGGED_STATS = {
    "alpha": "logra/alpha",
    "eta": "logra/eta",
    "predicted_kl": "logra/predicted_kl",
    "predicted_kl_used": "logra/predicted_kl_used",
    "predicted_step_kl": "logra/predicted_step_kl",
    "kl_budget": "logra/kl_budget",
    "kl_budget_effective": "logra/kl_budget_effective",
    "mismatch": "logra/mismatch",
    "realised_kl": "logra/realised_kl",
    "probe_tokens": "logra/probe_tokens",
    "probe_seconds": "logra/probe_seconds",
    "step_seconds": "logra/step_seconds",
    "nonfinite_skips": "logra/nonfinite_skips",
    "probe_skips": "logra/probe_skips",
}
# Running totals: logged as they stand at the log, not averaged over its window (a mean of
# 0, 0, 1 would read as a third of a skip).
_COUNTERS = frozenset({"logra/nonfinite_skips", "logra/probe_skips"})


class LoGRACallback(TrainerCallback):
    """Feeds the mismatch ``κ`` before each optimizer step and collects LoGRA's statistics after it,
    averaged into the next training log."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.mismatch_samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.pending: dict[str, list[float]] = {}
        # Under DeepSpeed LoGRA runs beside the engine's optimizer (see attach_logra): built when
        # training starts, once the engine has placed (and, with ZeRO-3, partitioned) the weights.
        self.deepspeed_kwargs: dict[str, Any] | None = None
        self.logra: LoGRAOptimizer | None = None
        self.resume_state: str | None = None  # LoGRA's state file in the checkpoint being resumed
        self.vllm_sync: dict[str, Any] = {}  # {"sync": VLLMSync} once the compressed vLLM sync has run

    @property
    def optimizer(self) -> LoGRAOptimizer | None:
        if self.logra is not None:
            return self.logra
        optimizer = self.trainer.optimizer
        # Accelerate wraps the optimizer; DeepSpeed keeps it as .optimizer of its own.
        while optimizer is not None and not isinstance(optimizer, LoGRAOptimizer):
            optimizer = getattr(optimizer, "optimizer", None)
        return optimizer

    def on_train_begin(self, args, state, control, **kwargs):
        if self.deepspeed_kwargs is not None and self.logra is None:
            self.logra = LoGRAOptimizer(
                _unwrap(self.trainer.model), non_target_optimizer="external", **self.deepspeed_kwargs
            )
            if self.resume_state is not None:
                self.logra.load_state_dict(torch.load(self.resume_state, weights_only=True))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        optimizer = self.optimizer
        if optimizer is not None and self.mismatch_samples:
            rollout = torch.cat([r.flatten() for r, _, _ in self.mismatch_samples])
            trainer_logps = torch.cat([t.flatten() for _, t, _ in self.mismatch_samples])
            mask = torch.cat([m.flatten() for _, _, m in self.mismatch_samples])
            optimizer.observe_mismatch(rollout, trainer_logps, mask)
        self.mismatch_samples.clear()
        if self.logra is not None:  # DeepSpeed: the engine has stepped the non-targets; now the targets
            self.logra.step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        optimizer = self.optimizer
        if optimizer is None:
            return
        group = optimizer.param_groups[0]  # the scheduled step size this update used
        values = {f"logra/{group['lr_mode']}": group["lr"]}
        values.update((name, optimizer.stats.get(key)) for key, name in _LOGGED_STATS.items())
        for name, value in values.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.pending.setdefault(name, []).append(float(value))

    def pop_logs(self) -> dict[str, float]:
        logs = {
            name: values[-1] if name in _COUNTERS else sum(values) / len(values)
            for name, values in self.pending.items()
        }
        self.pending = {}
        return logs


def attach_logra(
    trainer: Trainer,
    *,
    target_modules=None,
    vllm_sync: str | dict = "compressed",
    keep_lr_schedule: bool = False,
    **optimizer_kwargs: Any,
) -> LoGRACallback:
    """Make ``trainer`` train with :class:`LoGRAOptimizer`; call before ``trainer.train()``.

    ``optimizer_kwargs`` go to :class:`LoGRAOptimizer` (``rank``, ``kl_budget``, ``direction``,
    ``update_ratio`` …). The KL probe's temperature defaults to the trainer's sampling temperature.
    The model is patched here if it is not already (``target_modules`` as in :func:`patch_model`),
    which covers trainers that built the model from a model id. The trainer's learning-rate
    schedule scales ``update_ratio`` (or ``lr``), and is logged as ``logra/update_ratio``; the
    trainer's default linear decay, which would take the step to zero by the end of training (and
    with KL control, the KL per update once ``alpha_max`` binds), is replaced by a constant schedule
    unless ``keep_lr_schedule=True`` (any other ``lr_scheduler_type`` is the user's choice and kept).
    Under DeepSpeed the schedule drives the engine's optimizer of the non-targets only; LoGRA runs
    beside it with a constant ``update_ratio``.
    ``max_grad_norm`` is disabled (no dense gradient exists to clip; the step size is set by
    ``kl_budget``/``update_ratio``). Returns the callback that logs LoGRA's statistics.

    With ``use_vllm=True`` in colocate mode, ``vllm_sync="compressed"`` (default) replaces the
    trainer's full-weight ``sync_weights`` with :class:`~logra_optim.integrations.vllm.VLLMSync`:
    each sync sends the factors ``(F, seed)`` merged since the last one (the first sends full weights),
    with drift checks; a dict instead gives ``VLLMSync`` options (``check_every``, ``drift_bound``,
    ``full_every``; in server mode ``transport="nccl"`` sends the tensors over an NCCL group with the
    server's GPU workers instead of inside the requests). ``"full"`` keeps the trainer's own full
    sync. Logged as ``logra/sync_*``.
    """
    if not isinstance(trainer, Trainer):
        raise TypeError(
            f"attach_logra expects a transformers.Trainer subclass (GRPOTrainer, RLOOTrainer, …), got "
            f"{type(trainer).__name__}; in a custom loop use LoGRAOptimizer directly"
        )
    if any(isinstance(callback, LoGRACallback) for callback in trainer.callback_handler.callbacks):
        raise RuntimeError("attach_logra: LoGRA is already attached to this trainer")
    try:  # Catch misspelt options now, not when train() builds the optimizer.
        inspect.signature(LoGRAOptimizer).bind(trainer.model, **optimizer_kwargs)
    except TypeError as error:
        raise TypeError(f"attach_logra: invalid LoGRAOptimizer options: {error}") from None
    if not (vllm_sync in ("compressed", "full") or isinstance(vllm_sync, dict)):
        raise ValueError(
            f"attach_logra: vllm_sync must be 'compressed', 'full' or a dict of VLLMSync options, got {vllm_sync!r}"
        )
    mixed_precision = getattr(getattr(trainer, "accelerator", None), "mixed_precision", None)
    if trainer.args.fp16 or mixed_precision == "fp16" or _deepspeed_fp16(trainer):
        raise ValueError(
            "attach_logra: fp16 mixed precision is not supported: loss scaling multiplies LoGRA's sketches, which "
            "are not .grad, so no scaler can unscale them or detect their overflow. Use bf16=True (bf16 autocast "
            "with fp32 master weights needs no loss scaling)"
        )
    if trainer.optimizer is not None:
        raise RuntimeError(
            "attach_logra: the trainer already has an optimizer (passed through optimizers=(...) or already "
            "created); construct the trainer without one and call attach_logra before train()"
        )
    model = trainer.model
    if _is_peft_model(model):
        raise ValueError(
            "attach_logra: the trainer's model is PEFT-wrapped (peft_config was given); LoGRA trains the base "
            "weights itself, so drop the peft_config/LoRA adapter"
        )
    if not patched_targets(model):
        patch_model(model, target_modules)
    elif target_modules is not None:
        warnings.warn("attach_logra: the model is already patched; target_modules is ignored", stacklevel=2)
    optimizer_kwargs.setdefault("temperature", float(getattr(trainer, "temperature", 1.0) or 1.0))

    # Trainer keeps the config it was given as its args: another trainer built from the same config
    # (a baseline beside this one) must keep its clipping and schedule.
    trainer.args = copy.copy(trainer.args)
    if trainer.args.max_grad_norm:
        warnings.warn(
            f"attach_logra: max_grad_norm={trainer.args.max_grad_norm} disabled: LoGRA targets have no dense "
            "gradient to clip, and the update size is set by kl_budget/update_ratio",
            stacklevel=2,
        )
        _disable_deepspeed_clipping_from(trainer, trainer.args.max_grad_norm)
        trainer.args.max_grad_norm = 0.0

    deepspeed = getattr(trainer, "is_deepspeed_enabled", False)  # then LoGRA runs beside the engine, unscheduled
    if not deepspeed and not keep_lr_schedule and trainer.args.lr_scheduler_type == SchedulerType.LINEAR:
        warmup = bool(getattr(trainer.args, "warmup_steps", 0) or getattr(trainer.args, "warmup_ratio", 0))
        constant = SchedulerType.CONSTANT_WITH_WARMUP if warmup else SchedulerType.CONSTANT
        warnings.warn(
            "attach_logra: the trainer's default linear learning-rate decay would scale LoGRA's update_ratio down "
            f"to 0 by the end of training; using lr_scheduler_type={constant.value!r} instead "
            "(attach_logra(keep_lr_schedule=True) keeps the linear decay; any other lr_scheduler_type is kept)",
            stacklevel=2,
        )
        trainer.args.lr_scheduler_type = constant

    callback = LoGRACallback(trainer)
    if deepspeed:
        _attach_beside_deepspeed(trainer, callback, optimizer_kwargs)
    else:

        class LoGRAOptimizerFactory:
            """transformers instantiates a non-Optimizer class and calls it with ``(model, **kwargs)``."""

            def __call__(self, model, **kwargs):
                return LoGRAOptimizer(_unwrap(model), **kwargs)

        trainer.optimizer_cls_and_kwargs = (LoGRAOptimizerFactory, optimizer_kwargs)
    if vllm_sync != "full" and getattr(trainer, "use_vllm", False):
        _use_compressed_vllm_sync(trainer, callback, {} if vllm_sync == "compressed" else dict(vllm_sync))
    trainer.add_callback(callback)
    _load_what_resume_skips(trainer)
    _feed_mismatch_from_batches(trainer, callback)
    _add_stats_to_logs(trainer, callback)
    return callback


def _use_compressed_vllm_sync(trainer: Trainer, callback: LoGRACallback, options: dict) -> None:
    """Replace ``trainer.vllm_generation.sync_weights`` (TRL's full sync, run before generating
    whenever the weights changed) with a compressed one. Full weights still go through TRL's own
    gathering iterator (FSDP, ZeRO-3), renamed for vLLM."""
    from logra_optim.integrations.vllm import VLLMSync

    try:  # misspelt options fail now, not at the first sync
        inspect.signature(VLLMSync).bind(None, None, **options)
    except TypeError as error:
        raise TypeError(f"attach_logra: invalid vllm_sync options: {error}") from None
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None:
        return
    server = generation.mode == "server"
    if server:
        client = getattr(generation, "vllm_client", None)  # the main process's; the others never send
        if client is None:
            return
        if not getattr(client, "logra_server", False):
            warnings.warn(
                f"attach_logra: the vLLM server at {client.base_url} does not run the logra weight-transfer "
                "backend, so it only takes full weights over TRL's NCCL group; keeping TRL's full sync. For "
                f"compressed syncs, {START_SERVER}",
                stacklevel=3,
            )
            return
        engine = client.base_url
    else:
        engine = generation.llm
    full_sync = generation.sync_weights
    holder = callback.vllm_sync

    def sync_weights():
        optimizer = callback.optimizer
        if optimizer is None:  # no LoGRA optimizer yet: nothing to record updates from
            return full_sync()
        transposed = [target.parameter_name for target in optimizer.targets if target.layout.transposed]
        if transposed:  # VLLMSync cannot place them (vLLM keeps GPT-OSS's experts in a layout of its own)
            if not holder.get("warned_transposed"):
                holder["warned_transposed"] = True
                warnings.warn(
                    f"attach_logra: {len(transposed)} targets are experts stored transposed (GPT-OSS), e.g. "
                    f"{transposed[0]!r}, which the compressed sync cannot place in vLLM; keeping TRL's full sync",
                    stacklevel=2,
                )
            return full_sync()
        if server and any(target.layout.kind != REPLICATED for target in optimizer.targets):
            if not holder.get("warned_sharded"):
                holder["warned_sharded"] = True
                warnings.warn(
                    "attach_logra: compressed sync to a vLLM server is not supported with a sharded trainer "
                    "(FSDP2, ZeRO-3: only the main process talks to the server); keeping TRL's full sync",
                    stacklevel=2,
                )
            return full_sync()
        sync = holder.get("sync")
        if sync is None or sync.optimizer is not optimizer:  # first sync, or a rebuilt optimizer
            if sync is not None:
                sync.close()
            sync = holder["sync"] = VLLMSync(
                optimizer, engine, named_parameters=generation._iter_named_params, **options
            )
        if not server and generation.enable_sleep_mode:  # TRL sleeps at level 2 after generating: weights gone
            generation.llm.wake_up(tags=["weights"])
            generation._llm_weights_sleeping = False
            sync.mark_weights_discarded()
        stats = sync.sync()
        for key in ("bytes", "seconds", "drift", "served_drift"):
            if key in stats:
                callback.pending.setdefault(f"logra/sync_{key}", []).append(float(stats[key]))
        callback.pending.setdefault("logra/sync_full", []).append(float(stats["kind"] == "full"))

    generation.sync_weights = sync_weights


def _attach_beside_deepspeed(trainer: Trainer, callback: LoGRACallback, optimizer_kwargs: dict) -> None:
    """DeepSpeed wraps the trainer's optimizer in its ZeRO optimizer, which only handles parameters
    that require grad (none of LoGRA's targets do), and builds no training engine without them. So
    the engine gets the optimizer of the trainable non-targets (``non_target_optimizer``), and LoGRA
    runs beside it: built when training starts (after ZeRO-3 has partitioned the weights), stepped
    once per optimizer step, after the engine's step, from the callback."""
    non_target = optimizer_kwargs.pop("non_target_optimizer", None)
    trainable = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    if not trainable or not callable(non_target):
        raise ValueError(
            "attach_logra under DeepSpeed: the DeepSpeed engine needs an optimizer with at least one trainable "
            "parameter, and LoGRA's targets are frozen. Unfreeze a small non-target (e.g. "
            "model.model.norm.weight.requires_grad_(True)) after patch_model and pass "
            "non_target_optimizer=lambda params: torch.optim.AdamW(params, lr=...) "
            f"(trainable now: {trainable[:4] or 'none'})"
        )
    if optimizer_kwargs.get("realised_kl_check"):
        raise ValueError(
            "attach_logra under DeepSpeed: realised_kl_check is not supported (the engine updates the non-targets "
            "before LoGRA's step, so the measured KL would include their update)"
        )

    class NonTargetOptimizerFactory:
        """The optimizer DeepSpeed's engine wraps: the trainable non-targets only."""

        def __call__(self, model, **kwargs):
            return non_target([p for p in _unwrap(model).parameters() if p.requires_grad])

    trainer.optimizer_cls_and_kwargs = (NonTargetOptimizerFactory, {})
    callback.deepspeed_kwargs = optimizer_kwargs

    # Checkpoints: DeepSpeed's hold the weights (ZeRO-3: the partitions) and the engine's optimizer;
    # LoGRA's state (the same on every rank) goes beside them, and is loaded when training starts.
    save, load = trainer._save_optimizer_and_scheduler, trainer._load_optimizer_and_scheduler

    def save_with_logra(output_dir, *args, **kwargs):
        result = save(output_dir, *args, **kwargs)
        if callback.logra is not None and trainer.args.should_save:
            torch.save(callback.logra.state_dict(), os.path.join(output_dir, LOGRA_STATE_NAME))
        return result

    def load_with_logra(checkpoint, *args, **kwargs):
        result = load(checkpoint, *args, **kwargs)
        if checkpoint is not None:
            path = os.path.join(checkpoint, LOGRA_STATE_NAME)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"attach_logra: resuming from {checkpoint}, which has no {LOGRA_STATE_NAME}")
            callback.resume_state = path
        return result

    trainer._save_optimizer_and_scheduler = save_with_logra
    trainer._load_optimizer_and_scheduler = load_with_logra


def _load_what_resume_skips(trainer: Trainer) -> None:
    """Since transformers 5, checkpoints are written in the Hub's layout, where mixture-of-experts
    models keep each expert's matrices apart; ``Trainer``'s resume loads them with
    ``load_state_dict``, which does not stack them back into the model's expert weights
    (transformers#48805). Those weights would restart from their initial values while the optimizer
    state resumes. After the trainer's own load, every parameter it did not find under any of its
    names is loaded through ``from_pretrained``, which converts the layout (a second copy of the
    model, on the CPU of each process, while it loads). FSDP and DeepSpeed resume from their own
    checkpoints, in the model's layout, and are left alone."""
    load = trainer._load_from_checkpoint

    def load_and_convert(resume_from_checkpoint, model=None):
        load(resume_from_checkpoint, model)
        if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
            return
        model = _unwrap(trainer.model if model is None else model)
        stored = _checkpoint_keys(resume_from_checkpoint)
        if stored is None or not hasattr(type(model), "from_pretrained"):
            return
        names: dict[int, list[str]] = {}
        for name, parameter in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(parameter), []).append(name)
        missing = [aliases[0] for aliases in names.values() if not any(name in stored for name in aliases)]
        if not missing:
            return
        converted, info = type(model).from_pretrained(
            resume_from_checkpoint, device_map="cpu", output_loading_info=True
        )
        absent = [name for name in missing if name in set(info["missing_keys"])]
        if absent:
            raise RuntimeError(
                f"attach_logra: resuming from {resume_from_checkpoint}, whose weights lack {absent[:4]} in "
                "any layout transformers converts; those parameters would restart from their initial values"
            )
        converted = dict(converted.named_parameters(remove_duplicate=False))
        parameters = dict(model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name in missing:
                parameters[name].copy_(converted[name])
        warnings.warn(
            f"attach_logra: resuming from {resume_from_checkpoint}: loaded {len(missing)} parameters "
            f"({', '.join(missing[:3])}{', …' if len(missing) > 3 else ''}) that the trainer's resume skips, "
            "through from_pretrained (the checkpoint stores them in the Hub's per-expert layout, transformers#48805)",
            stacklevel=2,
        )

    trainer._load_from_checkpoint = load_and_convert


def _checkpoint_keys(directory: str) -> set[str] | None:
    """The tensor names of a checkpoint's safetensors weights (one file or an index), or ``None``."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as file:
            return set(json.load(file)["weight_map"])
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as file:
            return set(file.keys())
    return None


def _deepspeed_config(trainer: Trainer) -> dict:
    """The DeepSpeed config the engine will be built from (empty without DeepSpeed)."""
    plugin = getattr(getattr(trainer, "accelerator", None), "state", None)
    plugin = getattr(plugin, "deepspeed_plugin", None)
    return getattr(plugin, "deepspeed_config", None) or {}


def _deepspeed_fp16(trainer: Trainer) -> bool:
    return bool(_deepspeed_config(trainer).get("fp16", {}).get("enabled") is True)


def _disable_deepspeed_clipping_from(trainer: Trainer, max_grad_norm: float) -> None:
    """transformers fills a DeepSpeed config's ``"gradient_clipping": "auto"`` from ``max_grad_norm``
    when the training arguments are built, before attach_logra runs: a clipping value equal to it
    came from there (or says the same) and is disabled with it."""
    config = _deepspeed_config(trainer)
    if config.get("gradient_clipping") == max_grad_norm:
        config["gradient_clipping"] = 0.0


def _unwrap(model):
    # DDP / DeepSpeed engines keep the patched model as .module.
    while not patched_targets(model) and hasattr(model, "module"):
        model = model.module
    return model


def _is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") or type(model).__name__.startswith("Peft")


def _feed_mismatch_from_batches(trainer: Trainer, callback: LoGRACallback) -> None:
    """GRPO with vLLM puts the engine's log-probs of the sampled tokens (``sampling_per_token_logps``)
    and the trainer's, before the update (``old_per_token_logps``), in each batch: exactly the pair
    the mismatch estimate needs. They are collected per micro-batch and fed once per update."""
    compute_loss = trainer.compute_loss

    warned = []

    def compute_loss_recording_mismatch(model, inputs, *args, **kwargs):
        if trainer.model.training and isinstance(inputs, dict):
            rollout, current = inputs.get("sampling_per_token_logps"), inputs.get("old_per_token_logps")
            mask = inputs.get("completion_mask")
            if rollout is not None and current is not None and mask is not None:
                callback.mismatch_samples.append((rollout.detach(), current.detach(), mismatch_mask(trainer, inputs)))
            elif rollout is not None and current is None and not warned:
                warned.append(True)
                warn(
                    "attach_logra: the batches carry the rollout engine's log-probs but not the trainer's "
                    "(old_per_token_logps), which TRL computes only with vllm_importance_sampling_correction=True "
                    "or when gradient_accumulation_steps is not a multiple of steps_per_generation × num_iterations: "
                    "the rollout/trainer mismatch κ is not estimated and stays 0, so the KL budget is not lowered "
                    "for it",
                    RuntimeWarning,
                )
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = compute_loss_recording_mismatch


def mismatch_mask(trainer: Trainer, inputs: dict) -> torch.Tensor:
    """Generated tokens of completed responses (docs/method.md §3): the completion mask, without tool
    output tokens, restricted to completions that ended with an EOS token (truncated ones are
    not samples of the full policy's stopping behaviour)."""
    mask = inputs["completion_mask"].detach().bool()
    if inputs.get("tool_mask") is not None:
        mask = mask & inputs["tool_mask"].detach().bool()
    eos_ids = getattr(trainer, "eos_token_ids", None)
    completion_ids = inputs.get("completion_ids")
    if eos_ids and completion_ids is not None:
        # Completed = its last real token is an EOS (an earlier EOS may end a tool-call turn).
        last = inputs["completion_mask"].long().cumsum(dim=1).argmax(dim=1, keepdim=True)
        last_token = completion_ids.gather(1, last).squeeze(1)
        completed = torch.isin(last_token, torch.as_tensor(eos_ids, device=completion_ids.device))
        mask = mask & completed.unsqueeze(1)
    return mask


def _add_stats_to_logs(trainer: Trainer, callback: LoGRACallback) -> None:
    """Merge LoGRA's averaged statistics into the trainer's training logs, so they reach stdout,
    TensorBoard, W&B … through the trainer's own reporting."""
    log = trainer.log

    def log_with_logra_stats(logs: dict[str, float], *args, **kwargs):
        if callback.pending and "loss" in logs:  # training logs only, not evaluation or the summary
            # The norm of .grad, which LoGRA's targets do not have: 0, or the non-targets' alone.
            logs = {**{k: v for k, v in logs.items() if k != "grad_norm"}, **callback.pop_logs()}
        return log(logs, *args, **kwargs)

    trainer.log = log_with_logra_stats


def _teach_trl_the_logra_backend() -> None:
    """TRL's server mode opens an NCCL group between the trainer and a vLLM server (CUDA only) and
    broadcasts full weights into it. A server running the ``logra`` weight-transfer backend takes
    neither: against one, ``VLLMClient.init_communicator`` opens no group and marks the client
    (``client.logra_server``), and ``update_named_params`` sends full weights inside the update request
    (what TRL's sync sends before ``attach_logra``'s compressed sync takes over, or with
    ``vllm_sync="full"``). Any other server keeps TRL's own behaviour. Runs once, on import of this
    module, so that a trainer built afterwards uses it."""
    try:
        from trl.generation.vllm_client import VLLMClient
    except ImportError:  # a TRL without server mode, or without vLLM
        return
    if getattr(VLLMClient.init_communicator, "logra_aware", False):
        return
    init_communicator, update_named_params = VLLMClient.init_communicator, VLLMClient.update_named_params

    def logra_init_communicator(client, device=0):
        try:
            backend = server_backend(client.base_url)
        except RuntimeError:
            backend = None  # no weight-transfer endpoints: TRL's own code says so
        if backend != BACKEND:
            return init_communicator(client, device)
        client.logra_server, client.communicator = True, None

    def logra_update_named_params(client, metadata, named_params):
        if not getattr(client, "logra_server", False):
            return update_named_params(client, metadata, named_params)
        weights = ((name, tensor.detach().to("cpu", copy=True)) for name, tensor in named_params)
        VLLMServer(client.base_url, []).full_sync(weights, 0, "float32")

    logra_init_communicator.logra_aware = True
    VLLMClient.init_communicator = logra_init_communicator
    VLLMClient.update_named_params = logra_update_named_params


_teach_trl_the_logra_backend()
