"""The pipeline of a sharded publish (training shards: torch), run by ``flows.publish.pipeline.run_publish``.

- one rank (every rank runs it; rank 0 commits): snapshot the shards, plan, the rank's part
  (baseline, encode and partial manifest, stage its next baseline), then merge and commit (rank 0)
  or wait for the commit (the others), keep the staged baseline;
- every rank from one process (a DCP directory, a layout file): each rank's part in turn (memory:
  one rank's shards), then merge and commit.
"""

from __future__ import annotations

from dcr_core.errors import StepConflictError, UsageError
from flows import local_refs
from flows.local_refs import LocalRef
from flows.options import PublishOptions
from flows.publish import ranks, shard_baseline, shards
from flows.publish.pipeline import result_of
from flows.publish.plan import PublishPlan
from flows.publish.shards import ShardedSource
from flows.results import PublishResult
from flows.steps import Runner, Step, StepTable
from storage.commit import discard_attempt
from storage.root import RootRef, open_root


class RankSteps(StepTable):
    """The steps of one rank of a sharded publish, in order."""

    snapshot_shards = Step(shards.snapshot_shards)
    plan_rank = Step(ranks.plan_rank)
    load_shard_baseline = Step(shard_baseline.load_shard_baseline)
    encode_rank = Step(ranks.encode_rank)
    stage_shard_baseline = Step(shard_baseline.stage_shard_baseline)
    commit_ranks = Step(ranks.commit_ranks)  # rank 0: merge the ranks' parts and commit
    await_commit = Step(ranks.await_commit)  # the other ranks
    keep_shard_baseline = Step(shard_baseline.keep_shard_baseline)


def _rank_part(tasks: RankSteps, plan: PublishPlan, snap: LocalRef) -> str | None:
    """One rank's share: its baseline, encode and upload with its partial manifest, and its next
    baseline staged (kept only once the step is committed)."""
    baseline = tasks.load_shard_baseline(plan, snap)
    try:
        tasks.encode_rank(plan, snap, baseline)
    finally:
        local_refs.release(baseline)
    return tasks.stage_shard_baseline(plan, snap)


def publish_rank(runner: Runner, ref: RootRef, source: ShardedSource, step: int, keyframe: bool,
                 options: PublishOptions, attempt: str | None, timeout: float) -> PublishResult:
    """This rank's part of a sharded publish (every rank calls it; rank 0 commits)."""
    tasks = RankSteps(runner)
    attempt = ranks.agree_on_attempt(attempt, source.world)  # a collective: every rank, first
    plan, staged = None, None
    with local_refs.holding(source, "shards") as src:
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
            local_refs.release(snap)
    tasks.keep_shard_baseline(plan, staged)
    return result_of(marker, summary, tasks)


def publish_ranks(runner: Runner, ref: RootRef, sources: list[ShardedSource], step: int, keyframe: bool,
                  options: PublishOptions) -> PublishResult:
    """Every rank of a sharded publish from this one process, then the commit."""
    tasks = RankSteps(runner)
    worlds = {s.world for s in sources}
    order = sorted(s.rank for s in sources)
    if len(worlds) != 1 or order != list(range(next(iter(worlds)))):
        raise UsageError(f"sources must be ranks 0..world-1 of one world, got ranks {order} of worlds {sorted(worlds)}")
    attempt = ranks.agree_on_attempt(None, 1)
    plans: list[PublishPlan] = []
    staged: list[str | None] = []
    try:
        for source in sorted(sources, key=lambda s: s.rank):  # memory: one rank's shards at a time
            with local_refs.holding(source, "shards") as src:
                snap = tasks.snapshot_shards(src)
                try:
                    plans.append(tasks.plan_rank(ref, snap, step, keyframe, options, attempt))
                    staged.append(_rank_part(tasks, plans[-1], snap))
                finally:
                    local_refs.release(snap)
        manifest, marker = tasks.commit_ranks(plans[0], 0.0)
    except BaseException as e:
        for s in staged:
            shard_baseline.drop_shard_baseline(s)
        if plans and not isinstance(e, StepConflictError):
            discard_attempt(open_root(ref), step, attempt)
        raise
    for plan, s in zip(plans, staged):
        tasks.keep_shard_baseline(plan, s)
    return result_of(marker, manifest.summary, tasks)
