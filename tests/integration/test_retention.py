"""Keyframe policy and ``dcr gc``: retention never deletes what a reader or registered receiver needs."""

from __future__ import annotations

import uuid

import pytest
from safetensors.torch import load_file

from dcr_core.chain import Direction, Move, StepInfo, plan_path
from dcr_core.errors import StepNotFoundError, UsageError
from dcr_core.retention import KeyframePolicy, steps_to_keep
from flows import run_materialize, run_publish, run_receive
from flows.maintenance import gc
from flows.options import GcOptions, PublishOptions
from storage import layout
from storage.catalog import Catalog
from storage.root import Root, RootRef
from tests.support.helpers import assert_bits_equal, chain_of_steps, tree_snapshot
from tests.support.servers import new_root

CHUNK_BYTES = 256


def opts(tmp_path, **kw) -> PublishOptions:
    return PublishOptions(chunk_bytes=CHUNK_BYTES, cache_dir=str(tmp_path / "cache"), **kw)


def lineage(*pairs, snapshots=()) -> dict[int, StepInfo]:
    """``(step, base)`` pairs -> StepInfos (base None: a keyframe; steps in ``snapshots`` are deltas
    that also store a full copy)."""
    return {s: StepInfo(s, b, b is not None, 10, 100 if s in snapshots else None) for s, b in pairs}


# -- pure decisions ---------------------------------------------------------------------------------


def test_the_keyframe_policy_triggers_on_step_count_or_delta_bytes_only():
    assert KeyframePolicy().due(100, 0, 10**12, 1) is None
    p = KeyframePolicy(every=4)
    assert p.due(3, 0, 0, 100) is None and "every 4" in p.due(4, 0, 0, 100)
    assert p.due(9, None, 0, 100) is None  # unknown keyframe: no trigger
    q = KeyframePolicy(above=0.5)
    assert q.due(9, 0, 50, 100) is None and q.due(9, 0, 51, 100) is not None
    assert q.due(9, 0, None, 100) is None and q.due(9, 0, 51, None) is None
    with pytest.raises(UsageError):
        KeyframePolicy(every=-1)
    with pytest.raises(UsageError):
        KeyframePolicy(above=-0.1)


def test_retention_keeps_the_newest_steps_chains_and_what_receivers_need():
    steps = lineage((0, None), (1, 0), (2, 1), (3, 2), (4, None), (5, 4), (6, 5), (7, 6))
    assert steps_to_keep(steps, 1) == {4, 5, 6, 7}
    assert steps_to_keep(steps, 5) == {0, 1, 2, 3, 4, 5, 6, 7}  # step 3 needs its chain back to 0
    # a receiver on the latest lineage needs only its own step (the deltas forward are kept anyway)
    assert steps_to_keep(steps, 1, {"r": 5}) == {4, 5, 6, 7}
    # a receiver on an older lineage restarts from the latest keyframe: only its own step is kept
    assert steps_to_keep(steps, 1, {"r": 2}) == {2, 4, 5, 6, 7}
    # a receiver on a branch keeps the deltas it undoes down to the common ancestor
    branch = lineage((0, None), (1, 0), (2, 1), (3, 1), (4, 3))
    assert steps_to_keep(branch, 1, {"r": 2}) == {0, 1, 2, 3, 4}
    assert steps_to_keep(steps, 1, {"gone": 99}) == {4, 5, 6, 7}
    assert steps_to_keep({}, 3) == set()
    with pytest.raises(UsageError):
        steps_to_keep(steps, 0)


def test_snapshots_are_restart_points_for_planning_and_retention():
    steps = lineage(*[(0, None)] + [(s, s - 1) for s in range(1, 8)], snapshots=(4,))
    assert steps_to_keep(steps, 1) == {4, 5, 6, 7}  # nothing before the snapshot is needed
    assert steps_to_keep(steps, 1, {"r": 2}) == {2, 3, 4, 5, 6, 7}  # its deltas forward
    assert plan_path(steps, None, 6) == [Move(4, Direction.KEYFRAME), Move(5, Direction.FORWARD), Move(6, Direction.FORWARD)]
    assert plan_path(steps, 5, 7) == [Move(6, Direction.FORWARD), Move(7, Direction.FORWARD)]
    # after history before the snapshot is deleted, chains end there; a held step whose history is
    # gone still moves forward by deltas
    pruned = {s: i for s, i in steps.items() if s not in (0, 1)}
    assert plan_path(pruned, None, 7)[0] == Move(4, Direction.KEYFRAME)
    assert plan_path(pruned, 2, 7) == [Move(s, Direction.FORWARD) for s in (3, 4, 5, 6, 7)]  # 40 < 100+30
    assert steps_to_keep(pruned, 1, {"r": 2}) == {2, 3, 4, 5, 6, 7}
    gone = {s: i for s, i in pruned.items() if s != 3}  # now step 2 can only restart
    assert plan_path(gone, 2, 7) == [Move(4, Direction.KEYFRAME)] + [Move(s, Direction.FORWARD) for s in (5, 6, 7)]
    assert steps_to_keep(gone, 1, {"r": 2}) == {2, 4, 5, 6, 7}


# -- the keyframe policy in the publisher ------------------------------------------------------------


@pytest.mark.parametrize("policy", [KeyframePolicy(every=3), KeyframePolicy(above=0.05)], ids=["every", "above"])
def test_the_keyframe_policy_adds_restart_points_and_every_receiver_stays_exact(tmp_path, policy):
    root = str(tmp_path / "root")
    ckpts = chain_of_steps(8, seed=3)
    snapshots = []
    for i, ck in enumerate(ckpts):
        res = run_publish(root, ck, i, options=opts(tmp_path, keyframe_policy=policy))
        assert res.kind == ("keyframe" if i == 0 else "delta")
        follower = run_receive(root, "r", str(tmp_path / "r.safetensors"))
        assert_bits_equal(load_file(tmp_path / "r.safetensors"), ck)
        if "snapshot_bytes" in res.summary:
            snapshots.append(i)
            assert res.summary["keyframe_step"] == i and res.summary["keyframe_reason"]
            # an up-to-date receiver still pulls only the delta
            assert follower.moves == [f"forward:{i}"] and follower.bytes_pulled == res.summary["bytes_stored"]
        fresh = run_receive(root, f"new{i}", str(tmp_path / f"new{i}.safetensors"))
        assert_bits_equal(load_file(tmp_path / f"new{i}.safetensors"), ck)
        start = max([0] + [s for s in snapshots if s <= i])
        assert fresh.moves[0] == f"keyframe:{start}"  # new receivers start from the nearest restart point
    if policy.every:
        assert snapshots == [3, 6]
    else:
        assert snapshots and 1 not in snapshots
        cat = Catalog(Root(root))
        for s in range(1, 8):  # the policy held: no lineage carried more delta bytes than allowed
            m = cat.marker(s)
            if "snapshot_bytes" in m.summary:
                continue
            kf = cat.marker(m.summary["keyframe_step"]).summary
            before = m.summary["chain_bytes"] - m.summary["bytes_stored"] - kf.get("snapshot_bytes", kf["bytes_stored"])
            assert before <= policy.above * m.summary["bytes_full"]
    out = tmp_path / "v.json"
    from flows.cli import main

    assert main(["verify", root, "--json", "-q"]) == 0 and not out.exists()


# -- gc ----------------------------------------------------------------------------------------------


def publish_run(root: str, tmp_path, n: int = 8, every: int = 4, dtypes: list[str] | None = None) -> list[dict]:
    ckpts = chain_of_steps(n, seed=5, dtypes=dtypes)
    for i, ck in enumerate(ckpts):
        run_publish(root, ck, i, options=opts(tmp_path, keyframe_policy=KeyframePolicy(every=every)))
    return ckpts


def test_gc_deletes_only_what_retention_and_receivers_do_not_need(tmp_path, backend):
    root = new_root(backend, tmp_path)
    # On the servers, a few dtypes (each object is a request there); every dtype runs locally.
    few = ["BF16", "F32", "I8", "BOOL"] if backend in ("s3", "gcs", "azure") else None
    ckpts = publish_run(root, tmp_path, dtypes=few)  # a keyframe at 0, a delta with a full snapshot at 4
    behind = tmp_path / "behind.safetensors"
    run_receive(root, "behind", str(behind), step=2)
    dry = gc.run_gc(root, GcOptions(keep_last=2, dry_run=True))
    assert dry.plan.delete_steps == [0, 1] and dry.plan.receivers == {"behind": 2}
    assert dry.plan.bytes_freed > 0 and not dry.deleted_steps
    assert Catalog(Root(root)).committed_steps() == list(range(8))  # a dry run deletes nothing

    report = gc.run_gc(root, GcOptions(keep_last=2))
    assert report.deleted_steps == [0, 1]
    cat = Catalog(Root(root))
    assert cat.committed_steps() == [2, 3, 4, 5, 6, 7]
    assert not Root(root).objects(layout.step_dir(0))
    # what was kept still serves every reader exactly: the receiver catches up by deltas
    res = run_receive(root, "behind", str(behind))
    assert res.moves == [f"forward:{s}" for s in range(3, 8)]
    assert_bits_equal(load_file(behind), ckpts[7])
    for s in (4, 6, 7):
        out = tmp_path / f"m{s}.safetensors"
        run_materialize(root, s, str(out))
        assert_bits_equal(load_file(out), ckpts[s])
    with pytest.raises(StepNotFoundError):
        run_materialize(root, 0, str(tmp_path / "m0.safetensors"))

    # the receiver moved on: nothing before the snapshot at step 4 is needed any more
    report = gc.run_gc(root, GcOptions(keep_last=1))
    assert report.deleted_steps == [2, 3]
    assert Catalog(Root(root)).committed_steps() == [4, 5, 6, 7]
    fresh = tmp_path / "fresh.safetensors"
    run_receive(root, "fresh", str(fresh))
    assert_bits_equal(load_file(fresh), ckpts[7])


def test_gc_collects_losing_and_abandoned_attempts_but_not_young_ones(tmp_path):
    root = str(tmp_path / "root")
    ckpts = publish_run(root, tmp_path, n=3, every=0)
    r = Root(root)
    losing = f"{layout.step_dir(1)}/attempts/{uuid.uuid4().hex}"
    r.write(f"{losing}/manifest.json", b"{}")
    young = f"{layout.step_dir(9)}/attempts/{uuid.uuid4().hex}"  # a publish of step 9 in progress
    r.write(f"{young}/data.zarr/zarr.json", b"{}")
    plan = gc.plan_gc(RootRef(root), GcOptions(keep_last=3))
    assert plan.delete_attempts == [losing] and plan.young_attempts == [young]
    plan = gc.plan_gc(RootRef(root), GcOptions(keep_last=3), now=2e10)  # long after: every uncommitted attempt is abandoned
    assert plan.delete_attempts == [losing, young]
    gc.run_gc(root, GcOptions(keep_last=3))
    assert not r.objects(losing) and r.objects(young)
    gc.run_gc(root, GcOptions(keep_last=3, grace_seconds=0))
    assert not r.objects(young)
    assert Catalog(Root(root)).committed_steps() == [0, 1, 2]
    out = tmp_path / "m.safetensors"
    run_materialize(root, 2, str(out))
    assert_bits_equal(load_file(out), ckpts[2])


@pytest.mark.faults(component="gc", outcome="every step whole or invisible; a rerun finishes")
def test_a_gc_that_crashes_midway_leaves_a_consistent_bucket_and_a_rerun_finishes(tmp_path, monkeypatch):
    root = str(tmp_path / "root")
    ckpts = publish_run(root, tmp_path)
    real_remove = Root.remove
    calls = []

    def crash_after_marker(self, key, recursive=False):
        calls.append(key)
        if len(calls) == 2:  # the marker of step 0 is gone, its data not yet
            raise KeyboardInterrupt("killed")
        return real_remove(self, key, recursive)

    monkeypatch.setattr(Root, "remove", crash_after_marker)
    with pytest.raises(KeyboardInterrupt):
        gc.run_gc(root, GcOptions(keep_last=1))
    monkeypatch.setattr(Root, "remove", real_remove)
    cat = Catalog(Root(root))
    assert cat.committed_steps() == [1, 2, 3, 4, 5, 6, 7]  # step 0 invisible, the rest whole
    state = tmp_path / "s.safetensors"
    run_receive(root, "r", str(state))
    assert_bits_equal(load_file(state), ckpts[7])
    # step 0 lost its marker: its leftover is an abandoned attempt, collected after the grace period
    gc.run_gc(root, GcOptions(keep_last=1, grace_seconds=0))
    assert Catalog(Root(root)).listed_steps() == [4, 5, 6, 7]
    assert tree_snapshot(tmp_path / "root" / "steps" / layout.step_dir(0).split("/")[-1]) == {}


def test_dcr_gc_dry_run_and_bad_arguments(tmp_path, capsys):
    from flows.cli import main

    root = str(tmp_path / "root")
    publish_run(root, tmp_path, n=6)
    before = tree_snapshot(root)
    assert main(["gc", root, "--keep-last", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would delete step 0" in out and "would delete step 3" in out and "dry run" in out
    assert tree_snapshot(root) == before
    assert main(["gc", root, "--keep-last", "0"]) == 2
    assert "argument --keep-last" in capsys.readouterr().err
    assert main(["gc", root, "--keep-last", "1", "--grace-seconds", "-1"]) == 2
    assert tree_snapshot(root) == before
    assert main(["gc", root, "--keep-last", "1", "--json"]) == 0
    assert Catalog(Root(root)).committed_steps() == [4, 5]


@pytest.mark.faults(component="gc", outcome="forged leases pin nothing; gc removes them and says why, escaped")
def test_leases_that_no_receiver_can_have_taken_pin_nothing_and_gc_says_why(tmp_path):
    """Someone who can write the bucket drops leases with ``expires_at`` Infinity, NaN, 1e300, a name
    that is no receiver id (with a terminal escape in it), and an unreadable body an hour old: gc
    deletes the steps they would have pinned, removes them, and its report names each and why
    (control characters escaped). An unreadable lease written just now still pins its step, and a
    real lease still does."""
    import json
    import os
    import time

    from storage import leases
    from tests.support.cli import dcr

    root = str(tmp_path / "root")
    publish_run(root, tmp_path, n=6)
    r = Root(root)
    forged = {
        0: ("rx-inf.json", b'{"receiver": "rx-inf", "expires_at": Infinity}'),
        1: ("rx-nan.json", b'{"receiver": "rx-nan", "expires_at": NaN}'),
        2: ("rx-far.json", json.dumps({"receiver": "rx-far", "expires_at": 1e300}).encode()),
        3: ("\x1b]0;owned\x07.json", b'{"receiver": "x", "expires_at": 9e9}'),
    }
    for step, (name, body) in forged.items():
        r.write(f"{layout.leases_dir(step)}/{name}", body)
    r.write(f"{layout.leases_dir(1)}/rx-old.json", b"{not json")
    old = time.time() - 2 * leases.GARBAGE_AFTER
    os.utime(os.path.join(root, layout.leases_dir(1), "rx-old.json"), (old, old))
    r.write(f"{layout.leases_dir(2)}/rx-young.json", b"{not json")  # may be a lease: pins step 2
    leases.take(r, "rx-real", [3], target=5, ttl=600)  # a real one: pins step 3
    out = dcr("gc", root, "--keep-last", "1", "--grace-seconds", "0", check=0).stdout
    assert "\x1b" not in out and "\x07" not in out
    assert "removed lease steps/000000000003/leases/\\x1b]0;owned\\x07.json: not a lease a receiver takes" in out, out
    for step, why in ((0, "expires_at is inf, not a time"), (1, "expires_at is nan, not a time"),
                      (2, "s ahead, beyond the 86400 s a lease may last"), (1, "unreadable (JSONDecodeError) and")):
        assert f"removed lease steps/{step:012d}/leases/" in out and why in out, (why, out)
    assert Catalog(r).committed_steps() == [2, 3, 4, 5]  # 0 and 1 deleted; 2 and 3 pinned by what may be leases
    assert leases.live(r, 2) == ["rx-young"] and leases.live(r, 3) == ["rx-real"]
    with pytest.raises(UsageError, match="at most 86400 seconds"):
        leases.take(r, "rx", [5], target=5, ttl=float("inf"))
    for bad in ("inf", "1e300", "nan", "0"):
        err = dcr("receive", root, "--receiver", "rx", "--state", tmp_path / "s.safetensors", "--lease-seconds", bad,
                  check=2).stderr
        assert "argument --lease-seconds" in err and len(err.strip().splitlines()) == 1


@pytest.mark.faults("gc", component="gc", outcome="a real lease written under a garbage lease's name pins its step; "
                    "gc keeps both")
def test_a_garbage_lease_replaced_by_a_real_one_after_the_plan_is_kept_and_pins_its_step(tmp_path):
    """gc plans while ``rx.json`` on step 1 is an unreadable hour-old object (garbage); before it
    collects, receiver ``rx`` takes a real lease on step 1 under that name. gc spares step 1 and
    leaves the new lease alone (it looks again before removing garbage)."""
    import os
    import time

    from storage import leases

    root = str(tmp_path / "root")
    publish_run(root, tmp_path, n=6)  # a keyframe at step 4: steps 0-3 are gc's to delete
    r = Root(root)
    r.write(f"{layout.leases_dir(1)}/rx.json", b"{cut off")
    old = time.time() - 2 * leases.GARBAGE_AFTER
    os.utime(os.path.join(root, layout.leases_dir(1), "rx.json"), (old, old))
    plan = gc.plan_gc(RootRef(root, {}), GcOptions(keep_last=1, grace_seconds=0))
    assert 1 in plan.delete_steps and [k for k, _ in plan.garbage_leases] == [f"{layout.leases_dir(1)}/rx.json"]
    leases.take(r, "rx", [1], target=5, ttl=600)
    report = gc.collect(RootRef(root, {}), plan)
    assert report.spared == {1: ["rx"]} and report.removed_leases == []
    assert leases.live(r, 1) == ["rx"] and Catalog(r).marker(1) is not None
