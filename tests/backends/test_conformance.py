"""One conformance suite, run against every backend: local, memory://, S3 (moto server), GCS (emulator).

Every storage behaviour DCR relies on, and the refit loop on top of it, must hold on each.
"""

from __future__ import annotations

import threading

import pytest
import torch

from dcr_core.errors import IntegrityError, StepConflictError, StepNotFoundError, UnsafeKeyError
from flows import run_materialize, run_publish, run_receive
from flows.maintenance.audit import list_steps, verify
from flows.maintenance.gc import plan_gc
from flows.options import GcOptions, PublishOptions
from flows.publish.pipeline import PublishSteps
from storage import layout, run_identity
from storage.catalog import Catalog
from storage.root import Root
from storage.stats import io_stats
from tests.support.helpers import assert_bits_equal, chain_of_steps, file_bytes
from tests.support.steps import patch_step


def opts(tmp_path, **kw) -> PublishOptions:
    return PublishOptions(chunk_bytes=1024, cache_dir=str(tmp_path / "cache"), **kw)


def load(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_objects_round_trip_and_listings_are_fresh(make_root):
    root = Root(make_root())
    assert root.listdir("steps") == []
    root.write("steps/a/x", b"1")
    root.write("steps/b", b"22")
    assert root.read("steps/a/x") == b"1"
    assert root.listdir("steps") == ["a", "b"]
    root.write("steps/c", b"")
    assert root.listdir("steps") == ["a", "b", "c"]  # a listing made before is never served stale
    assert root.exists("steps/b") and not root.exists("steps/zz")
    with pytest.raises(FileNotFoundError):
        root.read("steps/zz")
    root.remove("steps/a", recursive=True)
    assert "a" not in root.listdir("steps")


def test_create_if_absent_creates_once_and_never_replaces(make_root):
    root = Root(make_root())
    assert root.create_if_absent("steps/m.json", b"first") is True
    assert root.create_if_absent("steps/m.json", b"second") is False
    assert root.read("steps/m.json") == b"first"


def test_a_read_with_a_limit_fetches_at_most_the_limit_plus_one_byte(make_root):
    """An oversized object is refused having transferred at most ``limit + 1`` bytes (a ranged read),
    so a hostile or damaged object cannot exhaust a reader's memory."""
    url = make_root()
    root = Root(url)
    root.write("steps/big", b"x" * (4 << 20))
    root.write("steps/small", b"y" * 1000)
    before = io_stats(root.url)
    with pytest.raises(IntegrityError, match="steps/big"):
        root.read("steps/big", limit=1024)
    assert io_stats(root.url).minus(before).bytes_read <= 1025
    assert root.read("steps/small", limit=1000) == b"y" * 1000  # exactly the limit is fine


@pytest.mark.parametrize("key", ["../x", "/abs", "a//b", "a/./b", "a/../../b", ""])
def test_keys_outside_root_are_refused(make_root, key):
    root = Root(make_root())
    with pytest.raises(UnsafeKeyError):
        root.write(key, b"x")


def test_refit_chain_forward_backward_and_keyframe_is_bit_exact(make_root, tmp_path):
    url = make_root()
    steps = chain_of_steps(5, seed=3)
    for i, ck in enumerate(steps):
        run_publish(url, ck, i, options=opts(tmp_path))
    state = tmp_path / "state.safetensors"
    run_receive(url, "rx", str(state), 2)
    assert_bits_equal(load(state), steps[2])
    res = run_receive(url, "rx", str(state))
    assert res.moves == ["forward:3", "forward:4"]
    assert_bits_equal(load(state), steps[4])
    res = run_receive(url, "rx", str(state), 1)
    # the planner takes whichever exact path pulls fewer bytes
    assert res.moves in (["backward:4", "backward:3", "backward:2"], ["keyframe:0", "forward:1"])
    assert_bits_equal(load(state), steps[1])
    run_materialize(url, 3, str(tmp_path / "m.safetensors"))
    assert_bits_equal(load(tmp_path / "m.safetensors"), steps[3])
    rows = list_steps(Root(url))
    assert [r.step for r in rows] == [0, 1, 2, 3, 4] and all(r.committed for r in rows)
    assert "rx" in rows[1].receivers
    assert not verify(Root(url)).errors


def test_a_corrupted_chunk_is_detected_and_nothing_is_applied(make_root, tmp_path):
    url = make_root()
    steps = chain_of_steps(2, seed=4)
    for i, ck in enumerate(steps):
        run_publish(url, ck, i, options=opts(tmp_path))
    state = tmp_path / "state.safetensors"
    run_receive(url, "rx", str(state), 0)
    before = file_bytes(state)
    root = Root(url)
    m = Catalog(root).manifest(1)
    name, entry = next((n, e) for n, e in sorted(m.tensors.items()) if len(e.chunks))
    key = layout.store_key(1, m.attempt, entry.stored_at(0)[0])
    data = bytearray(root.read(key))
    data[len(data) // 2] ^= 0x40
    root.write(key, bytes(data))
    with pytest.raises(IntegrityError) as ei:
        run_receive(url, "rx", str(state))
    assert key in str(ei.value) and len(str(ei.value).splitlines()) == 1
    assert file_bytes(state) == before
    assert verify(Root(url)).errors


@pytest.mark.faults(component="bad input or damaged bucket",
                    outcome="junk objects named like steps cost no request: a no-op receive, ls and gc read as much as without them")
def test_junk_objects_named_like_steps_cost_no_requests(make_root, tmp_path, monkeypatch):
    monkeypatch.setattr(run_identity, "CACHE_SECONDS", 0)  # run.json read by every call alike, however long each takes
    url = make_root()
    for i, ck in enumerate(chain_of_steps(2, seed=6)):
        run_publish(url, ck, i, options=opts(tmp_path))
    state = str(tmp_path / "state.safetensors")
    run_receive(url, "rx", state)
    root = Root(url)

    def requests() -> tuple[int, list[int]]:
        before = io_stats(url)
        assert run_receive(url, "rx", state).moves == []  # a follower's poll: nothing new
        steps = [r.step for r in list_steps(root)]
        plan_gc(root.ref, GcOptions(keep_last=1))
        used = io_stats(url).minus(before)
        return used.gets + used.heads + used.lists, steps

    clean = requests()
    # above the newest step, where a scan for the newest one starts
    junk = {root.full(layout.step_dir(s)): b"" for s in range(1000, 1400)}  # each cost a GET per scan before
    if root.backend.local:
        for path in junk:
            open(path, "wb").close()
    else:  # a few connections at a time: 2,000 at once overrun a test server on a busy machine
        root.fs.pipe(junk, **({"batch_size": 8} if root.fs.async_impl else {}))
    assert len(root.listdir(layout.STEPS)) == 402
    assert requests() == clean


def test_a_publish_that_dies_before_its_commit_is_invisible_and_a_retry_commits(make_root, tmp_path, monkeypatch):
    url = make_root()
    steps = chain_of_steps(2, seed=5)
    run_publish(url, steps[0], 0, options=opts(tmp_path))

    def crash(real, *a, **k):
        raise ConnectionResetError("publisher died before the commit")

    patch_step(monkeypatch, PublishSteps, "commit_step", crash)
    with pytest.raises(ConnectionResetError):
        run_publish(url, steps[1], 1, options=opts(tmp_path))
    assert Catalog(Root(url)).latest_committed() == 0
    with pytest.raises(StepNotFoundError):
        run_receive(url, "rx", str(tmp_path / "s.safetensors"), 1)
    monkeypatch.undo()
    run_publish(url, steps[1], 1, options=opts(tmp_path))
    run_receive(url, "rx", str(tmp_path / "s.safetensors"), 1)
    assert_bits_equal(load(tmp_path / "s.safetensors"), steps[1])
    rows = list_steps(Root(url))
    assert rows[1].attempts == 2  # the dead attempt stays, unreferenced


def test_racing_publishers_of_one_step_commit_exactly_once(backend, make_root, tmp_path, monkeypatch):
    if backend == "gcs":
        pytest.skip("the GCS emulator ignores ifGenerationMatch=0: a same-instant race cannot be decided there "
                    "(real GCS decides it); covered sequentially by test_create_if_absent_creates_once")
    url = make_root()
    base = chain_of_steps(1, seed=6)[0]
    run_publish(url, base, 0, options=opts(tmp_path))
    n = 6
    barrier = threading.Barrier(n, timeout=60)
    def gated(real, plan, manifest):
        barrier.wait()  # every publisher has written its attempt and reaches the commit together
        return real(plan, manifest)

    patch_step(monkeypatch, PublishSteps, "commit_step", gated)
    candidates = [{k: v.clone() for k, v in base.items()} for _ in range(n)]
    for i, c in enumerate(candidates):
        first = sorted(c)[0]
        c[first].reshape(-1).view(torch.uint8)[: i + 1] ^= 1
    outcomes: list = [None] * n

    def publish(i):
        try:
            outcomes[i] = run_publish(url, candidates[i], 1, options=opts(tmp_path / f"p{i}", use_cache=False))
        except Exception as e:  # noqa: BLE001 - the losers' errors are the point
            outcomes[i] = e

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, o in enumerate(outcomes) if not isinstance(o, Exception)]
    assert len(winners) == 1, outcomes
    assert all(isinstance(o, StepConflictError) for i, o in enumerate(outcomes) if i != winners[0])
    marker = Catalog(Root(url)).marker(1)
    assert marker.attempt == outcomes[winners[0]].attempt
    run_receive(url, "rx", str(tmp_path / "s.safetensors"), 1)
    assert_bits_equal(load(tmp_path / "s.safetensors"), candidates[winners[0]])
