"""kill -9 (or another signal) of a real ``dcr`` process at a point it reports reaching (``dcr_core.events``).

The process runs with ``DCR_FAILPOINTS=POINT=pause``: on reaching POINT it writes
``dcr: failpoint POINT reached`` to stderr and blocks; the test then sends SIGKILL. So a kill
lands exactly where the test says, and ``kill_at`` proves it: it fails if the process exits
without reaching the point, and checks that SIGKILL (not a normal exit) ended it. ``signal_at``
sends any signal there (SIGINT: Ctrl-C) and returns how the process ended.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kill_at(point: str, *args, env: dict | None = None, timeout: float = 120.0) -> str:
    """Run ``dcr ARGS`` until it reaches ``point`` (``name`` or ``name@N``), SIGKILL it there, and
    return what it wrote to stderr before dying."""
    rc, before, _ = signal_at(point, signal.SIGKILL, *args, env=env, timeout=timeout)
    assert rc == -signal.SIGKILL, f"dcr {args[0]} ended with {rc}, not by the kill at {point}"
    return before


def signal_at(point: str, signum: int, *args, env: dict | None = None,
              timeout: float = 120.0) -> tuple[int, str, str]:
    """Run ``dcr ARGS`` until it reaches ``point``, send it ``signum`` there and wait for its end:
    its exit code, what it wrote to stderr up to the point, and what it wrote after."""
    spec = point if "@" in point else f"{point}@1"
    e = {**os.environ, "DCR_ORCHESTRATOR": "none", **(env or {}), "DCR_FAILPOINTS": f"{spec}=pause"}
    # The signal's default disposition in the child: a suite started in the background of a
    # non-interactive shell inherits SIGINT ignored, and Python then installs no KeyboardInterrupt.
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *map(str, args)], cwd=REPO, env=e,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=None if signum == signal.SIGKILL else lambda: signal.signal(signum, signal.SIG_DFL))
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr] + [lines.put(None)], daemon=True).start()
    seen, after = [], []
    try:
        while True:
            line = lines.get(timeout=timeout)
            if line is None:
                proc.wait()
                raise AssertionError(f"dcr {args[0]} exited ({proc.returncode}) without reaching {spec}: {''.join(seen)[-800:]}")
            seen.append(line)
            if line.startswith(f"dcr: failpoint {spec} reached"):
                break
        proc.send_signal(signum)
        proc.wait(timeout=30)
        while (line := lines.get(timeout=timeout)) is not None:
            after.append(line)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(seen), "".join(after)


def sweep(cases: list, default: set, key=None) -> list:
    """A kill sweep's cases for ``pytest.mark.parametrize``: those whose ``key`` (the case, or the
    case's point) is in ``default`` run in the default suite, every other one with the slow suite
    (``make test-slow``), so each sweep keeps a representative in every run."""
    def k(c):
        return key(c) if key else (c[0] if isinstance(c, tuple) else c)

    return [c if k(c) in default else pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=pytest.mark.slow)
            for c in cases]
