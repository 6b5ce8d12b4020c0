"""The JVP probe's attention: the closed-form tangent (``logra_optim.attention``) against torch's
math attention differentiated op by op, in time and memory, at long contexts.

One causal grouped-query attention call on forward-AD duals (query, key and value all carry a
tangent), as the probe makes it in every layer, each variant and length in a fresh process
(``runner.run_fresh``): the median time of 3 calls after a warm-up, and the rise of the process's
peak RSS over its value before the first call.

    python benchmarks/bench_probe_attention.py --json benchmarks/results/probe-attention.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import sys
import time

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from logra_optim.attention import AttentionTangentMode
from logra_optim.cli.runner import run_fresh

VARIANTS = {"closed form": AttentionTangentMode, "op by op (math backend)": contextlib.nullcontext}


def worker(spec: dict) -> dict:
    torch.set_num_threads(spec["threads"])
    batch, heads, kv_heads, head_dim, length = (spec[k] for k in ("batch", "heads", "kv_heads", "head_dim", "length"))
    generator = torch.Generator().manual_seed(0)
    primals = [torch.randn(batch, h, length, head_dim, generator=generator) for h in (heads, kv_heads, kv_heads)]
    tangents = [torch.randn(x.shape, generator=generator) for x in primals]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def call():
        with torch.no_grad(), fwAD.dual_level(), sdpa_kernel(SDPBackend.MATH), VARIANTS[spec["variant"]]():
            duals = [fwAD.make_dual(x, t) for x, t in zip(primals, tangents)]
            output = F.scaled_dot_product_attention(*duals, is_causal=True, enable_gqa=True)
            return fwAD.unpack_dual(output).tangent

    call()
    times = []
    for _ in range(3):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    rise = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024  # ru_maxrss is KiB on Linux
    return {**spec, "seconds": statistics.median(times), "peak_rise_bytes": rise}


def main() -> None:
    parser = argparse.ArgumentParser(description="The JVP probe's attention: closed-form tangent against op by op")
    parser.add_argument("--lengths", default="512,1024,2048", help="comma-separated sequence lengths")
    parser.add_argument("--batch", type=int, default=2, help="probe sequences")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=str)
    args = parser.parse_args()

    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        for variant in VARIANTS:
            spec = dict(
                variant=variant,
                length=length,
                batch=args.batch,
                heads=args.heads,
                kv_heads=args.kv_heads,
                head_dim=args.head_dim,
                threads=args.threads,
            )
            rows.append(run_fresh(worker, spec, label=f"{variant}, length {length}"))
            print(
                f"{variant}, length {length}: {rows[-1]['seconds']:.3f} s, "
                f"peak +{rows[-1]['peak_rise_bytes'] / 2**20:.0f} MiB",
                file=sys.stderr,
            )
    print(
        f"\n{args.batch} sequences, {args.heads} query / {args.kv_heads} key-value heads of {args.head_dim}, "
        f"causal, fp32, {args.threads} threads\n"
    )
    print("| length | closed form | op by op | time ratio | closed form peak rise | op by op peak rise |")
    print("|---:|---:|---:|---:|---:|---:|")
    for closed, op_by_op in zip(rows[::2], rows[1::2]):
        print(
            f"| {closed['length']} | {closed['seconds']:.3f} s | {op_by_op['seconds']:.3f} s "
            f"| {op_by_op['seconds'] / closed['seconds']:.1f}× | {closed['peak_rise_bytes'] / 2**20:.0f} MiB "
            f"| {op_by_op['peak_rise_bytes'] / 2**20:.0f} MiB |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
