"""The commit marker: the object whose existence makes a step real.

It names the one attempt of the step that counts and binds that attempt's manifest by digest, plus
the step's kind, base and policy digest and a summary that planners read without the manifest.
Created once (create-if-absent, ``storage.commit``), deleted only by ``dcr gc``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dcr_core.chain import DELTA, KEYFRAME
from storage import layout, signing
from storage.document_fields import document, fail, parse_attempt, parse_digest, parse_int, parse_run_id

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
    signature: str | None = None  # of body(), when the publisher has a signing key (storage.signing)
    run: str | None = None  # the ROOT's run id (``storage.run_identity``); None in markers written before runs
    signature_algorithm: str = signing.HMAC_SHA256

    @property
    def manifest_key(self) -> str:
        return layout.manifest_key(self.step, self.attempt)

    def to_json(self) -> bytes:
        return signing.signed_json(self.body(), self.signature, self.signature_algorithm)

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
        } | ({} if self.run is None else {"run": self.run})

    @classmethod
    def from_json(cls, data: bytes, where: str, step: int) -> CommitMarker:
        if len(data) > MAX_MARKER_BYTES:
            raise fail(where, "commit marker is larger than 1 MiB")
        d = document(data, where, FORMAT, "DCR commit marker")
        if d.get("step") != step:
            raise fail(where, f"commit marker of step {d.get('step')!r} found under step {step}")
        attempt = parse_attempt(d.get("attempt"), where)
        if d.get("manifest") != f"attempts/{attempt}/{layout.MANIFEST}":
            raise fail(where, f"manifest {d.get('manifest')!r} lies outside attempt {attempt}")
        kind = d.get("kind")
        if kind not in (KEYFRAME, DELTA):
            raise fail(where, f"bad kind {kind!r}")
        base = d.get("base_step")
        signature, algorithm = signing.signature_field(d, where)
        return cls(
            signature=signature,
            signature_algorithm=algorithm,
            step=step,
            attempt=attempt,
            manifest_digest=parse_digest(d.get("manifest_digest"), where),
            kind=kind,
            base_step=None if base is None else parse_int(base, where, 0, max(0, step - 1)),
            policy_digest=parse_digest(d.get("policy_digest"), where),
            committed_at=str(d.get("committed_at", "")),
            summary=_summary(d.get("summary"), where),
            run=None if d.get("run") is None else parse_run_id(d.get("run"), where),
        )


_SUMMARY_INTS = ("tensors", "tensors_changed", "elements", "elements_changed", "bytes_full", "bytes_stored",
                 "chunks_stored", "snapshot_bytes", "keyframe_step", "chain_bytes")


def _summary(s: object, where: str) -> dict:
    """The marker's summary, its known fields checked (planners price paths from them)."""
    if s is None:
        return {}
    if not isinstance(s, dict):
        raise fail(where, "summary must be an object")
    for k in _SUMMARY_INTS:
        if k in s:
            parse_int(s[k], f"{where} summary.{k}")
    if "invertible" in s and not isinstance(s["invertible"], bool):
        raise fail(where, f"summary.invertible must be true or false, got {s['invertible']!r}")
    rate = s.get("change_rate")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0):
        raise fail(where, f"summary.change_rate must be a number in 0..1, got {rate!r}")
    if "keyframe_reason" in s and not isinstance(s["keyframe_reason"], str):
        raise fail(where, "summary.keyframe_reason must be a string")
    return s
