"""``logra demo``: GRPO with verifiable rewards, trained by LoGRA and the methods it replaces, side by side.

What it does, and why each piece is there:

1. **Policy.** Without ``--model``, a Qwen2 built from a config (``--policy``: ``tiny``,
   ``small`` or ``medium``) and a one-token-per-symbol tokenizer built in memory: nothing is downloaded. With
   ``--model PATH``, any local Hugging Face causal LM and its tokenizer.
2. **Warm start.** A randomly initialised policy never produces a correct digit, so every GRPO group
   would have zero advantage. A short supervised pass on correct answers (AdamW, answer tokens only)
   brings it to partial competence; every method starts from this same checkpoint.
3. **RL.** TRL's ``GRPOTrainer`` on fresh problems, once per method: LoGRA (``attach_logra``, the
   two-line change of the README), dense AdamW on every parameter, AdamW on exactly LoGRA's target
   matrices, and LoRA on the same target modules; each seed in a fresh process
   (``runner.run_fresh``) so that peak memory is the run's own (RSS above the post-import level on
   CPU, the allocator's peak on CUDA). On request (``--methods``), the memory-efficient low-rank
   peers too: GaLore and APOLLO-Mini on the target matrices, AdamW on the rest (``peers.py``).
4. **Evaluation.** Greedy decoding on held-out problems before RL, every ``--eval-every`` updates
   and after RL: mean reward and exact accuracy, which the noisy sampled training reward cannot
   show. Evaluation time is not counted in the time per update.

The parent process prints a table and saves ``reward.png`` (training reward curves and greedy
evaluations) and ``memory.png`` next to ``summary.json`` in the output directory.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import math
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import tasks
from ..options import DIRECTIONS
from ..probe import spread_rows
from .arguments import choice_list, device, int_list, model_dir, positive_float, positive_int, writable_dir
from .measure import (
    MIB,
    auto_probe_dtype,
    memory_baseline,
    peak_memory,
    percentile_95,
    ratio,
    resolve_device,
    synchronize,
)
from .peers import PEER_MODULES, LOW_RANK_PEERS, check_proj_gap, lora_model, low_rank_optimizer, train_only_targets
from .runner import run_fresh

# LoGRA and the three ways to train the same model it is measured against by default: dense AdamW
# on every parameter, AdamW on exactly LoGRA's target matrices, and LoRA on the same target modules;
# on request, the memory-efficient peers GaLore and APOLLO-Mini (every parameter, their low-rank rule
# on the target matrices). METHODS' order is the table's and the plots'.
DEFAULT_METHODS = ("logra", "adamw", "adamw-targets", "lora")
METHODS = (*DEFAULT_METHODS, "galore", "apollo-mini")
PEER_SCOPES = ("all", "targets")
COLORS = {
    "logra": "tab:blue",
    "adamw": "tab:orange",
    "adamw-targets": "tab:green",
    "lora": "tab:red",
    "galore": "tab:purple",
    "apollo-mini": "tab:brown",
}
LABELS = {
    "logra": "LoGRA",
    "adamw": "dense AdamW",
    "adamw-targets": "AdamW on LoGRA's targets",
    "lora": "LoRA",
    "galore": "GaLore",
    "apollo-mini": "APOLLO-Mini",
}
SPECIAL_TOKENS = {"pad": "<pad>", "eos": "<eos>", "unk": "<unk>", "bos": "<bos>"}
EVAL_PROBLEMS = 256
PROBE_DTYPES = ("auto", "float32", "bfloat16")  # --probe-dtype
EVAL_SEED = 65_535  # training draws use seeds 0…, 10 000 + seed (warm start) and 20 000 (validation)

# --quick keeps one microbatch of 32 completions per update, and the KL budget the medium policy's
# sweep chose for that batch (the tiny policy's was not swept at it).
QUICK_KL_BUDGET = 1e-3


@dataclass
class DemoSettings:
    """Everything a run needs; the parent writes it as JSON for each worker process."""

    output: str
    task: str = "addition"
    digits: int = 1
    # 100 updates of 2 microbatches of 32 completions (below): the completions of the former 200
    # updates of one microbatch, in less time (generation runs 64 at once). An update of one
    # microbatch of 3-token completions reads so few tokens that the costs that do not grow with them
    # (AdamW's step; LoGRA's probe, directions and merge) decided the time per update
    # (docs/benchmarks.md, "The demo"); RL trainers accumulate many microbatches per update.
    steps: int = 100
    rank: int = 32
    # KL per update, and a first moment over a projection kept for 10 updates: a GRPO batch is mostly
    # noise, and without averaging each update spent its whole budget on it. Chosen by an equal sweep
    # on seed 0 (docs/benchmarks.md): 3e-3 with 64 completions per update, 1e-3 with 32.
    kl_budget: float = 3e-3
    # The relative step before KL control scales it; the default 6e-5 is for billion-parameter
    # models and would cap α (at alpha_max) long before this tiny one reaches the budget.
    update_ratio: float = 5e-2
    # Completions are 2–3 tokens: with the optimizer's default 2 probed sequences the KL that an
    # update moves the rest of the batch has a wide tail here; 8 (of the update's last microbatch)
    # narrow it (docs/benchmarks.md: how many sequences the KL probe reads).
    probe_samples: int = 8
    # The probe's products in bf16 (as a bf16 training forward's; the KL math stays float64): prediction
    # within a percent, a third less probe time where bf16 products are fast (docs/benchmarks.md).
    # "auto": bf16 on CUDA GPUs with native bf16, fp32 on CPUs (measure.auto_probe_dtype says why);
    # "float32" (or None) and "bfloat16" force one.
    probe_dtype: str | None = "auto"
    # LoGRA's first moment in sketch space and how many updates keep one projection (docs/method.md §2).
    beta1: float = 0.9
    direction: str = "orthogonal"
    refresh_every: int = 10
    # LoGRA's realised-KL check: measure each update's KL on the probe contexts after the merge and
    # redo it with a rescaled α when it misses the budget by more than 10%.
    realised_kl_check: bool = False
    # LoGRA's floor on the predicted KL, a fraction of its median over the last 20 updates (kl_floor;
    # None: no floor).
    kl_floor: float | None = None
    # Activation checkpointing for every method (TRL's GRPOConfig turns it on by default). Off here:
    # on the demo's CPU run it made every method's update slower (dense AdamW 0.70 s instead of
    # 0.37–0.43) and the run 15 minutes long (docs/benchmarks.md, "The demo").
    gradient_checkpointing: bool = False
    # Learning rates; None: the policy's (POLICY_RATES).
    adamw_lr: float | None = None  # dense AdamW
    adamw_targets_lr: float | None = None  # AdamW on LoGRA's targets
    lora_lr: float | None = None
    galore_lr: float | None = None
    apollo_mini_lr: float | None = None
    # What GaLore and APOLLO-Mini train: "all" parameters (their rule on LoGRA's target matrices,
    # AdamW on the rest, as their users run them) or only LoGRA's "targets" (the rest frozen, the
    # same trained set as LoGRA, AdamW on the targets and LoRA).
    peer_scope: str = "all"
    # Steps between GaLore's and APOLLO-Mini's projection refreshes (None: their READMEs' 200).
    peer_proj_gap: int | None = None
    # LoGRA trains its target matrices only, the rest frozen as in the paper, unless this is set: then
    # AdamW at this rate trains every other parameter (embeddings, norms, biases) beside it, through
    # LoGRAOptimizer's non_target_optimizer, as GaLore and APOLLO-Mini do with peer_scope "all".
    logra_non_target_lr: float | None = None
    eval_every: int = 25  # greedy evaluation every this many updates (0: before and after RL only)
    warm_start_steps: int = 1000
    warm_start_reward: float = 0.45
    warm_start_lr: float | None = None
    batch_size: int = 32  # completions per microbatch: 4 prompts × num_generations
    accumulation: int = 2  # microbatches per update (generated together, one optimizer step)
    num_generations: int = 8
    seeds: list[int] = field(default_factory=lambda: [0])
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    model: str | None = None
    policy: str = "medium"  # the built-in policy without --model: a key of POLICIES
    unswept: list[str] = field(default_factory=list)  # knobs no equal sweep chose here (unswept())
    device: str = "auto"
    threads: int | None = None

    def __post_init__(self):
        # Filled in once, at construction: ``dataclasses.replace(settings, policy=...)`` keeps the
        # old policy's rates unless they are given again (as None).
        rates = MODEL_RATES if self.model else POLICY_RATES.get(self.policy)
        if rates is None:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        self.adamw_lr = self.adamw_lr or rates.adamw
        self.adamw_targets_lr = self.adamw_targets_lr or rates.adamw_targets
        self.lora_lr = self.lora_lr or rates.lora
        self.galore_lr = self.galore_lr or rates.galore
        self.apollo_mini_lr = self.apollo_mini_lr or rates.apollo_mini
        self.warm_start_lr = self.warm_start_lr or rates.warm_start
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {', '.join(DIRECTIONS)}, got {self.direction!r}")
        if self.probe_dtype is not None and self.probe_dtype not in PROBE_DTYPES:
            raise ValueError(f"probe_dtype must be one of {', '.join(PROBE_DTYPES)} or None, got {self.probe_dtype!r}")
        if self.probe_dtype == "bfloat16" and self.realised_kl_check:
            raise ValueError(
                "probe_dtype='bfloat16' cannot be combined with realised_kl_check (which compares rounded logits); "
                "use probe_dtype='float32' or 'auto'"
            )
        if self.peer_scope not in PEER_SCOPES:
            raise ValueError(f"peer_scope must be one of {', '.join(PEER_SCOPES)}, got {self.peer_scope!r}")
        check_proj_gap("peer_proj_gap", self.peer_proj_gap)
        rate = self.logra_non_target_lr
        if rate is not None and not (isinstance(rate, int | float) and math.isfinite(rate) and rate > 0):
            raise ValueError(f"logra_non_target_lr must be a positive finite learning rate or None, got {rate!r}")
        if rate is not None and self.realised_kl_check:
            raise ValueError(
                "logra_non_target_lr cannot be combined with realised_kl_check: the measured KL would include the "
                "non-targets' AdamW step, which the check can neither undo nor rescale"
            )

    def learning_rate(self, method: str) -> float:
        """The learning rate ``method`` trains at (LoGRA's optimizer takes none: the AdamW one is the
        trainer's unused setting)."""
        rates = {
            "adamw-targets": self.adamw_targets_lr,
            "lora": self.lora_lr,
            "galore": self.galore_lr,
            "apollo-mini": self.apollo_mini_lr,
        }
        return rates.get(method, self.adamw_lr)

    @property
    def style(self) -> str:
        # One symbol per word for every tokenizer: the demo's word-level one needs it, and BPE
        # tokenizers split "4 7 + 1 5 =" into the same digit tokens a model would see in prose.
        return "spaced"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DemoSettings(output="")
    parser.add_argument(
        "--model", type=model_dir, help="a local Hugging Face causal LM; without it, the --policy Qwen2 built here"
    )
    parser.add_argument(
        "--policy",
        choices=sorted(POLICIES),
        default=None,
        help=f"the built-in policy (without --model); default {defaults.policy}, or tiny with --quick",
    )
    parser.add_argument("--task", choices=sorted(tasks.TASKS), default="addition", help="the verifiable task")
    parser.add_argument("--digits", type=positive_int, default=defaults.digits, help="operand digits (sort: digits+2)")
    parser.add_argument(
        "--steps", type=positive_int, help=f"GRPO updates per run; default {defaults.steps}, or 60 with --quick"
    )
    parser.add_argument(
        "--accumulation",
        type=positive_int,
        default=None,
        help=f"microbatches of {defaults.batch_size} completions per update, generated together and trained with "
        f"gradient accumulation; default {defaults.accumulation}, or 1 with --quick",
    )
    parser.add_argument("--rank", type=positive_int, default=defaults.rank, help="LoGRA sketch rank")
    parser.add_argument(
        "--kl-budget",
        type=positive_float,
        default=None,
        help=f"LoGRA's KL per update; default {defaults.kl_budget:g}, or {QUICK_KL_BUDGET:g} with --quick (32 "
        "completions per update)",
    )
    parser.add_argument(
        "--probe-samples",
        type=positive_int,
        default=defaults.probe_samples,
        help=f"sequences of each microbatch ({defaults.batch_size}; the update's last) that LoGRA's KL probe reads; "
        f"the KL meter reads {KL_METER_SAMPLES} others",
    )
    parser.add_argument(
        "--probe-dtype",
        choices=PROBE_DTYPES,
        default=defaults.probe_dtype,
        help="the matrix products of LoGRA's KL probe: float32 (the weights'), bfloat16, or auto: bfloat16 on CUDA "
        "GPUs with native bf16, float32 on CPUs",
    )
    parser.add_argument(
        "--beta1", type=float, default=defaults.beta1, help="LoGRA's first-moment decay in sketch space (0: none)"
    )
    parser.add_argument(
        "--refresh-every", type=positive_int, default=defaults.refresh_every, help="LoGRA updates per projection"
    )
    parser.add_argument(
        "--direction", choices=DIRECTIONS, default=defaults.direction, help="LoGRA's direction rule (direction=)"
    )
    parser.add_argument(
        "--adamw-lr",
        type=positive_float,
        default=None,
        help="dense AdamW's learning rate (default: the policy's)",
    )
    parser.add_argument(
        "--adamw-targets-lr",
        type=positive_float,
        default=None,
        help="the learning rate of AdamW on LoGRA's targets (default: the policy's)",
    )
    parser.add_argument(
        "--lora-lr", type=positive_float, default=None, help="LoRA's learning rate (default: the policy's)"
    )
    parser.add_argument(
        "--galore-lr", type=positive_float, default=None, help="GaLore's learning rate (default: the policy's)"
    )
    parser.add_argument(
        "--apollo-mini-lr",
        type=positive_float,
        default=None,
        help="APOLLO-Mini's learning rate (default: the policy's)",
    )
    parser.add_argument(
        "--peer-scope",
        choices=PEER_SCOPES,
        default=defaults.peer_scope,
        help="what GaLore and APOLLO-Mini train: all parameters, or only LoGRA's targets (the rest frozen)",
    )
    parser.add_argument(
        "--peer-proj-gap",
        type=positive_int,
        default=None,
        help="updates between GaLore's and APOLLO-Mini's projection refreshes (default: their READMEs' 200)",
    )
    parser.add_argument(
        "--logra-non-target-lr",
        type=positive_float,
        default=None,
        help="train every parameter that is not a LoGRA target (embeddings, norms) with AdamW at this rate "
        "beside LoGRA (default: frozen, as in the paper)",
    )
    parser.add_argument(
        "--eval-every", type=int, default=defaults.eval_every, help="greedy evaluation every N updates (0: off)"
    )
    parser.add_argument(
        "--warm-start-steps",
        type=int,
        default=None,
        help="at most this many supervised steps before RL; unset: 1000, or 0 with --model",
    )
    parser.add_argument(
        "--warm-start-reward",
        type=float,
        default=defaults.warm_start_reward,
        help="stop the warm start once greedy validation reward reaches this",
    )
    parser.add_argument(
        "--warm-start-lr",
        type=positive_float,
        default=None,
        help="the warm start's learning rate (default: the policy's)",
    )
    parser.add_argument("--seeds", type=int_list, default=[0], help="comma-separated; several give mean ± std")
    parser.add_argument(
        "--methods",
        type=choice_list(METHODS),
        default=list(DEFAULT_METHODS),
        help=f"comma-separated subset of {','.join(METHODS)} (default: {','.join(DEFAULT_METHODS)})",
    )
    parser.add_argument("--device", type=device, default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="activation checkpointing for every method (TRL's GRPO default; off here: slower on CPU)",
    )
    parser.add_argument(
        "--threads", type=positive_int, default=None, help="torch threads per run (default: torch's choice)"
    )
    parser.add_argument("--output", type=writable_dir, default="logra-demo", help="directory for plots and results")
    parser.add_argument(
        "--quick", action="store_true", help="a short run: the tiny policy, 60 updates of 32 completions"
    )


def settings_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> DemoSettings:
    """The run's settings from parsed arguments; inconsistent values are usage errors."""
    warm = args.warm_start_steps if args.warm_start_steps is not None else (0 if args.model else 1000)
    if warm < 0:
        parser.error(f"--warm-start-steps must be ≥ 0, got {warm}")
    if not 0.0 <= args.warm_start_reward <= 1.0:
        parser.error(f"--warm-start-reward must be in [0, 1] (rewards are), got {args.warm_start_reward}")
    if not 0.0 <= args.beta1 < 1.0:
        parser.error(f"--beta1 must be in [0, 1), got {args.beta1}")
    if args.logra_non_target_lr is not None and "logra" not in args.methods:
        parser.error("--logra-non-target-lr sets LoGRA's AdamW on the rest, but --methods has no logra")
    if args.eval_every < 0:
        parser.error(f"--eval-every must be ≥ 0 (0 turns the evaluations during RL off), got {args.eval_every}")
    room = DemoSettings.batch_size - KL_METER_SAMPLES
    if args.probe_samples > room:
        parser.error(
            f"--probe-samples must be ≤ {room}, got {args.probe_samples}: the KL meter reads {KL_METER_SAMPLES} "
            f"other sequences of each batch of {DemoSettings.batch_size}"
        )
    settings = DemoSettings(
        output=os.path.abspath(args.output),
        task=args.task,
        digits=args.digits,
        steps=args.steps or (60 if args.quick else DemoSettings.steps),
        accumulation=args.accumulation or (1 if args.quick else DemoSettings.accumulation),
        rank=args.rank,
        kl_budget=args.kl_budget or (QUICK_KL_BUDGET if args.quick else DemoSettings.kl_budget),
        probe_samples=args.probe_samples,
        probe_dtype=args.probe_dtype,
        beta1=args.beta1,
        refresh_every=args.refresh_every,
        direction=args.direction,
        adamw_lr=args.adamw_lr,
        adamw_targets_lr=args.adamw_targets_lr,
        lora_lr=args.lora_lr,
        galore_lr=args.galore_lr,
        apollo_mini_lr=args.apollo_mini_lr,
        peer_scope=args.peer_scope,
        peer_proj_gap=args.peer_proj_gap,
        logra_non_target_lr=args.logra_non_target_lr,
        eval_every=args.eval_every,
        warm_start_steps=warm,
        seeds=args.seeds,
        methods=args.methods,
        model=args.model,
        policy=args.policy or ("tiny" if args.quick else DemoSettings.policy),
        device=args.device,
        threads=args.threads,
        gradient_checkpointing=args.gradient_checkpointing,
        warm_start_reward=args.warm_start_reward,
        warm_start_lr=args.warm_start_lr,
    )
    given = {name for name, _ in METHOD_SETTINGS.values() if getattr(args, name) is not None}
    settings.unswept = unswept(settings, given)
    return settings


# Each method's knob: the option that sets it and how the table names it.
METHOD_SETTINGS = {
    "logra": ("kl_budget", "LoGRA's KL budget"),
    "adamw": ("adamw_lr", "dense AdamW's learning rate"),
    "adamw-targets": ("adamw_targets_lr", "AdamW on the targets' learning rate"),
    "lora": ("lora_lr", "LoRA's learning rate"),
    "galore": ("galore_lr", "GaLore's learning rate"),
    "apollo-mini": ("apollo_mini_lr", "APOLLO-Mini's learning rate"),
}


# What equal sweeps chose, by (policy, microbatches per update) and method (docs/benchmarks.md,
# "The demo": demo-sweep-medium/ at one microbatch, demo-sweep-acc2/ at two; the tiny policy's
# learning rates are the learning benchmark's, at one). GaLore's and APOLLO-Mini's rates were matched
# by KL per update instead, and no sweep chose a budget for LoGRA on the tiny policy.
SWEPT = {
    ("medium", 1): {"adamw": 3e-5, "adamw-targets": 3e-5, "lora": 3e-4, "logra": 1e-3},
    ("medium", 2): {"adamw": 3e-5, "adamw-targets": 1e-4, "lora": 3e-4, "logra": 3e-3},
    ("tiny", 1): {"adamw": 3e-4, "adamw-targets": 3e-4, "lora": 3e-4},
}


def unswept(settings: DemoSettings, given: set[str]) -> list[str]:
    """The methods' knobs in this run that are not what an equal sweep chose for its policy and
    batch (:data:`SWEPT`; those the user set are not listed), each with why: the demo prints them
    under its table."""
    notes = []
    chosen = {} if settings.model else SWEPT.get((settings.policy, settings.accumulation), {})
    for method in settings.methods:
        name, label = METHOD_SETTINGS[method]
        value = getattr(settings, name)
        if name in given or (method in chosen and math.isclose(value, chosen[method])):
            continue
        batch = f"{settings.accumulation} microbatch{'es' if settings.accumulation > 1 else ''} per update"
        if settings.model:
            why = "not tuned for pretrained models"
        elif method in ("galore", "apollo-mini"):
            why = "matched by KL per update, not swept"
        else:
            why = f"not what a sweep chose for the {settings.policy} policy at {batch}"
        notes.append(f"{label} {value:g} ({why})")
    return notes


# --------------------------------------------------------------------------------------------------
# The tiny policy and its tokenizer


def build_tokenizer():
    """A word-level tokenizer with one token per task symbol; prompts are written space-separated."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: i for i, symbol in enumerate([*tasks.SYMBOLS, *SPECIAL_TOKENS.values()])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS["unk"]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with single spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, **{f"{role}_token": token for role, token in SPECIAL_TOKENS.items()}
    )
    tokenizer.padding_side = "left"  # generation continues the prompt's last token
    return tokenizer


# Built-in policies (Qwen2 shapes): ``tiny`` learns the task in seconds but is so small that the
# interpreter, not the optimizer, decides its memory and time. ``small`` (11 M target parameters)
# and ``medium`` (22 M: two layers with the hidden and intermediate sizes of the Qwen2 shape
# ``benchmarks/configs/qwen2-h1024.json``, 2 KV heads instead of 4) are
# 99.9% targets, where weights, gradients and optimizer state decide them, as in a real LLM.
POLICIES = {
    "tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4, head_dim=32),
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, head_dim=64),
    "medium": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=16, head_dim=64),
}


@dataclass(frozen=True)
class PolicyRates:
    """Learning rates for one policy: for AdamW, AdamW on the targets and LoRA, each one's best of an
    equal sweep on it (docs/benchmarks.md, "The demo"); GaLore's and APOLLO-Mini's were not swept
    (see below), and the ``small`` policy reuses ``tiny``'s."""

    adamw: float  # dense AdamW
    adamw_targets: float  # AdamW on LoGRA's targets
    lora: float
    warm_start: float  # the supervised warm start's AdamW
    galore: float  # GaLore on the targets, AdamW on the rest
    apollo_mini: float  # APOLLO-Mini on the targets, AdamW on the rest


# The tiny policy's are the learning benchmark's (LoRA: 3e-4 and 1e-3 tied there; 1e-3 collapses on
# the small policy). The medium policy's are from the demo's sweep at its batch (2 microbatches of
# 32 completions per update; benchmarks/results/demo-sweep-acc2/): dense AdamW 3e-5 (its reward falls
# back at 3e-4), AdamW on the targets 1e-4, LoRA 3e-4. Best means the highest sampled-reward AUC, as
# in the learning benchmark. The medium policy's warm start
# at 2e-3 takes 440 supervised steps to the target reward, at 1e-3 120.
# GaLore and APOLLO-Mini are not swept here yet (bench_learning.py --methods galore,apollo-mini does):
# their rates are chosen so that an update moves the policy about as far as AdamW's does at its rate,
# by the realised KL per update of the demo's meter, because their scales make a learning rate mean
# another step. GaLore's step is 0.25 × a rank-r Adam step projected back, per entry about
# sqrt(r / min(d_out, d_in)) / 4 of a dense Adam step (0.04× on the medium policy's 1024-wide matrices
# at rank 32, 0.13× on the tiny's), but along the gradient's top singular directions, where it moves
# the outputs most; APOLLO-Mini's is the raw gradient rescaled by sqrt(128) × the norm of a rank-1 Adam
# step, about 11 / sqrt(min(d_out, d_in)) of AdamW's per entry (≈ 1× tiny, 0.35× medium), again along
# the gradient. Measured (seed 0, 15–20 updates, median KL/update over AdamW's at its rate): tiny,
# GaLore 2e-3 2.5×, APOLLO-Mini 3e-4 2.7×; medium, GaLore 3e-4 1.7× (1e-3: 13×, and the reward fell),
# APOLLO-Mini 3e-5 1.8× (1e-4: 14×). KL grows as the rate squared, so on the 1–3 grid of the rates: GaLore
# 1e-3 tiny (≈ 0.6×) and 3e-4 medium (10× AdamW's, the ratio of GaLore's paper at scale 0.25);
# APOLLO-Mini at AdamW's rate. The small policy takes the tiny one's, ``--model`` the medium's ratios.
POLICY_RATES = {
    "tiny": PolicyRates(adamw=3e-4, adamw_targets=3e-4, lora=3e-4, warm_start=2e-3, galore=1e-3, apollo_mini=3e-4),
    "small": PolicyRates(adamw=3e-4, adamw_targets=3e-4, lora=3e-4, warm_start=2e-3, galore=1e-3, apollo_mini=3e-4),
    "medium": PolicyRates(adamw=3e-5, adamw_targets=1e-4, lora=3e-4, warm_start=1e-3, galore=3e-4, apollo_mini=3e-5),
}
# ``--model``: a pretrained causal LM; not tuned here, set the rates for it.
MODEL_RATES = PolicyRates(adamw=3e-4, adamw_targets=3e-4, lora=3e-4, warm_start=1e-3, galore=3e-3, apollo_mini=3e-4)


def build_policy(tokenizer, seed: int, size: str = "tiny"):
    """A Qwen2 of ``POLICIES[size]`` with 2 KV heads and tied embeddings, built from a config."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if size not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {size!r}")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        **POLICIES[size],
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def load_policy(settings: DemoSettings, path: str | None = None):
    """The policy and tokenizer from ``path`` (a saved checkpoint or ``--model``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    path = path or settings.model
    # The tiny policy's word-level tokenizer is reloaded as itself: AutoTokenizer would pick
    # Qwen2Tokenizer from the model type, whose pre-tokenizer drops task words such as "sort".
    tokenizer = (AutoTokenizer if settings.model else PreTrainedTokenizerFast).from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    return model, tokenizer


# --------------------------------------------------------------------------------------------------
# Warm start and evaluation


def _encode_supervised(tokenizer, problems: list[tasks.Problem], device):
    """Prompt + answer + eos, right-padded, with labels only on the answer and eos."""
    rows, labels = [], []
    for problem in problems:
        prompt = tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]
        answer = tokenizer(problem.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device)
    label_ids = torch.tensor([r + [-100] * (width - len(r)) for r in labels], device=device)
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
    return input_ids, attention, label_ids


def warm_start(model, tokenizer, settings: DemoSettings, seed: int, device, progress=None) -> dict:
    """Supervised steps on correct answers until the greedy reward on a validation set reaches
    ``settings.warm_start_reward`` (checked every 20 steps and after the last), at most
    ``settings.warm_start_steps``.

    Stopping at a reward rather than after a fixed count makes every seed start RL from about the
    same competence: a fixed count lands anywhere from 0.2 to 0.8 on this task, and from 0.2
    GRPO's groups rarely hold a better answer to learn from.
    """
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.warm_start_lr, weight_decay=0.0)
    problems = tasks.make_problems(
        settings.task, settings.warm_start_steps * 32, digits=settings.digits, style=settings.style, seed=10_000 + seed
    )
    validation = tasks.make_problems(settings.task, 128, digits=settings.digits, style=settings.style, seed=20_000)
    reached = {"steps": 0, "reward": float("nan")}
    for step in range(settings.warm_start_steps):
        input_ids, attention, labels = _encode_supervised(tokenizer, problems[step * 32 : (step + 1) * 32], device)
        model(input_ids=input_ids, attention_mask=attention, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if progress is not None:
            progress()
        if (step + 1) % 20 == 0 or step + 1 == settings.warm_start_steps:  # the last step's is reported too
            reached = {"steps": step + 1, **evaluate(model, tokenizer, settings, device, validation)}
            if reached["reward"] >= settings.warm_start_reward:
                break
    return reached


def evaluate(model, tokenizer, settings: DemoSettings, device, problems=None) -> dict[str, float]:
    """Greedy answers to held-out problems (by default the fixed evaluation set): mean reward and
    exact-match accuracy."""
    if problems is None:
        problems = tasks.make_problems(
            settings.task, EVAL_PROBLEMS, digits=settings.digits, style=settings.style, seed=EVAL_SEED
        )
    was_training = model.training
    model.eval()
    scores = []
    with torch.no_grad():
        for start in range(0, len(problems), 64):
            chunk = problems[start : start + 64]
            batch = tokenizer([p.prompt for p in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            batch = batch.to(device)
            generated = model.generate(
                **batch,
                max_new_tokens=tasks.answer_length(settings.task, settings.digits) + 1,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            texts = tokenizer.batch_decode(generated[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
            scores += [tasks.score(text, p.answer) for text, p in zip(texts, chunk)]
    model.train(was_training)
    return {"reward": statistics.fmean(scores), "accuracy": sum(s == 1.0 for s in scores) / len(scores)}


# --------------------------------------------------------------------------------------------------
# One RL run (worker process)


def _grpo_config(settings: DemoSettings, method: str, seed: int, device: str):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(Path(settings.output) / "runs" / f"{method}-seed{seed}"),
        max_steps=settings.steps,
        per_device_train_batch_size=settings.batch_size,
        gradient_accumulation_steps=settings.accumulation,
        num_generations=settings.num_generations,
        max_completion_length=tasks.answer_length(settings.task, settings.digits) + 1,
        temperature=1.0,
        learning_rate=settings.learning_rate(method),
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        seed=seed,
        data_seed=seed,
        use_cpu=device == "cpu",
        bf16=False,
        report_to="none",
        use_vllm=False,
        gradient_checkpointing=settings.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def prepare_model(model, method: str, rank: int, peer_scope: str = "all"):
    """The model ``method`` trains, before the trainer is built: ``adamw-targets`` freezes everything
    but the weights of LoGRA's targets (``patch_model``'s choice, no sketching); ``lora`` wraps the
    same target modules in peft LoRA adapters (``r = rank``, ``lora_alpha = 2r``, no dropout, base
    frozen); ``galore`` and ``apollo-mini`` freeze the same as ``adamw-targets`` with ``peer_scope``
    ``"targets"``. ``adamw``, ``logra`` (which ``attach_logra`` patches) and the peers with
    ``peer_scope="all"`` take the model as it is. The trainer's optimizer then updates exactly the
    parameters left trainable (see ``peers.py``)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    if method == "adamw-targets" or (method in LOW_RANK_PEERS and peer_scope == "targets"):
        return train_only_targets(model)
    if method == "lora":
        return lora_model(model, rank)
    return model


def peer_optimizer(model, method: str, args, rank: int, proj_gap: int | None = None):
    """For a low-rank peer (``galore``, ``apollo-mini``): its optimizer over every trainable parameter of
    ``model`` (GaLore at ``rank``; APOLLO-Mini is rank 1), with the trainer's AdamW settings
    (``args``: the ``GRPOConfig``), for ``GRPOTrainer(optimizers=(optimizer, None))``; ``None`` for
    every other method (the trainer builds its AdamW, or LoGRA replaces it). The trainer still builds
    its scheduler around a given optimizer: ``constant`` multiplies each group's learning rate
    by 1, so the rate given here is the one trained at."""
    if method not in LOW_RANK_PEERS:
        return None
    adamw = dict(
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
    )
    return low_rank_optimizer(model, method, rank, proj_gap, **adamw)


def run_worker(spec: dict) -> dict:
    """Train from the warm-start checkpoint with ``spec["method"]`` (one of ``METHODS``) in
    this fresh process; return the record. Dense AdamW trains at ``settings.adamw_lr``, AdamW on the
    targets at ``settings.adamw_targets_lr``, LoRA at
    ``settings.lora_lr``, GaLore and APOLLO-Mini at ``settings.galore_lr`` and ``settings.apollo_mini_lr``,
    LoGRA at ``settings.kl_budget`` (``None``: no KL control, a fixed relative step) and
    ``settings.update_ratio``."""
    from datasets import Dataset
    from trl import GRPOTrainer

    settings, method, seed = DemoSettings(**spec["settings"]), spec["method"], spec["seed"]
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = resolve_device(settings.device)
    if device.startswith("cuda:"):
        torch.cuda.set_device(device)  # accelerate trains on the current device
    # Each method's own modules are imported before the memory baseline, as in `logra bench`: module
    # code is not training memory.
    module = "logra_optim.integrations.trl" if method == "logra" else PEER_MODULES.get(method)
    if module is not None:
        importlib.import_module(module)
    baseline = memory_baseline(device)

    model, tokenizer = load_policy(settings, str(Path(settings.output) / "warm_start" / f"seed{seed}"))
    model.to(device)
    before = evaluate(model, tokenizer, settings, device)
    model = prepare_model(model, method, settings.rank, settings.peer_scope)
    problems = tasks.make_problems(
        settings.task,
        settings.steps * settings.batch_size * settings.accumulation,
        digits=settings.digits,
        style=settings.style,
        seed=seed,
    )
    dataset = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})
    evaluations, meter = greedy_evaluations(settings, tokenizer, device), kl_meter(device, settings.probe_samples)
    args = _grpo_config(settings, method, seed, device)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=tasks.reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[progress_callback(settings.steps), evaluations, meter],
        optimizers=(peer_optimizer(model, method, args, settings.rank, settings.peer_proj_gap), None),
    )
    probe_dtype = None
    if method == "logra":
        from logra_optim.integrations.trl import attach_logra  # imported before the baseline

        probe_dtype = None if settings.probe_dtype == "float32" else settings.probe_dtype
        if probe_dtype == "auto":  # the realised-KL check needs fp32 products
            probe_dtype = None if settings.realised_kl_check else auto_probe_dtype(device)

        non_targets = {}
        if settings.logra_non_target_lr is not None:  # patched here, before attach_logra would freeze them
            from logra_optim import patch_model

            patch_model(model, freeze_non_targets=False)
            non_targets["non_target_optimizer"] = functools.partial(
                torch.optim.AdamW,
                lr=settings.logra_non_target_lr,
                betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_epsilon,
                weight_decay=args.weight_decay,
            )
        attach_logra(
            trainer,
            **non_targets,
            rank=settings.rank,
            kl_budget=settings.kl_budget,
            update_ratio=settings.update_ratio,
            probe_samples=settings.probe_samples,
            beta1=settings.beta1,
            direction=settings.direction,
            refresh_every=settings.refresh_every,
            probe_dtype=None if probe_dtype is None else getattr(torch, probe_dtype),
            realised_kl_check=settings.realised_kl_check,
            kl_floor=settings.kl_floor,
        )
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started - evaluations.seconds - meter.seconds
    after = evaluate(model, tokenizer, settings, device)
    history = trainer.state.log_history
    rewards = [entry["reward"] for entry in history if "reward" in entry]
    logra_stats = {
        key: [entry[key] for entry in history if key in entry]
        for key in sorted({k for entry in history for k in entry if k.startswith("logra/")})
    }
    return {
        "method": method,
        "seed": seed,
        "before": before,
        "after": after,
        "train_rewards": rewards,
        "evaluations": [[0, before["reward"]], *evaluations.points, [settings.steps, after["reward"]]],
        "logra_stats": logra_stats,
        "kl_per_update": meter.kls,
        "kl_meter_held_out": meter.held_out,
        "seconds_per_update": seconds / settings.steps,
        "peak_bytes": peak_memory(device) - baseline,
        "device": device,
        "probe_dtype": probe_dtype,
        # What the optimizer updates (LoGRA's targets take no .grad, so requires_grad undercounts them).
        "trained_params": sum(p.numel() for group in _param_groups(trainer.optimizer) for p in group["params"]),
        # The optimizer that trained (accelerate wraps it) and the learning rates its groups ended at.
        "optimizer": _qualified_name(type(getattr(trainer.optimizer, "optimizer", trainer.optimizer))),
        "learning_rates": sorted({g["lr"] for g in _param_groups(trainer.optimizer) if g.get("lr") is not None}),
    }


def _param_groups(optimizer) -> list[dict]:
    """Every parameter group ``optimizer`` steps, LoGRA's ``non_target_optimizer``'s included."""
    inner = getattr(getattr(optimizer, "optimizer", optimizer), "non_target_optimizer", None)
    return [*optimizer.param_groups, *(inner.param_groups if inner is not None else [])]


def _qualified_name(cls: type) -> str:
    """``module.Class``: GaLore's and APOLLO's optimizers are both classes named ``AdamW``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def greedy_evaluations(settings: DemoSettings, tokenizer, device: str):
    """A trainer callback that evaluates the policy greedily every ``settings.eval_every`` updates
    before the last (``points``: ``[update, reward]``; the run's own evaluation after RL is the
    last point) and keeps the time it took (``seconds``) out of the training time."""
    from transformers import TrainerCallback

    class GreedyEvaluations(TrainerCallback):
        def __init__(self):
            self.points: list[list[float]] = []
            self.seconds = 0.0

        def on_step_end(self, args, state, control, model=None, **kwargs):
            every = settings.eval_every
            if every and state.global_step % every == 0 and state.global_step < state.max_steps and model is not None:
                started = time.perf_counter()
                self.points.append([state.global_step, evaluate(model, tokenizer, settings, device)["reward"]])
                self.seconds += time.perf_counter() - started

    return GreedyEvaluations()


# Sequences of each update's batch on which every method's realised KL per update is measured.
KL_METER_SAMPLES = 8


def held_out_rows(batch: int, probed: int, samples: int = KL_METER_SAMPLES) -> torch.Tensor:
    """``samples`` rows of a ``batch``-row batch, spread over the rows that LoGRA's KL probe does
    not read (its ``probed`` rows, chosen by :func:`~logra_optim.probe.spread_rows`); fewer if fewer
    remain, and the probed rows themselves only when the probe reads the whole batch.

    Held out, so that LoGRA's realised KL is measured on sequences its controller did not fit α to:
    on the probed rows the KL equals the budget by construction, and that says nothing about the
    batch's other sequences. Every method is measured on the same rows."""
    probed_mask = torch.zeros(batch, dtype=torch.bool)
    probed_mask[spread_rows(batch, probed)] = True
    free = (~probed_mask).nonzero().squeeze(1)
    if free.numel() == 0:
        free = torch.arange(batch)
    return free[spread_rows(free.numel(), samples)]


def kl_meter(device: str = "cpu", probed: int = DemoSettings.probe_samples, samples: int = KL_METER_SAMPLES):
    """A trainer callback that measures every update's realised KL, ``KL(π_before ‖ π_after)`` per
    generated token, on ``samples`` sequences of the update's own batch that LoGRA's probe (of
    ``probed`` sequences) does not read (:func:`held_out_rows`), for any method alike: the logits
    before the optimizer step against those after it. ``kls`` holds one value per update;
    ``seconds`` its cost, kept out of the training time; ``rows`` the batch rows of the latest
    measurement; ``held_out`` whether every measurement avoided the probed rows (not when the probe
    reads whole batches). This is what makes the methods' step sizes comparable: a KL budget and a
    learning rate are not. Queued GPU work is waited for around each clock read, so that no
    training work is counted as the meter's time."""
    from transformers import TrainerCallback

    from logra_optim.probe import ContextRecorder, default_logits_fn, inference_environment, realised_kl

    class KLMeter(TrainerCallback):
        def __init__(self):
            self.kls: list[float] = []
            self.seconds = 0.0
            self.rows: list[int] = []
            self.held_out = True
            self._recorder = self._contexts = self._base = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self._recorder = ContextRecorder(model, None, args.temperature)  # every row; chosen per update

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            synchronize(device)
            started = time.perf_counter()
            batch = self._recorder.latest if self._recorder else None
            self._contexts = None
            if batch is not None:
                rows = held_out_rows(len(batch.input_ids), probed, samples)
                self.rows, self.held_out = rows.tolist(), self.held_out and probed < len(batch.input_ids)
                self._contexts = batch.select(rows)
            if self._contexts is not None and self._contexts.tokens:
                with torch.no_grad(), inference_environment(model):
                    self._base = default_logits_fn(model, self._contexts)[self._contexts.probe_mask]
            synchronize(device)
            self.seconds += time.perf_counter() - started

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            if self._base is None:
                return
            synchronize(device)
            started = time.perf_counter()
            with torch.no_grad():
                total, tokens = realised_kl(model, self._contexts, self._base)
            self.kls.append(float(total) / max(int(tokens), 1))
            self._base = None
            self.seconds += time.perf_counter() - started

        def on_train_end(self, args, state, control, **kwargs):
            if self._recorder is not None:
                self._recorder.remove()

    return KLMeter()


def progress_callback(steps: int):
    """A trainer callback that prints ``PROGRESS step steps reward`` lines on stderr, which the
    parent process turns into its progress bar (a worker's own bar would interleave with it)."""
    from transformers import TrainerCallback

    class ProgressLines(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                print(f"PROGRESS {state.global_step} {steps} {logs['reward']:.4f}", file=sys.stderr, flush=True)

    return ProgressLines()


# --------------------------------------------------------------------------------------------------
# Parent: warm start, one worker per (method, seed), table and plots


def prepare_warm_starts(settings: DemoSettings, device: str, console) -> None:
    """Build (or load) the policy and warm-start it once per seed; every method starts from it."""
    from rich.progress import Progress
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # save_pretrained's shard bar, under our own bars
    for seed in settings.seeds:
        target = Path(settings.output) / "warm_start" / f"seed{seed}"
        if settings.model:
            model, tokenizer = load_policy(settings)
        else:
            tokenizer = build_tokenizer()
            model = build_policy(tokenizer, seed, settings.policy)
        if settings.warm_start_steps:
            with Progress(console=console, transient=True) as progress:
                bar = progress.add_task(f"warm start (supervised), seed {seed}", total=settings.warm_start_steps)
                reached = warm_start(model, tokenizer, settings, seed, device, lambda: progress.advance(bar))
            console.print(
                f"warm start, seed {seed}: {reached['steps']} supervised steps, validation reward "
                f"{reached['reward']:.2f} (target {settings.warm_start_reward})"
            )
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)


def launch_worker(settings: DemoSettings, method: str, seed: int, console, description: str | None = None) -> dict:
    """Run one RL run in a fresh process, showing its progress (``description`` names it; default:
    the method and seed); return its record."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        label = f"{description} run" if description else f"{LABELS[method]} run (seed {seed})"
        bar = progress.add_task(description or f"{LABELS[method]}, seed {seed}", total=settings.steps, reward="-")

        def show_progress(line: str) -> bool:
            if not line.startswith("PROGRESS "):
                return False
            step, _, value = line.split()[1:4]
            progress.update(bar, completed=int(step), reward=value)
            return True

        return run_fresh(
            run_worker,
            {"settings": asdict(settings), "method": method, "seed": seed},
            label=label,
            env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
            on_line=show_progress,
        )


def summarize(records: list[dict]) -> list[dict]:
    """Per method: means (and spreads over seeds) of the before/after evaluation, memory and time."""
    rows = []
    for method in METHODS:
        runs = [r for r in records if r["method"] == method]
        if not runs:
            continue

        def stat(values):
            return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)

        rows.append(
            {
                "method": method,
                "seeds": [r["seed"] for r in runs],
                "reward_auc": stat([statistics.fmean(r["train_rewards"]) for r in runs]),
                "reward_before": stat([r["before"]["reward"] for r in runs]),
                "reward_after": stat([r["after"]["reward"] for r in runs]),
                "accuracy_before": stat([r["before"]["accuracy"] for r in runs]),
                "accuracy_after": stat([r["after"]["accuracy"] for r in runs]),
                # Median and 95th percentile over each run's updates, then the seed mean.
                "kl_per_update": stat([statistics.median(r.get("kl_per_update") or [math.nan]) for r in runs]),
                "kl_per_update_p95": stat([percentile_95(r.get("kl_per_update") or [math.nan]) for r in runs]),
                "peak_bytes": max(r["peak_bytes"] for r in runs),
                "seconds_per_update": statistics.median(r["seconds_per_update"] for r in runs),
                "trained_params": runs[0]["trained_params"],
            }
        )
    return rows


def table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    def pm(pair, fmt="{:.3f}"):
        mean, spread = pair
        return fmt.format(mean) + (f" ± {fmt.format(spread)}" if spread else "")

    adamw = next((r for r in rows if r["method"] == "adamw"), None)
    headers = [
        "method",
        "sampled reward AUC",
        "reward before",
        "reward after",
        "exact before",
        "exact after",
        "KL/update (p95)",
        "peak MiB",
        "s/update",
    ]
    if adamw:
        headers += ["memory / AdamW", "time / AdamW"]
    cells = []
    for r in rows:
        row = [
            LABELS[r["method"]],
            pm(r["reward_auc"]),
            pm(r["reward_before"]),
            pm(r["reward_after"]),
            pm(r["accuracy_before"]),
            pm(r["accuracy_after"]),
            f"{r['kl_per_update'][0]:.1e} ({r['kl_per_update_p95'][0]:.1e})",
            f"{r['peak_bytes'] / MIB:.0f}",
            f"{r['seconds_per_update']:.2f}",
        ]
        if adamw:
            row += [
                ratio(r["peak_bytes"], adamw["peak_bytes"]),
                ratio(r["seconds_per_update"], adamw["seconds_per_update"]),
            ]
        cells.append(row)
    return headers, cells


def plot(records: list[dict], rows: list[dict], output: Path) -> list[Path]:
    """Reward curves (each seed faint, the seed mean bold; greedy evaluations as dashed points) and a
    peak-memory bar chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for method in METHODS:
        runs = [r for r in records if r["method"] == method]
        if not runs:
            continue
        curves = [r["train_rewards"] for r in runs]
        for curve in curves:
            ax.plot(range(1, len(curve) + 1), curve, color=COLORS[method], alpha=0.15, linewidth=0.6)
        length = min(map(len, curves))
        mean = [statistics.fmean(c[i] for c in curves) for i in range(length)]
        window = max(1, length // 15)
        smooth = [statistics.fmean(mean[max(0, i - window + 1) : i + 1]) for i in range(length)]
        ax.plot(range(1, length + 1), smooth, color=COLORS[method], linewidth=2, label=f"{LABELS[method]} (sampled)")
        points = [r.get("evaluations", []) for r in runs]
        common = min(map(len, points))
        if common:
            steps = [p[0] for p in points[0][:common]]
            greedy = [statistics.fmean(p[i][1] for p in points) for i in range(common)]
            ax.plot(steps, greedy, "o--", color=COLORS[method], markersize=4, linewidth=1)
    ax.plot([], [], "o--", color="gray", markersize=4, linewidth=1, label="greedy evaluation (seed mean)")
    ax.set_xlabel("GRPO update")
    ax.set_ylabel("reward")
    ax.set_title("Reward during RL (faint: each seed; bold: seed mean, moving average)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    reward_png = output / "reward.png"
    fig.savefig(reward_png, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(
        [LABELS[r["method"]] for r in rows],
        [r["peak_bytes"] / MIB for r in rows],
        color=[COLORS[r["method"]] for r in rows],
    )
    ax.set_ylabel("peak training memory (MiB)")
    ax.set_title("Peak memory of the RL process")
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    memory_png = output / "memory.png"
    fig.savefig(memory_png, dpi=120)
    plt.close(fig)
    return [reward_png, memory_png]


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """``logra demo``: the whole demo; returns the summary that is also written to ``summary.json``."""
    return run_demo(settings_from(args, parser))


def training_device(requested: str) -> str:
    """The device runs train on (``"auto"`` resolved), with this process set up for them: offline Hub,
    and on CPU DeepSpeed told so (accelerate imports it when installed, and it warns about no GPU)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    device = resolve_device(requested)
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return device


def run_demo(settings: DemoSettings) -> dict:
    """The whole demo for ``settings``; returns the summary that is also written to ``summary.json``."""
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    output = Path(settings.output)
    output.mkdir(parents=True, exist_ok=True)
    device = training_device(settings.device)
    started = time.perf_counter()
    source = settings.model or f"the {settings.policy} Qwen2 built from a config (no download)"
    console.print(
        f"[bold]logra demo[/]: task {settings.task} ({settings.digits} digits), policy {source}, "
        f"device {device}, seeds {settings.seeds}"
    )
    prepare_warm_starts(settings, device, console)
    records = [launch_worker(settings, method, seed, console) for seed in settings.seeds for method in settings.methods]
    rows = summarize(records)
    headers, cells = table_rows(rows)
    table = Table(
        title=f"GRPO, {settings.steps} updates from the same warm start; rewards: greedy answers to "
        f"{EVAL_PROBLEMS} held-out problems",
        title_justify="left",
    )
    for i, header in enumerate(headers):
        # Wrapped, never cut: a narrow terminal (or a pipe, 80 columns) must not drop digits.
        table.add_column(header, justify="left" if i == 0 else "right", no_wrap=i == 0, overflow="fold")
    for row in cells:
        table.add_row(*row)
    Console(width=max(Console().width, 160)).print(table)
    if settings.unswept:  # beside the table, on stdout
        Console().print("Not from an equal sweep on this policy and batch: " + "; ".join(settings.unswept) + ".")
    if settings.policy == "tiny" and settings.model is None:
        Console().print(
            "On the tiny policy, peak memory and time per update measure the interpreter and fixed costs, not the "
            "methods: compare them on the medium policy (the default) or with logra bench."
        )
    images = plot(records, rows, output)
    summary = {
        "settings": asdict(settings),
        "device": device,
        "rows": rows,
        "runs": records,
        "wall_seconds": time.perf_counter() - started,
    }
    (output / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(
        f"plots: {', '.join(str(p) for p in images)}; summary: {output / 'summary.json'} "
        f"({summary['wall_seconds']:.0f} s)"
    )
    return summary
