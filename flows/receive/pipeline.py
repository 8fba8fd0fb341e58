"""The receiver's pipelines: the order of its steps, written once, run in-process or as Prefect tasks.

- a state file (``run_receive``; the receiver kind ``StateFile``, whose lifecycle runs the steps of
  ``StateSteps``): under the state's lock (one writer per file; a cut-off in-place patch settled
  first), plan, then stage the refit and install it (or verify the held state when there is
  nothing to apply), then record the receiver's commit;
- ``run_materialize``: the same into a fresh file, with no receiver record.
With a runner that maps (``flows.workers``), a refit that rewrites the file is staged by tasks
mapped over groups of tensors on its workers (``flows.receive.on_workers``).
A live module's pipeline is ``flows.receive.module_pipeline`` (it needs torch; this one does not).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from dcr_core import events
from dcr_core.errors import IntegrityError, StateMismatchError, StepVanishedError, UsageError
from flows.options import ReceiveOptions
from flows.receive import exact as exact_files
from flows.receive import on_workers, state_file
from flows.receive.receiver import Binding, Receiver, check_arguments, fenced
from flows.receive.records import ReceiverCommit
from flows.receive.state_file import Staged
from flows.results import ReceiveResult
from flows.steps import InProcess, Runner, Step, StepTable
from flows.workers import portable_root
from storage import heartbeat, reader
from storage.catalog import Catalog
from storage.local import dir_swap, fleet_epochs, journal, materialized, sidecar, state
from storage.reader import RefitPlan, manifests
from storage.root import RootRef, open_root
from storage.source_layout import DIRECTORY

log = logging.getLogger("dcr.receive")
T = TypeVar("T")

class StateSteps(StepTable):
    """A state file's steps, in order."""

    plan_receive = Step(state_file.plan_receive)
    take_leases = Step(state_file.take_leases)
    stage_refit = Step(state_file.stage_refit)
    # on workers (flows.receive.on_workers): a file reserved, then its groups of tensors written (mapped)
    reserve_file = Step(on_workers.reserve_file)
    rewrite_group = Step(on_workers.rewrite_group)
    install_state = Step(state_file.install_state)
    verify_held_state = Step(state_file.verify_held_state)  # instead of the install: nothing to apply
    record_receiver_commit = Step(state_file.record_receiver_commit)
    release_leases = Step(state_file.release_leases)


MAX_REPLANS = 3  # a step deleted under a refit (gc): plan again, this many times at most


def with_replans(plan: Callable[[], RefitPlan], run: Callable[[RefitPlan], T], undo: Callable[[], None],
                 where: str) -> tuple[RefitPlan, T]:
    """``plan()``, then ``run(plan)``; when a step the plan reads was deleted meanwhile (gc), ``undo()``
    (release what ``run`` leased) and plan again, ``MAX_REPLANS`` times at most. Both receive
    pipelines (state file and live module) refit through this one loop."""
    for attempt in range(1, MAX_REPLANS + 1):
        p = plan()
        try:
            return p, run(p)
        except (StepVanishedError, IntegrityError) as e:
            undo()
            if attempt == MAX_REPLANS or not (isinstance(e, StepVanishedError) or state_file.vanished(p)):
                raise
            log.warning("%s: a step of the refit was deleted meanwhile (gc); planning again", where)
    raise AssertionError("unreachable")


@dataclass
class Leases:
    """The steps a refit has leased (gc keeps them while it reads): taken for each plan, dropped
    before a replan, released when the refit ends, whether it succeeded or failed (a ``with``
    block, or ``release()`` by whoever ends it later: a vLLM worker after its apply). Every receiver
    (state file, live module, vLLM worker, fleet member) leases through this one class;
    ``take``/``drop`` are the pipeline's steps (Prefect tasks under a flow)."""

    root: RootRef
    receiver_id: str
    ttl: float
    take_fn: Callable = state_file.take_leases
    drop_fn: Callable = state_file.release_leases
    steps: list[int] = field(default_factory=list)

    def take(self, plan: RefitPlan) -> None:
        self.release()
        self.steps = list(self.take_fn(self.root, self.receiver_id, plan, self.ttl))

    def release(self) -> None:
        steps, self.steps = self.steps, []
        if steps:
            self.drop_fn(self.root, self.receiver_id, steps)

    def replanned(self, plan: Callable[[], RefitPlan], run: Callable[[RefitPlan], T], where: str) -> tuple[RefitPlan, T]:
        """``with_replans`` with these leases dropped before each replan."""
        return with_replans(plan, run, self.release, where)

    def __enter__(self) -> Leases:
        return self

    def __exit__(self, *exc) -> None:
        self.release()  # also when the refit failed: leases only ever protect reads in progress


def stage_on_workers(tasks: StateSteps, plan: RefitPlan, state_path: str, options: ReceiveOptions,
                     root_url: str | None = None, exact: str | None = None) -> Staged:
    """Stage the refit as a new file written by ``rewrite-group`` tasks on the runner's workers
    (``flows.receive.on_workers``; ``exact``: the published files of a materialization); a
    ``state_file.Staged`` for ``install_state``. The temp files are removed on any failure."""
    reserved = tasks.reserve_file(plan, state_path, root_url, exact)
    try:
        groups = on_workers.groups_of(plan, tasks.slots, options.group_bytes)
        parts = tasks.map(on_workers.rewrite_group, [{"group": g} for g in groups], plan=plan, reserved=reserved,
                          io_workers=options.io_workers)
        target = manifests(plan)[plan.target_step]
        expected = sum(e.nbytes for e in target.tensors.values())
        if sum(p["bytes_written"] for p in parts) != expected:  # every tensor written, once: no hole of zeros
            raise IntegrityError(f"{state_path}: the groups wrote {sum(p['bytes_written'] for p in parts)} of "
                                 f"{expected} bytes; nothing installed")
    except BaseException:
        for tmp in reserved.temp_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        if exact == DIRECTORY:
            dir_swap.discard(state_path)  # the new directory they were in
        raise
    events.reached("receive.staged", path=reserved.tmp)
    pulled = sum(p["bytes_pulled"] for p in parts)
    if exact is not None:
        return Staged(state_path, reserved.tmp, False, pulled, exact=exact, moves=reserved.moves,
                      about=exact_files.about(plan))
    return Staged(state_path, reserved.tmp, False, pulled)


def clear_for_rewrite(state_path: str) -> None:
    """Before a file is rewritten whole (under its lock): a pending in-place patch settled (so a
    failed rewrite leaves one whole step), then its journal and block digests removed."""
    with contextlib.suppress(StateMismatchError):  # a damaged or foreign journal: moot here
        journal.settle(state_path)
    journal.remove(state_path)
    sidecar.remove(state_path)


class StateFile(Receiver):
    """A DCR state file (what ``dcr receive --state PATH`` keeps; ``state:PATH`` in a fleet) as a
    receiver. Its lifecycle: under the file's lock (one writer per file, leftovers of a killed one
    removed; a cut-off in-place patch settled first), plan and lease, stage the refit beside the
    file without touching it (or, with nothing to apply, verify the held state); apply installs it
    (one atomic rename, or the journal put in force); record writes the receiver's commit; release
    drops the leases, the lock, and a staged refit never applied. Nothing to pause: a reader sees
    one whole step or the next. Its version is the step its header says.

    Under a fleet coordinator's epoch, the file refuses an older epoch than one it has seen
    (``fence``: kept beside the file, under its lock).

    ``fresh``, ``exact`` and ``record=False`` are ``run_materialize``'s: a fresh output, the step's
    published files byte for byte, no receiver record. Under a fleet (a binding's ``coordinator``)
    the record says ``mode: "fleet"``, and a failure to write it is logged, not raised: the file
    holds the step, and the next refit records it. ``lock_timeout``: how long a refit waits for the
    file's lock (None: as long as it takes; a fleet member waits the fleet's ``--timeout``)."""

    def __init__(self, path: str | os.PathLike, runner: Runner | None = None, *, fresh: bool = False,
                 exact: str | None = None, record: bool = True, lock_timeout: float | None = None):
        if exact is not None and (record or not fresh):
            raise UsageError("an exact materialization writes a fresh output and records no receiver")
        super().__init__(os.fspath(path))
        self.given, self.fresh, self.exact, self.recording = os.fspath(path), fresh, exact, record
        self.lock_timeout = lock_timeout
        self.tasks = StateSteps(runner or InProcess())
        self._lock: contextlib.ExitStack | None = None
        self._leases: Leases | None = None
        self._plan: RefitPlan | None = None
        self._staged: Staged | None = None
        self._installing = False
        self._pulled = 0

    @classmethod
    def from_url(cls, url: str, timeout: float | None = None, **how) -> StateFile:
        return cls(url[len("state:"):], lock_timeout=timeout)

    @classmethod
    def from_target(cls, target, runner: Runner | None = None, **how) -> StateFile:
        return cls(target, runner)

    @classmethod
    def canonical(cls, url: str) -> tuple[str, str]:
        path = url[len("state:"):]
        if not path:
            raise UsageError(f"{url!r}: a state file member is state:PATH")
        path = os.path.abspath(path)  # the same file from any directory
        return f"state:{path}", f"state-{os.path.basename(path)}"

    @property
    def path(self) -> str:
        """The file the state path names (a link's target; checked: a regular file or none, in an existing directory)."""
        if self.exact == DIRECTORY:
            return exact_files.check_directory(self.given)
        return state_file.check_path(self.given)

    @property
    def identity(self) -> str:
        return f"state:{self.path}"  # the real path: a link and its target are one file, one lock

    def hold(self, timeout: float | None = None) -> None:
        if self._lock is None:
            lock = contextlib.ExitStack()
            lock.enter_context(state.exclusive(self.path, timeout=timeout))
            self._lock = lock  # held until release

    def fence(self, fleet: str, epoch: int) -> None:
        """The fleet epochs this file has seen are kept beside it (``storage.local.fleet_epochs``):
        checked, and raised under the file's lock (a coordinator's look before it holds the file
        only checks), so a coordinator that lost its lease cannot move the file from any process."""
        path = self.path
        newer = fenced(fleet_epochs.read(path), fleet, epoch)
        if newer is not None and self._lock is not None:
            fleet_epochs.write(path, newer)

    def seen_fleets(self) -> dict[str, int]:
        return fleet_epochs.read(self.path)

    def version(self) -> int | None:
        path = self.path
        return state.peek_step(path) if os.path.exists(path) else None

    def stage(self, step: int | None) -> None:
        b, tasks = self.binding, self.tasks
        self._drop_staged()  # a lock already held (``hold``) stays held
        ref, options = b.root, b.options
        if options.max_staleness is not None:  # before anything is read or written: a stale ROOT changes nothing
            r = open_root(ref)
            heartbeat.check_fresh(r, options.max_staleness, Catalog(r).key)
        path = self.path
        mapped = tasks.mapped and not options.in_place  # an in-place patch runs here (see flows.receive.on_workers)
        named = state.absolute_root(ref.url)  # what the state's header records, as in one process (workers' cwd differs)
        if mapped:
            ref, path = portable_root(ref), os.path.abspath(path)
        try:
            self.hold(self.lock_timeout)
            self.admit(b)  # again under the lock: a fleet's epoch checked and kept atomically
            self._settle(path)
            leases = self._leases = Leases(ref, b.receiver_id, options.lease_seconds, tasks.take_leases,
                                           tasks.release_leases)

            def staged(p: RefitPlan) -> Staged | None:
                if self.recording:
                    leases.take(p)
                if not p.moves:
                    return None
                if mapped:
                    return stage_on_workers(tasks, p, path, options, named, self.exact)
                return tasks.stage_refit(p, path, options, self.exact)

            self._plan, self._staged = leases.replanned(lambda: tasks.plan_receive(ref, path, step, self.fresh),
                                                        staged, path)
            if self._staged is None:  # nothing to apply: the file must hold the step it claims
                tasks.verify_held_state(self._plan, path)
        except BaseException:
            self.release()
            raise

    def _settle(self, path: str) -> None:
        """What a killed writer left, settled under the lock before anything is planned."""
        if self.exact == DIRECTORY:  # a swap a kill cut off: finished (after its journal) or undone (before)
            materialized.settle(path)
        if self.fresh:  # rewritten whole; still settle a patch first, so a failed rewrite leaves a whole step
            clear_for_rewrite(path)
            return
        cut_off = os.path.exists(journal.journal_path(path))  # a committed patch rolled forward, a cut-off one back
        if journal.settle(path) is not None and cut_off:
            log.warning("%s: rolled back an interrupted in-place refit", path)
            sidecar.remove(path)  # its stamp already fails (the roll back wrote); hash it all next time

    def install(self, step: int | None) -> None:
        if step is not None and (self._lock is None or self._plan is None or self._plan.target_step != step):
            self.stage(step)  # a step other than the one prepared (a fleet taking a member back): prepared now
        if self._lock is None or self._plan is None:
            raise UsageError(f"{self.name}: nothing prepared: prepare first")
        staged, self._pulled = self._staged, 0
        if staged is not None:
            self._installing = True
            self.tasks.install_state(staged)
            self._pulled = staged.bytes_pulled

    def record(self) -> None:
        b, p = self.binding, self._plan
        if not self.recording or p is None:
            return
        fleet = {"mode": "fleet"} if b.coordinator is not None else {}
        rec = ReceiverCommit(from_step=p.current_step, moves=p.describe(), bytes_pulled=self._pulled,
                             policy_digest=manifests(p)[p.target_step].policy_digest, **fleet)
        try:
            self.tasks.record_receiver_commit(b.root, b.receiver_id, p.target_step, rec)
        except Exception as e:
            if b.coordinator is None:
                raise
            log.warning("receiver %s: recording its commit of step %s failed (%s: %s)", b.receiver_id,
                        p.target_step, type(e).__name__, e)  # the file holds the step; the next refit records it

    def release(self) -> None:
        try:
            self._drop_staged()
        finally:
            lock, self._lock = self._lock, None
            if lock is not None:
                lock.close()

    def _drop_staged(self) -> None:
        """The leases let go, and a refit staged but never applied removed (the lock stays)."""
        staged, self._staged = self._staged, None
        try:
            if staged is not None and not self._installing:  # staged, never applied (a fleet's "nobody switches")
                for tmp in [tmp for tmp, _ in staged.moves] or [staged.path]:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)
            if self._leases is not None:
                self._leases.release()
        finally:
            self._leases, self._installing = None, False

    def result(self) -> ReceiveResult:
        p = self._plan
        if p is None:
            raise UsageError(f"{self.name}: no refit recorded")
        return ReceiveResult(p.target_step, p.current_step, p.describe(), self._pulled,
                             manifests(p)[p.target_step].policy_digest, dict(self.tasks.timings))


def run_receive(
    root: str | os.PathLike, receiver_id: str, state_path: str | os.PathLike, step: int | None = None,
    storage_options: dict | None = None, options: ReceiveOptions | None = None, runner: Runner | None = None,
    record: bool = True, fresh: bool = False, exact: str | None = None,
) -> ReceiveResult:
    """Bring the state file at ``state_path`` to ``step`` (default: latest) and record the commit.
    ``exact`` (``run_materialize``, with ``fresh``): write the step's published file ("file") or
    directory ("directory") byte for byte instead of a state file."""
    options = check_arguments(receiver_id if record else None, step, options)
    receiver = StateFile(state_path, runner, fresh=fresh, exact=exact, record=record)
    receiver.bind(Binding(RootRef(os.fspath(root), dict(storage_options or {})), receiver_id, options))
    return receiver.refit(step)


def run_materialize(
    root: str | os.PathLike, step: int | None, out: str | os.PathLike, storage_options: dict | None = None,
    options: ReceiveOptions | None = None, runner: Runner | None = None, force: bool = False,
) -> ReceiveResult:
    """Write the full checkpoint of a committed step to ``out`` (no receiver record); with a runner
    that maps, as groups of tensors on its workers.

    A step published from a safetensors file is written byte for byte as that file (its SHA-256 is
    the published file's); one published from a sharded directory, as its files (same names, same
    index) inside the directory ``out``, unless ``out`` names a ``.safetensors`` file. Otherwise
    (published from tensors or shards, or ``options.as_state``) ``out`` is a file in DCR's state
    format: the step's tensors, with ``dcr.*`` metadata (``storage.local.state``).

    An existing ``out`` is replaced only when DCR wrote it (a receiver state or a materialization:
    its header names a step, or its record beside it vouches for it: ``storage.local.materialized``),
    or with ``force``: ``--out`` pointed at a trainer's checkpoint by mistake must not lose it."""
    options = check_arguments(None, step, options)
    ref = RootRef(os.fspath(root), dict(storage_options or {}))
    if getattr(runner, "mapped", False):
        portable_root(ref)  # refused before anything is read: workers could not reach it
    cat = Catalog(open_root(ref))
    step = reader.resolve_target(cat, step)  # fixed now: what is written depends on how the step was published
    source = cat.manifest(step).source
    kind = exact_files.output_kind(os.fspath(out), None if source is None else source.kind, options.as_state)
    target = exact_files.check_directory(out) if kind == DIRECTORY else state_file.check_path(out)
    theirs = materialized.foreign(target, kind == DIRECTORY)
    if theirs and not force:
        what = os.fspath(out) if theirs == [target] else f"{os.fspath(out)}: {os.path.basename(theirs[0])}"
        raise UsageError(f"{what}: exists and was not written by dcr materialize or dcr receive (a trainer's "
                         "checkpoint?); choose another --out, or pass --force to replace it")
    return run_receive(ref.url, "materialize", out, step, ref.storage_options, options, runner, record=False,
                       fresh=True, exact=kind)
