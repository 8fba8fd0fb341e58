"""Streaming during construction: receivers fetch a step's chunks while it is published, apply
them only after the commit, and end exactly where a dense refit ends, whatever fails on the way.

The follower runs in a thread of the test (``flows.receive.follow`` with ``Streaming``) or as a
``dcr receive --follow --stream`` process; publishers are slowed per stored object (a ``sleep``
failpoint: per chunk, or per pack of a packed step cut into small packs) so that the follower
really fetches before the commit, and every test asserts that it did (chunks prefetched, taken by
the refit). A packed step's chunks are announced when their pack lands: with the default 8 MiB
packs a test step is one pack, written last, so tests that need chunks landing over time use
small packs (``PACKED``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass

import pytest
from safetensors.torch import load_file

from dcr_core import events
from dcr_core.errors import IntegrityError, StepConflictError
from flows import PublishOptions, run_materialize, run_publish, run_receive
from flows.receive.follow import follow
from flows.streaming import Streaming
from storage import layout, stream
from storage.catalog import Catalog
from storage.chunk_io import verified_as
from storage.held_chunks import PREFETCHED, Prefetched
from storage.root import Root, RootRef
from tests.support.fault_report import FaultCase
from tests.support.helpers import assert_bits_equal, chain_of_steps, file_bytes
from tests.support.kill import REPO, kill_at
from tests.support.procs import Lines, reported
from tests.support.servers import S3_BUCKET

CHUNK_BYTES = 256
SLOW = "chunk.stored@*=sleep(0.02)"  # a publisher slow enough that a follower fetches before its commit


@dataclass(frozen=True)
class Layout:
    """How a test publishes its steps: ``pack_bytes`` (0: one object per chunk), and the failpoint
    that spreads their stored objects over time so a follower fetches before the commit."""

    name: str
    pack_bytes: int
    slow: str

    def __str__(self) -> str:
        return self.name


PER_OBJECT = Layout("per-object", 0, SLOW)
PACKED = Layout("packed", 4 * CHUNK_BYTES, "pack.stored@*=sleep(0.05)")  # a test step: about 7 packs
LAYOUTS = [PER_OBJECT, PACKED]


def opts(tmp_path, packing: Layout | None = None, **kw) -> PublishOptions:
    packs = {} if packing is None else {"pack_bytes": packing.pack_bytes}
    return PublishOptions(**{"chunk_bytes": CHUNK_BYTES, "cache_dir": str(tmp_path / "cache"), **packs, **kw})


class Points:
    """Every point reached in this process, in order, with its fields."""

    def __init__(self):
        self.seen: list[tuple[str, dict]] = []
        self._cond = threading.Condition()

    def __call__(self, point: str, fields: dict) -> None:
        with self._cond:
            self.seen.append((point, dict(fields)))
            self._cond.notify_all()

    def count(self, point: str) -> int:
        with self._cond:
            return sum(1 for p, _ in self.seen if p == point)

    def first(self, point: str) -> int:
        with self._cond:
            return next(i for i, (p, _) in enumerate(self.seen) if p == point)

    def wait_for(self, point: str, n: int = 1, timeout: float = 60) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: sum(1 for p, _ in self.seen if p == point) >= n, timeout):
                raise AssertionError(f"{point} reached {sum(1 for p, _ in self.seen if p == point)} times, not {n}")

    def wait_for_next(self, point: str, timeout: float = 60) -> None:
        """Until ``point`` is reached once more than it has been so far (a follower that looked
        again: whatever it would have done by now, it did)."""
        self.wait_for(point, self.count(point) + 1, timeout)


class Follower(threading.Thread):
    """A streaming follower of ``root`` in a thread, until its state holds ``until``."""

    def __init__(self, root: str, state, until: int, options: dict | None = None):
        super().__init__(daemon=True)
        self.root, self.state, self.until = root, str(state), until
        self.streaming = Streaming(RootRef(root, options or {}))
        self.options = options or {}
        self.results: list[dict] = []
        self.error: BaseException | None = None
        self.polling = threading.Event()
        watch = self.streaming.watch

        def watched(held):
            watch(held)
            self.polling.set()

        self.streaming.watch = watched

    def start(self) -> None:
        """Start, and return once the follower polls ROOT (so a publish that follows is streamed)."""
        super().start()
        assert self.polling.wait(60), "the follower never polled"

    def run(self) -> None:
        def receive(step):
            return run_receive(self.root, "follower", self.state, step, self.options).__dict__

        try:
            for res in follow(RootRef(self.root, self.options), self.state, receive, 0.02, self.until,
                              stream=self.streaming):
                self.results.append(res)
        except BaseException as e:  # noqa: BLE001 - reported by finish()
            self.error = e

    def finish(self, timeout: float = 120) -> list[dict]:
        self.join(timeout)
        assert not self.is_alive(), "the follower did not reach its step"
        if self.error is not None:
            raise self.error
        return self.results


@contextlib.contextmanager
def publishing_slowly(root: str, ck: dict, step: int, tmp_path, packing: Layout):
    """Publish ``ck`` as ``step`` in a thread, laid out as ``packing`` (its stored objects spread
    over time), and held after its manifest, before its commit, until the block ends; yields an
    event set once the publish returned (a kill test asserts it was still running), releases and
    joins it on exit.

    The hold is what makes a kill "mid-stream" on any machine: a follower or mirror process started
    in the block needs seconds to import under load, and without it the publish could commit before
    the process first looked (it would then never reach a streaming point and wait for good)."""
    done, release = threading.Event(), threading.Event()

    def hold(point: str, fields: dict) -> None:
        if point == "publish.manifest-written":
            release.wait(300)

    def publish():
        with events.listening(hold), events.failpoints(packing.slow):
            run_publish(root, ck, step, options=opts(tmp_path, packing, io_workers=2))
        done.set()

    t = threading.Thread(target=publish)
    t.start()
    try:
        yield done
    finally:
        release.set()
        t.join(120)


def dcr(*args, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """``dcr ARGS`` in a process of its own, in-process orchestration."""
    out = subprocess.run([sys.executable, "-m", "flows.cli", *map(str, args)], cwd=REPO, capture_output=True,
                         text=True, env={**os.environ, "DCR_ORCHESTRATOR": "none", **kw.pop("env", {})}, **kw)
    assert not check or out.returncode == 0, out.stderr
    return out


def _setup(tmp_path, seed: int, n: int = 3):
    root = str(tmp_path / "root")
    cks = chain_of_steps(n, seed=seed)
    run_publish(root, cks[0], 0, options=opts(tmp_path))
    state = tmp_path / "follower.safetensors"
    run_receive(root, "follower", str(state), step=0)
    return root, cks, state


def _dense(root: str, step: int, tmp_path) -> dict:
    out = tmp_path / f"dense-{step}-{uuid.uuid4().hex[:6]}.safetensors"
    run_materialize(root, step, str(out))
    return load_file(out)


def _prefetch_gets(monkeypatch) -> list[str]:
    """The keys of the ranged GETs the prefetchers' pools make from now on (packed chunks)."""
    gets: list[str] = []
    real = Root.read_range

    def counting(self, key, start, length):
        if threading.current_thread().name.startswith("dcr-prefetch"):
            gets.append(key)
        return real(self, key, start, length)

    monkeypatch.setattr(Root, "read_range", counting)
    return gets


@pytest.mark.parametrize("packing", LAYOUTS, ids=str)
def test_a_streamed_refit_fetches_before_the_commit_and_ends_bit_exact(tmp_path, monkeypatch, packing):
    root, cks, state = _setup(tmp_path, seed=41)
    points = Points()
    hits = PREFETCHED.hits
    gets = _prefetch_gets(monkeypatch)
    with events.listening(points):
        f = Follower(root, state, until=2)
        f.start()
        with events.failpoints(packing.slow):
            run_publish(root, cks[1], 1, options=opts(tmp_path, packing))
            run_publish(root, cks[2], 2, options=opts(tmp_path, packing))
        results = f.finish()
    assert [r["step"] for r in results][-1] == 2
    got = load_file(state)
    assert_bits_equal(got, cks[2])
    assert_bits_equal(got, _dense(root, 2, tmp_path))  # the dense refit's bits, every tensor
    # Chunks really were fetched before their step's commit, and the refit used them.
    assert points.count("stream.chunk-prefetched") > 10
    assert points.first("stream.chunk-prefetched") < points.first("publish.committed")
    assert PREFETCHED.hits > hits
    assert [s for s, _ in f.streaming.started] == [1, 2]
    assert PREFETCHED.bytes_held == 0  # nothing left behind
    prefetched = [fields["key"] for p, fields in points.seen if p == "stream.chunk-prefetched"]
    if packing.pack_bytes:  # each chunk a range of a pack, fetched with its neighbours: a GET per run, not per chunk
        assert all(f"/{layout.PACKS}/" in k for k in prefetched)
        assert 0 < len(gets) < len(prefetched) / 2, (len(gets), len(prefetched))
    else:
        assert not gets and not any(f"/{layout.PACKS}/" in k for k in prefetched)


@pytest.mark.parametrize("pack_bytes", [0, PACKED.pack_bytes, 8 << 20], ids=["per-object", "packed", "one-pack"])
def test_the_publisher_exposes_its_attempt_and_every_stored_chunk(tmp_path, pack_bytes):
    """Every stored chunk is in a stream index, where it is stored (a packed chunk: with its pack's
    size): also those of the last pack, written once every chunk is encoded (with 8 MiB packs, the
    whole step)."""
    root, cks, _ = _setup(tmp_path, seed=42)
    res = run_publish(root, cks[1], 1, options=opts(tmp_path, pack_bytes=pack_bytes))
    r = Root(root)
    b = stream.read_building(r)
    assert (b.step, b.attempt) == (1, res.attempt)
    listed, seq, last = {}, 0, False
    while not last:
        idx = stream.read_index(r, 1, res.attempt, seq)
        assert idx is not None, f"stream index {seq} missing before the last"
        listed.update({(c.tensor, c.index): (c.digest, c.nbytes, c.location(1, res.attempt), c.pack_bytes)
                       for c in idx.chunks})
        seq, last = seq + 1, idx.last
    assert stream.read_index(r, 1, res.attempt, seq) is None
    m = Catalog(r).manifest(1)
    stored, sizes = {}, m.packs()
    for name, e in m.tensors.items():
        for pos in range(e.n_stored):
            key, index, digest, nbytes = e.stored_at(pos)
            size = sizes[e.chunks.packs[pos]] if e.chunks.packs else 0  # announced with it: a mirror forwards it whole
            stored[name, index] = (digest, nbytes, (layout.store_key(1, res.attempt, key), e.offset_at(pos)), size)
    packs = len(m.packs())
    assert {0: packs == 0, PACKED.pack_bytes: packs > 1, 8 << 20: packs == 1}[pack_bytes], packs
    assert listed == stored  # every chunk the manifest names, with the same digest, size and place; nothing else
    # Turned off, nothing is exposed.
    run_publish(root, cks[2], 2, options=opts(tmp_path, stream=False))
    assert stream.read_building(r).step == 1
    assert not r.objects(layout.attempt_dir(2, Catalog(r).marker(2).attempt) + "/stream")


STREAM_FAULTS = [
    FaultCase("streaming", "publisher killed after its first stream index",
              "the follower's state untouched; prefetched chunks never applied; the retry's bits, exactly"),
    FaultCase("streaming", "publisher killed after its last stream index, before the manifest",
              "the follower's state untouched; prefetched chunks never applied; the retry's bits, exactly"),
    FaultCase("streaming", "publisher killed after the manifest, before the commit marker",
              "the follower's state untouched; prefetched chunks never applied; the retry's bits, exactly"),
]


@pytest.mark.faults("streaming")
@pytest.mark.parametrize("case", STREAM_FAULTS, ids=str)
def test_a_publisher_dying_mid_stream_leaves_followers_untouched(case, tmp_path):
    """The dead attempt published other bits than the retry: a follower that applied anything of it
    could not end at the retry's bits. (Packed steps, the default layout, in small packs so that the
    first index comes before the last pack.)"""
    root, cks, state = _setup(tmp_path, seed=43)
    before = file_bytes(state)
    other = chain_of_steps(2, seed=99)[1]  # the dead attempt's bits (same names, dtypes and shapes)
    other = {n: other[n] if n in other else t for n, t in cks[1].items()}
    point = ["stream.index-written@1", "publish.tensors-stored", "publish.manifest-written"][STREAM_FAULTS.index(case)]
    points = Points()
    with events.listening(points):
        f = Follower(root, state, until=1)
        f.start()
        with events.failpoints(f"{PACKED.slow},{point}=raise"), pytest.raises(events.FailpointError):
            run_publish(root, other, 1, options=opts(tmp_path, PACKED))
        points.wait_for("stream.chunk-prefetched")
        points.wait_for_next("follow.waiting")  # it looked for a commit again, and found none
        assert f.is_alive() and file_bytes(state) == before  # nothing applied: no commit
        assert Catalog(Root(root)).committed_steps() == [0]
        dead = f.streaming.started[-1][1]
        with events.failpoints(PACKED.slow):
            res = run_publish(root, cks[1], 1, options=opts(tmp_path, PACKED))  # the retry: a new attempt
        f.finish()
    assert res.attempt != dead
    assert_bits_equal(load_file(state), cks[1])
    # It streamed the dead attempt first (and the retry too, if it saw the retry's announcement
    # before the commit); nothing of the dead one was left held or used.
    assert [a for _, a in f.streaming.started][0] == dead
    assert not [k for (u, k) in list(PREFETCHED._held) if dead in k]  # dropped, never taken


@pytest.mark.faults("streaming", component="streaming",
                    outcome="the follower streams the announced attempt; it loses; the winner's bits, exactly")
def test_a_follower_streaming_the_losing_attempt_applies_the_winner(tmp_path):
    root, cks, state = _setup(tmp_path, seed=44)
    loser = {n: t.clone() for n, t in chain_of_steps(2, seed=98)[1].items() if n in cks[1]}
    loser = {n: loser.get(n, t) for n, t in cks[1].items()}
    points = Points()
    go = threading.Event()
    conflicts: list[StepConflictError] = []

    def slow_loser():  # announces and streams, then waits at its manifest until the winner committed
        try:
            run_publish(root, loser, 1, options=opts(tmp_path, PACKED, io_workers=2))
        except StepConflictError as e:
            conflicts.append(e)

    with events.listening(points):
        f = Follower(root, state, until=1)
        f.start()
        real_reached = events.reached

        t = threading.Thread(target=slow_loser)
        # Hold the loser right after its manifest (its thread only), until the winner has committed.
        def hold(point, **fields):
            if point == "publish.manifest-written" and threading.current_thread() is t:
                go.wait(60)
            return real_reached(point, **fields)

        events.reached = hold
        try:
            slow = events.failpoints(PACKED.slow)
            slow.__enter__()
            t.start()
            points.wait_for("stream.chunk-prefetched")
            winner = run_publish(root, cks[1], 1, options=opts(tmp_path, PACKED, stream=False))
            go.set()
            t.join(60)
            slow.__exit__(None, None, None)
        finally:
            events.reached = real_reached
        f.finish()
    assert len(conflicts) == 1
    assert Catalog(Root(root)).marker(1).attempt == winner.attempt
    assert f.streaming.started and f.streaming.started[0][1] != winner.attempt  # it streamed the loser
    assert_bits_equal(load_file(state), cks[1])


@pytest.mark.faults("streaming", component="security",
                    outcome="chunks named by a forged index are refused on arrival; the refit reads them; bit-exact")
def test_a_forged_announcement_or_index_changes_nothing(tmp_path):
    """building.json and the indexes are hints: a forged index naming wrong digests gets its chunks
    refused by the prefetch, and the refit reads them itself."""
    root, cks, state = _setup(tmp_path, seed=45)
    before = file_bytes(state)
    r = Root(root)
    res = run_publish(root, cks[1], 1, options=opts(tmp_path))
    seq = 0  # every index of the committed attempt rewritten with another digest per chunk
    while (idx := stream.read_index(r, 1, res.attempt, seq)) is not None:
        bad = [stream.StreamedChunk(c.tensor, c.dtype, c.grid, c.key_in_store, c.index, "0" * 64, c.nbytes, c.pack,
                                    c.offset) for c in idx.chunks]
        r.write(layout.stream_key(1, res.attempt, seq),
                stream.StreamIndex(1, res.attempt, seq, idx.codec, tuple(bad), idx.last).to_json())
        seq += 1
    r.write(layout.BUILDING, b'{"format": "dcr-building", "step": 7, "attempt": "not hex"}')
    assert stream.read_building(r) is None  # malformed: ignored
    r.write(layout.BUILDING, stream.Building(1, res.attempt).to_json())
    marker = r.read(layout.commit_key(1))
    r.remove(layout.commit_key(1))  # as if the step were still being published
    hits = PREFETCHED.hits
    points = Points()
    with events.listening(points):
        f = Follower(root, state, until=1)
        f.start()
        points.wait_for("stream.index-read", seq)
        points.wait_for_next("follow.waiting")  # it looked for a commit again, and found none
        assert file_bytes(state) == before and f.is_alive()
        assert r.create_if_absent(layout.commit_key(1), marker)
        f.finish()
    assert points.count("stream.chunk-prefetched") == 0  # every forged chunk refused on arrival
    assert PREFETCHED.hits == hits
    assert_bits_equal(load_file(state), cks[1])


def test_prefetched_chunks_are_used_only_as_verified_and_within_budget():
    store = Prefetched(budget=100)
    from concurrent.futures import Future

    def done(data: bytes) -> Future:
        f = Future()
        f.set_result(data)
        return f

    v = ("d" * 64, 60, "F32", 16, 0, 16, "{}")
    stopped = threading.Event()
    assert store.reserve(60, stopped)
    store.put("u", "k1", v, done(b"x" * 60), 60)
    assert store.take("u", "k1", (*v[:-1], '{"other": 1}')) is None  # another codec: not used, and gone
    assert ("u", "k1") not in store and store.bytes_held == 0
    assert store.reserve(60, stopped)
    store.put("u", "k2", v, done(b"y" * 60), 60)
    stopped.set()
    assert not store.reserve(60, stopped)  # over budget: waits, and gives up once stopped
    assert store.take("u", "k2", v) == b"y" * 60 and store.bytes_held == 0
    failed = Future()
    failed.set_exception(OSError("connection reset"))
    assert store.reserve(10, stopped)
    store.put("u", "k3", v, failed, 10)
    assert store.take("u", "k3", v) is None  # a failed prefetch: the refit reads it itself
    assert store.drop("u") == 0 and store.bytes_held == 0


@pytest.mark.parametrize("pack", ["", "0123abcd.000000"], ids=["per-object", "packed"])
def test_a_prefetch_stopped_while_waiting_for_its_budget_leaves_no_bytes_reserved(tmp_path, pack):
    """A follower holds at most its budget: a prefetcher waits for room, and gives up once stopped
    (a newer attempt announced, the refit done). What it had reserved for chunks it was about to
    fetch (packed: a run of back-to-back chunks, fetched by one GET once the run ends) is released
    when it is closed, else the process's budget would shrink for good."""
    from dcr_core.chunking import ChunkGrid
    from flows.options import KEYFRAMES
    from storage.chunk_io import BoundedPool
    from storage.prefetch import Prefetcher

    grid = ChunkGrid((64,), (16,))
    chunks = tuple(stream.StreamedChunk("t", "U8", grid, f"t/c/{i}", i, "0" * 64, 10, pack, 10 * i) for i in range(4))
    idx = stream.StreamIndex(1, "a" * 32, 0, KEYFRAMES, chunks, True)
    store = Prefetched(budget=25)  # two chunks fit, the third waits
    p = Prefetcher(Root(str(tmp_path)), 1, "a" * 32, store=store, trusted={"t": ("U8", grid)})
    p.stopped.set()
    with BoundedPool(2) as pool:
        assert not p.take(idx, pool)
    p.close()
    assert store.bytes_held == 0


def test_verified_as_names_everything_a_check_depends_on():
    from dcr_core.chunking import ChunkGrid
    from flows.options import SPARSE_DELTAS

    g = ChunkGrid((10, 7), (3, 7))
    a = verified_as(SPARSE_DELTAS, "F32", g, 3, "a" * 64, 12)
    assert a != verified_as(SPARSE_DELTAS, "I32", g, 3, "a" * 64, 12)
    assert a != verified_as(SPARSE_DELTAS, "F32", g, 2, "a" * 64, 12)
    assert a != verified_as(SPARSE_DELTAS, "F32", ChunkGrid((10, 7), (2, 7)), 3, "a" * 64, 12)


# -- processes: a real follower on the moto S3 server, kill -9 of a streaming follower ---------------------


def _follower_cmd(root: str, state, *extra) -> list[str]:
    return ["receive", root, "--receiver", "follower", "--state", str(state), "--follow", "--stream",
            "--interval", "0.05", "--until-step", "1", *extra]


@pytest.mark.backend
def test_a_streaming_follower_process_on_s3(s3_server, tmp_path):
    root = f"s3://{S3_BUCKET}/stream-{uuid.uuid4().hex[:8]}"
    cks = chain_of_steps(2, seed=46)
    run_publish(root, cks[0], 0, options=opts(tmp_path, chunk_bytes=4096))
    state = tmp_path / "follower.safetensors"
    run_receive(root, "follower", str(state), step=0)
    env = {**os.environ, "DCR_ORCHESTRATOR": "none", "DCR_FAILPOINTS": "follow.waiting=report"}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *_follower_cmd(root, state, "--json")], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err = Lines(proc.stderr)
    err.wait_for(reported("follow.waiting"))  # it has looked once, found nothing new, and polls
    with events.failpoints(PACKED.slow):  # packs landing over time, fetched by ranged GETs
        run_publish(root, cks[1], 1, options=opts(tmp_path, PACKED, io_workers=2))
    out = proc.stdout.read()
    assert proc.wait(timeout=120) == 0, err.text()
    res = json.loads(out)
    assert res["step"] == 1 and res["prefetched"]["chunks"] > 10, res
    assert_bits_equal(load_file(state), cks[1])


@pytest.mark.faults("streaming", component="process",
                    outcome="kill -9 of a streaming follower mid-prefetch: state byte-identical; a restart ends bit-exact")
def test_kill_9_of_a_streaming_follower_mid_prefetch(tmp_path):
    root, cks, state = _setup(tmp_path, seed=47, n=2)
    before = file_bytes(state)
    with publishing_slowly(root, cks[1], 1, tmp_path, PACKED) as done:
        kill_at("stream.chunk-prefetched@3", *_follower_cmd(root, state))
        assert not done.is_set(), "the publish ended before the follower was killed: not mid-stream"
        assert file_bytes(state) == before
    assert Catalog(Root(root)).committed_steps() == [0, 1]
    assert file_bytes(state) == before
    dcr(*_follower_cmd(root, state), timeout=120)
    assert_bits_equal(load_file(state), cks[1])


@pytest.mark.parametrize("packing", LAYOUTS, ids=str)
def test_a_streaming_mirror_forwards_while_upstream_publishes(tmp_path, packing):
    """origin -> (dcr mirror --follow --stream) -> region; a follower of the region streams from it.
    The origin's publish is held before its commit until the region's follower has fetched chunks
    from the region: the mirror forwarded them (and their indexes) before the commit (a packed
    step: each pack whole, once its announced chunks tile it), and the region commits only after
    the origin did; the region's follower ends exact."""
    root, cks, _ = _setup(tmp_path, seed=48)
    region = str(tmp_path / "region")
    seen = "follow.waiting=report,mirror.pack-forwarded=report,stream.chunk-prefetched=report"
    env = {**os.environ, "DCR_ORCHESTRATOR": "none", "DCR_FAILPOINTS": seen}
    dcr("mirror", root, region)
    state = tmp_path / "region-follower.safetensors"
    run_receive(region, "follower", str(state), step=0)
    mirror = subprocess.Popen([sys.executable, "-m", "flows.cli", "mirror", root, region, "--follow", "--stream",
                               "--interval", "0.1", "-q"], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    err = Lines(mirror.stderr)
    try:
        err.wait_for(reported("follow.waiting"))  # it has looked upstream once and polls
        points = Points()
        with events.listening(points):
            f = Follower(region, state, until=1)
            f.start()
            with publishing_slowly(root, cks[1], 1, tmp_path, packing) as done:
                points.wait_for("stream.chunk-prefetched", 6)  # from the region, forwarded there before the commit
                assert not done.is_set()
            f.finish()
    finally:
        mirror.kill()
        mirror.wait()
    assert points.first("stream.chunk-prefetched") < points.first("publish.committed")
    if packing.pack_bytes:
        assert reported("mirror.pack-forwarded") in err.text()
    attempt = Catalog(Root(root)).marker(1).attempt
    assert f.streaming.started == [(1, attempt)]
    assert Catalog(Root(region)).marker(1).attempt == attempt
    assert_bits_equal(load_file(state), cks[1])
    assert_bits_equal(load_file(state), _dense(root, 1, tmp_path))


def _forged_pack(forgery: str, chunks: list[stream.StreamedChunk], size: int) -> list[stream.StreamedChunk]:
    """The announcements of one pack's chunks (``chunks``, in pack order; ``size`` bytes), forged."""
    if forgery == "gap":  # announced one byte larger: its last byte covered by no chunk
        return [dataclasses.replace(c, pack_bytes=size + 1) for c in chunks]
    if forgery == "overlap":  # the last chunk moved one byte back, over its neighbour: no byte past it
        return chunks[:-1] + [dataclasses.replace(chunks[-1], offset=chunks[-1].offset - 1)]
    if forgery == "short":  # its last chunk left out, the pack announced as the chunks before it
        return [dataclasses.replace(c, pack_bytes=chunks[-1].offset) for c in chunks[:-1]]
    assert forgery == "digest"
    return [dataclasses.replace(chunks[0], digest="0" * 64)] + chunks[1:]


@pytest.mark.faults("streaming", component="security",
                    outcome="a pack its announced chunks do not tile, or with a chunk off its digest, is not forwarded; "
                    "the mirror then copies the origin's bytes, checked")
@pytest.mark.parametrize("forgery", ["gap", "overlap", "short", "digest"])
def test_a_forged_pack_announcement_forwards_nothing_wrong(tmp_path, forgery):
    """A streaming mirror is told of a pack by announcements forged or left partial: its chunks do
    not tile it (a byte covered by none, two overlapping), the pack is larger than announced, or a
    chunk's digest is not its bytes'. That pack is never written downstream nor listed in a
    downstream index (a gap or an overlap: the other packs still are; a pack that fails its read or
    check ends the forwarding, as a chunk does), whatever is downstream is the origin's bytes, and
    the mirror then commits the step exactly."""
    from flows.maintenance.mirror import run_mirror
    from flows.maintenance.mirror_stream import Forwarder
    from storage.chunk_io import BoundedPool

    root, cks, state = _setup(tmp_path, seed=54, n=2)
    region = str(tmp_path / "region")
    run_mirror(root, region)
    src, dst = Root(root), Root(region)
    attempt = run_publish(root, cks[1], 1, options=opts(tmp_path, PACKED)).attempt
    sizes = Catalog(src).manifest(1).packs()
    victim = max(sizes, key=sizes.get)
    indexes = []
    while (idx := stream.read_index(src, 1, attempt, len(indexes))) is not None:
        indexes.append(idx)
    announced = sorted((c for idx in indexes for c in idx.chunks if c.pack == victim), key=lambda c: c.offset)
    assert len(announced) > 1 and all(c.pack_bytes == sizes[victim] for c in announced)
    forged = {c.key_in_store: c for c in _forged_pack(forgery, announced, sizes[victim])}
    trusted = {n: (e.dtype, e.grid) for n, e in Catalog(src).manifest(0).tensors.items()}
    forwarder = Forwarder(src, dst, 1, attempt, workers=2, trusted=trusted)
    forwarder.begin()
    with BoundedPool(2) as pool:
        for idx in indexes:
            chunks = tuple(forged[c.key_in_store] if c.pack == victim else c for c in idx.chunks
                           if c.pack != victim or c.key_in_store in forged)
            try:
                forwarder.take(dataclasses.replace(idx, chunks=chunks), pool)
            except IntegrityError as e:  # the pack that is not as announced: the forwarding ends there
                assert forgery in ("short", "digest") and victim in str(e), e
                break
        else:
            assert forgery in ("gap", "overlap")
    down = {o.key for o in dst.objects(layout.attempt_dir(1, attempt)) if "/stream/" not in o.key}
    forwarded = {k.rsplit("/", 1)[1] for k in down if f"/{layout.PACKS}/" in k}
    assert victim not in forwarded and (forgery in ("short", "digest") or forwarded == set(sizes) - {victim})
    assert all(dst.read(key) == src.read(key) for key in down)  # the origin's bytes, checked
    for seq in range(len(indexes)):  # downstream indexes list only what was forwarded
        listed = stream.read_index(dst, 1, attempt, seq)
        assert listed is None or {c.pack for c in listed.chunks} <= forwarded
    run_mirror(root, region)
    run_receive(region, "follower", str(state))
    assert_bits_equal(load_file(state), cks[1])


def test_a_stream_index_bounds_each_packed_chunk_by_its_pack_size():
    """The pack size announced with a packed chunk is optional (indexes written before it parse,
    the size unknown: 0) and, when given, holds the chunk: one ending past it is refused."""
    from dcr_core.chunking import ChunkGrid
    from dcr_core.errors import DCRError
    from flows.options import KEYFRAMES

    grid = ChunkGrid((8,), (4,))
    chunks = tuple(stream.StreamedChunk("t", "U8", grid, f"t/c/{i}", i, "0" * 64, 10, "0123abcd.000000", 10 * i, 20)
                   for i in range(2))
    idx = stream.StreamIndex(1, "a" * 32, 0, KEYFRAMES, chunks, True)
    assert stream.index_at(idx.to_json(), "i", 1, "a" * 32, 0) == idx
    older = json.loads(idx.to_json())
    del older["arrays"]["t"]["pack_bytes"]
    assert [c.pack_bytes for c in stream.StreamIndex.from_json(json.dumps(older).encode(), "i").chunks] == [0, 0]
    for bad in ([20, 19], [20], [20, "20"], [20, 1 << 41]):
        forged = json.loads(idx.to_json())
        forged["arrays"]["t"]["pack_bytes"] = bad
        with pytest.raises(DCRError, match="i array 't'"):
            stream.StreamIndex.from_json(json.dumps(forged).encode(), "i")


@pytest.mark.faults("streaming", component="process",
                    outcome="kill -9 of a streaming mirror mid-forward: nothing visible downstream; a rerun commits it exactly")
def test_kill_9_of_a_streaming_mirror_mid_forward(tmp_path):
    root, cks, _ = _setup(tmp_path, seed=49, n=2)
    region = str(tmp_path / "region")
    dcr("mirror", root, region)
    # One object per chunk: forwarded chunk by chunk, so the kill lands between forwarded objects
    with publishing_slowly(root, cks[1], 1, tmp_path, PER_OBJECT) as done:
        kill_at("mirror.index-forwarded@1", "mirror", root, region, "--follow", "--stream", "--interval", "0.05")
        assert not done.is_set(), "the publish ended before the mirror was killed: not mid-stream"
    r = Root(region)
    assert Catalog(r).committed_steps() == [0]  # forwarded chunks and an index, never a marker
    attempt = Catalog(Root(root)).marker(1).attempt
    assert r.objects(layout.attempt_dir(1, attempt) + "/stream")
    dcr("mirror", root, region)
    out = tmp_path / "region-1.safetensors"
    run_materialize(region, 1, str(out))
    assert_bits_equal(load_file(out), cks[1])


def test_follow_receive_streams_from_python(tmp_path):
    from flows import follow_receive

    root, cks, state = _setup(tmp_path, seed=50, n=2)
    got, points = [], Points()
    t = threading.Thread(target=lambda: got.extend(follow_receive(root, "follower", str(state), stream=True,
                                                                  interval=0.02, until_step=1)))
    with events.listening(points):
        t.start()
        points.wait_for("follow.waiting")  # it polls
        with events.failpoints(SLOW):
            run_publish(root, cks[1], 1, options=opts(tmp_path))
        t.join(60)
    assert [r.step for r in got] == [1]
    assert_bits_equal(load_file(state), cks[1])


@pytest.mark.faults("streaming", component="process",
                    outcome="kill -9 of a streaming publisher: the follower's state untouched; the rerun's bits, exactly")
def test_kill_9_of_a_publisher_process_while_a_follower_streams(tmp_path):
    from tests.support.helpers import write_safetensors

    root, cks, state = _setup(tmp_path, seed=51, n=2)
    before = file_bytes(state)
    ck = tmp_path / "step1.safetensors"
    write_safetensors(ck, cks[1])
    env = {"DCR_CACHE_DIR": str(tmp_path / "cache")}
    points = Points()
    with events.listening(points):
        f = Follower(root, state, until=1)
        f.start()
        kill_at("stream.index-written@1", "publish", root, ck, "--step", "1", "--chunk-bytes", CHUNK_BYTES, env=env)
        points.wait_for("stream.index-read")  # the follower read what the dead publisher exposed
        points.wait_for_next("follow.waiting")  # and looked for a commit again, finding none
        assert f.is_alive() and file_bytes(state) == before
        dcr("publish", root, ck, "--step", 1, "--chunk-bytes", CHUNK_BYTES, env=env, timeout=120)
        f.finish()
    assert_bits_equal(load_file(state), cks[1])
    committed = Catalog(Root(root)).marker(1).attempt
    assert f.streaming.started[0][1] != committed  # it streamed the dead attempt; the rerun's bits won


@pytest.mark.backend
def test_a_streaming_relay_between_two_s3_servers(s3_server, tmp_path):
    """origin (the session's S3 server) -> dcr mirror --follow --stream -> region (a second server with
    its own endpoint and credentials) -> a streaming follower of the region: the follower fetches
    before the origin's commit, and ends bit-exact (one object per chunk; packs are forwarded as
    ``test_a_streaming_mirror_forwards_while_upstream_publishes`` shows)."""
    import boto3
    from moto.server import ThreadedMotoServer

    second = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    second.start()
    mirror = None
    try:
        host, port = second.get_host_and_port()
        region_opts = {"endpoint_url": f"http://{host}:{port}", "key": "region-b", "secret": "b-secret"}
        boto3.client("s3", endpoint_url=region_opts["endpoint_url"], aws_access_key_id="region-b",
                     aws_secret_access_key="b-secret", region_name="us-east-1").create_bucket(Bucket="region-b")
        root = f"s3://{S3_BUCKET}/origin-{uuid.uuid4().hex[:8]}"
        region = f"s3://region-b/mirror-{uuid.uuid4().hex[:8]}"
        cks = chain_of_steps(2, seed=52)
        run_publish(root, cks[0], 0, options=opts(tmp_path, chunk_bytes=4096))
        env = {**os.environ, "DCR_ORCHESTRATOR": "none", "DCR_FAILPOINTS": "follow.waiting=report"}
        dst = [x for k, v in region_opts.items() for x in ("--dst-storage-option", f"{k}={v}")]
        dcr("mirror", root, region, *dst)
        state = tmp_path / "region-follower.safetensors"
        run_receive(region, "follower", str(state), step=0, storage_options=region_opts)
        mirror = subprocess.Popen([sys.executable, "-m", "flows.cli", "mirror", root, region, *dst, "--follow",
                                   "--stream", "--interval", "0.1", "-q"], cwd=REPO, env=env, stderr=subprocess.PIPE,
                                  text=True)
        Lines(mirror.stderr).wait_for(reported("follow.waiting"))  # it has looked upstream once and polls
        points = Points()
        with events.listening(points):
            f = Follower(region, state, until=1, options=region_opts)
            f.start()
            with events.failpoints("chunk.stored@*=sleep(0.05)"):
                res = run_publish(root, cks[1], 1, options=opts(tmp_path, PER_OBJECT, io_workers=2))
            f.finish()
        assert points.count("stream.chunk-prefetched") > 5
        assert points.first("stream.chunk-prefetched") < points.first("publish.committed")
        assert f.streaming.started == [(1, res.attempt)]
        assert_bits_equal(load_file(state), cks[1])
    finally:
        if mirror is not None:
            mirror.kill()
            mirror.wait()
        second.stop()


@pytest.mark.faults("streaming", component="security",
                    outcome="a forged stream index costs the follower no memory: its peak RSS stays under 400 MiB")
@pytest.mark.parametrize("follower", ["receive", "mirror"])
def test_a_forged_stream_index_cannot_make_a_follower_allocate(tmp_path, follower):
    """Someone who can write the bucket but holds no key forges ``building.json`` and a stream index
    naming four arrays of 2**26-2**28 BF16 elements, each backed by a few KiB that decompress to
    that size (0.1-0.5 GB each). A ``dcr receive --follow --stream`` follower (or ``dcr mirror
    --follow --stream``) reads the index and decodes none of it (no such tensor in the step it
    holds, nor such a grid): its peak resident memory stays under 400 MiB (HEAD 6d19cce: several
    GB), and a real step then arrives exactly."""
    import numpy as np

    from dcr_core.chunking import ChunkGrid
    from flows.options import KEYFRAMES
    from storage.stream import Building, StreamedChunk, StreamIndex

    root, cks, state = _setup(tmp_path, seed=53, n=2)
    r = Root(root)
    attempt = "f" * 32
    chunks = []
    for i, n in enumerate((1 << 26, 1 << 27, 1 << 28, 1 << 28)):
        data = KEYFRAMES.encode(np.zeros(n, dtype=np.uint16))
        key_in_store = f"evil{i}/c/0"
        r.write(layout.store_key(1, attempt, key_in_store), data)
        chunks.append(StreamedChunk(f"evil.{i}", "BF16", ChunkGrid((n,), (n,)), key_in_store, 0, "0" * 64, len(data)))
    r.write(layout.stream_key(1, attempt, 0), StreamIndex(1, attempt, 0, KEYFRAMES, tuple(chunks), True).to_json())
    r.write(layout.BUILDING, Building(1, attempt).to_json())
    points = "stream.index-read=report,stream.chunk-skipped@4=report,mirror.committed@1=report"
    env = {**os.environ, "DCR_ORCHESTRATOR": "none", "DCR_FAILPOINTS": points}
    region = str(tmp_path / "region")
    if follower == "mirror":
        dcr("mirror", root, region, check=0)
    cmd = _follower_cmd(root, state) if follower == "receive" else \
        ["mirror", root, region, "--follow", "--stream", "--interval", "0.05"]
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *cmd], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        err = Lines(proc.stderr)
        err.wait_for(reported("stream.index-read"))  # it read the forged index...
        err.wait_for(reported("stream.chunk-skipped@4"))  # ...and passed over every chunk it names, decoding none
        peak = int(open(f"/proc/{proc.pid}/status").read().split("VmHWM:")[1].split()[0]) * 1024
        print(f"{follower} follower under a forged index: peak RSS {peak / 2**20:.0f} MiB")  # shown with -s
        assert peak < 400 << 20, f"peak RSS {peak >> 20} MiB"
        run_publish(root, cks[1], 1, options=opts(tmp_path))
        if follower == "receive":
            assert proc.wait(timeout=120) == 0, err.text()
        else:
            err.wait_for(reported("mirror.committed@1"))
    finally:
        if proc.poll() is None:
            proc.kill()
    if follower == "mirror":
        run_receive(region, "follower", str(state))
    assert_bits_equal(load_file(state), cks[1])
