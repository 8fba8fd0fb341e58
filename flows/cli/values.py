"""The typed values of ``dcr``'s numeric options.

Every numeric option is read by a ``Number``: finite and within the option's range, so a NaN, an
infinity, a negative count or a zero poll interval is a usage error (one line, exit 2: see
``flows.cli.Parser``) before anything runs, never a traceback nor a busy loop.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

# A follower or a mirror lists ROOT at most 20 times a second: a shorter interval only loads the
# store (an interval of 0 opened about 9,000 objects in 5 s) and brings nothing sooner.
MIN_POLL_INTERVAL = 0.05
# The longest wait between two rounds (a poll, a renewal, one member's answer): time.sleep and
# socket timeouts take no more than a day without overflowing on some platforms.
MAX_WAIT = 86400.0


@dataclass(frozen=True)
class Number:
    """A numeric option's type: ``kind`` (int or float) from ``lo`` (excluded if ``lo_open``) to
    ``hi``, always finite. ``unit`` names what it counts in the error (``seconds``, ``MiB``)."""

    kind: type
    lo: float
    hi: float | None = None
    lo_open: bool = False
    unit: str = ""

    def __call__(self, text: str) -> int | float:
        try:
            value = self.kind(text)
        except (TypeError, ValueError):
            value = None
        if value is None or not math.isfinite(value) or not self.admits(value):
            raise argparse.ArgumentTypeError(f"expected {self.describe()}, got {text!r}")
        return value

    def admits(self, value: float) -> bool:
        above = value > self.lo if self.lo_open else value >= self.lo
        return above and (self.hi is None or value <= self.hi)

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a number"
        unit = f" of {self.unit}" if self.unit else ""
        lo, hi = (None if x is None else f"{x:g}" if self.kind is float else str(int(x)) for x in (self.lo, self.hi))
        low = f"above {lo}" if self.lo_open else f"at least {lo}"
        if hi is None:
            return f"{what}{unit} {low}"
        if self.lo_open:
            return f"{what}{unit} {low} and at most {hi}"
        return f"{what}{unit} from {lo} to {hi}"


POLL_INTERVAL = Number(float, MIN_POLL_INTERVAL, MAX_WAIT, unit="seconds")
SECONDS = Number(float, 0, MAX_WAIT, lo_open=True, unit="seconds")
WAIT = Number(float, 0, MAX_WAIT, unit="seconds")  # 0: not at all
WORKERS = Number(int, 1, 1024)
