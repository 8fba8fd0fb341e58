"""A Dask ``LocalCluster`` of worker processes on 127.0.0.1 for the tests, and a worker plugin that
logs the DCR points each worker process reaches (``dcr_core.events``) to a file: which process
started and finished which group of a mapped publish or receive, or copied which object of a
mapped mirror, including processes that replace a killed
worker (plugins reach them too)."""

from __future__ import annotations

import json
import os
import threading

from distributed import LocalCluster
from distributed.diagnostics.plugin import WorkerPlugin

from dcr_core import events


def local_cluster(n_workers: int = 2) -> LocalCluster:
    return LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                        dashboard_address=None)


LOGGED = ("publish.group-", "receive.group-", "mirror.object-copied")  # the points mapped tasks reach


class EventLog(WorkerPlugin):
    """Appends ``{"pid", "point", **fields}`` for every ``LOGGED`` point a worker process reaches to ``path``."""

    name = "dcr-event-log"

    def __init__(self, path: str):
        self.path = path
        self._listening = None

    def setup(self, worker) -> None:
        lock = threading.Lock()

        def listener(point: str, fields: dict) -> None:
            if point.startswith(LOGGED):
                line = json.dumps({"pid": os.getpid(), "point": point, **fields}) + "\n"
                with lock, open(self.path, "a") as f:
                    f.write(line)

        self._listening = events.listening(listener)
        self._listening.__enter__()

    def teardown(self, worker) -> None:
        if self._listening is not None:
            self._listening.__exit__(None, None, None)


def read_log(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
