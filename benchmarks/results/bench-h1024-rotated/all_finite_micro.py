"""The finiteness check of the sketch buffer at the h1024 bench shape: ``all_finite`` (one ``aminmax``
pass) against ``isfinite(x).all()``, on 2 threads.

Run from the repository root: ``python benchmarks/results/bench-h1024-rotated/all_finite_micro.py``
(output: ``all_finite_micro.txt`` beside it).
"""

import time

import torch

from logra_optim.updates import all_finite

SKETCH_ENTRIES = 9437184  # 36864 target rows × rank 256: every sketch of the h1024 shape
CALLS = 50

torch.set_num_threads(2)
buffer = torch.randn(SKETCH_ENTRIES, generator=torch.Generator().manual_seed(0))


def milliseconds(check) -> float:
    """Mean time of one call over CALLS calls, after one warm-up call."""
    check()
    started = time.perf_counter()
    for _ in range(CALLS):
        check()
    return (time.perf_counter() - started) / CALLS * 1e3


print(f"isfinite(x).all(): {milliseconds(lambda: bool(torch.isfinite(buffer).all())):.1f} ms")
print(f"all_finite([x]):   {milliseconds(lambda: all_finite([buffer])):.1f} ms")
