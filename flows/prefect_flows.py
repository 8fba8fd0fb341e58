"""The Prefect flows ``publish_refit`` and ``receive_refit``: each refit step is one coarse task.

Tasks take and return references, plans and in-process objects (the refit task hands an open,
verified temp file to the task that moves it into place); nothing is serialized. No task hashes its inputs (``NO_CACHE``): tensors would cost seconds to hash and
their hashes are not content-stable. I/O tasks retry transient failures
(``storage.retry.is_transient``); DCR's own errors (bad input, conflicts, integrity) are final.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows import pipeline
from flows.module_target import receive_into_module
from storage.retry import is_transient


def _transient(task_, task_run, state) -> bool:
    """Retry only failures that are not DCR's own verdicts."""
    try:
        state.result()
    except Exception as e:  # noqa: BLE001
        return is_transient(e)
    return False


def _task(fn, name: str, retries: int = 0):
    return task(
        fn,
        name=name,
        cache_policy=NO_CACHE,
        persist_result=False,
        retries=retries,
        retry_delay_seconds=1,
        retry_condition_fn=_transient if retries else None,
    )


L = pipeline.LOCAL
PREFECT_TASKS = SimpleNamespace(
    snapshot=_task(L.snapshot, "snapshot"),
    plan_publish=_task(L.plan_publish, "plan-publish"),
    load_baseline=_task(L.load_baseline, "load-baseline", retries=2),
    encode_and_write=_task(L.encode_and_write, "encode-and-write-chunks", retries=2),
    write_snapshot=_task(L.write_snapshot, "write-snapshot", retries=2),
    write_manifest=_task(L.write_manifest, "write-manifest", retries=2),
    commit_step=_task(L.commit_step, "commit", retries=2),
    remember_baseline=_task(L.remember_baseline, "remember-baseline"),
    plan_receive=_task(L.plan_receive, "resolve-chain", retries=2),
    refit_file=_task(L.refit_file, "fetch-apply-verify", retries=2),
    replace_state=_task(L.replace_state, "replace-state"),
    verify_state=_task(L.verify_state, "verify-held-state"),
    record_commit=_task(L.record_commit, "record-receiver-commit", retries=2),
    publish_rank_part=_task(L.publish_rank_part, "publish-rank-shards"),
    commit_ranks=_task(L.commit_ranks, "merge-and-commit", retries=2),
)


@flow(name="dcr-publish-refit", validate_parameters=False, log_prints=True)
def publish_refit(
    root: str,
    source: Any,
    step: int,
    keyframe: bool = False,
    storage_options: dict | None = None,
    options: Any = None,
    attempt: str | None = None,
) -> dict:
    """Publish ``source`` as ``step`` of ``root``: a checkpoint path, a name->tensor mapping, or
    training shards: a list of all ranks' ``ShardedSource`` (one task per rank, then a merge-and-commit
    task), or this rank's ``ShardedSource`` when every rank runs the flow (the rank's steps run inside
    the flow; rank 0 commits; see ``flows.shard_publish``)."""
    result = pipeline.run_publish(
        root, source, step, keyframe, storage_options, options, tasks=PREFECT_TASKS, attempt=attempt
    )
    return asdict(result)


@flow(name="dcr-receive-refit", validate_parameters=False, log_prints=True)
def receive_refit(
    root: str,
    receiver_id: str,
    target: Any,
    step: int | None = None,
    storage_options: dict | None = None,
    options: Any = None,
    state_path: str | None = None,
) -> dict:
    """Bring ``target`` (a state file path, or a module with ``load_weights``) to ``step``."""
    if isinstance(target, (str, os.PathLike)):
        result = pipeline.run_receive(
            root, receiver_id, os.fspath(target), step, storage_options, options, tasks=PREFECT_TASKS
        )
        return asdict(result)
    return receive_into_module(
        root, receiver_id, target, step, storage_options, options, state_path, tasks=PREFECT_TASKS
    )
