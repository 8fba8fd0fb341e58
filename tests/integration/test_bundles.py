"""Bundles (manifest schema 4): small tensors of a dtype stored as one flat tensor, so a step of tens
of thousands of tensors costs about what its bytes in a few tensors cost. Members keep their names,
shapes and digests; the policy digest does not depend on the layout; receivers hold members by name
and end with the dense refit's bits; a chain refits exactly forward, backward and from nothing."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from dcr_core import bundles
from dcr_core.digest import BLOCKS, FLAT, DigestScheme
from dcr_core.dtypes import TensorInfo
from dcr_core.errors import IntegrityError
from storage import layout
from storage.local.bundled import BundledView
from storage.local.safetensors import SafetensorsCheckpoint
from storage.manifest import Manifest
from tests.support.cli import dcr
from tests.support.helpers import (
    assert_bits_equal,
    file_bytes,
    nasty_checkpoint,
    next_step,
    read_state,
    write_safetensors,
)
from tests.support.publishing import publish_file

BUNDLE = ("--bundle-min-tensors", 2)


def _manifest(root, step: int) -> Manifest:
    marker = json.loads(open(os.path.join(root, layout.commit_key(step))).read())
    key = layout.manifest_key(step, marker["attempt"])
    return Manifest.from_json(open(os.path.join(root, key), "rb").read(), key)


def test_a_bundled_chain_refits_exactly_forward_backward_and_from_nothing(tmp_path):
    """Every dtype, special values, 0-d and empty tensors, sizes off the chunk grid, bundled (chunks
    of 256 bytes: a bundle spans many chunks, a chunk many members): receivers forward, backward and
    from nothing hold the dense checkpoints bit for bit, and the step materializes byte for byte."""
    root = tmp_path / "bucket"
    cks = [nasty_checkpoint(seed=5, big=30)]
    for s in range(1, 4):
        cks.append(next_step(cks[-1], seed=s, fraction=0.2))
    for s, ck in enumerate(cks):
        publish_file(tmp_path, root, ck, s, *BUNDLE, "--pack-bytes", 4096)
    m = _manifest(root, 2)
    assert m.schema_version == 4 and len(m.bundles()) >= 10  # one bundle per dtype
    held = {n for n, *_ in m.policy_entries()}
    assert held == set(cks[2]) and not any(n.startswith(bundles.PREFIX) for n in held)
    assert m.summary()["tensors"] == len(cks[2])
    state = tmp_path / "state.safetensors"
    for target in (3, 1, 3, 0, 2):
        dcr("receive", root, "--receiver", "r", "--state", state, "--step", target, check=0)
        assert_bits_equal(read_state(state), cks[target])
    fresh = tmp_path / "fresh.safetensors"
    dcr("receive", root, "--receiver", "f", "--state", fresh, check=0)
    assert_bits_equal(read_state(fresh), cks[3])
    out = tmp_path / "m.safetensors"
    dcr("materialize", root, "--step", 2, "--out", out, check=0)
    assert file_bytes(out) == file_bytes(tmp_path / "c2.safetensors")
    dcr("verify", root, "--deep", check=0)


def test_the_policy_digest_does_not_depend_on_bundling(tmp_path):
    """The same weights published with and without bundles (and with flat digests): one policy digest."""
    ck = nasty_checkpoint(seed=1)
    digests = set()
    for i, flags in enumerate([BUNDLE, ("--bundle-below", 0), BUNDLE + ("--pack-bytes", 0)]):
        root = tmp_path / f"b{i}"
        publish_file(tmp_path, root, ck, 0, *flags)
        m = _manifest(root, 0)
        assert bool(m.bundles()) == (i != 1)
        digests.add(m.policy_digest)
    assert len(digests) == 1


def test_a_delta_keeps_its_keyframes_bundles_and_a_new_keyframe_decides_again(tmp_path):
    """Deltas keep the lineage's layout whatever their flags say (every move of a refit shares it); a
    keyframe decides anew, and a receiver crosses from one lineage to the other exactly."""
    root = tmp_path / "bucket"
    a = nasty_checkpoint(seed=2)
    b = next_step(a, seed=7, fraction=0.3)
    c = next_step(b, seed=8, fraction=0.3)
    publish_file(tmp_path, root, a, 0, *BUNDLE)
    publish_file(tmp_path, root, b, 1, "--bundle-below", 0)
    assert _manifest(root, 1).bundles() and _manifest(root, 1).bundles().keys() == _manifest(root, 0).bundles().keys()
    publish_file(tmp_path, root, c, 2, "--keyframe", "--bundle-below", 0)
    assert not _manifest(root, 2).bundles() and _manifest(root, 2).schema_version == 3
    state = tmp_path / "s.safetensors"
    for target, ck in ((1, b), (2, c), (0, a)):
        dcr("receive", root, "--receiver", "r", "--state", state, "--step", target, check=0)
        assert_bits_equal(read_state(state), ck)


def test_a_state_file_lays_each_bundle_out_back_to_back(tmp_path):
    """A receiver's state file holds members by name, each bundle's members contiguous in bundle
    order: the bundle is then one read of the held file."""
    root = tmp_path / "bucket"
    ck = nasty_checkpoint(seed=4)
    publish_file(tmp_path, root, ck, 0, *BUNDLE)
    state = tmp_path / "s.safetensors"
    dcr("receive", root, "--receiver", "r", "--state", state, check=0)
    m = _manifest(root, 0)
    with SafetensorsCheckpoint(state) as held:
        v = BundledView(held, m.bundles())
        for b in m.bundles():
            runs = v._file_runs(b)
            assert len(runs[1]) == 1  # one run: the members lie back to back
            assert m.tensors[b].matches(v.bits(b))


def test_a_bundle_reads_from_members_in_any_file_order(tmp_path):
    """Members spread over a checkpoint in another order (and over two files of a directory) are
    gathered into the bundle's bits exactly, chunk by chunk and whole."""
    rng = np.random.default_rng(0)
    d = tmp_path / "ck"
    d.mkdir()
    names = [f"t{i:02d}" for i in range(23)]
    arrays = {n: rng.integers(0, 255, size=(int(rng.integers(0, 9)), 3), dtype=np.uint8).view(np.int8) for n in names}
    import torch

    write_safetensors(d / "b.safetensors", {n: torch.from_numpy(arrays[n].copy()) for n in names[::2]})
    write_safetensors(d / "a.safetensors", {n: torch.from_numpy(arrays[n].copy()) for n in reversed(names[1::2])})
    infos = {n: TensorInfo(n, "I8", arrays[n].shape) for n in names}
    plan = bundles.plan(infos, 1 << 20, 2)
    (b, members), = plan.items()
    flat = np.concatenate([arrays[n].reshape(-1).view(np.uint8) for n in members.names])
    with SafetensorsCheckpoint(d) as ck:
        v = BundledView(ck, plan)
        assert np.array_equal(v.bits(b), flat)
        for step in (1, 5, 17):
            parts = [v.read_into(b, s, np.empty(min(step, flat.size - s), np.uint8)).copy() for s in range(0, flat.size, step)]
            assert np.array_equal(np.concatenate(parts), flat)


@pytest.mark.parametrize("scheme", [FLAT, BLOCKS, DigestScheme(4096), DigestScheme(8)], ids=str)
def test_member_digests_fed_chunk_by_chunk_equal_each_members_digest(scheme):
    rng = np.random.default_rng(1)
    for _ in range(40):
        shapes = [tuple(int(x) for x in rng.integers(0, 30, size=int(rng.integers(0, 3)))) for _ in range(int(rng.integers(1, 25)))]
        m = bundles.Members("BF16", tuple(f"t{i}" for i in range(len(shapes))), tuple(shapes))
        flat = rng.integers(0, 65535, size=m.numel, dtype=np.uint16)
        want = tuple(scheme.digest(v) for _, v in m.split(flat))
        assert m.digests_of(flat, scheme) == want
        h = bundles.MembersHasher(m, scheme)
        step = int(rng.integers(1, 40))
        for s in range(0, max(m.numel, 1), step):
            h.update(flat[s:s + step])
        assert h.finish(False).digests == want


def test_a_member_whose_bits_are_not_its_digest_fails_the_bundle(tmp_path):
    """The bundle's digest matches but one member's digest in the manifest does not: refused."""
    root = tmp_path / "bucket"
    publish_file(tmp_path, root, nasty_checkpoint(seed=6), 0, *BUNDLE)
    m = _manifest(root, 0)
    b, members = next(iter(m.bundles().items()))
    with SafetensorsCheckpoint(tmp_path / "c0.safetensors") as ck:
        bits = BundledView(ck, m.bundles()).bits(b)
    e = m.tensors[b]
    assert e.matches(bits)
    import dataclasses

    wrong = members.with_digests(("0" * 64,) + members.digests[1:])
    assert not dataclasses.replace(e, members=wrong).matches(bits)
    assert dataclasses.replace(e, members=wrong).matches(bits, members=False)


def _forged(root, step, change) -> bytes:
    marker = json.loads(open(os.path.join(root, layout.commit_key(step))).read())
    key = layout.manifest_key(step, marker["attempt"])
    d = json.loads(open(os.path.join(root, key), "rb").read())
    change(d)
    return json.dumps(d).encode()


@pytest.mark.parametrize("change, said", [
    (lambda d: d["bundles"][next(iter(d["bundles"]))]["names"].append("x"), "equal length"),
    (lambda d: d["bundles"][next(iter(d["bundles"]))]["names"].__setitem__(1, d["bundles"][next(iter(d["bundles"]))]["names"][0]), "named twice"),
    (lambda d: d["bundles"][next(iter(d["bundles"]))]["digests"].__setitem__(0, "Z" * 64), "hex"),
    (lambda d: d["bundles"][next(iter(d["bundles"]))]["shapes"].__setitem__(0, [1.5]), "integers"),
    (lambda d: d["bundles"].__setitem__("%bundle.nope.0", d["bundles"][next(iter(d["bundles"]))]), "not one of its tensors"),
    (lambda d: d.__setitem__("schema_version", 3), "schema 4"),
    (lambda d: d["bundles"][next(iter(d["bundles"]))]["shapes"].__setitem__(0, [999]), "flat tensor"),
    (lambda d: d["bundles"][next(iter(d["bundles"]))].__setitem__("names", 7), "names must be a list"),
    (lambda d: d.pop("codec"), "bad codec"),
], ids=["names-longer", "named-twice", "digest", "shape", "unknown-bundle", "schema", "numel", "names-not-a-list",
        "no-codec"])
def test_a_bad_bundles_table_is_refused_in_one_line(tmp_path, change, said):
    root = tmp_path / "bucket"
    publish_file(tmp_path, root, nasty_checkpoint(seed=6), 0, *BUNDLE)
    with pytest.raises(IntegrityError) as e:
        Manifest.from_json(_forged(root, 0, change), "m")
    assert said in str(e.value) and "\n" not in str(e.value)


def test_a_member_clashing_with_a_tensor_is_refused(tmp_path):
    root = tmp_path / "bucket"
    publish_file(tmp_path, root, nasty_checkpoint(seed=6), 0, *BUNDLE)

    def clash(d):
        b = next(iter(d["bundles"]))
        d["tensors"][d["bundles"][b]["names"][0]] = d["tensors"][b]

    with pytest.raises(IntegrityError, match="both bundled and stored alone"):
        Manifest.from_json(_forged(root, 0, clash), "m")


def test_bundles_follow_the_thresholds():
    infos = {f"e{i}": TensorInfo(f"e{i}", "BF16", (4, 4)) for i in range(5)}
    infos["big"] = TensorInfo("big", "BF16", (1024, 1024))
    infos["f"] = TensorInfo("f", "F32", (2,))
    infos[bundles.bundle_name("BF16", 0)] = TensorInfo(bundles.bundle_name("BF16", 0), "F32", (1,))  # a name taken
    plan = bundles.plan(infos, 1 << 20, 5)
    assert list(plan) == [bundles.bundle_name("BF16", 1)] and plan[bundles.bundle_name("BF16", 1)].names == tuple(f"e{i}" for i in range(5))
    assert bundles.plan(infos, 1 << 20, 6) == {} and bundles.plan(infos, 0, 2) == {}
    stored = bundles.stored_infos(infos, plan)
    assert set(stored) == {"big", "f", bundles.bundle_name("BF16", 0), bundles.bundle_name("BF16", 1)}
    assert list(bundles.policy_infos(stored, plan)) == [bundles.bundle_name("BF16", 0), *(f"e{i}" for i in range(5)), "big", "f"]


def test_a_header_of_640_bytes_is_read_as_safetensors(tmp_path):
    """A header whose length starts with the bytes a pickle starts with (0x80 0x02) is still a
    safetensors file (its JSON opens at byte 8)."""
    import torch

    p = tmp_path / "x.safetensors"
    for pad in range(0, 400):
        write_safetensors(p, {"a" * (1 + pad): torch.zeros(1)})
        if struct.unpack("<Q", open(p, "rb").read(8))[0] % 256 == 0x80:
            break
    head = open(p, "rb").read(9)
    assert head[0] == 0x80 and head[8:9] == b"{"
    with SafetensorsCheckpoint(p) as ck:
        assert len(ck.infos) == 1


def test_a_moe_checkpoint_is_bundled_by_default(tmp_path):
    """The defaults bundle a checkpoint of many small tensors (300 here): one entry per bundle, and
    the receive ends exact."""
    from dcr_bench import moe

    old, new = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    moe.write_pair(str(old), str(new), 2_000_000, 800, 0.03, 0)
    root = tmp_path / "bucket"
    dcr("publish", root, old, "--step", 0, "--no-cache", check=0)
    dcr("publish", root, new, "--step", 1, "--no-cache", check=0)
    m = _manifest(root, 1)
    assert m.schema_version == 4 and len(m.tensors) < 10 and m.summary()["tensors"] == 800
    state = tmp_path / "s.safetensors"
    dcr("receive", root, "--receiver", "r", "--state", state, check=0)
    with SafetensorsCheckpoint(state) as a, SafetensorsCheckpoint(new) as b:
        assert set(a.infos) == set(b.infos)
        assert all(np.array_equal(a.bits(n).view(np.uint8), b.bits(n).view(np.uint8)) for n in b.infos)


def _chain(tmp_path, n=3, **kw):
    root = tmp_path / "bucket"
    cks = [nasty_checkpoint(seed=9, **kw)]
    for s in range(1, n):
        cks.append(next_step(cks[-1], seed=20 + s, fraction=0.25))
    for s, ck in enumerate(cks):
        publish_file(tmp_path, root, ck, s, *BUNDLE, "--pack-bytes", 2048)
    return root, cks


def test_a_mirror_copies_bundled_steps_and_gc_keeps_what_receivers_need(tmp_path):
    """Mirroring (packs checked whole), then gc of the source: a receiver of the mirror and of the
    source ends exact; the mirror verifies deep."""
    from flows.maintenance import audit
    from flows.maintenance.mirror import run_mirror
    from storage.root import Root

    root, cks = _chain(tmp_path)
    mirror = str(tmp_path / "mirror")
    run_mirror(str(root), mirror)
    assert not audit.verify(Root(mirror), deep=True).errors
    state = tmp_path / "m.safetensors"
    for target in (0, 2, 1):
        dcr("receive", mirror, "--receiver", "m", "--state", state, "--step", target, check=0)
        assert_bits_equal(read_state(state), cks[target])
    dcr("gc", root, "--keep-last", 1, check=0)
    fresh = tmp_path / "f.safetensors"
    dcr("receive", root, "--receiver", "f", "--state", fresh, check=0)
    assert_bits_equal(read_state(fresh), cks[-1])


def test_a_refit_rewritten_by_groups_writes_each_member_in_place(tmp_path):
    """The mapped rewrite (``dcr receive --workers``): groups of stored tensors, a bundle's members
    each written at its place of the reserved file; the result is the dense refit's bits."""
    from flows.receive import on_workers
    from storage import reader
    from storage.local.safetensors import install
    from storage.root import open_root

    root, cks = _chain(tmp_path)
    state = tmp_path / "s.safetensors"
    dcr("receive", root, "--receiver", "r", "--state", state, "--step", 0, check=0)
    plan = reader.plan_refit(open_root(str(root)), 0, 2)
    reserved = on_workers.reserve_file(plan, str(state))
    groups = on_workers.groups_of(plan, 3, group_bytes=64)
    assert len(groups) > 1
    parts = [on_workers.rewrite_group(plan, reserved, g) for g in groups]
    assert sum(p["bytes_written"] for p in parts) == sum(t.nbytes for t in cks[2].values())
    install(reserved.tmp, str(state))
    assert_bits_equal(read_state(state), cks[2])


def test_the_auditor_opens_a_bundled_tensor_by_its_name(tmp_path):
    """``open_tensor`` of a member: its bits, read from its bundle's array and shaped as the tensor."""
    import torch
    from dcr_zarr_codec import open_tensor

    root, cks = _chain(tmp_path, n=1)
    m = _manifest(root, 0)
    for members in m.bundles().values():
        for name in (members.names[0], members.names[-1]):
            got = np.asarray(open_tensor(str(root), 0, name))
            want = cks[0][name]
            assert got.shape == tuple(want.shape)
            assert got.tobytes() == want.contiguous().view(torch.uint8).numpy().tobytes()
    with pytest.raises(KeyError):
        open_tensor(str(root), 0, "no such tensor")


def test_a_live_module_receiver_refits_a_bundled_step_exactly(tmp_path):
    """Live modules place a bundle's members by name through their loader (the loader never sees a
    bundle): densely, then by delta, the module holds each step's bits (more in test_module_bundles)."""
    import torch

    from flows import receive_into_module

    root, cks = _chain(tmp_path, n=2, dtypes=["F32", "BF16"], odd_names=False)

    class Held(torch.nn.Module):
        def load_weights(self, weights):
            for n, t in weights:
                getattr(self, n.replace(".", "_")).copy_(t)

    module = Held()
    for n, t in sorted(cks[0].items()):
        module.register_buffer(n.replace(".", "_"), torch.zeros_like(t))
    mirror = str(tmp_path / "mirror.safetensors")
    for step, mode in ((0, "dense"), (1, "delta"), (0, "delta")):
        assert receive_into_module(str(root), "m", module, step, state_path=mirror)["mode"] == mode
        assert_bits_equal({n.replace("_", "."): t for n, t in module.state_dict().items()}, cks[step])


@pytest.mark.faults(component="publisher", outcome="nothing committed, receivers stay on the last step; a rerun commits the step bit-exact")
@pytest.mark.parametrize("point", ["pack.stored@1", "tensor.done@2", "publish.manifest-written"])
def test_kill_9_during_a_bundled_publish_commits_nothing_and_a_rerun_is_exact(tmp_path, point):
    """A publisher killed while a bundled delta's packs, bundles or manifest are written (at points
    it reports reaching): nothing visible; a rerun commits it, and a receiver ends exact."""
    from tests.support.kill import kill_at

    root = tmp_path / "bucket"
    ck0 = nasty_checkpoint(seed=13)
    ck1 = next_step(ck0, seed=14, fraction=0.3)
    publish_file(tmp_path, root, ck0, 0, *BUNDLE)
    p = tmp_path / "c1.safetensors"
    write_safetensors(p, ck1)
    kill_at(point, "publish", root, p, "--step", 1, "--chunk-bytes", 256, "--pack-bytes", 2048, "--no-cache", *BUNDLE)
    assert not os.path.exists(os.path.join(root, layout.commit_key(1)))
    state = tmp_path / "state.safetensors"
    dcr("receive", root, "--receiver", "r", "--state", state, check=0)
    assert_bits_equal(read_state(state), ck0)
    publish_file(tmp_path, root, ck1, 1, "--pack-bytes", 2048)
    assert _manifest(root, 1).bundles()
    dcr("receive", root, "--receiver", "r", "--state", state, check=0)
    assert_bits_equal(read_state(state), ck1)


def test_an_engine_worker_refits_a_bundled_chain_exactly_patching_and_reloading_members(tmp_path):
    """The engine receiver (prepare, pause, rollback: ``flows.receive.engine``, what vLLM's worker
    extension and backend run) on a vLLM-style model whose small tensors are bundled: a changed
    bundle is the members whose digests changed; a norm (a member) is patched in place, a member of
    a fused layer reloads that layer, the embedding (stored alone) is reloaded; a reload that fails
    mid-way rolls back to the held step exactly; a new unbundled lineage (a keyframe move) and the
    way back are exact; after every refit the model equals a dense load of the step, bit for bit."""
    import torch

    from dcr_bench.models.llama_vllm import LlamaConfig, VllmLlama, canonical_checkpoint
    from dcr_core import events
    from flows import run_publish
    from flows.options import PublishOptions
    from flows.receive.engine import EngineReceiver
    from flows.receive.receiver import Binding
    from storage.root import RootRef
    from tests.support.loader_engine import LoaderEngine

    cfg = LlamaConfig()  # no inv_freq: a buffer feeds every layer, and a keyframe move would reload all
    cks = [{n: t for n, t in canonical_checkpoint(cfg, seed=0).items() if not n.endswith("inv_freq")}]

    def changed(ck, flips):
        out = {n: t.clone() for n, t in ck.items()}
        for n, at in flips:
            out[n].view(-1).view(torch.int16)[at] ^= 1
        return out

    norm, q, emb, o = ("model.layers.1.input_layernorm.weight", "model.layers.0.self_attn.q_proj.weight",
                       "model.embed_tokens.weight", "model.layers.1.self_attn.o_proj.weight")
    cks.append(changed(cks[0], [(norm, 3), (q, 7), (emb, 11)]))
    cks.append(changed(cks[1], [(o, 5), (o, 900)]))
    cks.append(changed(cks[2], [(q, 8)]))
    cks[3]["lm_head.weight"] = torch.zeros_like(cks[3]["lm_head.weight"])  # a keyframe stores no chunk of it
    root = str(tmp_path / "bucket")
    opts = PublishOptions(chunk_bytes=1024, cache_dir=str(tmp_path / "cache"), bundle_min_tensors=2, bundle_below=16384)
    for s, ck in enumerate(cks[:3]):
        run_publish(root, ck, s, options=opts)
    run_publish(root, cks[3], 3, keyframe=True, options=opts.model_copy(update={"bundle_below": 0}))
    m = _manifest(root, 1)
    assert m.bundles() and emb in m.tensors and q not in m.tensors and not _manifest(root, 3).bundles()

    model = VllmLlama(cfg)
    model.load_weights(list(cks[0].items()))
    worker = EngineReceiver(LoaderEngine(model))
    worker.bind(Binding(RootRef(root), "v", mirror=str(tmp_path / "mirror.safetensors")))

    def refit(step):
        worker.refit(step)
        dense = VllmLlama(cfg)
        dense.load_weights(list(cks[step].items()))
        assert_bits_equal(dict(model.state_dict()), dict(dense.state_dict()))
        return worker.last.model_dump()

    def fails(step, held):  # the reload breaks after one tensor: the engine is back at ``held``, exactly
        events.set_failpoints("receive.engine-tensor@2=fail")
        try:
            with pytest.raises(events.FailpointFault):
                worker.refit(step)
        finally:
            events.set_failpoints("")
        dense = VllmLlama(cfg)
        dense.load_weights(list(cks[held].items()))
        assert_bits_equal(dict(model.state_dict()), dict(dense.state_dict()))
        assert worker.status()["known"]

    assert refit(0)["mode"] == "full"
    fails(1, 0)  # the norm's patch undone, the layers reloaded from the mirror
    r = refit(1)
    assert (r["mode"], r["changed_tensors"], r["patched_tensors"], r["patched_elements"]) == ("delta", 3, 1, 1), r
    assert r["reloaded_tensors"] == 4, r  # q, k, v (one fused layer) and the embedding
    r = refit(2)
    assert (r["mode"], r["changed_tensors"], r["patched_tensors"], r["patched_elements"], r["reloaded_tensors"]) == (
        "delta", 1, 1, 2, 0), r  # o_proj keeps the checkpoint's layout: patched, nothing reloaded
    r = refit(0)  # back through the inverse deltas
    assert (r["mode"], r["changed_tensors"]) == ("delta", 4), r
    fails(3, 0)  # a plan through a keyframe names no manifest of the held step: rolled back from the mirror
    r = refit(3)  # a keyframe move into the unbundled lineage: every tensor may differ, stored or not
    assert (r["mode"], r["changed_tensors"], r["moves"]) == ("delta", len(cks[3]), ["keyframe:3"]), r
    r = refit(1)  # and back: the bundled lineage's keyframe, then its delta
    assert (r["mode"], r["changed_tensors"]) == ("delta", len(cks[1])), r
    assert worker.status()["known"]


def test_a_member_digest_found_wrong_after_its_bundle_was_yielded_fails_the_refit_before_install(tmp_path, monkeypatch):
    """Members are checked beside the next tensors: a wrong member digest (its bundle's own digest
    right) still fails the receive before anything is installed; the state file is unchanged."""
    from dcr_core import bundles as core_bundles

    root = tmp_path / "bucket"
    cks = [nasty_checkpoint(seed=31)]
    cks.append(next_step(cks[0], seed=32, fraction=0.3))
    for s, ck in enumerate(cks):
        publish_file(tmp_path, root, ck, s, *BUNDLE)
    state = tmp_path / "s.safetensors"
    dcr("receive", root, "--receiver", "r", "--state", state, "--step", 0, check=0)
    before = file_bytes(state)
    real = core_bundles.Members.check
    calls = []

    def wrong_once(self, flat, scheme):
        calls.append(self.names[0])
        return self.names[-1] if len(calls) == 2 else real(self, flat, scheme)

    monkeypatch.setattr(core_bundles.Members, "check", wrong_once)
    from dcr_core.errors import StateMismatchError
    from flows import ReceiveOptions, run_receive

    with pytest.raises(StateMismatchError, match="does not match its digest after apply"):
        run_receive(str(root), "r", str(state), 1, None, ReceiveOptions())
    assert len(calls) >= 2 and file_bytes(state) == before
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # no temp file left
