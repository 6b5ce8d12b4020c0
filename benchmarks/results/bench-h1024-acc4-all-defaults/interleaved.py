"""Step times at the h1024 shape (4 microbatches of 2 × 256 tokens, rank 256, fp32, 2 threads) with the
methods interleaved in one process, the order rotated each round, so that the machine's drift falls on
every method alike. Not `logra bench`'s protocol (one fresh process per configuration, which isolates
memory); a check on its time ranking where its rounds drift. Run from the repository root:

    python benchmarks/results/bench-h1024-acc4-all-defaults/interleaved.py

Output of the stored run: interleaved.txt beside this file.
"""

import statistics
import time

import torch

from logra_optim.cli import bench

torch.set_num_threads(2)
METHODS = ["frozen", "adamw-targets", "lora", "logra-orthogonal", "adamw"]
ROUNDS = 7
ids = torch.randint(0, 32000, (2, 256), generator=torch.Generator().manual_seed(1))
runs = {}
for method in METHODS:
    spec = dict(config="benchmarks/configs/qwen2-h1024.json", seq=256, batch=2, method=method, device="cpu")
    runs[method] = bench.spec_optimizer(bench.build_model(spec, "cpu"), spec, 256)
times = {method: [] for method in METHODS}
for round_ in range(ROUNDS):
    order = METHODS[round_ % len(METHODS) :] + METHODS[: round_ % len(METHODS)]
    for method in order:
        model, optimizer = runs[method]
        start = time.perf_counter()
        bench.training_step(model, optimizer, ids, 4)
        if round_:  # the first round warms every method up
            times[method].append(time.perf_counter() - start)
adamw = statistics.median(times["adamw"])
for method in METHODS:
    median = statistics.median(times[method])
    steps = ", ".join(f"{t:.2f}" for t in times[method])
    print(f"{method:18} median {median:.2f} s ({median / adamw:.2f}× dense AdamW); steps: {steps}")
