"""The memory and step-time benchmark against AdamW on the same matrices: ``logra bench`` with the ``core`` preset.

The ``core`` preset is a 201 M-parameter Qwen2 (hidden 1536, 4 layers, intermediate 4224, 12 heads /
4 KV heads, vocab 32000); this runs dense AdamW on the LoGRA targets (``adamw-targets``, the
like-for-like reference) and on every parameter, LoGRA SGD at rank 256 and RowAdam at ranks 16…512,
on 2 × 512 tokens, 2 threads, on the CPU, and tabulates the fastest steps and optimizer parts too.
How it measures is ``logra bench``'s (``logra_optim/cli/bench.py``). Options after these override
them, any of ``logra bench``'s::

    python benchmarks/bench_core.py --output benchmarks/results/core-cpu
    python benchmarks/bench_core.py --checkpointing --ranks 256 --rounds 2 \
        --output benchmarks/results/core-cpu-checkpointing
"""

import sys

from logra_optim.cli import main

CORE = [
    "bench",
    "--preset",
    "core",
    "--methods",
    "adamw-targets,adamw,logra-sgd,logra-rowadam",
    "--rank",
    "256",
    "--ranks",
    "16,64,256,512",
    "--threads",
    "2",
    "--device",
    "cpu",
    "--detail",
]

if __name__ == "__main__":
    sys.exit(main([*CORE, *sys.argv[1:]]))
