"""``dcr receive --follow``: apply every newly committed step as it appears, and keep going.

Only commit markers make a step visible, so an attempt still being written (or abandoned) is never
applied. Each poll is one fresh listing of ``steps/`` plus reads of new markers; a refit runs only
when a committed step newer than the receiver's state exists. A follower rides out what passes: an
object store that is unreachable for a while, a step deleted under it by ``dcr gc``, a damaged
object someone repairs; it says so on each retry and waits longer each time (up to a minute). It
stops on what retrying cannot fix: bad arguments, a state that is not what it claims or a ROOT
rolled back behind it (``StateMismatchError``), and what must not be trusted (``UntrustedError``:
an unsigned or forged marker, a marker of another run, a link or special file below ROOT).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from dcr_core import events
from dcr_core.errors import IntegrityError, StateMismatchError, StepNotFoundError, UntrustedError
from flows.options import ReceiveOptions
from flows.receive.pipeline import run_receive
from flows.results import ReceiveResult
from flows.streaming import FOLLOW_INTERVAL, Streaming, poll
from storage import heartbeat
from storage.access import StoreUnreachableError
from storage.catalog import Catalog
from storage.heartbeat import StaleRootError
from storage.local import state
from storage.retry import is_transient
from storage.root import RootRef, open_root

MAX_BACKOFF = 60.0


def worth_retrying(e: BaseException) -> bool:
    if isinstance(e, StaleRootError):
        return True  # a publisher between heartbeats, or a mirror catching up: said, and waited for
    if isinstance(e, (StateMismatchError, UntrustedError)):
        return False  # a state that lies, a forged or foreign marker, a link: someone must look
    # an endpoint down (or refusing access) after the storage layer's retries: it may come back
    return isinstance(e, (IntegrityError, StepNotFoundError, StoreUnreachableError)) or is_transient(e)


def follow(
    root: RootRef, state_path: str, receive: Callable[[int], object], interval: float = FOLLOW_INTERVAL,
    until_step: int | None = None, warn: Callable[[str], None] | None = None, stream: Streaming | None = None,
    max_staleness: float | None = None,
) -> Iterator:
    """Yield ``receive(step)`` for every committed step newer than the state; stop once the state
    holds ``until_step`` or later (None: follow for good). ``warn`` hears every failure retried.
    ``stream``: also prefetch each step while it is being published (``flows.streaming``).
    ``max_staleness``: every poll also checks the ROOT's heartbeat (``storage.heartbeat``), so a ROOT
    that stopped moving is said (and retried) even when no new step comes."""
    def newer() -> int | None:
        held = state.peek_step(state_path)
        if stream is not None:
            stream.watch(held)
        cat = Catalog(open_root(root))  # opened on first use: an endpoint down now is retried
        if max_staleness is not None:
            heartbeat.check_fresh(cat.root, max_staleness, cat.key)
        latest = cat.latest_committed()
        if latest is not None and (held is None or latest > held or (latest < held and cat.retraction(held))):
            return latest  # newer, or back from a step that was retracted
        events.reached("follow.waiting", held=held)
        return None

    backoff = interval
    while True:
        held = state.peek_step(state_path)
        if until_step is not None and held is not None and held >= until_step:
            return
        try:
            step = poll(newer, f"{root.url}: waiting for a step after {held}", interval=interval, first=interval,
                        sleep=time.sleep if stream is None else stream.sleep)
            try:
                result = receive(step)
            except BaseException:
                if stream is not None:
                    stream.close()
                raise
            if stream is not None:
                stream.done(step)  # drops what the refit did not take
        except Exception as e:  # sorted below: retried or re-raised
            if not worth_retrying(e):
                raise
            delay = min(MAX_BACKOFF, backoff)
            backoff = min(MAX_BACKOFF, backoff * 2)
            if warn is not None:
                warn(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; retrying in {delay:.1f} s")
            time.sleep(delay)
            continue
        backoff = interval
        yield result


def follow_receive(
    root: str, receiver_id: str, state_path: str, storage_options: dict | None = None,
    options: ReceiveOptions | None = None, stream: bool = False, interval: float = FOLLOW_INTERVAL,
    until_step: int | None = None, warn: Callable[[str], None] | None = None,
) -> Iterator[ReceiveResult]:
    """``dcr receive --follow [--stream]`` in Python: yield the result of every refit of the state
    file at ``state_path`` as new steps are committed (with ``stream``, fetched while published)."""
    ref = RootRef(str(root), dict(storage_options or {}))
    streaming = Streaming(ref, (options or ReceiveOptions()).io_workers) if stream else None

    def receive(step: int) -> ReceiveResult:
        return run_receive(ref.url, receiver_id, state_path, step, ref.storage_options, options)

    yield from follow(ref, str(state_path), receive, interval, until_step, warn, streaming,
                      (options or ReceiveOptions()).max_staleness)
