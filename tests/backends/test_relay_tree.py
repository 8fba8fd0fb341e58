"""A relay tree of stores on three S3 servers: an origin and two regions, the links between them
throttled and counted.

Three moto servers, each its own process and store: the origin, region A and region B. Region A
and region B each reach the origin only through their own link (a ``netproxy.Proxy``: capped,
counting every body byte each way). Mirror A and mirror B pull from the origin over their link;
mirror A2 (region A) pulls from mirror A. Four state-file receivers per region, each its own
process. The same Ed25519-signed steps (a keyframe, then deltas at 3 % changed) are received twice:
through the tree (region A's receivers read A and A2, region B's read B) and directly (every
receiver reads the origin through its region's link). Mirrors and receivers hold only the public key.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest
from safetensors.torch import load_file

from dcr_bench.netproxy import Proxy
from dcr_bench.relay_tree import Worker, close_all, run_all, s3_servers
from flows import run_materialize, run_publish
from flows.maintenance.gc import run_gc
from flows.options import GcOptions, PublishOptions
from storage import layout, leases, signing
from storage.catalog import Catalog
from storage.root import Root
from tests.support.cli import dcr
from tests.support.helpers import assert_bits_equal, next_step
from tests.support.kill import kill_at
from tests.support.relay import flags, relay_chain, step_bytes

pytestmark = pytest.mark.backend

RATE = 40e6  # bytes/s, each direction of each inter-region link
CHUNK = 64 << 10
STEPS = 3
PER_REGION = 4
REGIONS = ("a", "b")


class World:
    """The servers, links, keys, ROOTs and processes of the module's tree."""

    def __init__(self, servers, links, key: str, cache_dir: str):
        tag = uuid.uuid4().hex[:8]
        self.servers, self.links, self.key, self.cache_dir = servers, links, key, cache_dir
        self.origin = f"s3://{servers['origin'].bucket}/run-{tag}"
        self.mirror = {"a": f"s3://region-a/mirror-{tag}", "a2": f"s3://region-a/mirror-a2-{tag}",
                       "b": f"s3://region-b/mirror-{tag}"}
        self.env = {"DCR_VERIFY_KEY_FILE": key + ".pub"}  # mirrors and receivers: the public key only
        self.cks = relay_chain(STEPS)
        self.workers: list[Worker] = []
        self.mirrors = {m: self._worker(f"mirror-{m}") for m in self.mirror}
        self.tree = {f"{r}{i}": self._worker(f"tree-{r}{i}") for r in REGIONS for i in range(PER_REGION)}
        self.direct = {f"{r}{i}": self._worker(f"direct-{r}{i}") for r in REGIONS for i in range(PER_REGION)}

    def _worker(self, name: str) -> Worker:
        w = Worker(name, self.env)
        self.workers.append(w)
        return w

    def opts(self, name: str) -> dict:
        """Storage options of a server (``origin``, ``a``, ``b``; ``a2`` lives on ``a``)."""
        return self.servers[name.rstrip("2")].options

    def via(self, region: str) -> dict:
        """Storage options that reach the origin through ``region``'s link."""
        return {**self.servers["origin"].options, "endpoint_url": self.links[region].url}

    def publish(self, step: int, **kw) -> None:
        """Publish ``cks[step]`` at the origin, the private key set for this call only."""
        verify = os.environ.pop("DCR_VERIFY_KEY_FILE", None)
        os.environ["DCR_SIGNING_KEY_FILE"] = self.key
        try:
            run_publish(self.origin, self.cks[step], step, storage_options=self.opts("origin"), options=PublishOptions(
                chunk_bytes=CHUNK, cache_dir=os.path.join(self.cache_dir, "pub")), **kw)
        finally:
            del os.environ["DCR_SIGNING_KEY_FILE"]
            if verify is not None:
                os.environ["DCR_VERIFY_KEY_FILE"] = verify

    def mirror_req(self, m: str) -> dict:
        src, src_opts = (self.mirror["a"], self.opts("a")) if m == "a2" else (self.origin, self.via(m))
        return {"op": "mirror", "src": src, "dst": self.mirror[m], "src_options": src_opts,
                "dst_options": self.opts(m), "as_id": f"mirror-{m}"}

    def tree_root(self, rid: str) -> str:
        """Region A: receivers 0 and 1 read mirror A, 2 and 3 mirror A2; region B's read mirror B."""
        return self.mirror["a2" if rid[0] == "a" and int(rid[1]) >= PER_REGION // 2 else rid[0]]

    def receive_req(self, mode: str, rid: str, step: int | None = None) -> dict:
        if mode == "tree":
            root = self.tree_root(rid)
            opts = self.opts(rid[0])
        else:
            root, opts = self.origin, self.via(rid[0])
        return {"op": "receive", "root": root, "receiver": f"{mode}-{rid}", "state": self.state(mode, rid),
                "step": step, "storage_options": opts}

    def state(self, mode: str, rid: str) -> str:
        return os.path.join(self.cache_dir, f"{mode}-{rid}.safetensors")

    def counts(self) -> dict:
        return {r: self.links[r].counts() for r in REGIONS}


def _delta(after: dict, before: dict) -> dict:
    return {r: {k: after[r][k] - before[r][k] for k in after[r]} for r in after}


def _add(total: dict, d: dict) -> None:
    for r, c in d.items():
        for k, v in c.items():
            total.setdefault(r, {}).setdefault(k, 0)
            total[r][k] += v


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("relay")
    signing.keygen(d / "key")
    mp = pytest.MonkeyPatch()
    mp.setenv("DCR_VERIFY_KEY_FILE", str(d / "key.pub"))
    for var in ("DCR_SIGNING_KEY_FILE", "DCR_SIGNING_KEY"):
        mp.delenv(var, raising=False)
    mp.setenv("DCR_CACHE_DIR", str(d / "dcr-cache"))
    w = None
    try:
        with s3_servers(("origin", *REGIONS), str(d)) as servers, Proxy(servers["origin"].url, RATE) as la, \
                Proxy(servers["origin"].url, RATE) as lb:
            w = World(servers, {"a": la, "b": lb}, str(d / "key"), str(d))
            yield w
    finally:
        close_all(w.workers if w else [])
        mp.undo()


@pytest.fixture(scope="module")
def relayed(world):
    """Each step published at the origin, then received by 8 receivers through the tree and by 8
    receivers directly: the bytes each link carried in each mode, and each step's stored bytes."""
    w = world
    bytes_tree: dict = {}
    bytes_direct: dict = {}
    stored = []
    for s in range(STEPS):
        w.publish(s)
        stored.append(step_bytes(Root(w.origin, w.opts("origin")), s))
        before = w.counts()
        run_all([(w.mirrors[r], w.mirror_req(r)) for r in REGIONS])  # each region's mirror pulls the step once
        w.mirrors["a2"].call(**w.mirror_req("a2"))  # a mirror of mirror A, inside region A
        run_all([(x, w.receive_req("tree", rid)) for rid, x in w.tree.items()])
        _add(bytes_tree, _delta(w.counts(), before))
        before = w.counts()
        run_all([(x, w.receive_req("direct", rid)) for rid, x in w.direct.items()])
        _add(bytes_direct, _delta(w.counts(), before))
        for mode in ("tree", "direct"):  # every receiver, every tensor, raw bytes
            for rid in w.tree:
                assert_bits_equal(load_file(w.state(mode, rid)), w.cks[s])
    return {"tree": bytes_tree, "direct": bytes_direct, "stored": stored}


def test_each_origin_link_carries_one_copy_with_the_tree_and_one_per_receiver_without(world, relayed):
    stored = relayed["stored"]
    chunks = sum(s["chunks"] for s in stored)
    markers = sum(s["marker"] for s in stored)
    manifests = sum(s["manifest"] for s in stored)
    keys = sum(len(s["objects"]) for s in stored)
    copy = sum(s["attempt"] for s in stored) + markers  # one copy of each step: its attempt's objects, its marker
    report = json.dumps({"copy": copy, "chunks": chunks, "manifests": manifests, "markers": markers, "keys": keys,
                         "tree": relayed["tree"], "direct": relayed["direct"]})
    for r in REGIONS:
        tree, direct = relayed["tree"][r]["bytes_down"], relayed["direct"][r]["bytes_down"]
        # Tree: every object crosses once. Beyond that only metadata: the manifest is read once more
        # (checked against the marker before it is copied), each mirror run reads the markers it
        # checks up to three times, and the listing of each attempt costs at most 512 bytes a key.
        assert copy <= tree <= copy + manifests + 3 * STEPS * markers + 512 * keys, report
        # Direct: each of the 4 receivers fetches every chunk (each changing tensor changes at 3 %
        # of random elements, so all its chunks change) and the manifest of each step; beyond that
        # markers, listings of steps/ and its own records.
        assert PER_REGION * (chunks + manifests) <= direct <= PER_REGION * (chunks + 2 * manifests + 3 * STEPS * markers), report
        # about 4x: the tree also copies each attempt's Zarr metadata and lists it (receivers do not)
        assert direct > 3.2 * tree, report
        # up the link: the mirrors' leases and positions only (a few hundred bytes a step)
        assert relayed["tree"][r]["bytes_up"] < 1024 * STEPS, report


def test_every_receiver_ends_bit_exact_against_a_dense_read_of_the_origin(world, relayed, tmp_path):
    dense = tmp_path / "dense.safetensors"
    run_materialize(world.origin, STEPS - 1, dense, world.opts("origin"))
    ref = load_file(dense)
    assert_bits_equal(ref, world.cks[STEPS - 1])
    for mode in ("tree", "direct"):
        for rid in world.tree:
            assert_bits_equal(load_file(world.state(mode, rid)), ref)  # raw bytes (uint8 views) of every tensor


@pytest.mark.faults(component="mirror", outcome="between servers: no step visible downstream before its payload; a rerun commits bit-exact")
def test_a_mirror_killed_mid_copy_between_servers_shows_no_partial_step(world, relayed, tmp_path):
    """(Killed after the payload, before the marker: tests/integration/test_mirror.py.)"""
    w = world
    b = w.opts("b")
    dst = f"s3://region-b/killed-{uuid.uuid4().hex[:6]}"
    point = f"mirror.object-copied@{len(relayed['stored'][0]['objects']) + 3}"  # a few objects into step 1
    err = kill_at(point, "mirror", w.origin, dst, *flags(w.via("b")), *flags(b, "--dst-storage-option"), env=w.env)
    assert f"failpoint {point} reached" in err
    droot, oroot = Root(dst, b), Root(w.origin, w.opts("origin"))
    assert Catalog(droot).committed_steps() == [0]  # step 1 was cut off: its marker was never written
    held = {o.key: o.size for o in droot.objects(layout.attempt_dir(1, relayed["stored"][1]["attempt_id"]))}
    assert held  # objects of step 1 are there (the other copy threads may have finished its payload): invisible
    dcr("mirror", w.origin, dst, *flags(w.via("b")), *flags(b, "--dst-storage-option"), env=w.env, check=0)
    for s in range(STEPS):  # each step: its marker and every object of its attempt, byte for byte
        st = relayed["stored"][s]
        assert droot.read(layout.commit_key(s)) == oroot.read(layout.commit_key(s))
        assert {o.key: o.size for o in droot.objects(layout.attempt_dir(s, st["attempt_id"]))} == st["objects"]
    state = tmp_path / "s.safetensors"
    dcr("receive", dst, "--receiver", "late", "--state", state, *flags(b), env=w.env, check=0)
    assert_bits_equal(load_file(state), w.cks[STEPS - 1])


@pytest.mark.faults(component="mirror", outcome="between servers: an altered payload, a dropped object or a replayed marker is refused in one line")
def test_a_mirror_that_alters_drops_or_replays_is_refused_by_its_receivers(world, relayed, tmp_path):
    w = world
    b = w.opts("b")
    mirror = Root(w.mirror["b"], b)
    last = STEPS - 1
    chunk = sorted(k for k in relayed["stored"][last]["objects"]  # a pack (or a chunk object of a layer)
                   if f"/{layout.PACKS}/" in k or ("layers." in k and "/c/" in k))[0]
    state = tmp_path / "s.safetensors"
    dcr("receive", w.mirror["b"], "--receiver", "check", "--state", state, "--step", last - 1, *flags(b), env=w.env, check=0)
    held = state.read_bytes()
    good_chunk, good_marker = mirror.read(chunk), mirror.read(layout.commit_key(last))
    flipped = bytearray(good_chunk)
    flipped[len(flipped) // 2] ^= 0x01
    cases = {  # what the mirror did, and what the receiver's one line must name
        "altered payload": (chunk, bytes(flipped), chunk),
        "dropped object": (chunk, None, chunk),
        "replayed marker": (layout.commit_key(last), mirror.read(layout.commit_key(last - 1)), layout.commit_key(last)),
    }
    try:
        for why, (key, data, says) in cases.items():
            if data is None:
                mirror.remove(key)
            else:
                mirror.write(key, data)
            out = dcr("receive", w.mirror["b"], "--receiver", "check", "--state", state, "--step", last, *flags(b), env=w.env)
            assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1, (why, out.stderr)
            assert out.stderr.startswith("dcr: error: ") and says in out.stderr, (why, out.stderr)
            assert state.read_bytes() == held, why  # the receiver's state is untouched
            mirror.write(chunk, good_chunk)
            mirror.write(layout.commit_key(last), good_marker)
    finally:
        mirror.write(chunk, good_chunk)
        mirror.write(layout.commit_key(last), good_marker)
    dcr("receive", w.mirror["b"], "--receiver", "check", "--state", state, *flags(b), env=w.env, check=0)
    assert_bits_equal(load_file(state), w.cks[last])


def test_gc_on_a_mirror_keeps_what_its_receivers_and_its_downstream_mirror_need(world, relayed):
    """Mirror A's gc keeps the steps its receivers lease or stand at and the step mirror A2
    (registered with ``--as``) stands at; a later mirror run does not copy back what gc deleted."""
    w = world
    a, A = w.opts("a"), w.mirror["a"]
    root = Root(A, a)
    for s in (3, 4):  # step 3 a keyframe: retention alone would keep only 3 and 4
        w.cks.append(next_step(w.cks[-1], 900 + s, fraction=0.03))
        w.publish(s, keyframe=s == 3)
    w.mirrors["a"].call(**w.mirror_req("a"))
    w.tree["a0"].call(**w.receive_req("tree", "a0"))  # a0 at 4; a1 and mirror A2 stay at step 2
    leases.take(root, "reader", [1], 4)  # a receiver of A reading step 1 right now

    def gc():
        return run_gc(A, GcOptions(keep_last=1, grace_seconds=0), a)

    assert gc().deleted_steps == [0]  # 1: leased; 2: a1 and mirror A2 stand there
    assert Catalog(root).committed_steps() == [1, 2, 3, 4]
    w.tree["a1"].call(**w.receive_req("tree", "a1"))
    leases.release(root, "reader", [1])
    assert gc().deleted_steps == [1]  # 2: mirror A2 still stands there
    w.mirrors["a2"].call(**w.mirror_req("a2"))
    assert gc().deleted_steps == [2]
    assert Catalog(root).committed_steps() == [3, 4]
    for rid in ("a2", "a3"):  # A2's receivers: from step 2 to 4
        w.tree[rid].call(**w.receive_req("tree", rid))
    for rid in ("a0", "a1", "a2", "a3"):
        assert_bits_equal(load_file(w.state("tree", rid)), w.cks[4])
    before = w.counts()["a"]["bytes_down"]
    again = w.mirrors["a"].call(**w.mirror_req("a"))["result"]
    assert again["copied_steps"] == [] and again["present_steps"] == [3, 4]  # 0-2, deleted by gc here, stay deleted
    assert w.counts()["a"]["bytes_down"] - before < 16 << 10  # listings and markers only
