"""The JVP probe's vocabulary part alone, at the bench_kl cost shape's LM head (1022 probe positions,
hidden 1024, 32k words, fp32, 2 threads): the head's primal and tangent products a chunk of
positions at a time, with and without the float64 KL terms; then the float64 terms alone by
positions per chunk, at 4k, 32k and 152k words. Settings alternate in one process.

    python benchmarks/results/kl-chunks/head_chunks.py > benchmarks/results/kl-chunks/head_chunks.txt
"""

import time

import torch

import logra_optim.kl as kl
from logra_optim.probe import _primal_and_tangent

torch.set_num_threads(2)
generator = torch.Generator().manual_seed(0)
head = torch.randn(32000, 1024, generator=generator) * 0.02
hidden = torch.randn(1022, 1024, generator=generator)
tangent = torch.randn(1022, 1024, generator=generator) * 1e-3


def seconds(fn, repeats=2):
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def head_and_terms(positions, terms):
    for start in range(0, hidden.shape[0], positions):
        rows = slice(start, start + positions)
        logits, tangent_logits = _primal_and_tangent(hidden[rows], tangent[rows], head, None)
        if terms:
            kl.fisher_kl_terms(logits, tangent_logits)


print("LM head (primal and tangent) over 1022 positions, 32k words; float64 terms: 256 positions a chunk")
kl._CPU_CHUNK_ELEMENTS = 256 * 32000
for repeat in range(3):
    for positions in (64, 128, 256, 512):
        products = seconds(lambda: head_and_terms(positions, False))
        both = seconds(lambda: head_and_terms(positions, True))
        print(
            f"round {repeat}: {positions:3d} positions a chunk: products {products:.3f} s, with the terms {both:.3f} s"
        )

print("\nfloat64 KL terms alone, by positions per chunk (MiB per float64 array)")
for vocabulary, positions in ((4096, 1024), (32000, 256), (151936, 64)):
    logits = torch.randn(positions, vocabulary, generator=generator) * 3
    tangent_logits = torch.randn(positions, vocabulary, generator=generator)
    for repeat in range(2):
        cells = []
        for chunk in (4, 16, 32, 64, 256):
            kl._CPU_CHUNK_ELEMENTS = chunk * vocabulary
            ms = 1e3 * seconds(lambda: kl.fisher_kl_terms(logits, tangent_logits), repeats=3)
            cells.append(f"{chunk} ({chunk * vocabulary * 8 / 2**20:.1f}): {ms:.1f} ms")
        print(f"{vocabulary} words, {positions} positions, round {repeat}: " + ", ".join(cells))
kl._CPU_CHUNK_ELEMENTS = 1 << 20  # the library's setting
print(f"\nthe rule's choice: {[kl.positions_per_chunk(v, torch.device('cpu')) for v in (4096, 32000, 151936)]}")
