"""Where LoGRA's step() time goes on a device: phase timers (synchronised) and a profiler table.

Ran on commit a1de5de as `python3 profile_step.py qwen2.5-1.5b 8 2 1024 4` (see benchmarks.md, "On a GPU");
formatted by ruff after it ran. It wraps private methods of that commit and is kept as a record, not a tool."""

import sys
import time
import json
import functools
import os
import torch
from logra_optim import LoGRAOptimizer, patch_model
from logra_optim import optimizer as opt_mod, control as control_mod, updates as updates_mod
from logra_optim.cli.bench import build_model

preset, layers, batch, seq, acc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
device = "cuda" if torch.cuda.is_available() else "cpu"
out = os.environ.get("OUT", "/tmp")
spec = dict(preset=preset, layers=layers, seq=seq)


def sync():
    if device == "cuda":
        torch.cuda.synchronize()


timers = {}


def timed(owner, name, label):
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*a, **k):
        sync()
        t = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            sync()
            timers[label] = timers.get(label, 0.0) + time.perf_counter() - t

    setattr(owner, name, wrapper)


timed(control_mod.KLController, "choose", "choose (probe)")
timed(control_mod.KLController, "check_realised", "merge+realised check")
timed(opt_mod.LoGRAOptimizer, "_plan", "plan (directions, eta)")
timed(opt_mod.LoGRAOptimizer, "_commit", "commit")
timed(opt_mod.LoGRAOptimizer, "_synchronise", "synchronise (finite)")
timed(updates_mod, "orthogonal_direction", "  orthogonal_direction")
timed(opt_mod.LoGRAOptimizer, "_merge", "  merge")
for name in dir(control_mod):
    if name.endswith("predicted_kl") or name.endswith("realised_kl") or name.startswith("probe"):
        if callable(getattr(control_mod, name)):
            timed(control_mod, name, "  " + name)
results = {}
variants = [
    ("orthogonal, fp32 probe", dict(direction="orthogonal", kl_budget=2e-4)),
    ("orthogonal, bf16 probe", dict(direction="orthogonal", kl_budget=2e-4, probe_dtype=torch.bfloat16)),
    ("sgd, fp32 probe", dict(direction="sgd", kl_budget=2e-4)),
    ("orthogonal, no KL", dict(direction="orthogonal", kl_budget=None)),
]
for label, options in variants:
    model = patch_model(build_model(spec, device))
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    optimizer = LoGRAOptimizer(model, rank=256 if device == "cuda" else 8, **options)
    step_times = []
    for step in range(3):
        if step == 2:
            timers.clear()
        sync()
        t0 = time.perf_counter()
        for _ in range(acc):
            model(input_ids=ids, labels=ids).loss.backward()
        sync()
        t1 = time.perf_counter()
        if step == 2 and label.startswith("orthogonal, fp32"):
            from torch.profiler import profile, ProfilerActivity

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
            with profile(activities=acts) as prof:
                optimizer.step()
                sync()
            key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60)
            table2 = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60)
            open(f"{out}/profile.txt", "w").write(table + "\n\n" + table2)
            print(table, flush=True)
        else:
            optimizer.step()
        sync()
        t2 = time.perf_counter()
        optimizer.zero_grad()
        step_times.append((t1 - t0, t2 - t1))
    results[label] = {
        "fwd_bwd_s": step_times[-1][0],
        "step_s": step_times[-1][1],
        "phases": dict(timers),
        "stats": {k: v for k, v in optimizer.stats.items() if isinstance(v, (int, float))},
    }
    print(label, json.dumps(results[label], indent=1), flush=True)
    del model, optimizer
    if device == "cuda":
        torch.cuda.empty_cache()
# eigh micro-benchmark: 56 float64 256x256 Gram matrices
if device == "cuda":
    g = torch.randn(56, 2048, 256, device=device, dtype=torch.float64)
    grams = g.mT @ g
    for name, fn in [
        ("eigh one by one (cuda)", lambda: [torch.linalg.eigh(m) for m in grams]),
        ("eigh batched (cuda)", lambda: torch.linalg.eigh(grams)),
        ("eigh one by one (cpu)", lambda: [torch.linalg.eigh(m) for m in grams.cpu()]),
    ]:
        fn()
        sync()
        t = time.perf_counter()
        fn()
        sync()
        results[name] = time.perf_counter() - t
        print(name, results[name], flush=True)
json.dump(results, open(f"{out}/profile.json", "w"), indent=1)
