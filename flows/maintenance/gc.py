"""``dcr gc``: delete what retention no longer needs, never what a reader may still use.

What is deleted (see ``dcr_core.retention`` for which committed steps are kept):
- committed steps that retention does not keep: the commit marker first (from then on the step is
  not visible to any reader), then everything under the step's prefix;
- attempts that can never be committed: a losing attempt of a committed step, and attempts of
  steps with no marker, once their newest object is older than the grace period (a publisher may
  still be writing a young one; a marker-less step prefix left by a crash between the two deletes
  above is collected the same way).

A crash at any point of a ``gc`` leaves the bucket consistent: a step is either fully visible
(marker and data) or invisible (no marker); running ``gc`` again finishes the job.

Receivers: a step a receiver registered (``steps/N/receivers/<id>.json``: the highest one each
receiver recorded) and the step each receiver is at now (``receivers/<id>.json``) are kept, with the deltas it needs
to reach the latest one. A step a receiver is reading is leased (``storage.leases``): gc keeps it
while the lease is live, looks again right before deleting the marker (spared), and once more after
(a receiver that leased it and saw the marker in between reads on: the marker is gone, the data
stays until a later gc finds the lease gone). A receiver whose plan lost a step before its lease
landed plans again; one holding a step gc deleted restarts from a restart point
(``storage.reader.held_or_restart``). Names below ``steps/`` that DCR does not write
(links, special files, attempt names that are not attempt ids) are reported and left alone.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from dcr_core import events
from dcr_core.errors import DCRError, UnsafeKeyError
from dcr_core.retention import steps_to_delete, steps_to_keep
from dcr_core.text import plural, printable
from flows.options import GcOptions
from flows.steps import InProcess, Runner, Step, StepTable
from storage import layout, leases
from storage.catalog import Catalog
from storage.root import Root, RootRef, open_root


@dataclass
class GcPlan:
    keep: list[int]
    delete_steps: list[int]
    delete_attempts: list[str]  # attempt prefixes (keys relative to ROOT)
    receivers: dict[str, int]  # receiver id -> the latest step it registered
    bytes_freed: int = 0
    objects: int = 0
    young_attempts: list[str] = field(default_factory=list)  # kept: within the grace period
    leftover_steps: list[int] = field(default_factory=list)  # marker-less, below the latest: tidied
    leased: dict[int, list[str]] = field(default_factory=dict)  # kept: receivers are reading them
    refused: list[str] = field(default_factory=list)  # left alone: links, foreign names, unreadable markers
    step_sizes: dict[int, list[int]] = field(default_factory=dict)  # doomed step -> [objects, bytes]
    # [key, why]: leases no receiver can have taken (storage.leases): they pin nothing and are removed
    garbage_leases: list[list[str]] = field(default_factory=list)


@dataclass
class GcReport:
    dry_run: bool
    plan: GcPlan
    deleted_steps: list[int] = field(default_factory=list)
    deleted_attempts: list[str] = field(default_factory=list)

    spared: dict[int, list[str]] = field(default_factory=dict)  # planned, then leased before deletion
    # marker deleted, data kept: a receiver leased it before the marker went (a later gc deletes it)
    hidden: dict[int, list[str]] = field(default_factory=dict)
    left_alone: list[str] = field(default_factory=list)  # found while deleting: links, special files
    removed_leases: list[list[str]] = field(default_factory=list)  # [key, why] of the garbage leases removed

    @classmethod
    def from_dict(cls, d: dict) -> GcReport:
        """The report from its ``asdict`` form (what the Prefect flow returns)."""
        plan = dict(d["plan"])
        plan["leased"] = {int(k): v for k, v in plan.get("leased", {}).items()}
        plan["step_sizes"] = {int(k): v for k, v in plan.get("step_sizes", {}).items()}
        return cls(d["dry_run"], GcPlan(**plan), list(d["deleted_steps"]), list(d["deleted_attempts"]),
                   {int(k): v for k, v in d.get("spared", {}).items()},
                   {int(k): v for k, v in d.get("hidden", {}).items()}, list(d.get("left_alone", [])),
                   list(d.get("removed_leases", [])))


def registered_receivers(cat: Catalog, steps: list[int], unreadable: dict[int, str] | None = None) -> dict[str, int]:
    """Each receiver id with the latest committed step it recorded. A step whose records cannot be
    listed (a link in place of ``receivers/``) goes into ``unreadable`` (else the error is raised)."""
    held: dict[str, int] = {}
    for s in steps:
        try:
            names = cat.receivers(s)
        except UnsafeKeyError as e:
            if unreadable is None:
                raise
            unreadable[s] = str(e)
            continue
        for rid in names:
            held[rid] = max(held.get(rid, -1), s)
    return held


def _positions(cat: Catalog, refused: list[str]) -> dict[str, int]:
    """Each receiver's position (``receivers/<id>.json``). Best effort: the highest step each
    recorded is kept anyway; a position that cannot be read only protects less extra."""
    try:
        return {rid: rec["step"] for rid, rec in cat.positions({}).items()}
    except DCRError as e:
        refused.append(f"{layout.POSITIONS_DIR}/: {e}; receivers' positions not read")
        return {}


def plan_gc(root: RootRef, options: GcOptions, now: float | None = None) -> GcPlan:
    """What a ``gc`` would delete (reads markers and listings only; writes nothing)."""
    now = time.time() if now is None else now
    keep_last, grace_seconds = options.keep_last, options.grace_seconds
    root = open_root(root)
    cat = Catalog(root)
    refused: list[str] = []
    listed, markers = [], {}
    for s in cat.listed_steps():
        try:
            markers[s] = cat.marker(s)
        except DCRError as e:  # an unreadable marker (damaged, a FIFO, a link): never touch that step
            refused.append(f"{layout.step_dir(s)}: {e}")
            continue
        listed.append(s)
    committed = [s for s in listed if markers[s] is not None]
    # retention looks at the live steps: a retracted step is kept only while leased (a receiver that
    # holds one and finds it gone restarts from a restart point)
    infos = {s: cat.step_info(s) for s in committed if _live(cat, s, refused)}
    # a live step built on a retracted one (a publish that raced dcr retract and died before
    # retracting itself: storage.commit): its chain reads the retracted step's delta, which stays
    pending = list(infos.values())
    while pending:
        base = pending.pop().base_step
        if base is not None and base not in infos and markers.get(base) is not None:
            infos[base] = cat.step_info(base)
            pending.append(infos[base])
    unreadable: dict[int, str] = {}
    receivers = registered_receivers(cat, committed, unreadable)
    refused += [f"{e}; step {s} kept" for s, e in sorted(unreadable.items())]
    at_now = _positions(cat, refused)  # where receivers are now (one that moved back is below its highest)
    # leases on marker-less steps too: a step whose marker gc deleted while a receiver was reading it
    garbage: list[list[str]] = []
    leased = {s: who for s in listed if (who := _leases(root, s, now, refused, garbage))}
    keep = (steps_to_keep(infos, keep_last, receivers) | steps_to_keep(infos, keep_last, at_now)
            | set(leased) | set(unreadable))
    doomed = steps_to_delete(committed, keep)
    plan = GcPlan(sorted(keep), doomed, [], receivers, leased=leased, refused=refused, garbage_leases=garbage)
    for s in doomed:
        objs = root.objects(layout.step_dir(s))
        plan.step_sizes[s] = [len(objs), sum(o.size for o in objs)]
        plan.objects += len(objs)
        plan.bytes_freed += sum(o.size for o in objs)
    latest = max(committed, default=None)
    for s in listed:
        if s in doomed or (markers[s] is None and s in leased):
            continue  # a marker-less step still leased: a receiver is finishing a read of it
        marker = markers[s]
        if marker is None and latest is not None and s < latest:
            plan.leftover_steps.append(s)
        try:
            attempts = root.listdir(layout.attempts_dir(s))
        except UnsafeKeyError as e:  # e.g. a link in place of attempts/: nothing under it is ours
            refused.append(str(e))
            continue
        for attempt in attempts:
            if marker is not None and attempt == marker.attempt:
                continue
            prefix = f"{layout.attempts_dir(s)}/{attempt}"
            try:
                layout.check_attempt(attempt)
            except UnsafeKeyError:
                refused.append(f"{prefix}: not an attempt DCR writes (its name is not an attempt id); left alone")
                continue
            try:
                objs = root.objects(prefix)
            except UnsafeKeyError as e:  # a link in place of an attempt
                refused.append(f"{prefix}: {e}")
                continue
            newest = max((o.mtime for o in objs if o.mtime is not None), default=None)
            unknown_age = any(o.mtime is None for o in objs)
            old_enough = not unknown_age and (newest is None or now - newest >= grace_seconds)
            if marker is not None or old_enough:  # a losing attempt can never commit: no grace
                plan.delete_attempts.append(prefix)
                plan.bytes_freed += sum(o.size for o in objs)
                plan.objects += len(objs)
            else:
                plan.young_attempts.append(prefix)
    return plan


def collect(root: RootRef, plan: GcPlan) -> GcReport:
    """Delete what ``plan`` lists: each doomed step's marker first (invisible from then on), then its
    prefix; then dead attempts; then marker-less leftovers."""
    r = open_root(root)
    report = GcReport(False, plan)
    for s in plan.delete_steps:
        who = leases.live(r, s)  # a receiver may have leased it since the plan: spare it
        if who:
            report.spared[s] = who
            continue
        events.reached("gc.leases-checked", step=s)
        r.remove(layout.commit_key(s))  # invisible from here on
        events.reached("gc.marker-deleted", step=s)
        who = leases.live(r, s)  # taken before the marker went, and the receiver saw the marker:
        if who:  # its reads finish first; a later gc deletes the data once the lease is gone
            report.hidden[s] = who
            continue
        _remove_step(r, s)
        events.reached("gc.step-deleted", step=s)
        report.deleted_steps.append(s)
    for prefix in plan.delete_attempts:
        r.remove(prefix, recursive=True)
        report.deleted_attempts.append(prefix)
    for s in plan.leftover_steps:
        try:
            _remove_leftover(r, s)
        except UnsafeKeyError as e:  # a link below the leftover: left alone, reported
            report.left_alone.append(str(e))
    _remove_garbage_leases(r, plan, report)
    return report


def _remove_step(root: Root, step: int) -> None:
    """Everything under the step's prefix, but a retracted step's record: it stays as a tombstone
    (the number is never used again, and a receiver that holds the step restarts from a restart
    point instead of taking the ROOT for rolled back)."""
    record = layout.retraction_key(step)
    if not root.exists(record):
        root.remove(layout.step_dir(step), recursive=True)
        return
    for name in root.listdir(layout.step_dir(step)):
        if f"{layout.step_dir(step)}/{name}" != record:
            try:
                root.remove(f"{layout.step_dir(step)}/{name}", recursive=True)
            except FileNotFoundError:
                pass


def _remove_garbage_leases(root: Root, plan: GcPlan, report: GcReport) -> None:
    """The leases the plan found to be garbage, last (they pin nothing: the rechecks above skipped
    them) and each only if it still is: a receiver may have written a real lease under that name
    since the plan, and that one gc keeps."""
    by_step: dict[int, set[str]] = {}
    for key, _ in plan.garbage_leases:  # steps/<step>/leases/<name>
        parts = key.split("/")
        step = layout.parse_step_dir(parts[1]) if len(parts) > 3 and parts[0] == layout.STEPS else None
        if step is not None:
            by_step.setdefault(step, set()).add(key)
    planned = {key: why for key, why in plan.garbage_leases}
    for step, keys in sorted(by_step.items()):
        if step in report.deleted_steps:  # gone with their step
            report.removed_leases += [[key, planned[key]] for key in sorted(keys)]
            continue
        try:
            still = {key: why for key, why in leases.scan(root, step).garbage}
        except UnsafeKeyError:
            continue
        for key in sorted(keys & set(still)):
            try:
                root.remove(key)
            except FileNotFoundError:
                continue
            report.removed_leases.append([key, still[key]])


class GcSteps(StepTable):
    plan_gc = Step(plan_gc)
    collect = Step(collect)


def run_gc(root: str | os.PathLike, options: GcOptions, storage_options: dict | None = None,
           runner: Runner | None = None) -> GcReport:
    """Plan, then (unless ``options.dry_run``) delete."""
    ref = RootRef(os.fspath(root), dict(storage_options or {}))
    tasks = GcSteps(runner or InProcess())
    plan = tasks.plan_gc(ref, options)
    events.reached("gc.planned", delete_steps=len(plan.delete_steps))
    return GcReport(True, plan) if options.dry_run else tasks.collect(ref, plan)


def _live(cat: Catalog, step: int, refused: list[str]) -> bool:
    try:
        return cat.retraction(step) is None
    except DCRError as e:  # an unreadable or forged retraction: the step counts as live (kept)
        refused.append(f"{layout.retraction_key(step)}: {e}")
        return True


def _leases(root: Root, step: int, now: float, refused: list[str], garbage: list[list[str]]) -> list[str]:
    try:
        found = leases.scan(root, step, now)
    except UnsafeKeyError as e:
        refused.append(str(e))
        return ["(unreadable leases)"]  # keep the step: gc never guesses in favour of deleting
    garbage += [[key, why] for key, why in found.garbage]
    return found.live


def _remove_leftover(root: Root, step: int) -> None:
    """Tidy a marker-less step below the latest (no publisher can commit it any more): receiver
    records of a deleted step, then the prefix itself once nothing is left under it."""
    if root.exists(layout.commit_key(step)) or root.listdir(layout.attempts_dir(step)):
        return
    for d in (layout.receivers_dir(step), layout.leases_dir(step)):
        try:
            root.remove(d, recursive=True)
        except FileNotFoundError:
            pass
    try:
        if not root.objects(layout.step_dir(step)):
            root.remove(layout.step_dir(step), recursive=True)  # an empty local directory
    except FileNotFoundError:
        pass


def _names(who) -> str:
    """Lease holders as named in the bucket (object names anyone with write access chose): escaped."""
    return ", ".join(printable(w) for w in who)


def format_report(report: GcReport) -> str:
    p = report.plan
    verb = "would delete" if report.dry_run else "deleted"
    steps = p.delete_steps if report.dry_run else report.deleted_steps
    lines = [f"{verb} step {s}" for s in steps]
    lines += [f"{verb} attempt {a}" for a in p.delete_attempts]
    lines += [f"kept attempt {a} (younger than the grace period)" for a in p.young_attempts]
    lines += [f"kept step {s} (leased by {_names(who)})" for s, who in sorted(p.leased.items())]
    lines += [f"spared step {s} (leased by {_names(who)} after the plan)" for s, who in sorted(report.spared.items())]
    lines += [f"uncommitted step {s}, its data kept while {_names(who)} finish reading it" for s, who in sorted(report.hidden.items())]
    lines += [f"left alone: {printable(r)}" for r in p.refused + report.left_alone]
    removed = "would remove" if report.dry_run else "removed"
    lines += [f"{removed} lease {printable(key)}: {printable(why)}"
              for key, why in (p.garbage_leases if report.dry_run else report.removed_leases)]
    objects, freed = p.objects, p.bytes_freed
    for s in list(report.spared) + list(report.hidden):  # planned, not deleted
        n, b = p.step_sizes.get(s, (0, 0))
        objects, freed = objects - n, freed - b
    lines.append(
        f"gc{' (dry run)' if report.dry_run else ''}: {verb} {plural(len(steps), 'step')} and "
        f"{plural(len(p.delete_attempts), 'stale attempt')}, {plural(objects, 'object')}, {plural(freed, 'byte')}; "
        f"kept {plural(len(p.keep), 'step')}" + (f" ({plural(len(p.receivers), 'receiver')} registered)" if p.receivers else "")
    )
    return "\n".join(lines)
