"""The publisher's pipelines: the order of its steps, written once, run in-process or as Prefect tasks.

- a canonical source (a checkpoint path, or name -> tensor in memory): snapshot, plan, baseline,
  encode and upload, [full snapshot for a restart point], manifest, commit, remember the baseline
  (here; torch-free for a checkpoint path);
- one rank of a sharded publish, or every rank from one process (a DCP directory, a layout file):
  ``flows.publish.rank_pipeline`` (training shards: torch), found by name and imported only for
  sharded sources.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
import uuid
from collections.abc import Mapping, Sequence

from dcr_core import events
from dcr_core.errors import DCRError, UsageError
from dcr_core.text import plural
from flows import local_refs
from flows.local_refs import LocalRef
from flows.options import PublishOptions
from flows.publish import baseline, commit, encode, sources
from flows.publish.baseline import BaselineSlot
from flows.publish.encode import BaselineMismatchError, announcing
from flows.publish.groups import GROUP_CACHE, drop_results, plan_groups, stored_keys
from flows.publish.plan import DEFAULT_TIMEOUT, plan_from_source
from flows.publish.sources import as_source_ref
from flows.results import PublishResult
from flows.steps import InProcess, Runner, Step, StepTable
from flows.workers import portable_root
from storage import layout
from storage.commit import discard_attempt
from storage.root import RootRef, open_root

log = logging.getLogger("dcr.publish")

SHARDS = "flows.publish.shards"  # ShardedSource (torch)
RANK_PIPELINE = "flows.publish.rank_pipeline"  # publish_rank(...), publish_ranks(...)

class PublishSteps(StepTable):
    """A canonical source's steps (a checkpoint, or tensors in memory), in order (torch-free: a
    checkpoint path is read as raw bits)."""

    snapshot = Step(sources.snapshot)
    plan_from_source = Step(plan_from_source)
    load_baseline = Step(baseline.load_baseline)
    encode_and_write = Step(encode.encode_and_write)
    # mapped over tensor groups on workers (flows.workers); a rerun of the attempt skips finished groups
    encode_group = Step(encode.encode_group, GROUP_CACHE)
    write_snapshot = Step(encode.write_snapshot)
    write_manifest = Step(commit.write_manifest)
    commit_step = Step(commit.commit_step)
    remember_baseline = Step(baseline.remember_baseline)


def sharded(source) -> tuple[bool, bool]:
    """Whether ``source`` is one rank's ``ShardedSource``, and whether it is a list of every rank's.

    A ``ShardedSource`` exists only in a process that imported its module (it holds torch tensors),
    so a process that never did cannot be holding one and is not made to import torch to find out."""
    shards = sys.modules.get(SHARDS)
    if shards is None:
        return False, False
    cls = shards.ShardedSource
    all_ranks = isinstance(source, Sequence) and not isinstance(source, (str, bytes)) and bool(source) \
        and all(isinstance(s, cls) for s in source)
    return isinstance(source, cls), all_ranks


def run_publish(
    root: str | os.PathLike, source, step: int, keyframe: bool = False, storage_options: dict | None = None,
    options: PublishOptions | None = None, runner: Runner | None = None, attempt: str | None = None,
    held: BaselineSlot | None = None, timeout: float = DEFAULT_TIMEOUT,
) -> PublishResult:
    """Publish ``source`` as ``step``: a checkpoint path, a name -> tensor mapping, a
    ``ShardedSource`` (this rank's training shards; every rank calls this, rank 0 commits) or a list
    of ``ShardedSource`` of all ranks (published from this one process).

    ``held``: a long-running publisher's in-memory baseline (``flows.publish.publisher``): used
    when it is exactly the plan's base, and after the commit replaced by this publish's snapshot
    when that is a private copy this call made (a mapping source); otherwise emptied, and the
    baseline file is written as without it. Not for sharded sources."""
    if not isinstance(keyframe, bool):
        raise UsageError(f"keyframe must be True or False, got {keyframe!r}")
    if options is not None and not isinstance(options, PublishOptions):
        raise UsageError(f"options must be a PublishOptions, got {type(options).__name__}")
    ref = RootRef(os.fspath(root), dict(storage_options or {}))
    options = options or PublishOptions()
    one_rank, all_ranks = sharded(source)
    if held is not None and (all_ranks or one_rank):
        raise UsageError("held= (an in-memory baseline) is not supported for sharded sources; publish them without it")
    if one_rank:
        return importlib.import_module(RANK_PIPELINE).publish_rank(
            runner or InProcess(), ref, source, step, keyframe, options, attempt, timeout)
    if all_ranks:
        return importlib.import_module(RANK_PIPELINE).publish_ranks(
            runner or InProcess(), ref, list(source), step, keyframe, options)
    tasks = PublishSteps(runner or InProcess())
    return _publish(tasks, ref, source, step, keyframe, options, held, attempt)


def _encode(tasks: PublishSteps, plan, snap, baseline) -> dict:
    """The manifest entries of every tensor, encoded and stored: in one call here, or, with workers
    (``tasks.mapped``), as tasks mapped over groups of tensors (``flows.publish.groups``), merged in
    name order (so the manifest is the same however the work was split)."""
    if not tasks.mapped:
        return tasks.encode_and_write(plan, snap, baseline)
    plan, snap, baseline = mappable(plan, snap, baseline)
    groups = plan_groups(plan, tasks.slots)
    log.info("step %d: encoding %s in %s on %s", plan.step, plural(len(plan.infos), "tensor"),
             plural(len(groups), "group"), plural(tasks.slots, "worker slot"))
    root, store = open_root(plan.root), layout.store_dir(plan.step, plan.attempt)
    again = bool(root.objects(store))  # a rerun of this attempt: finished groups come from the kept results

    def each(part: dict) -> None:
        events.reached("publish.group-returned", step=plan.step, arrays=[e.array for e in part.values()])
        if announce is not None:
            announce(part)

    with announcing(plan) as announce:  # streaming: each group's chunks announced as it returns
        parts = tasks.map(encode.encode_group, [{"group": g} for g in groups], each=each, plan=plan, source=snap,
                          baseline=baseline)
    entries = {name: entry for part in parts for name, entry in part.items()}
    if again:  # kept results are only as good as the objects they name: the attempt must hold exactly those
        want = stored_keys(entries.values(), plan.options.pack_bytes > 0)
        held = {o.key[len(store) + 1:] for o in root.objects(store)} - {layout.GROUP_META}
        if held != want:
            odd = sorted(want - held) or sorted(held - want)
            raise AttemptLostError(f"{layout.store_key(plan.step, plan.attempt, odd[0])}: attempt {plan.attempt} "
                                   f"misses {len(want - held)} and has {len(held - want)} other objects than its groups'")
    return entries


class AttemptLostError(DCRError):
    """A rerun's attempt does not hold exactly the objects its groups' results name: some are gone
    (``dcr gc`` collected the failed attempt in between) or others are there (the first run read a
    checkpoint since rewritten). The publish encodes everything again in a fresh attempt."""


def mappable(plan, snap, baseline):
    """The plan and files as workers can use them (local paths, the cache directory's too, made
    absolute: a worker finds the publisher's cache where it is); ``UsageError`` for
    what cannot leave this process: tensors held in memory, a ``memory://`` ROOT."""
    if not isinstance(snap, str):
        raise UsageError("publishing on workers reads a checkpoint file where each task runs; tensors held in this "
                         "process cannot travel: pass a checkpoint path, or publish without workers")
    if baseline is not None and not isinstance(baseline, str):
        raise UsageError("publishing on workers needs a baseline file the workers can read, not one held in memory: "
                         "publish without held=, or without workers")
    options = plan.options.model_copy(update={"cache_dir": os.path.abspath(plan.options.cache_dir)})
    return (dataclasses.replace(plan, root=portable_root(plan.root), options=options), os.path.abspath(snap),
            None if baseline is None else os.path.abspath(baseline))


def result_of(marker, summary: dict, tasks: StepTable) -> PublishResult:
    return PublishResult(marker.step, marker.kind, marker.base_step, marker.attempt, marker.policy_digest,
                         summary, dict(tasks.timings))


def _publish(tasks: PublishSteps, ref: RootRef, source, step: int, keyframe: bool, options: PublishOptions,
             held: BaselineSlot | None, attempt: str | None = None) -> PublishResult:
    src, given = as_source_ref(source)
    handles: list = [given]
    try:
        snap = tasks.snapshot(src)
        handles.append(snap if snap != src else None)
        plan = tasks.plan_from_source(ref, snap, step, keyframe, options, attempt)
        held_ref = None if held is None or held.baseline is None else local_refs.put(held.baseline, "held")
        handles.append(held_ref)
        baseline = tasks.load_baseline(plan, held_ref)
        handles.append(baseline)
        redone = None
        try:
            entries = _encode(tasks, plan, snap, baseline)
        except AttemptLostError as e:  # nothing of this attempt can be trusted now: all again, afresh
            log.warning("%s; encoding step %d again in a fresh attempt", e, step)
            discard_attempt(open_root(ref), step, plan.attempt)
            drop_results(plan)
            plan = dataclasses.replace(plan, attempt=uuid.uuid4().hex)
            entries = _encode(tasks, plan, snap, baseline)
        except BaselineMismatchError as e:
            if not options.use_cache:  # a private baseline rebuilt from ROOT just now: a real fault
                raise
            # The cache file failed the check made as it was used (flows.publish.baseline, "Trust"):
            # drop what this attempt wrote and encode once more, in a fresh attempt, from a baseline
            # hashed in full now (or rebuilt from ROOT). Nothing was committed. Said once the step
            # commits: the usual cause is another publisher of this ROOT that committed and patched
            # the cache, and a publisher that then loses the step prints its one-line error alone.
            redone = e
            discard_attempt(open_root(ref), step, plan.attempt)
            plan = dataclasses.replace(plan, attempt=uuid.uuid4().hex)
            baseline = tasks.load_baseline(plan, None, True)
            handles.append(baseline)
            entries = _encode(tasks, plan, snap, baseline)
        full = tasks.write_snapshot(plan, snap, entries) if plan.snapshot else None
        manifest = tasks.write_manifest(plan, entries, full)
        marker = tasks.commit_step(plan, manifest)
        if tasks.mapped:
            drop_results(plan)
        if redone is not None:
            log.warning("%s; step %d was published again from a checked baseline", redone, step)
        # Hold only a copy made here: a mapping passed in may still change under its owner.
        hold = held is not None and isinstance(source, Mapping)
        kept = tasks.remember_baseline(plan, snap, marker, baseline, hold)
        handles.append(kept)
        if held is not None:
            held.baseline = None if kept is None else local_refs.get(kept)
    finally:
        for h in handles:
            if isinstance(h, LocalRef):
                local_refs.release(h)
    return result_of(marker, {**manifest.summary, **marker.summary}, tasks)
