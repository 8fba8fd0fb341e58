"""The fast sparse encoder writes exactly the frames of the plain one, for every dtype and layout.

The plain encoder below is the codec's definition (``np.flatnonzero`` on the whole mask, gaps by
``np.diff``); the shipped one finds changes through 64-bit words first. Same input, same bytes.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numcodecs import Zstd

from dcr_core.bits import bits_of, torch_dtype
from dcr_core.dtypes import DTYPES
from dcr_core.sparse import (
    _HEAD,
    DENSE,
    DENSE_ABOVE,
    MAGIC,
    SPARSE,
    OutsideHeld,
    SparseFrameError,
    TooManyChanges,
    decode_sparse,
    encode_sparse,
    frame_changes,
    nonzero,
    xor_changes,
    xor_diff,
    xor_frame,
)

WIDTHS = [np.dtype("<u1"), np.dtype("<u2"), np.dtype("<u4"), np.dtype("<u8")]


def _plain_planes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a.view(np.uint8).reshape(-1, a.dtype.itemsize).T).tobytes()


def _plain_section(payload: bytes, level: int) -> bytes:
    frame = Zstd(level=level).encode(payload) if payload else b""
    return struct.pack("<Q", len(frame)) + bytes(frame)


def plain_encode(mask: np.ndarray, level: int) -> bytes:
    mask = np.ascontiguousarray(mask).reshape(-1)
    n = mask.size
    positions = np.flatnonzero(mask)
    k = positions.size
    if n and k / n > DENSE_ABOVE:
        return _HEAD.pack(MAGIC, 1, DENSE, mask.dtype.itemsize, 0, n, k) + _plain_section(_plain_planes(mask), level)
    gaps = np.diff(positions, prepend=-1).astype(np.uint32) - np.uint32(1)
    head = _HEAD.pack(MAGIC, 1, SPARSE, mask.dtype.itemsize, 0, n, k)
    return head + _plain_section(_plain_planes(gaps), level) + _plain_section(_plain_planes(mask[positions]), level)


def _check(mask: np.ndarray, level: int = 1) -> None:
    frame = encode_sparse(mask, level)
    assert frame == plain_encode(mask, level)
    assert encode_sparse(mask, level, nonzero(mask)) == frame, "the changes a publisher found already: the same frame"
    out = decode_sparse(frame, mask.dtype, mask.size)
    assert out.dtype == mask.dtype and out.tobytes() == np.ascontiguousarray(mask).tobytes()


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from(WIDTHS),
    n=st.integers(0, 3000),
    offset=st.integers(0, 7),
    density=st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.1, DENSE_ABOVE, 0.26, 0.6, 1.0]),
    seed=st.integers(0, 2**31),
    level=st.sampled_from([1, 3]),
)
def test_frames_equal_the_plain_encoder(dtype, n, offset, density, seed, level):
    """Any width, size (odd ones too), density, and start address (masks not 8-byte aligned)."""
    rng = np.random.default_rng(seed)
    buf = np.zeros(n + offset, dtype=dtype)
    hit = rng.random(n) < density
    buf[offset:][hit] = rng.integers(1, np.iinfo(dtype).max, size=int(hit.sum()), dtype=dtype, endpoint=True)
    _check(buf[offset:], level)


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from(WIDTHS),
    n=st.integers(0, 3000),
    offset=st.integers(0, 7),
    density=st.sampled_from([0.0, 0.001, 0.01, 0.3, 1.0]),
    seed=st.integers(0, 2**31),
)
def test_nonzero_equals_flatnonzero(dtype, n, offset, density, seed):
    """What in-place receivers journal: exactly the non-zero elements, in order, with their values."""
    rng = np.random.default_rng(seed)
    buf = np.zeros(n + offset, dtype=dtype)
    hit = rng.random(n) < density
    buf[offset:][hit] = rng.integers(1, np.iinfo(dtype).max, size=int(hit.sum()), dtype=dtype, endpoint=True)
    mask = buf[offset:]
    positions, values = nonzero(mask)
    assert positions.tolist() == np.flatnonzero(mask).tolist()
    assert values.dtype == mask.dtype and values.tobytes() == mask[mask != 0].tobytes()


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from(WIDTHS),
    n=st.integers(0, 3000),
    offset=st.integers(0, 7),
    density=st.sampled_from([0.0, 0.001, 0.03, 0.3, 1.0]),
    wide=st.booleans(),
    slack=st.integers(0, 9),
    seed=st.integers(0, 2**31),
)
def test_xor_changes_equals_numpy(dtype, n, offset, density, wide, slack, seed):
    """An in-place receiver's one pass per chunk: the new bits, and every change as (position, old,
    new), equal to numpy's XOR, flatnonzero and gathers, on views at any element offset and on
    inputs not aligned to their element size; outputs with room to spare hold the changes up to the
    count returned, and one too few is ``TooManyChanges``."""
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    held = rng.integers(0, info.max, size=n + offset, dtype=dtype, endpoint=True)[offset:]
    buf = np.zeros(n + offset, dtype=dtype)
    hit = rng.random(n) < density
    buf[offset:][hit] = rng.integers(1, info.max, size=int(hit.sum()), dtype=dtype, endpoint=True)
    mask = buf[offset:]
    k0, base = int(hit.sum()), int(rng.integers(0, 1 << 20))
    pos = np.empty(k0 + slack, np.dtype("<i8") if wide else np.dtype("<u4"))
    old, new, out = np.empty(k0 + slack, dtype), np.empty(k0 + slack, dtype), np.empty(n, dtype)
    assert xor_changes(held, mask, out, pos, old, new, base=base) == k0
    nz = np.flatnonzero(mask)
    assert out.tobytes() == (held ^ mask).tobytes()
    assert pos[:k0].tolist() == (nz + base).tolist()
    assert old[:k0].tobytes() == held[nz].tobytes() and new[:k0].tobytes() == out[nz].tobytes()
    if dtype.itemsize > 1 and n:  # the same bits one byte off their alignment (a packed safetensors file)
        raw = np.zeros(held.nbytes + 1, np.uint8)
        raw[1:] = held.view(np.uint8)
        odd = raw[1:].view(dtype)
        assert not odd.flags.aligned
        assert xor_changes(odd, mask, out, pos, old, new, base=base) == k0 and out.tobytes() == (held ^ mask).tobytes()
    if k0:
        with pytest.raises(TooManyChanges, match=f"more than the {k0 - 1} changes expected"):
            xor_changes(held, mask, out, pos[: k0 - 1], old[: k0 - 1], new[: k0 - 1])


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from(WIDTHS),
    n=st.integers(0, 3000),
    offset=st.integers(0, 7),
    density=st.sampled_from([0.0, 0.001, 0.03, 0.3, 1.0]),
    slack=st.integers(-2, 9),
    seed=st.integers(0, 2**31),
)
def test_xor_diff_equals_numpy(dtype, n, offset, density, slack, seed):
    """The publisher's one pass per chunk: the mask of two chunks, and its changes as (position,
    mask value, new value), equal to numpy's XOR, flatnonzero and gathers, on views at any element
    offset and on inputs not aligned to their element size; room for exactly the changes is enough,
    one too few gives None with the mask still whole; the codec makes the same frame from them."""
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    old = rng.integers(0, info.max, size=n + offset, dtype=dtype, endpoint=True)[offset:]
    new = old.copy()
    hit = rng.random(n) < density
    new[hit] ^= rng.integers(1, info.max, size=int(hit.sum()), dtype=dtype, endpoint=True)
    k0, want = int(hit.sum()), old ^ new
    nz = np.flatnonzero(want)
    mask = np.full(n, 0x5A, dtype)  # written over whole, whatever it held
    found = xor_diff(new, old, mask, k0 + slack)
    assert mask.tobytes() == want.tobytes()
    if slack < 0 and k0:
        assert found is None
        return
    pos, values, news = found  # a cap below zero is taken as no room, which no changes need
    assert pos.dtype == np.dtype("<u4") and values.dtype == news.dtype == dtype
    assert pos.tolist() == nz.tolist()
    assert values.tobytes() == want[nz].tobytes() and news.tobytes() == new[nz].tobytes()
    assert encode_sparse(mask, 1, (pos, values)) == encode_sparse(mask, 1)
    if dtype.itemsize > 1 and n:  # the same bits one byte off their alignment (a packed safetensors file)
        raw = np.zeros(new.nbytes + 1, np.uint8)
        raw[1:] = new.view(np.uint8)
        odd = raw[1:].view(dtype)
        assert not odd.flags.aligned
        again = xor_diff(odd, old, mask, k0)
        assert again is not None and again[0].tolist() == nz.tolist() and mask.tobytes() == want.tobytes()


def test_xor_diff_refuses_what_does_not_fit():
    a = np.zeros(8, np.uint16)
    with pytest.raises(ValueError, match="share one dtype and size"):
        xor_diff(a, a.view(np.int16), a.copy(), 8)
    with pytest.raises(ValueError, match="share one dtype and size"):
        xor_diff(a, a[:7], a.copy(), 8)
    with pytest.raises(ValueError, match="writable, C-contiguous"):
        xor_diff(a, a, np.zeros(16, np.uint16)[::2], 8)


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(WIDTHS),
    n=st.integers(0, 40000),
    short=st.integers(0, 5),
    density=st.sampled_from([0.0, 0.0005, 0.03, 0.2, DENSE_ABOVE, 0.3, 1.0]),
    wide=st.booleans(),
    slack=st.integers(0, 3),
    seed=st.integers(0, 2**31),
)
def test_xor_frame_equals_xor_changes_of_the_decoded_mask(dtype, n, short, density, wide, slack, seed):
    """What an in-place receiver applies straight from a stored frame (no dense mask): the same new
    bits and changes as decoding the frame and scanning its mask, for sparse and dense frames, any
    width, sizes that are not multiples of the copy pieces, a held chunk shorter than the frame (a
    last chunk: changes in its padding are ``OutsideHeld``), one output too few ``TooManyChanges``."""
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    size = max(0, n - short)
    held = rng.integers(0, info.max, size=size, dtype=dtype, endpoint=True)
    mask = np.zeros(n, dtype)
    hit = rng.random(n) < density
    mask[hit] = rng.integers(1, info.max, size=int(hit.sum()), dtype=dtype, endpoint=True)
    frame = encode_sparse(mask, 1)
    assert frame_changes(frame, dtype.itemsize, n) == int(hit.sum())
    k0, base = int(np.count_nonzero(mask[:size])), int(rng.integers(0, 1 << 20))
    pos_dt = np.dtype("<i8") if wide else np.dtype("<u4")
    got = {}
    for how in ("frame", "mask"):
        pos, old, new = np.empty(k0 + slack, pos_dt), np.empty(k0 + slack, dtype), np.empty(k0 + slack, dtype)
        out = np.empty(size, dtype)
        if how == "frame":
            if mask[size:].any() and frame[5] == SPARSE:
                with pytest.raises(OutsideHeld):
                    xor_frame(held, frame, n, out, pos, old, new, base=base)
                return
            k = xor_frame(held, frame, n, out, pos, old, new, base=base)
        else:
            k = xor_changes(held, decode_sparse(frame, dtype, n)[:size], out, pos, old, new, base=base)
        got[how] = (k, out.tobytes(), pos[:k].tobytes(), old[:k].tobytes(), new[:k].tobytes())
    assert got["frame"] == got["mask"] and got["frame"][0] == k0
    if k0:
        pos, old, new = np.empty(k0 - 1, pos_dt), np.empty(k0 - 1, dtype), np.empty(k0 - 1, dtype)
        with pytest.raises(TooManyChanges):
            xor_frame(held, frame, n, np.empty(size, dtype), pos, old, new, base=base)


def test_xor_frame_refuses_what_is_not_a_frame_of_the_chunk():
    mask = np.zeros(1000, np.uint16)
    mask[::7] = 3
    frame = encode_sparse(mask, 1)
    held, out = np.zeros(1000, np.uint16), np.empty(1000, np.uint16)
    outs = (np.empty(200, np.uint32), np.empty(200, np.uint16), np.empty(200, np.uint16))
    for bad, n, why in ((frame[:10], 1000, "too short"), (b"XXXX" + frame[4:], 1000, "not a DCR sparse frame"),
                        (frame, 999, "expected 999"), (frame[:-3], 1000, "truncated|does not decode"),
                        (frame + b"\0", 1000, "trailing bytes")):
        with pytest.raises(SparseFrameError, match=why):
            xor_frame(held[: min(n, 1000)], bad, n, out[: min(n, 1000)], *outs)
    with pytest.raises(SparseFrameError, match="expected 1000 x 4 B"):
        xor_frame(held.view(np.uint32), frame, 1000, out.view(np.uint32), outs[0], *(o.view(np.uint32) for o in outs[1:]))
    with pytest.raises(ValueError, match="at most n elements"):
        xor_frame(np.zeros(1001, np.uint16), frame, 1000, np.empty(1001, np.uint16), *outs)


def test_xor_changes_refuses_mixed_dtypes_and_positions_past_32_bits():
    a = np.zeros(8, np.uint16)
    with pytest.raises(ValueError, match="share one dtype"):
        xor_changes(a, a.view(np.int16), a.copy(), np.empty(0, "<u4"), a[:0], a[:0])
    with pytest.raises(ValueError, match="bad arguments"):
        xor_changes(a, a, a.copy(), np.empty(0, "<u4"), a[:0], a[:0], base=(1 << 32) - 4)
    assert xor_changes(a, a, a.copy(), np.empty(0, "<i8"), a[:0], a[:0], base=(1 << 32) - 4) == 0


@pytest.mark.parametrize("dtype", WIDTHS)
@pytest.mark.parametrize("n", [1, 7, 9, 8 * 37 + 3, 8 * 37 + 7])
def test_changes_only_after_the_last_whole_word(dtype, n):
    m = np.zeros(n, dtype=dtype)
    m[-1] = 1
    _check(m)
    m[0] = np.iinfo(dtype).max
    _check(m)


@pytest.mark.parametrize("dtype", WIDTHS)
def test_empty_all_zero_and_all_changed_chunks(dtype):
    _check(np.zeros(0, dtype=dtype))
    _check(np.zeros(1001, dtype=dtype))
    _check(np.full(1001, np.iinfo(dtype).max, dtype=dtype))
    _check(np.arange(1, 1002).astype(dtype) | dtype.type(1))  # dense: every element non-zero


@pytest.mark.parametrize("density", [DENSE_ABOVE - 0.001, DENSE_ABOVE + 0.001])
def test_the_dense_threshold_is_the_plain_encoders(density):
    n = 10_000
    m = np.zeros(n, dtype=np.uint16)
    m[: int(round(density * n))] = 0x0101
    frame = encode_sparse(m, 1)
    assert frame[5] == (DENSE if density > DENSE_ABOVE else SPARSE)
    _check(m)


FLOAT_NAMES = ["BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2", "C64"]


@pytest.mark.parametrize("name", FLOAT_NAMES)
def test_special_float_bits_survive_an_xor_round_trip(name):
    """NaN payloads, -0.0/+0.0 flips, infinities and subnormals, as stored bits of every float type."""
    dt = DTYPES[name]
    g = torch.Generator().manual_seed(7)
    old = (torch.randn(4099, generator=g) * 0.02).to(torch_dtype(dt))
    old_bits = bits_of(old).copy()
    new_bits = old_bits.copy()
    width = np.iinfo(dt.storage).bits
    sign = dt.storage.type(1 << (width - 1))
    new_bits[[3, 17]] ^= sign  # sign flips, e.g. -0.0 <-> +0.0 where the value is zero
    old_bits[100] = 0
    new_bits[100] = sign  # +0.0 -> -0.0
    new_bits[200] = dt.storage.type((1 << (width - 1)) - 1)  # all exponent and mantissa bits: a NaN payload
    new_bits[201] = dt.storage.type(1)  # smallest subnormal (or smallest value of the format)
    if name in ("BF16", "F16", "F32", "F64"):
        inf = torch.tensor([float("inf")], dtype=torch_dtype(dt))
        new_bits[300] = bits_of(inf)[0]
        new_bits[301] = bits_of(-inf)[0]
    new_bits[-1] ^= dt.storage.type(1)  # a change in the last element (after the last whole word)
    mask = np.bitwise_xor(new_bits, old_bits)
    _check(mask)
    applied = np.bitwise_xor(old_bits, decode_sparse(encode_sparse(mask, 1), dt.storage, mask.size))
    assert applied.tobytes() == new_bits.tobytes()
