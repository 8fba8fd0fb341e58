"""Receiving from the nearest of several ROOTs: a mirror first, upstream when it lags or fails.

``receive_nearest([mirror, upstream, ...], ...)`` (``dcr receive MIRROR --fallback-root UPSTREAM``):

- the target is ``step``, or the newest step live in any of the ROOTs (a mirror that lags does not
  hold a receiver back);
- a retraction seen in any of the ROOTs is honoured in all of them: a step that one ROOT shows
  retracted (its record verified, signed where the reader has a key, naming the attempt the others
  serve) is no target, whichever ROOT would serve it, so a mirror that lags behind a retraction, or
  whose record was deleted, never takes a receiver back to the retracted step (a ROOT that cannot be
  read shows nothing: ``--max-staleness`` is what refuses a mirror whose heartbeat names a
  retraction it does not show);
- the ROOTs are tried in order of preference; one that has not committed the target is skipped, and
  one whose refit fails on what another ROOT may not share (a missing or damaged object, a marker
  that does not verify, an unreachable endpoint) is reported on stderr and the next is tried;
- the first refit that succeeds is the result; it records the receiver's commit in the ROOT that
  served it. If none succeeds, the error names every ROOT and why.

Each ROOT has its own storage options (``RootRef(url, options)``). Every refit verifies as usual,
so a mirror that alters, drops or replays anything is refused by signature or digest, and the
receiver's state is untouched until a ROOT's refit has been verified whole.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

from dcr_core.errors import IntegrityError, RootNotFoundError, StepNotFoundError, UsageError
from flows.options import ReceiveOptions
from flows.receive.pipeline import run_receive
from flows.results import ReceiveResult
from storage.access import StoreUnreachableError
from storage.catalog import Catalog
from storage.marker import CommitMarker
from storage.root import RootRef, open_root

log = logging.getLogger("dcr.receive")


class RetractedElsewhereError(StepNotFoundError):
    """The target step is retracted in one of the ROOTs: no ROOT serves it."""


# what another ROOT may not share (a mirror not created yet: RootNotFoundError); bad arguments propagate
NEXT_ROOT = (IntegrityError, StepNotFoundError, RootNotFoundError, StoreUnreachableError, FileNotFoundError, OSError)


def _as_ref(root) -> RootRef:
    if isinstance(root, RootRef):
        return root
    if isinstance(root, (str, os.PathLike)):
        return RootRef(os.fspath(root), {})
    url, options = root
    return RootRef(os.fspath(url), dict(options or {}))


def _readable(roots: Sequence[RootRef], warn: Callable[[str], None]) -> list[Catalog]:
    """A catalog of each of ``roots`` that can be listed (the others are reported)."""
    cats = []
    for ref in roots:
        try:
            cat = Catalog(open_root(ref))
            cat.listed_steps()
        except NEXT_ROOT as e:
            warn(_why(ref.url, e))
            continue
        cats.append(cat)
    return cats


def _once(warn: Callable[[str], None]) -> Callable[[str], None]:
    """``warn``, saying each message once (a ROOT that cannot be read is asked about several steps)."""
    said: set[str] = set()

    def once(message: str) -> None:
        if message not in said:
            said.add(message)
            warn(message)
    return once


def _why(url: str, e: BaseException) -> str:
    return f"{url}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def retracted_in(cats: Sequence[Catalog], step: int, marker: CommitMarker, warn: Callable[[str], None]) -> str | None:
    """Where committed ``step`` (the attempt ``marker`` commits) is retracted: the first ROOT of
    ``cats`` that shows its verified retraction record, or None. A ROOT whose record cannot be read
    or does not verify is reported and shows nothing."""
    for cat in cats:
        try:
            r = cat.retraction(step)
        except NEXT_ROOT as e:
            warn(_why(cat.root.url, e))
            continue
        if r is not None and (r.attempt, r.manifest_digest) == (marker.attempt, marker.manifest_digest):
            why = f" ({r.retracted_at}: {r.reason})" if r.reason else f" ({r.retracted_at})"
            return f"{cat.root.url}{why}"
    return None


def newest_step(cats: Sequence[Catalog], warn: Callable[[str], None]) -> int:
    """The newest step live in any of the ROOTs of ``cats`` and retracted in none (a ROOT that cannot
    be read is reported)."""
    for step in sorted({s for cat in cats for s in cat.listed_steps()}, reverse=True):
        for cat in cats:
            try:
                marker = cat.marker(step) if cat.is_live(step) else None
            except NEXT_ROOT as e:
                warn(_why(cat.root.url, e))
                continue
            if marker is not None:
                if retracted_in(cats, step, marker, warn) is None:
                    return step
                break  # retracted somewhere: no ROOT serves it
    raise StepNotFoundError(f"no live step in {', '.join(c.root.url for c in cats) or 'any ROOT'}")


def receive_nearest(
    roots: Sequence, receiver_id: str, state_path: str | os.PathLike, step: int | None = None,
    options: ReceiveOptions | None = None, warn: Callable[[str], None] | None = None,
) -> ReceiveResult:
    """Bring ``state_path`` to ``step`` (default: the newest in any ROOT) from the first of ``roots``
    that can serve it. ``roots``: URLs, ``(url, storage_options)`` pairs or ``RootRef``s, nearest first."""
    refs = [_as_ref(r) for r in roots]
    if not refs:
        raise UsageError("no ROOT to receive from")
    warn = _once(warn or (lambda m: log.warning("%s", m)))
    cats = _readable(refs, warn)
    target = step if step is not None else newest_step(cats, warn)
    failures = []
    for ref in refs:
        try:
            marker = Catalog(open_root(ref)).marker(target)
            if marker is not None:
                where = retracted_in(cats, target, marker, warn)
                if where is not None:
                    raise RetractedElsewhereError(f"step {target} was retracted in {where}: no ROOT serves it")
                return run_receive(ref.url, receiver_id, state_path, target, ref.storage_options, options)
            failures.append(f"{ref.url}: step {target} not committed (yet)")
        except RetractedElsewhereError:
            raise
        except NEXT_ROOT as e:  # what another ROOT may not share; bad arguments and the like propagate
            failures.append(_why(ref.url, e))
            if ref is not refs[-1]:
                warn(f"{failures[-1]}; trying the next ROOT")
    raise StepNotFoundError(f"no ROOT could serve step {target}: " + "; ".join(failures))
