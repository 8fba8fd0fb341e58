"""One worker of an inference engine as a receiver, whatever the engine: the two phases of a refit,
their threads, and what DCR keeps between refits.

An engine plugs in by an ``EngineModel`` (``flows.receive.engine_model``: its model, its
tensor-parallel place, its own in-place reload); vLLM's adapters are the worker extension
(``flows.receive.vllm_worker``) and the weight-transfer backend (``flows.receive.vllm_transfer``).
A refit is two phases:

1. ``prepare`` (the engine keeps serving; ``prepare_in_background`` runs it in a thread): lock the
   worker's mirror, digest the engine, plan, lease, stage and verify the next step, and choose
   what to reload or patch (``flows.receive.engine_prepare``). Nothing in the engine changes.
2. ``apply`` (the pause window): check and write the touched modules through the engine's own
   reload, or in place, install the staged mirror (``flows.receive.engine_apply``). Once the
   engine serves again, a thread settles what the pause left (``engine_apply.settle``: the
   touched modules' digests, the mirror's directory synced), and ``record`` then writes the
   receiver's commit and releases the leases in another (``wait`` waits for both; so does the
   next prepare).

A worker's engine is *known* when its module digests (``flows.receive.held_digests``, the check a
live torch module receiver makes too) are those recorded after DCR last refitted it and its mirror
holds that step; otherwise (first refit, the engine reloaded or changed behind DCR's back) the
refit reloads every tensor. Anything before the apply leaves the engine untouched; a failed reload
is rolled back to the old step's bits, or ``EngineRefitError`` says the engine must be reloaded.
With tensor parallelism each rank is its own receiver (``<id>-rank<r>``), with its own mirror.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from dcr_core.errors import UsageError
from flows.receive import engine_apply, engine_prepare, held_digests, live_tensors, state_file
from flows.receive.engine_model import EngineModel, EngineState
from flows.receive.engine_prepare import Begun, Prepared
from flows.receive.receiver import Binding, Receiver
from flows.receive.records import WorkerPrepared, WorkerResult
from flows.results import ReceiveResult
from storage.catalog import Catalog
from storage.root import open_root

log = logging.getLogger("dcr.receive")

_Job = tuple[threading.Thread, dict[str, Any]]


class EngineReceiver(Receiver):
    """One engine worker (one tensor-parallel rank) as a receiver (see the module docstring)."""

    def __init__(self, engine: EngineModel):
        super().__init__(f"{engine.kind} worker")  # its rank is asked when a refit needs it (TP groups start late)
        self.engine = engine
        self.known = EngineState()
        self.last: WorkerResult | None = None  # the last apply's result
        self._prepared: Prepared | None = None
        self._applied: Prepared | None = None  # applied, its record not yet started
        self._background: _Job | None = None  # a prepare in a thread
        self._settling: _Job | None = None  # the last apply's digests (engine_apply.settle), in a thread
        self._finishing: _Job | None = None  # the last apply's record, in a thread

    # -- the lifecycle ---------------------------------------------------------------------------

    def bind(self, binding: Binding) -> None:
        """Bind to a ROOT; what an earlier binding prepared is dropped first (once the binding is
        admitted: a fleet coordinator that lost its lease drops nothing)."""
        if binding.options.in_place:
            raise UsageError("an engine worker's mirror is staged whole (in_place=False): the old one is its undo")
        self.admit(binding)
        self.abort()
        super().bind(binding)

    def version(self) -> int | None:
        held = self.known.held
        return None if held is None else held["step"]

    def stage(self, step: int | None) -> None:
        self._prepared = engine_prepare.stage(self.engine, self._begin(), step, self.binding.options)

    def prepare_in_background(self, step: int | None, report: str | None = None) -> dict:
        """``prepare`` in a thread (``apply`` waits for it; the engine serves meanwhile). ``report``:
        an id written with the outcome to the receiver's ``prepared/<id>.json`` in ROOT when the
        thread is done, so that a coordinator knows without calling into the engine (a call would
        wait in its engine loop)."""
        self.admit(self.binding)
        begun = self._begin()  # here, not in the thread: it runs the engine's kernels (the rest is read there)

        def staged() -> Prepared:
            held = None
            try:
                engine_prepare.digest(self.engine, begun)
                held = self.version() if begun.known else None  # what the engine holds, as DCR knows it
                p = engine_prepare.stage(self.engine, begun, step, self.binding.options)
            except BaseException as e:
                self._report(begun, report, step, held, e)
                raise
            self._report(begun, report, p.plan.target_step, held, None, p.staged.bytes_pulled if p.staged else 0)
            return p

        self._background = _start("dcr-prepare", staged)
        return {"preparing": True, "receiver": begun.receiver_id}

    def install(self, step: int | None) -> None:
        """The pause window: apply the prepared step (``step``, if another: prepared first, in the
        pause); its record follows (``record``)."""
        if step is not None and self.prepared_step() != step:
            self.abort()
            self.stage(step)
        p = self._take_prepared()
        try:
            self.last = engine_apply.apply(self.engine, self.known, p)
        except BaseException:
            engine_prepare.release(p)
            raise
        self._applied = p
        if p.after is not None:
            self._settling = _start("dcr-settle", p.after)

    def record(self) -> None:
        """Write the receiver's commit record and release the leases in a thread (object-store
        writes, after the engine serves again); ``wait`` waits for them, and so does the next prepare."""
        p, self._applied = self._applied, None
        if p is None or p.record is None:
            return
        record = p.record

        settling = self._settling

        def finish() -> None:
            try:
                if settling is not None:
                    settling[0].join()  # the mirror's directory synced before the record says so
                    if "error" in settling[1]:
                        raise settling[1]["error"]
                state_file.record_receiver_commit(p.ref, p.receiver_id, p.plan.target_step, record)
            except BaseException as e:  # reported by wait(); the next refit records again
                log.warning("receiver %s: recording its commit of step %s failed (%s: %s); the next refit records it",
                            p.receiver_id, p.plan.target_step, type(e).__name__, e)
                raise
            finally:
                engine_prepare.release(p)

        self._finishing = _start("dcr-record", finish)

    def release(self) -> None:
        self.abort()

    def abort(self) -> bool:
        """Drop a prepared refit (its staged mirror and leases); True if there was one."""
        self._settled()
        _join(self, "_finishing")  # the last refit's record: done before anything else locks the mirror
        staged = _join(self, "_background")
        if staged is not None and "result" in staged:
            self._prepared = staged["result"]
        p, self._prepared = self._prepared, None
        if p is None:
            return False
        engine_prepare.release(p)
        return True

    def result(self) -> ReceiveResult:
        if self.last is None:
            raise UsageError(f"{self.name}: no refit applied yet")
        r = self.last.model_dump()
        return ReceiveResult(r.pop("to_step"), r.pop("from_step"), r.pop("moves"), r.pop("bytes_pulled"),
                             r.pop("policy_digest"), {}, r)

    # -- waiting and inspection ------------------------------------------------------------------

    def prepared_step(self) -> int | None:
        """Wait for a background prepare (if any) and return the step prepared (None: nothing is);
        raise what the prepare failed with (the engine is untouched then)."""
        staged = _join(self, "_background")
        if staged is not None:
            if "error" in staged:
                raise staged["error"]
            self._prepared = staged["result"]
        return None if self._prepared is None else self._prepared.plan.target_step

    def prepared(self) -> WorkerPrepared:
        """What the (waited for) prepare staged."""
        self.prepared_step()
        if self._prepared is None:
            raise UsageError("nothing prepared: call dcr_prepare first")
        return engine_prepare.summary(self._prepared)

    def wait(self) -> dict | None:
        """Wait for the work a refit left in the background (a prepare, the commit record); raise
        what the record failed with. Returns what DCR knows the engine holds (``public_held``)."""
        self._settled()
        done = _join(self, "_finishing")
        if done is not None and "error" in done:
            raise done["error"]
        if self._background is not None:  # waited for, kept for apply
            self._background[0].join()
        return self.public_held()

    def preparing(self) -> bool:
        """Whether a background prepare is still pulling (``apply`` would wait for it)."""
        return self._background is not None and self._background[0].is_alive()

    def public_held(self) -> dict | None:
        held = self.known.held
        return None if held is None else {k: v for k, v in held.items() if k != "digests"}

    def status(self) -> dict:
        """What DCR knows the engine holds, checked against every module (kernels read back: the
        engine's thread only); completes the last apply's record (``engine_prepare.complete_record``)."""
        self._settled()
        probes = held_digests.probes_of(self.engine.model)
        engine_prepare.complete_record(self.known, self.engine.model, probes)
        held = self.known.held
        known = held is not None and held["digests"] is not None \
            and held_digests.digests_of(self.engine.model, probes=probes) == held["digests"]
        return {"held": self.public_held(), "known": known, "prepared": self._prepared is not None}

    def fingerprint(self) -> str:
        return held_digests.fingerprint(self.engine.model)

    def dump(self, readback: bool = True) -> dict:
        """name -> (dtype, shape, BLAKE3) of everything the engine holds (``live_tensors.dump``)."""
        return live_tensors.dump(self.engine.model, readback)

    # -- internals ---------------------------------------------------------------------------------

    def _settled(self) -> None:
        """Wait for the last apply's digests (``engine_apply.settle``); one that failed left the
        engine unknown (its error is logged: the next refit reloads the engine whole)."""
        done = _join(self, "_settling")
        if done is not None and "error" in done:
            e = done["error"]
            log.warning("%s: the digests after the last refit failed (%s: %s); the next refit reloads the engine whole",
                        self.name, type(e).__name__, e)

    def _begin(self) -> Begun:
        self._settled()  # what DCR knows the engine holds: the last apply's digests
        b = self.binding
        return engine_prepare.begin(self.engine, self.known, b.root, b.receiver_id, b.mirror)

    def _take_prepared(self) -> Prepared:
        self.prepared_step()
        p, self._prepared = self._prepared, None
        if p is None:
            raise UsageError("nothing prepared: call dcr_prepare first")
        return p

    def _report(self, b: Begun, report: str | None, step: int | None, held: int | None,
                error: BaseException | None, pulled: int | None = None) -> None:
        """Write the outcome of a background prepare to ``prepared/<receiver>.json`` (if asked for),
        with the step the engine held when it began (``held``: None when DCR does not know it, as
        after a restart: a coordinator believes an engine's version only if it agrees) and the
        bytes it pulled (``bytes_pulled``, when it succeeded); a failure to write it is logged (the
        coordinator then learns it from the start call)."""
        if report is None:
            return
        doc = {"prepare_id": report, "step": -1 if step is None else step, "ok": error is None, "held": held,
               "ranks": self.engine.ranks, **({} if error is None else {"error": f"{type(error).__name__}: {error}"}),
               **({} if pulled is None else {"bytes_pulled": pulled})}
        try:
            Catalog(open_root(b.ref)).record_prepared(b.receiver_id, doc)
        except Exception as e:  # noqa: BLE001 - advisory
            log.warning("receiver %s: could not record its prepare (%s: %s)", b.receiver_id, type(e).__name__, e)


def _start(name: str, fn: Callable[[], Any]) -> _Job:
    """Run ``fn`` in a thread; its result or error lands in the box ``_join`` returns."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to whoever joins
            box["error"] = e

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, box


def _join(receiver: EngineReceiver, attr: str) -> dict[str, Any] | None:
    """Wait for the thread kept as ``attr`` (if any), forget it, and return its box."""
    job = getattr(receiver, attr)
    if job is None:
        return None
    job[0].join()
    setattr(receiver, attr, None)
    return job[1]
