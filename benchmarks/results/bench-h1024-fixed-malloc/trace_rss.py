"""A one-off trace: the RSS and its high-water mark between the phases of three training steps at
the h1024 shape of ``logra bench`` (2 × 256 tokens, rank 256, 2 threads), above the post-import
level as the bench measures it. Run from the repository root, once per allocator setting:

    python benchmarks/results/bench-h1024-fixed-malloc/trace_rss.py frozen
    python benchmarks/results/bench-h1024-fixed-malloc/trace_rss.py logra-orthogonal
    python benchmarks/results/bench-h1024-fixed-malloc/trace_rss.py logra-orthogonal 1e-4
    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/results/bench-h1024-fixed-malloc/trace_rss.py ...

``--trim``: call glibc's ``malloc_trim(0)`` after each step and trace again (what freed heap glibc
still held). ``--warm``: enter one forward-mode dual level before the baseline, as ``logra bench``
now does (its first use imports torch's JVP decompositions). ``trace_rss.txt`` also holds two runs
with ``MKL_DISABLE_FAST_MM=1`` (MKL's buffer pool off) beside the fixed threshold. The last lines
count the tensors Python can reach (parameters aside), by storage.
"""

import ctypes
import gc
import sys
import warnings

import torch
from transformers import AutoModelForCausalLM  # noqa: F401  (imported before the baseline, as the bench's worker does)

from logra_optim.cli import bench


def rss() -> dict[str, float]:
    with open("/proc/self/status") as status:
        return {
            k: int(v.split()[0]) / 2**20 for k, v in (line.split(":") for line in status) if k in ("VmRSS", "VmHWM")
        }


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    method, budget = args[0], float(args[1]) if len(args) > 1 else None
    torch.set_num_threads(2)
    if "--warm" in sys.argv:
        with torch.autograd.forward_ad.dual_level():
            torch.autograd.forward_ad.make_dual(torch.zeros(1), torch.zeros(1)).mul(1.0)
    base = rss()["VmHWM"]

    def show(phase: str) -> None:
        now = rss()
        print(f"{phase:28s} rss {now['VmRSS'] - base:.3f} GiB   high-water {now['VmHWM'] - base:.3f} GiB", flush=True)

    spec = dict(config="benchmarks/configs/qwen2-h1024.json", preset=None, layers=None, seq=256)
    model, optimizer = bench.make_optimizer(bench.build_model(spec, "cpu"), method, 256, budget)
    show("model and optimizer")
    ids = torch.randint(0, 32000, (2, 256), generator=torch.Generator().manual_seed(1))
    for step in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        show(f"step {step}: forward")
        loss.backward()
        del loss
        show(f"step {step}: backward")
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
            show(f"step {step}: optimizer")
        if "--trim" in sys.argv:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            show(f"step {step}: malloc_trim(0)")
    gc.collect()
    warnings.simplefilter("ignore")  # gc hands over objects whose attribute reads warn
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, torch.nn.Parameter):
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    print(f"tensors reachable from Python, parameters aside: {sum(storages.values()) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
