"""The retraction record: the object whose existence takes a committed step back.

``steps/<N>/retracted.json`` names the step's attempt and manifest digest (so it retracts exactly
the step that was committed, never a later one under the same number) and the run, when and why;
it is signed with the publisher's key as commit markers are, and readers with a key refuse one that
is unsigned or does not verify (a forged retraction would roll receivers back). Created once
(create-if-absent), never changed; ``dcr gc`` deletes it with its step.

A step is retracted with every step built on it (``flows.maintenance.retract``), so no live step
stands on a retracted one: a retracted step is no refit's target and no publish's base, and its
number is never used again; its data stays until gc, so a receiver that holds it moves back to the
newest live step through the inverse deltas. The publisher's heartbeat names every retracted step
(``storage.heartbeat``), so a ROOT that hides a record is refused by ``--max-staleness``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from storage import layout, signing
from storage.document_fields import document, fail, parse_attempt, parse_digest, parse_run_id

if TYPE_CHECKING:
    from storage.marker import CommitMarker
    from storage.root import Root

FORMAT = "dcr-retraction"
MAX_RETRACTION_BYTES = 64 << 10
MAX_REASON_CHARS = 1000


@dataclass(frozen=True)
class Retraction:
    step: int
    attempt: str
    manifest_digest: str
    retracted_at: str
    reason: str = ""
    run: str | None = None
    signature: str | None = None
    signature_algorithm: str = signing.HMAC_SHA256

    def body(self) -> dict:
        """Every field but the signature: what a signature covers."""
        return {"format": FORMAT, "step": self.step, "attempt": self.attempt, "manifest_digest": self.manifest_digest,
                "retracted_at": self.retracted_at, "reason": self.reason} | ({} if self.run is None else {"run": self.run})

    def to_json(self) -> bytes:
        return signing.signed_json(self.body(), self.signature, self.signature_algorithm)

    @classmethod
    def from_json(cls, data: bytes, where: str, step: int) -> Retraction:
        if len(data) > MAX_RETRACTION_BYTES:
            raise fail(where, f"retraction record is larger than {MAX_RETRACTION_BYTES} bytes")
        d = document(data, where, FORMAT, "DCR retraction record")
        if d.get("step") != step:
            raise fail(where, f"retraction of step {d.get('step')!r} found under step {step}")
        reason = d.get("reason", "")
        if not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS:
            raise fail(where, f"reason must be text of at most {MAX_REASON_CHARS} characters")
        signature, algorithm = signing.signature_field(d, where)
        return cls(step, parse_attempt(d.get("attempt"), where), parse_digest(d.get("manifest_digest"), where),
                   str(d.get("retracted_at", "")), reason,
                   None if d.get("run") is None else parse_run_id(d.get("run"), where),
                   signature, algorithm)


def record(root: Root, marker: CommitMarker, reason: str, key: signing.Key | None) -> bool:
    """Retract the step ``marker`` committed (signed with ``key`` when given) unless a retraction of
    it exists already; whether this call wrote it."""
    rec = Retraction(marker.step, marker.attempt, marker.manifest_digest,
                     time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), reason, marker.run)
    if key is not None:
        rec = dataclasses.replace(rec, signature=key.sign(rec.body()), signature_algorithm=key.algorithm)
    return root.create_if_absent(layout.retraction_key(marker.step), rec.to_json())
