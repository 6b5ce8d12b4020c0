"""Shared test configuration.

Hypothesis runs derandomised (examples derived from the test's source, no example database), so a
test run is reproducible bit for bit and CI cannot flake on a newly drawn example.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.helpers.tiny import fixed_batch, tiny_qwen2

os.environ.setdefault("HF_HUB_OFFLINE", "1")

settings.register_profile(
    "logra",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "logra"))

# Every tensor here is tiny: intra-op threads only add synchronisation, and OpenMP's spin-waiting
# makes a 2-core CI machine with any other load run the suite up to 10× slower.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fixed_torch_seed():
    # Tests that draw random tensors without an explicit generator still get the same ones each run.
    torch.manual_seed(0)
    yield


@pytest.fixture
def tiny():
    return tiny_qwen2()


@pytest.fixture
def batch():
    return fixed_batch()


@pytest.fixture(scope="session")
def fitted_model():
    """A tiny Qwen2 fitted to a fixed batch, so its next-token distributions are far from uniform
    (a KL budget is only meaningful for a policy with confident predictions). Tests deep-copy it."""
    model = tiny_qwen2(attn_implementation="sdpa")
    batch = fixed_batch(batch=4, seq=16)
    adam = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(40):
        model(**batch).loss.backward()
        adam.step()
        adam.zero_grad()
    return model, batch
