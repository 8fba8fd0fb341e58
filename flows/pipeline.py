"""The refit pipelines, written once and run either as Prefect flows or in-process.

``run_publish``/``run_receive`` call their steps through a ``tasks`` namespace: the plain functions
(``LOCAL``), or the same functions wrapped as Prefect tasks (see ``flows.prefect_flows``). The
in-process form exists because a Prefect flow run without a server first starts a temporary API
server (about 9 s per process on this machine), which is too slow for ``dcr receive`` called in a
loop; with ``PREFECT_API_URL`` set, the CLI runs the Prefect flows (see the README).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from dcr_core.errors import StateMismatchError, UsageError
from flows import publish_steps as ps
from flows import receive_steps as rs
from flows.options import PublishOptions, ReceiveOptions
from flows.sources import MemorySource, open_source
from storage import layout, state_journal
from storage.checkpoint import exclusive

log = logging.getLogger("dcr.receive")


@dataclass
class PublishResult:
    step: int
    kind: str
    base_step: int | None
    attempt: str
    policy_digest: str
    summary: dict
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class ReceiveResult:
    step: int
    from_step: int | None
    moves: list[str]
    bytes_pulled: int
    policy_digest: str
    timings: dict[str, float] = field(default_factory=dict)


LOCAL = SimpleNamespace(
    snapshot=open_source,
    plan_publish=ps.plan_publish,
    load_baseline=ps.load_baseline,
    encode_and_write=ps.encode_and_write,
    write_snapshot=ps.write_snapshot,
    write_manifest=ps.write_manifest,
    commit_step=ps.commit_step,
    remember_baseline=ps.remember_baseline,
    plan_receive=rs.plan_receive,
    refit_file=rs.refit_file,
    replace_state=rs.replace_state,
    verify_state=rs.verify_state_file,
    record_commit=rs.record_commit,
    publish_rank_part=None,  # set below (flows.shard_publish imports this module's result types)
    commit_ranks=None,
)


class _Timer:
    def __init__(self) -> None:
        self.timings: dict[str, float] = {}

    def __call__(self, name: str, fn, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0


def run_publish(
    root: str,
    source,
    step: int,
    keyframe: bool = False,
    storage_options: dict | None = None,
    options: PublishOptions | None = None,
    tasks=LOCAL,
    attempt: str | None = None,
    held: ps.BaselineSlot | None = None,
) -> PublishResult:
    """Publish ``source`` as ``step``. ``source``: a checkpoint path, a name -> tensor mapping, a
    ``ShardedSource`` (this rank's training shards; every rank calls this, rank 0 commits) or a list
    of ``ShardedSource`` of all ranks (published from this one process).

    ``held``: a long-running publisher's in-memory baseline (``flows.publisher.Publisher``): used
    when it is exactly the plan's base, and after the commit replaced by this publish's snapshot
    (no baseline file written) when the snapshot is a private copy this call made (a mapping
    source); otherwise emptied, and the baseline file is written as without it. Not for sharded
    sources."""
    from flows import shard_publish
    from flows.shard_source import ShardedSource

    all_ranks = isinstance(source, (list, tuple)) and bool(source) and all(isinstance(s, ShardedSource) for s in source)
    if held is not None and (all_ranks or isinstance(source, ShardedSource)):
        raise UsageError("held= (an in-memory baseline) is not supported for sharded sources; publish them without it")
    if isinstance(source, ShardedSource):
        return shard_publish.run_rank(root, source, step, keyframe, storage_options, options, attempt)
    if all_ranks:
        return shard_publish.run_ranks_in_process(root, list(source), step, keyframe, storage_options, options, tasks)
    options = options or PublishOptions()
    so = dict(storage_options or {})
    root = os.fspath(root)
    t = _Timer()
    src = t("snapshot", tasks.snapshot, source)
    name = getattr(src, "path", "<source>")
    plan = t("plan", tasks.plan_publish, root, so, src.infos, step, keyframe, options, name)
    if held is None:
        baseline = t("baseline", tasks.load_baseline, plan)
    else:
        baseline = t("baseline", tasks.load_baseline, plan, held.baseline)
    entries = t("encode_write", tasks.encode_and_write, plan, src, baseline)
    if plan.snapshot:  # a restart point (keyframe policy): the delta plus a full copy
        snapshot = t("snapshot_write", tasks.write_snapshot, plan, src, entries)
        manifest, digest = t("manifest", tasks.write_manifest, plan, entries, snapshot)
    else:
        manifest, digest = t("manifest", tasks.write_manifest, plan, entries)
    marker = t("commit", tasks.commit_step, plan, manifest, digest)
    if held is None:
        t("remember_baseline", tasks.remember_baseline, plan, src, marker, baseline)
    else:  # hold only a copy made here: a source object passed in may still change under its owner
        hold = isinstance(src, MemorySource) and src is not source
        held.baseline = t("remember_baseline", tasks.remember_baseline, plan, src, marker, baseline, hold)
    return PublishResult(
        marker.step, marker.kind, marker.base_step, marker.attempt, marker.policy_digest,
        {**manifest.summary(), **marker.summary}, t.timings,
    )


def run_receive(
    root: str,
    receiver_id: str,
    state_path: str,
    step: int | None = None,
    storage_options: dict | None = None,
    options: ReceiveOptions | None = None,
    tasks=LOCAL,
    record: bool = True,
    fresh: bool = False,
) -> ReceiveResult:
    """Bring the state file at ``state_path`` to ``step`` (default: latest) and record the commit."""
    if record:
        layout.check_receiver(receiver_id)
    if step is not None:
        layout.check_step(step)
    so = dict(storage_options or {})
    root = os.fspath(root)
    state_path = rs.check_state_path(state_path)
    with exclusive(state_path):  # one writer per state file; leftovers of a killed one removed
        return _receive_locked(root, receiver_id, state_path, step, so, options, tasks, record, fresh)


def _receive_locked(root, receiver_id, state_path, step, so, options, tasks, record, fresh) -> ReceiveResult:
    t = _Timer()
    if fresh:  # rewritten whole; still undo a cut-off patch first, so a failed rewrite leaves a whole step
        with contextlib.suppress(StateMismatchError):  # a damaged or foreign journal: moot here
            state_journal.roll_back(state_path)
        state_journal.remove(state_path)
    elif state_journal.roll_back(state_path) is not None:  # an in-place patch was cut off: undo it first
        log.warning("%s: rolled back an interrupted in-place refit", state_path)
    current = None if fresh else rs.peek_state_step(state_path)
    plan = t("plan", tasks.plan_receive, root, so, current, step, state_path)
    pulled = 0
    if plan.moves:
        outcome = t("refit", tasks.refit_file, plan, state_path, options)
        t("replace_state", tasks.replace_state, outcome)
        pulled = outcome["bytes_pulled"]
    else:
        t("verify_state", tasks.verify_state, plan, state_path)
    target = plan.manifests[plan.target_step]
    if record:
        t(
            "record_commit", tasks.record_commit, root, so, receiver_id, plan.target_step,
            {
                "from_step": current,
                "moves": [f"{m.direction.value}:{m.step}" for m in plan.moves],
                "bytes_pulled": pulled,
                "policy_digest": target.policy_digest,
            },
        )
    return ReceiveResult(
        plan.target_step, current, [f"{m.direction.value}:{m.step}" for m in plan.moves],
        pulled, target.policy_digest, t.timings,
    )


def run_materialize(
    root: str, step: int | None, out: str, storage_options: dict | None = None, options: ReceiveOptions | None = None
) -> ReceiveResult:
    """Write the full checkpoint of a committed step to ``out`` (no receiver record)."""
    return run_receive(root, "materialize", out, step, storage_options, options, record=False, fresh=True)


def _shard_tasks() -> None:
    from flows import shard_publish

    LOCAL.publish_rank_part = shard_publish.rank_part
    LOCAL.commit_ranks = shard_publish.commit_merged


_shard_tasks()
