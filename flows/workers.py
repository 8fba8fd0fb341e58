"""Where a flow's mapped tasks run: in the flow's process (the default), on a ``LocalCluster`` of N
worker processes on this machine (``--workers N``), or on an existing Dask cluster
(``--workers dask://HOST:PORT``), through prefect-dask's ``DaskTaskRunner``.

Only mapped steps travel: a publish's ``encode-group`` (``flows.publish.groups``), a rewriting
receive's or a materialize's ``rewrite-group`` (``flows.receive.on_workers``), verify's
``verify-tensors`` and mirror's ``copy-object-batch``; the other steps of a flow run in its own
process, as without workers. A mapped task takes references only (a ROOT, file paths, the plan, its
group) and returns small results (manifest entries, counts); what it reads it reads where it runs. Retries belong to Dask: a task whose worker dies (kill -9, out of memory)
is run again on another worker, up to the scheduler's ``allowed-failures``; since a group's output
is a function of its input and every object write is atomic, a task run twice stores the same
bytes. Losing the scheduler fails the flow before anything is committed (the manifest and the
commit marker are written by the flow, after every group succeeded): run it again.

prefect-dask and distributed are imported only when workers are asked for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

from dcr_core.errors import DCRError, UsageError
from storage.backends import registry
from storage.root import RootRef

WorkersSpec = int | str | None
PRELOAD = "flows.prefect_flows"  # imported by every worker as it starts (``dask worker --preload``)
# The workers of a LocalCluster print to this command's terminal: Prefect's per-task INFO lines stay
# off it (they still reach the Prefect API); the command prints its own result.
QUIET_WORKERS = {"PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING"}
_ADDRESS = re.compile(r"^dask://([^\s/:]+|\[[0-9a-fA-F:.]+\]):(\d{1,5})$")


class WorkersLostError(DCRError):
    """The Dask cluster could not finish a mapped step (a task killed its workers, the scheduler
    went away): nothing was committed; the flow can be run again."""

    exit_code = 1


def parse_workers(spec: WorkersSpec) -> int | str | None:
    """``None`` or 0: no workers (tasks run in the flow's process); ``N`` (an int or its digits):
    a LocalCluster of N worker processes; ``dask://HOST:PORT``: that scheduler (as ``tcp://HOST:PORT``).
    Anything else is a ``UsageError``."""
    if spec is None or spec == 0 or spec == "0":
        return None
    if isinstance(spec, bool):
        raise UsageError(f"workers must be N (worker processes) or dask://HOST:PORT, got {spec!r}")
    if isinstance(spec, int) or (isinstance(spec, str) and spec.isdigit()):
        n = int(spec)
        if not 1 <= n <= 1024:
            raise UsageError(f"workers must be 1 to 1024 worker processes, got {n}")
        return n
    m = _ADDRESS.match(spec) if isinstance(spec, str) else None
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise UsageError(f"workers must be N (worker processes) or dask://HOST:PORT, got {spec!r}")
    return f"tcp://{m.group(1)}:{m.group(2)}"


def task_runner_for(spec: WorkersSpec):
    """The ``DaskTaskRunner`` for ``spec`` (see ``parse_workers``), or None. Not started: enter it."""
    target = parse_workers(spec)
    if target is None:
        return None
    from prefect_dask import DaskTaskRunner  # noqa: PLC0415 - only when workers are asked for

    if isinstance(target, int):  # one thread per process: a task uses threads of its own
        return DaskTaskRunner(cluster_class="distributed.LocalCluster", cluster_kwargs={
            "n_workers": target, "threads_per_worker": 1, "processes": True, "host": "127.0.0.1",
            "dashboard_address": None, "preload": [PRELOAD], "env": QUIET_WORKERS})
    return DaskTaskRunner(address=target)


@contextlib.contextmanager
def entered(workers: WorkersSpec = None) -> Iterator[Any]:
    """The task runner ``workers`` names (``parse_workers``), started for the block, or None (steps
    run in this process). An existing cluster of any kind (Kubernetes, SLURM, cloud) is named by its
    scheduler's address, so a flow's parameters stay JSON."""
    runner = task_runner_for(workers)
    if runner is None:
        yield None
        return
    with runner:
        yield runner


def portable_root(ref: RootRef) -> RootRef:
    """``ref`` as a task in another process opens it: a local path made absolute. A ``memory://``
    ROOT lives in one process: ``UsageError``."""
    kind = registry.backend_class(ref.url)
    if not kind.shared_between_processes:
        raise UsageError(f"{ref.url}: a {kind.schemes[0]}:// ROOT lives in one process; workers cannot reach it")
    return ref if "://" in ref.url else dataclasses.replace(ref, url=os.path.abspath(ref.url))


def slots(task_runner) -> int:
    """How many tasks the cluster runs at once (its worker threads); 1 at least."""
    client = getattr(task_runner, "client", None)
    if client is None:
        return 1
    return max(1, sum(client.nthreads().values()))


def run_mapped(task_runner, task, items: list[dict], shared: dict, each: Callable[[Any], None] | None = None) -> list:
    """``task(**shared, **item)`` for every item, submitted to ``task_runner`` at once (Prefect's
    ``TaskRunner.submit``); the results in the items' order, each passed to ``each`` once it and
    those before it are in. The first failure is raised (the task's own exception as it is, a
    cluster failure as ``WorkersLostError``) and what has not run is dropped.

    Only Prefect's API is used. Prefect 3's futures offer ``wait`` and ``result`` but no release
    and no cancel: a result is released on the workers, and a task not started yet cancelled, by
    dropping the last reference to its future (the Dask future under it is released when it is
    garbage collected, which CPython does at once, and the scheduler forgets a key nobody wants).
    Cancelling through the Prefect API instead would cost a server round trip per task and would
    not stop Dask from running it.

    The tasks are submitted without the flow's tags (``untagged``); their flow run keeps them."""
    with untagged():
        futures: list = [task_runner.submit(task, {**shared, **item}) for item in items]
    out: list = []
    try:
        for i in range(len(futures)):
            out.append(futures[i].result())
            futures[i] = None  # its result is here: a worker lost later need not recompute it
            if each is not None:
                each(out[-1])
        return out
    except Exception as e:  # noqa: BLE001 - re-raised: the task's own error as it is, the cluster's as one line
        futures.clear()  # what has not run is dropped (see the docstring)
        raise _lost(e) or e from None


def untagged():
    """A block whose Prefect task runs carry no tags (not the ``dcr``, ``root:``, ``step:`` tags of
    the flow around them). Prefect checks a tagged task run's tag concurrency limits as it starts, a
    write to the API's database even where no limit exists; the workers of a mapped step start their
    tasks together, and on a SQLite-backed API server the writes collide ("database is locked":
    503), which the client retries only after about 2 s. With ``--workers 2`` on a 2 GB publish that
    hit one worker's first task in 4 of 11 runs, and the encode step took 3.1-3.6 s instead of
    2.0-2.4 s (docs/benchmarks.md, "Publishing on Dask workers"). Untagged, no such call is made;
    the task runs still belong to their flow run, which keeps its tags."""
    from prefect.context import TagsContext  # noqa: PLC0415 - only when workers are asked for

    return TagsContext(current_tags=set())


def _lost(e: Exception) -> WorkersLostError | None:
    """A failure of the cluster (not of the task) as one line, or None."""
    from distributed import CancelledError  # noqa: PLC0415 - only when workers are asked for
    from distributed.comm.core import CommClosedError  # noqa: PLC0415
    from distributed.scheduler import KilledWorker  # noqa: PLC0415

    why = " ".join(str(e).split()) or type(e).__name__  # one line
    if isinstance(e, KilledWorker):
        return WorkersLostError(f"a task killed every worker that ran it ({why}; out of memory?); nothing was "
                                "committed, run it again")
    if isinstance(e, (CancelledError, CommClosedError)):
        return WorkersLostError(f"lost the Dask scheduler ({type(e).__name__}: {why}); nothing was committed, "
                                "run it again")
    return None
