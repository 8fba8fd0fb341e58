"""``dcr fleet`` without vLLM: bad input, a fleet whose members are down, and the fleet record.
(Switches of real vLLM servers: ``tests/vllm``, ``make test-vllm``.)"""

from __future__ import annotations

import json
import socket

import pytest

from dcr_core.errors import IntegrityError, StepNotFoundError, UsageError
from flows import run_publish, run_retract
from flows.options import PublishOptions
from flows.receive.fleet import FleetSwitchError, parse_members, run_fleet
from storage import fleet, layout
from storage.root import Root
from tests.support.cli import dcr
from tests.support.helpers import chain_of_steps


def _dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on (bound, then closed)
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def root(tmp_path):
    r = str(tmp_path / "bucket")
    for i, ck in enumerate(chain_of_steps(3, seed=61)):
        run_publish(r, ck, i, options=PublishOptions(chunk_bytes=256, cache_dir=str(tmp_path / "cache")))
    return r


def test_members_are_named_by_fleet_host_and_port_or_by_their_own_id():
    a, b = parse_members("rollout", ["http://10.0.0.7:8000/", "gen-b=http://gpu-b:8001"])
    assert (a.url, a.receiver) == ("http://10.0.0.7:8000", "rollout-10.0.0.7-8000")
    assert (b.url, b.receiver) == ("http://gpu-b:8001", "gen-b")
    for bad, why in ((["10.0.0.7:8000"], "expected http://HOST:PORT"), ([], "at least one --engine"),
                     (["http://h:1", "http://h:1"], "a different server"), (["x y=http://h:1"], "receiver id")):
        with pytest.raises(UsageError, match=why):
            parse_members("f", bad)


def test_a_fleet_with_a_member_down_switches_nobody_and_records_it(root):
    dead = _dead_url()
    with pytest.raises(FleetSwitchError, match=f"fleet f: nobody switched: {dead} could not prepare step 2") as e:
        run_fleet(root, [dead], name="f")  # the newest live step
    r = e.value.result
    assert (r.outcome, r.version, r.target) == ("aborted", None, 2)
    assert [(m["outcome"], m["step"]) for m in r.members] == [("failed", None)]
    rec = fleet.read(Root(root), "f")
    assert (rec.outcome, rec.target, rec.members[0].receiver) == ("aborted", 2, f"f-127.0.0.1-{dead.rsplit(':', 1)[1]}")
    assert "Connection refused" in rec.members[0].error


def test_the_cli_prints_every_member_then_one_error_line_and_status_shows_the_fleet(root):
    dead = _dead_url()
    out = dcr("fleet", root, "--engine", f"m0={dead}", "--step", "1", "--name", "gen")
    assert out.returncode == 6
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("dcr: error: fleet gen: nobody switched:")
    assert "fleet gen: aborted; version mixed (target 1, previous none)" in out.stdout
    assert f"{dead} (m0): step unknown, failed" in out.stdout
    status = dcr("status", root, check=0)
    assert "fleet gen: version mixed (aborted, target 1," in status.stdout and "m0@?" in status.stdout
    data = json.loads(dcr("status", root, "--json", check=0).stdout)
    assert [f["fleet"] for f in data["fleets"]] == ["gen"]


def test_a_fleet_switches_only_to_a_live_step(root):
    run_retract(root, 2)
    for step, why in ((2, "step 2 is retracted"), (7, "step 7 is not committed")):
        with pytest.raises(StepNotFoundError, match=why):
            run_fleet(root, [_dead_url()], step=step)
    with pytest.raises(UsageError, match="fleet name"):
        run_fleet(root, [_dead_url()], name="../x")
    assert dcr("fleet", root, "--engine", "nope", check=2).stderr.startswith("dcr: error: --engine 'nope'")


def test_a_damaged_fleet_record_is_refused_in_one_line(root):
    r = Root(root)
    r.write(layout.fleet_key("f"), b'{"format": "dcr-fleet", "fleet": "f", "version": -1}')
    with pytest.raises(IntegrityError, match=r"fleets/f\.json: not a DCR fleet record \(version"):
        fleet.read(r, "f")
    r.write(layout.fleet_key("f"), b"\xff")
    with pytest.raises(IntegrityError, match=r"fleets/f\.json: not a DCR fleet record"):
        fleet.read(r, "f")
