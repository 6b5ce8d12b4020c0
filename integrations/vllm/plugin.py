"""vLLM's plugin entry point (``vllm.general_plugins`` in ``pyproject.toml``): vLLM calls
:func:`register` in each of its processes before a worker builds its weight-transfer engine. It
only names the backend; its module (:mod:`.backend`) is imported when an engine uses it."""

from __future__ import annotations

BACKEND = "logra"
# The meaning of a LoGRA update over the backend; trainer and engine must speak the same one.
# 3: projections from the counter-based generator (sync payload version 4).
# 4: each target's stochastic-rounding seed in the payload (sync payload version 5).
PROTOCOL = 4


def register() -> None:
    """Add ``logra`` to vLLM's weight-transfer registry (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "logra_optim.integrations.vllm.backend", "LoGRAWeightTransferEngine"
        )
    except ValueError as error:  # vLLM may load plugins more than once in a process
        if "already registered" not in str(error):
            raise
