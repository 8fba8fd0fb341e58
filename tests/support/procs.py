"""The processes a test starts: stopping them (SIGTERM, a few seconds' grace, then SIGKILL), and
waiting for a line one of them prints."""

from __future__ import annotations

import os
import signal
import threading
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


class Lines:
    """A process's stream (its stderr, say) read line by line on a thread, so a test can wait for a
    line it prints (a point it reports reaching: ``DCR_FAILPOINTS=POINT=report``) instead of sleeping."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self.closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def wait_for(self, text: str, count: int = 1, timeout: float = 120.0) -> list[str]:
        """The first ``count`` lines that contain ``text``, once printed; fails if the stream ends or
        ``timeout`` passes first."""
        def matched() -> list[str]:
            return [x for x in self.lines if text in x]

        with self._cond:
            self._cond.wait_for(lambda: self.closed or len(matched()) >= count, timeout)
            found = matched()
        assert len(found) >= count, f"{count} lines with {text!r} never came: {''.join(self.lines)[-800:]}"
        return found[:count]

    def text(self, timeout: float = 60.0) -> str:
        """Everything the stream carried, once it is closed."""
        self._thread.join(timeout)
        return "".join(self.lines)


def reported(point: str) -> str:
    """The stderr line a process prints when it reaches ``point`` (``name`` or ``name@N``) under
    ``DCR_FAILPOINTS=POINT=report`` (or ``pause``/``exit``)."""
    return f"dcr: failpoint {point if '@' in point else point + '@1'} reached"
