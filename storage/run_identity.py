"""The run a ROOT holds: an identity bound into every commit marker (and so into its signature).

Two training runs that share a signing key could otherwise swap steps: a step directory copied from
run A into run B carries a valid signature, and B's receivers would load A's weights. So the first
publish into a ROOT (or the first one by this version into an older ROOT) creates ``run.json``
(create-if-absent: racing publishers agree on the winner's id) with a random run id and the step
it starts at; every marker committed from then on names the run, and readers refuse a marker
that names another run, or none at a step the run covers. Markers written before a ROOT had a run
stay readable. A mirror of a ROOT copies ``run.json`` with the steps: it is the same run. What
this cannot stop: someone who can write the bucket replacing ``run.json`` and every step with
another run's (the whole ROOT becomes that run); one signing key per run closes that too.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from dcr_core.errors import IntegrityError, UntrustedError
from storage import layout
from storage.document_fields import document, fail, parse_int, parse_run_id
from storage.root import Root
from storage.signing import ALGORITHMS

FORMAT = "dcr-run"
MAX_RUN_BYTES = 4096


@dataclass(frozen=True)
class Run:
    run_id: str
    since_step: int  # markers of this step and later must name the run
    # the algorithm its first publisher signed with (None: unsigned, or a ROOT older than this field):
    # a reader without a key says so instead of reading a signed ROOT without a word
    signed: str | None = None

    def accepts(self, marker_run: str | None, step: int) -> bool:
        # a marker without a run was committed before the ROOT had one
        return marker_run == self.run_id or (marker_run is None and step < self.since_step)

    def check(self, marker_run: str | None, step: int, where: str) -> None:
        if self.accepts(marker_run, step):
            return
        if marker_run is None:
            raise UntrustedError(f"{where}: names no run, but run {self.run_id} covers step {step} (a marker from elsewhere?)")
        raise UntrustedError(f"{where}: commit marker of run {marker_run}, but this ROOT holds run {self.run_id} "
                             "(a step copied from another run)")


CACHE_SECONDS = 10.0
_seen: dict[str, tuple[float, Run | None]] = {}  # ROOT url -> (when read, its run) in this process


def read(root: Root, cached: bool = False) -> Run | None:
    """The ROOT's run, or None for a ROOT that has none yet. ``cached``: what this process read in
    the last ``CACHE_SECONDS`` may do (one GET per refit, not one per marker; callers read again
    when a marker disagrees with it, and a ROOT wiped and restarted is seen within seconds)."""
    hit = _seen.get(root.url)
    if cached and hit is not None and time.monotonic() - hit[0] < CACHE_SECONDS:
        return hit[1]
    where = f"{root.url}/{layout.RUN}"
    try:
        data = root.read(layout.RUN, limit=MAX_RUN_BYTES)
    except FileNotFoundError:
        _seen[root.url] = (time.monotonic(), None)
        return None
    d = document(data, where, FORMAT, "DCR run document")
    signed = d.get("signed")
    if signed is not None and signed not in ALGORITHMS:
        raise fail(where, f"'signed' must be one of {', '.join(ALGORITHMS)}")
    run = Run(parse_run_id(d.get("run_id"), where), parse_int(d.get("since_step"), where, 0, layout.MAX_STEP), signed)
    _seen[root.url] = (time.monotonic(), run)
    return run


def ensure(root: Root, step: int, signed: str | None = None) -> Run:
    """The ROOT's run, created now (starting at ``step``; ``signed``: the algorithm its steps are
    signed with) if it has none."""
    run = read(root)
    if run is not None:
        return run
    doc = {"format": FORMAT, "run_id": uuid.uuid4().hex, "since_step": step,
           "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if signed is not None:
        doc["signed"] = signed
    root.create_if_absent(layout.RUN, json.dumps(doc, indent=1).encode() + b"\n")
    run = read(root)  # this publisher's, or the one that won the race
    if run is None:
        raise IntegrityError(f"{root.url}/{layout.RUN}: created but not readable")
    return run
