"""DCR's vLLM plugin: registers the ``dcr`` weight-transfer backend (``flows.receive.vllm_transfer``).

vLLM calls ``register`` in every process it starts (the ``vllm.general_plugins`` entry point of
the ``dcr`` package), so ``--weight-transfer-config '{"backend": "dcr"}'`` works on a server
started with ``python -m vllm.entrypoints.openai.api_server`` and ``weight_transfer_config=`` on
``vllm.LLM`` as soon as DCR is installed beside vLLM. Registration is lazy (a module path): a vLLM
process that never selects the backend imports nothing of DCR but this module.
"""

from __future__ import annotations

BACKEND = "dcr"
ENGINE_MODULE = "flows.receive.vllm_transfer"
ENGINE_CLASS = "DCRWeightTransferEngine"


def register() -> None:
    """Register the ``dcr`` backend with vLLM's ``WeightTransferEngineFactory`` (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: PLC0415 - vLLM's process

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, ENGINE_MODULE, ENGINE_CLASS)
    except ValueError:  # registered already: vLLM may load plugins more than once in a process
        pass
