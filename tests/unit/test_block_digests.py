"""Block digests (``dcr_core.digest``: manifest schema 2) and the sidecar file that keeps them."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from dcr_core.digest import (
    BLOCKS,
    FLAT,
    BlockHasher,
    DigestScheme,
    block_count,
    block_leaves,
    blocks_root,
    tensor_digest,
)
from dcr_core.errors import IntegrityError
from storage.local import sidecar


@pytest.mark.parametrize("dtype", ["<u1", "<u2", "<u4", "<u8"])
@pytest.mark.parametrize("n", [0, 1, 511, 512, 513, 4096 * 3 + 7])
def test_block_digests_fed_in_any_pieces_equal_hashing_at_once(dtype, n):
    rng = np.random.default_rng(n)
    bits = rng.integers(0, 255, n * np.dtype(dtype).itemsize, np.uint8).view(dtype)
    block = 1024
    whole = block_leaves(bits, block)
    assert whole.shape == (block_count(bits.nbytes, block), 32)
    for _ in range(3):
        h = BlockHasher(block)
        cuts = sorted(rng.integers(0, n + 1, 5).tolist()) if n else []
        for a, b in zip([0, *cuts], [*cuts, n]):
            h.update(bits[a:b])
        assert np.array_equal(h.leaves(), whole)
        assert h.hexdigest() == blocks_root(block, whole) == DigestScheme(block).digest(bits)
    for i in range(whole.shape[0]):  # each block digest is BLAKE3 of its bytes
        raw = bits.view(np.uint8)[i * block : (i + 1) * block]
        assert whole[i].tobytes().hex() == tensor_digest(raw)


def test_a_single_flipped_bit_anywhere_changes_the_block_digest():
    bits = np.arange(3000, dtype="<u2")
    d0 = DigestScheme(4096).digest(bits)
    for pos in (0, 2047, 2048, 2999):
        for b in (0, 15):
            flipped = bits.copy()
            flipped[pos] ^= 1 << b
            assert DigestScheme(4096).digest(flipped) != d0
    # the scheme and its block size are bound: another block size, or flat digests, differ
    assert DigestScheme(8192).digest(bits) != d0 != FLAT.digest(bits) == tensor_digest(bits)
    assert blocks_root(4096, np.zeros((0, 32), np.uint8)) != blocks_root(8192, np.zeros((0, 32), np.uint8))


def _manifest_dict(**over):
    from dcr_core.codec import CodecSpec
    from dcr_core.delta import Encoding
    from storage.manifest import ChunkTable, Manifest, TensorEntry

    bits = np.arange(100, dtype="<u2")
    scheme = over.pop("scheme", BLOCKS)
    e = TensorEntry("w", "BF16", (100,), scheme.digest(bits), Encoding.FULL, "w", (100,),
                    ChunkTable((0,), ("0" * 64,), (10,)), scheme=scheme)
    from dcr_core.digest import policy_digest

    m = Manifest(0, "keyframe", None, None, policy_digest([("w", "BF16", (100,), e.digest)]), "a" * 32,
                 CodecSpec(), 1 << 20, {"w": e}, digest_scheme=scheme)
    return json.loads(m.to_json()) | over, bits


def test_manifests_name_their_scheme_and_old_ones_stay_readable():
    from storage.manifest import Manifest

    d, bits = _manifest_dict()
    assert d["schema_version"] == 2 and d["digest_scheme"] == {"name": "dcr-blocks-v1", "block_bytes": 1 << 20}
    m = Manifest.from_dict(d, "m")
    assert m.tensors["w"].scheme == BLOCKS and m.tensors["w"].matches(bits)
    old, _ = _manifest_dict(scheme=FLAT)  # what DCR wrote before block digests
    assert old["schema_version"] == 1 and "digest_scheme" not in old
    assert Manifest.from_dict(old, "m").tensors["w"].matches(bits)
    assert not Manifest.from_dict(old, "m").tensors["w"].matches(bits[::-1].copy())
    for bad, why in [({"digest_scheme": None}, "digest_scheme must be"),
                     ({"digest_scheme": {"name": "other", "block_bytes": 4096}}, "digest_scheme must be"),
                     ({"digest_scheme": {"name": "dcr-blocks-v1", "block_bytes": 4100}}, "multiple of 8"),
                     ({"digest_scheme": {"name": "dcr-blocks-v1", "block_bytes": 16}}, "block_bytes"),
                     ({"schema_version": 5}, "schema_version 5 is not supported"),
                     ({"schema_version": True}, "not supported")]:
        with pytest.raises(IntegrityError, match=why):
            Manifest.from_dict(d | bad, "m")
    with pytest.raises(IntegrityError, match="schema 1 manifest has flat digests"):
        Manifest.from_dict(old | {"digest_scheme": d["digest_scheme"]}, "m")
    # a block digest under a flat manifest (or the reverse) fails the tensor's check, not silently
    assert not Manifest.from_dict(old | {"tensors": d["tensors"], "policy_digest": d["policy_digest"]},
                                  "m").tensors["w"].matches(bits)


def test_a_sidecar_is_refused_when_torn_damaged_or_of_another_file(tmp_path):
    state = tmp_path / "s.safetensors"
    state.write_bytes(b"x" * 100)
    leaves = {"a": np.arange(64, dtype=np.uint8).reshape(2, 32), "b": np.zeros((0, 32), np.uint8)}
    sidecar.write(str(state), sidecar.Sidecar(3, "p" * 64, 4096, leaves))
    got = sidecar.load(str(state), 3, "p" * 64, 4096)
    assert got is not None and np.array_equal(got.leaves["a"], leaves["a"]) and got.leaves["b"].shape == (0, 32)
    assert sidecar.load(str(state), 4, "p" * 64, 4096) is None  # another step
    assert sidecar.load(str(state), 3, "q" * 64, 4096) is None  # another policy
    assert sidecar.load(str(state), 3, "p" * 64, 8192) is None  # another block size
    path = sidecar.sidecar_path(str(state))
    data = open(path, "rb").read()
    for torn in (data[:-1], data[: len(data) // 2], b"", bytes([data[0] ^ 1]) + data[1:],
                 data[:40] + bytes([data[40] ^ 1]) + data[41:]):
        open(path, "wb").write(torn)
        assert sidecar.load(str(state), 3, "p" * 64, 4096) is None
    open(path, "wb").write(data)
    assert sidecar.load(str(state), 3, "p" * 64, 4096) is not None
    with open(state, "r+b") as f:  # the same bytes written again: the change time moves
        f.write(b"x")
    assert sidecar.load(str(state), 3, "p" * 64, 4096) is None


def test_sampled_blocks_are_spread_over_every_block():
    sc = sidecar.Sidecar(0, "p", 4096, {"a": np.zeros((3, 32), np.uint8), "b": np.zeros((5, 32), np.uint8),
                                        "c": np.zeros((1, 32), np.uint8)})
    sizes = {"a": 3 * 4096, "b": 5 * 4096 - 1, "c": 4096 * 7}  # c's size disagrees: never sampled
    seen = set()
    for seed in range(200):
        picks = sidecar.sample(sc, sizes, 3, random.Random(seed))
        assert len(picks) == 3 == len(set(picks))
        seen.update(picks)
    assert seen == {("a", i) for i in range(3)} | {("b", i) for i in range(5)}
    assert len(sidecar.sample(sc, sizes, 100)) == 8
