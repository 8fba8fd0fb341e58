"""The publisher's refit, as plain functions (the Prefect flow wraps each one as a task).

Order and why: validate everything before the first write (plan); encode and upload every chunk
into a fresh attempt prefix, streaming; write the manifest; then create the commit marker, the
one create-if-absent write that makes the step real. A crash before the marker leaves only an
unreferenced attempt prefix (invisible to every reader; a retry writes a new attempt). Racing
publishers of one step each write their own attempt; exactly one marker creation succeeds.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
from dataclasses import dataclass, field

import blake3

from dcr_core.bits import bits_of
from dcr_core.chunking import ChunkGrid, choose_chunk_shape
from dcr_core.delta import Encoding, choose_encoding, count_changed, encode_chunks
from dcr_core.digest import policy_digest, tensor_digest
from dcr_core.dtypes import DTYPES
from dcr_core.errors import IntegrityError, SchemaMismatchError, StepConflictError, UsageError
from flows.options import PublishOptions
from flows.sources import Source
from storage import commit, layout, signing
from storage.catalog import Catalog, manifest_digest, utc_now
from storage.checkpoint import SafetensorsCheckpoint, StreamingSafetensorsWriter, TensorInfo
from storage.manifest import DELTA, KEYFRAME, ChunkTable, CommitMarker, Manifest, TensorEntry
from storage.root import Root
from storage.step_io import StepWriter

BASELINE_FILE = "baseline.safetensors"


@dataclass
class PublishPlan:
    root_url: str
    storage_options: dict
    step: int
    kind: str
    base_step: int | None
    base_policy_digest: str | None
    attempt: str
    infos: dict[str, TensorInfo]
    options: PublishOptions
    source_name: str = ""
    base_digests: dict[str, str] = field(default_factory=dict)  # tensor digests of the base step
    base_entries: dict[str, TensorEntry] = field(default_factory=dict)  # the base step's entries
    keyframe_reason: str = ""  # why the step is a keyframe or carries a snapshot ("" otherwise)
    snapshot: bool = False  # a delta that also stores a full copy of its step (keyframe policy)


@dataclass(frozen=True)
class HeldBaseline:
    """A committed step's bits kept in memory by the process that committed them: the snapshot it
    encoded and digested itself, so it serves as the next delta's baseline without being read back
    or re-verified (it is a private copy nothing writes to)."""

    root_url: str
    step: int
    policy_digest: str
    source: Source

    def is_base_of(self, plan: PublishPlan) -> bool:
        """Exactly the plan's base: same ROOT, step and policy digest (else the baseline is loaded)."""
        return (
            self.root_url == plan.root_url
            and self.step == plan.base_step
            and self.policy_digest == plan.base_policy_digest
            and set(self.source.infos) == set(plan.base_entries)
        )


@dataclass
class BaselineSlot:
    """Where a long-running publisher keeps its in-memory baseline between publishes
    (``run_publish(held=...)``). ``baseline`` is replaced only once a step is committed, so a
    publish that fails anywhere leaves the previous one."""

    baseline: HeldBaseline | None = None


def _schema_diff(base: Manifest, infos: dict[str, TensorInfo]) -> str | None:
    missing = sorted(set(base.tensors) - set(infos))
    extra = sorted(set(infos) - set(base.tensors))
    if missing:
        return f"tensor {missing[0]!r} of step {base.step} is missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
    if extra:
        return f"tensor {extra[0]!r} is not in step {base.step}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
    for name in sorted(infos):
        e, i = base.tensors[name], infos[name]
        if (e.dtype, e.shape) != (i.dtype, i.shape):
            return f"tensor {name!r} is {i.dtype}{list(i.shape)}, step {base.step} has {e.dtype}{list(e.shape)}"
    return None


def plan_publish(
    root_url: str,
    storage_options: dict,
    infos: dict[str, TensorInfo],
    step: int,
    keyframe: bool,
    options: PublishOptions,
    source_name: str = "",
) -> PublishPlan:
    """Validate the publish of ``step`` without writing anything."""
    layout.check_step(step)
    root = Root(root_url, storage_options)
    if not commit.supports(root.protocol):
        raise UsageError(
            f"{root.url}: no atomic create-if-absent for {root.protocol!r} ROOTs; use a local path, memory://, s3:// or gs://"
        )
    cat = Catalog(root)
    if cat.marker(step) is not None:
        raise StepConflictError(f"{root.url}: step {step} is already committed")
    latest = cat.latest_committed()
    if latest is not None and step <= latest:
        raise StepConflictError(
            f"{root.url}: step {step} is not after the latest committed step {latest}; publish step {latest + 1} or later"
        )
    reason = "first step" if latest is None else "requested" if keyframe else ""
    policy = "" if reason else _policy_reason(cat, latest, step, options)
    if reason:
        kind, base_step, base_policy = KEYFRAME, None, None
    else:
        base = cat.manifest(latest)
        diff = _schema_diff(base, infos)
        if diff:
            raise SchemaMismatchError(
                f"{source_name or 'checkpoint'}: {diff}; publish with --keyframe to start a new lineage"
            )
        kind, base_step, base_policy = DELTA, latest, base.policy_digest
    return PublishPlan(
        root_url, dict(storage_options), step, kind, base_step, base_policy,
        uuid.uuid4().hex, dict(infos), options, source_name,
        {} if kind == KEYFRAME else {n: e.digest for n, e in base.tensors.items()},
        {} if kind == KEYFRAME else dict(base.tensors), reason or policy,
        snapshot=bool(policy),
    )


def _policy_reason(cat: Catalog, latest: int, step: int, options: PublishOptions) -> str:
    """Why the keyframe policy makes ``step`` a keyframe, or "" (from the markers alone)."""
    policy = options.keyframe_policy
    if not (policy.every or policy.above):
        return ""
    s = cat.require_marker(latest).summary
    kf, chain = s.get("keyframe_step"), s.get("chain_bytes")
    kf_bytes = None
    if isinstance(kf, int) and cat.marker(kf) is not None:  # the lineage's restart point
        ks = cat.marker(kf).summary
        kf_bytes = ks.get("snapshot_bytes", ks.get("bytes_stored"))
    delta_bytes = chain - kf_bytes if isinstance(chain, int) and isinstance(kf_bytes, int) else None
    full = s.get("bytes_full") if isinstance(s.get("bytes_full"), int) else None
    return policy.due(step, kf if isinstance(kf, int) else None, delta_bytes, full) or ""


def _cache_path(plan: PublishPlan) -> str:
    key = blake3.blake3(plan.root_url.encode()).hexdigest()[:16]
    return os.path.join(plan.options.cache_dir, key, BASELINE_FILE)


def _cache_valid(path: str, plan: PublishPlan) -> bool:
    """The cached baseline holds exactly the base step's bits (checked tensor by tensor)."""
    from flows import receive_steps as rs

    try:
        ck = SafetensorsCheckpoint(path)
        if ck.metadata.get(rs.STATE_STEP) != str(plan.base_step) or ck.metadata.get(rs.STATE_POLICY) != plan.base_policy_digest:
            return False
        if set(ck.infos) != set(plan.base_digests):
            return False
        # Checked here (not only on use) so a damaged cache is rebuilt instead of failing the publish.
        return all(plan.base_entries[n].matches(bits_of(ck.tensor(n))) for n in plan.base_digests)
    except Exception:  # a broken cache is only a cache: it gets rebuilt
        return False


def load_baseline(plan: PublishPlan, held: HeldBaseline | None = None) -> str | Source | None:
    """The base step's bits: ``held`` (in memory) if it is exactly the plan's base; else a local
    file: the baseline cache if it verifies, else rebuilt from ROOT into the cache (streamed: a
    keyframe plus deltas, one tensor at a time)."""
    if plan.kind == KEYFRAME:
        return None
    if held is not None and held.is_base_of(plan):
        return held.source
    from flows import receive_steps as rs

    cache = _cache_path(plan)
    if plan.options.use_cache and os.path.exists(cache) and _cache_valid(cache, plan):
        return cache
    if not plan.options.use_cache:  # a private temp file, removed once encoding is done
        cache = os.path.join(tempfile.gettempdir(), f"dcr-baseline-{plan.attempt}.safetensors")
    rplan = rs.plan_receive(plan.root_url, plan.storage_options, None, plan.base_step)
    rs.replace_state(rs.refit_file(rplan, cache))
    return cache


def encode_and_write(plan: PublishPlan, source: Source, baseline: str | Source | None) -> dict[str, TensorEntry]:
    """Encode every tensor chunk by chunk and upload the stored chunks (streamed, bounded).

    ``baseline``: a file (re-checked tensor by tensor against the base step's digests as it is
    read: a file can change after it was verified) or a held in-memory snapshot (not re-checked:
    its digests are the ones this process computed when committing it, see ``HeldBaseline``).
    Memory: one tensor of the source and of a file baseline at a time, plus the upload window."""
    opts = plan.options
    codec = opts.keyframe_codec if plan.kind == KEYFRAME else opts.delta_codec
    root = Root(plan.root_url, plan.storage_options)
    pending: list[tuple[dict, list]] = []
    used_arrays: set[str] = set()
    from_file = isinstance(baseline, (str, os.PathLike))
    base_src = SafetensorsCheckpoint(baseline) if from_file else baseline
    with StepWriter(root, plan.step, plan.attempt, codec, workers=opts.io_workers) as w:
        w.write_group({"dcr": {"step": plan.step, "kind": plan.kind, "base_step": plan.base_step}})
        for name in sorted(plan.infos):
            info = plan.infos[name]
            new = bits_of(source.tensor(name))
            dt = DTYPES[info.dtype]
            grid = ChunkGrid(info.shape, choose_chunk_shape(info.shape, dt.itemsize, opts.chunk_bytes))
            base = None
            if plan.kind == KEYFRAME:
                encoding = Encoding.FULL
            else:
                base = bits_of(base_src.tensor(name))
                if from_file and not plan.base_entries[name].matches(base):
                    raise IntegrityError(f"{baseline}: tensor {name!r} changed since it was verified")
                if opts.overwrite_above >= 1.0:
                    encoding = Encoding.XOR  # the default: no extra pass to count changes first
                else:
                    encoding = choose_encoding(count_changed(new, base), new.size, opts.overwrite_above)
            array = layout.array_segment(name)
            while array in used_arrays:  # two names escaping alike: keep arrays distinct
                array += "_"
            used_arrays.add(array)
            changed = 0
            chunk_futs = []
            for c in encode_chunks(new, base, grid, encoding):
                changed += c.changed
                chunk_futs.append(w.write_chunk(array, grid, c.index, c.payload))
            if encoding is Encoding.XOR and not changed:
                encoding = Encoding.UNCHANGED
            attrs = {"dcr": {"tensor": name, "dtype": info.dtype, "encoding": encoding.value, "step": plan.step}}
            futures = [w.write_array(array, info.shape, grid.chunk_shape, info.dtype, attrs)]
            meta = {
                "name": name, "dtype": info.dtype, "shape": info.shape, "digest": tensor_digest(new),
                "encoding": encoding, "array": array, "chunk_shape": grid.chunk_shape,
                "base_digest": None if base is None else plan.base_digests[name], "changed": changed,
            }
            pending.append((meta, futures + chunk_futs))
        entries = {}
        for meta, futs in pending:
            stored = [f.result() for f in futs[1:]]
            futs[0].result()
            stored.sort(key=lambda s: s.index)
            table = ChunkTable(
                tuple(s.index for s in stored), tuple(s.digest for s in stored), tuple(s.nbytes for s in stored)
            )
            entries[meta["name"]] = TensorEntry(chunks=table, **meta)
    return entries


def write_snapshot(plan: PublishPlan, source: Source, entries: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """Store a full copy of the step beside its delta, in the same attempt (keyframe policy): new
    and far-behind receivers start from it, up-to-date receivers keep pulling only the delta.

    Arrays are named ``<tensor array>.full`` (kept distinct from every delta array); chunks use the
    delta codec, whose dense form stores values as byte planes. One tensor at a time."""
    root = Root(plan.root_url, plan.storage_options)
    used = {e.array for e in entries.values()}
    out: dict[str, TensorEntry] = {}
    with StepWriter(root, plan.step, plan.attempt, plan.options.delta_codec, workers=plan.options.io_workers) as w:
        pending = []
        for name in sorted(plan.infos):
            info, e = plan.infos[name], entries[name]
            new = bits_of(source.tensor(name))
            if not e.matches(new):
                raise IntegrityError(f"{plan.source_name or 'source'}: tensor {name!r} changed while publishing")
            array = e.array + ".full"
            while array in used:
                array += "_"
            used.add(array)
            grid = ChunkGrid(info.shape, e.chunk_shape)
            attrs = {"dcr": {"tensor": name, "dtype": info.dtype, "encoding": Encoding.FULL.value,
                             "step": plan.step, "snapshot": True}}
            futs = [w.write_array(array, info.shape, grid.chunk_shape, info.dtype, attrs)]
            futs += [w.write_chunk(array, grid, c.index, c.payload) for c in encode_chunks(new, None, grid, Encoding.FULL)]
            pending.append((e, array, futs))
        for e, array, futs in pending:
            stored = sorted((f.result() for f in futs[1:]), key=lambda x: x.index)
            futs[0].result()
            table = ChunkTable(tuple(x.index for x in stored), tuple(x.digest for x in stored), tuple(x.nbytes for x in stored))
            out[e.name] = dataclasses.replace(
                e, encoding=Encoding.FULL, array=array, chunks=table, base_digest=None, changed=0, parts=None
            )
    return out


def write_manifest(
    plan: PublishPlan, entries: dict[str, TensorEntry], snapshot: dict[str, TensorEntry] | None = None
) -> tuple[Manifest, str]:
    """Write the attempt's manifest (not yet visible to readers: no marker points at it)."""
    opts = plan.options
    m = Manifest(
        step=plan.step,
        kind=plan.kind,
        base_step=plan.base_step,
        base_policy_digest=plan.base_policy_digest,
        policy_digest=policy_digest((e.name, e.dtype, e.shape, e.digest) for e in entries.values()),
        attempt=plan.attempt,
        codec=opts.keyframe_codec if plan.kind == KEYFRAME else opts.delta_codec,
        chunk_bytes=opts.chunk_bytes,
        tensors=entries,
        created_at=utc_now(),
        producer={"tool": "dcr", "source": plan.source_name},
        snapshot=dict(snapshot or {}),
    )
    data = m.to_json()
    root = Root(plan.root_url, plan.storage_options)
    root.write(layout.manifest_key(plan.step, plan.attempt), data)
    return m, manifest_digest(data)


def commit_step(plan: PublishPlan, manifest: Manifest, digest: str) -> CommitMarker:
    """Create the commit marker if absent. Exactly one racing publisher of a step gets here first."""
    root = Root(plan.root_url, plan.storage_options)
    cat = Catalog(root)
    existing = cat.marker(plan.step)
    if existing is not None:
        if existing.attempt == plan.attempt and existing.manifest_digest == digest:
            return existing  # a retry of a commit whose first try succeeded but did not report back
        _discard(root, plan)
        raise StepConflictError(
            f"{root.url}: step {plan.step} was committed by another publisher"
            f" (attempt {existing.attempt}); this attempt was discarded"
        )
    latest = cat.latest_committed()
    if latest is not None and latest > plan.step:
        _discard(root, plan)
        raise StepConflictError(
            f"{root.url}: step {latest} was committed while step {plan.step} was being published; nothing committed"
        )
    marker = CommitMarker(
        step=plan.step,
        attempt=plan.attempt,
        manifest_digest=digest,
        kind=plan.kind,
        base_step=plan.base_step,
        policy_digest=manifest.policy_digest,
        committed_at=utc_now(),
        summary=_chain_summary(cat, plan, manifest.summary()),
    )
    key = signing.signing_key()
    if key is not None:
        marker = dataclasses.replace(marker, signature=signing.sign(key, marker.body()))
    if not root.create_if_absent(layout.commit_key(plan.step), marker.to_json()):
        winner = Catalog(root).marker(plan.step)
        if winner is not None and winner.attempt == plan.attempt and winner.manifest_digest == digest:
            return winner  # a retry of a commit whose first try succeeded but did not report back
        _discard(root, plan)
        raise StepConflictError(
            f"{root.url}: step {plan.step} was committed by another publisher"
            f" (attempt {winner.attempt if winner else '?'}); this attempt was discarded"
        )
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
    base = cat.marker(plan.base_step).summary if cat.marker(plan.base_step) else {}
    if isinstance(base.get("chain_bytes"), int) and isinstance(base.get("keyframe_step"), int):
        return {**summary, "keyframe_step": base["keyframe_step"],
                "chain_bytes": base["chain_bytes"] + summary["bytes_stored"]}
    return summary


def _discard(root: Root, plan: PublishPlan) -> None:
    """Best-effort removal of a losing attempt (never referenced, so leaving it is also safe)."""
    try:
        root.remove(layout.attempt_dir(plan.step, plan.attempt), recursive=True)
    except Exception:
        pass


def remember_baseline(
    plan: PublishPlan, source: Source, marker: CommitMarker, baseline: str | Source | None = None, hold: bool = False
) -> HeldBaseline | None:
    """Keep the committed policy as the baseline of the next delta: with ``hold`` (``source`` is a
    snapshot this publish made), in memory, returned and no file written; else as the local
    baseline file (verified on use).

    Runs after the commit: a failure here only costs the cache (the next publish rebuilds it)."""
    if not plan.options.use_cache or hold:
        if not plan.options.use_cache and isinstance(baseline, str) and os.path.exists(baseline):
            os.unlink(baseline)  # the private temp baseline of a --no-cache publish
        if hold:
            return HeldBaseline(plan.root_url, marker.step, marker.policy_digest, source)
        return None
    from flows.receive_steps import STATE_POLICY, STATE_ROOT, STATE_STEP

    names = sorted(plan.infos)
    meta = {STATE_STEP: str(marker.step), STATE_POLICY: marker.policy_digest, STATE_ROOT: plan.root_url}
    try:
        writer = StreamingSafetensorsWriter(_cache_path(plan), [plan.infos[n] for n in names], meta, durable=False)
    except Exception:  # noqa: BLE001
        return None  # the next publish rebuilds the baseline from ROOT
    try:
        for n in names:  # one tensor at a time
            writer.write(n, bits_of(source.tensor(n)))
        writer.commit()
    except Exception:  # noqa: BLE001 - the step is committed; only the cache is lost
        writer.abort()
    return None

