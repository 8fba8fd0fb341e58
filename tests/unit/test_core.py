"""Unit tests of dcr_core: raw bits, chunk grids, deltas, the codec, digests and the chain planner."""

from __future__ import annotations

import math
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcr_core.bits import bits_of, dtype_of, tensor_from_bits, torch_dtype
from dcr_core.chain import Direction, Move, StepInfo, ancestors, plan_path
from dcr_core.chunking import ChunkGrid, choose_chunk_shape
from dcr_core.codec import CodecSpec
from dcr_core.delta import Encoding, apply_chunk, choose_encoding, encode_chunks, pad
from dcr_core.digest import chunk_digest, policy_digest, tensor_digest
from dcr_core.dtypes import DTYPES, dtype_named
from dcr_core.errors import DCRError, IntegrityError, InvalidCheckpointError, StepNotFoundError
from storage import layout
from tests.support.helpers import SPECIALS, from_bits, nasty_tensor, random_bits, raw_bytes

ODD_SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (5, 3), (2, 3, 5), (1, 1, 1)]
ALL_DTYPES = list(DTYPES)


def one_line(err: BaseException) -> bool:
    return len(str(err).splitlines()) == 1


# --------------------------------------------------------------------------------------------------
# dtype table and raw bits


def test_dtype_table_lists_exactly_the_safetensors_dtypes_dcr_supports():
    assert set(DTYPES) == {
        "BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16",
        "F16", "BF16", "I32", "U32", "F32", "I64", "U64", "F64", "C64",
    }
    for name, dt in DTYPES.items():
        assert dt.name == name
        assert dtype_named(name) is dt
        assert torch.empty(0, dtype=torch_dtype(dt)).element_size() == dt.itemsize
        assert dt.storage.itemsize == dt.itemsize and dt.storage.kind == "u"
        assert dt.storage.byteorder in ("<", "|", "=")


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=str)
def test_bits_of_and_tensor_from_bits_round_trip_every_dtype_and_shape(dtype, shape):
    t = nasty_tensor(dtype, shape, seed=7)
    dt = DTYPES[dtype]
    assert dtype_of(t) is dt
    bits = bits_of(t)
    assert bits.dtype == dt.storage
    assert bits.shape == (math.prod(shape),)
    assert bits.tobytes() == raw_bytes(t)
    back = tensor_from_bits(bits, dt, shape)
    assert back.dtype == t.dtype and tuple(back.shape) == shape
    assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", [d for d in ALL_DTYPES if d != "BOOL"])
def test_special_bit_patterns_survive_bits_round_trip_unchanged(dtype):
    specials = np.array(SPECIALS[dtype], dtype=DTYPES[dtype].storage)
    t = from_bits(specials, dtype, (len(specials),))
    assert np.array_equal(bits_of(t), specials)
    back = tensor_from_bits(bits_of(t).copy(), DTYPES[dtype], (len(specials),))
    assert back.reshape(-1).view(torch.uint8).numpy().tobytes() == specials.tobytes()


def test_bits_of_a_non_contiguous_tensor_gives_its_c_order_bits():
    base = nasty_tensor("BF16", (4, 6), seed=3)
    t = base.t()  # a transposed view
    assert not t.is_contiguous()
    assert bits_of(t).tobytes() == t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_tensor_from_bits_copies_read_only_input_and_rejects_the_wrong_storage_type():
    bits = np.arange(6, dtype="<u2")
    bits.flags.writeable = False
    t = tensor_from_bits(bits, DTYPES["BF16"], (2, 3))
    assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == bits.tobytes()
    with pytest.raises(ValueError) as ei:
        tensor_from_bits(np.arange(6, dtype="<u4"), DTYPES["BF16"], (2, 3))
    assert one_line(ei.value)


def test_unknown_dtypes_are_rejected_with_a_one_line_error():
    with pytest.raises(InvalidCheckpointError) as ei:
        dtype_named("F4")
    assert one_line(ei.value) and "F4" in str(ei.value)
    with pytest.raises(InvalidCheckpointError) as ei:
        dtype_of(torch.zeros(2, dtype=torch.complex128))
    assert one_line(ei.value)


# --------------------------------------------------------------------------------------------------
# chunk grids


def _split_dim(shape, chunk):
    """The last dim where the chunk is shorter than the shape (0 if none)."""
    for i in range(len(shape) - 1, -1, -1):
        if chunk[i] < shape[i]:
            return i
    return 0


def _boxes_are_contiguous(shape, chunk) -> bool:
    """Brute force: every chunk's box of elements is one consecutive run of flat indices."""
    n = math.prod(shape)
    if n == 0:
        return True
    idx = np.arange(n).reshape(shape)
    grid = [-(-d // c) for d, c in zip(shape, chunk)]
    for g in np.ndindex(*grid):
        box = idx[tuple(slice(gi * c, (gi + 1) * c) for gi, c in zip(g, chunk))].ravel()
        if box.size and not np.array_equal(box, np.arange(box[0], box[0] + box.size)):
            return False
    return True


def check_grid_tiles_exactly(shape, chunk) -> None:
    """The grid's chunks tile the flat range once, in order, each the box Zarr stores for it."""
    grid = ChunkGrid(shape, chunk)
    n = math.prod(shape)
    assert grid.numel == n
    assert grid.grid_shape == tuple(-(-d // c) for d, c in zip(shape, chunk))
    assert grid.chunk_numel == math.prod(chunk)
    if n == 0:
        assert grid.n_chunks == 0
        return
    assert grid.n_chunks == math.prod(grid.grid_shape)
    idx = np.arange(n).reshape(shape)
    pos = 0
    for i in range(grid.n_chunks):
        g = grid.grid_index(i)
        assert g == tuple(int(x) for x in np.unravel_index(i, grid.grid_shape))
        assert layout.chunk_key("a", g) == "/".join(["a", "c", *map(str, g)])
        start, stop = grid.chunk_range(i)
        assert start == pos and stop > start, (shape, chunk, i)
        box = idx[tuple(slice(gi * c, (gi + 1) * c) for gi, c in zip(g, chunk))].ravel()
        assert np.array_equal(box, np.arange(start, stop)), (shape, chunk, i)
        assert stop - start <= grid.chunk_numel
        pos = stop
    assert pos == n
    with pytest.raises(IntegrityError):
        grid.chunk_range(grid.n_chunks)
    with pytest.raises(IntegrityError):
        grid.grid_index(-1)


def check_choose_chunk_shape(shape, itemsize, target) -> None:
    chunk = choose_chunk_shape(shape, itemsize, target)
    assert len(chunk) == len(shape)
    if math.prod(shape) == 0:
        assert chunk == tuple(max(1, d) for d in shape)
        check_grid_tiles_exactly(shape, chunk)
        return
    elems = max(1, target // itemsize)
    assert all(1 <= c <= d for c, d in zip(chunk, shape))
    assert math.prod(chunk) <= elems  # never over the target (at least one element)
    if chunk != shape:  # and as large as a contiguous chunk can be
        j = _split_dim(shape, chunk)
        inner = math.prod(chunk[j + 1:])
        assert (chunk[j] + 1) * inner > elems
    check_grid_tiles_exactly(shape, chunk)


def _is_column_block(shape, chunk) -> bool:
    """By the definition: rows of an equal column block of the last dim, single indices before."""
    return (len(shape) >= 2 and math.prod(shape) > 0 and chunk[-1] < shape[-1] and shape[-1] % chunk[-1] == 0
            and min(chunk[-2], shape[-2]) > 1 and all(c == 1 for c in chunk[:-2]))


def check_block_grid(shape, chunk) -> None:
    """A column-block grid: every chunk's box, in Zarr's C order, is what take/view/put/chunk_runs
    give; the runs tile the tensor once; the valid elements are a prefix of the padded chunk."""
    grid = ChunkGrid(shape, chunk)
    assert grid.is_blocked
    n = math.prod(shape)
    flat = np.arange(n, dtype=np.int64)
    idx = flat.reshape(shape)
    seen = np.zeros(n, dtype=np.int64)
    back = np.full(n, -1, dtype=np.int64)
    for i in range(grid.n_chunks):
        g = grid.grid_index(i)
        box = idx[tuple(slice(gi * c, (gi + 1) * c) for gi, c in zip(g, chunk))].ravel()
        assert np.array_equal(grid.take(flat, i), box), (shape, chunk, i)
        assert grid.chunk_size(i) == box.size <= grid.chunk_numel
        runs = grid.chunk_runs(i)
        assert np.array_equal(np.concatenate([np.arange(a, b) for a, b in runs]), box)
        assert grid.chunk_span(i) == (int(box[0]), int(box[-1]) + 1)
        for a, b in runs:
            seen[a:b] += 1
        grid.put(back, i, box)
    assert (seen == 1).all() and np.array_equal(back, flat)
    with pytest.raises(IntegrityError):
        grid.chunk_range(0)  # a block is not one range


def check_chunk_shape_validation(shape, chunk) -> None:
    try:
        ChunkGrid(shape, chunk)
    except IntegrityError as e:
        assert one_line(e)
        # Rejected: really not contiguous, or a conservative refusal of a chunk longer than a
        # size-1 dim in front of the split dim (equivalent to a contiguous one, never written).
        j = _split_dim(shape, chunk)
        assert not _boxes_are_contiguous(shape, chunk) or any(
            shape[i] == 1 and chunk[i] > 1 for i in range(j)
        ), (shape, chunk)
        assert not _is_column_block(shape, chunk), (shape, chunk)
        return
    if _is_column_block(shape, chunk):
        check_block_grid(shape, chunk)
        return
    assert _boxes_are_contiguous(shape, chunk), (shape, chunk)
    check_grid_tiles_exactly(shape, chunk)


@pytest.mark.parametrize(
    "shape,itemsize,target,expected",
    [
        ((), 4, 64, ()),
        ((0,), 2, 64, (1,)),
        ((3, 0, 2), 8, 64, (3, 1, 2)),
        ((10,), 1, 4, (4,)),
        ((13, 11), 8, 128, (1, 11)),
        ((13, 11), 2, 128, (5, 11)),
        ((3, 5, 7), 4, 64, (1, 2, 7)),
        ((3, 5, 7), 8, 1, (1, 1, 1)),  # less than one element: one element
        ((2, 3), 4, 1 << 20, (2, 3)),
    ],
)
def test_choose_chunk_shape_table(shape, itemsize, target, expected):
    assert choose_chunk_shape(shape, itemsize, target) == expected
    check_choose_chunk_shape(shape, itemsize, target)


@pytest.mark.parametrize(
    "shape,itemsize,target,blocks,expected",
    [
        ((37, 12), 4, 256, 4, (10, 3)),  # 64 elements a chunk would be 21 rows; rows cut in 4 blocks too
        ((37, 12), 4, 64, 4, (5, 3)),  # the target allows 5 rows of 3
        ((3, 9, 8), 2, 256, 4, (1, 3, 2)),
        ((8, 12), 4, 1 << 20, 4, (8, 12)),  # one chunk: not split (blocks would only add requests)
        ((37, 10), 4, 256, 4, (6, 10)),  # 4 does not divide 10: runs
        ((100,), 4, 64, 4, (16,)),  # one dim: runs
        ((37, 12), 4, 4, 4, (1, 3)),  # under one row of a block: single rows (still blocks of width 3)
    ],
)
def test_choose_chunk_shape_with_column_blocks(shape, itemsize, target, blocks, expected):
    chunk = choose_chunk_shape(shape, itemsize, target, column_blocks=blocks)
    assert chunk == expected
    if _is_column_block(shape, chunk):
        check_block_grid(shape, chunk)
    else:
        check_grid_tiles_exactly(shape, chunk)


def test_zero_dim_grid_has_one_chunk_keyed_c():
    grid = ChunkGrid((), ())
    assert grid.n_chunks == 1 and grid.chunk_range(0) == (0, 1) and layout.chunk_key("a", grid.grid_index(0)) == "a/c"


def test_empty_grids_have_no_chunks():
    for shape in [(0,), (3, 0, 2), (0, 0)]:
        grid = ChunkGrid(shape, choose_chunk_shape(shape, 4, 64))
        assert grid.n_chunks == 0 and grid.numel == 0


@pytest.mark.parametrize(
    "shape,chunk",
    [
        ((4, 6), (2, 4)),  # a column block must divide the last dim
        ((2, 4, 4), (2, 2, 2)),  # and cut nothing but rows before it
        ((3, 4, 5), (1, 2, 2)),
        ((4, 4), (2, 3)),
        ((2, 3, 4), (2, 1, 4)),
        ((4,), (2, 2)),  # rank mismatch
        ((4, 4), (0, 4)),  # empty chunk dim
        ((-1, 4), (1, 4)),  # negative dim
    ],
)
def test_non_contiguous_or_malformed_chunk_shapes_are_rejected(shape, chunk):
    with pytest.raises(IntegrityError) as ei:
        ChunkGrid(shape, chunk)
    assert one_line(ei.value)


def test_chunk_shapes_longer_than_trailing_dims_are_contiguous():
    check_grid_tiles_exactly((5, 3), (2, 7))
    check_grid_tiles_exactly((5,), (9,))


def test_seeded_sweep_of_random_shapes_keeps_every_grid_property():
    rng = np.random.default_rng(1234)
    for _ in range(300):
        ndim = int(rng.integers(0, 5))
        shape = tuple(int(x) for x in rng.integers(0, 8, size=ndim))
        itemsize = int(rng.choice([1, 2, 4, 8]))
        check_choose_chunk_shape(shape, itemsize, int(rng.integers(1, 600)))
        chunk = tuple(int(rng.integers(1, d + 3)) for d in shape)
        check_chunk_shape_validation(shape, chunk)


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=4).map(tuple)
_hyp = settings(
    max_examples=150, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

@_hyp
@given(shape=shapes, itemsize=st.sampled_from([1, 2, 4, 8]), target=st.integers(1, 800))
def test_chosen_chunk_shapes_are_contiguous_bounded_maximal_and_tile_exactly(shape, itemsize, target):
    check_choose_chunk_shape(shape, itemsize, target)

@_hyp
@given(data=st.data(), shape=shapes)
def test_grids_accept_only_contiguous_chunk_shapes(data, shape):
    chunk = tuple(data.draw(st.integers(1, d + 2)) for d in shape)
    check_chunk_shape_validation(shape, chunk)

@_hyp
@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=4).map(tuple), data=st.data())
def test_every_contiguous_chunk_shape_form_is_accepted(shape, data):
    j = data.draw(st.integers(0, len(shape) - 1))
    k = data.draw(st.integers(1, shape[j]))
    chunk = (1,) * j + (k,) + shape[j + 1:]
    check_grid_tiles_exactly(shape, chunk)


@_hyp
@given(shape=st.lists(st.integers(1, 9), min_size=2, max_size=4).map(tuple), blocks=st.integers(2, 4),
       itemsize=st.sampled_from([1, 2, 4, 8]), target=st.integers(1, 400))
def test_column_block_grids_gather_and_scatter_zarrs_boxes(shape, blocks, itemsize, target):
    chunk = choose_chunk_shape(shape, itemsize, target, column_blocks=blocks)
    ChunkGrid(shape, chunk)  # whatever was chosen is a valid grid
    if _is_column_block(shape, chunk):
        check_block_grid(shape, chunk)
    else:
        check_grid_tiles_exactly(shape, chunk)


# --------------------------------------------------------------------------------------------------
# deltas


def _grid(dtype: str, shape, target=64) -> ChunkGrid:
    return ChunkGrid(shape, choose_chunk_shape(shape, DTYPES[dtype].itemsize, target))


def _flip_some(bits: np.ndarray, rng, fraction=0.1) -> np.ndarray:
    out = bits.copy()
    if out.size:
        k = max(1, int(fraction * out.size))
        pos = rng.choice(out.size, size=k, replace=False)
        out[pos] ^= out.dtype.type(1)
    return out


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (37,), (13, 11), (3, 5, 7)], ids=str)
def test_encode_then_apply_restores_the_new_bits_for_every_encoding(dtype, shape):
    rng = np.random.default_rng(zlib.crc32(repr((dtype, shape)).encode()))
    base = bits_of(nasty_tensor(dtype, shape, seed=1)).copy()
    new = _flip_some(base, rng)
    grid = _grid(dtype, shape)

    full = list(encode_chunks(new, None, grid, Encoding.FULL))
    target = np.zeros_like(new)
    for c in full:
        assert c.payload.shape == (grid.chunk_range(c.index)[1] - grid.chunk_range(c.index)[0],)
        apply_chunk(target, grid, c.index, c.payload, Encoding.FULL)
    assert target.tobytes() == new.tobytes()

    for enc in (Encoding.XOR, Encoding.OVERWRITE):
        chunks = list(encode_chunks(new, base, grid, enc))
        assert [c.index for c in chunks] == sorted(c.index for c in chunks)
        target = base.copy()
        for c in chunks:
            apply_chunk(target, grid, c.index, c.payload, enc)
        assert target.tobytes() == new.tobytes(), enc
        assert sum(c.changed for c in chunks) == int(np.count_nonzero(new != base))

    assert list(encode_chunks(new, base, grid, Encoding.UNCHANGED)) == []


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(37, 12), (3, 9, 8), (5, 1, 16)], ids=str)
def test_column_block_chunks_encode_and_apply_exactly_for_every_encoding(dtype, shape):
    rng = np.random.default_rng(zlib.crc32(repr(("blocks", dtype, shape)).encode()))
    base = bits_of(nasty_tensor(dtype, shape, seed=3)).copy()
    new = _flip_some(base, rng)
    grid = ChunkGrid(shape, choose_chunk_shape(shape, DTYPES[dtype].itemsize, 16 * DTYPES[dtype].itemsize,
                                               column_blocks=4))
    assert grid.is_blocked or shape[-2] == 1  # one row: blocks of it are runs
    target = np.zeros_like(new)
    for c in encode_chunks(new, None, grid, Encoding.FULL):
        assert c.payload.tobytes() == grid.take(new, c.index).tobytes()
        apply_chunk(target, grid, c.index, c.payload, Encoding.FULL)
    assert target.tobytes() == new.tobytes()
    for enc in (Encoding.XOR, Encoding.OVERWRITE):
        target = base.copy()
        for c in encode_chunks(new, base, grid, enc):
            apply_chunk(target, grid, c.index, c.payload, enc)
        assert target.tobytes() == new.tobytes(), enc
    for c in encode_chunks(new, base, grid, Encoding.XOR):  # and back: XOR masks undo themselves
        apply_chunk(target, grid, c.index, c.payload, Encoding.XOR)
    assert target.tobytes() == base.tobytes()


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_xor_masks_are_self_inverse(dtype):
    rng = np.random.default_rng(5)
    shape = (13, 11)
    base = bits_of(nasty_tensor(dtype, shape, seed=2)).copy()
    new = _flip_some(base, rng, 0.3)
    grid = _grid(dtype, shape)
    chunks = list(encode_chunks(new, base, grid, Encoding.XOR))
    state = base.copy()
    for c in chunks:
        apply_chunk(state, grid, c.index, c.payload, Encoding.XOR)
    assert state.tobytes() == new.tobytes()
    for c in reversed(chunks):  # applying the same masks again steps backward
        apply_chunk(state, grid, c.index, c.payload, Encoding.XOR)
    assert state.tobytes() == base.tobytes()


def test_unchanged_chunks_and_all_zero_keyframe_chunks_are_not_stored():
    shape = (8, 4)
    grid = ChunkGrid(shape, (1, 4))  # 8 chunks of 4
    base = np.arange(32, dtype="<u2")
    new = base.copy()
    new[5] ^= 0x8000  # chunk 1
    new[30] ^= 0x0001  # chunk 7
    assert [c.index for c in encode_chunks(new, base, grid, Encoding.XOR)] == [1, 7]
    assert [c.index for c in encode_chunks(new, base, grid, Encoding.OVERWRITE)] == [1, 7]
    zeros = np.zeros(32, dtype="<u2")
    zeros[9] = 0x8000  # -0.0 in bf16 is not "zero bits"
    full = list(encode_chunks(zeros, None, grid, Encoding.FULL))
    assert [c.index for c in full] == [2] and full[0].changed == 1


def test_choose_encoding_table():
    assert choose_encoding(0, 10, 0.9) is Encoding.UNCHANGED
    assert choose_encoding(1, 10, 0.9) is Encoding.XOR
    assert choose_encoding(9, 10, 0.9) is Encoding.XOR
    assert choose_encoding(10, 10, 0.9) is Encoding.OVERWRITE
    assert choose_encoding(1, 10, 0.0) is Encoding.OVERWRITE
    assert choose_encoding(10, 10, 1.0) is Encoding.XOR
    assert choose_encoding(0, 0, 0.0) is Encoding.UNCHANGED
    assert Encoding.XOR.invertible and Encoding.UNCHANGED.invertible
    assert not Encoding.OVERWRITE.invertible and not Encoding.FULL.invertible


def test_delta_encodings_without_a_matching_base_and_wrong_payload_sizes_are_rejected():
    grid = ChunkGrid((8,), (4,))
    new = np.arange(8, dtype="<u4")
    with pytest.raises(ValueError):
        list(encode_chunks(new, None, grid, Encoding.XOR))
    with pytest.raises(ValueError):
        list(encode_chunks(new, np.arange(7, dtype="<u4"), grid, Encoding.OVERWRITE))
    target = new.copy()
    with pytest.raises(ValueError):
        apply_chunk(target, grid, 0, np.zeros(3, dtype="<u4"), Encoding.XOR)
    with pytest.raises(ValueError):
        apply_chunk(target, grid, 0, np.zeros(4, dtype="<u4"), Encoding.UNCHANGED)
    assert target.tobytes() == new.tobytes()


def test_pad_fills_edge_chunks_with_zero_bits():
    p = np.array([0xFFFF, 0x7FC1], dtype="<u2")
    assert pad(p, 2) is p
    assert pad(p, 5).tolist() == [0xFFFF, 0x7FC1, 0, 0, 0]


# --------------------------------------------------------------------------------------------------
# codec

SPECS = [CodecSpec(), CodecSpec(clevel=3, shuffle="shuffle"), CodecSpec(cname="lz4", clevel=1, shuffle="noshuffle")]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.cname}-{s.clevel}-{s.shuffle}")
@pytest.mark.parametrize("dtype", ["U8", "BF16", "F32", "C64"])
def test_codec_is_deterministic_and_round_trips_exact_bits(spec, dtype):
    bits = random_bits(np.random.default_rng(3), dtype, 4096)
    bits[:100] = 0  # some compressible data too
    a = spec.encode(bits)
    assert spec.encode(bits.copy()) == a
    with ThreadPoolExecutor(8) as pool:  # same bytes whatever thread encodes it
        assert set(pool.map(lambda _: spec.encode(bits), range(16))) == {a}
    out = spec.decode(a, bits.dtype, bits.size)
    assert out.dtype == bits.dtype and out.tobytes() == bits.tobytes()


def test_codec_decode_rejects_wrong_sizes_and_truncated_or_short_frames():
    spec = CodecSpec()
    bits = np.arange(256, dtype="<u4")
    data = spec.encode(bits)
    for bad in (
        lambda: spec.decode(data, bits.dtype, 255),
        lambda: spec.decode(data, bits.dtype, 257),
        lambda: spec.decode(data, np.dtype("<u8"), 256),
        lambda: spec.decode(data[:-1], bits.dtype, 256),
        lambda: spec.decode(data + b"\0", bits.dtype, 256),
        lambda: spec.decode(data[:10], bits.dtype, 256),
        lambda: spec.decode(b"", bits.dtype, 256),
    ):
        with pytest.raises(IntegrityError) as ei:
            bad()
        assert one_line(ei.value)


def test_codec_decode_rejects_a_frame_whose_header_lies_about_its_size():
    spec = CodecSpec()
    bits = np.arange(64, dtype="<u4")
    data = bytearray(spec.encode(bits))
    struct.pack_into("<I", data, 4, 1 << 30)  # claims 1 GiB decoded
    with pytest.raises(IntegrityError) as ei:
        spec.decode(bytes(data), bits.dtype, 64)
    assert one_line(ei.value)


def test_codec_spec_validates_and_round_trips_through_dict():
    for spec in SPECS:
        assert CodecSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError):
        CodecSpec(shuffle="bytes")
    with pytest.raises(ValueError):
        CodecSpec(clevel=10)


# --------------------------------------------------------------------------------------------------
# digests


@pytest.mark.parametrize("dtype", [d for d in ALL_DTYPES if d != "BOOL"])
def test_a_single_flipped_bit_anywhere_changes_the_tensor_digest(dtype):
    bits = bits_of(nasty_tensor(dtype, (5, 3), seed=9)).copy()
    d0 = tensor_digest(bits)
    assert tensor_digest(bits.copy()) == d0
    nbits = DTYPES[dtype].bits
    for pos in (0, 7, 14):
        for b in (0, nbits // 2, nbits - 1):
            flipped = bits.copy()
            flipped[pos] ^= flipped.dtype.type(1 << b)
            assert tensor_digest(flipped) != d0, (pos, b)


def test_digests_see_zero_signs_and_nan_payloads_that_float_compare_cannot():
    pz = from_bits(np.array([0x0000], dtype="<u2"), "BF16", (1,))
    nz = from_bits(np.array([0x8000], dtype="<u2"), "BF16", (1,))
    assert torch.equal(pz, nz)  # equal as floats...
    assert tensor_digest(bits_of(pz)) != tensor_digest(bits_of(nz))  # ...not as bits
    nans = [0x7FC1, 0xFFA5, 0x7F81, 0x7FC0]
    digests = {tensor_digest(bits_of(from_bits(np.array([n], dtype="<u2"), "BF16", (1,)))) for n in nans}
    assert len(digests) == len(nans)
    f32 = [0x7FC00001, 0x7FC00002, 0xFFC00001, 0x7F800001]
    assert len({tensor_digest(np.array([n], dtype="<u4")) for n in f32}) == len(f32)
    f64 = [0x0, 0x8000000000000000]
    assert len({tensor_digest(np.array([n], dtype="<u8")) for n in f64}) == 2


def test_chunk_digest_is_the_digest_of_the_unpadded_payload():
    p = np.array([1, 2, 3], dtype="<u2")
    assert chunk_digest(p) == tensor_digest(p)
    assert chunk_digest(p) != chunk_digest(pad(p, 4))
    assert tensor_digest(np.zeros(0, dtype="<u4")) == tensor_digest(np.zeros(0, dtype="<u1"))


def test_policy_digest_binds_every_name_dtype_shape_and_tensor_digest():
    d = "a" * 64
    base = [("w", "BF16", (2, 3), d), ("b", "F32", (3,), "b" * 64)]
    p0 = policy_digest(base)
    assert policy_digest(list(reversed(base))) == p0  # order does not matter
    variants = [
        [("w2", "BF16", (2, 3), d), base[1]],
        [("w", "F16", (2, 3), d), base[1]],
        [("w", "BF16", (3, 2), d), base[1]],
        [("w", "BF16", (6,), d), base[1]],
        [("w", "BF16", (2, 3, 1), d), base[1]],
        [("w", "BF16", (2, 3), "c" * 64), base[1]],
        [base[0]],
        base + [("s", "I64", (), "d" * 64)],
        [("w", "BF16", (), d), base[1]],
        [("w", "BF16", (0,), d), base[1]],
    ]
    digests = {policy_digest(v) for v in variants}
    assert p0 not in digests and len(digests) == len(variants)


# --------------------------------------------------------------------------------------------------
# chain planner


def _linear(n: int, kf_bytes=1000, delta_bytes=10, non_invertible=(), keyframes=()) -> dict[int, StepInfo]:
    """Steps 0..n-1: 0 (and ``keyframes``) are keyframes, the others deltas on the previous step."""
    out = {}
    for s in range(n):
        kf = s == 0 or s in keyframes
        out[s] = StepInfo(s, None if kf else s - 1, not kf and s not in non_invertible, kf_bytes if kf else delta_bytes)
    return out


def _moves(path: list[Move]) -> list[str]:
    return [f"{m.direction.value}:{m.step}" for m in path]


def test_planner_from_nothing_loads_the_keyframe_then_goes_forward():
    steps = _linear(6)
    assert _moves(plan_path(steps, None, 0)) == ["keyframe:0"]
    assert _moves(plan_path(steps, None, 3)) == ["keyframe:0", "forward:1", "forward:2", "forward:3"]
    assert _moves(plan_path(steps, 99, 2)) == ["keyframe:0", "forward:1", "forward:2"]  # unknown current


def test_planner_forward_backward_and_no_move():
    steps = _linear(6)
    assert _moves(plan_path(steps, 1, 4)) == ["forward:2", "forward:3", "forward:4"]
    assert _moves(plan_path(steps, 5, 1)) == ["backward:5", "backward:4", "backward:3", "backward:2"]
    assert _moves(plan_path(steps, 0, 5)) == [f"forward:{s}" for s in range(1, 6)]
    assert plan_path(steps, 3, 3) == []
    assert all(m.direction is Direction.BACKWARD for m in plan_path(steps, 5, 0))


def test_planner_goes_back_to_the_common_ancestor_then_forward_on_a_branch():
    steps = {
        0: StepInfo(0, None, False, 1000),
        1: StepInfo(1, 0, True, 10),
        2: StepInfo(2, 1, True, 10),
        3: StepInfo(3, 1, True, 10),  # a sibling of 2
        4: StepInfo(4, 3, True, 10),
    }
    assert _moves(plan_path(steps, 2, 4)) == ["backward:2", "forward:3", "forward:4"]
    assert _moves(plan_path(steps, 4, 2)) == ["backward:4", "backward:3", "forward:2"]


def test_planner_falls_back_to_the_keyframe_when_a_step_to_undo_is_not_invertible():
    steps = _linear(6, non_invertible=(3,))
    assert _moves(plan_path(steps, 5, 1)) == ["keyframe:0", "forward:1"]
    assert _moves(plan_path(steps, 5, 2)) == ["keyframe:0", "forward:1", "forward:2"]
    # Undoing only steps after the non-invertible one is still fine, and forward never needs it.
    assert _moves(plan_path(steps, 5, 3)) == ["backward:5", "backward:4"]
    assert _moves(plan_path(steps, 1, 5)) == ["forward:2", "forward:3", "forward:4", "forward:5"]


def test_planner_takes_the_path_that_pulls_fewer_bytes_and_the_delta_path_on_a_tie():
    steps = _linear(6, kf_bytes=100, delta_bytes=60)
    # 5 -> 1: undo 5,4,3,2 = 240 bytes vs keyframe 0 + forward 1 = 160 bytes.
    assert _moves(plan_path(steps, 5, 1)) == ["keyframe:0", "forward:1"]
    # 5 -> 4: undo 5 = 60 bytes vs 100 + 4 * 60.
    assert _moves(plan_path(steps, 5, 4)) == ["backward:5"]
    # 3 -> 1: undo 3,2 = 120 vs 100 + 60 = 160.
    assert _moves(plan_path(steps, 3, 1)) == ["backward:3", "backward:2"]
    tie = _linear(4, kf_bytes=60, delta_bytes=60)
    # 3 -> 1: undo 3,2 = 120 == keyframe 0 + forward 1 = 120: the delta path wins the tie.
    assert _moves(plan_path(tie, 3, 1)) == ["backward:3", "backward:2"]


def test_planner_crosses_a_second_keyframe_through_the_target_lineage():
    steps = _linear(7, keyframes=(3,))
    assert _moves(plan_path(steps, 5, 1)) == ["keyframe:0", "forward:1"]
    assert _moves(plan_path(steps, 1, 5)) == ["keyframe:3", "forward:4", "forward:5"]
    assert _moves(plan_path(steps, 6, 4)) == ["backward:6", "backward:5"]
    assert _moves(plan_path(steps, 2, 3)) == ["keyframe:3"]


def test_planner_raises_step_not_found_on_a_broken_chain():
    steps = _linear(6)
    del steps[2]
    with pytest.raises(StepNotFoundError) as ei:
        plan_path(steps, None, 4)
    assert one_line(ei.value) and "2" in str(ei.value)
    # the held step's own history is broken: it does not need it to restart from a keyframe
    assert _moves(plan_path(steps, 4, 1)) == ["keyframe:0", "forward:1"]
    with pytest.raises(StepNotFoundError):
        plan_path(steps, 1, 9)  # the target itself is not committed
    assert ancestors(steps, 1) == [1, 0]


def test_planner_rejects_a_base_that_is_not_earlier():
    steps = {0: StepInfo(0, None, False, 1), 1: StepInfo(1, 2, True, 1), 2: StepInfo(2, 1, True, 1)}
    with pytest.raises(IntegrityError) as ei:
        plan_path(steps, None, 2)
    assert one_line(ei.value)
    assert isinstance(ei.value, DCRError)
