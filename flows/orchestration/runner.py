"""``PrefectRunner``: each step of a step table (``flows.steps``) run as a Prefect task, mapped steps
on a Dask cluster's workers (``flows.workers``).

Tasks do not retry: transient request errors are retried by the storage layer's one owner per
backend (``storage.retry``); everything else is DCR's verdict on the data, which a retry cannot
change. A flow run that failed can simply be run again.
"""

from __future__ import annotations

import functools
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

from flows import workers as cluster
from flows.orchestration.task_cache import cached_task
from flows.steps import Step


@functools.cache
def step_task(step: Step):
    # Nothing to persist or cache (see flows.orchestration.task_cache): every task runs every time.
    return task(step.fn, name=step.name, persist_result=False, cache_policy=NO_CACHE, retries=0)


@functools.cache
def mapped_task(step: Step):
    # Mapped tasks run on workers: their results come back through Dask, not through result
    # storage; a step with a ResultCache keeps them for a rerun (flows.orchestration.task_cache).
    return task(step.fn, name=step.name, task_run_name=_mapped_name, persist_result=False, cache_policy=NO_CACHE,
                retries=0)


def _mapped_name() -> str:
    """``encode-group-3`` (a group of tensors, numbered); ``verify-tensors-<first name>``,
    ``copy-object-batch-<first key>`` (a batch, by its first item)."""
    p = task_run.parameters
    if p.get("group") is not None:
        return f"{task_run.task_name}-{getattr(p['group'], 'index', '?')}"
    first = (p.get("names") or p.get("keys") or ("?",))[0]
    return f"{task_run.task_name}-{str(first)[-48:]}"


class PrefectRunner:
    """Runs each step as a Prefect task (call the pipeline inside a flow run); with ``task_runner``
    (a started ``DaskTaskRunner``, ``flows.workers``), mapped steps run on its workers."""

    def __init__(self, task_runner: Any = None):
        self.task_runner = task_runner

    def wrap(self, step: Step):
        return step_task(step)

    @property
    def mapped(self) -> bool:
        return self.task_runner is not None

    @property
    def slots(self) -> int:
        return cluster.slots(self.task_runner)

    def map(self, step: Step, items: list[dict], shared: dict, each=None) -> list:
        mapped = mapped_task(step) if step.cache is None else cached_task(mapped_task(step), step.cache, shared)
        return cluster.run_mapped(self.task_runner, mapped, items, shared, each)
