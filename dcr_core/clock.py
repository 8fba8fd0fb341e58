"""The time a protocol reads and waits on, behind one small seam.

Code whose correctness depends on time (a fleet's lease: when it ends, how long a coordinator waits
for it) takes a ``Clock`` instead of calling ``time`` itself, so a test or a simulation can run it
against a clock it moves by hand (deterministically, with skew between parties), and production
code passes nothing (``SYSTEM``).

- ``time()``: wall-clock seconds since the epoch, what goes into stored documents (a lease's
  expiry, a record's date) and is compared across machines;
- ``monotonic()``: seconds on a clock that never goes back, for deadlines inside one process;
- ``sleep(seconds)``: wait that long.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float: ...

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The process's own clocks."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


SYSTEM: Clock = SystemClock()
