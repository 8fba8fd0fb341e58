"""A clock a test moves by hand (``dcr_core.clock.Clock``): ``sleep`` advances it instead of waiting."""

from __future__ import annotations

import threading
import time


class ManualClock:
    def __init__(self, start: float | None = None):
        self._now = time.time() if start is None else start
        self._mono = 1000.0
        self._lock = threading.Lock()
        self.slept = 0.0

    def time(self) -> float:
        with self._lock:
            return self._now

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def sleep(self, seconds: float) -> None:
        self.slept += seconds
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds
            self._mono += seconds
