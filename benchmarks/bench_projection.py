"""Raw speed of generating one projection ``A`` (``make_projection``), as every use now does.

Since projections are generated where they are used and never kept, a training step generates each
group's ``A`` once per forward (per microbatch), once for the step sizes and once for the merge (one
more pair at a redraw with a first moment). This times one generation (median and fastest of ``--repeats``,
after one warm-up), for each kind and width at rank ``--rank``, on ``--device``::

    python benchmarks/bench_projection.py --threads 2 --output benchmarks/results/projection-cpu.json

It calls only ``make_projection(seed, rank, width, kind, device=...)``, so the same command times
another release's generator when that release is first on ``PYTHONPATH`` (the numbers in
docs/benchmarks.md compare the Mersenne Twister one this way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from logra_optim import make_projection


def seconds(rank: int, width: int, kind: str, device: str, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` generations (a new seed each time: nothing can be cached)."""
    make_projection(0, rank, width, kind, device=device)
    times = []
    for seed in range(1, repeats + 1):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        make_projection(seed, rank, width, kind, device=device)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--widths", default="1024,2816", help="in-widths k, comma-separated")
    parser.add_argument("--kinds", default="rademacher,gaussian")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for kind in args.kinds.split(","):
        for width in (int(w) for w in args.widths.split(",")):
            times = seconds(args.rank, width, kind, args.device, args.repeats)
            median, fastest = statistics.median(times), min(times)
            rows.append(
                {
                    "kind": kind,
                    "rank": args.rank,
                    "width": width,
                    "device": args.device,
                    "median_s": median,
                    "min_s": fastest,
                }
            )
            where = f"{kind:>10}  {args.rank}×{width:<6} {args.device}"
            print(f"{where}: median {median * 1e3:7.2f} ms, min {fastest * 1e3:7.2f} ms")
    if args.output:
        meta = {"threads": torch.get_num_threads(), "torch": torch.__version__, "repeats": args.repeats}
        with open(args.output, "w") as handle:
            json.dump({"meta": meta, "results": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
