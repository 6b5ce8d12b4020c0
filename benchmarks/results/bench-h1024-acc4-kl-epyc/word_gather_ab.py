"""In one process, LoGRA's optimizer step (KL probe on) at the h1024 shape with 4 microbatches of
2 x 256 tokens, alternating each step between the sampled words' head rows gathered as before
(a fresh tensor per chunk of 8192 rows, 32 MiB) with power iterations normalised after every
product, and as now (one reused buffer of 16 positions' rows; the iterations on G / tr G,
normalised once). Six timed steps each; medians of the whole step, of the probe
(``stats["probe_seconds"]``) and of the rest. Run from the repository root:

    python benchmarks/results/bench-h1024-acc4-kl-epyc/word_gather_ab.py
"""

import statistics
import time

import torch

import logra_optim.polar as polar
import logra_optim.probe as probe
from logra_optim.cli.bench import build_model, make_optimizer


def word_tangents_before(tangent, weight, indices):
    rows, words = indices.shape
    out = tangent.new_empty((rows, words), dtype=weight.dtype)
    step = max(1, probe.HEAD_CHUNK_LOGITS // (words * weight.shape[1]))
    for start in range(0, rows, step):
        chunk = indices[start : start + step]
        gathered = weight.index_select(0, chunk.reshape(-1)).view(*chunk.shape, weight.shape[1])
        out[start : start + step] = torch.bmm(gathered, tangent[start : start + step, :, None].to(weight.dtype))[..., 0]
    return out


def largest_eigenvalue_before(grams, iterations=32):
    batch, r, _ = grams.shape
    start = torch.rand(r, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.5
    vector = start.to(grams.device).expand(batch, r, 1)
    for _ in range(iterations):
        vector = grams @ vector
        vector = vector / vector.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return (vector.mT @ grams @ vector).clamp_min(1e-300)


def main():
    torch.set_num_threads(2)
    variants = {
        "new": (probe.word_tangents, polar.largest_eigenvalue),
        "old": (word_tangents_before, largest_eigenvalue_before),
    }
    spec = dict(config="benchmarks/configs/qwen2-h1024.json", seq=256)
    model, optimizer = make_optimizer(build_model(spec, "cpu"), "logra-orthogonal", 256, 1e-4)
    input_ids = torch.randint(0, 32000, (2, 256), generator=torch.Generator().manual_seed(1))
    results = {"old": [], "new": []}
    for step in range(13):
        for _ in range(4):
            model(input_ids=input_ids, labels=input_ids).loss.backward()
        which = "old" if step % 2 else "new"
        probe.word_tangents, polar.largest_eigenvalue = variants[which]
        start = time.perf_counter()
        optimizer.step()
        elapsed = time.perf_counter() - start
        optimizer.zero_grad()
        if step >= 1:  # the first step warms up
            results[which].append((elapsed, optimizer.stats["probe_seconds"]))
    for which, steps in results.items():
        print(
            which,
            "step",
            round(statistics.median(s for s, _ in steps), 3),
            "probe",
            round(statistics.median(p for _, p in steps), 3),
            "nonprobe",
            round(statistics.median(s - p for s, p in steps), 3),
            [round(s, 2) for s, _ in steps],
        )


if __name__ == "__main__":
    main()
