"""One microbatch of the h1024 shape (2 × 256 tokens, rank 256, fp32, 2 threads): forward+backward,
optimizer step and KL probe of LoGRA, four timed steps after one warm-up (the middle two shown),
for a checkout of the code on PYTHONPATH. Run alternately for the commit before this session's
changes (0fa6db6, in a git worktree) and for the current code, to tell a code regression from the
machine's drift; the output of three alternations is old_vs_new.txt beside this file.

    git worktree add /tmp/old-code 0fa6db6
    for r in 1 2 3; do for d in /tmp/old-code .; do PYTHONPATH=$d python old_vs_new.py 1e-4; done; done
"""

import json
import sys
import time
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from logra_optim import LoGRAOptimizer, patch_model
import logra_optim

torch.set_num_threads(2)
torch.manual_seed(0)
cfg = AutoConfig.for_model(
    **json.load(open(str(__import__("pathlib").Path(__file__).parents[2] / "configs" / "qwen2-h1024.json")))
)
model = patch_model(AutoModelForCausalLM.from_config(cfg))
model.train()
kl = float(sys.argv[1]) if len(sys.argv) > 1 else None
opt = LoGRAOptimizer(model, rank=256, kl_budget=kl)
ids = torch.randint(0, 32000, (2, 256))
fb, st = [], []
for i in range(5):
    a = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    b = time.perf_counter()
    opt.step()
    opt.zero_grad()
    c = time.perf_counter()
    if i >= 1:
        fb.append(b - a)
        st.append(c - b)
print(
    logra_optim.__file__.split("/")[2],
    "kl" if kl else "nokl",
    "fwd+bwd",
    sorted(fb)[1:3],
    "step",
    sorted(st)[1:3],
    "probe",
    opt.stats.get("probe_seconds"),
)
