"""DCR inside every vLLM worker: the worker extension, the methods the driver calls.

Give ``worker_extension_cls=EXTENSION`` to ``vllm.LLM`` (or ``--worker-extension-cls`` to
``vllm serve``); vLLM mixes this class into each worker, and the driver calls its methods on every
worker with ``llm.collective_rpc("dcr_receive", kwargs={...})`` (``flows.receive.vllm_refit``
wraps that: ``refit_engine``). The methods are a thin adapter: the refit itself is the
engine-independent ``flows.receive.engine.EngineReceiver`` (prepare while the engine serves, then
the pause window, then the record in a thread), given the worker as its ``EngineModel``
(``VllmWorker``: the worker's model, its rank, and ``Worker.reload_weights(weights_iterator=...)``
with the fixes of ``vllm_fixups``, so repacked kernels are rebuilt). Results cross
``collective_rpc`` as dicts (``flows.receive.records``). The worker keeps its receiver in the
attribute ``_dcr_receiver`` (it cannot collide with the worker's own).

vLLM internals this relies on (vLLM 0.32.0; a vLLM upgrade breaks here first, and the exactness
tests in ``tests/vllm`` say where):

- the worker: ``worker_extension_cls`` mixing, ``Worker.reload_weights(weights_iterator=...)`` and,
  behind it, the layerwise reload of ``vllm.model_executor.model_loader.reload`` (a layer is
  processed once all its elements arrived), ``model_runner.model``, ``vllm_config``,
  ``model_config`` (``.model``: where a not-yet-known engine is rolled back from), ``rank``,
  ``parallel_config.tensor_parallel_size``, ``vllm.config.set_current_vllm_config``;
- the model: ``load_weights(iterable)`` and each parameter's ``weight_loader`` attribute (the
  layer probe, ``layer_probe``);
- the fixes (``vllm_fixups``): ``quant_method.process_weights_after_loading(module)`` (tied
  modules), ``quant_method.moe_kernel`` (MoE layers), and after a failed reload
  ``reload.layerwise.LAYERWISE_INFO``, ``_place_kernel_tensors``, ``finalize_layerwise_reload`` and
  ``vllm.model_executor.layers.attention.is_deferred_attention_layer``;
- on CPU, what linear layers compute with: ``cpu_linear(x, weight, bias)``,
  ``input_size_per_partition``, ``params_dtype`` (``live_tensors``);
- the driver (``vllm_refit``): ``LLM.collective_rpc(name, kwargs=...)``, ``LLM.reset_prefix_cache()``.
"""

from __future__ import annotations

import os

from dcr_core import events
from flows.options import ReceiveOptions
from flows.receive import vllm_fixups
from flows.receive.engine import EngineReceiver
from flows.receive.engine_apply import EngineRefitError
from flows.receive.engine_model import Weights
from flows.receive.receiver import Binding, check_arguments
from storage.root import RootRef

__all__ = ["EXTENSION", "DCRWorkerExtension", "EngineRefitError", "VllmWorker"]

EXTENSION = "flows.receive.vllm_worker.DCRWorkerExtension"


class VllmWorker:
    """A vLLM worker as DCR's ``EngineModel`` (``flows.receive.engine_model``)."""

    kind = "vllm"

    def __init__(self, worker):
        self.worker = worker

    @property
    def model(self):
        return self.worker.model_runner.model

    @property
    def rank(self) -> int:
        return self.worker.rank

    @property
    def ranks(self) -> int:
        return getattr(getattr(self.worker, "parallel_config", None), "tensor_parallel_size", 1)

    def reload(self, weights: Weights | None, layers: set[str] | None) -> None:
        w = self.worker  # without weights, vLLM reloads from model_config.model, where the engine was loaded from
        vllm_fixups.reload(self.model, w.vllm_config, layers,
                           w.reload_weights if weights is None else lambda: w.reload_weights(weights_iterator=weights))

    def abandon_reload(self) -> None:
        vllm_fixups.abandon(self.model, self.worker.vllm_config, self.worker.model_config)


class DCRWorkerExtension:
    """Methods vLLM adds to each of its workers (see the module docstring)."""

    def _dcr(self) -> EngineReceiver:
        receiver = self.__dict__.get("_dcr_receiver")
        if receiver is None:
            receiver = self._dcr_receiver = EngineReceiver(VllmWorker(self))
        return receiver

    # -- the two phases ------------------------------------------------------------------------

    def dcr_prepare(self, root: str, step: int | None = None, receiver_id: str = "vllm",
                    storage_options: dict | None = None, options: dict | None = None, state_path: str | None = None,
                    background: bool = False, report: str | None = None) -> dict:
        """Plan, lease, pull and verify ``step`` (default: the latest) of ``root`` into a staged mirror;
        the engine is not touched. ``background``: return at once and do it in a thread (``dcr_apply``
        waits for it). ``report`` (with ``background``): an id written with the outcome to the
        receiver's ``prepared/<id>.json`` in ROOT when the thread is done. Returns what was planned
        (or ``{"preparing": True}``)."""
        r = self._dcr()
        r.abort()
        opts = check_arguments(receiver_id, step, ReceiveOptions(**(options or {})))
        r.bind(Binding(RootRef(os.fspath(root), dict(storage_options or {})), receiver_id, opts, mirror=state_path))
        if background:
            return r.prepare_in_background(step, report)
        r.prepare(step)
        return r.prepared().model_dump()

    def dcr_apply(self) -> dict:
        """The pause window: reload the prepared step into the engine. The receiver's commit record
        and the lease release (object-store writes) then finish in a thread, after the engine serves
        again; ``dcr_wait`` waits for them, and so does the next prepare."""
        r = self._dcr()
        r.apply()
        r.record()
        return r.last.model_dump()

    def dcr_wait(self) -> dict:
        """Wait for the work a refit left in the background (a prepare, the commit record); raise
        what the record failed with. Returns the step held (``{"held": ...}``)."""
        return {"held": self._dcr().wait()}

    def dcr_receive(self, root: str, step: int | None = None, receiver_id: str = "vllm",
                    storage_options: dict | None = None, options: dict | None = None,
                    state_path: str | None = None) -> dict:
        """``dcr_prepare`` then ``dcr_apply``: bring this worker's engine to ``step`` (default latest)."""
        self.dcr_prepare(root, step, receiver_id, storage_options, options, state_path)
        return self.dcr_apply()

    def dcr_abort(self) -> bool:
        """Drop a prepared refit (its staged mirror and leases); True if there was one."""
        return self._dcr().abort()

    def dcr_prepared_step(self) -> int | None:
        """Wait for a background prepare (if any) and return the step prepared (None: nothing is);
        raise what the prepare failed with (the engine is untouched then)."""
        return self._dcr().prepared_step()

    # -- inspection (tests and operators) --------------------------------------------------------

    def dcr_preparing(self) -> bool:
        """Whether a background prepare is still pulling (``dcr_apply`` would wait for it)."""
        return self._dcr().preparing()

    def dcr_status(self) -> dict:
        return self._dcr().status()

    def dcr_fingerprint(self) -> str:
        return self._dcr().fingerprint()

    def dcr_set_failpoints(self, spec: str = "") -> str:
        """Set this worker process's failpoints (``dcr_core.events``; "" clears them) and restart
        their counts: fault tests of running servers (``/collective_rpc`` in vLLM's dev mode)."""
        events.set_failpoints(spec or None)
        return spec

    def dcr_dump(self, readback: bool = True) -> dict:
        """name -> (dtype, shape, BLAKE3) of everything the engine holds (``live_tensors.dump``)."""
        return self._dcr().dump(readback)
