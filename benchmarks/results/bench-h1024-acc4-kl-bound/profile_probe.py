"""Where the KL probe's time goes at the h1024 bench shape (4 microbatches of 2 × 256 tokens, rank 256,
fp32, 2 threads): torch.profiler around the third step's probe, and one plain forward of the same
tokens without grad for scale. Run from the repository root:

    python benchmarks/results/bench-h1024-acc4-kl-bound/profile_probe.py

Output of the stored run: profile_probe.txt beside this file.
"""

import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from logra_optim import control
from logra_optim.cli import bench

torch.set_num_threads(2)
spec = dict(
    config="benchmarks/configs/qwen2-h1024.json",
    seq=256,
    batch=2,
    method="logra-orthogonal",
    kl_budget=1e-4,
    device="cpu",
)
model, optimizer = bench.spec_optimizer(bench.build_model(spec, "cpu"), spec, 256)
ids = torch.randint(0, model.config.vocab_size, (2, 256), generator=torch.Generator().manual_seed(1))
probe, profiles = control.jvp_predicted_kl, []


def profiled_probe(*args, **kwargs):
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        result = probe(*args, **kwargs)
    profiles.append(prof)
    return result


for step in range(3):
    for _ in range(4):
        model(input_ids=ids, labels=ids).loss.backward()
    if step == 2:
        control.jvp_predicted_kl = profiled_probe
    optimizer.step()
    optimizer.zero_grad()
print(f"probe_seconds of the profiled step: {optimizer.stats['probe_seconds']:.3f}")
table = profiles[0].key_averages(group_by_input_shape=True)
print(table.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=24, max_shapes_column_width=60))

model.eval()
with torch.no_grad():
    times = []
    for _ in range(7):
        start = time.perf_counter()
        model(input_ids=ids)
        times.append(time.perf_counter() - start)
print(f"one forward of the 2 × 256 tokens without grad: median {statistics.median(times):.3f} s of 7")
