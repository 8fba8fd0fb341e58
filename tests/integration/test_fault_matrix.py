"""The fault matrix: a fault at every point of the publisher and the receiver, and in storage and
the network. After each, the retry or restart ends bit-exact, and no reader ever sees a mix of two
steps. Rows of ``docs/fault-matrix.md`` (see ``tests/support/fault_report.py``).

A process death is simulated in-process by ``Killed`` (a ``BaseException``: no ``except
Exception`` handler or retry swallows it), raised from a hook at the chosen point; ``kill -9`` of
real processes is in ``tests/system/test_cli.py``. While a publisher is stopped at its fault point, the
hook itself reads ROOT as a receiver would and checks that it serves exactly the old step.
"""

from __future__ import annotations

import os
import uuid

import pytest
from safetensors.torch import load_file

from dcr_bench.netproxy import Proxy
from dcr_core import events
from dcr_core.errors import IntegrityError, StepConflictError
from flows import PublishOptions, ReceiveOptions, run_materialize, run_publish, run_receive
from flows.publish.baseline import BASELINE_FILE
from storage import layout
from storage.catalog import Catalog
from storage.local import patch_log
from storage.local.safetensors import StreamingSafetensorsWriter
from storage.root import Root
from tests.support.fault_report import FaultCase
from tests.support.helpers import assert_bits_equal, chain_of_steps, file_bytes
from tests.support.servers import S3_BUCKET

CHUNK_BYTES = 256
pytestmark = pytest.mark.faults("fault matrix")


class Killed(BaseException):
    """The process died here."""


def opts(tmp_path, **kw) -> PublishOptions:
    return PublishOptions(chunk_bytes=CHUNK_BYTES, cache_dir=str(tmp_path / "cache"), **kw)


def _is_chunk(key: str) -> bool:
    return "/data.zarr/" in key and "/c/" in key


def _is_pack(key: str) -> bool:
    return f"/data.zarr/{layout.PACKS}/" in key


class Hook:
    """Counts calls that match and runs ``action`` at the n-th one (the publisher's faults inject
    half-written objects, which no failpoint can)."""

    def __init__(self, n: int, action):
        self.n, self.action, self.seen = n, action, 0

    def hit(self) -> bool:
        self.seen += 1
        return self.seen == self.n


def _served(root: str, tmp_path) -> dict:
    """What a fresh reader gets for the latest committed step (a dense materialize)."""
    out = tmp_path / f"observe-{uuid.uuid4().hex[:6]}.safetensors"
    run_materialize(root, None, str(out))
    bits = load_file(out)
    out.unlink()
    return bits


# -- publisher ---------------------------------------------------------------------------------------

# Packed steps (the default) write a pack once it holds PACK_BYTES (here: a few chunks each, so a
# step has several packs); --pack-bytes 0 writes one object per chunk. The publisher is killed at
# the n-th such write: before it, half-way through it (half the object written), or after it.
PACK_BYTES = 1024
UPLOADS = {  # fault -> (pack_bytes, the writes counted, n, when)
    "killed before the first pack upload": (PACK_BYTES, _is_pack, 1, "before"),
    "killed while uploading a pack (half the object written)": (PACK_BYTES, _is_pack, 1, "half"),
    "killed after the first pack upload": (PACK_BYTES, _is_pack, 1, "after"),
    "killed after the 5th pack upload": (PACK_BYTES, _is_pack, 5, "after"),
    "killed before the first chunk upload (one object per chunk)": (0, _is_chunk, 1, "before"),
    "killed while uploading a chunk (one object per chunk, half the object written)": (0, _is_chunk, 2, "half"),
    "killed after the first chunk upload (one object per chunk)": (0, _is_chunk, 1, "after"),
    "killed after the 5th chunk upload (one object per chunk)": (0, _is_chunk, 5, "after"),
}
PUBLISHER = [
    *(FaultCase("publisher", fault, "nothing visible; a retry commits the step bit-exact") for fault in UPLOADS),
    FaultCase("publisher", "killed after every chunk, before the manifest", "nothing visible; a retry commits the step bit-exact"),
    FaultCase("publisher", "killed after the manifest, before the commit marker", "nothing visible; a retry commits the step bit-exact"),
    FaultCase("publisher", "killed right after the commit marker was created (reply lost)", "the step is committed and exact; a rerun reports it already committed"),
    FaultCase("publisher", "killed while patching its baseline cache in place after the commit", "the step is committed and exact; the half-patched cache is unstamped: the next delta hashes it, rebuilds it from ROOT and is exact"),
    FaultCase("publisher", "killed while copying a keyframe into its baseline cache after the commit", "the step is committed and exact; the next delta rebuilds the baseline from ROOT"),
]


@pytest.mark.parametrize("case", PUBLISHER, ids=str)
def test_publisher_fault_points(case, tmp_path, monkeypatch):
    root = str(tmp_path / "root")
    cks = chain_of_steps(4, seed=21)
    upload = UPLOADS.get(case.fault)
    options = opts(tmp_path) if upload is None else opts(tmp_path, pack_bytes=upload[0])
    for s in (0, 1):
        run_publish(root, cks[s], s, options=options)
    observed = []

    def die():
        observed.append(_served(root, tmp_path))  # a reader while the publisher is stopped here
        raise Killed(case.fault)

    real_write, real_create = Root.write, Root.create_if_absent
    which = PUBLISHER.index(case) - len(UPLOADS) + 4  # the cases after the uploads: 4 to 8 (the uploads below 4)
    if upload is not None:
        _, counted, n, when = upload
        hook = Hook(n, die)

        def write(self, key, data):
            if counted(key) and hook.hit():
                if when == "before":
                    die()
                if when == "half":
                    real_write(self, key, data[: len(data) // 2])
                    die()
                real_write(self, key, data)
                die()
            return real_write(self, key, data)

        monkeypatch.setattr(Root, "write", write)
    elif which in (4, 5):
        def write(self, key, data):
            if key.endswith(layout.MANIFEST):
                if which == 5:
                    real_write(self, key, data)
                die()
            return real_write(self, key, data)

        monkeypatch.setattr(Root, "write", write)
    elif which == 6:
        def create(self, key, data):
            made = real_create(self, key, data)
            raise Killed(case.fault) if made else AssertionError("marker not created")

        monkeypatch.setattr(Root, "create_if_absent", create)
    elif which == 7:
        real_apply = patch_log.apply

        def apply(path, target, meta, progress=None):
            def cut(i):
                if i == 1:  # the second record written: the cache holds part of the patch
                    raise Killed(case.fault)
            return real_apply(path, target, meta, cut)

        monkeypatch.setattr(patch_log, "apply", apply)
    else:
        real_w = StreamingSafetensorsWriter.write

        def cache_write(self, name, data):
            if BASELINE_FILE in self.path:
                raise Killed(case.fault)
            return real_w(self, name, data)

        monkeypatch.setattr(StreamingSafetensorsWriter, "write", cache_write)

    with pytest.raises(Killed):
        run_publish(root, cks[2], 2, keyframe=which == 8, options=options)
    monkeypatch.undo()
    for seen in observed:
        assert_bits_equal(seen, cks[1])  # never a mix of steps 1 and 2
    committed = Catalog(Root(root)).committed_steps()
    state = tmp_path / "r.safetensors"
    run_receive(root, "r", str(state))
    if which <= 5:
        assert committed == [0, 1]
        assert_bits_equal(load_file(state), cks[1])
        run_publish(root, cks[2], 2, options=options)  # the restart
    else:
        assert committed == [0, 1, 2]
        with pytest.raises(StepConflictError):
            run_publish(root, cks[2], 2, options=options)
    run_receive(root, "r", str(state))
    assert_bits_equal(load_file(state), cks[2])
    run_publish(root, cks[3], 3, options=options)  # the next delta (baseline cache rebuilt if lost)
    run_receive(root, "r", str(state))
    assert_bits_equal(load_file(state), cks[3])
    assert Catalog(Root(root)).manifest(3).base_step == 2


# -- receiver (state file) ---------------------------------------------------------------------------


def _receiver_at_step_0(tmp_path, seed: int):
    """Steps 0 and 1 published (of a 3-step chain), and a receiver's state file at step 0."""
    root = str(tmp_path / "root")
    cks = chain_of_steps(3, seed=seed)
    for s in (0, 1):
        run_publish(root, cks[s], s, options=opts(tmp_path))
    state = tmp_path / "r.safetensors"
    run_receive(root, "r", str(state), step=0)
    return root, cks, state


RECEIVER = [
    FaultCase("receiver", "killed while fetching (after the first chunk)", "state file byte-identical to before; a restart ends bit-exact"),
    FaultCase("receiver", "killed while fetching (after the 10th chunk)", "state file byte-identical to before; a restart ends bit-exact"),
    FaultCase("receiver", "killed while writing the new state (first tensor)", "state file byte-identical to before; a restart ends bit-exact"),
    FaultCase("receiver", "killed while writing the new state (a middle tensor)", "state file byte-identical to before; a restart ends bit-exact"),
    FaultCase("receiver", "killed before the atomic replace of the state file", "state file byte-identical to before; a restart ends bit-exact"),
    FaultCase("receiver", "killed after the replace, before its commit record", "state file holds the new step exactly; a restart records the commit"),
]


@pytest.mark.parametrize("case", RECEIVER, ids=str)
def test_receiver_fault_points(case, tmp_path, monkeypatch):
    root, cks, state = _receiver_at_step_0(tmp_path, seed=22)
    before = file_bytes(state)
    which = RECEIVER.index(case)
    # The point each case's process dies at (``dcr_core.events``): it reports reaching it, then raises.
    point = ["chunk.fetched@1", "chunk.fetched@10", "receive.tensor-staged@1", "receive.tensor-staged@20",
             "receive.staged", "receive.replaced"][which]
    reached = []
    with events.listening(lambda p, fields: reached.append(p)), events.failpoints(f"{point}=raise"):
        with pytest.raises(events.FailpointError):
            run_receive(root, "r", str(state), step=1)
    name, _, nth = point.partition("@")
    assert reached.count(name) >= int(nth or 1)  # it died where intended (read-ahead threads may fetch more)
    assert "receive.replaced" not in reached[:-1] and "receive.recorded" not in reached
    leftovers = [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    if which <= 4:
        assert file_bytes(state) == before
    else:
        assert_bits_equal(load_file(state), cks[1])
        assert "r" not in Catalog(Root(root)).receivers(1)
    res = run_receive(root, "r", str(state), step=1)  # the restart (also removes a killed writer's temp)
    assert_bits_equal(load_file(state), cks[1])
    assert "r" in Catalog(Root(root)).receivers(1)
    assert res.moves == ([] if which == 5 else ["forward:1"])
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p], leftovers


# -- storage (what the bucket holds) -----------------------------------------------------------------

STORAGE = [
    FaultCase("storage", "a stored chunk truncated", "refit refused naming the object; state unchanged"),
    FaultCase("storage", "a stored chunk with one flipped byte", "refit refused naming the object; state unchanged"),
    FaultCase("storage", "a stored chunk deleted", "refit refused naming the object; state unchanged"),
    FaultCase("storage", "a stale listing that misses the newest step", "the receiver gets the step it sees, exactly; the next poll gets the newest"),
    FaultCase("storage", "a listing that shows a step still being published (no marker)", "the step is ignored; the receiver stays on the latest committed step"),
]


@pytest.mark.parametrize("case", STORAGE, ids=str)
def test_storage_faults(case, tmp_path, monkeypatch):
    root, cks, state = _receiver_at_step_0(tmp_path, seed=23)
    before = file_bytes(state)
    which = STORAGE.index(case)
    r = Root(root)
    if which <= 2:
        m = Catalog(r).manifest(1)
        e = next(e for e in m.tensors.values() if len(e.chunks))
        key = layout.store_key(1, m.attempt, e.stored_at(0)[0])
        data = r.read(key)
        if which == 0:
            r.write(key, data[: len(data) // 2])
        elif which == 1:
            r.write(key, data[:-1] + bytes([data[-1] ^ 0x40]))
        else:
            r.remove(key)
        with pytest.raises(IntegrityError) as ei:
            run_receive(root, "r", str(state))
        assert key in str(ei.value) and len(str(ei.value).splitlines()) == 1
        assert file_bytes(state) == before
        return
    if which == 3:
        run_publish(root, cks[2], 2, options=opts(tmp_path))
        real = Root.listdir

        def stale(self, key, **kw):
            names = real(self, key, **kw)
            return [n for n in names if n != layout.step_dir(2).split("/")[-1]] if key == layout.STEPS else names

        monkeypatch.setattr(Root, "listdir", stale)
        assert run_receive(root, "r", str(state)).step == 1
        assert_bits_equal(load_file(state), cks[1])
        monkeypatch.undo()
        assert run_receive(root, "r", str(state)).step == 2
        assert_bits_equal(load_file(state), cks[2])
        return
    r.write(f"{layout.step_dir(2)}/attempts/{uuid.uuid4().hex}/{layout.MANIFEST}", b"{}")
    assert run_receive(root, "r", str(state)).step == 1
    assert_bits_equal(load_file(state), cks[1])


# -- network (S3 server behind a fault-injecting proxy) ----------------------------------------------

NETWORK = [
    FaultCase("network", "connection reset on every 4th request", "retried; publish and refit bit-exact"),
    FaultCase("network", "HTTP 500 on every 4th request", "retried; publish and refit bit-exact"),
    FaultCase("network", "HTTP 503 SlowDown (throttling) on every 4th request", "retried; publish and refit bit-exact"),
    FaultCase("network", "a response stalled past the client's read timeout", "timed out, retried; refit bit-exact"),
    FaultCase("network", "a response body cut off half-way (every 4th GET)", "retried; refit bit-exact"),
]


@pytest.mark.backend
@pytest.mark.parametrize("case", NETWORK, ids=str)
def test_network_faults(case, s3_server, tmp_path):
    which = NETWORK.index(case)
    kind = ["reset", "500", "503", "stall", "truncate"][which]
    with Proxy(s3_server) as proxy:
        so = {"endpoint_url": proxy.url}
        if kind == "stall":
            so["config_kwargs"] = {"read_timeout": 1, "connect_timeout": 1, "retries": {"max_attempts": 1}}
            proxy.stall_seconds = 2.5
        root = f"s3://{S3_BUCKET}/net-{uuid.uuid4().hex[:8]}"
        cks = chain_of_steps(3, seed=24)
        o = PublishOptions(chunk_bytes=4096, cache_dir=str(tmp_path / "cache"))
        run_publish(root, cks[0], 0, storage_options=so, options=o)
        state = tmp_path / "r.safetensors"
        run_receive(root, "r", str(state), storage_options=so)
        n = {"i": 0}
        stalled = {"done": False}
        just_failed: set[tuple[str, str]] = set()

        def fault(method, path):
            n["i"] += 1
            if kind == "stall":
                if method == "GET" and "/data.zarr/" in path and not stalled["done"]:
                    stalled["done"] = True
                    return "stall"
                return None
            if kind == "truncate" and method != "GET":
                return None
            # Every 4th request fails, but never the same request twice in a row: with many threads
            # sharing the count, one request's retries could otherwise land on a 4th five times over
            # (the retry budget) by chance, which tests the luck of the draw, not the retries.
            if n["i"] % 4 == 0 and (method, path) not in just_failed:
                just_failed.add((method, path))
                return kind
            just_failed.discard((method, path))
            return None

        proxy.fault = fault
        if kind in ("reset", "500", "503"):
            run_publish(root, cks[1], 1, storage_options=so, options=o)
        else:
            proxy.fault = None
            run_publish(root, cks[1], 1, storage_options=so, options=o)
            proxy.fault = fault
        run_receive(root, "r", str(state), storage_options=so, options=ReceiveOptions(io_workers=2))
        proxy.fault = None
        assert_bits_equal(load_file(state), cks[1])
        injected = [e for e in proxy.log if e[2] in (0, 500, 503, -1)] if kind != "stall" else [stalled["done"]]
        assert injected and all(injected), "the fault was really injected"


# -- bits that never change under a fault --------------------------------------------------------------


@pytest.mark.faults(component="publisher", outcome="the dead attempt is never read; receivers pull only the committed attempt's chunks")
def test_what_a_killed_publisher_left_is_never_read(tmp_path, monkeypatch):
    """A killed publisher's half-written attempt is never read: the receiver's bytes pulled equal
    the committed attempt's stored chunks only."""
    root = str(tmp_path / "root")
    cks = chain_of_steps(3, seed=25)
    run_publish(root, cks[0], 0, options=opts(tmp_path))
    real_write = Root.write

    def write(self, key, data):
        if key.endswith(layout.MANIFEST):
            raise Killed("before manifest")
        return real_write(self, key, data)

    monkeypatch.setattr(Root, "write", write)
    with pytest.raises(Killed):
        run_publish(root, cks[1], 1, options=opts(tmp_path))
    monkeypatch.undo()
    run_publish(root, cks[1], 1, options=opts(tmp_path))
    attempts = Root(root).listdir(f"{layout.step_dir(1)}/attempts")
    assert len(attempts) == 2  # the dead attempt is still there (until dcr gc) and never read
    state = tmp_path / "r.safetensors"
    run_receive(root, "r", str(state), step=0)
    res = run_receive(root, "r", str(state))
    assert res.bytes_pulled == Catalog(Root(root)).manifest(1).summary()["bytes_stored"]
    assert_bits_equal(load_file(state), cks[1])
