"""Hashing beside the work that produces the bits: one ordered thread per stream of digests.

BLAKE3 releases the GIL, so a chunk hashed on a lane overlaps reading, XORing and encoding the next
one on the caller's thread. A digest is a sequence of updates, so a lane is one ordered thread, not
a pool. At most ``depth`` jobs wait: the caller never runs further ahead, so the buffers held for
hashing stay bounded (a caller that reuses ``depth + 1`` buffers in turn never overwrites one still
being hashed). The first job that fails is remembered: no digest is given after it, and ``drain``
raises it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

LANE_MIN_BYTES = 256 << 10  # chunks smaller than this are hashed inline: a hand-off costs more than it saves


class HashLane:
    def __init__(self, name: str, depth: int = 4):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: deque[Future] = deque()
        self.depth = depth
        self._error: BaseException | None = None  # the first job that failed: no digest after it

    def _run(self, fn: Callable, args: tuple) -> None:
        if self._error is not None:
            raise self._error
        try:
            fn(*args)
        except BaseException as e:
            self._error = self._error or e
            raise

    def _digest(self, hasher) -> str:
        if self._error is not None:
            raise self._error
        return hasher.hexdigest()

    def submit(self, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` after every job submitted before it (waits while ``depth`` are pending)."""
        while len(self._pending) >= self.depth:
            self._pending.popleft().result()
        f = self._pool.submit(self._run, fn, args)
        self._pending.append(f)
        return f

    def update(self, hasher, bits) -> Future:
        """``hasher.update(bits)``, in order."""
        return self.submit(hasher.update, bits)

    def digest(self, hasher) -> Future:
        """The hex digest once every update submitted before it is in (raises if any update failed)."""
        return self._pool.submit(self._digest, hasher)

    def drain(self) -> None:
        """Wait for every job submitted so far; raises the first that failed."""
        while self._pending:
            self._pending.popleft().result()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
