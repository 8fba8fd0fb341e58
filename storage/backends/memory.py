"""``memory://name``: fsspec's in-process filesystem (tests, demos, a publisher and its receivers
in one process).

Create-if-absent: check and write under a process-wide lock. Atomic within the process, which is
the whole extent of that filesystem; another process (a Dask worker) cannot reach it at all.
"""

from __future__ import annotations

import threading

from storage.backends.base import Backend

_LOCK = threading.Lock()


class MemoryBackend(Backend):
    schemes = ("memory",)
    form = "memory://name"
    has_latency = False  # a fetch is a copy in memory: more threads only contend for the cores
    shared_between_processes = False
    supports_conditional_create = True

    def create_if_absent(self, path: str, data: bytes) -> bool:
        with _LOCK:
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, data)
            return True
