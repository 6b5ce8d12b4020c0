"""``word_tangents`` alone at the h1024 probe's shape (510 positions × 64 sampled words, a 32k × 1024
fp32 head, random inputs), 2 threads: the rows gathered as before (a fresh 32 MiB tensor per chunk
of 8192 rows) against now (one reused 4 MiB buffer). Median of 7 calls each, after one warm-up.
Run from the repository root:

    python benchmarks/results/bench-h1024-acc4-kl-epyc/word_gather_micro.py
"""

import statistics
import sys
import time
from pathlib import Path

import torch

from logra_optim import probe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from word_gather_ab import word_tangents_before  # noqa: E402  (the gather before this change)


def median_seconds(function, *args, calls=7):
    function(*args)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        function(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    torch.set_num_threads(2)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(32000, 1024, generator=generator)
    tangent = torch.randn(510, 1024, generator=generator)
    indices = torch.randint(0, 32000, (510, 64), generator=generator)
    torch.testing.assert_close(
        probe.word_tangents(tangent, weight, indices), word_tangents_before(tangent, weight, indices)
    )
    before = median_seconds(word_tangents_before, tangent, weight, indices)
    now = median_seconds(probe.word_tangents, tangent, weight, indices)
    print(f"before {before * 1e3:.1f} ms, now {now * 1e3:.1f} ms, ratio {before / now:.2f}")


if __name__ == "__main__":
    main()
