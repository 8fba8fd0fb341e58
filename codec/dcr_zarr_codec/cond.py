"""The conditional delta frame (the ``dcr.cond`` codec's format): changes coded against the bits
the receiver already holds.

The XOR-mask frame (``sparse``) codes where the changes are and their XOR values as if nothing
else were known. A receiver applying a delta holds the old bits, and they predict a lot:
- **positions**: small weights have small ulps and change far more often than large ones, so the
  elements are split into classes by the held value's exponent field, and the changes of each
  class are gap-coded over that class's own enumeration (which the receiver rebuilds from its own
  bits): each class's gaps follow its own, much tighter, geometric law;
- **values**: the signed ulp step (the sign-magnitude integer difference of the bits, in value
  order) is +-1 for most changes of an optimizer step, where the XOR value of the same change
  depends on carries through the mantissa.
A change that flips its sign, changes its class, or moves more than 127 ulps is an *escape*: coded
by absolute position and XOR value, and left out of the class enumeration. So every non-escaped
change keeps its class, and the same frame decodes forward (held = old bits) and backward
(held = new bits). Decoding is integer arithmetic on the bits: exact for every value, NaN payloads
and -0.0 included. Non-float dtypes have one class and step as integers. Each class's gaps are
Golomb-Rice coded with the parameter that minimizes that class's bits (a geometric law: within a
few percent of its entropy); zstd over byte planes left 20-25% above it.

Frame: ``b"DCRC"``, version, mode, itemsize, exponent shift, exponent bits, 3 zero bytes, n, k,
escapes (u64 each); mode 0 (no held bits were given: keyframes, overwrites) is followed by a whole
``dcr.sparse`` frame; mode 1 by five sections (``u64 length + zstd frame``): per-class change
counts (u32), per-class Golomb-Rice parameters (u8), then the in-class gaps as one Golomb-Rice bit
string (``u64 length + bytes``, class by class, LSB first), then steps (zigzag u8), escape gaps
(u32) and escape values; multi-byte sections are split into byte planes as in ``sparse``. The kernels are C
(``_condk.c``, which releases the GIL).
"""

from __future__ import annotations

import struct
import sys

import numpy as np

from dcr_zarr_codec import _condk
from dcr_zarr_codec.sparse import (
    SparseFrameError,
    _planes,
    _read_section_array,
    _section,
    _unplanes,
    decode_sparse,
    encode_sparse,
)

MAGIC = b"DCRC"
VERSION = 1
PLAIN, CONDITIONAL = 0, 1
_HEAD = struct.Struct("<4sBBBBBxxxQQQ")

# dtype name -> (shift, width) of its exponent field: the classes of positions
CLASSES = {
    "BF16": (7, 8), "F16": (10, 5), "F32": (23, 8), "F64": (52, 11),
    "F8_E4M3": (3, 4), "F8_E4M3FNUZ": (3, 4), "F8_E5M2": (2, 5), "F8_E5M2FNUZ": (2, 5),
}

if sys.byteorder != "little":  # pragma: no cover - the frame is little-endian, like Zarr's raw bits here
    raise ImportError("dcr.cond frames need a little-endian host")


def classes_of(dtype: str) -> tuple[int, int]:
    """(shift, width) of the exponent field of ``dtype``; (0, 0), one class, for non-float dtypes."""
    return CLASSES.get(dtype, (0, 0))


def needs_held(data: bytes) -> bool:
    """Whether the frame decodes only against the held bits (mode 1)."""
    return len(data) >= _HEAD.size and data[:4] == MAGIC and data[5] == CONDITIONAL


def encode_cond(mask: np.ndarray, held: np.ndarray | None, dtype: str | None, level: int = 3) -> bytes:
    """Encode one (padded) chunk's XOR ``mask`` against ``held`` (the old bits of the same chunk,
    padded the same way); ``held=None`` stores ``mask`` (or any payload) plainly (mode 0)."""
    mask = np.ascontiguousarray(mask).reshape(-1)
    n, itemsize = mask.size, mask.dtype.itemsize
    if n >= 1 << 32:
        raise ValueError("a chunk holds fewer than 2^32 elements")
    shift, width = classes_of(dtype) if dtype is not None else (0, 0)
    if held is None:
        return _HEAD.pack(MAGIC, VERSION, PLAIN, itemsize, shift, width, n, 0, 0) + encode_sparse(mask, level)
    held = np.ascontiguousarray(held).reshape(-1)
    if held.dtype != mask.dtype or held.size != n:
        raise ValueError(f"held bits are {held.size} x {held.dtype}, the mask {n} x {mask.dtype}")
    k = int(np.count_nonzero(mask))
    counts, params, gap_bits, steps, egaps, evals = _condk.encode(held, mask, itemsize, shift, width, k)
    ke = len(egaps) // 4
    u32 = np.dtype("<u4")
    return b"".join((
        _HEAD.pack(MAGIC, VERSION, CONDITIONAL, itemsize, shift, width, n, k, ke),
        _section(_planes(np.frombuffer(counts, u32)), level),
        _section(np.frombuffer(params, np.uint8), level),
        struct.pack("<Q", len(gap_bits)) + gap_bits,  # Golomb-Rice bits: zstd finds nothing left to take
        _section(np.frombuffer(steps, np.uint8), level),
        _section(_planes(np.frombuffer(egaps, u32)), level),
        _section(_planes(np.frombuffer(evals, mask.dtype)), level),
    ))


def _header(data: bytes, storage: np.dtype, n: int, dtype: str | None) -> tuple[int, int, int, int, int]:
    if len(data) < _HEAD.size:
        raise SparseFrameError("chunk is too short to be a cond frame")
    magic, version, mode, itemsize, shift, width, n_frame, k, ke = _HEAD.unpack_from(data)
    if magic != MAGIC or version != VERSION or mode not in (PLAIN, CONDITIONAL):
        raise SparseFrameError("chunk is not a DCR cond frame (bad magic, version or mode)")
    if itemsize != np.dtype(storage).itemsize or n_frame != n or k > n or ke > k:
        raise SparseFrameError(f"cond frame holds {n_frame} x {itemsize} B (k={k}), expected {n} x {np.dtype(storage).itemsize} B")
    if mode == CONDITIONAL and dtype is not None and (shift, width) != classes_of(dtype):
        raise SparseFrameError(f"cond frame's classes ({shift}, {width}) are not those of {dtype}")
    if width > 11 or shift + width > 8 * itemsize:
        raise SparseFrameError("cond frame has an impossible exponent field")
    return mode, shift, width, k, ke


def _raw_section(data: bytes, offset: int) -> tuple[memoryview, int]:
    if offset + 8 > len(data):
        raise SparseFrameError("cond frame is truncated")
    (length,) = struct.unpack_from("<Q", data, offset)
    offset += 8
    if offset + length > len(data):
        raise SparseFrameError("cond frame is truncated")
    return memoryview(data)[offset : offset + length], offset + length


def check_frame(data: bytes, storage: np.dtype, n: int, dtype: str | None = None) -> None:
    """Check the frame's header against the chunk it should hold (size, type, classes)."""
    _header(bytes(data[: _HEAD.size]), storage, n, dtype)


def decode_cond(data: bytes, storage: np.dtype, n: int, held: np.ndarray | None = None,
                forward: bool = True, dtype: str | None = None, in_place: bool = False) -> np.ndarray:
    """The XOR mask a frame codes: ``n`` elements (mode 0), or, against ``held`` (the first
    ``held.size <= n`` elements of the chunk: the old bits forward, the new bits backward), the
    mask of those elements (mode 1). ``in_place`` (mode 1 only): write the other step's bits over
    ``held`` instead (a contiguous writable array) and return it: no mask, no XOR pass. Refuses
    anything inconsistent with ``SparseFrameError`` (in place, ``held`` may then be half-written:
    callers apply to a copy they verify, as every DCR apply does)."""
    data = bytes(data)
    storage = np.dtype(storage)
    mode, shift, width, k, ke = _header(data, storage, n, dtype)
    if mode == PLAIN:
        if in_place:
            raise SparseFrameError("cond frame without held bits cannot be applied in place")
        return decode_sparse(data[_HEAD.size :], storage, n)
    if held is None:
        raise SparseFrameError("cond frame decodes only against the held bits")
    if not in_place:
        held = np.ascontiguousarray(held).reshape(-1)
    elif held.ndim != 1 or not held.flags.c_contiguous or not held.flags.writeable:
        raise SparseFrameError("in-place decoding needs a flat, contiguous, writable array")
    if held.dtype != storage or held.size > n:
        raise SparseFrameError(f"held bits are {held.size} x {held.dtype}, the frame holds {n} x {storage}")
    nc, kk = 1 << width, k - ke
    off = _HEAD.size
    counts, off = _read_section_array(data, off, 4 * nc)
    params, off = _read_section_array(data, off, nc)
    gap_bits, off = _raw_section(data, off)
    steps, off = _read_section_array(data, off, kk)
    egaps, off = _read_section_array(data, off, 4 * ke)
    evals, off = _read_section_array(data, off, ke * storage.itemsize)
    if off != len(data):
        raise SparseFrameError("cond frame has trailing bytes")
    u32 = np.dtype("<u4")
    out = held if in_place else np.zeros(held.size, dtype=storage)
    try:
        _condk.decode(
            held, out, storage.itemsize, shift, width, forward, in_place,
            _unplanes(counts, u32, nc), params, gap_bits, steps, _unplanes(egaps, u32, ke),
            _unplanes(evals, storage, ke) if ke else b"",
        )
    except ValueError as e:
        raise SparseFrameError(str(e)) from None
    return out
