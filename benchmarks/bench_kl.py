"""Predicted-KL control: accuracy (realised KL / budget) and cost (probe time / plain forward time).

Accuracy: a small Qwen2 is first fitted to a fixed token set (so its next-token distributions are
far from uniform, as a trained LLM's are); then LoGRA takes several steps at each budget, and after
every step the exact full-vocabulary KL between the policy before and after the step is measured
on the probe contexts, independently of the optimizer's bookkeeping.

The JVP probe with a sampled vocabulary (``probe_words``) also gets its prediction compared with the
exact one's for one direction, over many draws, on the fitted model and on the cost models.

Cost: on a Qwen2 of realistic width, the median time of the JVP probe (with the weights' precision,
with bf16 products, on a subset of positions and with a sampled vocabulary) and of the finite-
difference probe over the probe contexts, divided by the median time of one plain (eval, no-grad)
forward of the same contexts and by that of a forward and backward of them with every weight frozen
(the floor of any method that keeps activations). Each model size runs in a fresh process
(``runner.run_fresh``), after warm-up.

    python benchmarks/bench_kl.py --json benchmarks/results/kl.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch

from logra_optim import LoGRAOptimizer, patch_model
from logra_optim.cli.runner import run_fresh
from logra_optim.kl import exact_kl_terms
from logra_optim.probe import (
    inference_environment,
    contexts_from_batch,
    default_logits_fn,
    finite_difference_predicted_kl,
    jvp_predicted_kl,
    subsample_positions,
)

BUDGETS = (1e-5, 3e-5, 1e-4, 2e-4)
# (probe, realised-KL check, probe dtype): the two predictors, the JVP probe with the check that
# measures the true KL after merging and retries with a rescaled α when it is off by more than 5%,
# and the JVP probe with bf16 products (probe_dtype). Then the JVP probe on random subsets of the
# positions (probe_positions: each of --acc-positions), its realised KL measured on all of them.
VARIANTS = (
    ("jvp", False, None),
    ("finite_difference", False, None),
    ("jvp", True, None),
    ("jvp", False, torch.bfloat16),
)


def qwen2(hidden: int, layers: int, vocab: int, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    heads = max(1, hidden // 64)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(2.75 * hidden) // 8 * 8,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=hidden // heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config)


def accuracy(args) -> list[dict]:
    base = qwen2(args.acc_hidden, args.acc_layers, args.acc_vocab)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.acc_vocab, (8, 64), generator=generator)
    batch = {"input_ids": ids, "labels": ids}
    adam = torch.optim.AdamW(base.parameters(), lr=2e-3)
    for _ in range(args.pretrain_steps):
        base(**batch).loss.backward()
        adam.step()
        adam.zero_grad()
    contexts = contexts_from_batch(ids, labels=ids, samples=2)

    rows = []
    model = patch_model(copy.deepcopy(base))
    opt = LoGRAOptimizer(model, rank=args.rank, direction="rowadam", kl_budget=1e-4)
    model(**batch).loss.backward()
    factors = [target.state.sketch * 1e-3 for target in opt.targets]
    states = [target.state for target in opt.targets]
    noise = [word_noise(model, states, factors, contexts, int(n), 200) for n in args.acc_words.split(",") if n]
    for row in noise:
        print(f"accuracy: {row['words']} words, sampled / exact prediction {row}", file=sys.stderr)
    subsets = [("jvp", False, None, int(n), None) for n in filter(None, args.acc_positions.split(","))]
    words = [("jvp", False, None, None, int(n)) for n in filter(None, args.acc_words.split(","))]
    for probe, check, dtype, positions, probe_words in [(*v, None, None) for v in VARIANTS] + subsets + words:
        name = probe + (" + realised-KL check" if check else "") + (" (bf16 products)" if dtype else "")
        name += f" ({positions} of {contexts.tokens} positions)" if positions else ""
        name += f" ({probe_words} of {args.acc_vocab} words)" if probe_words else ""
        for budget in BUDGETS:
            model = patch_model(copy.deepcopy(base))
            opt = LoGRAOptimizer(
                model,
                rank=args.rank,
                direction="rowadam",  # the stored results' direction (the default when they ran)
                kl_budget=budget,
                probe=probe,
                update_ratio=5e-3,
                alpha_max=1e3,
                realised_kl_check=check,
                realised_kl_tolerance=0.05,
                probe_dtype=dtype,
                probe_positions=positions,
                probe_words=probe_words,
            )
            ratios = []
            for _ in range(args.acc_steps):
                with torch.no_grad():
                    before = model(input_ids=contexts.input_ids).logits[contexts.probe_mask]
                model(**batch).loss.backward()
                opt.step()
                opt.zero_grad()
                with torch.no_grad():
                    after = model(input_ids=contexts.input_ids).logits[contexts.probe_mask]
                ratios.append(float(exact_kl_terms(before, after).mean()) / budget)
            rows.append(
                {
                    "probe": name,
                    "budget": budget,
                    "min": min(ratios),
                    "median": statistics.median(ratios),
                    "max": max(ratios),
                }
            )
            print(
                f"accuracy {name:36s} budget {budget:.0e}: realised/budget median {rows[-1]['median']:.4f} "
                f"[{rows[-1]['min']:.4f}, {rows[-1]['max']:.4f}]",
                file=sys.stderr,
            )
    return rows, noise


def word_noise(model, targets, factors, contexts, words: int, draws: int) -> dict:
    """The sampled-vocabulary prediction against the exact one for one direction: ``Σ q_s`` with
    ``words`` words per position over ``draws`` seeds, as ratios to every word's ``Σ q_s``."""
    exact = float(jvp_predicted_kl(model, targets, factors, contexts, keep_base=False)[0])
    ratios = sorted(
        float(jvp_predicted_kl(model, targets, factors, contexts, keep_base=False, words=words, seed=seed)[0]) / exact
        for seed in range(draws)
    )
    return {
        "words": words,
        "draws": draws,
        "mean": statistics.fmean(ratios),
        "p05": ratios[int(0.05 * (draws - 1))],
        "p95": ratios[int(0.95 * (draws - 1))],
    }


def _median_seconds(fn, runs: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def cost_worker(spec: dict) -> dict:
    """One model size, in this (fresh) process."""
    hidden, layers, vocab, rank = spec["hidden"], spec["layers"], spec["vocab"], spec["rank"]
    samples, seq, runs, warmup = spec["samples"], spec["seq"], spec["runs"], spec["warmup"]
    torch.set_num_threads(2)
    model = patch_model(qwen2(hidden, layers, vocab))
    ids = torch.randint(0, vocab, (samples, seq), generator=torch.Generator().manual_seed(2))
    opt = LoGRAOptimizer(model, rank=rank, kl_budget=1e-4, direction="rowadam")  # as the stored results
    model(input_ids=ids, labels=ids).loss.backward()
    contexts = contexts_from_batch(ids, labels=ids)
    # The probes perturb each target by its state's factor: the step's sketch, scaled down.
    targets = [target.state for target in opt.targets]
    factors = [t.sketch * 1e-3 for t in targets]

    def plain():
        with inference_environment(model):
            default_logits_fn(model, contexts)

    plain_s = _median_seconds(plain, runs, warmup)
    # Both JVP timings as the optimizer runs the probe without a realised-KL check (chunked LM head).
    jvp_s = _median_seconds(lambda: jvp_predicted_kl(model, targets, factors, contexts, keep_base=False), runs, warmup)
    subset = subsample_positions(contexts, spec["positions"], seed=1)
    jvp_subset_s = _median_seconds(
        lambda: jvp_predicted_kl(model, targets, factors, subset, keep_base=False), runs, warmup
    )
    jvp_words_s = _median_seconds(
        lambda: jvp_predicted_kl(model, targets, factors, contexts, keep_base=False, words=spec["words"]),
        runs,
        warmup,
    )
    noise = word_noise(model, targets, factors, contexts, spec["words"], 20)
    jvp_bf16_s = _median_seconds(
        lambda: jvp_predicted_kl(model, targets, factors, contexts, keep_base=False, compute_dtype=torch.bfloat16),
        runs,
        warmup,
    )
    # The floor of a method that keeps activations: forward and backward of the same tokens with
    # every weight frozen (input gradients only).
    frozen = qwen2(hidden, layers, vocab).requires_grad_(False)
    frozen.enable_input_require_grads()

    def floor():
        frozen(input_ids=ids, labels=ids).loss.backward()

    floor_s = _median_seconds(floor, runs, warmup)
    fd_s = _median_seconds(lambda: finite_difference_predicted_kl(model, targets, factors, contexts), runs, warmup)
    return {
        "hidden": hidden,
        "layers": layers,
        "vocab": vocab,
        "tokens": samples * seq,
        "rank": rank,
        "plain_forward_s": plain_s,
        "jvp_s": jvp_s,
        "jvp_bf16_s": jvp_bf16_s,
        "subset_positions": subset.tokens,
        "jvp_subset_s": jvp_subset_s,
        "jvp_subset_over_floor": jvp_subset_s / floor_s,
        "words": spec["words"],
        "jvp_words_s": jvp_words_s,
        "jvp_words_over_floor": jvp_words_s / floor_s,
        "word_noise": noise,
        "fd_s": fd_s,
        "frozen_forward_backward_s": floor_s,
        "jvp_over_forward": jvp_s / plain_s,
        "jvp_bf16_over_forward": jvp_bf16_s / plain_s,
        "fd_over_forward": fd_s / plain_s,
        "jvp_over_floor": jvp_s / floor_s,
        "jvp_bf16_over_floor": jvp_bf16_s / floor_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="Predicted-KL accuracy and probe cost")
    parser.add_argument("--acc-hidden", type=int, default=128)
    parser.add_argument("--acc-layers", type=int, default=2)
    parser.add_argument("--acc-vocab", type=int, default=512)
    parser.add_argument("--acc-steps", type=int, default=5)
    parser.add_argument("--pretrain-steps", type=int, default=60)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument(
        "--acc-positions",
        default="32,64",
        help="comma-separated probe_positions of the accuracy's subset rows (of 126)",
    )
    parser.add_argument("--cost-positions", type=int, default=128, help="probe_positions of the cost's subset column")
    parser.add_argument(
        "--acc-words", default="32", help="comma-separated probe_words of the accuracy's sampled-vocabulary rows"
    )
    parser.add_argument(
        "--cost-words", type=int, default=32, help="probe_words of the cost's sampled-vocabulary column"
    )
    parser.add_argument("--cost-rank", type=int, default=64)
    parser.add_argument("--sizes", type=str, default="512x4,1024x4", help="hidden×layers of the cost runs")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", type=str)
    args = parser.parse_args()

    rows, noise = accuracy(args)
    results = {"accuracy": rows, "word_noise": noise, "cost": []}
    for size in filter(None, args.sizes.split(",")):
        hidden, layers = (int(v) for v in size.split("x"))
        spec = dict(
            hidden=hidden,
            layers=layers,
            vocab=args.vocab,
            seq=args.seq,
            samples=args.samples,
            positions=args.cost_positions,
            words=args.cost_words,
            rank=args.cost_rank,
            runs=args.runs,
            warmup=args.warmup,
        )
        row = run_fresh(cost_worker, spec, label=f"cost worker (hidden {hidden}, {layers} layers)")
        results["cost"].append(row)
        print(
            f"cost hidden {hidden} layers {layers} ({row['tokens']} probe tokens, r={row['rank']}): "
            f"JVP {row['jvp_over_forward']:.2f}× a forward ({row['jvp_over_floor']:.2f}× the frozen forward+backward), "
            f"bf16 JVP {row['jvp_bf16_over_forward']:.2f}× ({row['jvp_bf16_over_floor']:.2f}×), "
            f"JVP on {row['subset_positions']} positions {row['jvp_subset_over_floor']:.2f}× the floor, "
            f"JVP with {row['words']} words {row['jvp_words_over_floor']:.2f}× the floor, "
            f"FD {row['fd_over_forward']:.2f}×",
            file=sys.stderr,
        )

    print("\n| probe | budget | realised / budget (median [min, max] over steps) |\n|---|---|---|")
    for row in results["accuracy"]:
        print(f"| {row['probe']} | {row['budget']:.0e} | {row['median']:.3f} [{row['min']:.3f}, {row['max']:.3f}] |")
    print("\n| model | words per position | sampled / exact Σ q: mean [5th, 95th percentile] (draws) |\n|---|---|---|")
    noise_rows = [(f"accuracy model, {args.acc_vocab} words", row) for row in results["word_noise"]]
    noise_rows += [
        (f"{row['hidden']} × {row['layers']}, {row['vocab']} words", row["word_noise"]) for row in results["cost"]
    ]
    for label, row in noise_rows:
        print(f"| {label} | {row['words']} | {row['mean']:.4f} [{row['p05']:.4f}, {row['p95']:.4f}] ({row['draws']}) |")
    print(
        "\n| model (hidden × layers, vocab) | probe tokens | plain forward s | frozen fwd+bwd s | JVP probe "
        "| JVP probe, bf16 products | JVP probe, a subset of positions | JVP probe, sampled words | FD probe |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in results["cost"]:
        print(
            f"| {row['hidden']} × {row['layers']}, {row['vocab']} | {row['tokens']} | {row['plain_forward_s']:.3f} "
            f"| {row['frozen_forward_backward_s']:.3f} | {row['jvp_over_forward']:.2f}× ({row['jvp_over_floor']:.2f}×) "
            f"| {row['jvp_bf16_over_forward']:.2f}× ({row['jvp_bf16_over_floor']:.2f}×) "
            f"| {row['subset_positions']}: {row['jvp_subset_s'] / row['plain_forward_s']:.2f}× "
            f"({row['jvp_subset_over_floor']:.2f}×) "
            f"| {row['words']}: {row['jvp_words_s'] / row['plain_forward_s']:.2f}× "
            f"({row['jvp_words_over_floor']:.2f}×) | {row['fd_over_forward']:.2f}× |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
