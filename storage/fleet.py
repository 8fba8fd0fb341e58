"""A fleet's record: ``fleets/NAME.json``, the policy version a fleet of engines serves.

``dcr fleet`` (``flows.receive.fleet``) writes it after every switch, whatever the outcome, once it
has asked every member which step it serves, so a router or a trainer reads one small object to
know which step the fleet's rollouts come from:

- ``members``: each engine's URL, receiver id, the step it said it serves when asked after the
  switch (``step``; None: unknown, it did not answer or serves no step DCR set), the switch's
  outcome for it (and its error, if any), its pause;
- ``version``: the step every member serves; None when they do not all serve one known step;
- ``outcome``: ``mixed`` when members serve different steps (a member that is unknown does not
  make members that agree mixed). Otherwise what the switch did: ``switched`` (every member serves
  ``target``), ``unchanged`` (they already did), ``unconfirmed`` (every member applied the target,
  but not every one said so when asked), ``aborted`` (a member failed to prepare: nobody
  switched), ``taken-back`` (a member failed to apply: the others were taken back to their
  previous step; see each member's); ``switching``: written before the first member changes, a
  switch to ``target`` is under way (or its coordinator died in it): each member it updates is
  ``switching``, its step unknown, and there is no version, until the switch's own record;
- ``target`` and ``previous``: the step this switch aimed at and the version before it;
- ``epoch`` (the lease's epoch of the coordinator that wrote it, ``storage.fleet_lease``),
  ``generation`` (1, 2, ...: one per record) and ``coordinator`` (the lease holder's id);
- ``at`` / ``at_utc``: when (the coordinator's clock).

Records written before epochs existed have no ``epoch``, ``generation`` nor ``coordinator``, and
their members' ``step`` is what that coordinator expected rather than what it read back; they
read as they are.

How a record is written, atomically on every backend. Each record is first created, only if
absent, as ``fleets/NAME/records/<generation:012d>.json``, generation one above the newest (the
last ``KEEP`` are kept). A coordinator writes only if its epoch is no older than the newest
record's: an older one (a coordinator that lost its lease) is refused (``FencedError``); two racing
for one generation: one creates it, the other looks again and is refused or goes one higher. So
the records' epochs never go down, whatever the interleaving. Then the record is copied to
``fleets/NAME.json`` (the object readers know), and the writer looks again: if a newer generation
exists meanwhile, it copies that one instead, until what it wrote last is the newest. A writer
killed between the two leaves ``fleets/NAME.json`` one record behind; ``read`` takes whichever of
it and the newest generation is newer.

The record is advisory (unsigned): engines verify every step they load against the publisher's
signature and digests whatever it says. It is validated with pydantic on read: a damaged or foreign
object is refused in one line naming it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dcr_core import events
from dcr_core.clock import SYSTEM, Clock
from dcr_core.errors import DCRError, FencedError, IntegrityError
from storage import fleet_lease, layout
from storage.document_fields import fail
from storage.root import Root

FORMAT: Final = "dcr-fleet"
MAX_FLEET_BYTES = 1 << 20
KEEP = 8  # record generations kept (the newest included)
POINTER_TRIES = 5  # copies of a newer generation to fleets/NAME.json before leaving it to that one's writer

MemberOutcome = Literal["switched", "unchanged", "not-switched", "failed", "taken-back", "switching"]
Outcome = Literal["switched", "unchanged", "unconfirmed", "aborted", "taken-back", "mixed", "switching"]


class Member(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    receiver: str
    step: int | None = Field(default=None, ge=0, le=layout.MAX_STEP)  # what it serves now (None: unknown)
    outcome: MemberOutcome
    error: str | None = None
    pause_seconds: float = Field(default=0.0, ge=0)
    bytes_pulled: int | None = Field(default=None, ge=0)  # by its prepare for this switch (None: not known)


class FleetRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["dcr-fleet"] = FORMAT
    fleet: str
    version: int | None = Field(ge=0, le=layout.MAX_STEP)
    target: int = Field(ge=0, le=layout.MAX_STEP)
    previous: int | None = Field(default=None, ge=0, le=layout.MAX_STEP)
    outcome: Outcome
    members: list[Member]
    at: float
    at_utc: str = ""
    epoch: int | None = Field(default=None, ge=1, le=layout.MAX_STEP)
    generation: int | None = Field(default=None, ge=1, le=layout.MAX_STEP)
    coordinator: str | None = None


def version_of(steps: list[int | None]) -> int | None:
    """The step every member serves; None when they do not all serve one known step."""
    known = set(steps)
    return known.pop() if len(known) == 1 and None not in known else None


def served_outcome(switch: Outcome, target: int, steps: list[int | None]) -> Outcome:
    """The record's outcome from what the switch did (``switch``) and what the members said they
    serve when asked afterwards (``steps``; None: unknown): see the module docstring."""
    known = {s for s in steps if s is not None}
    if len(known) > 1:
        return "mixed"
    if switch in ("switched", "unchanged") and (None in steps or known != {target}):
        return "unconfirmed"
    return switch


# -- writing ------------------------------------------------------------------------------------------


def record(root: Root, rec: FleetRecord, clock: Clock = SYSTEM) -> FleetRecord:
    """Write ``rec`` as its fleet's newest record (dated now if it is not), as the module docstring
    says: ``FencedError`` if a newer epoch's record exists. A record with no epoch (written by no
    lease holder) is written as the newest whatever the epochs before it."""
    at = rec.at or clock.time()
    rec = rec.model_copy(update={"at": at, "at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))})
    name = rec.fleet
    records = layout.fleet_records_dir(name)
    while True:
        generation, newest = _newest(root, name, strict=False)
        if newest is not None and rec.epoch is not None and (newest.epoch or 0) > rec.epoch:
            raise FencedError(f"fleet {name}: its record (generation {generation}) was written at epoch {newest.epoch}, "
                              f"newer than this coordinator's epoch {rec.epoch}: another coordinator took over; "
                              "nothing recorded")
        mine = rec.model_copy(update={"generation": generation + 1})
        data = mine.model_dump_json(indent=1).encode()
        if root.create_if_absent(layout.numbered_key(records, generation + 1), data):
            break
        if _generation(root, name, generation + 1, strict=False) == mine:  # ours: the create's reply was lost
            break
    events.reached("fleet.record-written", fleet=name, generation=mine.generation, epoch=mine.epoch)
    _point(root, name, mine)
    for old in _generations(root, name)[:-KEEP]:
        with contextlib.suppress(FileNotFoundError, DCRError, OSError):
            root.remove(layout.numbered_key(records, old))
    return mine


def _point(root: Root, name: str, rec: FleetRecord) -> None:
    """Copy ``rec`` to ``fleets/NAME.json``, then the newest generation while one newer than what
    was copied appears (a writer that raced this one)."""
    for _ in range(POINTER_TRIES):
        root.write(layout.fleet_key(name), rec.model_dump_json(indent=1).encode())
        generation, newest = _newest(root, name, strict=False)
        if newest is None or generation <= (rec.generation or 0):
            return
        rec = newest


# -- reading ------------------------------------------------------------------------------------------


def _parse(data: bytes, where: str, name: str) -> FleetRecord:
    try:
        rec = FleetRecord.model_validate_json(data)
    except ValidationError as e:
        first = e.errors()[0]
        raise fail(where, f"not a DCR fleet record ({'.'.join(map(str, first['loc'])) or 'document'}: {first['msg']})"
                   ) from None
    if rec.fleet != name:
        raise fail(where, f"names fleet {rec.fleet!r}")
    return rec


def _generations(root: Root, name: str) -> list[int]:
    found = (layout.parse_numbered(n) for n in root.listdir(layout.fleet_records_dir(name)))
    return sorted(g for g in found if g is not None and g >= 1)


def _generation(root: Root, name: str, generation: int, strict: bool = True) -> FleetRecord | None:
    """Record generation ``generation`` (None: gone; a damaged one raises, or with ``strict=False`` is None)."""
    key = layout.numbered_key(layout.fleet_records_dir(name), generation)
    try:
        rec = _parse(root.read(key, limit=MAX_FLEET_BYTES), f"{root.url}/{key}", name)
    except FileNotFoundError:
        return None
    except IntegrityError:
        if strict:
            raise
        return None
    if rec.generation != generation:
        if strict:
            raise fail(f"{root.url}/{key}", f"says generation {rec.generation}")
        return None
    return rec


def _newest(root: Root, name: str, strict: bool = True) -> tuple[int, FleetRecord | None]:
    """The newest generation number (0: none) and its record (None: none; damaged and not ``strict``)."""
    generations = _generations(root, name)
    if not generations:
        return 0, None
    return generations[-1], _generation(root, name, generations[-1], strict)


def read(root: Root, name: str) -> FleetRecord | None:
    """The record of fleet ``name`` (the newer of ``fleets/NAME.json`` and its newest generation), or
    None if it never switched."""
    key = layout.fleet_key(name)
    try:
        pointed: FleetRecord | None = _parse(root.read(key, limit=MAX_FLEET_BYTES), f"{root.url}/{key}", name)
    except FileNotFoundError:
        pointed = None
    generation, newest = _newest(root, name)
    if newest is not None and (pointed is None or (pointed.generation or 0) < generation):
        return newest
    return pointed


def names(root: Root) -> list[str]:
    """The fleets that have a record (or a lease) in ROOT."""
    out = set()
    for n in root.listdir(layout.FLEETS_DIR):
        candidate = n[:-5] if n.endswith(".json") else n
        try:
            layout.fleet_key(candidate)
        except ValueError:
            continue
        out.add(candidate)
    return sorted(out)


def lease_holder(root: Root, name: str, now: float | None = None) -> fleet_lease.LeaseRecord | None:
    """The lease of a coordinator switching fleet ``name`` now, or None (``storage.fleet_lease``)."""
    _, rec = fleet_lease.newest(root, name)
    return rec if fleet_lease.is_held(rec, time.time() if now is None else now) else None
