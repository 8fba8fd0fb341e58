"""DCR inside every vLLM worker: pull and verify a step, then reload it through vLLM's own loader.

Give ``worker_extension_cls=EXTENSION`` to ``vllm.LLM`` (or ``--worker-extension-cls`` to
``vllm serve``); vLLM mixes this class into each worker, and the driver calls its methods on every
worker with ``llm.collective_rpc("dcr_receive", kwargs={...})`` (``flows.receive.vllm_refit``
wraps that: ``refit_engine``).

Each worker keeps a *mirror*: a DCR state file holding the canonical checkpoint of the step its
engine serves (by default under the DCR cache directory, one per ROOT and receiver). A refit is two
phases:

1. ``dcr_prepare`` (the engine keeps serving; ``background=True`` runs it in a thread): plan from
   the mirror's step, lease the steps read, and stage the next mirror beside the current one:
   only the changed chunks are pulled, and every tensor is verified against the target step's
   digest. Nothing in the engine changes.
2. ``dcr_apply`` (the pause window): reload through vLLM's in-place, layer by layer reload
   (``worker.reload_weights(weights_iterator=...)``, vLLM's ``process_weights_after_loading``
   included, so repacked kernels are rebuilt) every layer a changed tensor feeds, each with all of
   its checkpoint tensors (``flows.receive.vllm_layers``), read from the staged mirror; a changed
   tensor whose layer keeps the checkpoint's layout is not reloaded but patched in place, only its
   changed elements (``flows.receive.vllm_patch``, found during the prepare); then put the staged
   mirror in place. The receiver's commit record and the lease release follow in a thread once
   the engine serves again (``dcr_wait`` waits for them).

A worker's engine is *known* when its weights' digests (per module, ``vllm_state.module_digests``)
are those recorded after DCR last refitted it and its mirror holds that step; otherwise (first
refit, the engine reloaded or changed behind DCR's back) the refit reloads every tensor. The whole
engine is hashed by the prepare, while it serves; the pause hashes only the modules the apply may
change (the reloaded layers, modules tied to them, the patched ones): before, to check they are
what the prepare saw; after, for the record. The pause's cost follows the change. The price: a
module the apply does not touch, rewritten by someone else between the prepare and the apply, is
caught by the next prepare (the engine is then unknown and reloaded whole), not by this apply.

Failures: anything before the apply leaves the engine untouched. If the reload fails, the same
layers are reloaded with the old step's values from the current mirror (a known engine), or every
weight from the engine's own model path (an engine not yet known); patched elements get their old
values back; and the touched modules' digests must then equal those of the prepare: the engine serves the old step, bit for bit, and a retry
starts over. If even that fails, the error says the engine must be reloaded.

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

import contextlib
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from dcr_core import events
from dcr_core.bits import tensor_from_bits, torch_dtype
from dcr_core.dtypes import DTYPES
from dcr_core.errors import DCRError, StateMismatchError, UsageError
from flows.options import ReceiveOptions
from flows.receive import state_file, vllm_fixups, vllm_layers, vllm_patch, vllm_state
from flows.receive.module import default_mirror_path
from flows.receive.pipeline import Leases, check_arguments
from storage import reader
from storage.catalog import Catalog
from storage.local import journal, state
from storage.local.safetensors import SafetensorsCheckpoint
from storage.reader import RefitPlan
from storage.root import RootRef, open_root

log = logging.getLogger("dcr.receive")

EXTENSION = "flows.receive.vllm_worker.DCRWorkerExtension"


class EngineRefitError(DCRError):
    """A refit of a vLLM engine failed after its weights started changing and could not be undone."""

    exit_code = 5


@dataclass
class _Begun:
    ref: RootRef
    receiver_id: str
    mirror: str
    digests: dict[str, str]  # the engine's module digests, when prepared
    known: bool
    layer_map: vllm_layers.LayerMap | None
    patchable: dict[str, str]  # names that can be patched in place (vllm_patch.candidates)
    lock: contextlib.ExitStack = field(repr=False)


@dataclass
class _Prepared:
    ref: RootRef
    receiver_id: str
    mirror: str
    plan: RefitPlan
    staged: state_file.Staged | None
    reload: list[str] | None  # None: every tensor
    layers: set[str] | None  # the layers those feed (None: all)
    patches: list[vllm_patch.Patch]  # changed elements written in place, not reloaded
    touched: set[str] | None  # the modules the apply may change (None: all): checked and re-hashed in the pause
    changed: int
    known: bool
    digests: dict[str, str]  # the engine's module digests, when prepared
    leases: Leases
    fetch_seconds: float
    lock: contextlib.ExitStack = field(repr=False)
    record: dict = field(default_factory=dict)  # the receiver's commit record, once applied

    @property
    def mode(self) -> str:
        if not self.plan.moves and self.known:
            return "current"
        return "delta" if self.known and self.reload is not None else "full"


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
        begun = self._dcr_begin(RootRef(os.fspath(root), dict(storage_options or {})), receiver_id, state_path)
        if not background:
            self._dcr_prepared = self._dcr_stage(begun, step, opts)
            return self._dcr_summary(self._dcr_prepared)
        def staged() -> _Prepared:
            try:
                p = self._dcr_stage(begun, step, opts)
            except BaseException as e:
                self._dcr_report(begun, report, step, e)
                raise
            self._dcr_report(begun, report, p.plan.target_step, None)
            return p

        self._dcr_start("_dcr_background", "dcr-prepare", staged)
        return {"preparing": True, "receiver": begun.receiver_id}

    def _dcr_report(self, b: _Begun, report: str | None, step: int | None, error: BaseException | None) -> None:
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
            result = self._dcr_do_apply(p)
        except BaseException:
            self._dcr_release(p)
            raise
        def finish() -> None:
            try:
                state_file.record_receiver_commit(p.ref, p.receiver_id, p.plan.target_step, p.record)
            except BaseException as e:  # reported by dcr_wait; the next refit records again
                log.warning("receiver %s: recording its commit of step %s failed (%s: %s); the next refit records it",
                            p.receiver_id, p.plan.target_step, type(e).__name__, e)
                raise
            finally:
                self._dcr_release(p)

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
        self._dcr_release(p)
        return True

    # -- inspection (tests and operators) --------------------------------------------------------

    def dcr_preparing(self) -> bool:
        """Whether a background prepare is still pulling (``dcr_apply`` would wait for it)."""
        bg = getattr(self, "_dcr_background", None)
        return bg is not None and bg[0].is_alive()

    def dcr_status(self) -> dict:
        held = getattr(self, "_dcr_held", None)
        known = bool(held) and held["digests"] == vllm_state.module_digests(self._dcr_model())
        return {"held": self._dcr_public_held(), "known": known, "prepared": getattr(self, "_dcr_prepared", None) is not None}

    def dcr_fingerprint(self) -> str:
        return vllm_state.fingerprint(self._dcr_model())

    def dcr_set_failpoints(self, spec: str = "") -> str:
        """Set this worker process's failpoints (``dcr_core.events``; "" clears them) and restart
        their counts: fault tests of running servers (``/collective_rpc`` in vLLM's dev mode)."""
        events.set_failpoints(spec or None)
        return spec

    def dcr_dump(self, readback: bool = True) -> dict:
        """name -> (dtype, shape, BLAKE3) of everything the engine holds (``vllm_state.dump``)."""
        return vllm_state.dump(self._dcr_model(), readback)

    # -- internals ---------------------------------------------------------------------------------

    def _dcr_public_held(self) -> dict | None:
        held = getattr(self, "_dcr_held", None)
        return None if held is None else {k: v for k, v in held.items() if k != "digests"}

    def _dcr_model(self) -> torch.nn.Module:
        return self.model_runner.model

    def _dcr_receiver(self, receiver_id: str) -> str:
        tp = getattr(getattr(self, "parallel_config", None), "tensor_parallel_size", 1)
        return receiver_id if tp == 1 else f"{receiver_id}-rank{self.rank}"

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

    def _dcr_begin(self, ref: RootRef, receiver_id: str, state_path) -> _Begun:
        """The part of a prepare that reads the model (in the RPC's thread, never beside a forward
        pass): the mirror's lock, the engine's module digests, whether DCR knows the engine, and (if
        so) the layer map for the mirror's schema and the names patchable in place."""
        rid = self._dcr_receiver(receiver_id)
        mirror = state_file.check_path(
            f"{state_path}.rank{self.rank}" if state_path and rid != receiver_id else state_path
            or default_mirror_path(ref.url, rid))
        lock = contextlib.ExitStack()
        lock.enter_context(state.exclusive(mirror))  # one refit per mirror; held until applied or aborted
        try:
            journal.settle(mirror)  # a mirror is never patched in place; a foreign journal is settled
            model = self._dcr_model()
            digests = vllm_state.module_digests(model)  # the whole engine, while it serves (not in the pause)
            held = getattr(self, "_dcr_held", None)
            known = bool(held) and held["root"] == ref.url and held["mirror"] == mirror \
                and held["digests"] == digests and state.peek_step(mirror) == held["step"]
            layer_map, patchable = None, {}
            if known:
                with SafetensorsCheckpoint(mirror) as ck:
                    schema = tuple(sorted((n, i.dtype, tuple(i.shape)) for n, i in ck.infos.items()))
                layer_map, patchable = self._dcr_layer_map(schema)
            return _Begun(ref, rid, mirror, digests, known, layer_map, patchable, lock)
        except BaseException:
            lock.close()
            raise

    def _dcr_stage(self, b: _Begun, step, opts: ReceiveOptions) -> _Prepared:
        """The part of a prepare that only reads the bucket and the mirror (may run in a thread):
        plan, lease, stage the next mirror (verified), and choose what to reload."""
        leases = Leases(b.ref, b.receiver_id, opts.lease_seconds)  # released after the apply (or an abort)
        t0 = time.perf_counter()
        try:
            def stage(p: RefitPlan):
                if not p.moves:
                    return None
                leases.take(p)
                return state_file.stage_refit(p, b.mirror, opts)

            plan, staged = leases.replanned(lambda: state_file.plan_receive(b.ref, b.mirror, step), stage, b.mirror)
            target = reader.manifests(plan)[plan.target_step]
            if staged is None and not b.known:  # the engine is reloaded from the mirror as it is: check it
                state_file.verify_held_state(plan, b.mirror)
            changed = _changed(plan)
            reload = layers = touched = None
            patches: list[vllm_patch.Patch] = []
            schema = tuple(sorted((n, e.dtype, e.shape) for n, e in target.tensors.items()))
            if b.known and b.layer_map is not None and b.layer_map.schema == schema:
                patch, reload = vllm_patch.split(changed, b.patchable, b.layer_map)
                if patch:
                    patches = self._dcr_patches(b, staged, patch)
                    if patches is None:  # a parameter's bytes are not the checkpoint's: reload its layer
                        patches, reload = [], b.layer_map.reload_set(changed)
                if reload is not None:
                    layers = b.layer_map.layers_of(reload)
                    touched = self._dcr_touched(layers, patches)
            return _Prepared(b.ref, b.receiver_id, b.mirror, plan, staged, reload, layers, patches, touched,
                             len(changed), b.known, b.digests, leases, time.perf_counter() - t0, b.lock)
        except BaseException:
            leases.release()
            b.lock.close()
            raise

    def _dcr_layer_map(self, schema: tuple) -> tuple[vllm_layers.LayerMap, dict[str, str]]:
        """The layer map for ``schema`` and the names patchable in place (probed once per schema)."""
        cached = getattr(self, "_dcr_layers", None)
        if cached is None or cached[0].schema != schema:
            layer_map = vllm_layers.probe_layers(self._dcr_model(), schema)
            cached = (layer_map, vllm_patch.candidates(self._dcr_model(), layer_map))
            self._dcr_layers = cached
        return cached

    def _dcr_patches(self, b: _Begun, staged, names: list[str]) -> list[vllm_patch.Patch] | None:
        """The in-place patches of ``names``: the held step's bits from the mirror, the target's from
        the staged mirror (reads the model; writes nothing)."""
        def reader_of(ck: SafetensorsCheckpoint):
            return lambda n: tensor_from_bits(ck.bits(n), DTYPES[ck.infos[n].dtype], tuple(ck.infos[n].shape))

        with SafetensorsCheckpoint(b.mirror) as held, SafetensorsCheckpoint(staged.path) as target:
            return vllm_patch.prepare(self._dcr_model(), b.patchable, names, reader_of(held), reader_of(target))

    def _dcr_touched(self, layers: set[str], patches: list[vllm_patch.Patch]) -> set[str]:
        """Every module an apply reloading ``layers`` and writing ``patches`` may change: the layers
        and their submodules, modules tied to them (``vllm_fixups.after_reload`` processes those) and
        the patched modules."""
        model = self._dcr_model()
        out = {pt.module for pt in patches} | {name for name, _ in vllm_layers.tied_followers(model, layers)}
        for name, _ in model.named_modules():
            parts = name.split(".")
            if any(".".join(parts[:i]) in layers for i in range(1, len(parts) + 1)):
                out.add(name)
        return out

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

    def _dcr_take_prepared(self) -> _Prepared:
        self.dcr_prepared_step()
        p = getattr(self, "_dcr_prepared", None)
        self._dcr_prepared = None
        if p is None:
            raise UsageError("nothing prepared: call dcr_prepare first")
        return p

    def _dcr_release(self, p: _Prepared) -> None:
        try:
            if p.staged is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p.staged.path)
            p.leases.release()
        finally:
            p.lock.close()

    def _dcr_summary(self, p: _Prepared) -> dict:
        return {"receiver": p.receiver_id, "from_step": p.plan.current_step, "to_step": p.plan.target_step,
                "mode": p.mode, "moves": p.plan.describe(), "changed_tensors": p.changed,
                "bytes_pulled": p.staged.bytes_pulled if p.staged else 0, "fetch_seconds": p.fetch_seconds}

    def _dcr_do_apply(self, p: _Prepared) -> dict:
        """The pause window. Only the modules the apply may change (``p.touched``) are hashed here:
        before, to check they are what prepare saw; after, for the held record. The rest of the
        engine was hashed by prepare, while it served."""
        t_apply = time.perf_counter()
        model = self._dcr_model()
        out = self._dcr_summary(p)
        target = reader.manifests(p.plan)[p.plan.target_step]
        if p.mode == "current":
            p.record = {"from_step": p.plan.current_step, "moves": [], "bytes_pulled": 0,
                        "policy_digest": target.policy_digest}
            return {**out, "pause_seconds": 0.0, "reload_seconds": 0.0, "reloaded_tensors": 0, "patched_tensors": 0,
                    "patched_elements": 0, "check_seconds": 0.0, "digest_seconds": 0.0, "hashed_modules": 0}
        if not _same(vllm_state.module_digests(model, p.touched), p.digests, p.touched):
            raise StateMismatchError("the engine's weights changed since dcr_prepare (reloaded outside DCR?); "
                                     "nothing was applied: prepare again")
        check_s = time.perf_counter() - t_apply
        names = sorted(target.tensors) if p.reload is None else p.reload
        source = p.staged.path if p.staged else p.mirror
        t0 = time.perf_counter()
        patched = 0
        try:
            patched = vllm_patch.apply(p.patches)
            if names or not p.patches:
                self._dcr_reload(source, target, names, p.layers)
        except BaseException as e:
            vllm_patch.undo(p.patches)
            self._dcr_roll_back(p, names, e)
            raise
        reload_s = time.perf_counter() - t0
        self._dcr_held = None  # unknown until the mirror is in place
        if p.staged is not None:
            state_file.install_state(p.staged)
            p.staged = None
        t1 = time.perf_counter()
        after = vllm_state.module_digests(model, p.touched)
        digests = after if p.touched is None else {**{k: v for k, v in p.digests.items() if k not in p.touched}, **after}
        digest_s = time.perf_counter() - t1
        self._dcr_held = {"root": p.ref.url, "step": p.plan.target_step, "policy_digest": target.policy_digest,
                          "mirror": p.mirror, "fingerprint": vllm_state.combine(digests), "digests": digests}
        pause = time.perf_counter() - t_apply  # the engine serves nothing while this RPC runs
        events.reached("receive.engine-reloaded", step=p.plan.target_step)
        timing = {"pause_seconds": pause, "reload_seconds": reload_s, "check_seconds": check_s,
                  "digest_seconds": digest_s, "reloaded_tensors": len(names), "patched_tensors": len(p.patches),
                  "patched_elements": patched, "hashed_modules": len(after)}
        p.record = {"from_step": p.plan.current_step, "moves": p.plan.describe(), "bytes_pulled": out["bytes_pulled"],
                    "policy_digest": target.policy_digest, "engine": "vllm", "mode": p.mode, **timing}
        return {**out, **timing}

    def _dcr_reload(self, path: str | None, manifest, names: list[str], layers: set[str] | None) -> None:
        """vLLM's in-place reload of ``names`` read from the state file at ``path`` (None: every
        weight from the engine's own model path), with the fixes of ``flows.receive.vllm_fixups``."""
        model = self._dcr_model()
        vllm_fixups.before_reload(model, layers)
        if path is None:
            self.reload_weights()  # vLLM reloads from model_config.model, where the engine was loaded from
        else:
            with SafetensorsCheckpoint(path) as ck:
                def weights() -> Iterator[tuple[str, torch.Tensor]]:
                    for n in names:
                        e = manifest.tensors[n]
                        t = _mapped(ck.mapped_bits(n), DTYPES[e.dtype], e.shape)
                        events.reached("receive.engine-tensor", name=n)
                        yield n, t

                self.reload_weights(weights_iterator=weights())
        with set_vllm_config(self):
            vllm_fixups.after_reload(model, layers)

    def _dcr_roll_back(self, p: _Prepared, names: list[str], error: BaseException) -> None:
        """Bring the engine back to the bits it had when prepared, or say it could not be."""
        model = self._dcr_model()
        how = "the old step's tensors from the mirror" if p.known else "the engine's own checkpoint"
        try:
            with set_vllm_config(self):
                vllm_fixups.abandon_reload(model, self.model_config)  # a cut-off reload leaves layers half loaded
            if p.known:
                old = reader.manifests(p.plan)[p.plan.current_step]
                if names:
                    self._dcr_reload(p.mirror, old, names, p.layers)
            else:
                self._dcr_reload(None, None, [], None)
            restored = _same(vllm_state.module_digests(model, p.touched), p.digests, p.touched)
        except BaseException as undo:  # noqa: BLE001 - reported with the original error
            self._dcr_held = None
            raise EngineRefitError(
                f"reloading step {p.plan.target_step} failed ({type(error).__name__}: {error}) and reloading "
                f"{how} failed too ({type(undo).__name__}: {undo}); the engine must be reloaded") from error
        if not restored:
            self._dcr_held = None
            raise EngineRefitError(
                f"reloading step {p.plan.target_step} failed ({type(error).__name__}: {error}); reloading {how} "
                "did not give back the engine's weights; the engine must be reloaded") from error
        log.warning("reloading step %s failed (%s: %s); the engine is back at its previous weights",
                    p.plan.target_step, type(error).__name__, error)


def set_vllm_config(worker):
    """vLLM's loaders read the current config; its worker methods set it (``set_current_vllm_config``)."""
    from vllm.config import set_current_vllm_config  # noqa: PLC0415 - in a vLLM worker

    return set_current_vllm_config(worker.vllm_config)


def _mapped(bits, dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A read-only tensor over the staged mirror's pages (a memory map: no copy, no fresh pages to
    fault in; vLLM's loaders copy out of it, as they copy out of a safetensors file they map)."""
    if not bits.size:
        return tensor_from_bits(bits, dtype, shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": the loaders only read it
        u8 = torch.from_numpy(bits.view(np.uint8))
    return u8.view(torch_dtype(dtype)).reshape(shape)


def _same(now: dict[str, str], prepared: dict[str, str], touched: set[str] | None) -> bool:
    """Whether the digests of ``touched`` (None: every module) taken now equal those of prepare."""
    return now == (prepared if touched is None else {k: v for k, v in prepared.items() if k in touched})


def _changed(plan: RefitPlan) -> list[str]:
    """Names any move of the plan stores chunks of (all names for a keyframe)."""
    ms = reader.manifests(plan)
    out: set[str] = set()
    for move in plan.moves:
        out.update(n for n, e in ms[move.step].tensors.items() if e.n_stored)
    return sorted(out)
