"""A LoGRA target as the optimizer's users see it.

Adapters (the vLLM sync, benchmarks, tests) need to know which weights an optimizer drives, under
which names a checkpoint or a rollout engine knows them, and which part of each weight this rank
stores. :attr:`LoGRAOptimizer.targets <logra_optim.LoGRAOptimizer.targets>` answers with these
read-only views, so that nothing outside the optimizer needs its private state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from .distributed import WeightLayout
from .patching import TargetState, target_state


@dataclass(frozen=True)
class Target:
    """One patched linear layer driven by an optimizer.

    ``name`` is the module's canonical name (wrapper prefixes such as ``module.`` or
    ``_orig_mod.`` removed), the name a Hugging Face checkpoint and a vLLM engine use; ``layout``
    says which part of the ``d×k`` weight this rank stores.
    """

    name: str
    module: nn.Linear
    layout: WeightLayout

    @property
    def weight(self) -> nn.Parameter:
        return self.module.weight

    @property
    def parameter_name(self) -> str:
        """The weight's name in a checkpoint: ``name + ".weight"``."""
        return self.name + ".weight"

    @property
    def shape(self) -> tuple[int, int]:
        """The logical ``(out_features, in_features)`` of the whole weight, however it is sharded."""
        return self.layout.shape

    @property
    def state(self) -> TargetState:
        """The layer's LoGRA record: current projection ``A`` and sketch view ``S`` while bound."""
        return target_state(self.module)
