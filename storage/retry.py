"""Retries with exponential backoff and jitter for transient object-store failures.

Transient: connection resets and refusals, timeouts, HTTP 5xx, throttling (429 / SlowDown).
Final: not found, already exists, permission denied, bad arguments, and DCR's own errors; those
are raised at once. Every operation retried here is idempotent (whole-object PUT of the same
bytes, GET, LIST), and conditional creates report "already exists" to their caller, which checks
whether the existing object is its own.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from typing import TypeVar

from dcr_core.errors import DCRError

T = TypeVar("T")

_FINAL = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    ValueError,
    TypeError,
    KeyError,
    DCRError,
)
_TRANSIENT_TEXT = re.compile(
    r"(50[0-9]|429|SlowDown|Throttl|RequestTimeout|reset by peer|Connection.*(reset|refused|aborted|closed)|"
    r"timed? ?out|ServiceUnavailable|InternalError|ServerDisconnected|IncompleteRead|BrokenPipe)",
    re.IGNORECASE,
)


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, _FINAL):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    return bool(_TRANSIENT_TEXT.search(f"{type(exc).__name__}: {exc}"))


class RetryPolicy:
    def __init__(self, attempts: int = 5, base_delay: float = 0.1, max_delay: float = 5.0):
        self.attempts = max(1, attempts)
        self.base_delay = base_delay
        self.max_delay = max_delay

    def call(self, fn: Callable[[], T], on_retry: Callable[[int, BaseException], None] | None = None) -> T:
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except BaseException as e:
                if attempt == self.attempts or not is_transient(e):
                    raise
                if on_retry:
                    on_retry(attempt, e)
                delay = min(self.max_delay, self.base_delay * 2 ** (attempt - 1))
                time.sleep(delay * (0.5 + random.random() / 2))
        raise AssertionError("unreachable")
