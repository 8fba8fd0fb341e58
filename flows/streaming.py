"""A follower's streaming: while it waits for the next commit, fetch the step being built.

Shared by receivers (``dcr receive --follow --stream``: a ``Prefetcher`` holds the chunks for the
refit) and mirrors (``dcr mirror --follow --stream``: a ``Forwarder`` copies them downstream).

Each poll of ``dcr receive --follow --stream`` also reads ``building.json`` (``storage.stream``); when
it names a step newer than the state and not yet committed, a ``Prefetcher`` fetches and verifies
that attempt's chunks as the publisher stores them. The wait between polls ends as soon as the
prefetcher sees the step's marker, and the refit that follows takes the prefetched chunks instead
of reading them (``storage.prefetched``): the same refit, the same checks, the same outcome as
without streaming, only earlier. A newer announcement (a publisher that retried, or the next step)
replaces the prefetch and drops what it held; so does the end of each refit.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dcr_core.errors import DCRError
from storage.catalog import Catalog
from storage.prefetch import Prefetcher, marker_exists
from storage.prefetched import PREFETCHED
from storage.root import Root, RootRef, open_root
from storage.stream import read_building

STREAMING_POLL = 0.5


class Streaming:
    """``start(root, step, attempt, workers)`` makes the (unstarted) ``Prefetcher`` of an announced
    attempt; by default one that holds chunks for this process's refits."""

    def __init__(self, root: RootRef, workers: int = 8, budget: int | None = None,
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
