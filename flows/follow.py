"""``dcr receive --follow``: poll ROOT and apply every newly committed step as it appears.

Only commit markers make a step visible, so an attempt still being written (or abandoned) is never
applied. Each poll is one fresh listing of ``steps/`` plus reads of new markers; a refit runs only
when a committed step newer than the receiver's state exists.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict

from flows import pipeline
from flows import receive_steps as rs
from storage.catalog import Catalog
from storage.root import Root


def follow(
    root: str,
    receiver_id: str,
    state_path: str,
    storage_options: dict | None = None,
    options=None,
    interval: float = 5.0,
    until_step: int | None = None,
    orchestrated: bool = False,
    max_polls: int | None = None,
) -> Iterator[dict]:
    """Yield one result per refit applied; stop at ``until_step`` (or after ``max_polls`` polls)."""
    so = dict(storage_options or {})
    polls = 0
    while True:
        polls += 1
        held = rs.peek_state_step(state_path)
        latest = Catalog(Root(root, so)).latest_committed()
        if latest is not None and (held is None or latest > held):
            if orchestrated:
                from flows.prefect_flows import receive_refit

                yield receive_refit(root, receiver_id, state_path, latest, so, options)
            else:
                yield asdict(pipeline.run_receive(root, receiver_id, state_path, latest, so, options))
            held = latest
        if until_step is not None and held is not None and held >= until_step:
            return
        if max_polls is not None and polls >= max_polls:
            return
        time.sleep(interval)
