"""``dcr retract ROOT --step N``: take back step N and every step built on it.

Why: a step published by mistake (a typo'd ``--step 999999999999`` that would bar every later
number, or a bad policy update) must be taken back without rewriting history. What is taken back
is N and its descendants: every committed step whose chain of bases leads to N (a delta on N, a
delta on that, ...). A later step on another base (a keyframe, or a delta a second publisher built
on N's base) does not depend on N and stays live. Each retracted step gets a signed retraction
record (``storage.retraction``), newest first, so a retraction cut off anywhere leaves no live step
on a retracted one, and a rerun finishes it. Then the run's heartbeat is renewed (it names the
retracted steps: ``storage.heartbeat``). From then on:

- a refit's default target is the newest live step; a retracted step is no target (refused by
  name); a receiver that holds one moves back on its next receive, through the inverse deltas it
  already knows how to apply (exact), or from a restart point if gc deleted them (gc keeps the
  retraction record as a tombstone); a receiver that reads several ROOTs (``--fallback-root``)
  honours a retraction seen in any of them (``flows.receive.nearest``);
- the next publish builds on the newest live step and may take any number above it that was never
  committed: a committed number, retracted or not, is never used again;
- ``dcr ls``, ``status``, ``show`` and ``report`` mark the step retracted (no lag counts it);
  ``dcr verify --deep`` still replays it (its data is whole until gc); ``dcr mirror`` copies the record to
  the mirrors that hold the step; ``dcr gc`` may delete retracted steps (a lease still pins them),
  keeping each record;
- a publish racing a retraction of its base never leaves a live step on it (``storage.commit``).

A ROOT whose steps are signed is retracted with the same key: a receiver with the key refuses an
unsigned retraction, as it refuses an unsigned marker.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dcr_core import events
from dcr_core.errors import UsageError
from storage import heartbeat, layout, retraction, signing
from storage.catalog import Catalog, not_committed
from storage.retraction import MAX_REASON_CHARS
from storage.root import RootRef, open_root


@dataclass
class RetractResult:
    retracted: list[int] = field(default_factory=list)  # newest first
    already: list[int] = field(default_factory=list)  # were retracted before this call
    latest: int | None = None  # the newest live step now


def run_retract(root: str | os.PathLike, step: int, reason: str = "", storage_options: dict | None = None
                ) -> RetractResult:
    """Retract committed step ``step`` and every step built on it (see the module docstring)."""
    layout.check_step(step)
    if not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS:
        raise UsageError(f"the reason must be text of at most {MAX_REASON_CHARS} characters")
    r = open_root(RootRef(os.fspath(root), dict(storage_options or {})))
    cat = Catalog(r)
    marker = cat.marker(step)
    if marker is None:
        raise not_committed(r, f"step {step} is not committed; nothing to retract")
    result = RetractResult()
    key = signing.publisher_key()
    signed = marker.signature is not None or (cat.root_run() is not None and cat.root_run().signed is not None)
    if signed and key is None:
        raise UsageError(f"{r.url}: its steps are signed, so a retraction must be too; set {signing.ENV_KEY_FILE} "
                         f"(or {signing.ENV_KEY}) to the publisher's key")
    seen: set[int] = set()
    while True:  # listed again once done: a publish that committed on a retracted step meanwhile is retracted too
        todo = [s for s in descendants(cat, step) if s not in seen]
        if not todo:
            break
        for s in sorted(todo, reverse=True):
            seen.add(s)
            if cat.retraction(s) is not None or not retraction.record(r, cat.require_marker(s), reason, key):
                result.already.append(s)  # before this call, or another retraction got there first
                continue
            events.reached("retract.recorded", step=s)
            result.retracted.append(s)
        cat = Catalog(r)
    result.retracted.sort(reverse=True)
    result.already.sort(reverse=True)
    result.latest = cat.latest_committed()
    heartbeat.beat_after(r, key, "a retraction")
    return result


def descendants(cat: Catalog, step: int) -> list[int]:
    """``step`` and every committed step whose chain of bases leads to it, ascending (a base is always
    older than its step, so one pass upward finds them all)."""
    found = {step}
    for s in cat.ever_committed_steps():
        if s > step and cat.marker(s).base_step in found:
            found.add(s)
    return sorted(found)
