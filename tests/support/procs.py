"""Stopping what a test started: SIGTERM, a few seconds' grace, then SIGKILL."""

from __future__ import annotations

import os
import signal
import time


def stop(pid: int, group: bool = False, grace: float = 5.0) -> None:
    """Stop process ``pid`` (with ``group``: its whole process group, ``pid`` being the leader)."""
    send = os.killpg if group else os.kill
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            send(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                send(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def stop_from_file(pid_file) -> None:
    with open(pid_file) as f:
        stop(int(f.read()))
