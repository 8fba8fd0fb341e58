"""Publishing from training shards: every rank projects its own changes; rank 0 commits.

Per rank (no data collective, no tensor assembled):
1. *plan*: the same checks as an unsharded publish (step free, after the latest, kind and base).
2. *snapshot*: copy (and convert) the rank's shards (``ShardedSource.snapshot``).
3. *baseline*: the rank's own shard bits of the base step, from its local cache, verified piece by
   piece against the base manifest's piece digests (or its plain digest for whole tensors); without
   a valid cache, rebuilt from ROOT one canonical chunk at a time (``rebuild_shard_baseline``).
4. *encode*: ``dcr_core.projection.project`` walks the canonical chunks the rank touches, one chunk
   buffer at a time. A chunk the rank covers entirely goes to the tensor's array as usual; a chunk
   it shares goes to slot ``rank`` of the sibling parts array (``<array>%parts``). Each piece's
   digest is taken from the local bits.
5. *partial manifest*: ``attempts/A/ranks/<rank>.json`` (chunk tables, parts, piece digests).

Rank 0 then waits for all partial manifests (metadata through storage), merges them into one
manifest (piece tables partition every tensor; the tensor digest is the piecewise digest), writes
the Zarr metadata, the manifest and the commit marker exactly as an unsharded publish does. The
other ranks wait for the marker naming their attempt and then keep their snapshot as the next
baseline. Any rank that fails writes ``attempts/A/failed.json``; nothing is committed then, and
the attempt stays unreferenced like any crashed attempt.

Attempt id: passed in (every rank the same), or broadcast from rank 0 when torch.distributed is
initialized (as 16 raw bytes in a tensor; no pickled objects), or a fresh one for single-process use.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace

import blake3
import numpy as np

from dcr_core.chunking import ChunkGrid, choose_chunk_shape
from dcr_core.delta import Encoding
from dcr_core.digest import pieces_digest, runs_digest
from dcr_core.dtypes import DTYPES
from dcr_core.errors import DCRError, IntegrityError, SchemaMismatchError, StateMismatchError, StepConflictError, UsageError
from dcr_core.projection import ShardBits, project
from flows import publish_steps as ps
from flows.options import PublishOptions
from flows.shard_source import ShardedSource, ShardSnapshot
from storage import commit, layout
from storage.catalog import Catalog
from storage.checkpoint import SafetensorsCheckpoint, StreamingSafetensorsWriter, TensorInfo
from storage.manifest import DELTA, KEYFRAME, PARTS_SUFFIX, CommitMarker, Manifest, TensorEntry
from storage.root import Root
from storage.step_io import StepWriter

PARTIAL_FORMAT = "dcr-rank-partial"
MAX_PARTIAL_BYTES = 256 << 20


@dataclass
class RankPlan:
    root_url: str
    storage_options: dict
    step: int
    kind: str
    base_step: int | None
    base_policy_digest: str | None
    attempt: str
    rank: int
    world: int
    options: PublishOptions
    base_entries: dict[str, TensorEntry] = field(default_factory=dict)

    def publish_plan(self) -> ps.PublishPlan:
        return ps.PublishPlan(
            self.root_url, self.storage_options, self.step, self.kind, self.base_step, self.base_policy_digest,
            self.attempt, {}, self.options, f"<shards of {self.world} ranks>",
            {n: e.digest for n, e in self.base_entries.items()}, dict(self.base_entries),
        )


def agree_on_attempt(attempt: str | None, world: int) -> str:
    """The attempt id every rank uses (see the module docstring)."""
    if attempt is not None:
        return layout.check_attempt(attempt)
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        buf = torch.zeros(16, dtype=torch.uint8)
        if dist.get_rank() == 0:
            buf = torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8).clone()
        dist.broadcast(buf, src=0)
        return bytes(buf.tolist()).hex()
    if world > 1:
        raise UsageError("a sharded publish over several processes needs attempt=<hex id> (the same on every rank) or torch.distributed")
    return uuid.uuid4().hex


def plan_rank(
    root_url: str, storage_options: dict, snap: ShardSnapshot, step: int, keyframe: bool,
    options: PublishOptions, attempt: str,
) -> RankPlan:
    """Validate this rank's part of the publish of ``step`` without writing anything."""
    layout.check_step(step)
    root = Root(root_url, storage_options)
    if not commit.supports(root.protocol):
        raise UsageError(f"{root.url}: no atomic create-if-absent for {root.protocol!r} ROOTs")
    cat = Catalog(root)
    if cat.marker(step) is not None:
        raise StepConflictError(f"{root.url}: step {step} is already committed")
    latest = cat.latest_committed()
    if latest is not None and step <= latest:
        raise StepConflictError(
            f"{root.url}: step {step} is not after the latest committed step {latest}; publish step {latest + 1} or later"
        )
    policy = options.keyframe_policy
    if policy.every or policy.above:
        raise UsageError(
            "the keyframe policy (restart-point snapshots) is not available for sharded publishes yet; "
            "publish a keyframe (keyframe=True) periodically instead"
        )
    if latest is None or keyframe:
        return RankPlan(root_url, dict(storage_options), step, KEYFRAME, None, None, attempt, snap.rank, snap.world, options)
    base = cat.manifest(latest)
    for name, info in sorted(snap.infos.items()):
        e = base.tensors.get(name)
        if e is None:
            raise SchemaMismatchError(f"rank {snap.rank}: tensor {name!r} is not in step {latest}; publish a keyframe")
        if (e.dtype, e.shape) != (info.dtype, info.shape):
            raise SchemaMismatchError(
                f"rank {snap.rank}: tensor {name!r} is {info.dtype}{list(info.shape)}, step {latest} has "
                f"{e.dtype}{list(e.shape)}; publish a keyframe"
            )
    return RankPlan(
        root_url, dict(storage_options), step, DELTA, latest, base.policy_digest, attempt, snap.rank, snap.world,
        options, dict(base.tensors),
    )


# ---- the rank's baseline --------------------------------------------------------------------------


def _cache_path(plan: RankPlan) -> str:
    key = blake3.blake3(plan.root_url.encode()).hexdigest()[:16]
    return os.path.join(plan.options.cache_dir, key, f"shards-rank{plan.rank}-of{plan.world}.safetensors")


def _piece_records(snap: ShardSnapshot, bits: list[np.ndarray]) -> dict[str, list]:
    out: dict[str, list] = {}
    for spec, b in zip(snap.specs, bits):
        for p in spec.pieces:
            c, local, n = p.runs()
            if p.numel:
                out.setdefault(p.name, []).append((p.start, p.extent, runs_digest(b, local, n)))
    return out


def _baseline_verified(entry: TensorEntry, records: list) -> bool:
    """This rank's pieces of ``entry`` hold the base step's bits (by the base's piece digests, or
    its plain digest when the rank's one piece is the whole tensor)."""
    if entry.pieces is None:
        return (
            len(records) == 1 and tuple(records[0][0]) == (0,) * len(entry.shape)
            and tuple(records[0][1]) == tuple(entry.shape) and records[0][2] == entry.digest
        )
    known = {(tuple(a), tuple(e)): d for a, e, d in entry.pieces.records()}
    return all(known.get((tuple(a), tuple(e))) == d for a, e, d in records)


def load_shard_baseline(plan: RankPlan, snap: ShardSnapshot) -> list[np.ndarray] | None:
    """The rank's shard bits of the base step (deltas): its local cache if that verifies against
    the base step's piece digests, else rebuilt from ROOT chunk by chunk (``rebuild_shard_baseline``)."""
    if plan.kind == KEYFRAME:
        return None
    if plan.options.use_cache:
        bits = _cached_baseline(plan, snap)
        if bits is not None:
            return bits
    return rebuild_shard_baseline(plan, snap)


def _cached_baseline(plan: RankPlan, snap: ShardSnapshot) -> list[np.ndarray] | None:
    from flows.receive_steps import STATE_STEP

    try:
        ck = SafetensorsCheckpoint(_cache_path(plan))
        # The step number only selects the file; the piece digests below verify every bit.
        if ck.metadata.get(STATE_STEP) != str(plan.base_step):
            return None
        bits = []
        for spec, dt in zip(snap.specs, snap.dtypes):
            info = ck.infos.get(spec.local_name)
            if info is None or (info.dtype, info.shape) != (dt, spec.local_shape):
                return None
            bits.append(ck.mapped_bits(spec.local_name))  # mapped: the baseline costs no extra memory
    except (DCRError, OSError):
        return None  # a missing or broken cache is only a cache
    for name, recs in _piece_records(snap, bits).items():
        if not _baseline_verified(plan.base_entries[name], recs):
            return None
    return bits


def rebuild_shard_baseline(plan: RankPlan, snap: ShardSnapshot) -> list[np.ndarray]:
    """The rank's shard of the base step, rebuilt from ROOT without assembling any tensor.

    For every canonical chunk the rank's pieces touch: the chunk's bits at the base step are built
    in one chunk buffer by applying the stored objects of that chunk index (main chunk and parts)
    along the chain from the keyframe, each verified against its manifest digest; then the rank's
    elements are copied out. Memory: the shard, one chunk buffer and the read-ahead window. Needs
    the same chunk shape for the tensor along the chain (else: publish a keyframe). Where the base
    step's piece digests cover the rank's pieces (same layout), the result is also checked
    against them; otherwise the per-chunk digests (bound by the signed manifests) are the check."""
    from dcr_core.chain import Direction
    from dcr_core.delta import apply_chunk
    from dcr_core.projection import chunks_touched, scatter_chunk, shard_runs
    from flows import receive_steps as rs
    from storage.step_io import stream_chunks

    hint = "publish a keyframe (keyframe=True / --keyframe) to start a new lineage"
    root = Root(plan.root_url, plan.storage_options)
    rplan = rs.plan_receive(plan.root_url, plan.storage_options, None, plan.base_step)
    if not rplan.moves or rplan.moves[0].direction is not Direction.KEYFRAME or any(
        m.direction is not Direction.FORWARD for m in rplan.moves[1:]
    ):
        raise StateMismatchError(f"rank {plan.rank}: cannot plan a keyframe-forward chain to step {plan.base_step}; {hint}")
    chain = [rplan.manifests[m.step] for m in rplan.moves]
    out = [np.zeros(b.size, dtype=b.dtype) for b in snap.bits]
    runs = shard_runs([s.pieces for s in snap.specs], [b.size for b in snap.bits])
    for name in sorted(runs):
        entries = [m.tensors.get(name) for m in chain]
        target = plan.base_entries[name]
        if any(e is None or (e.dtype, e.shape, e.chunk_shape) != (target.dtype, target.shape, target.chunk_shape) for e in entries):
            raise StateMismatchError(
                f"rank {plan.rank}: tensor {name!r} changes dtype, shape or chunking along the chain to step {plan.base_step}; {hint}"
            )
        grid = target.grid
        by_index = [_positions_by_index(e) for e in entries]
        touched = chunks_touched(runs[name], grid)
        jobs = ((m, e, pos) for ci in touched for m, e, idx in zip(chain, entries, by_index) for pos in idx.get(ci, ()))
        stream = stream_chunks(root, jobs, workers=plan.options.io_workers)
        try:
            for ci in touched:
                cs, ce = grid.chunk_range(ci)
                buf = np.zeros(ce - cs, dtype=DTYPES[target.dtype].storage)
                for e, idx in zip(entries, by_index):
                    for pos in idx.get(ci, ()):
                        _, _, index, payload = next(stream)
                        # chunk-relative apply: a one-chunk grid view of this chunk
                        apply_chunk(buf, ChunkGrid((ce - cs,), (ce - cs,)), 0, payload, e.encoding_at(pos))
                scatter_chunk(buf, cs, runs[name], out)
        finally:
            stream.close()
    for name, recs in _piece_records(snap, out).items():
        e = plan.base_entries[name]
        if e.pieces is not None:
            boxes = {(tuple(a), tuple(x)) for a, x, _ in e.pieces.records()}
            checkable = all((tuple(a), tuple(x)) in boxes for a, x, _ in recs)
        else:  # a plain digest: checkable when this rank holds the whole tensor as one piece
            checkable = len(recs) == 1 and tuple(recs[0][1]) == tuple(e.shape)
        if checkable and not _baseline_verified(e, recs):
            raise IntegrityError(f"rank {plan.rank}: rebuilt baseline of {name!r} does not match step {plan.base_step}'s digests")
    return out


def _positions_by_index(e: TensorEntry) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for pos in range(e.n_stored):
        out.setdefault(e.stored_at(pos)[1], []).append(pos)
    return out


def stage_shard_baseline(plan: RankPlan, snap: ShardSnapshot) -> StreamingSafetensorsWriter | None:
    """Write the snapshot as the rank's next baseline under a temp name; ``keep_shard_baseline``
    moves it into place once the step is committed (a lost cache only costs a keyframe)."""
    if not plan.options.use_cache:
        return None
    from flows.receive_steps import STATE_ROOT, STATE_STEP

    infos = [TensorInfo(s.local_name, dt, s.local_shape) for s, dt in zip(snap.specs, snap.dtypes)]
    try:
        w = StreamingSafetensorsWriter(_cache_path(plan), infos, {STATE_STEP: str(plan.step), STATE_ROOT: plan.root_url})
    except OSError:
        return None
    try:
        for s, b in zip(snap.specs, snap.bits):
            w.write(s.local_name, b)
    except Exception:  # noqa: BLE001
        w.abort()
        return None
    return w


def keep_shard_baseline(writer: StreamingSafetensorsWriter | None) -> None:
    if writer is None:
        return
    try:
        writer.commit()
    except Exception:  # noqa: BLE001 - the step is committed; only the cache is lost
        writer.abort()


def drop_shard_baseline(writer: StreamingSafetensorsWriter | None) -> None:
    if writer is not None:
        writer.abort()


# ---- encode and write the rank's chunks -------------------------------------------------------------


def encode_rank(plan: RankPlan, snap: ShardSnapshot, baseline: list[np.ndarray] | None) -> dict:
    """Project this rank's changes into canonical chunks and upload them; return its partial manifest."""
    opts = plan.options
    codec = opts.keyframe_codec if plan.kind == KEYFRAME else opts.delta_codec
    root = Root(plan.root_url, plan.storage_options)
    grids, dtypes = {}, {}
    for name, info in snap.infos.items():
        dt = DTYPES[info.dtype]
        grids[name] = ChunkGrid(info.shape, choose_chunk_shape(info.shape, dt.itemsize, opts.chunk_bytes))
        dtypes[name] = dt.storage
    shards = [
        ShardBits(spec.pieces, b, None if baseline is None else baseline[i])
        for i, (spec, b) in enumerate(zip(snap.specs, snap.bits))
    ]
    tensors = {
        name: {
            "dtype": info.dtype, "shape": list(info.shape), "chunk_shape": list(grids[name].chunk_shape),
            "array": layout.array_segment(name), "changed": 0, "chunks": [], "parts": [],
        }
        for name, info in snap.infos.items()
    }
    for name, recs in _piece_records(snap, snap.bits).items():
        tensors[name]["pieces"] = [[list(a), list(e), d] for a, e, d in recs]
    futures = []
    with StepWriter(root, plan.step, plan.attempt, codec, workers=opts.io_workers) as w:
        for c in project(shards, grids, dtypes):
            t = tensors[c.name]
            t["changed"] += c.changed
            if c.owner:
                futures.append((t["chunks"], w.write_chunk(t["array"], grids[c.name], c.index, c.payload)))
            else:
                arr = t["array"] + PARTS_SUFFIX
                futures.append((t["parts"], w.write_part(arr, grids[c.name], plan.rank, c.index, c.payload)))
        for out, f in futures:
            s = f.result()
            out.append([s.index, s.digest, s.nbytes])
    for t in tensors.values():
        t.setdefault("pieces", [])
    return {
        "format": PARTIAL_FORMAT, "rank": plan.rank, "world": plan.world, "step": plan.step, "kind": plan.kind,
        "base_step": plan.base_step, "base_policy_digest": plan.base_policy_digest, "tensors": tensors,
    }


def write_partial(plan: RankPlan, partial: dict) -> None:
    Root(plan.root_url, plan.storage_options).write(
        layout.rank_partial_key(plan.step, plan.attempt, plan.rank), json.dumps(partial).encode()
    )


def fail_attempt(plan: RankPlan, message: str) -> None:
    """Tell the other ranks this attempt is dead (best effort: they also time out)."""
    try:
        Root(plan.root_url, plan.storage_options).write(
            layout.attempt_failed_key(plan.step, plan.attempt),
            json.dumps({"rank": plan.rank, "error": message[:2000]}).encode(),
        )
    except Exception:  # noqa: BLE001
        pass


def _failed(root: Root, plan: RankPlan) -> str | None:
    key = layout.attempt_failed_key(plan.step, plan.attempt)
    if not root.exists(key):
        return None
    try:
        d = json.loads(root.read(key))
        return f"rank {int(d.get('rank'))} failed: {str(d.get('error'))[:500]}"
    except Exception:  # noqa: BLE001
        return "another rank failed"


def _poll(timeout: float, what: str, check):
    deadline, delay = time.monotonic() + timeout, 0.01
    while True:
        out = check()
        if out is not None:
            return out
        if time.monotonic() > deadline:
            raise StepConflictError(f"{what}: timed out after {timeout:.0f} s; nothing committed")
        time.sleep(delay)
        delay = min(0.25, delay * 2)


# ---- merge (rank 0) -------------------------------------------------------------------------------


def _read_partials(root: Root, plan: RankPlan, timeout: float) -> list[dict]:
    rdir = layout.ranks_dir(plan.step, plan.attempt)
    want = {f"{r}.json" for r in range(plan.world)}

    def check():
        msg = _failed(root, plan)
        if msg:
            raise StepConflictError(f"{root.url}: step {plan.step}: {msg}; nothing committed")
        return True if want <= set(root.listdir(rdir)) else None

    _poll(timeout, f"{root.url}: step {plan.step}: waiting for the partial manifests of {plan.world} ranks", check)
    out = []
    for r in range(plan.world):
        key = layout.rank_partial_key(plan.step, plan.attempt, r)
        data = root.read(key)
        where = f"{root.url}/{key}"
        if len(data) > MAX_PARTIAL_BYTES:
            raise IntegrityError(f"{where}: larger than {MAX_PARTIAL_BYTES} bytes")
        try:
            d = json.loads(data)
        except ValueError:
            raise IntegrityError(f"{where}: not valid JSON") from None
        if not isinstance(d, dict) or d.get("format") != PARTIAL_FORMAT or d.get("rank") != r or not isinstance(d.get("tensors"), dict):
            raise IntegrityError(f"{where}: not the partial manifest of rank {r}")
        for k, v in (("world", plan.world), ("step", plan.step), ("kind", plan.kind), ("base_step", plan.base_step),
                     ("base_policy_digest", plan.base_policy_digest)):
            if d.get(k) != v:
                raise StepConflictError(f"{where}: rank {r} planned {k}={d.get(k)!r}, rank 0 planned {v!r}; nothing committed")
        out.append(d)
    return out


def _columns(rows: list, what: str) -> list:
    if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == 3 for r in rows):
        raise IntegrityError(f"{what}: malformed chunk list")
    return rows


def merge_partials(plan: RankPlan, partials: list[dict]) -> dict[str, TensorEntry]:
    """One manifest entry per tensor from all ranks' partial manifests (validated like any manifest)."""
    merged: dict[str, dict] = {}
    for d in partials:
        r = d["rank"]
        for name, t in d["tensors"].items():
            what = f"rank {r} tensor {name!r}"
            if not isinstance(t, dict):
                raise IntegrityError(f"{what}: malformed entry")
            m = merged.setdefault(name, {
                "dtype": t.get("dtype"), "shape": t.get("shape"), "chunk_shape": t.get("chunk_shape"),
                "array": t.get("array"), "changed": 0, "chunks": [], "parts": [], "pieces": [],
            })
            for k in ("dtype", "shape", "chunk_shape", "array"):
                if t.get(k) != m[k]:
                    raise IntegrityError(f"{what}: {k} {t.get(k)!r} differs from another rank's {m[k]!r}")
            if isinstance(t.get("changed"), bool) or not isinstance(t.get("changed"), int):
                raise IntegrityError(f"{what}: malformed changed count")
            m["changed"] += t["changed"]
            m["chunks"] += _columns(t.get("chunks"), what)
            m["parts"] += [[i, r, dg, nb] for i, dg, nb in _columns(t.get("parts"), what)]
            m["pieces"] += _columns(t.get("pieces"), what)
    if plan.kind == DELTA:
        missing = sorted(set(plan.base_entries) - set(merged))
        if missing:
            raise SchemaMismatchError(f"tensor {missing[0]!r} of step {plan.base_step} is in no rank's shards; publish a keyframe")
    arrays = [m["array"] for m in merged.values()]
    if len(set(arrays)) != len(arrays):
        raise UsageError("two canonical tensor names map to one array name; rename one")
    entries = {}
    where = f"step {plan.step} (merged from {plan.world} ranks)"
    for name, m in sorted(merged.items()):
        chunks = sorted(m["chunks"], key=lambda x: x[0])
        parts = sorted(m["parts"], key=lambda x: (x[0], x[1]))
        try:
            records = [(tuple(a), tuple(e), dg) for a, e, dg in m["pieces"]]
            digest = pieces_digest(records)
        except (TypeError, ValueError):
            raise IntegrityError(f"{where}: tensor {name!r}: malformed piece records") from None
        stored = bool(chunks or parts)
        encoding = Encoding.FULL if plan.kind == KEYFRAME else (Encoding.XOR if stored else Encoding.UNCHANGED)
        d = {
            "dtype": m["dtype"], "shape": m["shape"], "digest": digest,
            "base_digest": plan.base_entries[name].digest if plan.kind == DELTA else None,
            "encoding": encoding.value, "changed_elements": m["changed"], "array": m["array"],
            "chunk_shape": m["chunk_shape"],
            "chunks": {"indices": [c[0] for c in chunks], "digests": [c[1] for c in chunks], "nbytes": [c[2] for c in chunks]},
            "pieces": {"scheme": "dcr-pieces-v1", "starts": [list(a) for a, _, _ in records],
                       "extents": [list(e) for _, e, _ in records], "digests": [x for _, _, x in records]},
        }
        if parts:
            d["parts"] = {
                "array": m["array"] + PARTS_SUFFIX, "slots": plan.world, "slot": [p[1] for p in parts],
                "indices": [p[0] for p in parts], "digests": [p[2] for p in parts], "nbytes": [p[3] for p in parts],
            }
        if plan.kind == DELTA:
            base = plan.base_entries[name]
            if (base.dtype, list(base.shape)) != (m["dtype"], m["shape"]):
                raise SchemaMismatchError(f"tensor {name!r} is {m['dtype']}{m['shape']}, step {plan.base_step} has {base.dtype}{list(base.shape)}")
        entries[name] = TensorEntry.from_dict(name, d, where)  # checks pieces partition, digests, limits
    return entries


def write_store_metadata(plan: RankPlan, entries: dict[str, TensorEntry]) -> None:
    """The Zarr group and array documents (so stock zarr reads the step, parts included)."""
    opts = plan.options
    codec = opts.keyframe_codec if plan.kind == KEYFRAME else opts.delta_codec
    root = Root(plan.root_url, plan.storage_options)
    with StepWriter(root, plan.step, plan.attempt, codec, workers=opts.io_workers) as w:
        w.write_group({"dcr": {"step": plan.step, "kind": plan.kind, "base_step": plan.base_step, "ranks": plan.world}})
        futs = []
        for name, e in entries.items():
            attrs = {"dcr": {"tensor": name, "dtype": e.dtype, "encoding": e.encoding.value, "step": plan.step}}
            futs.append(w.write_array(e.array, e.shape, e.chunk_shape, e.dtype, attrs))
            if e.parts is not None:
                pattrs = {"dcr": {**attrs["dcr"], "parts_of": e.array,
                                  "combine": "XOR over axis 0, then XOR with the main array"}}
                futs.append(w.write_array(e.parts.array, (e.parts.slots, *e.shape), (1, *e.chunk_shape), e.dtype, pattrs))
        for f in futs:
            f.result()


def commit_merged(plan: RankPlan, timeout: float) -> tuple[Manifest, CommitMarker]:
    root = Root(plan.root_url, plan.storage_options)
    entries = merge_partials(plan, _read_partials(root, plan, timeout))
    write_store_metadata(plan, entries)
    pplan = plan.publish_plan()
    manifest, digest = ps.write_manifest(pplan, entries)
    return manifest, ps.commit_step(pplan, manifest, digest)


def await_commit(plan: RankPlan, timeout: float) -> CommitMarker:
    root = Root(plan.root_url, plan.storage_options)

    def check():
        marker = Catalog(root).marker(plan.step)  # a fresh catalog: markers are cached per instance
        if marker is not None:
            if marker.attempt != plan.attempt:
                raise StepConflictError(f"{root.url}: step {plan.step} was committed by another publisher (attempt {marker.attempt})")
            return marker
        msg = _failed(root, plan)
        if msg:
            raise StepConflictError(f"{root.url}: step {plan.step}: {msg}; nothing committed")
        return None

    return _poll(timeout, f"{root.url}: step {plan.step}: rank {plan.rank} waiting for the commit", check)


# ---- the pipelines --------------------------------------------------------------------------------


def run_rank(
    root: str, source: ShardedSource, step: int, keyframe: bool = False, storage_options: dict | None = None,
    options: PublishOptions | None = None, attempt: str | None = None, timeout: float = 600.0,
):
    """One rank's publish of ``step`` (every rank calls this; rank 0 also commits)."""
    from flows.pipeline import PublishResult, _Timer

    options = options or PublishOptions()
    so = dict(storage_options or {})
    root = os.fspath(root)
    t = _Timer()
    snap = t("snapshot", source.snapshot)
    attempt = agree_on_attempt(attempt, snap.world)
    plan = None
    try:
        plan = t("plan", plan_rank, root, so, snap, step, keyframe, options, attempt)
        baseline = t("baseline", load_shard_baseline, plan, snap)
        partial = t("encode_write", encode_rank, plan, snap, baseline)
        t("partial_manifest", write_partial, plan, partial)
        if plan.rank == 0:
            manifest, marker = t("commit", commit_merged, plan, timeout)
            summary = manifest.summary()
        else:
            marker = t("await_commit", await_commit, plan, timeout)
            summary = dict(marker.summary)
    except BaseException as e:
        # Tell the other ranks at once (they would otherwise wait for their timeout).
        fail_attempt(plan or RankPlan(root, so, step, "", None, None, attempt, snap.rank, snap.world, options), str(e))
        raise
    t("remember_baseline", lambda: keep_shard_baseline(stage_shard_baseline(plan, snap)))
    return PublishResult(marker.step, marker.kind, marker.base_step, marker.attempt, marker.policy_digest, summary, t.timings)


def rank_part(
    root: str, storage_options: dict, source: ShardedSource, step: int, keyframe: bool, options: PublishOptions,
    attempt: str,
) -> tuple[RankPlan, StreamingSafetensorsWriter | None]:
    """One rank's share of an in-process publish: snapshot, plan, baseline, encode and upload, partial
    manifest, and its next baseline staged (kept only once the step is committed)."""
    snap = source.snapshot()
    plan = plan_rank(root, storage_options, snap, step, keyframe, options, attempt)
    baseline = load_shard_baseline(plan, snap)
    write_partial(plan, encode_rank(plan, snap, baseline))
    return plan, stage_shard_baseline(plan, snap)


def run_ranks_in_process(
    root: str, sources: list[ShardedSource], step: int, keyframe: bool = False, storage_options: dict | None = None,
    options: PublishOptions | None = None, tasks=None,
):
    """Publish the shards of all ranks from one process, one rank at a time (memory: one rank's
    shards), e.g. a DCP directory. ``tasks``: ``rank_part``/``commit_merged`` as plain functions
    (default) or as Prefect tasks (one task per rank, then the commit)."""
    from flows.pipeline import PublishResult, _Timer

    tasks = tasks or SimpleNamespace(publish_rank_part=rank_part, commit_ranks=commit_merged)
    options = options or PublishOptions()
    so = dict(storage_options or {})
    root = os.fspath(root)
    world = {s.world for s in sources}
    ranks = sorted(s.rank for s in sources)
    if len(world) != 1 or ranks != list(range(next(iter(world)))):
        raise UsageError(f"sources must be ranks 0..world-1 of one world, got ranks {ranks} of worlds {sorted(world)}")
    t = _Timer()
    attempt = uuid.uuid4().hex
    plans, staged = [], []
    try:
        for src in sorted(sources, key=lambda s: s.rank):
            plan, writer = t("rank_part", tasks.publish_rank_part, root, so, src, step, keyframe, options, attempt)
            plans.append(plan)
            staged.append(writer)
        manifest, marker = t("commit", tasks.commit_ranks, plans[0], 0.0)
    except BaseException as e:
        for w in staged:
            drop_shard_baseline(w)
        if plans and not isinstance(e, StepConflictError):
            ps._discard(Root(root, so), plans[0].publish_plan())
        raise
    for w in staged:
        t("remember_baseline", keep_shard_baseline, w)
    return PublishResult(marker.step, marker.kind, marker.base_step, marker.attempt, marker.policy_digest,
                         manifest.summary(), t.timings)
