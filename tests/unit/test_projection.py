"""Projection: every rank's projected XOR, combined, equals the XOR of the canonical tensors."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_core.chunking import ChunkGrid, choose_chunk_shape
from dcr_core.conversion import cast, offset
from dcr_core.errors import UsageError
from dcr_core.projection import ShardBits, project
from dcr_core.shard_spec import BufferParam, flat_buffer, flat_buffer_size, fused_qkv, gated_fc1, reshard, split
from tests.support.shard_helpers import combine, cut, random_bits

DTYPES = [np.uint8, np.uint16, np.uint32, np.uint64]


@st.composite
def layouts(draw):
    """(canonical shapes, per-rank list of (pieces, local numel)) for a random placement."""
    kind = draw(st.sampled_from(["split", "qkv", "fc1", "flat"]))
    if kind == "split":
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
        dims = draw(st.lists(st.integers(0, ndim - 1), max_size=min(ndim, 2), unique=True)) if ndim else []
        worlds = {d: draw(st.integers(1, 4)) for d in dims}
        ranks = []
        for combo in itertools.product(*[range(worlds[d]) for d in dims]):
            pcs = split("t", shape, {d: (r, worlds[d]) for d, r in zip(dims, combo)})
            if ndim and draw(st.booleans()):
                fs = draw(st.integers(1, 3))
                ranks += [reshard(pcs, pcs[0].extent, {0: (r, fs)}) for r in range(fs)]
            else:
                ranks.append(pcs)
        return {"t": shape}, [(r, sum(p.numel for p in r)) for r in ranks]
    if kind in ("qkv", "fc1"):
        tp = draw(st.integers(1, 3))
        rest = draw(st.sampled_from([(), (3,), (7,), (2, 3)]))
        if kind == "qkv":
            ng = draw(st.integers(1, 2)) * tp
            hpg, hd = draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 3))
            nh = ng * hpg
            shapes = {"q": (nh * hd, *rest), "k": (ng * hd, *rest), "v": (ng * hd, *rest)}
            ranks = [fused_qkv("q", "k", "v", nh, ng, hd, rest, t, tp) for t in range(tp)]
        else:
            ffn = draw(st.integers(1, 5)) * tp
            shapes = {"g": (ffn, *rest), "u": (ffn, *rest)}
            ranks = [gated_fc1("g", "u", ffn, rest, t, tp) for t in range(tp)]
        return shapes, [(r, sum(p.numel for p in r)) for r in ranks]
    # distributed-optimizer flat buffers over TP shards (splits along any dim, fused QKV), DP ranks
    dp, tp = draw(st.integers(1, 4)), draw(st.integers(1, 2))
    align = draw(st.sampled_from([1, 8, 64]))
    nparams = draw(st.integers(1, 4))
    shapes = {}
    specs = []
    for i in range(nparams):
        shape = tuple(draw(st.lists(st.integers(1, 12), min_size=1, max_size=3)))
        specs.append((shape, draw(st.integers(0, len(shape) - 1))))
        shapes[f"p{i}"] = shape
    with_qkv = draw(st.booleans())
    if with_qkv:
        shapes |= {"q": (4 * 2, 3), "k": (2 * 2, 3), "v": (2 * 2, 3)}
    ranks = []
    for t in range(tp):
        params = []
        for i, (shape, dim) in enumerate(specs):
            pcs = split(f"p{i}", shape, {dim: (t, tp)})
            params.append(BufferParam(f"p{i}", pcs[0].extent, tuple(pcs)))
        if with_qkv:
            qkv = fused_qkv("q", "k", "v", 4, 2, 2, (3,), t, tp)
            params.append(BufferParam("qkv", (sum(p.numel for p in qkv) // 3, 3), tuple(qkv)))
        per = flat_buffer_size(params, dp, align) // dp
        ranks += [(flat_buffer(params, r, dp, align), per) for r in range(dp)]
    return shapes, ranks


@given(layouts(), st.sampled_from(DTYPES), st.integers(1, 64), st.booleans(), st.integers(0, 2**32 - 1))
@settings(max_examples=120, deadline=None)
def test_projected_xors_combine_to_canonical_xor(layout, dtype, chunk_bytes, keyframe, seed):
    shapes, ranks = layout
    rng = np.random.default_rng(seed)
    itemsize = np.dtype(dtype).itemsize
    grids = {n: ChunkGrid(s, choose_chunk_shape(s, itemsize, chunk_bytes)) for n, s in shapes.items()}
    dtypes = {n: np.dtype(dtype) for n in shapes}
    new = {n: random_bits(rng, math.prod(s), dtype) for n, s in shapes.items()}
    base = {}
    for n, b in new.items():  # a sparse change: some elements flipped
        b = b.copy()
        flip = rng.random(b.size) < 0.3
        b[flip] ^= np.array(rng.integers(1, 255), dtype=dtype)
        base[n] = b
    contributions = []
    owners: dict[tuple[str, int], int] = {}
    for pieces, numel in ranks:
        sb = ShardBits(tuple(pieces), cut(new, pieces, numel, dtype), None if keyframe else cut(base, pieces, numel, dtype))
        for c in project([sb], grids, dtypes):
            assert c.payload.shape == (grids[c.name].chunk_range(c.index)[1] - grids[c.name].chunk_range(c.index)[0],)
            if c.owner:
                assert (c.name, c.index) not in owners
                owners[(c.name, c.index)] = 1
            contributions.append(c)
    # an owned chunk has no other contributor
    for c in contributions:
        if not c.owner:
            assert (c.name, c.index) not in owners
    got = combine(contributions, grids, dtypes)
    for n in shapes:
        want = new[n] if keyframe else new[n] ^ base[n]
        assert got[n].tobytes() == want.tobytes(), n


def test_several_shards_of_one_rank_and_bad_input():
    shape = (8, 6)
    g = {"t": ChunkGrid(shape, (2, 6))}
    d = {"t": np.dtype(np.uint16)}
    rng = np.random.default_rng(0)
    new = {"t": random_bits(rng, 48, np.uint16)}
    a, b = split("t", shape, {1: (0, 2)}), split("t", shape, {1: (1, 2)})
    shards = [ShardBits(tuple(p), cut(new, p, 24, np.uint16)) for p in (a, b)]
    out = list(project(shards, g, d))
    assert all(c.owner for c in out)  # one rank with both halves owns every chunk
    assert combine(out, g, d)["t"].tobytes() == new["t"].tobytes()
    with pytest.raises(UsageError, match="overlap"):
        list(project(shards + shards[:1], g, d))
    with pytest.raises(UsageError, match="baseline"):
        list(project([shards[0], ShardBits(shards[1].pieces, shards[1].new, shards[1].new)], g, d))


def test_conversions_commute_with_placement():
    """Cast FP32 master -> BF16 and offset (norm kept as w-1) per shard == on the gathered tensor."""
    torch.manual_seed(0)
    master = torch.randn(10, 6) * 1e-2
    master.view(torch.int32)[0, 0] = 0x7FC00123  # a NaN payload, -0.0 and a subnormal
    master.view(torch.int32)[0, 1] = -(2**31)
    master.view(torch.int32)[0, 2] = 0x00000007
    for conv in (cast(torch.bfloat16), offset(1.0, torch.bfloat16)):
        want = conv(master).view(torch.uint16).numpy().reshape(-1)
        g = {"t": ChunkGrid((10, 6), (3, 6))}
        d = {"t": np.dtype(np.uint16)}
        contributions = []
        for t in range(3):
            pcs = split("t", (10, 6), {0: (t, 3)})
            lo, hi = pcs[0].start[0], pcs[0].start[0] + pcs[0].extent[0]
            local = conv(master[lo:hi].clone()).view(torch.uint16).numpy().reshape(-1)
            contributions += list(project([ShardBits(tuple(pcs), local)], g, d))
        assert combine(contributions, g, d)["t"].tobytes() == want.tobytes()
