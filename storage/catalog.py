"""What ROOT holds: committed steps, their commit markers and manifests, receiver records.

A step is committed exactly when ``steps/<step>/commit.json`` exists. Everything read here is
checked: markers against their location, manifests against the marker's digest and the marker's
own fields, before any caller sees them.
"""

from __future__ import annotations

import json
import time
from functools import lru_cache

import blake3

from dcr_core.chain import StepInfo
from dcr_core.errors import IntegrityError, StepNotFoundError
from storage import layout, signing
from storage.manifest import DELTA, CommitMarker, Manifest
from storage.root import Root


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def manifest_digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


class Catalog:
    """Read access to the steps of one ROOT, with markers and manifests cached per instance."""

    def __init__(self, root: Root):
        self.root = root
        self.key = signing.signing_key()  # markers must be signed with it when set
        self._marker = lru_cache(maxsize=None)(self._read_marker)
        self._manifest = lru_cache(maxsize=64)(self._read_manifest)

    def listed_steps(self) -> list[int]:
        """Every step with a prefix under ``steps/`` (committed or not), ascending."""
        steps = (layout.parse_step_dir(n) for n in self.root.listdir(layout.STEPS))
        return sorted(s for s in steps if s is not None)

    def committed_steps(self) -> list[int]:
        return [s for s in self.listed_steps() if self.marker(s) is not None]

    def latest_committed(self) -> int | None:
        for s in reversed(self.listed_steps()):
            if self.marker(s) is not None:
                return s
        return None

    def marker(self, step: int) -> CommitMarker | None:
        return self._marker(step)

    def require_marker(self, step: int) -> CommitMarker:
        m = self.marker(step)
        if m is None:
            raise StepNotFoundError(f"{self.root.url}: step {step} is not committed")
        return m

    def _read_marker(self, step: int) -> CommitMarker | None:
        key = layout.commit_key(step)
        try:
            data = self.root.read(key)
        except FileNotFoundError:
            return None
        where = f"{self.root.url}/{key}"
        marker = CommitMarker.from_json(data, where, step)
        if self.key is not None:
            if marker.signature is None:
                raise IntegrityError(f"{where}: commit marker is not signed, and a signing key is configured")
            if not signing.verify(self.key, marker.body(), marker.signature):
                raise IntegrityError(f"{where}: commit marker signature does not match (tampered, or another key)")
        return marker

    def manifest(self, step: int) -> Manifest:
        return self._manifest(step)

    def _read_manifest(self, step: int) -> Manifest:
        marker = self.require_marker(step)
        key = marker.manifest_key
        where = f"{self.root.url}/{key}"
        try:
            data = self.root.read(key)
        except FileNotFoundError:
            raise IntegrityError(f"{where}: manifest named by the commit marker is missing") from None
        if manifest_digest(data) != marker.manifest_digest:
            raise IntegrityError(f"{where}: manifest digest does not match the commit marker")
        m = Manifest.from_json(data, where)
        if (m.step, m.attempt, m.kind, m.base_step, m.policy_digest) != (
            marker.step, marker.attempt, marker.kind, marker.base_step, marker.policy_digest
        ):
            raise IntegrityError(f"{where}: manifest disagrees with its commit marker")
        return m

    def step_info(self, step: int) -> StepInfo:
        marker = self.require_marker(step)
        s = marker.summary
        return StepInfo(
            step=step,
            base_step=marker.base_step if marker.kind == DELTA else None,
            invertible=bool(s.get("invertible", False)),
            stored_bytes=int(s.get("bytes_stored", 0)),
            restart_bytes=int(s["snapshot_bytes"]) if marker.kind == DELTA and isinstance(s.get("snapshot_bytes"), int) else None,
        )

    def keyframe_cost(self, step: int) -> int | None:
        """Stored bytes of the keyframe path to ``step`` (keyframe plus deltas), if its marker says."""
        v = self.require_marker(step).summary.get("chain_bytes")
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    def chain_infos(self, *steps: int | None) -> dict[int, StepInfo]:
        """StepInfo of every step on the chains of ``steps`` back to their keyframes."""
        out: dict[int, StepInfo] = {}
        for s in steps:
            while s is not None and s not in out:
                if self.marker(s) is None:
                    break
                info = out[s] = self.step_info(s)
                s = info.base_step
        return out

    def receivers(self, step: int) -> list[str]:
        return [n[: -len(".json")] for n in self.root.listdir(layout.receivers_dir(step)) if n.endswith(".json")]

    def record_receiver(self, step: int, receiver_id: str, record: dict) -> None:
        record = {"committed_at": utc_now(), **record}
        data = json.dumps({"receiver": receiver_id, "step": step, **record}, indent=1).encode() + b"\n"
        self.root.write(layout.receiver_key(step, receiver_id), data)
