"""The sparse XOR-mask codec: exact round trips, strict decoding, and stock zarr reading it."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from dcr_zarr_codec import metadata, zarr_codec
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_core.codec import CodecSpec
from dcr_core.errors import IntegrityError
from dcr_core.sparse import DENSE_ABOVE, decode_sparse, encode_sparse
from flows import run_publish
from flows.options import PublishOptions
from storage.catalog import Catalog
from storage.root import Root

DTYPES = [np.dtype("<u1"), np.dtype("<u2"), np.dtype("<u4"), np.dtype("<u8")]


def _mask(dtype, n, density, seed):
    rng = np.random.default_rng(seed)
    m = np.zeros(n, dtype=dtype)
    hit = rng.random(n) < density
    info = np.iinfo(dtype)
    m[hit] = rng.integers(1, info.max, size=int(hit.sum()), dtype=dtype, endpoint=True)
    return m


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 5000),
    density=st.sampled_from([0.0, 0.0005, 0.01, 0.05, DENSE_ABOVE, 0.3, 0.9, 1.0]),
    seed=st.integers(0, 2**31),
    level=st.sampled_from([1, 3]),
)
def test_every_mask_round_trips_bit_exactly(dtype, n, density, seed, level):
    m = _mask(dtype, n, density, seed)
    out = decode_sparse(encode_sparse(m, level), dtype, n)
    assert out.dtype == dtype and out.tobytes() == m.tobytes()


def test_encoding_is_deterministic_and_sparse_masks_are_small():
    m = _mask(np.dtype("<u2"), 1 << 20, 0.02, 1)
    a, b = encode_sparse(m, 1), encode_sparse(m, 1)
    assert a == b
    changed = np.count_nonzero(m)
    assert len(a) < 4 * changed  # positions + values, far below 2 B x every element


def test_first_and_last_elements_and_all_bit_patterns_survive():
    m = np.zeros(1000, dtype=np.uint16)
    m[[0, 1, 998, 999]] = [0xFFFF, 0x8000, 0x0001, 0x7FC1]
    assert decode_sparse(encode_sparse(m), np.uint16, 1000).tobytes() == m.tobytes()


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d[:-1],  # truncated
        lambda d: d + b"\0",  # trailing bytes
        lambda d: b"XXXX" + d[4:],  # bad magic
        lambda d: d[:16] + (10**9).to_bytes(8, "little") + d[24:],  # claims more changes than elements
    ],
    ids=["truncated", "trailing", "magic", "count"],
)
def test_hostile_frames_are_refused_before_allocation(mutate):
    m = _mask(np.dtype("<u2"), 4096, 0.05, 2)
    with pytest.raises(IntegrityError):
        decode_sparse(mutate(encode_sparse(m)), np.uint16, 4096)


def test_a_frame_for_another_size_or_width_is_refused():
    data = encode_sparse(_mask(np.dtype("<u2"), 100, 0.1, 3))
    with pytest.raises(IntegrityError):
        decode_sparse(data, np.uint16, 101)
    with pytest.raises(IntegrityError):
        decode_sparse(data, np.uint32, 100)


def test_codec_spec_reads_manifests_written_before_the_sparse_codec():
    assert CodecSpec.from_dict({"cname": "zstd", "clevel": 3, "shuffle": "shuffle"}).name == "blosc"


def test_sparse_codec_block_lists_only_what_the_codec_uses():
    spec = CodecSpec(name="dcr.sparse", clevel=2)
    assert spec.to_dict() == {"name": "dcr.sparse", "clevel": 2}
    assert CodecSpec.from_dict(spec.to_dict()) == spec
    # manifests written before listed Blosc's fields too: they still read
    old = {"name": "dcr.sparse", "cname": "zstd", "clevel": 2, "shuffle": "shuffle", "blocksize": 0}
    assert CodecSpec.from_dict(old) == spec


@pytest.mark.parametrize("former,name", [("dcr-sparse", "dcr.sparse"), ("dcr-cond", "dcr.cond")])
def test_a_codec_block_with_the_former_name_reads_as_the_codec_and_is_written_with_its_one_name(former, name):
    """Manifests written before the codecs had one name each said ``dcr-sparse`` / ``dcr-cond``:
    they read as the same codec, for DCR and for the step reader's Zarr documents alike."""
    spec = CodecSpec.from_dict({"name": former, "clevel": 2})
    assert spec == CodecSpec(name=name, clevel=2) == CodecSpec(name=former, clevel=2)
    assert spec.to_dict() == {"name": name, "clevel": 2}
    assert metadata.compressor({"name": former, "clevel": 2}, 2) == {"name": name, "configuration": {"level": 2}}


def test_the_zarr_codecs_are_registered_under_the_names_dcr_writes():
    entry_points = {e.name for e in importlib.metadata.entry_points(group="zarr.codecs")}
    assert {metadata.SPARSE_CODEC, metadata.COND_CODEC} <= entry_points
    assert (zarr_codec.DcrSparseCodec().to_dict()["name"], zarr_codec.DcrCondCodec().to_dict()["name"]) == (
        metadata.SPARSE_CODEC, metadata.COND_CODEC)


def test_stock_zarr_reads_sparse_delta_arrays_through_the_installed_entry_point(tmp_path):
    root = str(tmp_path / "bucket")
    g = torch.Generator().manual_seed(0)
    old = {"w": torch.randn(300, 70, generator=g).bfloat16()}
    new = {"w": old["w"].clone()}
    new["w"].view(-1).view(torch.int16)[::37] ^= 3
    # one object per chunk and a zarr.json per array: what zarr opens by path (a packed step opens
    # through dcr_zarr_codec.open_tensor, tests/integration/test_open_step.py)
    opts = PublishOptions(chunk_bytes=4096, cache_dir=str(tmp_path / "c"), pack_bytes=0)
    run_publish(root, old, 0, options=opts)
    run_publish(root, new, 1, options=opts)
    m = Catalog(Root(root)).manifest(1)
    assert m.codec.name == "dcr.sparse"
    store = tmp_path / "bucket" / "steps" / "000000000001" / "attempts" / m.attempt / "data.zarr"
    # a fresh interpreter that imports nothing of this project: zarr finds the codec by entry point
    code = (
        "import sys, zarr, json; g = zarr.open_group(sys.argv[1], mode='r');"
        "a = g['w'][...]; print(json.dumps([a.dtype.str, list(a.shape), a.tobytes().hex()]))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(store)], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    dtype, shape, hexbytes = json.loads(out.stdout)
    expect = (old["w"].view(torch.int16) ^ new["w"].view(torch.int16)).numpy().astype("<u2")
    assert dtype == "<u2" and shape == [300, 70]
    assert bytes.fromhex(hexbytes) == expect.tobytes()
