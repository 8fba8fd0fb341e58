"""DCR inside every vLLM worker: the worker extension, the methods the driver calls.

Give ``worker_extension_cls=EXTENSION`` to ``vllm.LLM`` (or ``--worker-extension-cls`` to
``vllm serve``); vLLM mixes this class into each worker, and the driver calls its methods on every
worker with ``llm.collective_rpc("dcr_receive", kwargs={...})`` (``flows.receive.vllm_refit``
wraps that: ``refit_engine``). A refit is two phases:

1. ``dcr_prepare`` (the engine keeps serving; ``background=True`` runs it in a thread): lock the
   worker's mirror, digest the engine, plan, lease, stage and verify the next step, and choose
   what to reload or patch (``flows.receive.vllm_prepare``). Nothing in the engine changes.
2. ``dcr_apply`` (the pause window): check and write the touched modules through vLLM's own
   in-place layerwise reload (``worker.reload_weights(weights_iterator=...)``,
   ``process_weights_after_loading`` included, so repacked kernels are rebuilt) or in place,
   install the staged mirror, record (``flows.receive.vllm_apply``). The receiver's commit record
   and the lease release follow in a thread once the engine serves again (``dcr_wait`` waits).

A worker's engine is *known* when its module digests (``flows.receive.held_digests``, the check a
live torch module receiver makes too) are those recorded after DCR last refitted it and its mirror
holds that step; otherwise (first refit, the engine reloaded or changed behind DCR's back) the
refit reloads every tensor. Anything before the apply leaves the engine untouched; a failed reload
is rolled back to the old step's bits, or ``EngineRefitError`` says the engine must be reloaded.

The worker keeps its state in ``_dcr_`` attributes (they cannot collide with the worker's own):
``_dcr_held`` (what DCR knows the engine holds, None when unknown), ``_dcr_prepared`` (a prepared
refit), ``_dcr_layers`` (the layer map of the mirror's schema), ``_dcr_background`` and
``_dcr_finishing`` (the prepare's and the record's threads).

vLLM internals this relies on (vLLM 0.32.0; a vLLM upgrade breaks here first, and the exactness
tests in ``tests/vllm`` say where):

- the worker: ``worker_extension_cls`` mixing, ``Worker.reload_weights(weights_iterator=...)`` and,
  behind it, the layerwise reload of ``vllm.model_executor.model_loader.reload`` (a layer is
  processed once all its elements arrived), ``model_runner.model``, ``vllm_config``,
  ``model_config`` (``.model``: where a not-yet-known engine is rolled back from), ``rank``,
  ``parallel_config.tensor_parallel_size``, ``vllm.config.set_current_vllm_config``;
- the model: ``load_weights(iterable)`` and each parameter's ``weight_loader`` attribute (the
  layer probe, ``vllm_layers``);
- the fixes (``vllm_fixups``): ``quant_method.process_weights_after_loading(module)`` (tied
  modules), ``quant_method.moe_kernel`` (MoE layers), and after a failed reload
  ``reload.layerwise.LAYERWISE_INFO``, ``_place_kernel_tensors``, ``finalize_layerwise_reload`` and
  ``vllm.model_executor.layers.attention.is_deferred_attention_layer``;
- on CPU, what linear layers compute with: ``cpu_linear(x, weight, bias)``,
  ``input_size_per_partition``, ``params_dtype`` (``vllm_state``);
- the driver (``vllm_refit``): ``LLM.collective_rpc(name, kwargs=...)``, ``LLM.reset_prefix_cache()``.
"""

from __future__ import annotations

import logging
import os
import threading

from dcr_core import events
from dcr_core.errors import UsageError
from flows.options import ReceiveOptions
from flows.receive import held_digests, state_file, vllm_apply, vllm_prepare, vllm_state
from flows.receive.pipeline import check_arguments
from flows.receive.vllm_apply import EngineRefitError
from flows.receive.vllm_prepare import Begun, Prepared, model_of, release
from storage.catalog import Catalog
from storage.root import RootRef, open_root

__all__ = ["EXTENSION", "DCRWorkerExtension", "EngineRefitError"]

log = logging.getLogger("dcr.receive")

EXTENSION = "flows.receive.vllm_worker.DCRWorkerExtension"


class DCRWorkerExtension:
    """Methods vLLM adds to each of its workers (see the module docstring). Attributes are prefixed
    ``_dcr_`` so they cannot collide with the worker's own."""

    # -- the two phases ------------------------------------------------------------------------

    def dcr_prepare(self, root: str, step: int | None = None, receiver_id: str = "vllm",
                    storage_options: dict | None = None, options: dict | None = None, state_path: str | None = None,
                    background: bool = False, report: str | None = None) -> dict:
        """Plan, lease, pull and verify ``step`` (default: the latest) of ``root`` into a staged mirror;
        the engine is not touched. ``background``: return at once and do it in a thread (``dcr_apply``
        waits for it). ``report`` (with ``background``): an id written with the outcome to the
        receiver's ``prepared/<id>.json`` in ROOT when the thread is done, so that a coordinator knows
        without calling into the engine (a call would wait in its engine loop). Returns what was
        planned (or ``{"preparing": True}``)."""
        self.dcr_abort()
        opts = check_arguments(receiver_id, step, ReceiveOptions(**(options or {})))
        if opts.in_place:
            raise UsageError("a vLLM worker's mirror is staged whole (in_place=False): the old one is its undo")
        begun = vllm_prepare.begin(self, RootRef(os.fspath(root), dict(storage_options or {})), receiver_id, state_path)
        if not background:
            self._dcr_prepared = vllm_prepare.stage(self, begun, step, opts)
            return vllm_prepare.summary(self._dcr_prepared)
        def staged() -> Prepared:
            try:
                p = vllm_prepare.stage(self, begun, step, opts)
            except BaseException as e:
                self._dcr_report(begun, report, step, e)
                raise
            self._dcr_report(begun, report, p.plan.target_step, None)
            return p

        self._dcr_start("_dcr_background", "dcr-prepare", staged)
        return {"preparing": True, "receiver": begun.receiver_id}

    def _dcr_report(self, b: Begun, report: str | None, step: int | None, error: BaseException | None) -> None:
        """Write the outcome of a background prepare to ``prepared/<receiver>.json`` (if asked for);
        a failure to write it is logged (the coordinator then learns it from the start call)."""
        if report is None:
            return
        tp = getattr(getattr(self, "parallel_config", None), "tensor_parallel_size", 1)
        doc = {"prepare_id": report, "step": -1 if step is None else step, "ok": error is None, "ranks": tp,
               **({} if error is None else {"error": f"{type(error).__name__}: {error}"})}
        try:
            Catalog(open_root(b.ref)).record_prepared(b.receiver_id, doc)
        except Exception as e:  # noqa: BLE001 - advisory
            log.warning("receiver %s: could not record its prepare (%s: %s)", b.receiver_id, type(e).__name__, e)

    def dcr_apply(self) -> dict:
        """The pause window: reload the prepared step into the engine (see the module docstring).
        The receiver's commit record and the lease release (object-store writes) then finish in a
        thread, after the engine serves again; ``dcr_wait`` waits for them, and so does the next
        prepare."""
        p = self._dcr_take_prepared()
        try:
            result = vllm_apply.apply(self, p)
        except BaseException:
            release(p)
            raise
        def finish() -> None:
            try:
                state_file.record_receiver_commit(p.ref, p.receiver_id, p.plan.target_step, p.record)
            except BaseException as e:  # reported by dcr_wait; the next refit records again
                log.warning("receiver %s: recording its commit of step %s failed (%s: %s); the next refit records it",
                            p.receiver_id, p.plan.target_step, type(e).__name__, e)
                raise
            finally:
                release(p)

        self._dcr_start("_dcr_finishing", "dcr-record", finish)
        return result

    def dcr_wait(self) -> dict:
        """Wait for the work a refit left in the background (a prepare, the commit record); raise
        what the record failed with. Returns the step held (``{"held": ...}``)."""
        done = self._dcr_join("_dcr_finishing")
        if done is not None and "error" in done:
            raise done["error"]
        bg = getattr(self, "_dcr_background", None)
        if bg is not None:  # waited for, kept for dcr_apply
            bg[0].join()
        return {"held": self._dcr_public_held()}

    def dcr_receive(self, root: str, step: int | None = None, receiver_id: str = "vllm",
                    storage_options: dict | None = None, options: dict | None = None,
                    state_path: str | None = None) -> dict:
        """``dcr_prepare`` then ``dcr_apply``: bring this worker's engine to ``step`` (default latest)."""
        self.dcr_prepare(root, step, receiver_id, storage_options, options, state_path)
        return self.dcr_apply()

    def dcr_abort(self) -> bool:
        """Drop a prepared refit (its staged mirror and leases); True if there was one."""
        self._dcr_join("_dcr_finishing")  # the last refit's record: done before anything else locks the mirror
        staged = self._dcr_join("_dcr_background")
        if staged is not None and "result" in staged:
            self._dcr_prepared = staged["result"]
        p = getattr(self, "_dcr_prepared", None)
        self._dcr_prepared = None
        if p is None:
            return False
        release(p)
        return True

    def dcr_prepared_step(self) -> int | None:
        """Wait for a background prepare (if any) and return the step prepared (None: nothing is);
        raise what the prepare failed with (the engine is untouched then)."""
        staged = self._dcr_join("_dcr_background")
        if staged is not None:
            if "error" in staged:
                raise staged["error"]
            self._dcr_prepared = staged["result"]
        p = getattr(self, "_dcr_prepared", None)
        return None if p is None else p.plan.target_step

    # -- inspection (tests and operators) --------------------------------------------------------

    def dcr_preparing(self) -> bool:
        """Whether a background prepare is still pulling (``dcr_apply`` would wait for it)."""
        bg = getattr(self, "_dcr_background", None)
        return bg is not None and bg[0].is_alive()

    def dcr_status(self) -> dict:
        held = getattr(self, "_dcr_held", None)
        known = bool(held) and held_digests.unchanged(model_of(self), held["digests"])
        return {"held": self._dcr_public_held(), "known": known, "prepared": getattr(self, "_dcr_prepared", None) is not None}

    def dcr_fingerprint(self) -> str:
        return held_digests.fingerprint(model_of(self))

    def dcr_set_failpoints(self, spec: str = "") -> str:
        """Set this worker process's failpoints (``dcr_core.events``; "" clears them) and restart
        their counts: fault tests of running servers (``/collective_rpc`` in vLLM's dev mode)."""
        events.set_failpoints(spec or None)
        return spec

    def dcr_dump(self, readback: bool = True) -> dict:
        """name -> (dtype, shape, BLAKE3) of everything the engine holds (``vllm_state.dump``)."""
        return vllm_state.dump(model_of(self), readback)

    # -- internals ---------------------------------------------------------------------------------

    def _dcr_public_held(self) -> dict | None:
        held = getattr(self, "_dcr_held", None)
        return None if held is None else {k: v for k, v in held.items() if k != "digests"}

    def _dcr_start(self, attr: str, name: str, fn) -> None:
        """Run ``fn`` in a thread kept as ``attr``; its result or error lands in a box ``_dcr_join`` returns."""
        box: dict = {}

        def run() -> None:
            try:
                box["result"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to whoever joins
                box["error"] = e

        thread = threading.Thread(target=run, name=name, daemon=True)
        setattr(self, attr, (thread, box))
        thread.start()

    def _dcr_join(self, attr: str) -> dict | None:
        """Wait for the thread kept as ``attr`` (if any), forget it, and return its box."""
        job = getattr(self, attr, None)
        if job is None:
            return None
        job[0].join()
        setattr(self, attr, None)
        return job[1]

    def _dcr_take_prepared(self) -> Prepared:
        self.dcr_prepared_step()
        p = getattr(self, "_dcr_prepared", None)
        self._dcr_prepared = None
        if p is None:
            raise UsageError("nothing prepared: call dcr_prepare first")
        return p
