"""Chunk objects fetched before their step was committed (streaming), held until a refit takes them.

The store is process-wide, like the manifest cache: a follower's prefetcher (``storage.prefetch``)
puts futures of verified chunk bytes here, keyed by ROOT and object key, and ``read_chunk`` takes
them instead of reading the object again. An entry records what it was verified against (digest,
stored size, dtype, the chunk's element range, the codec); it is used only for a manifest entry that
asks for exactly that, so a chunk is never applied on the strength of a stream index alone. Held
bytes are bounded (``reserve`` blocks while the budget is spent); whatever a refit does not take is
dropped with its attempt (``drop``).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass

log = logging.getLogger("dcr.stream")

DEFAULT_BUDGET = 2 << 30  # bytes of stored (compressed) chunks held at once
Verified = tuple  # (digest, nbytes, dtype, chunk_numel, start, stop, codec as JSON)


@dataclass
class _Held:
    future: Future
    verified: Verified
    nbytes: int


class Prefetched:
    def __init__(self, budget: int = DEFAULT_BUDGET):
        self.budget = budget
        self._held: dict[tuple[str, str], _Held] = {}
        self._bytes = 0
        self._cond = threading.Condition()
        self.hits = 0

    @property
    def bytes_held(self) -> int:
        return self._bytes

    def __contains__(self, item: tuple[str, str]) -> bool:
        with self._cond:
            return item in self._held

    def reserve(self, nbytes: int, stopped: threading.Event) -> bool:
        """Wait until ``nbytes`` more fit in the budget (or anything at all when nothing is held);
        False if ``stopped`` was set first."""
        with self._cond:
            while self._bytes and self._bytes + nbytes > self.budget:
                if stopped.is_set():
                    return False
                self._cond.wait(0.1)
            self._bytes += nbytes
            return True

    def put(self, url: str, key: str, verified: Verified, future: Future, nbytes: int) -> None:
        """Hold ``future`` (bytes of ``url``/``key`` verified as ``verified``); ``nbytes`` were reserved."""
        with self._cond:
            old = self._held.pop((url, key), None)
            if old is not None:
                self._release(old)
            self._held[(url, key)] = _Held(future, verified, nbytes)

    def take(self, url: str, key: str, verified: Verified) -> bytes | None:
        """The held bytes of ``url``/``key`` if they were verified exactly as ``verified`` (waiting
        for a fetch in flight), else None; the entry is gone either way."""
        with self._cond:
            held = self._held.pop((url, key), None)
        if held is None:
            return None
        try:
            if held.verified != verified:
                return None
            try:
                data = held.future.result()
            except (CancelledError, Exception) as e:  # noqa: BLE001 - a failed prefetch: the refit reads it itself
                log.info("prefetched %s/%s unusable (%s); reading it again", url, key, e)
                return None
            self.hits += 1
            return data
        finally:
            with self._cond:
                self._release(held)

    def drop(self, url: str, prefix: str = "") -> int:
        """Forget every held object of ``url`` under ``prefix`` (in-flight fetches are cancelled or
        left to finish unobserved); the number dropped."""
        with self._cond:
            gone = [k for k in self._held if k[0] == url and k[1].startswith(prefix)]
            for k in gone:
                held = self._held.pop(k)
                held.future.cancel()
                self._release(held)
        return len(gone)

    def _release(self, held: _Held) -> None:  # under the lock
        self._bytes -= held.nbytes
        self._cond.notify_all()


PREFETCHED = Prefetched()
