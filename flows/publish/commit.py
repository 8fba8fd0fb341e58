"""Finishing a publish: the attempt's manifest, then the commit marker that makes the step real.

The manifest is written into the attempt (invisible: no marker names it yet); the marker is then
created if absent (``storage.commit``), carrying a summary that lets receivers plan and price
their paths from markers alone: the keyframe of the step's lineage and the stored bytes of the
keyframe path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from dcr_core import events
from dcr_core.chain import KEYFRAME
from dcr_core.digest import policy_digest
from dcr_core.errors import IntegrityError, InvalidCheckpointError
from flows.publish.plan import PublishPlan
from storage import layout, source_layout
from storage.catalog import Catalog, manifest_digest, utc_now
from storage.commit import commit_marker
from storage.local.safetensors import SafetensorsCheckpoint
from storage.manifest import Manifest, SourceRecord, TensorEntry, policy_entries
from storage.marker import CommitMarker
from storage.root import open_root

log = logging.getLogger("dcr.publish")


@dataclass(frozen=True)
class WrittenManifest:
    """A manifest written into its attempt, by reference: its digest and what the marker carries."""

    digest: str
    policy_digest: str
    summary: dict


def write_manifest(
    plan: PublishPlan, entries: dict[str, TensorEntry], snapshot: dict[str, TensorEntry] | None = None,
) -> WrittenManifest:
    """Write the attempt's manifest (not yet visible to readers: no marker points at it), and
    before it the source layout of a checkpoint published from its files (``keep_source``)."""
    source, note = keep_source(plan, entries)
    producer = {"tool": "dcr", "source": plan.source_name} | ({"source_layout": note} if note else {})
    m = Manifest(
        step=plan.step,
        kind=plan.kind,
        base_step=plan.base_step,
        base_policy_digest=plan.base_policy_digest,
        policy_digest=policy_digest(policy_entries(entries)),
        attempt=plan.attempt,
        codec=plan.codec,
        chunk_bytes=plan.options.chunk_bytes,
        tensors=entries,
        created_at=utc_now(),
        producer=producer,
        snapshot=dict(snapshot or {}),
        digest_scheme=plan.scheme,
        source=source,
    )
    data = m.to_json()
    try:  # what every receiver will do first: a manifest they would refuse is never committed
        Manifest.from_json(data, f"the manifest of step {plan.step}")
    except IntegrityError as e:
        raise InvalidCheckpointError(f"{plan.source_name or 'source'}: receivers would refuse it: {e}") from None
    open_root(plan.root).write(layout.manifest_key(plan.step, plan.attempt), data)
    events.reached("publish.manifest-written", step=plan.step)
    return WrittenManifest(manifest_digest(data), m.policy_digest, m.summary())


def keep_source(plan: PublishPlan, entries: dict[str, TensorEntry]) -> tuple[SourceRecord | None, str]:
    """Write the source layout of a checkpoint published from its files (``storage.source_layout``:
    each file's header bytes, so the step materializes byte for byte) into the attempt, when the
    files are still as planned and hold exactly the published tensors; its record for the manifest,
    or None and why not (also said in the manifest's ``producer``)."""
    if plan.source_file is None:
        return None, ""
    if plan.source_layout.startswith("not kept"):
        return None, plan.source_layout
    try:
        with SafetensorsCheckpoint(plan.source_file) as ck:
            kept = source_layout.capture(ck)
        if kept.digest() != plan.source_layout:
            raise source_layout.Unkept(f"{plan.source_file}: its headers changed while it was published")
        kept.check(policy_entries(entries), plan.source_file)
    except (source_layout.Unkept, InvalidCheckpointError, IntegrityError, OSError) as e:
        log.warning("%s; step %d is committed without its files' own bytes: it materializes with DCR's header",
                    e, plan.step)
        return None, f"not kept: {e}"
    data = kept.to_json()
    open_root(plan.root).write(layout.source_key(plan.step, plan.attempt), data)
    return kept.record(), ""


def commit_step(plan: PublishPlan, manifest: WrittenManifest) -> CommitMarker:
    """Create the commit marker if absent. Exactly one racing publisher of a step gets here first."""
    root = open_root(plan.root)
    marker = CommitMarker(
        step=plan.step,
        attempt=plan.attempt,
        manifest_digest=manifest.digest,
        kind=plan.kind,
        base_step=plan.base_step,
        policy_digest=manifest.policy_digest,
        committed_at=utc_now(),
        summary=_chain_summary(Catalog(root), plan, manifest.summary),
    )
    marker = commit_marker(root, marker)
    events.reached("publish.committed", step=plan.step, attempt=plan.attempt)
    return marker


def _chain_summary(cat: Catalog, plan: PublishPlan, summary: dict) -> dict:
    """Add the keyframe of this step's lineage and the stored bytes of the keyframe path to it, so
    receivers can price that path without reading every marker back to the keyframe."""
    if plan.kind == KEYFRAME:
        return {**summary, "keyframe_step": plan.step, "chain_bytes": summary["bytes_stored"],
                "keyframe_reason": plan.keyframe_reason or "requested"}
    if plan.snapshot:  # this delta is its lineage's new restart point
        return {**summary, "keyframe_step": plan.step, "chain_bytes": summary["snapshot_bytes"],
                "keyframe_reason": plan.keyframe_reason}
    base_marker = cat.marker(plan.base_step)
    base = base_marker.summary if base_marker else {}
    if isinstance(base.get("chain_bytes"), int) and isinstance(base.get("keyframe_step"), int):
        return {**summary, "keyframe_step": base["keyframe_step"],
                "chain_bytes": base["chain_bytes"] + summary["bytes_stored"]}
    return summary
