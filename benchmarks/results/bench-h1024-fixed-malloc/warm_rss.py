"""Library code a LoGRA step with the KL probe pages in, with and without the bench's warm-up.

One process: the model's modules imported, optionally ``logra bench``'s warm-up (two steps of the same method on
``warm_config``'s model), then two steps at the h1024 shape (2 × 256 tokens, rank 256, budget
1e-4). Prints ``/proc/self/status``'s resident sizes (MiB) before and after the h1024 steps:
``RssFile`` is mapped files, mostly shared libraries' code.

    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/results/bench-h1024-fixed-malloc/warm_rss.py cold
    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/results/bench-h1024-fixed-malloc/warm_rss.py warm
"""

import sys

import torch
import transformers.models.qwen2.modeling_qwen2  # noqa: F401  (module code in both cases)
from transformers import AutoModelForCausalLM  # noqa: F401

from logra_optim.cli.bench import build_model, make_optimizer, training_step, warm_code_paths


def resident() -> dict:
    fields = ("VmHWM", "VmRSS", "RssAnon", "RssFile")
    with open("/proc/self/status") as status:
        rows = [line.split() for line in status if line.startswith(fields)]
    return {row[0].rstrip(":"): round(int(row[1]) / 1024, 1) for row in rows}


spec = dict(
    config="benchmarks/configs/qwen2-h1024.json",
    method="logra-orthogonal",
    rank=256,
    kl_budget=1e-4,
    batch=2,
    seq=256,
)
torch.set_num_threads(2)
if sys.argv[1] == "warm":
    warm_code_paths(spec)
before = resident()
model, optimizer = make_optimizer(build_model(spec, "cpu"), spec["method"], spec["rank"], spec["kl_budget"])
input_ids = torch.randint(0, 32000, (2, 256), generator=torch.Generator().manual_seed(1))
for _ in range(2):
    training_step(model, optimizer, input_ids, 1)
after = resident()
print(f"{sys.argv[1]}: before {before}")
print(f"{sys.argv[1]}: after  {after}")
print(f"{sys.argv[1]}: RssFile paged in by the h1024 steps: {after['RssFile'] - before['RssFile']:.1f} MiB")
