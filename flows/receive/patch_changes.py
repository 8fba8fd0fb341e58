"""The changes of a tensor's chunks against the held bits: what an in-place refit (``flows.receive.in_place``)
writes into a state file, computed without touching it.

- ``xor_streamed``: one XOR delta, one pass per chunk over the held bits (memory-mapped): the new bits
  of each chunk and every change as (position, old value, new value), the new tensor hashed as it
  streams by (on a hash lane beside the next chunk's pass); a ``dcr.sparse`` chunk applied from its
  stored frame, checked only when the tensor's result fails.
- ``xor_parallel``: the same on worker threads (``ChunkWorkers``: a bounded pool and the chunk buffers
  its threads take in turn) when the held block digests are trusted: each chunk applied and only the
  blocks it changes hashed again.
- ``applied_on_copy``: anything else (several moves, overwrites, shared parts, piecewise digests, column
  blocks): the held bits copied into a scratch buffer, every chunk applied, the differing elements kept.
"""

from __future__ import annotations

import math
import queue

import blake3
import numpy as np

from dcr_core import sparse
from dcr_core.delta import Encoding, apply_chunk, resolve
from dcr_core.digest import block_leaves, blocks_root
from dcr_core.errors import IntegrityError, StateMismatchError
from dcr_core.hash_lane import LANE_MIN_BYTES, HashLane
from storage.chunk_io import BoundedPool, UncheckedChunk


def _merged(ranges: set[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for start, stop in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop])
    return [(a, b) for a, b in out]


def streamable(entries, e_target):
    """The one move that stores chunks of this tensor, if it is an XOR delta of main chunks only and
    the target has a plain digest (patched chunk by chunk, no copy); else None."""
    stored = [e for e in entries if e.n_stored]
    if len(stored) != 1 or stored[0].parts is not None or e_target.pieces is not None or stored[0].grid.is_blocked:
        return None
    e = stored[0]
    return e if all(e.encoding_at(p) is Encoding.XOR for p in range(e.n_stored)) else None


def xor_streamed(held_bits: np.ndarray, e, e_target, stream, forward: bool = True, step: int | None = None,
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
    positions = np.empty(cap, position_dtype(held_bits.size))
    old, new = np.empty(cap, held_bits.dtype), np.empty(cap, held_bits.dtype)
    unchecked: list[UncheckedChunk] = []  # the stored bytes of this tensor's chunks applied unchecked
    chunks = chunk_changes(held_bits, e, stream, forward, step, positions, old, new, unchecked,
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
    the tensor's block digests against the target's digest: ``xor_streamed``'s result."""
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


def chunk_changes(held_bits: np.ndarray, e, stream, forward: bool, step: int | None, positions, old, new,
                   unchecked: list[UncheckedChunk], ring: int = 1):
    """Per stored chunk of ``e`` (in index order): ``(start, stop, new bits, k0, k)``, its changes
    written to ``positions/old/new[k0:k]``. The new bits live in ``ring`` buffers reused in turn (a
    chunk's stay put until ``ring - 1`` more chunks are asked for).

    A chunk that comes unchecked (``UncheckedChunk``: a ``dcr.sparse`` frame) is applied from its
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


class ChunkWorkers:
    """The threads an in-place refit applies and hashes chunks on (``xor_parallel``), with the
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


def xor_parallel(held_bits: np.ndarray, e, e_target, stream, step: int | None, held_leaves: np.ndarray,
                  workers: ChunkWorkers):
    """``xor_streamed`` with held block digests, for chunks that come unchecked (``dcr.sparse``
    frames), chunk by chunk on several threads: each frame's header gives its count of changes, so
    every chunk's place in the outputs is known before it is applied; a thread applies the frame
    (``sparse.xor_frame``) and hashes the blocks of the chunk that hold a change while they are in
    cache. Blocks across two chunks are hashed at the end."""
    item, block = held_bits.dtype.itemsize, e_target.scheme.block_bytes
    cap = min(e.changed, held_bits.size)
    positions = np.empty(cap, position_dtype(held_bits.size))
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
                 leaves: np.ndarray, block: int, workers: ChunkWorkers) -> tuple[int, int, list[int]]:
    """One chunk of ``xor_parallel`` (on a worker thread): its changes into ``positions/old/new``,
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
        except sparse.SparseFrameError:  # its header passed, its sections do not decode
            payload.checked()  # names the object (it is not a frame: its digest cannot match)
            raise IntegrityError(f"{payload.url}/{payload.key}: not a sparse frame") from None  # pragma: no cover
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


def position_dtype(numel: int) -> np.dtype:
    """How a journal stores a tensor's positions: uint32 below 2^32 elements, else int64."""
    return np.dtype("<u4") if numel < 1 << 32 else np.dtype("<i8")


def applied_on_copy(held_bits: np.ndarray, entries, e_target, stream, scratch: np.ndarray, forwards: list[bool],
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
