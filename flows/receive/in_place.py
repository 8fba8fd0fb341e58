"""Refitting a receiver's state file in place (``ReceiveOptions(in_place=True)``, ``--in-place``).

The default refit writes a whole new state file and renames it over the old one: a reader that has
the file open keeps a consistent old copy, but every refit reads the whole state and writes and
fsyncs a second copy. In place, only the changed elements are written into the file (the page
cache still writes back every page they dirty: with changes scattered at 1% or more that is nearly
every 4 KiB page, so the disk writes about the file once either way; what is saved is the full
read and the second copy):

1. *Compute* (``stage_patch``; the file is not touched), tensor by tensor, with chunks fetched as
   they arrive. One XOR delta (the common case): one pass per chunk over the held bits
   (memory-mapped) gives the new bits of the chunk and every change as (position, old value, new
   value), into arrays sized by the manifest's count of changed elements; the new tensor is hashed
   as it streams by (on a hash lane beside the next chunk's pass): no copy of the tensor. A
   ``dcr-sparse`` chunk comes unchecked (``storage.chunk_io.UncheckedChunk``) and is applied from
   its stored frame (``sparse.xor_frame``, C: its gap and value planes; no dense mask is built,
   decoded or hashed); its digest covers the decoded mask, so it is checked only when the tensor's
   result fails, to name the bad object. Other chunks are decoded, checked and scanned
   (``sparse.xor_changes``). With the held block digests trusted, such a delta's chunks are applied
   and hashed on worker threads (``_xor_parallel``). Otherwise (several moves, overwrites, shared
   parts, piecewise digests, column blocks): the held bits are copied into a scratch buffer, every
   chunk applied, and the elements that differ kept. Either way the result is checked against the
   target step's digest, and a tensor no move touches is checked in place. For XOR deltas the
   result matches its digest exactly when the held bits were the base's, so this also checks the
   held state. The journal (``storage.local.journal``: positions, old and new values, both headers)
   is written under a temp name as its records are computed (``journal.Stager``) and fsynced at the
   end.
2. *Install* (``flows.receive.state_file.install_state``): the journal is put in force (renamed
   ``.undo``), the new values and the new header (same length, padded) are written into the file's
   page cache, and the journal is renamed ``.redo``: committed. The file is not fsynced here; the
   kernel writes the pages back, and the next receive (or ``consistent_state``) settles the patch:
   an fsync in the same boot, new values where the file differs after a reboot; journal deleted.

A crash before the commit leaves ``.undo``: the next receive of that state (under the state's lock)
rolls the file back to its old step before anything else, so a retry ends bit-exact. A crash or a
power loss after it leaves ``.redo``: the next receive rolls the file forward to the new step. Not atomic
for other readers: a process reading the state file while a patch runs, or after a crash cut one
off (or a power loss followed a committed one) and before the next receive, can see a mix of two
steps. Readers outside DCR read inside
``storage.local.state.consistent_state(path)``, or use the default rewrite. Memory: the journal is
built in memory before it is staged, 8 bytes per changed BF16 element (3.2 GB for an 8B-parameter
model at 5% changed). Chosen only for a held single-file state, no restart from a keyframe, a
header that fits and a journal under half the state file; otherwise the refit rewrites.
"""

from __future__ import annotations

import logging
import math
import os
import queue
from dataclasses import dataclass

import blake3
import numpy as np

from dcr_core import events, sparse
from dcr_core.delta import Encoding, apply_chunk, resolve
from dcr_core.digest import block_count, block_leaves, blocks_root
from dcr_core.dtypes import DTYPES
from dcr_core.errors import IntegrityError, StateMismatchError
from dcr_core.hash_lane import LANE_MIN_BYTES, HashLane
from flows.options import ReceiveOptions
from storage import reader
from storage.chunk_io import BoundedPool, UncheckedChunk, stream_chunks
from storage.local import journal, sidecar, state
from storage.local.safetensors import SafetensorsCheckpoint
from storage.reader import RefitPlan
from storage.root import open_root

log = logging.getLogger("dcr.receive")
MAX_JOURNAL_FRACTION = 0.5  # a rewrite writes the whole state; a journal this big already costs half


@dataclass(frozen=True)
class StagedPatch:
    journal: str  # the staged (not yet active) journal
    bytes_pulled: int
    journal_bytes: int
    sidecar: str | None = None  # the staged block digests of the new state (``storage.local.sidecar``)
    blocks_hashed: int = 0  # blocks hashed (with block digests: changed, sampled or untrusted ones)


def blocked(*manifests) -> int | None:
    """The block size when every manifest has the same block digests and no piecewise tensor."""
    schemes = {m.digest_scheme for m in manifests}
    if len(schemes) != 1 or not (scheme := schemes.pop()).blocked:
        return None
    if any(e.pieces is not None for m in manifests for e in m.tensors.values()):
        return None
    return scheme.block_bytes


def trusted_sidecar(state_path: str, held, ck: SafetensorsCheckpoint, block: int) -> sidecar.Sidecar | None:
    """The held state's block digests if the trust policy allows them (``storage.local.sidecar``):
    whole, stamped with the file as it is, consistent with the held step's digests, and a random
    sample of blocks hashing to them. None otherwise: the refit then hashes every tensor."""
    sc = sidecar.load(state_path, held.step, held.policy_digest, block)
    if sc is None or set(sc.leaves) != set(held.tensors):
        return None
    for name, e in held.tensors.items():
        leaves = sc.leaves[name]
        if leaves.shape[0] != block_count(e.nbytes, block) or blocks_root(block, leaves) != e.digest:
            return None
    for name, b in sidecar.sample(sc, {n: e.nbytes for n, e in held.tensors.items()}):
        bits = ck.mapped_bits(name)
        item = bits.dtype.itemsize
        got = blake3.blake3(memoryview(np.ascontiguousarray(bits[b * block // item : (b + 1) * block // item]))
                            .cast("B")).digest()
        if got != sc.leaves[name][b].tobytes():
            log.warning("%s: tensor %r differs from the block digests kept beside it (changed outside DCR?); "
                        "checking every tensor", state_path, name)
            return None
    return sc


def _merged(ranges: set[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for start, stop in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop])
    return [(a, b) for a, b in out]


def _streamable(entries, e_target):
    """The one move that stores chunks of this tensor, if it is an XOR delta of main chunks only and
    the target has a plain digest (patched chunk by chunk, no copy); else None."""
    stored = [e for e in entries if e.n_stored]
    if len(stored) != 1 or stored[0].parts is not None or e_target.pieces is not None or stored[0].grid.is_blocked:
        return None
    e = stored[0]
    return e if all(e.encoding_at(p) is Encoding.XOR for p in range(e.n_stored)) else None


def _xor_streamed(held_bits: np.ndarray, e, e_target, stream, forward: bool = True, step: int | None = None,
                  held_leaves: np.ndarray | None = None, lane: HashLane | None = None):
    """The changes one XOR delta makes to a tensor, from its masks alone (chunks in index order):
    positions are the masks' non-zero elements, found with the new bits in one pass per chunk
    (``sparse.xor_changes``) into arrays sized by the entry's count of changed elements; the new
    tensor is hashed as it streams by (held bits between stored chunks, held XOR mask within them),
    or, given the held state's block digests (``held_leaves``), only the blocks with a change: a
    block within one chunk from the chunk's new bits at once, one across chunks at the end (its held
    bytes with the changes). Returns ``(positions, old, new, block digests of the result or None,
    blocks hashed)``; False if the result misses its digest. Given a ``lane`` (and chunks of at least
    ``LANE_MIN_BYTES``), the hashing runs on it, beside the pass over the next chunk."""
    item = held_bits.dtype.itemsize
    if lane is not None and min(math.prod(e.grid.chunk_shape), held_bits.size) * item < LANE_MIN_BYTES:
        lane = None
    cap = min(e.changed, held_bits.size)  # an XOR mask's non-zero elements are the changed ones
    positions = np.empty(cap, _position_dtype(held_bits.size))
    old, new = np.empty(cap, held_bits.dtype), np.empty(cap, held_bits.dtype)
    unchecked: list[UncheckedChunk] = []  # the stored bytes of this tensor's chunks applied unchecked
    chunks = _chunk_changes(held_bits, e, stream, forward, step, positions, old, new, unchecked,
                            ring=1 if lane is None else lane.depth + 1)

    def behind(fn, *args) -> None:  # on the lane if there is one (in order), else now
        if lane is None:
            fn(*args)
        else:
            lane.submit(fn, *args)

    if held_leaves is None:
        h = e_target.scheme.hasher()

        def feed(held_part: np.ndarray, chunk: np.ndarray) -> None:
            h.update(held_part)
            h.update(chunk)

        at = k = 0
        for start, stop, chunk, _, end in chunks:
            behind(feed, held_bits[at:start], chunk)
            at, k = stop, end
        if lane is not None:
            lane.drain()
        h.update(held_bits[at:])
        if h.hexdigest() != e_target.digest:
            _check(unchecked)
            return False
        leaves = h.leaves() if e_target.scheme.blocked else None
        return positions[:k], old[:k], new[:k], leaves, 0 if leaves is None else leaves.shape[0]
    block = e_target.scheme.block_bytes
    leaves = held_leaves.copy()
    k = hashed = 0
    across: set[int] = set()
    for start, stop, chunk, k0, k in chunks:
        inside, spanning = _blocks_with_changes(positions[k0:k], start, stop, held_bits, block)
        behind(_hash_inside, leaves, chunk, start, block, inside)
        hashed += len(inside)
        across.update(spanning)
    if lane is not None:
        lane.drain()
    return _finish_blocks(held_bits, positions, old, new, k, leaves, across, e_target, unchecked, hashed)


def _blocks_with_changes(positions: np.ndarray, start: int, stop: int, held_bits: np.ndarray, block: int
                         ) -> tuple[list[int], list[int]]:
    """The blocks that the chunk ``[start, stop)`` overlaps and that hold one of its changes
    (``positions``, ascending): those inside the chunk (the tensor's last block may be short), and
    those reaching past it. Positions are sorted, so a block's changes are the ones between its
    first and last element (no sort, no pass per change)."""
    item = held_bits.dtype.itemsize
    lo_chunk, hi_chunk = start * item, stop * item
    first, last = lo_chunk // block, (hi_chunk - 1) // block
    edges = _block_edges(first, last, block // item, held_bits.size, positions.dtype)
    inside, across = [], []
    for b in (np.flatnonzero(np.diff(np.searchsorted(positions, edges))) + first).tolist():
        lo, hi = b * block, min((b + 1) * block, held_bits.nbytes)
        (inside if lo >= lo_chunk and hi <= hi_chunk else across).append(b)
    return inside, across


def _hash_inside(leaves: np.ndarray, chunk: np.ndarray, start: int, block: int, inside: list[int]) -> None:
    """The digests of blocks ``inside`` the chunk starting at element ``start``, from its new bits."""
    raw, lo_chunk = memoryview(chunk).cast("B"), start * chunk.dtype.itemsize
    for b in inside:
        lo = b * block - lo_chunk
        leaves[b] = np.frombuffer(blake3.blake3(raw[lo : lo + block]).digest(), np.uint8)


def _finish_blocks(held_bits: np.ndarray, positions, old, new, k: int, leaves: np.ndarray, across, e_target,
                   unchecked: list[UncheckedChunk], hashed: int):
    """Hash the changed blocks that reach across chunks (their held bytes with the changes) and check
    the tensor's block digests against the target's digest: ``_xor_streamed``'s result."""
    block, item = e_target.scheme.block_bytes, held_bits.dtype.itemsize
    pos = positions[:k]
    for b in sorted(across):
        lo, hi = b * block // item, min((b + 1) * block // item, held_bits.size)
        work = np.array(held_bits[lo:hi])
        i, j = np.searchsorted(pos, [lo, hi])
        work[pos[i:j].astype(np.int64) - lo] = new[i:j]
        leaves[b] = np.frombuffer(blake3.blake3(memoryview(work).cast("B")).digest(), np.uint8)
    if blocks_root(block, leaves) != e_target.digest:
        _check(unchecked)
        return False
    return positions[:k], old[:k], new[:k], leaves, hashed + len(across)


def _chunk_changes(held_bits: np.ndarray, e, stream, forward: bool, step: int | None, positions, old, new,
                   unchecked: list[UncheckedChunk], ring: int = 1):
    """Per stored chunk of ``e`` (in index order): ``(start, stop, new bits, k0, k)``, its changes
    written to ``positions/old/new[k0:k]``. The new bits live in ``ring`` buffers reused in turn (a
    chunk's stay put until ``ring - 1`` more chunks are asked for).

    A chunk that comes unchecked (``UncheckedChunk``: a ``dcr-sparse`` frame) is applied from its
    stored sections (``sparse.xor_frame``: no dense mask is built, decoded or hashed) and kept in
    ``unchecked``: the caller verifies the tensor it builds, and checks these to name a bad object
    when that fails. A frame that does not parse is checked at once (its error names it)."""
    grid = e.grid
    bufs = [np.empty(min(math.prod(grid.chunk_shape), held_bits.size), held_bits.dtype) for _ in range(ring)]
    at = k = 0
    for i in range(e.n_stored):
        _, _, index, payload = next(stream)
        start, stop = grid.chunk_range(index)
        held_chunk = np.asarray(held_bits[start:stop])
        buf = bufs[i % ring]
        if start < at or stop - start > buf.size:
            raise StateMismatchError(f"tensor {e.name!r}: chunk {index} out of order or of the wrong size")
        chunk = buf[: stop - start]
        k0 = k
        try:
            if isinstance(payload, UncheckedChunk):
                unchecked.append(payload)
                try:
                    k += sparse.xor_frame(held_chunk, payload.data, grid.chunk_numel, chunk, positions[k:], old[k:],
                                          new[k:], base=start)
                    yield start, stop, chunk, k0, k
                    at = stop
                    continue
                except (sparse.SparseFrameError, sparse.OutsideHeld):
                    payload = payload.checked()  # names the object if it is not the chunk, else decodes it whole
            payload = resolve(payload, held_chunk, forward)
            if payload.shape != (stop - start,):
                raise StateMismatchError(f"tensor {e.name!r}: chunk {index} of the wrong size")
            k += sparse.xor_changes(held_chunk, np.ascontiguousarray(payload).view(held_bits.dtype), chunk,
                                    positions[k:], old[k:], new[k:], base=start)
        except sparse.TooManyChanges:
            _check(unchecked)
            raise IntegrityError(f"tensor {e.name!r} (refit to step {step}): its stored chunks change more than the "
                                 f"{e.changed} elements its manifest entry lists") from None
        yield start, stop, chunk, k0, k
        at = stop


class _ChunkWorkers:
    """The threads an in-place refit applies and hashes chunks on (``_xor_parallel``), with the
    chunk buffers they take in turn: at most ``workers + 1`` chunks are admitted at a time."""

    def __init__(self, workers: int):
        self.workers = max(1, workers)
        self.pool = BoundedPool(self.workers, window=self.workers + 1, name="dcr-apply")
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()

    def take(self, nbytes: int) -> np.ndarray:
        try:
            buf = self._free.get_nowait()
        except queue.Empty:
            return np.empty(nbytes, np.uint8)
        return buf if buf.nbytes >= nbytes else np.empty(nbytes, np.uint8)

    def give(self, buf: np.ndarray) -> None:
        self._free.put(buf)

    def close(self) -> None:
        self.pool.close(cancel=True)


def _xor_parallel(held_bits: np.ndarray, e, e_target, stream, step: int | None, held_leaves: np.ndarray,
                  workers: _ChunkWorkers):
    """``_xor_streamed`` with held block digests, for chunks that come unchecked (``dcr-sparse``
    frames), chunk by chunk on several threads: each frame's header gives its count of changes, so
    every chunk's place in the outputs is known before it is applied; a thread applies the frame
    (``sparse.xor_frame``) and hashes the blocks of the chunk that hold a change while they are in
    cache. Blocks across two chunks are hashed at the end."""
    item, block = held_bits.dtype.itemsize, e_target.scheme.block_bytes
    cap = min(e.changed, held_bits.size)
    positions = np.empty(cap, _position_dtype(held_bits.size))
    old, new = np.empty(cap, held_bits.dtype), np.empty(cap, held_bits.dtype)
    leaves = held_leaves.copy()
    grid = e.grid
    unchecked: list[UncheckedChunk] = []
    jobs = []
    at = k = 0
    try:
        for _ in range(e.n_stored):
            _, _, index, payload = next(stream)
            start, stop = grid.chunk_range(index)
            if start < at or not isinstance(payload, UncheckedChunk):
                raise StateMismatchError(f"tensor {e.name!r}: chunk {index} out of order")  # pragma: no cover - invariant
            at = stop
            unchecked.append(payload)
            try:
                kk = sparse.frame_changes(payload.data, item, grid.chunk_numel)
            except sparse.SparseFrameError:
                payload.checked()  # names the object (it is not a frame: its digest cannot match)
                raise IntegrityError(f"{payload.url}/{payload.key}: not a sparse frame") from None  # pragma: no cover
            if k + kk > cap:
                _check(unchecked)
                raise IntegrityError(f"tensor {e.name!r} (refit to step {step}): its stored chunks change more than "
                                     f"the {e.changed} elements its manifest entry lists")
            jobs.append((workers.pool.submit(_apply_chunk, held_bits, start, stop, payload, positions[k : k + kk],
                                             old[k : k + kk], new[k : k + kk], leaves, block, workers), kk, payload))
            k += kk
        across: set[int] = set()
        hashed = 0
        for fut, kk, payload in jobs:
            got, inside, spanning = fut.result()
            if got != kk:
                _check(unchecked)
                raise IntegrityError(f"{payload.url}/{payload.key}: the frame says {kk} changes and holds {got}")
            hashed += inside
            across.update(spanning)
    finally:
        for fut, _, _ in jobs:
            fut.cancel()
        for fut, _, _ in jobs:
            if not fut.cancelled():
                fut.exception()  # wait: no thread still writes to the outputs or the leaves
    return _finish_blocks(held_bits, positions, old, new, k, leaves, across, e_target, unchecked, hashed)


def _apply_chunk(held_bits: np.ndarray, start: int, stop: int, payload: UncheckedChunk, positions, old, new,
                 leaves: np.ndarray, block: int, workers: _ChunkWorkers) -> tuple[int, int, list[int]]:
    """One chunk of ``_xor_parallel`` (on a worker thread): its changes into ``positions/old/new``,
    the digests of the blocks inside it that hold a change into ``leaves``. Returns (changes found,
    blocks hashed, blocks with a change that reach past the chunk)."""
    item = held_bits.dtype.itemsize
    buf = workers.take((stop - start) * item)
    try:
        chunk = buf[: (stop - start) * item].view(held_bits.dtype)
        held_chunk = np.asarray(held_bits[start:stop])
        try:
            got = sparse.xor_frame(held_chunk, payload.data, payload.grid.chunk_numel, chunk, positions, old, new,
                                   base=start)
        except sparse.OutsideHeld:  # changes in the padding: decoded whole (checked), padding dropped
            mask = np.ascontiguousarray(payload.checked()).view(held_bits.dtype)
            got = sparse.xor_changes(held_chunk, mask, chunk, positions, old, new, base=start)
        except sparse.TooManyChanges:
            return positions.size + 1, 0, []
        inside, spanning = _blocks_with_changes(positions[:got], start, stop, held_bits, block)
        _hash_inside(leaves, chunk, start, block, inside)
        return got, len(inside), spanning
    finally:
        workers.give(buf)


def _block_edges(first: int, last: int, per_block: int, size: int, dtype: np.dtype) -> np.ndarray:
    """The first element of blocks ``first`` to ``last + 1`` (cut at ``size``), in the positions'
    dtype: searching positions for them casts nothing."""
    return np.minimum(np.arange(first, last + 2, dtype=np.int64) * per_block, size).astype(dtype)


def _check(unchecked: list[UncheckedChunk]) -> None:
    """Decode and digest-check chunks applied unchecked: an ``IntegrityError`` names the first bad one."""
    for c in unchecked:
        c.checked()


def _position_dtype(numel: int) -> np.dtype:
    """How a journal stores a tensor's positions: uint32 below 2^32 elements, else int64."""
    return np.dtype("<u4") if numel < 1 << 32 else np.dtype("<i8")


def _applied_on_copy(held_bits: np.ndarray, entries, e_target, stream, scratch: np.ndarray, forwards: list[bool],
                     held_leaves: np.ndarray | None = None):
    """The general case (several moves, overwrites, shared parts, piecewise digests): apply every
    chunk to a copy of the tensor and compare it with the held bits where chunks landed. Given the
    held state's block digests, only the blocks a chunk landed in are hashed."""
    work = scratch[: held_bits.nbytes].view(held_bits.dtype)
    np.copyto(work, held_bits)
    touched: set[tuple[int, int]] = set()
    for e, forward in zip(entries, forwards):
        grid = e.grid
        for pos in range(e.n_stored):
            _, _, index, payload = next(stream)
            apply_chunk(work, grid, index, payload, e.encoding_at(pos), forward)
            touched.add(grid.chunk_span(index))
    leaves, block, item = None, e_target.scheme.block_bytes, work.dtype.itemsize
    if e_target.pieces is not None or block is None:
        if not e_target.matches(work):
            return False
        hashed = 0
    elif held_leaves is None:
        leaves = block_leaves(work, block)
        hashed = leaves.shape[0]
    else:
        leaves, raw = held_leaves.copy(), memoryview(work).cast("B")
        blocks = sorted({k for a, b in _merged(touched) for k in range(a * item // block, (b * item - 1) // block + 1)})
        for k in blocks:
            leaves[k] = np.frombuffer(blake3.blake3(raw[k * block : (k + 1) * block]).digest(), np.uint8)
        hashed = len(blocks)
    if leaves is not None and blocks_root(block, leaves) != e_target.digest:
        return False
    positions = np.concatenate(
        [np.flatnonzero(work[a:b] != held_bits[a:b]) + a for a, b in _merged(touched)] or [np.empty(0, np.int64)]
    )
    return positions, np.asarray(held_bits[positions]), work[positions].copy(), leaves, hashed


def eligible(plan: RefitPlan, state_path: str) -> bool:
    """Whether patching in place is possible and cheaper than rewriting (see the module doc)."""
    if plan.current_step is None or not plan.moves or plan.from_keyframe:
        return False
    if not os.path.isfile(state_path):
        return False
    ms = reader.manifests(plan)
    target = ms[plan.target_step]
    state_bytes = sum(e.nbytes for e in target.tensors.values())
    size = 0
    for move in plan.moves:
        for e in ms[move.step].tensors.values():
            changed = e.changed if e.n_stored else 0
            size += changed * ((4 if e.numel < 1 << 32 else 8) + 2 * DTYPES[e.dtype].itemsize)
    return size <= MAX_JOURNAL_FRACTION * max(state_bytes, 1)


def stage_patch(plan: RefitPlan, state_path: str, options: ReceiveOptions) -> StagedPatch | None:
    """Compute the in-place patch of ``state_path`` (step 1 above) without touching it, and stage
    its journal; None when the header has no room for the new metadata (the caller rewrites)."""
    root = open_root(plan.root)
    ms = reader.manifests(plan, root)
    target = ms[plan.target_step]
    held = ms[plan.current_step]
    ck = SafetensorsCheckpoint(state_path)
    try:
        reader.check_schema(held, ck.infos, state_path)
        reader.check_moves(plan, ms)
        (header,) = ck.headers.values()
        new_header = header.with_metadata(state.metadata(plan.target_step, target.policy_digest, plan.root.url))
        if new_header is None:
            return None
        names = sorted(target.tensors)
        chosen, tables = reader.move_tables(plan, ms)
        forwards = reader.move_forwards(plan)
        # The journal is written as its records are computed (on a thread of its own), fsynced at the end.
        stager = journal.Stager(state_path, plan.current_step, plan.target_step, header.raw, new_header, len(names))
        try:
            pulled = 0
            block = blocked(*ms.values())
            sc = trusted_sidecar(state_path, held, ck, block) if block else None
            new_leaves: dict[str, np.ndarray] = {}
            hashed = 0
            scratch: np.ndarray | None = None  # one buffer for every copied tensor: no fresh pages per tensor
            # XOR deltas of dcr-sparse frames come unchecked and are applied from their stored form; the
            # tensor built from them is checked against the step's digest (``_chunk_changes``).
            fused = {n for n in names if _streamable([t[n] for t in tables], target.tensors[n]) is not None}
            stream = stream_chunks(root, reader.chunk_jobs(names, chosen, tables), workers=options.io_workers,
                                   unchecked=lambda m, e: e.name in fused and m.codec.name == "dcr-sparse")
            lane = HashLane("dcr-hash", depth=2)  # the new chunks' blocks hashed beside the next chunk's pass
            workers = _ChunkWorkers(min(4, os.cpu_count() or 1))  # with trusted block digests: chunks in parallel
            try:
                for name in names:
                    e_target = target.tensors[name]
                    held_bits = ck.mapped_bits(name)
                    entries = [t[name] for t in tables]
                    before = None if sc is None else sc.leaves[name]
                    if not any(e.n_stored for e in entries):
                        if before is not None and blocks_root(block, before) == e_target.digest:
                            new_leaves[name] = before  # unchanged, and trusted (the sidecar's policy)
                        elif block:
                            new_leaves[name] = block_leaves(held_bits, block)
                            hashed += new_leaves[name].shape[0]
                            if blocks_root(block, new_leaves[name]) != e_target.digest:
                                raise reader.held_mismatch(state_path, name, held.step)
                        elif not e_target.matches(held_bits):
                            raise reader.held_mismatch(state_path, name, held.step)
                        changes = None
                    elif (one := _streamable(entries, e_target)) is not None:
                        forward = next(f for e, f in zip(entries, forwards) if e is one)
                        frames = next(m for m, t in zip(chosen, tables) if t[name] is one).codec.name == "dcr-sparse"
                        chunk_bytes = min(math.prod(one.grid.chunk_shape), held_bits.size) * held_bits.dtype.itemsize
                        if before is not None and block and frames and chunk_bytes >= LANE_MIN_BYTES:
                            changes = _xor_parallel(held_bits, one, e_target, stream, plan.target_step, before, workers)
                        else:
                            changes = _xor_streamed(held_bits, one, e_target, stream, forward, plan.target_step,
                                                    before if block else None, lane)
                    else:
                        if scratch is None:
                            scratch = np.empty(max(e.nbytes for e in target.tensors.values()), np.uint8)
                        changes = _applied_on_copy(held_bits, entries, e_target, stream, scratch, forwards,
                                                   before if block else None)
                    if changes:
                        hashed += changes[4]
                        if changes[3] is not None:
                            new_leaves[name] = changes[3]
                    pulled += sum(e.stored_bytes for e in entries)
                    events.reached("tensor.done", name=name, nbytes=e_target.nbytes)
                    if changes is False:  # the result does not match step N's digest
                        if not held.tensors[name].matches(held_bits):
                            raise reader.held_mismatch(state_path, name, held.step)
                        raise reader.result_mismatch(plan.target_step, name)
                    if changes is not None and changes[0].size:
                        stager.add(journal.Record(
                            ck.data_offset(name), held_bits.dtype.itemsize,
                            changes[0].astype(_position_dtype(held_bits.size), copy=False), *changes[1:3],
                        ))
                if next(stream, None) is not None:
                    raise StateMismatchError("more chunks fetched than applied")  # pragma: no cover - invariant
            finally:
                workers.close()
                lane.close()
                stream.close()
            staged_journal = stager.finish()
        except BaseException:
            stager.abort()
            raise
    finally:
        ck.close()
    staged_blocks = None
    if block and set(new_leaves) == set(target.tensors):
        staged_blocks = sidecar.stage(state_path, sidecar.Sidecar(plan.target_step, target.policy_digest, block, new_leaves))
    events.reached("receive.blocks-hashed", blocks=hashed, trusted=sc is not None)
    return StagedPatch(staged_journal, pulled, stager.journal.nbytes, staged_blocks, hashed)

