"""The auditor's one call: ``dcr_zarr_codec.open_tensor`` (and ``open_step``) reads any tensor of
any committed step by its name, from the commit marker and manifest alone: steps with one object
per chunk (every bucket written before packs) and packed steps (manifest schema 3)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from dcr_zarr_codec import StepDocumentError, StepNotCommittedError, open_step, open_tensor
from dcr_zarr_codec.metadata import DTYPE_BITS
from fsspec.implementations.reference import ReferenceNotReachable

from dcr_core.dtypes import DTYPES
from storage import layout
from tests.support.auditor import PACK_BYTES, check_step_reads, publish_two
from tests.support.helpers import raw_bits


def manifest_of(root: str, step: int) -> dict:
    marker = json.loads(open(os.path.join(root, layout.commit_key(step))).read())
    return json.loads(open(os.path.join(root, layout.manifest_key(step, marker["attempt"]))).read())


def pack_sizes(m: dict) -> list[int]:
    """Each pack's size: the sum of its chunks' (they tile it)."""
    sizes = [0] * len(m["packs"])
    for table in (m["tensors"], m.get("snapshot", {})):
        for e in table.values():
            for p, n in zip(e["chunks"].get("pack", []), e["chunks"]["nbytes"]):
                sizes[p] += n
    return sizes


def test_open_tensor_reads_every_tensor_of_steps_with_one_object_per_chunk(tmp_path):
    root = str(tmp_path / "bucket")
    a, b = publish_two(root, tmp_path, pack_bytes=(0, 0))
    m = manifest_of(root, 1)
    assert m["snapshot"] and m["codec"]["name"] == "dcr.sparse" and "packs" not in m
    group = check_step_reads(root, a, b)
    arrays = {e["array"] for e in m["tensors"].values()} | {e["array"] for e in m["snapshot"].values()}
    assert set(group.array_keys()) == arrays
    assert any(n != e["array"] for n, e in m["tensors"].items())  # escaped names, found by tensor name
    for name, e in m["snapshot"].items():  # the restart point's full copy: the values' bits
        assert np.asarray(group[e["array"]][...]).tobytes() == raw_bits(b[name]).tobytes(), name
        assert group[e["array"]].attrs["dcr"]["snapshot"] is True


def test_open_tensor_reads_a_packed_step(tmp_path):
    root = str(tmp_path / "bucket")
    a, b = publish_two(root, tmp_path)
    packed = [manifest_of(root, step) for step in (0, 1)]
    for step, m in enumerate(packed):  # what a packed step is: packs, no chunk objects, no zarr.json
        assert m["schema_version"] == 3 and len(m["packs"]) > 1
        store = os.path.join(root, layout.store_dir(step, m["attempt"]))
        assert os.listdir(store) == [layout.PACKS]
        assert sorted(os.listdir(os.path.join(store, layout.PACKS))) == m["packs"]
        assert [os.path.getsize(os.path.join(store, layout.pack_key(p))) for p in m["packs"]] == pack_sizes(m)
    tensors = packed[1]["tensors"]
    assert any(e["shape"] == [] and e["chunks"]["indices"] for e in packed[0]["tensors"].values())  # a 0-d tensor
    unstored = [n for n, e in tensors.items() if e["chunks"]["indices"] and len(e["chunks"]["indices"])
                < np.prod([-(-s // c) for s, c in zip(e["shape"], e["chunk_shape"])])]
    assert unstored  # chunks not stored read as zeros: "no change"
    assert any(o > 0 for e in tensors.values() for o in e["chunks"].get("offset", []))
    check_step_reads(root, a, b)
    group = open_step(root, 1)
    for name, e in packed[1]["snapshot"].items():
        assert np.asarray(group[e["array"]][...]).tobytes() == raw_bits(b[name]).tobytes(), name


def test_the_codec_package_knows_every_dtype_dcr_stores():
    assert DTYPE_BITS == {name: d.bits for name, d in DTYPES.items()}


# --------------------------------------------------------------------------------------------------
# bad input: a one-line error naming the object; never zeros in place of a chunk the manifest lists


@pytest.fixture
def packed_root(tmp_path):
    root = str(tmp_path / "bucket")
    publish_two(root, tmp_path, pack_bytes=(0, PACK_BYTES))  # step 0 one object per chunk, step 1 packed
    return root


def rewrite_manifest(root: str, step: int, change) -> None:
    marker = json.loads(open(os.path.join(root, layout.commit_key(step))).read())
    path = os.path.join(root, layout.manifest_key(step, marker["attempt"]))
    m = json.loads(open(path).read())
    change(m)
    open(path, "w").write(json.dumps(m))


def stored_tensor(m: dict) -> tuple[str, dict]:
    return next((n, e) for n, e in sorted(m["tensors"].items()) if e["chunks"]["indices"])


def one_line(err) -> str:
    text = str(err.value)
    assert len(text.splitlines()) == 1, text
    return text


@pytest.mark.faults(component="bad input or damaged bucket", outcome="a one-line error naming the missing commit marker")
def test_a_step_not_committed_is_named(packed_root):
    with pytest.raises(StepNotCommittedError) as err:
        open_tensor(packed_root, 7, "x")
    assert "steps/000000000007/commit.json" in one_line(err) and "not committed" in str(err.value)
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        open_tensor(packed_root, 1, "nope")


@pytest.mark.faults(component="bad input or damaged bucket",
                    outcome="a listed chunk whose object or pack is gone is an error naming it, never zeros")
@pytest.mark.parametrize("packed", [False, True], ids=["chunk-object", "pack"])
def test_a_listed_chunk_that_is_missing_is_an_error_not_zeros(tmp_path, packed):
    root = str(tmp_path / "bucket")
    publish_two(root, tmp_path, pack_bytes=(PACK_BYTES if packed else 0, 0))
    m = manifest_of(root, 0)
    name, e = stored_tensor(m)
    store = os.path.join(root, layout.store_dir(0, m["attempt"]))
    if packed:
        gone = os.path.join(store, layout.pack_key(m["packs"][e["chunks"]["pack"][0]]))
    else:
        grid = [-(-s // c) for s, c in zip(e["shape"], e["chunk_shape"])]
        index = np.unravel_index(e["chunks"]["indices"][0], grid) if grid else ()
        gone = os.path.join(store, e["array"], "c", *map(str, index))
    os.remove(gone)
    with pytest.raises(ReferenceNotReachable) as err:
        open_tensor(root, 0, name)[...]
    assert gone.removeprefix(root) in one_line(err)


def _hostile(root, change, match: str):
    rewrite_manifest(root, 1, change)
    with pytest.raises(StepDocumentError, match=match) as err:
        open_step(root, 1)
    one_line(err)
    assert "manifest.json" in str(err.value)


@pytest.mark.faults(component="security", outcome="a name from the manifest that would leave its place in ROOT is refused, naming the manifest")
@pytest.mark.parametrize("field", ["array", "pack"])
def test_names_that_would_leave_the_attempt_are_refused(packed_root, field):
    def change(m):
        if field == "array":
            stored_tensor(m)[1]["array"] = "../../../000000000000/x"
        else:
            m["packs"][0] = "../../../000000000000/attempts/x"

    _hostile(packed_root, change, {"array": "not a safe path segment", "pack": "is not <8 hex digits>.<6 digits>"}[field])


@pytest.mark.faults(component="security", outcome="a commit marker naming an attempt outside its step is refused, naming the marker")
def test_a_marker_naming_an_attempt_outside_its_step_is_refused(packed_root):
    path = os.path.join(packed_root, layout.commit_key(1))
    marker = json.loads(open(path).read())
    marker["attempt"] = "../../000000000000/attempts/" + marker["attempt"]
    open(path, "w").write(json.dumps(marker))
    with pytest.raises(StepDocumentError, match="not 16-64 lowercase hex digits") as err:
        open_tensor(packed_root, 1, "BF16.mat")
    assert "steps/000000000001/commit.json" in one_line(err)


@pytest.mark.faults(component="bad input or damaged bucket", outcome="a chunk range outside its pack, or a pack not listed, is refused naming the manifest")
@pytest.mark.parametrize("damage", ["offset", "pack", "packs", "index", "json", "codec", "chunk"])
def test_damaged_packed_manifests_are_refused(packed_root, damage):
    def change(m):
        e = stored_tensor(m)[1]["chunks"]
        if damage == "offset":  # the chunk starts where its pack ends
            e["offset"][0] = pack_sizes(m)[e["pack"][0]]
        elif damage == "pack":
            e["pack"][0] = len(m["packs"])
        elif damage == "packs":  # packs as objects, not names
            m["packs"] = [{"name": p, "bytes": n} for p, n in zip(m["packs"], pack_sizes(m))]
        elif damage == "index":
            e["indices"][0] = 10**9
        elif damage == "codec":
            m["codec"] = {"name": "lz4-of-the-future"}
        elif damage == "chunk":  # zarr would allocate a whole chunk: 8 GiB
            stored_tensor(m)[1]["chunk_shape"] = [1 << 33] * len(stored_tensor(m)[1]["shape"])
        else:
            m["tensors"] = "x"

    _hostile(packed_root, change, {"offset": "ends at byte", "pack": "chunks pack: expected an integer",
                                   "packs": "pack name", "index": "index", "json": "tensors",
                                   "codec": "lz4-of-the-future", "chunk": "exceeds"}[damage])
