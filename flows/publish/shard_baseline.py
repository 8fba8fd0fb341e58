"""A rank's baseline: its own shard bits of the base step, without gathering any tensor.

1. The rank's cache file (``shards-rank<r>-of<w>.safetensors`` in the ROOT's publisher cache),
   memory-mapped and verified piece by piece against the base manifest's piece digests (or its
   plain digest where the rank holds a whole tensor as one piece).
2. Else rebuilt from ROOT chunk by chunk (``rebuild``): for every canonical chunk the rank's
   pieces touch, the chunk's bits at the base step are built in one chunk buffer from the stored
   objects of that chunk index (main chunk and parts) along the chain from the keyframe, each
   verified on arrival; then the rank's elements are copied out.
After the commit the rank's snapshot becomes its next baseline (staged before, installed after).
"""

from __future__ import annotations

import contextlib
import logging
import os

import numpy as np

from dcr_core.chain import KEYFRAME, Direction
from dcr_core.chunking import ChunkGrid
from dcr_core.delta import apply_chunk
from dcr_core.digest import FLAT, runs_digest
from dcr_core.dtypes import DTYPES
from dcr_core.errors import DCRError, IntegrityError, StateMismatchError
from dcr_core.projection import chunks_touched, scatter_chunk, shard_runs
from flows import local_refs
from flows.local_refs import LocalRef
from flows.publish.baseline import cache_path
from flows.publish.plan import PublishPlan
from flows.publish.shards import ShardSnapshot
from storage import reader
from storage.chunk_io import stream_chunks
from storage.local import state
from storage.local.safetensors import SafetensorsCheckpoint, StreamingSafetensorsWriter, install
from storage.manifest import TensorEntry
from storage.root import open_root

log = logging.getLogger("dcr.publish")

KEYFRAME_HINT = "publish a keyframe (keyframe=True / --keyframe) to start a new lineage"


def rank_cache_path(plan: PublishPlan) -> str:
    return cache_path(plan, f"shards-rank{plan.rank}-of{plan.world}.safetensors")


def piece_records(snap: ShardSnapshot, bits: list[np.ndarray], base: dict[str, TensorEntry] | None = None,
                  ) -> dict[str, list]:
    """``(start, extent, digest)`` of every non-empty piece of the rank, by canonical tensor. With
    ``base``: a piece that is a whole tensor whose base entry has a plain digest is hashed in the
    base manifest's scheme (block digests), so ``_verified`` can compare it with that digest."""
    out: dict[str, list] = {}
    for spec, b in zip(snap.specs, bits):
        for p in spec.pieces:
            c, local, n = p.runs()
            if p.numel:
                e = None if base is None else base.get(p.name)
                whole = e is not None and e.pieces is None and tuple(p.extent) == tuple(e.shape)
                scheme = e.scheme if whole else FLAT
                out.setdefault(p.name, []).append((p.start, p.extent, runs_digest(b, local, n, scheme)))
    return out


def _verified(entry: TensorEntry, records: list) -> bool:
    """This rank's pieces of ``entry`` hold the base step's bits (by the base's piece digests, or
    its plain digest when the rank's one piece is the whole tensor)."""
    if entry.pieces is None:
        return (
            len(records) == 1 and tuple(records[0][0]) == (0,) * len(entry.shape)
            and tuple(records[0][1]) == tuple(entry.shape) and records[0][2] == entry.digest
        )
    known = {(tuple(a), tuple(e)): d for a, e, d in entry.pieces.records()}
    return all(known.get((tuple(a), tuple(e))) == d for a, e, d in records)


def load_shard_baseline(plan: PublishPlan, snapshot: LocalRef) -> LocalRef | None:
    """The rank's shard bits of the base step (deltas), held in this process (see module doc)."""
    if plan.kind == KEYFRAME:
        return None
    snap: ShardSnapshot = local_refs.get(snapshot)
    bits = _cached(plan, snap) if plan.options.use_cache else None
    return local_refs.put(bits if bits is not None else rebuild(plan, snap), "shard baseline")


def _cached(plan: PublishPlan, snap: ShardSnapshot) -> list[np.ndarray] | None:
    try:
        with SafetensorsCheckpoint(rank_cache_path(plan)) as ck:
            # The step number only selects the file; the piece digests below verify every bit.
            if ck.metadata.get(state.STEP) != str(plan.base_step):
                return None
            bits = []
            for spec, dt in zip(snap.specs, snap.dtypes):
                info = ck.infos.get(spec.local_name)
                if info is None or (info.dtype, info.shape) != (dt, spec.local_shape):
                    return None
                bits.append(ck.mapped_bits(spec.local_name))  # mapped (its own mapping): no extra memory
    except (DCRError, OSError):
        return None  # a missing or broken cache is only a cache
    base = plan.base_entries()
    for name, recs in piece_records(snap, bits, base).items():
        if not _verified(base[name], recs):
            return None
    return bits


def _positions_by_index(e: TensorEntry) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for pos in range(e.n_stored):
        out.setdefault(e.stored_at(pos)[1], []).append(pos)
    return out


def rebuild(plan: PublishPlan, snap: ShardSnapshot) -> list[np.ndarray]:
    """The rank's shard of the base step, rebuilt from ROOT without assembling any tensor.

    Memory: the shard, one chunk buffer and the read-ahead window. Needs the same chunk shape for
    the tensor along the chain (else: publish a keyframe). Where the base step's piece digests cover
    the rank's pieces (same layout), the result is also checked against them; otherwise the
    per-chunk digests (bound by the signed manifests) are the check."""
    root = open_root(plan.root)
    rplan = reader.plan_refit(root, None, plan.base_step)
    if not rplan.from_keyframe or any(m.direction is not Direction.FORWARD for m in rplan.moves[1:]):
        raise StateMismatchError(f"rank {plan.rank}: cannot plan a keyframe-forward chain to step {plan.base_step}; {KEYFRAME_HINT}")
    ms = reader.manifests(rplan, root)
    chain = [ms[m.step] for m in rplan.moves]
    forwards = reader.move_forwards(rplan)
    base = plan.base_entries()
    out = [np.zeros(b.size, dtype=b.dtype) for b in snap.bits]
    runs = shard_runs([s.pieces for s in snap.specs], [b.size for b in snap.bits])
    for name in sorted(runs):
        entries = [m.tensors.get(name) for m in chain]
        target = base[name]
        if any(e is None or (e.dtype, e.shape, e.chunk_shape) != (target.dtype, target.shape, target.chunk_shape) for e in entries):
            raise StateMismatchError(
                f"rank {plan.rank}: tensor {name!r} changes dtype, shape or chunking along the chain to step {plan.base_step}; {KEYFRAME_HINT}"
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
                one_chunk = ChunkGrid((ce - cs,), (ce - cs,))  # chunk-relative apply
                for e, idx, forward in zip(entries, by_index, forwards):
                    for pos in idx.get(ci, ()):
                        _, _, _, payload = next(stream)
                        apply_chunk(buf, one_chunk, 0, payload, e.encoding_at(pos), forward)
                scatter_chunk(buf, cs, runs[name], out)
        finally:
            stream.close()
    for name, recs in piece_records(snap, out, base).items():
        e = base[name]
        if e.pieces is not None:
            boxes = {(tuple(a), tuple(x)) for a, x, _ in e.pieces.records()}
            checkable = all((tuple(a), tuple(x)) in boxes for a, x, _ in recs)
        else:  # a plain digest: checkable when this rank holds the whole tensor as one piece
            checkable = len(recs) == 1 and tuple(recs[0][1]) == tuple(e.shape)
        if checkable and not _verified(e, recs):
            raise IntegrityError(f"rank {plan.rank}: rebuilt baseline of {name!r} does not match step {plan.base_step}'s digests")
    return out


def stage_shard_baseline(plan: PublishPlan, snapshot: LocalRef) -> str | None:
    """Write the snapshot as the rank's next baseline under a temp name (installed once the step is
    committed: ``keep_shard_baseline``); None without a cache or when it cannot be written (a lost
    cache only costs a rebuild)."""
    if not plan.options.use_cache:
        return None
    snap: ShardSnapshot = local_refs.get(snapshot)
    infos = [info for info in snap.local_infos()]
    try:
        w = StreamingSafetensorsWriter(rank_cache_path(plan), infos, {state.STEP: str(plan.step), state.ROOT: plan.root.url},
                                       durable=False)
    except OSError as e:
        log.warning("rank %d: cannot stage its next baseline (%s)", plan.rank, e)
        return None
    try:
        for s, b in zip(snap.specs, snap.bits):
            w.write(s.local_name, b)
        return w.finish()
    except (OSError, ValueError) as e:
        w.abort()
        log.warning("rank %d: cannot stage its next baseline (%s)", plan.rank, e)
        return None


def keep_shard_baseline(plan: PublishPlan, staged: str | None) -> None:
    """Install the staged baseline (after the commit)."""
    if staged is None:
        return
    try:
        install(staged, rank_cache_path(plan), durable=False)
    except OSError as e:  # the step is committed; only the cache is lost
        log.warning("rank %d: cannot keep its next baseline (%s); the next delta rebuilds it", plan.rank, e)
        drop_shard_baseline(staged)


def drop_shard_baseline(staged: str | None) -> None:
    if staged is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staged)
