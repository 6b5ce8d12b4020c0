"""logra-optim: LLM RL post-training with low-rank gradient sketches (LoGRA).

Two lines turn a PyTorch training script into a LoGRA one::

    from logra_optim import LoGRAOptimizer, patch_model
    opt = LoGRAOptimizer(patch_model(model), rank=256, kl_budget=2e-4)
"""

from .kl import CosineBudget
from .optimizer import LoGRAOptimizer
from .patching import (
    DEFAULT_TARGET_NAMES,
    find_experts_modules,
    find_target_modules,
    patch_model,
    patched_modules,
    patched_targets,
    unpatch_model,
)
from .projection import ProjectionSpec, canonical_name, make_projection, projection_seed

__all__ = [
    "DEFAULT_TARGET_NAMES",
    "CosineBudget",
    "LoGRAOptimizer",
    "ProjectionSpec",
    "canonical_name",
    "find_experts_modules",
    "find_target_modules",
    "make_projection",
    "patch_model",
    "patched_modules",
    "patched_targets",
    "projection_seed",
    "unpatch_model",
]
__version__ = "0.1.0"
