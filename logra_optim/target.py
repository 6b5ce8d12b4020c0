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
    """One weight driven by an optimizer: a patched linear layer's ``weight``, or the stacked
    ``[E, d, k]`` weight of a mixture-of-experts block (``attribute`` names it, e.g. ``"down_proj"``;
    ``[E, k, d]`` where ``layout.transposed``, GPT-OSS).

    ``name`` is the canonical name (wrapper prefixes such as ``module.`` or ``_orig_mod.`` removed)
    a Hugging Face checkpoint and a vLLM engine use: the module's for a linear, the parameter's for
    experts. ``layout`` says which part of the ``d×k`` matrix (``E·d × k`` for experts) this rank stores,
    and whether experts are stored transposed.
    """

    name: str
    module: nn.Module
    layout: WeightLayout
    attribute: str = "weight"

    @property
    def weight(self) -> nn.Parameter:
        return getattr(self.module, self.attribute)

    @property
    def parameter_name(self) -> str:
        """The weight's name in a checkpoint: ``name + ".weight"`` for a linear, ``name`` for experts."""
        return self.name + ".weight" if self.attribute == "weight" else self.name

    @property
    def shape(self) -> tuple[int, int]:
        """The logical ``(rows, in_features)`` matrix of the whole weight, however it is sharded:
        ``(out_features, in_features)`` for a linear, ``(E·d, k)`` for ``E`` stacked experts."""
        return self.layout.shape

    @property
    def stacked(self) -> bool:
        """Whether the weight is a mixture-of-experts stack (sketched at ``expert_rank``), whatever
        its number of experts, one included."""
        return self.attribute != "weight"

    @property
    def experts(self) -> int:
        """How many matrices the weight stacks: 1 for a linear, ``E`` for experts."""
        return self.state.experts

    @property
    def state(self) -> TargetState:
        """The weight's LoGRA record: current projection ``A`` and sketch view ``S`` while bound."""
        return target_state(self.module, self.attribute)
