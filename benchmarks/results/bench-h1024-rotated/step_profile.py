"""Where LoGRA's optimizer step goes at the h1024 bench shape, one microbatch of 2 × 256 tokens.

Qwen2 of benchmarks/configs/qwen2-h1024.json (hidden 1024, 4 layers, 32k words), fp32, rank 256,
default options (orthogonal directions, first moment), no KL control, 2 threads. Three steps of
warm-up, then cProfile of one optimizer step; the output is step_profile.txt beside this file.

    cd benchmarks/results/bench-h1024-rotated && python step_profile.py > step_profile.txt
"""

import cProfile
import io
import json
import pathlib
import pstats
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from logra_optim import LoGRAOptimizer, patch_model

torch.set_num_threads(2)
torch.manual_seed(0)
config_path = pathlib.Path(__file__).parents[2] / "configs" / "qwen2-h1024.json"
model = patch_model(AutoModelForCausalLM.from_config(AutoConfig.for_model(**json.loads(config_path.read_text()))))
model.train()
opt = LoGRAOptimizer(model, rank=256)
ids = torch.randint(0, 32000, (2, 256))
for warm in range(3):
    started = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    between = time.perf_counter()
    opt.step()
    opt.zero_grad()
    print(
        f"warm-up step {warm}: forward+backward {between - started:.3f} s, "
        f"optimizer {time.perf_counter() - between:.3f} s"
    )
model(input_ids=ids, labels=ids).loss.backward()
profile = cProfile.Profile()
profile.enable()
opt.step()
profile.disable()
out = io.StringIO()
pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(24)
print("\n".join(line for line in out.getvalue().splitlines() if line.strip()))
