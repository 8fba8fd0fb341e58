"""The sparse XOR-mask frame (the ``dcr.sparse`` codec's format): gap-coded positions and byte planes, each entropy-coded with zstd.

An XOR mask of an RL update is mostly zero: a few percent of elements change, by a few ulps. Its
information is where the changes are (positions) and what they are (values). This codec stores
exactly those, in forms zstd models well:
- positions as gaps (``p[i] - p[i-1] - 1``), as uint32 split into 4 byte planes: the high planes
  are nearly all zero and cost almost nothing, the low plane carries the geometric gap law;
- the non-zero XOR values split into byte planes (low mantissa bytes, then sign/exponent bytes).
Dense chunks (more than ``DENSE_ABOVE`` of elements non-zero) store all values as byte planes.

Frame: ``b"DCRS"``, version, mode (0 sparse, 1 dense), itemsize, 0, n (u64), k (u64), then one or
two sections of ``u64 length + zstd frame``. Decoding checks every size against the frame and the
caller's expected element count before allocating.
"""

from __future__ import annotations

import struct

import numpy as np
from numcodecs import Zstd

from dcr_zarr_codec import _condk  # the C kernels, built with this package (here: xor_changes)


class SparseFrameError(ValueError):
    """A chunk that is not a valid sparse frame of the expected size (corrupt, truncated, foreign)."""

MAGIC = b"DCRS"
VERSION = 1
SPARSE, DENSE = 0, 1
DENSE_ABOVE = 0.25
_HEAD = struct.Struct("<4sBBBBQQ")


def _planes(a: np.ndarray) -> np.ndarray:
    """``a``'s bytes regrouped plane by plane (all first bytes, then all second bytes, ...)."""
    if a.dtype.itemsize == 1:
        return a.view(np.uint8)
    # Plane j is ``a >> 8j`` cut to its low byte (a truncating cast): faster than a transposed copy.
    out = np.empty((a.dtype.itemsize, a.size), dtype=np.uint8)
    out[0] = a
    shifted = np.empty_like(a)
    for j in range(1, a.dtype.itemsize):
        out[j] = np.right_shift(a, 8 * j, out=shifted)
    return out


def _unplanes(data: bytes | np.ndarray, dtype: np.dtype, count: int) -> np.ndarray:
    u8 = np.frombuffer(data, dtype=np.uint8)
    if dtype.itemsize == 1:
        return u8.copy()
    return np.ascontiguousarray(u8.reshape(dtype.itemsize, count).T).view(dtype).reshape(count)


_ZSTD = Zstd()  # decompression only (numcodecs' Zstd holds no state between calls)


def _section(payload: np.ndarray, level: int) -> bytes:
    frame = Zstd(level=level).encode(payload) if payload.size else b""
    return struct.pack("<Q", len(frame)) + bytes(frame)


def _word_hits(mask: np.ndarray) -> tuple[np.ndarray, int, int]:
    """Which 64-bit words of a flat contiguous ``mask`` are non-zero (booleans), log2 of the
    elements per word, and how many elements the whole words hold."""
    shift = (8 // mask.dtype.itemsize).bit_length() - 1
    whole = mask.size >> shift << shift
    return mask[:whole].view(np.uint64) != 0, shift, whole


def _changes(mask: np.ndarray, word_hits: np.ndarray, shift: int, whole: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions (ascending) and values of the non-zero elements of a flat contiguous ``mask``.

    ``np.flatnonzero`` on a wide integer array tests element by element. Here only the non-zero
    64-bit words are gathered, and only their elements are tested (as booleans, which numpy scans
    fast). Elements after the last whole word are tested apart.
    """
    hit_words = np.flatnonzero(word_hits)
    inside = mask[:whole].view(np.uint64)[hit_words].view(mask.dtype)
    if shift:
        hit = np.flatnonzero(inside != 0)
        positions = (hit_words[hit >> shift] << shift) | (hit & ((1 << shift) - 1))
        values = inside[hit]
    else:  # one element per word: the non-zero words are the changes
        positions, values = hit_words, inside
    if whole < mask.size:
        tail = np.flatnonzero(mask[whole:])
        positions = np.concatenate([positions, tail + whole])
        values = np.concatenate([values, mask[whole:][tail]])
    return positions, values


def nonzero(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions (ascending) and values of the non-zero elements of a flat mask, found through its
    64-bit words (several times faster than ``np.flatnonzero`` on sparse masks)."""
    mask = np.ascontiguousarray(mask).reshape(-1)
    return _changes(mask, *_word_hits(mask))


class TooManyChanges(ValueError):
    """A mask with more changes than the outputs given to ``xor_changes`` hold."""


def xor_changes(held: np.ndarray, mask: np.ndarray, out: np.ndarray, positions: np.ndarray, old: np.ndarray,
                new: np.ndarray, base: int = 0) -> int:
    """``out = held ^ mask`` (flat, one unsigned dtype) and every change the mask makes, in one pass:
    for the j-th non-zero element i of ``mask``, ``positions[j] = base + i`` (``positions`` is uint32
    or int64), ``old[j] = held[i]``, ``new[j] = out[i]``. Returns how many there are; ``ValueError``
    when the arguments do not fit, ``TooManyChanges`` when the outputs cannot hold every change (the
    caller sized them from what it was told to expect). Outputs past the count may be overwritten;
    no output may overlap an input. Inputs not aligned to their element size are copied first."""
    if not (held.dtype == mask.dtype == out.dtype == old.dtype == new.dtype) or positions.dtype not in (
        np.dtype("<u4"), np.dtype("<i8")
    ) or not (positions.size == old.size == new.size):
        raise ValueError("xor_changes: held, mask, out, old and new share one dtype; positions are uint32 or int64")
    if not all(a.flags.c_contiguous and a.flags.aligned and a.flags.writeable for a in (out, positions, old, new)):
        raise ValueError("xor_changes: outputs must be writable, C-contiguous and aligned")
    held, mask = (np.require(a, requirements=["C", "A"]) for a in (held, mask))  # a packed file's tensors may not be
    k = _condk.xor_changes(held, mask, out, positions, old, new, held.dtype.itemsize, positions.dtype.itemsize == 8,
                           base)
    if k < 0:
        raise TooManyChanges(f"the mask has more than the {old.size} changes expected")
    return k


def xor_diff(new: np.ndarray, old: np.ndarray, mask: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray,
                                                                                np.ndarray] | None:
    """``mask = new ^ old`` (flat, one unsigned dtype, written whole) and its changes in one pass:
    ascending positions (uint32 when ``new`` has fewer than 2^32 elements, else int64), the mask's
    values there and ``new``'s, each an array of its own. None when there are more than ``cap``
    changes (``nonzero(mask)`` finds them then). Inputs not aligned to their element size are
    copied first."""
    if not (new.dtype == old.dtype == mask.dtype) or not (new.size == old.size == mask.size):
        raise ValueError("xor_diff: new, old and mask share one dtype and size")
    if not (mask.flags.c_contiguous and mask.flags.aligned and mask.flags.writeable):
        raise ValueError("xor_diff: the mask must be writable, C-contiguous and aligned")
    new, old = (np.require(a, requirements=["C", "A"]) for a in (new, old))
    cap = max(0, min(int(cap), new.size))
    wide = new.size > 0xFFFFFFFF
    positions = np.empty(cap, dtype="<i8" if wide else "<u4")
    values, news = np.empty(cap, dtype=new.dtype), np.empty(cap, dtype=new.dtype)
    k = _condk.xor_diff(new, old, mask, positions, values, news, new.dtype.itemsize, wide, 0)
    if k < 0:
        return None
    return positions[:k].copy(), values[:k].copy(), news[:k].copy()  # not holding the room for ``cap``


class OutsideHeld(ValueError):
    """A frame whose changes reach past the held elements given to ``xor_frame`` (into a last
    chunk's padding): the caller decodes the frame whole instead, which ignores the padding."""


def frame_changes(frame: bytes, itemsize: int, n: int) -> int:
    """How many changes (non-zero elements) a sparse frame of ``n`` elements of ``itemsize`` bytes
    says it holds, from its header alone; ``SparseFrameError`` if it is not such a frame."""
    if len(frame) < _HEAD.size:
        raise SparseFrameError("chunk is too short to be a sparse frame")
    magic, version, mode, size, _, n_frame, k = _HEAD.unpack_from(frame)
    if magic != MAGIC or version != VERSION or mode not in (SPARSE, DENSE):
        raise SparseFrameError("chunk is not a DCR sparse frame (bad magic, version or mode)")
    if size != itemsize or n_frame != n or k > n:
        raise SparseFrameError(f"sparse frame holds {n_frame} x {size} B (k={k}), expected {n} x {itemsize} B")
    return k


def xor_frame(held: np.ndarray, frame: bytes, n: int, out: np.ndarray, positions: np.ndarray, old: np.ndarray,
              new: np.ndarray, base: int = 0) -> int:
    """``xor_changes(held, mask, ...)`` for the mask of the sparse frame ``frame`` (``n`` elements of
    ``held``'s dtype, ``held`` its first ``held.size``), without building the mask: the frame's
    sections are decompressed and applied as they are (``_condk.xor_planes``: a copy of ``held``,
    then one step per change). Dense frames are decoded and passed to ``xor_changes``.
    ``SparseFrameError`` for anything but such a frame, ``OutsideHeld`` for changes past ``held``,
    ``TooManyChanges`` as ``xor_changes``. The frame's digest is not checked here."""
    if not (held.dtype == out.dtype == old.dtype == new.dtype) or held.size > n or out.size != held.size:
        raise ValueError("xor_frame: held, out, old and new share one dtype; held holds at most n elements")
    k, itemsize = frame_changes(frame, held.dtype.itemsize, n), held.dtype.itemsize
    if frame[5] == DENSE:
        return xor_changes(held, decode_sparse(frame, held.dtype, n)[: held.size], out, positions, old, new, base)
    gaps, off = _read_section_array(frame, _HEAD.size, 4 * k)
    values, off = _read_section_array(frame, off, k * itemsize)
    if off != len(frame):
        raise SparseFrameError("sparse frame has trailing bytes")
    if positions.dtype not in (np.dtype("<u4"), np.dtype("<i8")) or not (positions.size == old.size == new.size):
        raise ValueError("xor_frame: positions are uint32 or int64, as many as old and new")
    if not all(a.flags.c_contiguous and a.flags.aligned and a.flags.writeable for a in (out, positions, old, new)):
        raise ValueError("xor_frame: outputs must be writable, C-contiguous and aligned")
    held = np.require(held, requirements=["C", "A"])
    got = _condk.xor_planes(held, gaps, values, out, positions, old, new, itemsize, positions.dtype.itemsize == 8, base)
    if got == -1:
        raise TooManyChanges(f"the frame has more than the {old.size} changes expected")
    if got == -2:
        raise OutsideHeld(f"the frame changes elements past the {held.size} held")
    return got


def encode_sparse(mask: np.ndarray, level: int = 3, changes: tuple[np.ndarray, np.ndarray] | None = None) -> bytes:
    """Encode one chunk of raw bits (any unsigned dtype, flat). ``changes``: its non-zero elements'
    positions (ascending) and values if the caller found them already (``nonzero(mask)``): the same
    frame, without scanning the mask again."""
    mask = np.ascontiguousarray(mask).reshape(-1)
    n = mask.size
    if n >= 1 << 32:
        raise ValueError("a chunk holds fewer than 2^32 elements")
    if changes is not None:
        positions, values = changes
        k = positions.size
        if n and k / n > DENSE_ABOVE:
            head = _HEAD.pack(MAGIC, VERSION, DENSE, mask.dtype.itemsize, 0, n, k)
            return head + _section(_planes(mask), level)
        if values.dtype != mask.dtype or values.size != k:
            raise ValueError("encode_sparse: the changes' values are the mask's elements at their positions")
    else:
        word_hits, shift, whole = _word_hits(mask)
        at_most = (int(np.count_nonzero(word_hits)) << shift) + n - whole  # elements in non-zero words
        if n and at_most / n > DENSE_ABOVE:  # only then can the chunk be dense: count exactly
            k = int(np.count_nonzero(mask))
            if k / n > DENSE_ABOVE:
                head = _HEAD.pack(MAGIC, VERSION, DENSE, mask.dtype.itemsize, 0, n, k)
                return head + _section(_planes(mask), level)
        positions, values = _changes(mask, word_hits, shift, whole)
        k = positions.size
    gaps = np.empty(k, dtype=np.uint32)
    if k:
        gaps[0] = positions[0]
        np.subtract(positions[1:], positions[:-1], out=gaps[1:], casting="unsafe")
        gaps[1:] -= np.uint32(1)
    head = _HEAD.pack(MAGIC, VERSION, SPARSE, mask.dtype.itemsize, 0, n, k)
    return head + _section(_planes(gaps), level) + _section(_planes(values), level)


def _read_section_array(data: bytes, offset: int, expect: int) -> tuple[np.ndarray, int]:
    """One section's ``expect`` decompressed bytes, as a uint8 array (no copy to ``bytes``)."""
    if offset + 8 > len(data):
        raise SparseFrameError("sparse frame is truncated")
    (length,) = struct.unpack_from("<Q", data, offset)
    offset += 8
    if offset + length > len(data):
        raise SparseFrameError("sparse frame is truncated")
    if expect == 0:
        if length:
            raise SparseFrameError("sparse frame has data where none is expected")
        return np.zeros(0, dtype=np.uint8), offset
    try:
        out = np.empty(expect, dtype=np.uint8)
        # a memoryview: numcodecs decompresses from it without a copy of the section (bytes slicing copies)
        _ZSTD.decode(memoryview(data)[offset : offset + length], out=out)
    except Exception as e:  # noqa: BLE001 - not zstd, or a different size than the header says
        raise SparseFrameError(f"sparse frame section does not decode to {expect} bytes ({e})") from None
    return out, offset + length


def decode_sparse(data: bytes, storage: np.dtype, n: int) -> np.ndarray:
    """Decode one chunk into exactly ``n`` elements of ``storage``, refusing anything else."""
    data = bytes(data)
    storage = np.dtype(storage)
    k, mode, itemsize = frame_changes(data, storage.itemsize, n), data[5], storage.itemsize
    off = _HEAD.size
    if mode == DENSE:
        raw, off = _read_section_array(data, off, n * itemsize)
        out = _unplanes(raw, storage, n) if n else np.zeros(0, dtype=storage)
    else:
        raw_gaps, off = _read_section_array(data, off, 4 * k)
        raw_vals, off = _read_section_array(data, off, k * itemsize)
        out = np.zeros(n, dtype=storage)
        if k:
            # position i = gap_0 + ... + gap_i + i, in one int64 buffer (no temporaries)
            positions = _unplanes(raw_gaps, np.dtype("<u4"), k).astype(np.int64)
            positions[1:] += 1
            np.cumsum(positions, out=positions)
            if positions[-1] >= n:
                raise SparseFrameError("sparse frame has a position outside the chunk")
            out[positions] = _unplanes(raw_vals, storage, k)
    if off != len(data):
        raise SparseFrameError("sparse frame has trailing bytes")
    return out
