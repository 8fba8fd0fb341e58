"""Waiting for ROOT: the one poller, and a follower's streaming (fetch the step being built while it waits).

``poll`` waits for something to appear in ROOT: ``dcr receive --follow``, the ranks of a sharded
publish waiting for each other and for the commit, and this module's followers.

Shared by receivers (``dcr receive --follow --stream``: a ``Prefetcher`` holds the chunks for the
refit) and mirrors (``dcr mirror --follow --stream``: a ``Forwarder`` copies them downstream).

Each poll of ``dcr receive --follow --stream`` also reads ``building.json`` (``storage.stream``); when
it names a step newer than the state and not yet committed, a ``Prefetcher`` fetches and verifies
that attempt's chunks as the publisher stores them. The wait between polls ends as soon as the
prefetcher sees the step's marker, and the refit that follows takes the prefetched chunks instead
of reading them (``storage.held_chunks``): the same refit, the same checks, the same outcome as
without streaming, only earlier. A newer announcement (a publisher that retried, or the next step)
replaces the prefetch and drops what it held; so does the end of each refit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from dcr_core.errors import DCRError, StepConflictError
from storage.catalog import Catalog
from storage.chunk_io import IO_WORKERS
from storage.held_chunks import PREFETCHED
from storage.prefetch import Prefetcher, marker_exists
from storage.root import Root, RootRef, open_root
from storage.stream import read_building

FOLLOW_INTERVAL = 5.0  # seconds a follower (dcr receive --follow, dcr mirror --follow) waits between looks

T = TypeVar("T")


def poll(check: Callable[[], T | None], what: str, timeout: float | None = None,
         interval: float = 0.25, first: float = 0.01, sleep: Callable[[float], object] = time.sleep) -> T:
    """Call ``check`` until it returns something other than None and return that. Waits ``first``
    seconds after the first miss, doubling up to ``interval``; raises ``StepConflictError`` after
    ``timeout`` seconds (None: wait for good). Errors ``check`` raises end the wait. ``sleep(s)``
    waits between checks (it may return early: a streaming follower wakes on the commit)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = min(first, interval)
    while True:
        out = check()
        if out is not None:
            return out
        if deadline is not None and time.monotonic() > deadline:
            raise StepConflictError(f"{what}: timed out after {timeout:.0f} s; nothing committed")
        sleep(delay)
        delay = min(interval, delay * 2)


STREAMING_POLL = 0.5


class Streaming:
    """``start(root, step, attempt, workers)`` makes the (unstarted) ``Prefetcher`` of an announced
    attempt; by default one that holds chunks for this process's refits."""

    def __init__(self, root: RootRef, workers: int = IO_WORKERS, budget: int | None = None,
                 start: Callable[[Root, int, str, int], Prefetcher] | None = None):
        self.root, self.workers = root, workers
        self.make = start or (lambda r, step, attempt, workers, trusted: Prefetcher(r, step, attempt, workers=workers,
                                                                                   trusted=trusted))
        if budget is not None:
            PREFETCHED.budget = budget
        self.current: Prefetcher | None = None
        self._trusted: tuple[int | None, dict] = (None, {})  # (held step, its schema and grids)
        self.started: list[tuple[int, str]] = []  # (step, attempt) of every prefetch begun
        self.last: dict | None = None  # what the last prefetch fetched before it ended

    def watch(self, held: int | None) -> None:
        """Start prefetching the step ``building.json`` names, if it is newer than ``held`` and not
        committed yet (and not being prefetched already)."""
        root = open_root(self.root)
        b = read_building(root)
        if b is None or (held is not None and b.step <= held):
            return
        cur = self.current
        if cur is not None and (cur.step, cur.attempt) == (b.step, b.attempt):
            return
        if marker_exists(root, b.step):
            return  # committed already: the refit reads it as usual
        self.close()
        self.current = self.make(root, b.step, b.attempt, self.workers, self.trusted(root, held)).start()
        self.started.append((b.step, b.attempt))

    def trusted(self, root: Root, held: int | None) -> dict:
        """Tensor -> (dtype, chunk grid) of committed step ``held`` (from its verified manifest): what
        the prefetch of the next step may decode before that step commits (``Prefetcher.admits``).
        Nothing when the follower holds no step (or its step is gone): it reads everything after the
        commit."""
        if held is None:
            return {}
        if self._trusted[0] != held:
            try:
                m = Catalog(root).manifest(held)
                grids = {n: (e.dtype, e.grid) for n, e in m.tensors.items()}
            except DCRError:
                grids = {}
            self._trusted = (held, grids)
        return self._trusted[1]

    def sleep(self, seconds: float) -> None:
        """Wait between polls. While a step is prefetched its prefetcher watches the marker and this
        returns the moment it appears, so the follower's own polls (a listing and a GET each) slow to
        one per ``STREAMING_POLL`` seconds: they would load the store the publisher is writing to."""
        if self.current is None or not self.current.active:
            time.sleep(seconds)
        else:
            self.current.wait(max(seconds, STREAMING_POLL))

    def done(self, step: int) -> None:
        """A refit reached ``step``: end a prefetch of that step or an older one."""
        if self.current is not None and self.current.step <= step:
            self.close()

    def close(self) -> None:
        """Stop the prefetch and drop what it still holds."""
        if self.current is not None:
            cur = self.current
            cur.close()
            self.last = {"step": cur.step, "attempt": cur.attempt, "indexes": cur.indexes, "chunks": cur.chunks,
                         "bytes": cur.bytes, "error": cur.error}
            self.current = None
