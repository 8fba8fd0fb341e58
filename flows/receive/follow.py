"""``dcr receive --follow``: apply every newly committed step as it appears.

Only commit markers make a step visible, so an attempt still being written (or abandoned) is never
applied. Each poll is one fresh listing of ``steps/`` plus reads of new markers; a refit runs only
when a committed step newer than the receiver's state exists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from flows.poll import poll
from storage.catalog import Catalog
from storage.local import state
from storage.root import RootRef, open_root


def follow(
    root: RootRef, state_path: str, receive: Callable[[int], dict], interval: float = 5.0,
    until_step: int | None = None,
) -> Iterator[dict]:
    """Yield ``receive(step)`` for every committed step newer than the state; stop once the state
    holds ``until_step`` or later (None: follow for good)."""
    r = open_root(root)

    def newer() -> int | None:
        held = state.peek_step(state_path)
        latest = Catalog(r).latest_committed()
        return latest if latest is not None and (held is None or latest > held) else None

    while True:
        held = state.peek_step(state_path)
        if until_step is not None and held is not None and held >= until_step:
            return
        step = poll(newer, f"{root.url}: waiting for a step after {held}", interval=interval, first=interval)
        yield receive(step)
