"""Named points a refit passes: progress events for listeners, and failpoints for fault tests.

Code says where it is with ``reached("chunk.stored", key=key, nbytes=n)``. Listeners
(``listening``) receive ``(point, fields)``: a progress display, a logger, a test counting chunks.

A failpoint turns a point into a fault, in the spirit of etcd's gofail: ``DCR_FAILPOINTS`` (read
when this module is imported) or ``set_failpoints`` holds ``POINT[@N]=ACTION`` entries separated by
commas, ``N`` being the N-th time this process reaches the point (default 1):
- ``pause``: write ``dcr: failpoint POINT@N reached (pid P)`` to stderr, then block for good; a
  test kills the process there, so the kill provably lands at that point;
- ``exit``: write the same line, then ``os._exit(137)``: a crash that runs no cleanup, like kill -9;
- ``raise``: raise ``FailpointError``, a ``BaseException`` that stands for the process dying there
  (no ``except Exception`` handler or retry swallows it); for in-process fault tests;
- ``fail``: raise ``FailpointFault``, an ordinary ``RuntimeError``: an error the code is expected
  to survive (a failed read, a reload that breaks), where ``raise`` stands for dying;
- ``report``: write the same line, then go on: a test waits for it to know that another process
  got there (a follower is polling) instead of sleeping for a guess;
- ``sleep(S)``: wait S seconds, then go on (silently): widens a race window. ``POINT@*=sleep(S)``
  sleeps every time the point is reached.

With no listener and no failpoint, ``reached`` is one global check. Points are listed in
``POINTS`` so tests and docs name real ones; reaching an unlisted point is a programming error.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

POINTS = frozenset({
    # the command line, before it imports the modules of the command it runs
    "cli.importing",
    # progress of long work: the bytes a run will handle, then each tensor handled (raw bytes)
    "work.planned", "tensor.done",
    # publisher
    "chunk.stored", "chunk.fetched", "pack.stored",
    "publish.planned", "publish.tensors-stored", "publish.manifest-written",
    "publish.committed", "publish.baseline-kept", "publish.baseline-patched-record",
    # the commit: the base found live (then the marker is created), and a base retracted meanwhile
    "publish.base-checked", "publish.base-retracted",
    # streaming: a publisher's stream index written; a receiver's index read, a chunk prefetched
    "stream.index-written", "stream.index-read", "stream.chunk-prefetched",
    # a chunk a stream index names but the follower will not fetch before the commit (Prefetcher.admits)
    "stream.chunk-skipped",
    # a rank of a sharded publish
    "publish.rank-partial-written",
    # a group of tensors of a mapped publish (flows.publish.groups), where its task runs
    "publish.group-started", "publish.group-done", "publish.group-baseline-rebuilt",
    # ... and in the flow's process, as each group's result comes back (in group order)
    "publish.group-returned",
    # a group of tensors of a receive rewriting its state on workers (flows.receive.on_workers), where its task runs
    "receive.group-started", "receive.group-done",
    # receiver (state file)
    "receive.planned", "receive.leased", "receive.tensor-staged", "receive.staged",
    "receive.journal-written", "receive.patch-record", "receive.rollback-record", "receive.patch-written",
    "receive.blocks-hashed", "receive.blocks-written",
    "receive.patched", "receive.settled", "receive.replaced",
    # a directory materialized (storage.local.dir_swap): the swap's journal written, the new directory
    # in place; where there is no exchange, the old one moved aside first
    "receive.swap-journaled", "receive.moved-aside", "receive.swapped",
    "receive.recorded",
    # receiver (an engine): each tensor handed to the engine's reload, then the reload done
    "receive.engine-tensor", "receive.engine-reloaded",
    # a fleet member (flows.receive.fleet): before what it holds alone is taken (in the one order of
    # every coordinator); its update, once paused, before anything changes
    "fleet.member-hold", "fleet.member-update",
    # a fleet's coordinator lease (storage.fleet_lease): taken (at its epoch), waited for (held by
    # another), renewed; the members asked their step after a switch; the fleet's record created
    # (before fleets/NAME.json is pointed at it)
    "fleet.lease-taken", "fleet.lease-waiting", "fleet.lease-renewed", "fleet.read-back", "fleet.record-written",
    # a mirror: each object copied downstream, a step's payload complete, its marker copied
    "mirror.object-copied", "mirror.payload-copied", "mirror.committed",
    # a streaming mirror: a pack forwarded whole (its announced chunks tile it, each checked); an
    # upstream stream index forwarded downstream (its chunks and packs first)
    "mirror.pack-forwarded", "mirror.index-forwarded",
    # a follower (receive --follow, mirror --follow) looked upstream, found nothing new, and waits
    "follow.waiting",
    # maintenance
    "retract.recorded",
    "gc.planned", "gc.leases-checked", "gc.marker-deleted", "gc.step-deleted",
})

ACTIONS = ("pause", "exit", "raise", "fail", "report", "sleep(S)")
EVERY = 0  # the N of ``POINT@*``

Listener = Callable[[str, dict], None]


class FailpointError(BaseException):
    """Raised by a failpoint whose action is ``raise``: the process "dies" there."""


class FailpointFault(RuntimeError):
    """Raised by a failpoint whose action is ``fail``: an ordinary error at that point."""


_lock = threading.Lock()
_listeners: list[Listener] = []
_failpoints: dict[tuple[str, int], str] = {}
_counts: dict[str, int] = {}
_active = False


def parse_failpoints(spec: str) -> dict[tuple[str, int], str]:
    """``"a.b@3=pause,c=raise"`` -> ``{("a.b", 3): "pause", ("c", 1): "raise"}``."""
    out: dict[tuple[str, int], str] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        where, sep, action = item.partition("=")
        point, _, nth = where.partition("@")
        if not sep or not _valid_action(action) or point not in POINTS or (nth and not (nth.isdigit() or nth == "*")):
            raise ValueError(
                f"failpoint {item!r} is not POINT[@N|@*]=ACTION with ACTION one of {', '.join(ACTIONS)} "
                f"and POINT one of {', '.join(sorted(POINTS))}"
            )
        out[(point, EVERY if nth == "*" else int(nth or 1))] = action
    return out


def _valid_action(action: str) -> bool:
    if action.startswith("sleep(") and action.endswith(")"):
        try:
            return 0 <= float(action[6:-1]) <= 3600
        except ValueError:
            return False
    return action in ACTIONS[:-1]


def _refresh() -> None:
    global _active
    _active = bool(_listeners or _failpoints)


def set_failpoints(spec: str | dict[tuple[str, int], str] | None) -> None:
    """Replace this process's failpoints (and restart the counts)."""
    with _lock:
        _failpoints.clear()
        _failpoints.update(parse_failpoints(spec) if isinstance(spec, str) else (spec or {}))
        _counts.clear()
        _refresh()


@contextmanager
def failpoints(spec: str) -> Iterator[None]:
    """Failpoints active for the block only (in-process fault tests)."""
    set_failpoints(spec)
    try:
        yield
    finally:
        set_failpoints(None)


@contextmanager
def listening(listener: Listener) -> Iterator[Listener]:
    """Call ``listener(point, fields)`` for every point reached in the block (any thread)."""
    with _lock:
        _listeners.append(listener)
        _refresh()
    try:
        yield listener
    finally:
        with _lock:
            _listeners.remove(listener)
            _refresh()


def listened() -> bool:
    """Whether a listener is attached (work done only for listeners can be skipped otherwise)."""
    return bool(_listeners)


def reached(point: str, **fields) -> None:
    """Report that this process reached ``point``: tell the listeners, then act on its failpoint."""
    if not _active:
        return
    if point not in POINTS:
        raise ValueError(f"unknown point {point!r}")
    with _lock:
        n = _counts[point] = _counts.get(point, 0) + 1
        action = _failpoints.get((point, n)) or _failpoints.get((point, EVERY))
        listeners = list(_listeners)
    for listener in listeners:
        listener(point, fields)
    if action is None:
        return
    if action.startswith("sleep("):
        time.sleep(float(action[6:-1]))
        return
    if action == "raise":
        raise FailpointError(f"failpoint {point}@{n}")
    if action == "fail":
        raise FailpointFault(f"failpoint {point}@{n}: injected failure")
    sys.stderr.write(f"dcr: failpoint {point}@{n} reached (pid {os.getpid()})\n")
    sys.stderr.flush()
    if action == "report":
        return
    if action == "exit":
        os._exit(137)
    while True:  # pause: wait to be killed
        time.sleep(3600)


set_failpoints(os.environ.get("DCR_FAILPOINTS") or None)
