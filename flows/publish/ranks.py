"""Publishing from training shards: every rank projects its own changes; rank 0 commits.

Per rank (no data collective, no tensor assembled): plan as any publish does, for the canonical
tensors the rank touches; load its baseline (``flows.publish.shard_baseline``); project its changes
into canonical chunks (``dcr_core.projection.project``, one chunk buffer at a time): a chunk the
rank covers entirely goes to the tensor's array, a chunk it shares to slot ``rank`` of the sibling
parts array (``<array>%parts``); each piece's digest comes from the local bits; chunks and parts
go into the rank's own packs (``PublishOptions.pack_bytes``; 0: one object each); then its partial
manifest, ``attempts/A/ranks/<rank>.json``, saying where each lies.

Rank 0 waits for every partial manifest (metadata through storage), merges them into one manifest
(the pieces partition every tensor; its digest is the piecewise digest; every rank packed, or none
did), writes the Zarr metadata of an unpacked step, the manifest and the commit marker exactly as an
unsharded publish does. The other ranks wait for
the marker naming their attempt. A rank that fails writes ``attempts/A/failed.json``: nothing is
committed, and the attempt stays unreferenced like any crashed attempt.

Attempt id: passed in (every rank the same), or broadcast from rank 0 when torch.distributed is
initialized (as 16 raw bytes in a tensor; no pickled objects), or a fresh one for one process.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dcr_core import events
from dcr_core.chain import DELTA, KEYFRAME
from dcr_core.chunking import ChunkGrid, choose_chunk_shape
from dcr_core.delta import Encoding
from dcr_core.digest import pieces_digest
from dcr_core.dtypes import DTYPES
from dcr_core.errors import DCRError, IntegrityError, SchemaMismatchError, StepConflictError, UnsafeKeyError, UsageError
from dcr_core.projection import ShardBits, project
from dcr_core.text import plural
from flows import local_refs
from flows.local_refs import LocalRef
from flows.options import PublishOptions
from flows.publish.commit import WrittenManifest, commit_step, write_manifest
from flows.publish.plan import DEFAULT_TIMEOUT, PublishPlan, plan_publish
from flows.publish.shard_baseline import piece_records
from flows.publish.shards import ShardSnapshot
from flows.streaming import poll
from storage import layout
from storage.catalog import Catalog
from storage.chunk_io import StepWriter, StoredChunk
from storage.document_fields import fail, parse_digest, parse_int, parse_shape
from storage.manifest import MAX_PACK_BYTES, ChunkTable, PartTable, PieceTable, TensorEntry
from storage.marker import CommitMarker
from storage.root import Root, RootRef, open_root

log = logging.getLogger("dcr.publish")

PARTIAL_FORMAT = "dcr-rank-partial"
MAX_PARTIAL_BYTES = 256 << 20


def agree_on_attempt(attempt: str | None, world: int) -> str:
    """The attempt id every rank uses (see the module docstring)."""
    if attempt is not None:
        return layout.check_attempt(attempt)
    if dist.is_available() and dist.is_initialized():
        buf = torch.zeros(16, dtype=torch.uint8)
        if dist.get_rank() == 0:
            buf = torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8).clone()
        dist.broadcast(buf, src=0)
        return bytes(buf.tolist()).hex()
    if world > 1:
        raise UsageError("a sharded publish over several processes needs attempt=<hex id> (the same on every rank) or torch.distributed")
    return uuid.uuid4().hex


# ---- a rank's partial manifest ------------------------------------------------------------------


# Chunk index, payload digest, stored bytes; in a packed step also the pack holding it and its
# offset there (each rank packs what it stores: its writer's own tag names its packs).
Stored = tuple[int, str, int] | tuple[int, str, int, str, int]


def _stored(s: StoredChunk) -> Stored:
    return (s.index, s.digest, s.nbytes, s.pack, s.offset) if s.pack else (s.index, s.digest, s.nbytes)


@dataclass
class PartialEntry:
    """One canonical tensor as one rank contributed to it."""

    dtype: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    array: str
    changed: int = 0
    chunks: list[Stored] = field(default_factory=list)  # whole chunks this rank covers
    parts: list[Stored] = field(default_factory=list)  # this rank's parts of shared chunks
    pieces: list[tuple[tuple[int, ...], tuple[int, ...], str]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "dtype": self.dtype, "shape": list(self.shape), "chunk_shape": list(self.chunk_shape),
            "array": self.array, "changed": self.changed, "chunks": [list(c) for c in self.chunks],
            "parts": [list(p) for p in self.parts], "pieces": [[list(a), list(e), d] for a, e, d in self.pieces],
        }

    @classmethod
    def from_dict(cls, d: object, what: str) -> PartialEntry:
        if not isinstance(d, dict):
            raise fail(what, "malformed entry")
        if d.get("dtype") not in DTYPES:
            raise fail(what, f"unsupported dtype {d.get('dtype')!r}")
        shape, chunk_shape = parse_shape(d.get("shape"), what), parse_shape(d.get("chunk_shape"), what)
        grid = ChunkGrid(shape, chunk_shape)
        last = max(0, grid.n_chunks - 1)

        def pack(name: object) -> str:
            try:
                return layout.check_pack(name)
            except UnsafeKeyError as e:
                raise fail(what, str(e)) from None

        def stored(rows: object) -> list[Stored]:
            if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) in (3, 5) for r in rows):
                raise fail(what, "malformed chunk list")
            return [(parse_int(r[0], what, 0, last), parse_digest(r[1], what), parse_int(r[2], what))
                    + (() if len(r) == 3 else (pack(r[3]), parse_int(r[4], what, 0, MAX_PACK_BYTES)))
                    for r in rows]

        pieces = d.get("pieces")
        if not isinstance(pieces, list) or not all(isinstance(p, list) and len(p) == 3 for p in pieces):
            raise fail(what, "malformed piece records")
        return cls(
            d["dtype"], shape, chunk_shape, layout.check_segment(d.get("array"), f"{what} array"),
            parse_int(d.get("changed"), what), stored(d.get("chunks")), stored(d.get("parts")),
            [(parse_shape(a, what), parse_shape(e, what), parse_digest(dg, what)) for a, e, dg in pieces],
        )


@dataclass
class RankPartial:
    """What one rank wrote for one attempt (stored as ``ranks/<rank>.json``)."""

    rank: int
    world: int
    step: int
    kind: str
    base_step: int | None
    base_policy_digest: str | None
    tensors: dict[str, PartialEntry]
    packed: bool = False  # its chunks and parts lie in packs (absent from partials written before packs)

    def to_json(self) -> bytes:
        return json.dumps({
            "format": PARTIAL_FORMAT, "rank": self.rank, "world": self.world, "step": self.step, "kind": self.kind,
            "base_step": self.base_step, "base_policy_digest": self.base_policy_digest, "packed": self.packed,
            "tensors": {n: e.to_dict() for n, e in self.tensors.items()},
        }).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str, rank: int) -> RankPartial:
        if len(data) > MAX_PARTIAL_BYTES:
            raise IntegrityError(f"{where}: larger than {MAX_PARTIAL_BYTES} bytes")
        try:
            d = json.loads(data)
        except (ValueError, RecursionError):
            raise IntegrityError(f"{where}: not valid JSON") from None
        if not isinstance(d, dict) or d.get("format") != PARTIAL_FORMAT or d.get("rank") != rank or not isinstance(d.get("tensors"), dict):
            raise IntegrityError(f"{where}: not the partial manifest of rank {rank}")
        packed = d.get("packed", False)
        tensors = {str(n): PartialEntry.from_dict(t, f"rank {rank} tensor {n!r}") for n, t in d["tensors"].items()}
        rows = [r for t in tensors.values() for r in t.chunks + t.parts]
        if not isinstance(packed, bool) or any((len(r) == 5) != packed for r in rows):
            raise IntegrityError(f"{where}: packed is {packed!r}, but its chunks say otherwise")
        return cls(rank, d.get("world"), d.get("step"), d.get("kind"), d.get("base_step"), d.get("base_policy_digest"),
                   tensors, packed)


# ---- the rank's encode ------------------------------------------------------------------------------


def encode_rank(plan: PublishPlan, snapshot: LocalRef, baseline: LocalRef | None) -> str:
    """Project this rank's changes into canonical chunks, upload them and write the rank's partial
    manifest; returns its key."""
    snap: ShardSnapshot = local_refs.get(snapshot)
    base_bits = None if baseline is None else local_refs.get(baseline)
    opts = plan.options
    grids, dtypes = {}, {}
    for name, info in snap.infos.items():
        dt = DTYPES[info.dtype]
        grids[name] = ChunkGrid(info.shape, choose_chunk_shape(info.shape, dt.itemsize, opts.chunk_bytes))
        dtypes[name] = dt.storage
    shards = [
        ShardBits(spec.pieces, b, None if base_bits is None else base_bits[i])
        for i, (spec, b) in enumerate(zip(snap.specs, snap.bits))
    ]
    tensors = {
        name: PartialEntry(info.dtype, info.shape, grids[name].chunk_shape, layout.array_segment(name))
        for name, info in snap.infos.items()
    }
    for name, recs in piece_records(snap, snap.bits).items():
        tensors[name].pieces = [(tuple(a), tuple(e), d) for a, e, d in recs]
    root = open_root(plan.root)
    futures = []
    with StepWriter(root, plan.step, plan.attempt, plan.codec, workers=opts.io_workers, pack_bytes=opts.pack_bytes) as w:
        for c in project(shards, grids, dtypes):
            t = tensors[c.name]
            t.changed += c.changed
            if c.owner:
                futures.append((t.chunks, w.write_chunk(t.array, grids[c.name], c.index, c.payload)))
            else:
                futures.append((t.parts, w.write_part(layout.parts_array(t.array), grids[c.name], plan.rank, c.index, c.payload)))
        for out, f in futures:
            out.append(_stored(f.result()))
    partial = RankPartial(plan.rank, plan.world, plan.step, plan.kind, plan.base_step, plan.base_policy_digest, tensors,
                          opts.pack_bytes > 0)
    key = layout.rank_partial_key(plan.step, plan.attempt, plan.rank)
    root.write(key, partial.to_json())
    events.reached("publish.rank-partial-written", step=plan.step, rank=plan.rank)
    return key


def plan_rank(root: RootRef, snapshot: LocalRef, step: int, keyframe: bool, options: PublishOptions,
              attempt: str) -> PublishPlan:
    """The plan of one rank's part of a sharded publish (the tensors its shards touch)."""
    snap: ShardSnapshot = local_refs.get(snapshot)
    if options.delta_codec.conditional and not keyframe:
        raise UsageError("the dcr.cond codec codes each chunk against its whole old bits, which no training rank "
                         "holds: publish from shards with dcr.sparse (the default) or blosc")
    if options.column_blocks > 1:
        raise UsageError("column blocks are not flat ranges of the canonical tensor, which is how training ranks' "
                         "shards are projected onto chunks: publish from shards with column_blocks=1 (the default)")
    return plan_publish(root, snap.infos, step, keyframe, options, f"<shards of {plural(snap.world, 'rank')}>",
                        shard=(snap.rank, snap.world), attempt=attempt)


def fail_attempt(root: RootRef, step: int, attempt: str, rank: int, message: str) -> None:
    """Tell the other ranks this attempt is dead (best effort: they also time out)."""
    try:
        open_root(root).write(
            layout.attempt_failed_key(step, attempt), json.dumps({"rank": rank, "error": message[:2000]}).encode()
        )
    except (OSError, DCRError) as e:
        log.warning("rank %d: could not mark attempt %s failed (%s); the other ranks time out", rank, attempt, e)


def _failed(root: Root, plan: PublishPlan) -> str | None:
    key = layout.attempt_failed_key(plan.step, plan.attempt)
    try:
        d = json.loads(root.read(key, limit=64 << 10))
    except FileNotFoundError:
        return None
    except (ValueError, RecursionError, IntegrityError):
        return "another rank failed"
    if not isinstance(d, dict):
        return "another rank failed"
    return f"rank {d.get('rank')!r} failed: {str(d.get('error'))[:500]}"


# ---- merge and commit (rank 0) ------------------------------------------------------------------


def read_partials(root: Root, plan: PublishPlan, timeout: float) -> list[RankPartial]:
    rdir = layout.ranks_dir(plan.step, plan.attempt)
    want = {f"{r}.json" for r in range(plan.world)}

    def all_written():
        msg = _failed(root, plan)
        if msg:
            raise StepConflictError(f"{root.url}: step {plan.step}: {msg}; nothing committed")
        return True if want <= set(root.listdir(rdir)) else None

    poll(all_written, f"{root.url}: step {plan.step}: waiting for the partial manifests of {plural(plan.world, 'rank')}", timeout)
    out = []
    for r in range(plan.world):
        key = layout.rank_partial_key(plan.step, plan.attempt, r)
        where = f"{root.url}/{key}"
        p = RankPartial.from_json(root.read(key, limit=MAX_PARTIAL_BYTES), where, r)
        for k, v in (("world", plan.world), ("step", plan.step), ("kind", plan.kind), ("base_step", plan.base_step),
                     ("base_policy_digest", plan.base_policy_digest), ("packed", plan.options.pack_bytes > 0)):
            if getattr(p, k) != v:
                raise StepConflictError(f"{where}: rank {r} planned {k}={getattr(p, k)!r}, rank 0 planned {v!r}; nothing committed")
        out.append(p)
    return out


def merge_partials(plan: PublishPlan, partials: list[RankPartial]) -> dict[str, TensorEntry]:
    """One manifest entry per tensor from all ranks' partial manifests."""
    merged: dict[str, tuple[PartialEntry, list, list, list]] = {}
    changed: dict[str, int] = {}
    for p in partials:
        for name, t in p.tensors.items():
            what = f"rank {p.rank} tensor {name!r}"
            first, chunks, parts, pieces = merged.setdefault(name, (t, [], [], []))
            for k in ("dtype", "shape", "chunk_shape", "array"):
                if getattr(t, k) != getattr(first, k):
                    raise IntegrityError(f"{what}: {k} {getattr(t, k)!r} differs from another rank's {getattr(first, k)!r}")
            changed[name] = changed.get(name, 0) + t.changed
            chunks += t.chunks
            parts += [(r[0], p.rank, *r[1:]) for r in t.parts]
            pieces += t.pieces
    base = plan.base_entries()
    if plan.kind == DELTA:
        missing = sorted(set(base) - set(merged))
        if missing:
            raise SchemaMismatchError(f"tensor {missing[0]!r} of step {plan.base_step} is in no rank's shards; publish a keyframe")
    arrays = [first.array for first, *_ in merged.values()]
    if len(set(arrays)) != len(arrays):
        raise UsageError("two canonical tensor names map to one array name; rename one")
    where = f"step {plan.step} (merged from {plural(plan.world, 'rank')})"
    entries = {}
    for name, (first, chunks, parts, pieces) in sorted(merged.items()):
        chunks.sort()
        parts.sort()
        if any(a[0] == b[0] for a, b in zip(chunks, chunks[1:])) or any(a[:2] == b[:2] for a, b in zip(parts, parts[1:])):
            raise IntegrityError(f"{where}: tensor {name!r}: two ranks stored the same chunk")
        if plan.kind == DELTA and (base[name].dtype, base[name].shape) != (first.dtype, first.shape):
            raise SchemaMismatchError(
                f"tensor {name!r} is {first.dtype}{list(first.shape)}, step {plan.base_step} has {base[name].dtype}{list(base[name].shape)}"
            )
        table = PieceTable(tuple(a for a, _, _ in pieces), tuple(e for _, e, _ in pieces), tuple(d for _, _, d in pieces))
        encoding = Encoding.FULL if plan.kind == KEYFRAME else (Encoding.XOR if chunks or parts else Encoding.UNCHANGED)
        entry = TensorEntry(
            name=name, dtype=first.dtype, shape=first.shape, digest=pieces_digest(table.records()),
            encoding=encoding, array=first.array, chunk_shape=first.chunk_shape,
            chunks=ChunkTable(*_columns(chunks, 0, 1, 2, 3, 4)),
            base_digest=base[name].digest if plan.kind == DELTA else None, changed=changed[name], pieces=table, scheme=plan.scheme,
            parts=None if not parts else PartTable(layout.parts_array(first.array), plan.world, *_columns(parts, 1, 0, 2, 3, 4, 5)),
        )
        # Other ranks' data: the checks every reader of the manifest makes (pieces partition the
        # tensor, no chunk both whole and in parts, limits), made here before anything is written;
        # that the packs' chunks tile them is checked on the whole manifest (``write_manifest``).
        packs = sorted({p for p, _, _ in entry.packed_spans()})
        entries[name] = TensorEntry.from_dict(name, entry.to_dict({p: i for i, p in enumerate(packs)}), where,
                                              packs=tuple(packs))
    return entries


def _columns(rows: list[tuple], *fields: int) -> list[tuple]:
    """Columns ``fields`` of the rows, in that order; rows without the last two of a packed step
    (the pack, the offset) give them empty."""
    return [tuple(r[f] for r in rows) if all(len(r) > f for r in rows) else () for f in fields]


def write_store_metadata(plan: PublishPlan, entries: dict[str, TensorEntry]) -> None:
    """The Zarr group and array documents (so stock zarr reads the step, parts included), for an
    unpacked step: a packed one has none, as an unsharded one (``StepWriter``)."""
    if plan.options.pack_bytes > 0:
        return
    with StepWriter(open_root(plan.root), plan.step, plan.attempt, plan.codec, workers=plan.options.io_workers) as w:
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


def commit_ranks(plan: PublishPlan, timeout: float = DEFAULT_TIMEOUT) -> tuple[WrittenManifest, CommitMarker]:
    """Rank 0: wait for every rank's partial manifest, merge, write the manifest, commit."""
    root = open_root(plan.root)
    entries = merge_partials(plan, read_partials(root, plan, timeout))
    write_store_metadata(plan, entries)
    manifest = write_manifest(plan, entries)
    return manifest, commit_step(plan, manifest)


def await_commit(plan: PublishPlan, timeout: float = DEFAULT_TIMEOUT) -> CommitMarker:
    """Ranks other than 0: wait for the marker naming this attempt (or a failure)."""
    root = open_root(plan.root)

    def committed():
        marker = Catalog(root).marker(plan.step)
        if marker is not None:
            if marker.attempt != plan.attempt:
                raise StepConflictError(f"{root.url}: step {plan.step} was committed by another publisher (attempt {marker.attempt})")
            return marker
        msg = _failed(root, plan)
        if msg:
            raise StepConflictError(f"{root.url}: step {plan.step}: {msg}; nothing committed")
        return None

    return poll(committed, f"{root.url}: step {plan.step}: rank {plan.rank} waiting for the commit", timeout)
