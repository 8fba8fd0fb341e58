"""Waiting for something to appear in ROOT: the one poller (``dcr receive --follow``, the ranks of
a sharded publish waiting for each other and for the commit)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from dcr_core.errors import StepConflictError

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
