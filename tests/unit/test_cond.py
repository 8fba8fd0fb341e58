"""The ``dcr.cond`` frame: changes coded against the held bits (``dcr_zarr_codec.cond``).

Exactness on raw bits for every dtype and hazard: special values stepping by integer units (NaN
payloads, infinities, subnormals, +-0.0, the largest magnitudes), random XOR changes (escapes),
sizes that are not multiples of anything, held bits shorter than the frame (a padded last chunk),
decoding forward (held = old) and backward (held = new). Corrupt frames and wrong held bits raise
``IntegrityError`` (never a crash, never a silent wrong size); the bytes sit below ``dcr.sparse``'s
where positions depend on the exponent, as in optimizer steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from dcr_zarr_codec.cond import CLASSES, classes_of, decode_cond, encode_cond, needs_held
from dcr_zarr_codec.sparse import SparseFrameError
from dcr_zarr_codec.zarr_codec import DcrCondCodec, HeldBitsNeeded

from dcr_core.chunking import ChunkGrid, choose_chunk_shape
from dcr_core.codec import CodecSpec
from dcr_core.delta import Encoding, HeldCoded, apply_chunk
from dcr_core.dtypes import DTYPES
from dcr_core.errors import IntegrityError
from dcr_core.sparse import encode_sparse
from storage.chunk_io import decode_chunk
from tests.support.helpers import SPECIALS

COND = CodecSpec(name="dcr.cond", clevel=3)


def _step(bits: np.ndarray, pos: np.ndarray, d: np.ndarray) -> np.ndarray:
    """``bits`` with the elements at ``pos`` moved by ``d`` units of their sign-magnitude integer
    (wrapping through the sign, as an optimizer's nextafter would not, to reach every escape)."""
    out = bits.copy()
    width = 8 * bits.dtype.itemsize
    sign = 1 << (width - 1)
    for p, s in zip(pos.tolist(), d.tolist()):
        b = int(out[p])
        mag = (b & (sign - 1)) + s
        out[p] = ((b & sign) | mag) % (1 << width) if mag >= 0 else (b ^ sign) | -mag
    return out


def _pair(dtype: str, n: int, seed: int, rate: float = 0.05, ulps: float = 0.7):
    """Old and new bits of one chunk: weights-like values (specials sprinkled in), a share of the
    changes as 1-3 unit steps, the rest random XOR values."""
    rng = np.random.default_rng(seed)
    st = DTYPES[dtype].storage
    raw = rng.integers(0, 256, size=n * st.itemsize, dtype=np.uint8).view(st).copy()
    if dtype in ("BF16", "F32", "F16", "F64"):
        w = rng.normal(0, 0.02, n)
        raw = {"BF16": lambda: (w.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16),
               "F32": lambda: w.astype(np.float32).view(np.uint32), "F16": lambda: w.astype(np.float16).view(np.uint16),
               "F64": lambda: w.view(np.uint64)}[dtype]().copy()
    sp = np.array(SPECIALS.get(dtype, [0]), dtype=np.uint64).astype(st)
    if n:
        at = rng.choice(n, size=min(n, 3 * sp.size), replace=False)
        raw[at] = np.resize(sp, at.size)
    k = min(n, max(1, int(rate * n))) if n else 0
    pos = rng.choice(n, size=k, replace=False) if n else np.zeros(0, np.int64)
    n_step = int(ulps * k)
    new = _step(raw, pos[:n_step], rng.integers(1, 4, n_step) * rng.choice([-1, 1], n_step))
    xs = rng.integers(1, 1 << min(63, 8 * st.itemsize), size=k - n_step, dtype=np.uint64).astype(st)
    new[pos[n_step:]] ^= np.where(xs == 0, st.type(1), xs)
    # steps onto every special value too
    if n:
        sp_at = at[: min(at.size, 8)]
        new = _step(new, sp_at, np.resize(np.array([1, -1, 2, -3]), sp_at.size))
    return raw, new


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("n", [0, 1, 7, 64, 1001, 4099])
def test_every_dtype_round_trips_forward_and_backward(dtype, n):
    old, new = _pair(dtype, n, seed=n)
    mask = old ^ new
    frame = encode_cond(mask, old, dtype)
    st = DTYPES[dtype].storage
    assert needs_held(frame)
    assert decode_cond(frame, st, n, old, True, dtype).tobytes() == mask.tobytes()
    assert decode_cond(frame, st, n, new, False, dtype).tobytes() == mask.tobytes()
    # in place: the other step's bits written over the held ones
    fwd, back = old.copy(), new.copy()
    decode_cond(frame, st, n, fwd, True, dtype, in_place=True)
    decode_cond(frame, st, n, back, False, dtype, in_place=True)
    assert fwd.tobytes() == new.tobytes() and back.tobytes() == old.tobytes()
    assert encode_cond(mask, old, dtype) == frame  # deterministic


@pytest.mark.parametrize("dtype", ["BF16", "F32", "F8_E4M3", "I64"])
def test_a_padded_last_chunk_decodes_against_its_real_elements(dtype):
    old, new = _pair(dtype, 777, seed=5)
    n_padded = 1024
    pad = np.zeros(n_padded - 777, dtype=old.dtype)
    frame = COND.encode(np.concatenate([old ^ new, pad]), np.concatenate([old, pad]), dtype)
    st = DTYPES[dtype].storage
    assert COND.decode(frame, st, n_padded, base=old, dtype=dtype).tobytes() == (old ^ new).tobytes()
    # through the apply, as receivers run it: HeldCoded resolved against the target's chunk
    grid = ChunkGrid((777,), (n_padded,))
    for start, forward, want in ((old, True, new), (new, False, old)):
        target = start.copy()
        apply_chunk(target, grid, 0, HeldCoded(frame, COND, dtype, n_padded, 777), Encoding.XOR, forward)
        assert target.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", ["BF16", "F32", "F8_E5M2", "I16"])
def test_column_block_chunks_decode_against_the_gathered_held_bits(dtype):
    """A column block (rows of a slice of the last dim, an edge block with fewer rows) codes its
    elements in Zarr's order; apply gathers the held bits, decodes, and scatters the result."""
    shape = (37, 12)
    old, new = _pair(dtype, 37 * 12, seed=9, rate=0.2)
    grid = ChunkGrid(shape, choose_chunk_shape(shape, DTYPES[dtype].itemsize, 64 * DTYPES[dtype].itemsize,
                                               column_blocks=4))
    assert grid.is_blocked and grid.chunk_size(grid.n_chunks - 1) < grid.chunk_numel  # an edge block
    st = DTYPES[dtype].storage
    for forward, start, want in ((True, old, new), (False, new, old)):
        target = start.copy()
        for i in range(grid.n_chunks):
            mask, held = grid.take(old ^ new, i), grid.take(old, i)
            pad = np.zeros(grid.chunk_numel - mask.size, dtype=st)
            frame = COND.encode(np.concatenate([mask, pad]), np.concatenate([held, pad]), dtype)
            payload = decode_chunk("mem://x", f"c/{i}", frame, COND, dtype, grid, i, len(frame))
            apply_chunk(target, grid, i, payload, Encoding.XOR, forward)
        assert target.tobytes() == want.tobytes(), forward


def test_without_held_bits_the_frame_stores_the_payload_plainly():
    old, new = _pair("BF16", 300, seed=1)
    frame = COND.encode(new)  # a keyframe chunk or an overwrite: no base
    assert not needs_held(frame)
    assert COND.decode(frame, np.dtype("<u2"), 300, dtype="BF16").tobytes() == new.tobytes()


def test_all_changed_and_unchanged_chunks():
    old, _ = _pair("F32", 5000, seed=2)
    for new in (old.copy(), old ^ np.uint32(1), old ^ np.uint32(0x80000000)):
        m = old ^ new
        f = encode_cond(m, old, "F32")
        assert decode_cond(f, np.uint32, 5000, old, True, "F32").tobytes() == m.tobytes()
        assert decode_cond(f, np.uint32, 5000, new, False, "F32").tobytes() == m.tobytes()


def test_classes_are_the_exponent_fields():
    assert classes_of("BF16") == (7, 8) and classes_of("F32") == (23, 8) and classes_of("I32") == (0, 0)
    for name, (shift, width) in CLASSES.items():
        assert shift + width == 8 * DTYPES[name].itemsize - 1  # the field just below the sign bit


def _corruptions(frame: bytes, rng):
    yield frame[:-1]
    yield frame + b"\0"
    yield frame[:30]
    yield b""
    for _ in range(300):
        b = bytearray(frame)
        i = int(rng.integers(0, len(b)))
        b[i] ^= 1 << int(rng.integers(0, 8))
        yield bytes(b)


def test_corrupt_frames_raise_integrity_errors_and_never_crash():
    old, new = _pair("BF16", 4000, seed=9)
    frame = encode_cond(old ^ new, old, "BF16")
    rng = np.random.default_rng(0)
    raised = 0
    for bad in _corruptions(frame, rng):
        try:
            out = COND.decode(bad, np.dtype("<u2"), 4000, base=old, dtype="BF16")
        except IntegrityError:
            raised += 1
            continue
        assert out.shape == (4000,) and out.dtype == np.uint16  # decoded to something: the digests decide
    # A flipped bit in the Golomb-Rice gaps or the steps often still decodes (no redundancy there):
    # receivers check the stored bytes' digest before decoding (storage.chunk_io), so such a chunk
    # never reaches a decode; the structure (sizes, counts, ranges) is checked here regardless.
    assert raised > 100


def test_wrong_sizes_types_and_missing_held_bits_are_refused():
    old, new = _pair("BF16", 500, seed=4)
    frame = encode_cond(old ^ new, old, "BF16")
    with pytest.raises(SparseFrameError, match="expected"):
        decode_cond(frame, np.uint16, 501, old)
    with pytest.raises(SparseFrameError, match="expected"):
        decode_cond(frame, np.uint32, 500, old.astype(np.uint32))
    with pytest.raises(SparseFrameError, match="classes"):
        decode_cond(frame, np.uint16, 500, old, dtype="F16")
    with pytest.raises(SparseFrameError, match="held bits"):
        decode_cond(frame, np.uint16, 500, None)
    with pytest.raises(SparseFrameError, match="held bits"):
        decode_cond(frame, np.uint16, 500, np.zeros(600, np.uint16))


def test_other_held_bits_decode_to_a_mask_the_digest_refuses_or_an_error():
    """The frame trusts the held bits' classes; held bits of another step either fail a check
    (a change outside its class, a step out of range) or give another mask (the tensor digest
    catches it): never a crash."""
    old, new = _pair("BF16", 4000, seed=10)
    frame = encode_cond(old ^ new, old, "BF16")
    other, _ = _pair("BF16", 4000, seed=11)
    try:
        m = decode_cond(frame, np.uint16, 4000, other)
    except SparseFrameError:
        return
    assert m.tobytes() != (old ^ new).tobytes()


def _adamw_like(n: int, rate: float, seed: int):
    """BF16 weights ~N(0, 0.02) moved by +-1 ulp with a probability that falls with the ulp's size
    (an AdamW step of a fixed size changes small weights' bits far more often)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.02, n).astype(np.float32)
    bits = (w.view(np.uint32) >> 16).astype(np.uint16)
    ulp = np.abs(w) / 128 + 1e-12
    p = np.minimum(1.0, rate * np.median(ulp) / ulp)
    pos = np.flatnonzero(rng.random(n) < p)
    new = bits.copy()
    new[pos] = (new[pos].astype(np.int32) + np.where(rng.random(pos.size) < 0.5, 1, -1)).astype(np.uint16)
    return bits, new


def test_bytes_fall_below_the_xor_frame_when_the_exponent_predicts_changes():
    old, new = _adamw_like(1 << 20, 0.03, seed=1)
    mask = old ^ new
    cond, sparse = len(encode_cond(mask, old, "BF16", 3)), len(encode_sparse(mask, 3))
    assert cond < 0.8 * sparse, (cond, sparse)


def test_stock_zarr_reading_a_cond_array_says_what_to_do(tmp_path):
    store = str(tmp_path / "s.zarr")
    a = zarr.create_array(store, shape=(8,), chunks=(8,), dtype="uint16", fill_value=0,
                          compressors=[DcrCondCodec()], zarr_format=3)
    (tmp_path / "s.zarr" / "c").mkdir(exist_ok=True)
    (tmp_path / "s.zarr" / "c" / "0").write_bytes(b"x" * 10)
    with pytest.raises(HeldBitsNeeded, match="dcr materialize"):
        zarr.open_array(store, mode="r")[...]
    assert a.metadata.to_dict()["codecs"][-1]["name"] == "dcr.cond"
