"""A fleet's record: ``fleets/NAME.json``, the policy version a fleet of engines serves.

``dcr fleet`` (``flows.receive.fleet``) writes it after every switch, whatever the outcome, so a
router or a trainer reads one small object to know which step the fleet's rollouts come from:

- ``version``: the step every member serves (None when the members are left on different steps,
  which ``outcome: "mixed"`` says; the members' own entries say where each is);
- ``target`` and ``previous``: the step this switch aimed at and the version before it;
- ``outcome``: ``switched`` (every member at ``target``), ``unchanged`` (they already were),
  ``aborted`` (a member failed to prepare: nobody switched), ``taken-back`` (a member failed to
  apply: the others were taken back, every member serves ``previous``), ``mixed`` (a take-back
  failed too: see the members);
- ``members``: each engine's URL, receiver id, step and outcome (and error, if any);
- ``at`` / ``at_utc``: when (the coordinator's clock).

The record is advisory (unsigned): engines verify every step they load against the publisher's
signature and digests whatever it says. It is validated with pydantic on read: a damaged or foreign
object is refused in one line naming it.
"""

from __future__ import annotations

import time
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from storage import layout
from storage.document_fields import fail
from storage.root import Root

FORMAT: Final = "dcr-fleet"
MAX_FLEET_BYTES = 1 << 20

MemberOutcome = Literal["switched", "unchanged", "not-switched", "failed", "taken-back"]
Outcome = Literal["switched", "unchanged", "aborted", "taken-back", "mixed"]


class Member(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    receiver: str
    step: int | None = Field(default=None, ge=0, le=layout.MAX_STEP)  # what it serves now (None: unknown)
    outcome: MemberOutcome
    error: str | None = None
    pause_seconds: float = Field(default=0.0, ge=0)


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


def record(root: Root, rec: FleetRecord) -> FleetRecord:
    """Write ``rec`` as its fleet's record (dated now if it is not)."""
    at = rec.at or time.time()
    rec = rec.model_copy(update={"at": at, "at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))})
    root.write(layout.fleet_key(rec.fleet), rec.model_dump_json(indent=1).encode())
    return rec


def read(root: Root, name: str) -> FleetRecord | None:
    """The record of fleet ``name``, or None if it never switched."""
    key = layout.fleet_key(name)
    try:
        data = root.read(key, limit=MAX_FLEET_BYTES)
    except FileNotFoundError:
        return None
    where = f"{root.url}/{key}"
    try:
        rec = FleetRecord.model_validate_json(data)
    except ValidationError as e:
        first = e.errors()[0]
        raise fail(where, f"not a DCR fleet record ({'.'.join(map(str, first['loc'])) or 'document'}: {first['msg']})"
                   ) from None
    if rec.fleet != name:
        raise fail(where, f"names fleet {rec.fleet!r}")
    return rec


def names(root: Root) -> list[str]:
    """The fleets that have a record in ROOT."""
    out = []
    for n in root.listdir(layout.FLEETS_DIR):
        if n.endswith(".json"):
            try:
                layout.fleet_key(n[:-5])
            except ValueError:
                continue
            out.append(n[:-5])
    return sorted(out)
