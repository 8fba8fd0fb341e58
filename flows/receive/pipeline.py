"""The receiver's pipelines: the order of its steps, written once, run in-process or as Prefect tasks.

- a state file (``run_receive``): under the state's lock (one writer per file; a cut-off in-place
  patch settled first), plan, then stage the refit and install it (or verify the held state
  when there is nothing to apply), then record the receiver's commit;
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

from dcr_core.errors import IntegrityError, StateMismatchError, StepVanishedError, UsageError
from flows.options import ReceiveOptions
from flows.receive import exact as exact_files
from flows.receive import on_workers, state_file
from flows.results import ReceiveResult
from flows.steps import InProcess, Runner, Step, StepTable
from flows.workers import portable_root
from storage import heartbeat, layout, reader, signing
from storage.catalog import Catalog
from storage.local import journal, materialized, sidecar, state
from storage.reader import RefitPlan, manifests
from storage.root import RootRef, open_root
from storage.source_layout import DIRECTORY

log = logging.getLogger("dcr.receive")
T = TypeVar("T")

STATE_STEPS = StepTable(
    Step("resolve-chain", state_file.plan_receive),
    Step("take-leases", state_file.take_leases),
    Step("fetch-apply-verify", state_file.stage_refit),
    Step("reserve-file", on_workers.reserve_file),
    Step("rewrite-group", on_workers.rewrite_group),
    Step("replace-state", state_file.install_state),
    Step("verify-held-state", state_file.verify_held_state),
    Step("record-receiver-commit", state_file.record_receiver_commit),
    Step("release-leases", state_file.release_leases),
)
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


def clear_for_rewrite(state_path: str) -> None:
    """Before a file is rewritten whole (under its lock): a pending in-place patch settled (so a
    failed rewrite leaves one whole step), then its journal and block digests removed."""
    with contextlib.suppress(StateMismatchError):  # a damaged or foreign journal: moot here
        journal.settle(state_path)
    journal.remove(state_path)
    sidecar.remove(state_path)


def check_arguments(receiver_id: str | None, step: int | None, options) -> ReceiveOptions:
    if receiver_id is not None:
        layout.check_receiver(receiver_id)
    if step is not None:
        layout.check_step(step)
    if options is not None and not isinstance(options, ReceiveOptions):
        raise UsageError(f"options must be a ReceiveOptions, got {type(options).__name__}")
    if options is not None and options.require_signed:  # before anything is read
        signing.check_verifiable(f"receiver {receiver_id}" if receiver_id else "receive", "--require-signed")
    return options or ReceiveOptions()


def run_receive(
    root: str | os.PathLike, receiver_id: str, state_path: str | os.PathLike, step: int | None = None,
    storage_options: dict | None = None, options: ReceiveOptions | None = None, runner: Runner | None = None,
    record: bool = True, fresh: bool = False, exact: str | None = None,
) -> ReceiveResult:
    """Bring the state file at ``state_path`` to ``step`` (default: latest) and record the commit.
    ``exact`` (``run_materialize``, with ``fresh``): write the step's published file ("file") or
    directory ("directory") byte for byte instead of a state file."""
    options = check_arguments(receiver_id if record else None, step, options)
    ref = RootRef(os.fspath(root), dict(storage_options or {}))
    if options.max_staleness is not None:  # before anything is read or written: a stale ROOT changes nothing
        r = open_root(ref)
        heartbeat.check_fresh(r, options.max_staleness, Catalog(r).key)
    if exact is not None and (record or not fresh):
        raise UsageError("an exact materialization writes a fresh output and records no receiver")
    state_path = exact_files.check_directory(state_path) if exact == DIRECTORY else state_file.check_path(state_path)
    tasks = STATE_STEPS.bind(runner or InProcess())
    mapped = tasks.mapped and not options.in_place  # an in-place patch runs here (see flows.receive.on_workers)
    named = state.absolute_root(ref.url)  # what the state's header records, as in one process (workers' cwd differs)
    if mapped:
        ref, state_path = portable_root(ref), os.path.abspath(state_path)
    with state.exclusive(state_path):  # one writer per state file; leftovers of a killed one removed
        if exact == DIRECTORY:  # a swap a kill cut off: finished (after its journal) or undone (before)
            materialized.settle(state_path)
        if fresh:  # rewritten whole; still settle a patch first, so a failed rewrite leaves a whole step
            clear_for_rewrite(state_path)
        else:  # an in-place patch: a committed one rolled forward (and fsynced), a cut-off one back
            cut_off = os.path.exists(journal.journal_path(state_path))
            if journal.settle(state_path) is not None and cut_off:
                log.warning("%s: rolled back an interrupted in-place refit", state_path)
                sidecar.remove(state_path)  # its stamp already fails (the roll back wrote); hash it all next time
        with Leases(ref, receiver_id, options.lease_seconds, tasks.take_leases, tasks.release_leases) as leases:
            def stage(p: RefitPlan):
                if record:
                    leases.take(p)
                if not p.moves:
                    return None
                if mapped:
                    return on_workers.stage_on_workers(tasks, p, state_path, options, named, exact)
                return tasks.stage_refit(p, state_path, options, exact)

            plan, staged = leases.replanned(lambda: tasks.plan_receive(ref, state_path, step, fresh), stage, state_path)
            pulled = 0
            if staged is not None:
                tasks.install_state(staged)
                pulled = staged.bytes_pulled
            else:
                tasks.verify_held_state(plan, state_path)
            policy = manifests(plan)[plan.target_step].policy_digest
            if record:
                tasks.record_receiver_commit(ref, receiver_id, plan.target_step, {
                    "from_step": plan.current_step, "moves": plan.describe(), "bytes_pulled": pulled,
                    "policy_digest": policy,
                })
    return ReceiveResult(plan.target_step, plan.current_step, plan.describe(), pulled, policy, dict(tasks.timings))


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
