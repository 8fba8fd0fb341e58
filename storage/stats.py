"""Requests and bytes moved under each ROOT in this process, so what a refit moved can be measured."""

from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass


@dataclass
class IOStats:
    gets: int = 0
    bytes_read: int = 0
    puts: int = 0
    bytes_written: int = 0
    lists: int = 0
    heads: int = 0
    deletes: int = 0
    retries: int = 0

    def copy(self) -> IOStats:
        return IOStats(**asdict(self))

    def minus(self, other: IOStats) -> IOStats:
        return IOStats(**{k: v - getattr(other, k) for k, v in asdict(self).items()})


_STATS: dict[str, IOStats] = {}
_LOCK = threading.Lock()


def count(url: str, **deltas: int) -> None:
    with _LOCK:
        s = _STATS.setdefault(url, IOStats())
        for k, v in deltas.items():
            setattr(s, k, getattr(s, k) + v)


def io_stats(url: str | os.PathLike) -> IOStats:
    """A snapshot of the counters of ROOT ``url`` in this process."""
    with _LOCK:
        return _STATS.setdefault(os.fspath(url), IOStats()).copy()
