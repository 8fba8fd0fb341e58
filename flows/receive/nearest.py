"""Receiving from the nearest of several ROOTs: a mirror first, upstream when it lags or fails.

``receive_nearest([mirror, upstream, ...], ...)`` (``dcr receive MIRROR --fallback-root UPSTREAM``):

- the target is ``step``, or the newest step committed in any of the ROOTs (a mirror that lags does
  not hold a receiver back);
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
from storage.root import RootRef, open_root

log = logging.getLogger("dcr.receive")
# what another ROOT may not share (a mirror not created yet: RootNotFoundError); bad arguments propagate
NEXT_ROOT = (IntegrityError, StepNotFoundError, RootNotFoundError, StoreUnreachableError, FileNotFoundError, OSError)


def _as_ref(root) -> RootRef:
    if isinstance(root, RootRef):
        return root
    if isinstance(root, (str, os.PathLike)):
        return RootRef(os.fspath(root), {})
    url, options = root
    return RootRef(os.fspath(url), dict(options or {}))


def newest_step(roots: Sequence[RootRef], warn: Callable[[str], None]) -> int:
    """The newest step committed in any of ``roots`` (ROOTs that cannot be read are reported)."""
    latest = []
    for ref in roots:
        try:
            s = Catalog(open_root(ref)).latest_committed()
        except NEXT_ROOT as e:
            warn(f"{ref.url}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        if s is not None:
            latest.append(s)
    if not latest:
        raise StepNotFoundError(f"no committed step in {', '.join(r.url for r in roots)}")
    return max(latest)


def receive_nearest(
    roots: Sequence, receiver_id: str, state_path: str | os.PathLike, step: int | None = None,
    options: ReceiveOptions | None = None, warn: Callable[[str], None] | None = None,
) -> ReceiveResult:
    """Bring ``state_path`` to ``step`` (default: the newest in any ROOT) from the first of ``roots``
    that can serve it. ``roots``: URLs, ``(url, storage_options)`` pairs or ``RootRef``s, nearest first."""
    refs = [_as_ref(r) for r in roots]
    if not refs:
        raise UsageError("no ROOT to receive from")
    warn = warn or (lambda m: log.warning("%s", m))
    target = step if step is not None else newest_step(refs, warn)
    failures = []
    for ref in refs:
        try:
            if Catalog(open_root(ref)).marker(target) is None:
                failures.append(f"{ref.url}: step {target} not committed (yet)")
                continue
            return run_receive(ref.url, receiver_id, state_path, target, ref.storage_options, options)
        except NEXT_ROOT as e:  # what another ROOT may not share; bad arguments and the like propagate
            why = f"{ref.url}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            failures.append(why)
            if ref is not refs[-1]:
                warn(f"{why}; trying the next ROOT")
    raise StepNotFoundError(f"no ROOT could serve step {target}: " + "; ".join(failures))
