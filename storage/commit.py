"""The commit protocol: a step is visible exactly when its commit marker exists.

A marker is only ever created (create-if-absent, ``storage.backends``, after everything it names
is written) or deleted (by ``dcr gc``, before anything it names). Every reader starts from
markers, so no reader sees an object of an attempt that is not committed.

``commit_marker`` is the publisher's half: exactly one racing publisher of a step creates the
marker; a retry of a commit whose first try succeeded but did not report back recognises its own
marker (same attempt, same manifest digest); a loser removes its own attempt (best effort: an
unreferenced attempt is invisible anyway) and gets a ``StepConflictError``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TypeGuard

from dcr_core import events
from dcr_core.errors import DCRError, StepConflictError
from storage import heartbeat, layout, retraction, run_identity, signing
from storage.catalog import Catalog
from storage.marker import CommitMarker
from storage.root import Root

log = logging.getLogger("dcr.storage")


def _is_own(found: CommitMarker | None, marker: CommitMarker) -> TypeGuard[CommitMarker]:
    """Whether the marker ``found`` is ``marker``'s own (this attempt's, this manifest's)."""
    return found is not None and found.attempt == marker.attempt and found.manifest_digest == marker.manifest_digest


def commit_marker(root: Root, marker: CommitMarker) -> CommitMarker:
    """Create ``marker`` (signed when a signing key is set) unless the step is committed already."""
    cat = Catalog(root)
    existing = cat.marker(marker.step)
    if existing is not None:
        if _is_own(existing, marker):
            return existing
        raise _lost(root, marker, existing)
    latest = cat.latest_committed()
    if latest is not None and latest > marker.step:
        discard_attempt(root, marker.step, marker.attempt)
        raise StepConflictError(
            f"{root.url}: step {latest} was committed while step {marker.step} was being published; nothing committed"
        )
    if marker.base_step is not None and cat.retraction(marker.base_step) is not None:
        discard_attempt(root, marker.step, marker.attempt)
        raise StepConflictError(f"{root.url}: step {marker.base_step} was retracted while step {marker.step} was being "
                                "published on it; nothing committed (publish again: it builds on the newest live step)")
    events.reached("publish.base-checked", step=marker.step)
    key = signing.publisher_key()
    marker = dataclasses.replace(marker, run=run_identity.ensure(root, marker.step, key.algorithm if key else None).run_id)
    if key is not None:
        marker = dataclasses.replace(marker, signature=key.sign(marker.body()), signature_algorithm=key.algorithm)
    if root.create_if_absent(layout.commit_key(marker.step), marker.to_json()):
        _unless_base_retracted(root, marker, key)
        heartbeat.beat_after(root, key, f"step {marker.step} committed")
        return marker
    winner = Catalog(root).marker(marker.step)
    if _is_own(winner, marker):
        return winner
    raise _lost(root, marker, winner)


def _unless_base_retracted(root: Root, marker: CommitMarker, key: signing.Key | None) -> None:
    """``dcr retract`` of the base may have landed between the check before the commit and the
    commit: then this step retracts itself (no live step may stand on a retracted one) and says so.
    Each side looks after its own write (retract lists the steps again after its records), so one of
    the two always sees the other."""
    if marker.base_step is None or Catalog(root).retraction(marker.base_step) is None:
        return
    events.reached("publish.base-retracted", step=marker.step, base=marker.base_step)
    retraction.record(root, marker, f"its base step {marker.base_step} was retracted while it was being published", key)
    heartbeat.beat_after(root, key, f"step {marker.step} committed and retracted")
    raise StepConflictError(f"{root.url}: step {marker.base_step} was retracted while step {marker.step} was being "
                            f"published on it; step {marker.step} was committed and then retracted (publish again: it "
                            "builds on the newest live step, under a new number)")


def _lost(root: Root, marker: CommitMarker, winner: CommitMarker | None) -> StepConflictError:
    """Discard this attempt (another one is the step) and say so."""
    discard_attempt(root, marker.step, marker.attempt)
    return StepConflictError(
        f"{root.url}: step {marker.step} was committed by another publisher"
        f" (attempt {winner.attempt if winner else '?'}); this attempt was discarded"
    )


def discard_attempt(root: Root, step: int, attempt: str) -> None:
    """Best-effort removal of an attempt that lost (never referenced, so leaving it is also safe:
    ``dcr gc`` collects it)."""
    try:
        root.remove(layout.attempt_dir(step, attempt), recursive=True)
    except (OSError, ValueError, DCRError) as e:  # a publisher may lack delete permission (docs/guides/operations.md, "Permissions")
        log.info("could not remove the losing attempt %s of step %d (%s); dcr gc will", attempt, step, e)
