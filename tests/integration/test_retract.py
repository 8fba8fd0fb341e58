"""``dcr retract``: the newest steps taken back, exactly, everywhere they went.

A retracted step is no refit's target and no publish's base; every kind of receiver that holds one
moves back to the newest live step on its next refit (rewrite and in-place state files, a live
module, a mirror and the receivers of that mirror), bit for bit what a dense load of that step
gives; a committed step number is never used again; a signed ROOT takes signed retractions only.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from dcr_core.errors import IntegrityError, StepConflictError, StepNotFoundError, UsageError
from flows import run_materialize, run_publish, run_receive, run_retract
from flows.maintenance.mirror import run_mirror
from flows.options import PublishOptions, ReceiveOptions
from storage import layout
from storage.catalog import Catalog
from storage.root import Root
from tests.support.cli import dcr
from tests.support.fused_module import TinyFused
from tests.support.helpers import assert_bits_equal, chain_of_steps, file_bytes, module_bits
from tests.support.publishing import publish_steps

pytestmark = pytest.mark.faults(component="retraction", outcome="every receiver back at the newest live step, bit-exact")


def _dense(ck) -> dict[str, torch.Tensor]:
    m = TinyFused()
    m.load_weights(ck.items())
    return module_bits(m)


def test_every_receiver_of_a_retracted_step_moves_back_exactly_and_the_number_is_never_reused(tmp_path):
    root, region = str(tmp_path / "origin"), str(tmp_path / "region")
    cks = chain_of_steps(5, seed=41)
    publish_steps(root, cks, cache_dir=tmp_path / "cache", chunk_bytes=256)
    rewrite, in_place, downstream = (tmp_path / n for n in ("rewrite.safetensors", "inplace.safetensors", "down.safetensors"))
    run_receive(root, "rewrite", str(rewrite))
    run_receive(root, "in-place", str(in_place), options=ReceiveOptions(in_place=True))
    run_mirror(root, region)
    run_receive(region, "down", str(downstream))
    for path in (rewrite, in_place, downstream):
        assert_bits_equal(load_file(path), cks[4])

    out = dcr("retract", root, "--step", 3, "--reason", "a bad update", check=0).stdout
    assert out.startswith("retracted steps 3, 4; the newest live step is 2"), out
    assert json.load(open(os.path.join(root, layout.retraction_key(4))))["reason"] == "a bad update"
    ls = {line.split()[0]: line for line in dcr("ls", root, check=0).stdout.splitlines()[1:]}
    assert "retracted" in ls["3"] and "retracted" in ls["4"] and "retracted" not in ls["2"]
    assert "RETRACTED" in dcr("show", root, "--step", 4, check=0).stdout
    status = dcr("status", root, check=0).stdout
    assert "latest committed step: 2" in status and "4!" in status and "! retracted" in status
    deep = json.loads(dcr("verify", root, "--deep", "--json", check=0).stdout)  # a retracted step's data is whole
    assert deep["replayed"] == [1, 2, 3, 4] and not deep["errors"], deep

    for rid, path, opts in (("rewrite", rewrite, None), ("in-place", in_place, ReceiveOptions(in_place=True))):
        res = run_receive(root, rid, str(path), options=opts)
        assert res.step == 2 and res.moves == ["backward:4", "backward:3"], res.moves
        assert_bits_equal(load_file(path), cks[2])
    assert json.loads(dcr("mirror", root, region, "--json", check=0).stdout)["retracted_steps"] == [3, 4]
    assert run_receive(region, "down", str(downstream)).step == 2
    assert_bits_equal(load_file(downstream), cks[2])
    dcr("verify", region, check=0)

    out = dcr("receive", root, "--receiver", "late", "--state", tmp_path / "late.safetensors", "--step", 4, check=4)
    assert "step 4 was retracted" in out.stderr and "a bad update" in out.stderr and "newest live step is 2" in out.stderr
    refused = dcr("materialize", root, "--step", 3, "--out", tmp_path / "m.safetensors", check=4).stderr
    assert "step 3 was retracted" in refused

    # the next publish builds on step 2, under a number never committed
    with pytest.raises(StepConflictError, match="step 4 was committed and retracted; a step number is never used twice: "
                                                 "publish step 5"):
        publish_steps(root, [cks[4]], 4, cache_dir=tmp_path / "cache", chunk_bytes=256)
    new = chain_of_steps(7, seed=43)[6]
    new = {n: new[n] if n in new and new[n].shape == t.shape and new[n].dtype == t.dtype else t for n, t in cks[2].items()}
    publish_steps(root, [new], 5, cache_dir=tmp_path / "cache", chunk_bytes=256)
    assert Catalog(Root(root)).manifest(5).base_step == 2
    for rid, path, opts in (("rewrite", rewrite, None), ("in-place", in_place, ReceiveOptions(in_place=True))):
        run_receive(root, rid, str(path), options=opts)
        assert_bits_equal(load_file(path), new)
    run_materialize(root, 5, str(tmp_path / "dense.safetensors"))
    assert_bits_equal(load_file(tmp_path / "dense.safetensors"), new)
    run_mirror(root, region)
    run_receive(region, "down", str(downstream))
    assert_bits_equal(load_file(downstream), new)


def test_a_live_module_moves_back_exactly(tmp_path):
    from flows import receive_into_module

    root = str(tmp_path / "bucket")
    cks = [TinyFused.checkpoint(s) for s in range(3)]
    publish_steps(root, cks, cache_dir=tmp_path / "cache", chunk_bytes=256)
    live = TinyFused()
    receive_into_module(root, "m", live, state_path=str(tmp_path / "mirror.safetensors"))
    assert_bits_equal(module_bits(live), _dense(cks[2]))
    run_retract(root, 2)
    res = receive_into_module(root, "m", live, state_path=str(tmp_path / "mirror.safetensors"))
    assert res["step"] == 1
    assert_bits_equal(module_bits(live), _dense(cks[1]))


def test_a_typod_step_is_taken_back_and_the_run_goes_on(tmp_path):
    """``--step 999999999999`` by mistake: retract it, and the next publish takes the next number."""
    root = str(tmp_path / "bucket")
    cks = chain_of_steps(3, seed=45)
    publish_steps(root, cks[:2], cache_dir=tmp_path / "cache", chunk_bytes=256)
    publish_steps(root, [cks[2]], 999999999999, cache_dir=tmp_path / "cache", chunk_bytes=256)
    with pytest.raises(StepConflictError, match="not after the latest committed step 999999999999"):
        publish_steps(root, [cks[2]], 2, cache_dir=tmp_path / "cache", chunk_bytes=256)
    res = run_retract(root, 999999999999, reason="typo")
    assert res.retracted == [999999999999] and res.latest == 1
    assert run_retract(root, 999999999999).already == [999999999999]  # a rerun: the same result
    publish_steps(root, [cks[2]], 2, cache_dir=tmp_path / "cache", chunk_bytes=256)
    state = tmp_path / "s.safetensors"
    run_receive(root, "r", str(state))
    assert_bits_equal(load_file(state), cks[2])
    with pytest.raises(StepNotFoundError, match="step 7 is not committed"):
        run_retract(root, 7)


def test_a_signed_root_takes_signed_retractions_only(tmp_path, monkeypatch):
    from storage import signing

    signing.keygen(tmp_path / "key")
    monkeypatch.setenv("DCR_SIGNING_KEY_FILE", str(tmp_path / "key"))
    root = str(tmp_path / "bucket")
    cks = chain_of_steps(3, seed=47)
    publish_steps(root, cks, cache_dir=tmp_path / "cache", chunk_bytes=256)
    monkeypatch.delenv("DCR_SIGNING_KEY_FILE")
    with pytest.raises(UsageError, match="its steps are signed, so a retraction must be too"):
        run_retract(root, 2)
    assert not os.path.exists(os.path.join(root, layout.retraction_key(2)))
    monkeypatch.setenv("DCR_VERIFY_KEY_FILE", str(tmp_path / "key.pub"))
    state = tmp_path / "s.safetensors"
    run_receive(root, "r", str(state))
    before = file_bytes(state)
    # someone who can write the bucket but holds no key forges one: receivers with the key refuse it
    m = Catalog(Root(root)).marker(2)
    forged = {"format": "dcr-retraction", "step": 2, "attempt": m.attempt, "manifest_digest": m.manifest_digest,
              "retracted_at": "now", "reason": "", "run": m.run}
    Root(root).write(layout.retraction_key(2), json.dumps(forged).encode())
    with pytest.raises(IntegrityError, match="retraction is not signed"):
        run_receive(root, "r", str(state))
    assert file_bytes(state) == before
    Root(root).remove(layout.retraction_key(2))
    monkeypatch.delenv("DCR_VERIFY_KEY_FILE")
    monkeypatch.setenv("DCR_SIGNING_KEY_FILE", str(tmp_path / "key"))
    run_retract(root, 2)
    monkeypatch.delenv("DCR_SIGNING_KEY_FILE")
    monkeypatch.setenv("DCR_VERIFY_KEY_FILE", str(tmp_path / "key.pub"))
    assert run_receive(root, "r", str(state)).step == 1
    assert_bits_equal(load_file(state), cks[1])
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def test_a_retracted_step_gc_deleted_stays_a_tombstone_its_receivers_restart_and_its_number_stays_used(tmp_path):
    """Retract step 4, then ``dcr gc`` deletes it (nothing leases it): its retraction record stays
    alone under ``steps/4/``, so step 4 can never be published again, a receiver that held it
    restarts from a restart point to the newest live step (bit-exact), and a mirror made before
    the gc takes the retraction from the tombstone."""
    from flows.maintenance.gc import run_gc
    from flows.options import GcOptions

    root, region = str(tmp_path / "origin"), str(tmp_path / "region")
    cks = chain_of_steps(5, seed=47)
    publish_steps(root, cks, cache_dir=tmp_path / "cache", chunk_bytes=256)
    state = tmp_path / "s.safetensors"
    run_receive(root, "r", str(state))
    run_mirror(root, region)
    run_retract(root, 4)
    report = run_gc(root, GcOptions(keep_last=1, grace_seconds=0))
    assert 4 in report.deleted_steps
    assert sorted(os.listdir(os.path.join(root, layout.step_dir(4)))) == ["retracted.json"]
    cat = Catalog(Root(root))
    assert cat.marker(4) is None and cat.retraction(4) is not None and 4 in cat.used_steps()
    with pytest.raises(StepConflictError, match="step 4 was committed and retracted; a step number is never used twice"):
        publish_steps(root, [cks[4]], 4, cache_dir=tmp_path / "cache", chunk_bytes=256)
    res = run_receive(root, "r", str(state))
    assert res.step == 3
    assert_bits_equal(load_file(state), cks[3])
    assert run_mirror(root, region).retracted_steps == [4]
    down = tmp_path / "down.safetensors"
    run_receive(region, "down", str(down))
    assert_bits_equal(load_file(down), cks[3])


@pytest.mark.parametrize("when", ["before-the-commit", "after-the-commit"])
def test_a_publish_racing_a_retraction_of_its_base_leaves_no_live_step_on_a_retracted_one(tmp_path, when):
    """``dcr retract --step 4`` lands while step 5 is being published on step 4: before the
    publisher's last look at its base (it commits nothing), or between that look and its commit
    (step 5 commits, sees the retraction and retracts itself). Either way step 5 is not live, the
    error says what happened, gc runs, and a receiver ends at step 3 exactly."""
    from dcr_core import events
    from flows.maintenance.gc import run_gc
    from flows.options import GcOptions

    root = str(tmp_path / "origin")
    cks = chain_of_steps(6, seed=49)
    publish_steps(root, cks[:5], cache_dir=tmp_path / "cache", chunk_bytes=256)
    state = tmp_path / "s.safetensors"
    run_receive(root, "r", str(state))
    point = "publish.manifest-written" if when == "before-the-commit" else "publish.base-checked"
    fired = []

    def retract_now(p, fields):
        if p == point and not fired:
            fired.append(p)
            run_retract(root, 4, reason="bad")

    with events.listening(retract_now), pytest.raises(StepConflictError) as e:
        publish_steps(root, [cks[5]], 5, cache_dir=tmp_path / "cache", chunk_bytes=256)
    assert fired == [point]
    cat = Catalog(Root(root))
    if when == "before-the-commit":
        assert "step 4 was retracted while step 5 was being published on it; nothing committed" in str(e.value)
        assert cat.marker(5) is None
    else:
        assert "step 5 was committed and then retracted" in str(e.value)
        assert cat.retraction(5) is not None and "base step 4 was retracted" in cat.retraction(5).reason
    assert cat.latest_committed() == 3 and (5 in cat.used_steps()) == (when == "after-the-commit")
    run_gc(root, GcOptions(keep_last=2, grace_seconds=0))
    assert run_receive(root, "r", str(state)).step == 3
    assert_bits_equal(load_file(state), cks[3])
    publish_steps(root, [cks[3]], 6, cache_dir=tmp_path / "cache", chunk_bytes=256)  # the run goes on, on step 3


def test_a_mirror_copies_a_retraction_of_a_step_older_than_upstreams_newest(tmp_path):
    """Retract step 4, publish step 5 on step 3, then mirror: the mirror held step 4 live, and marks
    it retracted although it is older than upstream's newest step."""
    root, region = str(tmp_path / "origin"), str(tmp_path / "region")
    cks = chain_of_steps(6, seed=51)
    publish_steps(root, cks[:5], cache_dir=tmp_path / "cache", chunk_bytes=256)
    run_mirror(root, region)
    run_retract(root, 4)
    new = {n: t for n, t in cks[3].items()}
    publish_steps(root, [new], 5, cache_dir=tmp_path / "cache", chunk_bytes=256)
    res = run_mirror(root, region)
    assert res.retracted_steps == [4]
    assert Catalog(Root(region)).committed_steps()[-2:] == [3, 5]
    down = tmp_path / "down.safetensors"
    run_receive(region, "down", str(down), options=ReceiveOptions())
    assert_bits_equal(load_file(down), new)


def test_a_retraction_takes_back_the_step_and_what_builds_on_it_not_a_later_step_on_another_base(tmp_path):
    """Step 7 is published on step 5 while another publisher commits step 6 (both live): retracting
    step 6 takes back step 6 alone, and a step built on it later (8, on 6) with it; step 7 stays the
    newest live step, and a receiver that held step 6 moves to it exactly."""
    from dcr_core import events

    root = str(tmp_path / "origin")
    cks = chain_of_steps(8, seed=53)
    publish_steps(root, cks[:6], cache_dir=tmp_path / "cache", chunk_bytes=256)
    fired = []

    def publish_six(p, fields):
        if p == "publish.manifest-written" and fields.get("step") == 7 and not fired:
            fired.append(p)
            run_publish(root, cks[6], 6, options=PublishOptions(chunk_bytes=256, cache_dir=str(tmp_path / "other")))

    with events.listening(publish_six):
        publish_steps(root, [cks[7]], 7, cache_dir=tmp_path / "cache", chunk_bytes=256)
    cat = Catalog(Root(root))
    assert fired and cat.marker(7).base_step == 5 and cat.marker(6).base_step == 5 and cat.latest_committed() == 7
    state = tmp_path / "s.safetensors"
    run_receive(root, "r", str(state), step=6)

    res = run_retract(root, 6, reason="bad")
    assert res.retracted == [6] and res.latest == 7, res
    cat = Catalog(Root(root))
    assert cat.is_live(7) and cat.retraction(6) is not None and cat.is_live(5)
    assert run_receive(root, "r", str(state)).step == 7
    assert_bits_equal(load_file(state), cks[7])


def test_a_retraction_takes_back_every_step_built_on_the_retracted_one(tmp_path):
    """A chain 3 -> 4 -> 5 and a keyframe 6: retracting step 4 takes back 4 and 5 (built on it),
    newest first, and leaves the keyframe live."""
    root = str(tmp_path / "origin")
    cks = chain_of_steps(7, seed=55)
    publish_steps(root, cks[:6], cache_dir=tmp_path / "cache", chunk_bytes=256)
    run_publish(root, cks[6], 6, keyframe=True, options=PublishOptions(chunk_bytes=256, cache_dir=str(tmp_path / "cache")))
    out = dcr("retract", root, "--step", 4, check=0).stdout
    assert out.startswith("retracted steps 4, 5; the newest live step is 6"), out
    assert Catalog(Root(root)).committed_steps() == [0, 1, 2, 3, 6]


@pytest.mark.faults(component="retraction", outcome="a retraction in any ROOT is honoured; a mirror hiding it is refused")
def test_a_retraction_seen_in_any_root_is_honoured_and_a_mirror_hiding_it_is_refused(tmp_path, monkeypatch):
    """A receiver reads a mirror first and the origin as fallback (signed). The origin retracts step 3
    while the mirror lags: the receiver moves back to step 2 and stays there (never 2 -> 3 -> 2 -> 3),
    and asking for step 3 names the ROOT that retracted it. The mirror then copies the record and the
    origin's heartbeat (which names step 3 retracted); its record deleted, the mirror still serves no
    step 3, and a receiver with --max-staleness refuses the mirror alone, naming step 3."""
    from storage import heartbeat, signing

    signing.keygen(tmp_path / "key")
    monkeypatch.setenv("DCR_SIGNING_KEY_FILE", str(tmp_path / "key"))
    origin, region = str(tmp_path / "origin"), str(tmp_path / "region")
    cks = chain_of_steps(4, seed=57)
    publish_steps(origin, cks, cache_dir=tmp_path / "cache", chunk_bytes=256)
    monkeypatch.delenv("DCR_SIGNING_KEY_FILE")
    monkeypatch.setenv("DCR_VERIFY_KEY_FILE", str(tmp_path / "key.pub"))
    run_mirror(origin, region)
    state = tmp_path / "s.safetensors"

    def receive(*extra, check=0):
        return dcr("receive", region, "--fallback-root", origin, "--receiver", "r", "--state", state, *extra,
                   check=check)

    receive()
    assert_bits_equal(load_file(state), cks[3])
    dcr("retract", origin, "--step", 3, "--reason", "bad", env={"DCR_SIGNING_KEY_FILE": str(tmp_path / "key")}, check=0)
    for _ in range(2):  # the mirror still shows step 3 live: the origin's retraction wins, every time
        receive()
        assert_bits_equal(load_file(state), cks[2])
    assert json.load(open(os.path.join(origin, heartbeat.KEY)))["retracted"] == [3]
    assert Catalog(Root(region)).position("r")["step"] == 2  # served by the mirror, moving back
    out = receive("--step", 3, check=4)
    assert f"step 3 was retracted in {origin}" in out.stderr and "bad" in out.stderr, out.stderr
    assert_bits_equal(load_file(state), cks[2])

    assert run_mirror(origin, region).retracted_steps == [3]
    dcr("receive", region, "--receiver", "m", "--state", tmp_path / "m.safetensors", "--max-staleness", 600, check=0)
    os.unlink(os.path.join(region, layout.retraction_key(3)))  # the mirror hides it
    receive()
    assert_bits_equal(load_file(state), cks[2])
    out = dcr("receive", region, "--receiver", "m", "--state", tmp_path / "m.safetensors", "--max-staleness", 600,
              check=5)
    assert "says step 3 was retracted, but this ROOT shows it live" in out.stderr, out.stderr
