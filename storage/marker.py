"""The commit marker: the object whose existence makes a step real.

It names the one attempt of the step that counts and binds that attempt's manifest by digest, plus
the step's kind, base and policy digest and a summary that planners read without the manifest.
Created once (create-if-absent, ``storage.commit``), deleted only by ``dcr gc``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from dcr_core.chain import DELTA, KEYFRAME
from storage import layout
from storage.fields import fail, parse_attempt, parse_digest, parse_int

SCHEMA_VERSION = 1
FORMAT = "dcr-commit"
MAX_MARKER_BYTES = 1 << 20


@dataclass(frozen=True)
class CommitMarker:
    """The object whose existence makes a step real; it names the attempt and binds its manifest."""

    step: int
    attempt: str
    manifest_digest: str
    kind: str
    base_step: int | None
    policy_digest: str
    committed_at: str
    summary: dict = field(default_factory=dict)
    signature: str | None = None  # HMAC of body() when the publisher has a signing key

    @property
    def manifest_key(self) -> str:
        return layout.manifest_key(self.step, self.attempt)

    def to_json(self) -> bytes:
        d = self.body()
        if self.signature is not None:
            d["signature"] = {"algorithm": "hmac-sha256", "value": self.signature}
        return json.dumps(d, indent=1).encode() + b"\n"

    def body(self) -> dict:
        """Every field but the signature: what a signature covers."""
        return {
            "format": FORMAT,
            "schema_version": SCHEMA_VERSION,
            "step": self.step,
            "attempt": self.attempt,
            "manifest": f"attempts/{self.attempt}/{layout.MANIFEST}",
            "manifest_digest": self.manifest_digest,
            "kind": self.kind,
            "base_step": self.base_step,
            "policy_digest": self.policy_digest,
            "committed_at": self.committed_at,
            "summary": self.summary,
        }

    @classmethod
    def from_json(cls, data: bytes, where: str, step: int) -> CommitMarker:
        if len(data) > MAX_MARKER_BYTES:
            raise fail(where, "commit marker is larger than 1 MiB")
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise fail(where, f"not valid JSON ({e})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise fail(where, "not a DCR commit marker")
        if d.get("step") != step:
            raise fail(where, f"commit marker of step {d.get('step')!r} found under step {step}")
        attempt = parse_attempt(d.get("attempt"), where)
        if d.get("manifest") != f"attempts/{attempt}/{layout.MANIFEST}":
            raise fail(where, f"manifest {d.get('manifest')!r} lies outside attempt {attempt}")
        kind = d.get("kind")
        if kind not in (KEYFRAME, DELTA):
            raise fail(where, f"bad kind {kind!r}")
        base = d.get("base_step")
        sig = d.get("signature")
        if sig is not None and not (
            isinstance(sig, dict) and sig.get("algorithm") == "hmac-sha256" and isinstance(sig.get("value"), str)
        ):
            raise fail(where, "malformed signature")
        return cls(
            signature=None if sig is None else sig["value"],
            step=step,
            attempt=attempt,
            manifest_digest=parse_digest(d.get("manifest_digest"), where),
            kind=kind,
            base_step=None if base is None else parse_int(base, where, 0, max(0, step - 1)),
            policy_digest=parse_digest(d.get("policy_digest"), where),
            committed_at=str(d.get("committed_at", "")),
            summary=d.get("summary") if isinstance(d.get("summary"), dict) else {},
        )
