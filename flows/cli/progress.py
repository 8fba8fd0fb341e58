"""A progress bar for long commands: bytes handled, rate and ETA, on a terminal only.

The pipelines say what they will handle (``work.planned``: raw bytes) and each tensor they finish
(``tensor.done``) through ``dcr_core.events``; this listener draws them with tqdm on stderr. Nothing
is drawn under ``-q`` or ``--json``, when stderr is not a terminal (logs, CI, pipes), or with
``DCR_PROGRESS=0``; the bar is cleared when the command ends, before its result line.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from tqdm import tqdm

from dcr_core import events


def wanted(args) -> bool:
    if getattr(args, "quiet", False) or getattr(args, "json", False):
        return False
    if os.environ.get("DCR_PROGRESS", "").strip() in ("0", "false", "no"):
        return False
    return sys.stderr.isatty() or os.environ.get("DCR_PROGRESS", "").strip() in ("1", "true", "yes")


@contextmanager
def shown(args, label: str):
    """Show the progress of what runs inside (one bar; a new plan, e.g. after a replan, restarts it)."""
    if not wanted(args):
        yield
        return
    bar = tqdm(total=None, desc=label, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False,
               dynamic_ncols=True, mininterval=0.2)

    def listener(point: str, fields: dict) -> None:
        if point == "work.planned":
            bar.reset(total=fields["nbytes"] or None)
        elif point == "tensor.done":
            bar.update(fields["nbytes"])

    try:
        with events.listening(listener):
            yield
    finally:
        bar.close()
