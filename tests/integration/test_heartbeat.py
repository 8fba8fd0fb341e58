"""Freshness: a signed heartbeat per commit (and per ``dcr heartbeat``), copied by mirrors; a
receiver with ``--max-staleness`` refuses a ROOT that stopped moving, naming how old it is."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

from storage import heartbeat, signing
from storage.root import Root
from tests.support.cli import dcr
from tests.support.helpers import file_bytes, write_safetensors

pytestmark = pytest.mark.faults(component="security", outcome="a stale ROOT is refused naming its age; nothing changes")


@pytest.fixture
def signed_origin(tmp_path, monkeypatch):
    signing.keygen(tmp_path / "key")
    monkeypatch.setenv("DCR_SIGNING_KEY_FILE", str(tmp_path / "key"))
    origin = tmp_path / "origin"
    for step in (0, 1):
        write_safetensors(tmp_path / f"c{step}.safetensors", {"w": torch.full((64,), float(step))})
        dcr("publish", origin, tmp_path / f"c{step}.safetensors", "--step", step, check=0)
    monkeypatch.delenv("DCR_SIGNING_KEY_FILE")
    monkeypatch.setenv("DCR_VERIFY_KEY_FILE", str(tmp_path / "key.pub"))  # from here on: mirrors and receivers
    return origin


def test_each_commit_beats_and_a_fresh_root_is_received(signed_origin, tmp_path):
    hb = json.loads((signed_origin / heartbeat.KEY).read_text())
    assert hb["latest_step"] == 1 and hb["signature"]["algorithm"] == "ed25519" and time.time() - hb["at"] < 60
    dcr("receive", signed_origin, "--receiver", "r", "--state", tmp_path / "s.safetensors", "--max-staleness", 60, check=0)


def test_a_mirror_that_stopped_copying_is_refused_by_age_until_it_copies_again(signed_origin, tmp_path, monkeypatch):
    """The origin's last heartbeat is an hour old when the mirror copies it, then the mirror stops:
    its receivers with ``--max-staleness 600`` refuse it, naming the age, and their state is kept.
    A renewed heartbeat upstream, copied by the next mirror run, makes it acceptable again."""
    region, state = tmp_path / "region", tmp_path / "s.safetensors"
    monkeypatch.setenv("DCR_SIGNING_KEY_FILE", str(tmp_path / "key"))
    monkeypatch.delenv("DCR_VERIFY_KEY_FILE")
    r = Root(str(signed_origin))
    heartbeat.beat(r, signing.publisher_key(), now=time.time() - 3600)
    monkeypatch.delenv("DCR_SIGNING_KEY_FILE")
    monkeypatch.setenv("DCR_VERIFY_KEY_FILE", str(tmp_path / "key.pub"))
    dcr("mirror", signed_origin, region, check=0)
    dcr("receive", region, "--receiver", "r", "--state", state, "--step", 0, check=0)
    before = file_bytes(state)
    out = dcr("receive", region, "--receiver", "r", "--state", state, "--max-staleness", 600, check=5)
    assert len(out.stderr.strip().splitlines()) == 1 and "its newest heartbeat is 36" in out.stderr, out.stderr
    assert "more than --max-staleness 600 s" in out.stderr and file_bytes(state) == before
    dcr("heartbeat", signed_origin, env={"DCR_SIGNING_KEY_FILE": str(tmp_path / "key")}, check=0)
    dcr("mirror", signed_origin, region, check=0)
    dcr("receive", region, "--receiver", "r", "--state", state, "--max-staleness", 600, check=0)


def test_a_forged_fresh_heartbeat_is_refused_and_a_missing_one_named(signed_origin, tmp_path):
    """Someone without the key writes a fresh, unsigned heartbeat to hide a frozen mirror: refused.
    A ROOT with no heartbeat at all is refused under ``--max-staleness`` as such; bad values are
    usage errors."""
    state = tmp_path / "s.safetensors"
    doc = json.loads((signed_origin / heartbeat.KEY).read_text())
    doc.pop("signature")
    doc["at"] = time.time()
    (signed_origin / heartbeat.KEY).write_text(json.dumps(doc))
    out = dcr("receive", signed_origin, "--receiver", "r", "--state", state, "--max-staleness", 600, check=5)
    assert "heartbeat is not signed" in out.stderr and not state.exists()
    os.unlink(signed_origin / heartbeat.KEY)
    out = dcr("receive", signed_origin, "--receiver", "r", "--state", state, "--max-staleness", 600, check=5)
    assert "no heartbeat (heartbeat.json)" in out.stderr and not state.exists()
    for bad in ("inf", "0", "-5"):
        out = dcr("receive", signed_origin, "--receiver", "r", "--state", state, "--max-staleness", bad, check=2)
        assert "argument --max-staleness" in out.stderr


def test_a_heartbeat_copied_without_its_steps_or_from_another_run_vouches_for_nothing(signed_origin, tmp_path):
    """A replaying mirror serves step 0 and puts the origin's fresh, validly signed heartbeat (it
    names step 1) beside it: refused, naming the step it does not hold. A fresh heartbeat of another
    ROOT's run, signed with the same key: refused, naming the run. The mirror itself copies a
    heartbeat only when it holds the step it names."""
    region, state = tmp_path / "region", tmp_path / "s.safetensors"
    dcr("mirror", signed_origin, region, "--step", 0, check=0)
    assert not (region / heartbeat.KEY).exists()  # it holds step 0 only: upstream's heartbeat names step 1
    shutil.copy(signed_origin / heartbeat.KEY, region / heartbeat.KEY)
    out = dcr("receive", region, "--receiver", "r", "--state", state, "--max-staleness", 600, check=5)
    assert "names step 1, which this ROOT does not hold" in out.stderr and not state.exists(), out.stderr
    other = tmp_path / "other"
    write_safetensors(tmp_path / "o.safetensors", {"w": torch.zeros(64)})
    dcr("publish", other, tmp_path / "o.safetensors", "--step", 1, env={"DCR_SIGNING_KEY_FILE": str(tmp_path / "key")},
        check=0)
    shutil.copy(other / heartbeat.KEY, signed_origin / heartbeat.KEY)
    out = dcr("receive", signed_origin, "--receiver", "r", "--state", state, "--max-staleness", 600, check=5)
    assert "a heartbeat of run" in out.stderr and "but this ROOT holds run" in out.stderr, out.stderr


def test_a_heartbeat_planted_in_a_mirror_is_replaced_by_upstreams(signed_origin, tmp_path):
    """Someone without the key plants an unsigned heartbeat dated a year ahead in a mirror (its
    ``--max-staleness`` receivers refuse it): the next ``dcr mirror`` replaces it with upstream's,
    byte for byte, and they accept the mirror again."""
    region, state = tmp_path / "region", tmp_path / "s.safetensors"
    dcr("mirror", signed_origin, region, check=0)
    doc = json.loads((region / heartbeat.KEY).read_text())
    doc.pop("signature")
    doc["at"] = time.time() + 365 * 86400
    (region / heartbeat.KEY).write_text(json.dumps(doc))
    out = dcr("receive", region, "--receiver", "r", "--state", state, "--max-staleness", 600, check=5)
    assert "heartbeat is not signed" in out.stderr
    dcr("mirror", signed_origin, region, check=0)
    assert file_bytes(region / heartbeat.KEY) == file_bytes(signed_origin / heartbeat.KEY)
    dcr("receive", region, "--receiver", "r", "--state", state, "--max-staleness", 600, check=0)


@pytest.mark.faults(component="security", outcome="a renewal that would go backwards signs nothing, naming both steps")
def test_a_renewal_never_goes_backwards_unless_the_newer_step_was_retracted(signed_origin, tmp_path):
    """A writer hides step 1's commit marker during a renewal: ``dcr heartbeat`` signs nothing and
    names both steps (a heartbeat naming step 0 would vouch for a mirror frozen there). With the
    marker back it renews; after ``dcr retract --step 1`` it names step 0, and step 1 as retracted."""
    key = {"DCR_SIGNING_KEY_FILE": str(tmp_path / "key")}
    marker = signed_origin / "steps" / "000000000001" / "commit.json"
    before = (signed_origin / heartbeat.KEY).read_bytes()
    os.rename(marker, tmp_path / "hidden.json")
    out = dcr("heartbeat", signed_origin, env=key, check=5)
    assert "newest live step is 0, older than step 1 its previous heartbeat named" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and (signed_origin / heartbeat.KEY).read_bytes() == before
    os.rename(tmp_path / "hidden.json", marker)
    dcr("heartbeat", signed_origin, env=key, check=0)
    assert json.loads((signed_origin / heartbeat.KEY).read_text())["latest_step"] == 1
    dcr("retract", signed_origin, "--step", 1, env=key, check=0)
    hb = json.loads(dcr("heartbeat", signed_origin, "--json", env=key, check=0).stdout)
    assert (hb["latest_step"], hb["retracted"]) == (0, [1])
    dcr("receive", signed_origin, "--receiver", "r", "--state", tmp_path / "s.safetensors", "--max-staleness", 60,
        check=0)
