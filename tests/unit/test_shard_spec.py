"""Shard specs: every placement partitions its canonical tensors, and runs agree with numpy slicing."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_core.errors import UsageError
from dcr_core.shard_spec import (
    BufferParam,
    NamingMap,
    Piece,
    check_partition,
    flat_buffer,
    flat_buffer_size,
    fused_qkv,
    gated_fc1,
    replicate,
    reshard,
    shift_index,
    split,
    split_bounds,
)
from tests.support.shard_helpers import box_view, cut


def test_split_bounds_follow_torch_chunk_semantics():
    import torch

    for size in range(0, 12):
        for world in range(1, 6):
            chunks = torch.arange(size).chunk(world) if size else ()
            got = [split_bounds(size, world, r) for r in range(world)]
            want = [(int(c[0]), int(c[-1]) + 1) for c in chunks] if size else []
            nonempty = [(a, b) for a, b in got if b > a]
            assert nonempty == want
            assert sum(b - a for a, b in got) == size


def test_runs_merge_whole_rows_and_match_slicing():
    p = split("w", (6, 4, 5), {0: (1, 3)})[0]
    c, l, n = p.runs()
    assert (c.tolist(), l.tolist(), n) == ([40], [0], 40)  # two whole rows: one run
    q = split("w", (6, 4, 5), {2: (0, 2)})[0]
    c, l, n = q.runs()
    assert n == 3 and len(c) == 24
    canon = np.arange(120, dtype=np.uint32)
    got = np.concatenate([canon[a : a + n] for a in c])
    assert (got == box_view(canon, q).reshape(-1)).all()


def test_zero_dim_and_empty_tensors():
    p = split("s", (), {})[0]
    assert p.runs()[0].tolist() == [0] and p.runs()[2] == 1
    check_partition(split("e", (0, 3), {0: (0, 2)}) + split("e", (0, 3), {0: (1, 2)}), {"e": (0, 3)})


def test_partition_errors_name_the_tensor():
    a = split("w", (4, 4), {0: (0, 2)})
    with pytest.raises(UsageError, match="'w'.*no piece"):
        check_partition(a, {"w": (4, 4)})
    with pytest.raises(UsageError, match="'w'.*covered twice"):
        check_partition(a + a + split("w", (4, 4), {0: (1, 2)}), {"w": (4, 4)})
    with pytest.raises(UsageError, match="'x'.*not a canonical tensor"):
        check_partition(split("x", (2,), {}), {"w": (4, 4)})


def test_naming_pipeline_and_expert_renames():
    assert shift_index("decoder.layers.3.mlp.weight", "layers", 8) == "decoder.layers.11.mlp.weight"
    assert shift_index("layers.0.experts.1.w1", "experts", 4) == "layers.0.experts.5.w1"
    names = NamingMap((
        (r"decoder\.layers\.(\d+)\.self_attention\.linear_proj\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
        (r"embedding\.word_embeddings\.weight", "model.embed_tokens.weight"),
    ))
    assert names("decoder.layers.7.self_attention.linear_proj.weight") == "model.layers.7.self_attn.o_proj.weight"
    with pytest.raises(UsageError, match="matches no naming rule"):
        names("decoder.final_layernorm.weight")


# ---- every placement partitions, and cut/runs agree -------------------------------------------------

@st.composite
def split_layouts(draw):
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    dims = draw(st.lists(st.integers(0, max(0, ndim - 1)), max_size=min(ndim, 2), unique=True)) if ndim else []
    worlds = {d: draw(st.integers(1, 4)) for d in dims}
    uneven = draw(st.booleans())
    sizes = {}
    if uneven and dims:
        d = dims[0]
        cuts = sorted(draw(st.lists(st.integers(0, shape[d]), min_size=worlds[d] - 1, max_size=worlds[d] - 1)))
        b = [0, *cuts, shape[d]]
        sizes[d] = [y - x for x, y in zip(b, b[1:])]
    ranks = []
    import itertools

    for combo in itertools.product(*[range(worlds[d]) for d in dims]):
        splits = {d: (r, worlds[d]) for d, r in zip(dims, combo)}
        ranks.append(split("t", shape, splits, sizes))
    # optionally a second-level split (FSDP Shard(0) of each shard) along dim 0
    if ndim and draw(st.booleans()):
        fs = draw(st.integers(1, 3))
        ranks = [reshard(pcs, pcs[0].extent, {0: (r, fs)}) for pcs in ranks for r in range(fs)]
    return {"t": shape}, ranks


@given(split_layouts())
@settings(max_examples=150, deadline=None)
def test_splits_partition_and_cut_matches_runs(layout):
    shapes, ranks = layout
    check_partition([p for r in ranks for p in r], shapes)
    canon = {"t": np.arange(math.prod(shapes["t"]), dtype=np.uint32)}
    for pieces in ranks:
        numel = sum(p.numel for p in pieces)
        local = cut(canon, pieces, numel, np.uint32)
        for p in pieces:
            c, l, n = p.runs()
            for a, b in zip(c.tolist(), l.tolist()):
                assert (local[b : b + n] == canon["t"][a : a + n]).all()


@given(
    st.integers(1, 3), st.sampled_from([1, 2, 4]), st.integers(1, 3), st.sampled_from([(), (3,), (5,)]), st.data()
)
@settings(max_examples=60, deadline=None)
def test_fused_qkv_and_gated_fc1_partition(groups_per_rank, hpg, hd, rest, data):
    tp = data.draw(st.integers(1, 3))
    ng = groups_per_rank * tp
    nh = ng * hpg
    pieces = [p for t in range(tp) for p in fused_qkv("q", "k", "v", nh, ng, hd, rest, t, tp)]
    check_partition(pieces, {"q": (nh * hd, *rest), "k": (ng * hd, *rest), "v": (ng * hd, *rest)})
    ffn = data.draw(st.integers(1, 4)) * tp
    g = [p for t in range(tp) for p in gated_fc1("gate", "up", ffn, rest, t, tp)]
    check_partition(g, {"gate": (ffn, *rest), "up": (ffn, *rest)})


def test_fused_qkv_matches_megatron_row_order():
    # 4 heads, 2 groups, head_dim 1, tp 1: rows are q0 q1 k0 v0 q2 q3 k1 v1
    pieces = fused_qkv("q", "k", "v", 4, 2, 1, (), 0, 1)
    canon = {"q": np.array([10, 11, 12, 13], np.uint16), "k": np.array([20, 21], np.uint16), "v": np.array([30, 31], np.uint16)}
    assert cut(canon, pieces, 8, np.uint16).tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    g = gated_fc1("g", "u", 4, (), 1, 2)  # tp rank 1 of 2 holds [g2 g3 u2 u3]
    assert cut({"g": np.arange(4, dtype=np.uint16), "u": np.arange(10, 14, dtype=np.uint16)}, g, 4, np.uint16).tolist() == [2, 3, 12, 13]


@given(st.data())
@settings(max_examples=80, deadline=None)
def test_flat_buffer_ranges_partition(data):
    tp = data.draw(st.integers(1, 2))
    dp = data.draw(st.integers(1, 4))
    align = data.draw(st.sampled_from([1, 4, 64]))
    nparams = data.draw(st.integers(1, 4))
    shapes = {}
    all_pieces = []
    for t in range(tp):
        params = []
        for i in range(nparams):
            shape = tuple(data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)).__iter__())
            shape = shapes.setdefault(f"p{i}", shape)
            dim = data.draw(st.integers(0, len(shape) - 1)) if t == 0 else None
            dim = shapes.setdefault(f"dim{i}", dim)
            pcs = split(f"p{i}", shape, {dim: (t, tp)})
            params.append(BufferParam(f"p{i}", pcs[0].extent, tuple(pcs)))
        for r in range(dp):
            pieces = flat_buffer(params, r, dp, align)
            all_pieces += pieces
            per_rank = flat_buffer_size(params, dp, align) // dp
            for p in pieces:
                lo, hi = p.local_span()
                assert 0 <= lo and hi < per_rank
    check_partition(all_pieces, {k: v for k, v in shapes.items() if k.startswith("p")})


def test_replicate_only_owner_contributes():
    assert replicate("n", (4,), 0) and replicate("n", (4,), 1) == []
    assert replicate("n", (4,), 2, owner=2)


def test_piece_outside_tensor_is_refused():
    with pytest.raises(UsageError, match="outside"):
        Piece("w", (4,), (3,), (2,), 0, (1,))


def test_readme_megatron_layout_partitions_one_pipeline_stage():
    """The README's Megatron example (small sizes): TP x DP flat buffers of fused QKV, gated fc1 and
    row-parallel projections, renamed to global layers, cover the stage's canonical tensors."""
    from dcr_core.shard_spec import rename, shift_index

    tp, dp, nh, ng, hd, H, F, L, stage = 2, 2, 4, 2, 2, 6, 8, 2, 1
    to_global = lambda n: shift_index(n, "layers", stage * L)
    pieces = []
    for t in range(tp):
        params = []
        for i in range(L):
            p = f"model.layers.{i}"
            qkv = fused_qkv(f"{p}.q", f"{p}.k", f"{p}.v", nh, ng, hd, (H,), t, tp)
            fc1 = gated_fc1(f"{p}.gate", f"{p}.up", F, (H,), t, tp)
            o = split(f"{p}.o", (H, nh * hd), {1: (t, tp)})
            down = split(f"{p}.down", (H, F), {1: (t, tp)})
            params += [BufferParam(f"{i}.qkv", ((nh // ng + 2) * hd * ng // tp, H), tuple(rename(qkv, to_global))),
                       BufferParam(f"{i}.proj", (H, nh * hd // tp), tuple(rename(o, to_global))),
                       BufferParam(f"{i}.fc1", (2 * F // tp, H), tuple(rename(fc1, to_global))),
                       BufferParam(f"{i}.fc2", (H, F // tp), tuple(rename(down, to_global)))]
        for d in range(dp):
            pieces += flat_buffer(params, d, dp)
    shapes = {}
    for i in range(stage * L, (stage + 1) * L):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.q": (nh * hd, H), f"{p}.k": (ng * hd, H), f"{p}.v": (ng * hd, H), f"{p}.gate": (F, H),
                   f"{p}.up": (F, H), f"{p}.o": (H, nh * hd), f"{p}.down": (H, F)}
    check_partition(pieces, shapes)


def test_expert_parallel_and_pipeline_renames_partition_the_experts():
    """EP rank e holds local experts 0..E-1 = global e*E..; each expert's w1 is also TP-split."""
    from dcr_core.shard_spec import rename, shift_index

    ep, local, tp = 2, 3, 2
    pieces = []
    for e in range(ep):
        for t in range(tp):
            for j in range(local):
                pcs = split(f"model.layers.0.mlp.experts.{j}.w1", (8, 4), {0: (t, tp)})
                pieces += rename(pcs, lambda n, e=e: shift_index(n, "experts", e * local))
    shapes = {f"model.layers.0.mlp.experts.{x}.w1": (8, 4) for x in range(ep * local)}
    check_partition(pieces, shapes)
    with pytest.raises(UsageError, match="covered twice|no piece"):
        check_partition(pieces + split("model.layers.0.mlp.experts.5.w1", (8, 4), {0: (0, 2)}), shapes)
