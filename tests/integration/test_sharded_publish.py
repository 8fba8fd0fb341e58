"""Publishing from training shards: receivers get exactly the canonical checkpoint, every step.

The canonical checkpoints here are "nasty" (NaN payloads, signed zeros, infinities, subnormals,
0-d and empty tensors); the test cuts them into shards with plain numpy slicing (tests/shard_helpers),
publishes from the shards only, and compares what receivers hold with the canonical tensors, raw
bytes.
"""

from __future__ import annotations

import glob
import json
import os
import threading

import numpy as np
import pytest
import torch
import zarr
from dcr_zarr_codec import open_step

from dcr_core.bits import bits_of
from dcr_core.errors import DCRError, IntegrityError, StateMismatchError
from dcr_core.shard_spec import BufferParam, flat_buffer, flat_buffer_size, fused_qkv, gated_fc1, replicate, split
from flows import local_refs, receive_into_module, run_materialize, run_publish, run_receive
from flows.maintenance import audit
from flows.maintenance.mirror import run_mirror
from flows.options import DELTA_CODECS, PublishOptions
from flows.publish import ranks
from flows.publish.shard_baseline import load_shard_baseline
from flows.publish.shards import Shard, ShardedSource
from storage import layout
from storage.catalog import Catalog
from storage.root import Root, RootRef
from tests.support.fused_module import TinyFused
from tests.support.helpers import assert_bits_equal, damage_chunk, from_bits, nasty_tensor, next_step, read_state
from tests.support.shard_helpers import cut

TP, DP = 2, 2
NH, NG, HD, H, FFN = 4, 2, 3, 5, 6


def canonical(seed: int = 0) -> dict[str, torch.Tensor]:
    t = {
        "m.q_proj.weight": nasty_tensor("BF16", (NH * HD, H), seed, "q"),
        "m.k_proj.weight": nasty_tensor("BF16", (NG * HD, H), seed, "k"),
        "m.v_proj.weight": nasty_tensor("BF16", (NG * HD, H), seed, "v"),
        "m.gate_proj.weight": nasty_tensor("BF16", (FFN, H), seed, "g"),
        "m.up_proj.weight": nasty_tensor("BF16", (FFN, H), seed, "u"),
        "m.o_proj.weight": nasty_tensor("BF16", (H, NH * HD), seed, "o"),
        "m.embed.weight": nasty_tensor("BF16", (7, H), seed, "e"),
        "m.norm.weight": nasty_tensor("F32", (H,), seed, "n"),
        "m.scale": nasty_tensor("I8", (), seed, "s"),
        "m.empty": nasty_tensor("F16", (0, 3), seed, "z"),
        "m.fsdp.weight": nasty_tensor("F32", (5, 3), seed, "f"),
    }
    return t


def rank_pieces(tp: int, dp: int) -> list[tuple[str, object, list]]:
    """(shard name, dtype, pieces) of rank (tp, dp): a BF16 distributed-optimizer flat buffer over
    the TP shards of fused QKV (GQA), gated fc1, row-parallel o_proj and an uneven vocab split, plus
    replicated and FSDP-style (``Shard(0)`` over all 4 ranks) tensors."""
    params = [
        BufferParam("qkv", ((NH // NG + 2) * HD * NG // TP, H), tuple(fused_qkv(
            "m.q_proj.weight", "m.k_proj.weight", "m.v_proj.weight", NH, NG, HD, (H,), tp, TP))),
        BufferParam("fc1", (2 * FFN // TP, H), tuple(gated_fc1("m.gate_proj.weight", "m.up_proj.weight", FFN, (H,), tp, TP))),
    ]
    o = split("m.o_proj.weight", (H, NH * HD), {1: (tp, TP)})
    params.append(BufferParam("o", o[0].extent, tuple(o)))
    e = split("m.embed.weight", (7, H), {0: (tp, TP)})
    params.append(BufferParam("embed", e[0].extent, tuple(e)))
    rank = tp * DP + dp
    out = [("buffer", "BF16", flat_buffer(params, dp, DP, align=8), flat_buffer_size(params, DP, align=8) // DP)]
    out.append(("norm", "F32", replicate("m.norm.weight", (H,), rank), H if rank == 0 else 0))
    out.append(("scale", "I8", replicate("m.scale", (), rank), 1 if rank == 0 else 0))
    out.append(("empty", "F16", split("m.empty", (0, 3), {0: (rank, TP * DP)}), 0))
    f = split("m.fsdp.weight", (5, 3), {0: (rank, TP * DP)})
    out.append(("fsdp", "F32", f, f[0].numel))
    return out


def sources(ckpt: dict[str, torch.Tensor]) -> list[ShardedSource]:
    bits = {n: bits_of(t) for n, t in ckpt.items()}
    out = []
    for tp in range(TP):
        for dp in range(DP):
            rank = tp * DP + dp
            shards = []
            for name, dtype, pieces, numel in rank_pieces(tp, dp):
                storage = bits[pieces[0].name].dtype if pieces else np.dtype(np.uint8)
                local = cut(bits, pieces, numel, storage) if pieces else np.zeros(0, dtype=np.uint8)
                if not pieces:
                    continue
                shards.append(Shard(name, from_bits(local, dtype, (numel,)), pieces))
            out.append(ShardedSource(shards, rank=rank, world=TP * DP))
    return out


@pytest.fixture
def opts(tmp_path):
    return PublishOptions(chunk_bytes=32, cache_dir=str(tmp_path / "cache"))


def test_sharded_steps_reach_receivers_bit_exact(tmp_path, opts):
    root = str(tmp_path / "bucket")
    steps = [canonical(1)]
    for i in range(1, 4):
        steps.append(next_step(steps[-1], 100 + i, fraction=0.1, unchanged=0.1))
    state = str(tmp_path / "r0.safetensors")
    for n, ck in enumerate(steps):
        res = run_publish(root, sources(ck), n, options=opts)
        assert res.kind == ("keyframe" if n == 0 else "delta")
        run_receive(root, "r0", state)
        assert_bits_equal(read_state(state), ck)
    m = Catalog(Root(root)).manifest(3)
    assert any(e.parts is not None for e in m.tensors.values())  # shared chunks were stored as parts
    assert all(e.pieces is not None for e in m.tensors.values())
    # a receiver that starts late, then steps backward (XOR masks are self-inverse)
    late = str(tmp_path / "late.safetensors")
    run_receive(root, "late", late, step=3)
    assert_bits_equal(read_state(late), steps[3])
    run_receive(root, "late", late, step=1)
    assert_bits_equal(read_state(late), steps[1])
    run_materialize(root, 2, str(tmp_path / "full2.safetensors"))
    assert_bits_equal(read_state(tmp_path / "full2.safetensors"), steps[2])
    report = audit.verify(Root(root), deep=True)
    assert not report.errors, report.errors


@pytest.mark.parametrize("packed", [False, True], ids=["per-object", "packed"])
def test_stock_zarr_reads_main_and_parts(tmp_path, opts, packed):
    """An unpacked step is a Zarr store stock zarr opens; a packed one has no ``zarr.json`` and is
    read through the auditor's ``open_step``, its parts from the ranks' packs too."""
    root = str(tmp_path / "bucket")
    a = canonical(2)
    b = next_step(a, 7, fraction=0.5, unchanged=0.0)
    opts = opts.model_copy(update={"pack_bytes": 256 if packed else 0})
    run_publish(root, sources(a), 0, options=opts)
    run_publish(root, sources(b), 1, options=opts)
    m = Catalog(Root(root)).manifest(1)
    store = glob.glob(f"{root}/steps/000000000001/attempts/{m.attempt}/data.zarr")[0]
    assert bool(m.packs()) == packed and any(e.parts is not None and e.parts.packs for e in m.tensors.values()) == packed
    assert bool(glob.glob(f"{store}/**/zarr.json", recursive=True)) != packed
    checked = 0
    for g in [open_step(root, 1)] + ([] if packed else [zarr.open_group(store, mode="r")]):
        for name, e in m.tensors.items():
            if e.parts is None:
                continue
            mask = g[e.array][...] ^ np.bitwise_xor.reduce(g[e.parts.array][...], axis=0)
            want = (bits_of(b[name]) ^ bits_of(a[name])).reshape(e.shape)
            assert mask.tobytes() == want.tobytes(), name
            checked += 1
    assert checked


def test_fused_qkv_gqa_and_gated_mlp_round_trip_into_a_live_module(tmp_path, opts):
    """Megatron fused QKV (GQA) and gated fc1 shards -> canonical q/k/v, gate/up -> a vLLM-style
    module whose load_weights fuses them again: bits equal a dense load of the canonical checkpoint."""
    root = str(tmp_path / "bucket")
    hidden, kv, inter, tp = 8, 4, 12, 2
    nh, ng, hd = 4, 2, 2  # q: 8 rows, k/v: 4 rows

    def srcs(ck):
        bits = {n: bits_of(t) for n, t in ck.items()}
        out = []
        for t in range(tp):
            qkv = fused_qkv("layer.q_proj.weight", "layer.k_proj.weight", "layer.v_proj.weight", nh, ng, hd, (hidden,), t, tp)
            fc1 = gated_fc1("layer.gate_proj.weight", "layer.up_proj.weight", inter, (hidden,), t, tp)
            shards = [
                Shard("qkv", from_bits(cut(bits, qkv, sum(p.numel for p in qkv), np.uint16), "BF16", (sum(p.numel for p in qkv) // hidden, hidden)), qkv),
                Shard("fc1", from_bits(cut(bits, fc1, sum(p.numel for p in fc1), np.uint16), "BF16", (inter, hidden)), fc1),
            ]
            for name in ("layer.norm.weight", "rotary.inv_freq"):
                pcs = replicate(name, tuple(ck[name].shape), t)
                if pcs:
                    shards.append(Shard(name, ck[name].clone(), pcs))
            out.append(ShardedSource(shards, rank=t, world=tp))
        return out

    ckpts = [TinyFused.checkpoint(0, hidden, kv, inter)]
    ckpts.append(next_step(ckpts[0], 5, fraction=0.2, unchanged=0.0))
    target = TinyFused(hidden, kv, inter)
    for n, ck in enumerate(ckpts):
        run_publish(root, srcs(ck), n, options=opts)
        receive_into_module(root, "mod", target, state_path=str(tmp_path / "mirror.safetensors"))
        dense = TinyFused(hidden, kv, inter)
        dense.load_weights(ck.items())
        assert_bits_equal(dict(target.named_parameters()) | dict(target.named_buffers()),
                          dict(dense.named_parameters()) | dict(dense.named_buffers()))


def test_lost_shard_baselines_are_rebuilt_from_root_chunk_by_chunk(tmp_path, opts):
    """No cache (another machine, --no-cache) or a tampered one: each rank rebuilds its shard of the
    base step from the stored chunks (main and parts) along the chain, and the delta is exact."""
    root, state = str(tmp_path / "bucket"), str(tmp_path / "s.safetensors")
    steps = [canonical(3)]
    for i in range(1, 4):
        steps.append(next_step(steps[-1], 40 + i, fraction=0.2, unchanged=0.1))
    run_publish(root, sources(steps[0]), 0, options=opts)
    run_publish(root, sources(steps[1]), 1, options=opts)
    other = PublishOptions(chunk_bytes=32, cache_dir=str(tmp_path / "elsewhere"))
    run_publish(root, sources(steps[2]), 2, options=other)  # empty cache: rebuilt over keyframe + 1 delta
    # tamper with a cached baseline: it fails its piece digests and is rebuilt
    for f in glob.glob(str(tmp_path / "elsewhere" / "*" / "shards-rank0-*.safetensors")):
        data = bytearray(open(f, "rb").read())
        data[-3] ^= 0x10
        open(f, "wb").write(bytes(data))
    res = run_publish(root, sources(steps[3]), 3, options=other)
    assert res.kind == "delta"
    for n in (2, 3):
        run_receive(root, "r", state, step=n)
        assert_bits_equal(read_state(state), steps[n])
    no_cache = PublishOptions(chunk_bytes=32, cache_dir=str(tmp_path / "elsewhere"), use_cache=False)
    for src in sources(steps[3]):
        snap = src.snapshot()
        with local_refs.holding(snap, "shard snapshot") as snap_ref:
            plan = ranks.plan_rank(RootRef(root), snap_ref, 4, False, no_cache, "ab" * 16)
            rebuilt = local_refs.get(load_shard_baseline(plan, snap_ref))  # use_cache=False: always rebuilt
        for spec, b, new in zip(snap.specs, rebuilt, snap.bits):
            covered = np.zeros(b.size, dtype=bool)
            for p in spec.pieces:
                _, local, n = p.runs()
                for x in local.tolist():
                    covered[x:x + n] = True
            assert (b[covered] == new[covered]).all()  # the rebuilt step-3 shard is the step-3 shard


def test_rebuild_needs_one_chunking_along_the_chain(tmp_path, opts):
    root = str(tmp_path / "bucket")
    a = canonical(4)
    run_publish(root, sources(a), 0, options=opts)
    other = PublishOptions(chunk_bytes=64, cache_dir=str(tmp_path / "elsewhere"))
    run_publish(root, sources(next_step(a, 1)), 1, options=other)  # rebuilt from step 0 (32-byte chunks)
    third = PublishOptions(chunk_bytes=64, cache_dir=str(tmp_path / "third"))
    with pytest.raises(StateMismatchError, match="changes dtype, shape or chunking.*keyframe"):
        run_publish(root, sources(next_step(a, 2)), 2, options=third)
    assert Catalog(Root(root)).latest_committed() == 1


def test_a_gap_in_the_layout_commits_nothing(tmp_path, opts):
    root = str(tmp_path / "bucket")
    srcs = sources(canonical(5))
    srcs[2] = ShardedSource([s for s in srcs[2].shards if s.name != "fsdp"], rank=2, world=4)
    with pytest.raises(IntegrityError, match="m.fsdp.weight.*do not partition"):
        run_publish(root, srcs, 0, options=opts)
    assert Catalog(Root(root)).latest_committed() is None


def test_ranks_in_threads_agree_through_storage(tmp_path, opts):
    """Each rank calls run_publish with its own source and a shared attempt id; rank 0 commits."""
    root = str(tmp_path / "bucket")
    steps = [canonical(6), None]
    steps[1] = next_step(steps[0], 9)
    for n, ck in enumerate(steps):
        srcs = sources(ck)
        results, errors = {}, {}
        attempt = f"{n:02d}" * 16

        def run(src, n=n, attempt=attempt, results=results, errors=errors):
            try:
                results[src.rank] = run_publish(root, src, n, options=opts, attempt=attempt)
            except DCRError as e:
                errors[src.rank] = e

        threads = [threading.Thread(target=run, args=(s,)) for s in srcs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert {r.attempt for r in results.values()} == {attempt}
        state = str(tmp_path / "s.safetensors")
        run_receive(root, "r", state)
        assert_bits_equal(read_state(state), ck)


def test_a_failing_rank_stops_the_commit(tmp_path, opts):
    root = str(tmp_path / "bucket")
    srcs = sources(canonical(7))
    errors = {}
    bad_opts = PublishOptions(chunk_bytes=64, cache_dir=opts.cache_dir)  # rank 1 disagrees on chunking

    def run(src):
        try:
            run_publish(root, src, 0, options=bad_opts if src.rank == 1 else opts, attempt="cd" * 16)
        except DCRError as e:
            errors[src.rank] = e

    threads = [threading.Thread(target=run, args=(s,)) for s in srcs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert 0 in errors and Catalog(Root(root)).latest_committed() is None
    assert "chunk_shape" in str(errors[0]) or "failed" in str(errors[0])


def test_snapshot_is_a_bit_copy(tmp_path):
    w = torch.zeros(4, 3, dtype=torch.bfloat16)
    src = ShardedSource([Shard("w", w, split("w", (4, 3), {}))])
    snap = src.snapshot()
    w.view(torch.int16)[0, 0] = 0x7FC1  # training goes on after the snapshot
    assert not snap.bits[0].any()


def test_manifest_parts_and_pieces_are_validated(tmp_path, opts):
    from storage.manifest import Manifest, TensorEntry

    root = str(tmp_path / "bucket")
    a = canonical(8)
    run_publish(root, sources(a), 0, options=opts)
    run_publish(root, sources(next_step(a, 3, fraction=0.5, unchanged=0.0)), 1, options=opts)
    m = Catalog(Root(root)).manifest(1)
    name, e = next((n, e) for n, e in m.tensors.items() if e.parts is not None and e.pieces is not None)
    packs = tuple(m.packs())
    assert e.parts.packs  # the ranks packed their parts (the default)
    good = e.to_dict({p: i for i, p in enumerate(packs)})
    assert TensorEntry.from_dict(name, good, "m", e.scheme, packs) == e  # round trip

    def bad(mutate, match):
        d = json.loads(json.dumps(good))
        mutate(d)
        with pytest.raises(IntegrityError, match=match):
            TensorEntry.from_dict(name, d, "m", packs=packs)

    bad(lambda d: d["pieces"]["starts"].pop() and d["pieces"]["extents"].pop() and d["pieces"]["digests"].pop(),
        "do not partition")
    bad(lambda d: d["pieces"]["digests"].__setitem__(0, "0" * 64), "digest does not match its pieces")
    bad(lambda d: d["pieces"]["extents"].__setitem__(0, [10**6] * len(e.shape)), "outside|partition")
    bad(lambda d: d["parts"]["slot"].__setitem__(0, 99), "expected an integer")
    bad(lambda d: d["parts"].__setitem__("array", "../x"), "safe path segment")
    if len(e.parts) > 1:
        bad(lambda d: (d["parts"]["indices"].reverse(), d["parts"]["slot"].reverse()), "strictly increasing")
    if len(e.chunks):
        bad(lambda d: d["parts"]["indices"].__setitem__(0, d["chunks"]["indices"][0]), "both whole and in parts|increasing")
    bad(lambda d: d["parts"]["pack"].__setitem__(0, len(packs)), "parts.pack")
    bad(lambda d: d["parts"]["offset"].pop(), "parts.pack/offset must be lists")
    with pytest.raises(IntegrityError, match="name packs, but the manifest lists none"):
        TensorEntry.from_dict(name, good, "m")
    # a part moved onto another stored chunk's bytes: the pack's chunks no longer tile it
    doc = json.loads(m.to_json())
    doc["tensors"][name]["parts"]["offset"][0] += 1
    with pytest.raises(IntegrityError, match="do not tile"):
        Manifest.from_dict(doc, "m")


def test_a_corrupt_part_fails_the_refit_and_leaves_the_state(tmp_path, opts):
    root, state = str(tmp_path / "bucket"), str(tmp_path / "s.safetensors")
    a = canonical(9)
    run_publish(root, sources(a), 0, options=opts)
    run_receive(root, "r", state)
    before = open(state, "rb").read()
    run_publish(root, sources(next_step(a, 4, fraction=0.5, unchanged=0.0)), 1, options=opts)
    m = Catalog(Root(root)).manifest(1)
    name, e = next((n, e) for n, e in m.tensors.items() if e.parts is not None)
    damage_chunk(root, 1, name, len(e.chunks))  # its first part (in a rank's pack: the default)
    with pytest.raises(DCRError):
        run_receive(root, "r", state)
    assert open(state, "rb").read() == before
    assert audit.verify(Root(root), step=1).errors


def test_a_sharded_delta_on_top_of_an_unsharded_keyframe(tmp_path, opts):
    """Switching from canonical publishes to shards needs no new keyframe: the ranks rebuild their
    base shards from the canonical chunks."""
    root, state = str(tmp_path / "bucket"), str(tmp_path / "s.safetensors")
    a = canonical(12)
    b = next_step(a, 13, fraction=0.2, unchanged=0.0)
    run_publish(root, a, 0, options=opts)  # a name -> tensor mapping: plain digests
    assert run_publish(root, sources(b), 1, options=opts).kind == "delta"
    run_receive(root, "r", state, step=0)
    run_receive(root, "r", state)
    assert_bits_equal(read_state(state), b)


def test_training_ranks_refuse_the_cond_codec_with_one_line_and_commit_nothing(tmp_path, opts):
    """``dcr.cond`` codes each chunk against its whole old bits, which no rank holds."""
    root = str(tmp_path / "bucket")
    first = canonical(1)
    run_publish(root, sources(first), 0, options=opts)
    cond = opts.model_copy(update={"delta_codec": DELTA_CODECS["cond"]})
    with pytest.raises(DCRError, match="dcr.cond") as err:
        run_publish(root, sources(next_step(first, 7)), 1, options=cond)
    assert "\n" not in str(err.value)
    assert Catalog(Root(root)).marker(1) is None


@pytest.mark.parametrize("keyframe", [True, False], ids=["keyframe", "delta"])
def test_training_ranks_refuse_column_blocks_with_one_line_and_commit_nothing(tmp_path, opts, keyframe):
    """Shards are projected onto flat chunk ranges; a column block is not one."""
    root = str(tmp_path / "bucket")
    first = canonical(1)
    blocks = opts.model_copy(update={"column_blocks": 4})
    if not keyframe:
        run_publish(root, sources(first), 0, options=opts)
    with pytest.raises(DCRError, match="column blocks") as err:
        run_publish(root, sources(next_step(first, 7) if not keyframe else first), 0 if keyframe else 1,
                    options=blocks)
    assert "\n" not in str(err.value)
    assert Catalog(Root(root)).marker(0 if keyframe else 1) is None


def _experts(seed: int, n: int) -> dict[str, torch.Tensor]:
    """``n`` small BF16 expert matrices: a mixture-of-experts checkpoint in miniature."""
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i // 32}.experts.{i % 32}.w": torch.randint(-32768, 32767, (4, 16), generator=g,
                                                                 dtype=torch.int16).view(torch.bfloat16)
            for i in range(n)}


def _expert_sources(ck: dict[str, torch.Tensor], world: int) -> list[ShardedSource]:
    """Even experts split by rows (each rank stores whole chunks), odd ones by columns (every
    chunk shared by every rank: each stores its parts)."""
    out = []
    for r in range(world):
        shards = []
        for i, (name, t) in enumerate(ck.items()):
            dim = i % 2
            p = split(name, tuple(t.shape), {dim: (r, world)})
            a, e = p[0].start[dim], p[0].extent[dim]
            shards.append(Shard(name, (t[a:a + e] if dim == 0 else t[:, a:a + e]).contiguous(), p))
        out.append(ShardedSource(shards, rank=r, world=world))
    return out


def _step_objects(root: str, step: int) -> list[str]:
    d = f"{root}/steps/{step:012d}"
    return sorted(os.path.relpath(os.path.join(p, f), d) for p, _, fs in os.walk(d) for f in fs)


def test_a_sharded_delta_of_many_small_tensors_writes_objects_by_its_bytes(tmp_path):
    """Each rank packs its chunks and parts: a delta of 600 experts over 4 ranks writes at most
    16 + stored bytes / 8 MiB objects, plus one partial manifest per rank (counted apart), where one
    object per chunk and part wrote thousands; receivers, a mirror and its receivers hold exactly
    the dense checkpoint."""
    root, state, world = str(tmp_path / "bucket"), str(tmp_path / "s.safetensors"), 4
    ck0 = _experts(0, 600)
    ck1 = next_step(ck0, 1, fraction=0.03, unchanged=0.0)
    opts = PublishOptions(chunk_bytes=64, cache_dir=str(tmp_path / "cache"))
    run_publish(root, _expert_sources(ck0, world), 0, options=opts)
    run_receive(root, "r", state)
    run_publish(root, _expert_sources(ck1, world), 1, options=opts)
    m = Catalog(Root(root)).manifest(1)
    stored = m.summary()["bytes_stored"]
    assert sum(e.n_stored for e in m.tensors.values()) > 1000  # chunks and parts: one object each, unpacked
    assert all(e.parts is not None and e.parts.packs for e in list(m.tensors.values())[1::2])
    objects = _step_objects(root, 1)
    partials = [o for o in objects if f"/{m.attempt}/ranks/" in o]
    assert len(partials) == world
    assert len(objects) - len(partials) <= 16 + stored / (8 << 20), objects
    assert not any(o.endswith("zarr.json") for o in objects)
    run_receive(root, "r", state)
    assert_bits_equal(read_state(state), ck1)
    fresh = str(tmp_path / "fresh.safetensors")
    run_receive(root, "f", fresh, step=1)
    assert_bits_equal(read_state(fresh), ck1)
    assert not audit.verify(Root(root), deep=True).errors
    mirror = str(tmp_path / "mirror")
    run_mirror(root, mirror)  # each pack checked whole against the chunks and parts it holds
    far = str(tmp_path / "far.safetensors")
    run_receive(mirror, "far", far)
    assert_bits_equal(read_state(far), ck1)


def test_a_sharded_delta_with_pack_bytes_0_stores_one_object_per_chunk_and_part(tmp_path):
    root, state = str(tmp_path / "bucket"), str(tmp_path / "s.safetensors")
    ck0 = _experts(2, 40)
    ck1 = next_step(ck0, 3, fraction=0.1, unchanged=0.0)
    opts = PublishOptions(chunk_bytes=64, cache_dir=str(tmp_path / "cache"), pack_bytes=0)
    run_publish(root, _expert_sources(ck0, 4), 0, options=opts)
    run_receive(root, "r", state)
    run_publish(root, _expert_sources(ck1, 4), 1, options=opts)
    m = Catalog(Root(root)).manifest(1)
    assert m.schema_version < 3 and not m.packs()
    objects = _step_objects(root, 1)
    stored = [o for o in objects if "/c/" in o]
    assert len(stored) == sum(e.n_stored for e in m.tensors.values()) > 0
    assert any("%parts/c/" in o for o in stored) and any(o.endswith("zarr.json") for o in objects)
    run_receive(root, "r", state)
    assert_bits_equal(read_state(state), ck1)


@pytest.mark.faults(component="rank partial manifest", outcome="an old (unpacked) one still reads; one whose "
                    "rows contradict its packed flag, or names a bad pack, is refused naming the rank")
def test_partial_manifests_with_and_without_pack_columns(tmp_path):
    ck = _experts(4, 8)
    root = str(tmp_path / "bucket")
    opts = PublishOptions(chunk_bytes=64, cache_dir=str(tmp_path / "cache"))
    run_publish(root, _expert_sources(ck, 2), 0, options=opts)
    m = Catalog(Root(root)).manifest(0)
    data = open(f"{root}/{layout.rank_partial_key(0, m.attempt, 1)}", "rb").read()
    partial = ranks.RankPartial.from_json(data, "p", 1)
    assert partial.packed and all(len(r) == 5 for t in partial.tensors.values() for r in t.chunks + t.parts)
    old = json.loads(data)  # as written before packs: no flag, three columns per row
    del old["packed"]
    for t in old["tensors"].values():
        t["chunks"], t["parts"] = [r[:3] for r in t["chunks"]], [r[:3] for r in t["parts"]]
    before = ranks.RankPartial.from_json(json.dumps(old).encode(), "p", 1)
    assert not before.packed
    assert {n: (t.chunks, t.parts) for n, t in before.tensors.items()} == {
        n: ([r[:3] for r in t.chunks], [r[:3] for r in t.parts]) for n, t in partial.tensors.items()}
    old["packed"] = True
    with pytest.raises(IntegrityError, match="p: packed is True, but its chunks say otherwise"):
        ranks.RankPartial.from_json(json.dumps(old).encode(), "p", 1)
    bad = json.loads(data)
    name, t = next((n, t) for n, t in bad["tensors"].items() if t["chunks"])
    t["chunks"][0][3] = "../../x"
    with pytest.raises(IntegrityError, match=f"rank 1 tensor {name!r}.*pack name"):
        ranks.RankPartial.from_json(json.dumps(bad).encode(), "p", 1)


@pytest.mark.faults(component="rank partial manifest", outcome="ranks disagreeing on --pack-bytes 0: nothing committed")
def test_ranks_that_disagree_on_packing_commit_nothing(tmp_path):
    root = str(tmp_path / "bucket")
    opts = PublishOptions(chunk_bytes=64, cache_dir=str(tmp_path / "cache"))
    errors = {}

    def run(src):
        try:
            run_publish(root, src, 0, options=opts.model_copy(update={"pack_bytes": 0}) if src.rank == 1 else opts,
                        attempt="ce" * 16)
        except DCRError as e:
            errors[src.rank] = e

    threads = [threading.Thread(target=run, args=(s,)) for s in _expert_sources(_experts(5, 8), 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert "planned packed=False, rank 0 planned True" in str(errors[0]) and "\n" not in str(errors[0])
    assert 1 in errors and Catalog(Root(root)).latest_committed() is None
