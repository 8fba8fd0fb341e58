"""The publisher's pipelines: the order of its steps, written once, run in-process or as Prefect tasks.

- a canonical source (a checkpoint path, or name -> tensor in memory): snapshot, plan, baseline,
  encode and upload, [full snapshot for a restart point], manifest, commit, remember the baseline;
- one rank of a sharded publish (every rank runs it; rank 0 commits): snapshot the shards, plan,
  the rank's part (baseline, encode and partial manifest, stage its next baseline), then merge and
  commit (rank 0) or wait for the commit (the others), keep the staged baseline;
- every rank from one process (a DCP directory, a layout file): each rank's part in turn (memory:
  one rank's shards), then merge and commit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from dcr_core.errors import StepConflictError, UsageError
from flows import refs
from flows.options import PublishOptions
from flows.publish import ranks, shard_baseline
from flows.publish.baseline import BaselineSlot
from flows.publish.plan import PublishPlan
from flows.publish.shards import ShardedSource
from flows.publish.sources import as_source_ref
from flows.publish.steps import PUBLISH
from flows.refs import LocalRef
from flows.results import PublishResult
from flows.steps import Bound, InProcess, Runner
from storage.commit import discard_attempt
from storage.root import RootRef, open_root


def run_publish(
    root: str | os.PathLike, source, step: int, keyframe: bool = False, storage_options: dict | None = None,
    options: PublishOptions | None = None, runner: Runner | None = None, attempt: str | None = None,
    held: BaselineSlot | None = None, timeout: float = ranks.DEFAULT_TIMEOUT,
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
    tasks = PUBLISH.bind(runner or InProcess())
    all_ranks = isinstance(source, Sequence) and not isinstance(source, (str, bytes)) and bool(source) \
        and all(isinstance(s, ShardedSource) for s in source)
    if held is not None and (all_ranks or isinstance(source, ShardedSource)):
        raise UsageError("held= (an in-memory baseline) is not supported for sharded sources; publish them without it")
    if isinstance(source, ShardedSource):
        return _publish_rank(tasks, ref, source, step, keyframe, options, attempt, timeout)
    if all_ranks:
        return _publish_ranks(tasks, ref, list(source), step, keyframe, options)
    return _publish(tasks, ref, source, step, keyframe, options, held)


def _result(marker, summary: dict, tasks: Bound) -> PublishResult:
    return PublishResult(marker.step, marker.kind, marker.base_step, marker.attempt, marker.policy_digest,
                         summary, dict(tasks.timings))


def _publish(tasks: Bound, ref: RootRef, source, step: int, keyframe: bool, options: PublishOptions,
             held: BaselineSlot | None) -> PublishResult:
    src, given = as_source_ref(source)
    handles: list = [given]
    try:
        snap = tasks.snapshot(src)
        handles.append(snap if snap != src else None)
        plan = tasks.plan_from_source(ref, snap, step, keyframe, options)
        held_ref = None if held is None or held.baseline is None else refs.put(held.baseline, "held")
        handles.append(held_ref)
        baseline = tasks.load_baseline(plan, held_ref)
        handles.append(baseline)
        entries = tasks.encode_and_write(plan, snap, baseline)
        full = tasks.write_snapshot(plan, snap, entries) if plan.snapshot else None
        manifest = tasks.write_manifest(plan, entries, full)
        marker = tasks.commit_step(plan, manifest)
        # Hold only a copy made here: a mapping passed in may still change under its owner.
        hold = held is not None and isinstance(source, Mapping)
        kept = tasks.remember_baseline(plan, snap, marker, baseline, hold)
        handles.append(kept)
        if held is not None:
            held.baseline = None if kept is None else refs.get(kept)
    finally:
        for h in handles:
            if isinstance(h, LocalRef):
                refs.release(h)
    return _result(marker, {**manifest.summary, **marker.summary}, tasks)


def _rank_part(tasks: Bound, plan: PublishPlan, snap: LocalRef) -> str | None:
    """One rank's share: its baseline, encode and upload with its partial manifest, and its next
    baseline staged (kept only once the step is committed)."""
    baseline = tasks.load_shard_baseline(plan, snap)
    try:
        tasks.encode_rank(plan, snap, baseline)
    finally:
        refs.release(baseline)
    return tasks.stage_shard_baseline(plan, snap)


def _publish_rank(tasks: Bound, ref: RootRef, source: ShardedSource, step: int, keyframe: bool,
                  options: PublishOptions, attempt: str | None, timeout: float) -> PublishResult:
    attempt = ranks.agree_on_attempt(attempt, source.world)  # a collective: every rank, first
    plan, staged = None, None
    with refs.holding(source, "shards") as src:
        snap = tasks.snapshot_shards(src)
        try:
            plan = tasks.plan_rank(ref, snap, step, keyframe, options, attempt)
            staged = _rank_part(tasks, plan, snap)
            if plan.rank == 0:
                manifest, marker = tasks.commit_ranks(plan, timeout)
                summary = manifest.summary
            else:
                marker = tasks.await_commit(plan, timeout)
                summary = dict(marker.summary)
        except BaseException as e:
            # Tell the other ranks at once (they would otherwise wait for their timeout).
            ranks.fail_attempt(ref, step, attempt, source.rank, f"{type(e).__name__}: {e}")
            shard_baseline.drop_shard_baseline(staged)
            raise
        finally:
            refs.release(snap)
    tasks.keep_shard_baseline(plan, staged)
    return _result(marker, summary, tasks)


def _publish_ranks(tasks: Bound, ref: RootRef, sources: list[ShardedSource], step: int, keyframe: bool,
                   options: PublishOptions) -> PublishResult:
    worlds = {s.world for s in sources}
    order = sorted(s.rank for s in sources)
    if len(worlds) != 1 or order != list(range(next(iter(worlds)))):
        raise UsageError(f"sources must be ranks 0..world-1 of one world, got ranks {order} of worlds {sorted(worlds)}")
    attempt = ranks.agree_on_attempt(None, 1)
    plans: list[PublishPlan] = []
    staged: list[str | None] = []
    try:
        for source in sorted(sources, key=lambda s: s.rank):  # memory: one rank's shards at a time
            with refs.holding(source, "shards") as src:
                snap = tasks.snapshot_shards(src)
                try:
                    plans.append(tasks.plan_rank(ref, snap, step, keyframe, options, attempt))
                    staged.append(_rank_part(tasks, plans[-1], snap))
                finally:
                    refs.release(snap)
        manifest, marker = tasks.commit_ranks(plans[0], 0.0)
    except BaseException as e:
        for s in staged:
            shard_baseline.drop_shard_baseline(s)
        if plans and not isinstance(e, StepConflictError):
            discard_attempt(open_root(ref), step, attempt)
        raise
    for plan, s in zip(plans, staged):
        tasks.keep_shard_baseline(plan, s)
    return _result(marker, manifest.summary, tasks)
