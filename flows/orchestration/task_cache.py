"""What a flow run keeps for a rerun: a publish's finished ``encode-group`` results, nothing else.

A publish on workers keeps each finished ``encode-group`` result (its manifest entries, a few KB)
in Prefect's task cache, keyed by everything the result depends on
(``flows.publish.groups.result_key``: ROOT, step, attempt, base, options, the group's tensors, the
checkpoint's file identity) under the publisher's cache directory; the attempt of a flow run is
derived from its id (``run_attempt``), so Prefect running the same flow run again (``retries``, a
crashed deployment run retried) skips the groups that finished and encodes only the others; the
results are deleted once the step commits (``tests/system/test_workers.py``). Nothing else is
persisted or cached (``persist_result=False``, ``NO_CACHE``), because no rerun could use it: a
publish without workers encodes in one task; a receive, materialize or fleet switch plans again
from what the target holds now (a finished step is found finished by the plan, not by a cache);
verify is a report on the bucket as it is now; a mirror skips steps the destination already holds
by looking at it; gc plans from the bucket each run. What a run did is in its artifacts (tables,
the publish's links: ``flows.orchestration.reports``) and its return value.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from prefect import Task
from prefect.cache_policies import CachePolicy
from prefect.runtime import flow_run

from flows.steps import ResultCache


def cached_task(mapped: Task, cache: ResultCache, shared: dict) -> Task:
    """A step's ``mapped`` task with Prefect's task cache: its result kept (``persist_result``) in the
    run's directory (``cache.where``) under a key of everything it depends on (``cache.key``), so a
    rerun of a failed flow run finds the calls that finished Cached and runs only the others."""
    return mapped.with_options(
        persist_result=True, cache_policy=CachePolicy.from_cache_key_fn(lambda _context, params: cache.key(params)),
        result_storage=Path(cache.where(shared)), cache_expiration=datetime.timedelta(seconds=cache.seconds))


def run_attempt(attempt: str | None) -> str | None:
    """The attempt id of this flow run's publish: ``attempt`` if given, else one derived from the
    flow run's id, so that Prefect running the same flow run again (its ``retries``, a crashed
    deployment run retried) writes into the same attempt and finds its finished groups Cached; a
    new run gets a new attempt, as an in-process publish does."""
    if attempt is not None:
        return attempt
    run_id = flow_run.get_id()
    return None if run_id is None else str(run_id).replace("-", "")
