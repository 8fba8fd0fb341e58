"""Coordinators of one fleet at once (``dcr fleet`` over state files, in this process and in two):
one holds the fleet's lease, the other is refused in one line or waits; one that lost its lease
moves no member (the members' fences) and writes no record (the record's); a coordinator killed
at any point it reports reaching, then a rerun, converges exactly; the record lists what each
member said it serves."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from dcr_core import events
from dcr_core.errors import BusyError, FencedError
from flows import run_publish, run_receive
from flows.options import PublishOptions
from flows.receive.fleet import FleetResult, FleetSwitchError, run_fleet
from flows.receive.pipeline import StateFile
from flows.receive.receiver import Binding
from storage import fleet, fleet_lease
from storage.root import Root, RootRef
from tests.support.cli import REPO, dcr
from tests.support.clock import ManualClock
from tests.support.helpers import assert_bits_equal, at_once, chain_of_steps, read_state
from tests.support.kill import kill_at, sweep

STEPS = chain_of_steps(3, seed=61)
LATER = fleet_lease.DEFAULT_TTL + fleet_lease.CLOCK_MARGIN + 1  # past any lease taken now


@pytest.fixture
def root(tmp_path):
    r = str(tmp_path / "bucket")
    for i, ck in enumerate(STEPS):
        run_publish(r, ck, i, options=PublishOptions(chunk_bytes=256, cache_dir=str(tmp_path / "cache")))
    return r


@pytest.fixture
def members(root, tmp_path):
    """Two state files at step 0, as ``state:PATH`` members."""
    paths = [str(tmp_path / f"{n}.safetensors") for n in "ab"]
    for p in paths:
        run_receive(root, f"r-{os.path.basename(p)}", p, step=0)
    return paths


def _engines(paths):
    return [f"state:{p}" for p in paths]


def _assert_fleet_at(root, paths, step, name="f"):
    """Every member holds ``step`` exactly, and the fleet's record says so."""
    for p in paths:
        assert_bits_equal(read_state(p), STEPS[step])
    rec = fleet.read(Root(root), name)
    assert (rec.version, rec.outcome in ("switched", "unchanged")) == (step, True), rec
    assert [m.step for m in rec.members] == [step] * len(paths)


def _on(point, fleet_name, action):
    """A listener calling ``action(fields)`` the first time ``point`` is reached (for ``fleet_name``,
    where the point names its fleet)."""
    done = []

    def listener(p, fields):
        if p == point and fields.get("fleet", fleet_name) == fleet_name and not done:
            done.append(True)
            action(fields)

    return listener


def test_a_second_coordinator_is_refused_in_one_line_naming_the_holder_and_status_shows_it(root, members):
    seen = {}

    def second(fields):
        seen["epoch"] = fields["epoch"]
        seen["cli"] = dcr("fleet", root, *sum((["--engine", e] for e in _engines(members)), []), "--step", "1",
                          "--name", "f")
        seen["status"] = dcr("status", root, check=0).stdout

    with events.listening(_on("fleet.lease-taken", "f", second)):
        r = run_fleet(root, _engines(members), step=2, name="f")
    assert (r.outcome, r.version, seen["epoch"]) == ("switched", 2, 1)
    out = seen["cli"]
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert re.fullmatch(r"dcr: error: fleet f: another coordinator is switching it: \S+ pid \d+ \([0-9a-f]{12}\) holds "
                        r"its lease \(epoch 1\) until \S+Z \(in \d+ s, renewed while it switches\); retry later, or "
                        r"pass --wait SECONDS\n", out.stderr), out.stderr
    assert f"pid {os.getpid()}" in out.stderr
    assert re.search(r"switching now: \S+ pid \d+ \(\w+\), epoch 1, its lease until", seen["status"])
    _assert_fleet_at(root, members, 2)
    status = dcr("status", root, check=0).stdout  # after: each member's step and the record's age
    assert re.search(r"fleet f: version 2 \(switched, target 2, epoch 1; recorded \S+Z, \d+s ago\)", status), status
    assert f"  f-state-a.safetensors (state:{members[0]}): step 2, switched" in status
    assert "switching now" not in status


def test_wait_waits_for_the_other_coordinator_then_switches(root, members):
    box: dict = {}
    waiting = threading.Event()

    def start_second(fields):
        def second():
            try:
                box["second"] = run_fleet(root, _engines(members), step=2, name="f", wait=30)
            except Exception as e:  # noqa: BLE001 - asserted below
                box["second"] = e

        box["thread"] = threading.Thread(target=second)
        box["thread"].start()
        assert waiting.wait(10)  # the second one waits for the lease while the first switches

    def listener(p, fields):
        if p == "fleet.lease-waiting":
            waiting.set()

    t0 = time.monotonic()
    with events.listening(listener), events.listening(_on("fleet.member-update", "f", start_second)):
        first = run_fleet(root, _engines(members), step=1, name="f")
        box["thread"].join(30)
    assert time.monotonic() - t0 < 20
    assert (first.outcome, first.version) == ("switched", 1)
    assert isinstance(box["second"], FleetResult), box["second"]
    assert (box["second"].outcome, box["second"].version, box["second"].previous) == ("switched", 2, 1)
    _assert_fleet_at(root, members, 2)
    assert fleet.read(Root(root), "f").epoch == 2


@pytest.mark.parametrize("wait", [0.0, 30.0])
def test_two_coordinators_at_once_never_leave_the_members_apart(root, members, wait):
    """Two switches to different steps started together: without --wait one is refused (or comes
    after the other), with it both switch; the members always end on one step, the record's, and
    neither outlives its bound."""
    results, seconds = at_once({step: functools.partial(run_fleet, root, _engines(members)[::1 if step == 1 else -1],
                                                        step=step, name="f", wait=wait, timeout=20) for step in (1, 2)}, 60)
    assert seconds < 20
    ok = [s for s, r in results.items() if isinstance(r, FleetResult)]
    assert ok and all(isinstance(results[s], BusyError) for s in set(results) - set(ok)), results
    if wait:
        assert sorted(ok) == [1, 2]
    last = fleet.read(Root(root), "f").version
    assert last in ok
    _assert_fleet_at(root, members, last)


def test_two_coordinator_processes_at_once_end_on_one_step(root, members):
    engines = sum((["--engine", e] for e in _engines(members)), [])
    env = {**os.environ, "DCR_ORCHESTRATOR": "none"}
    procs = [subprocess.Popen([sys.executable, "-m", "flows.cli", "fleet", root, *engines, "--step", str(s), "--name", "f",
                               "--wait", "60", "--timeout", "60"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for s in (1, 2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    rec = fleet.read(Root(root), "f")
    assert rec.epoch == 2 and rec.generation == 4  # each switch: its "switching" record, then its own
    _assert_fleet_at(root, members, rec.version)


def test_a_coordinator_that_lost_its_lease_moves_no_member_and_writes_no_record(root, members, monkeypatch):
    """A takes the lease (epoch 1) and is paused before it holds anything; its lease expires, B
    takes epoch 2 and switches the fleet to 2. A, resuming unaware (its renewal silenced), is
    refused by every member and by the record; stopped by its own renewal, it stops before
    preparing. Both in one line."""
    clock = ManualClock()

    def overtaken(fields):
        clock.advance(LATER)
        r = run_fleet(root, _engines(members), step=2, name="f", clock=clock)
        assert (r.outcome, r.version) == ("switched", 2)
        monkeypatch.setattr(fleet_lease.FleetLease, "renew", lambda self: None)  # A notices nothing

    with events.listening(_on("fleet.lease-taken", "f", overtaken)):
        with pytest.raises(FleetSwitchError, match=r"^fleet f: its record \(generation 2\) was written at epoch 2, newer "
                           r"than this coordinator's epoch 1: another coordinator took over; nothing recorded$"):
            run_fleet(root, _engines(members), step=1, name="f", clock=clock, renew_in_background=False)
    _assert_fleet_at(root, members, 2)
    assert fleet.read(Root(root), "f").epoch == 2

    a = StateFile(members[0])  # the fence, as any process sees it: kept beside the file
    with pytest.raises(FencedError, match="^fleet f epoch 1 is older than epoch 2 this member has seen: another "
                       "coordinator took over$"):
        a.bind(Binding(RootRef(root), "r-a", coordinator="f", epoch=1))
    a.bind(Binding(RootRef(root), "r-a", coordinator="f", epoch=3))  # a newer one is let in (and kept once held)

    monkeypatch.undo()  # B's clock runs ahead of A's: by A's, its lease still holds; it finds B's newer epoch
    with events.listening(_on("fleet.lease-taken", "f", lambda fields: run_fleet(
            root, _engines(members), step=2, name="f", clock=ManualClock(start=clock.time() + LATER)))):
        with pytest.raises(FleetSwitchError, match=r"^fleet f: this coordinator lost its lease \(epoch 3\): \S+ pid \d+ "
                           r"\(\w+\) took it over at epoch 4; it stopped before preparing \(nothing changed\)$"):
            run_fleet(root, _engines(members), step=1, name="f", clock=clock, renew_in_background=False)
    _assert_fleet_at(root, members, 2)


KILL_POINTS = ["fleet.lease-taken", "fleet.member-hold@2", "fleet.lease-renewed@1", "fleet.lease-renewed@2",
               "fleet.member-update@1", "fleet.member-update@2", "fleet.read-back", "fleet.record-written"]


@pytest.mark.faults(component="fleet coordinator", outcome="a rerun brings every member to the step exactly; the record says so")
@pytest.mark.parametrize("point", sweep(KILL_POINTS, {"fleet.member-update@2", "fleet.record-written"}))
def test_a_coordinator_dying_at_any_point_then_a_rerun_converges(root, members, point):
    """In this process: the coordinator "dies" at ``point`` (nothing after it runs but the
    ``finally`` blocks); a rerun, once the dead one's lease expired, brings every member to the step
    exactly and records it."""
    spec = point if "@" in point else f"{point}@1"
    with events.failpoints(f"{spec}=raise"), pytest.raises(events.FailpointError):
        run_fleet(root, _engines(members), step=2, name="f")
    r = run_fleet(root, _engines(members), step=2, name="f", clock=ManualClock(start=time.time() + LATER))
    assert r.version == 2 and r.outcome in ("switched", "unchanged")
    _assert_fleet_at(root, members, 2)


@pytest.mark.faults(component="fleet coordinator", outcome="a rerun takes the dead one's lease at once and brings every "
                    "member to the step exactly; the record says so")
@pytest.mark.parametrize("point", sweep(KILL_POINTS, {"fleet.member-update@2"}))
def test_kill_9_of_a_coordinator_then_a_rerun_converges_at_once(root, members, point):
    """``dcr fleet`` killed (SIGKILL) at ``point``: its lease is left held, its locks die with it; a
    rerun on this machine sees that the holder's process is gone, takes the lease at once, and
    brings every member to the step exactly."""
    engines = sum((["--engine", e] for e in _engines(members)), [])
    kill_at(point, "fleet", root, *engines, "--step", "2", "--name", "f")
    t0 = time.monotonic()
    out = dcr("fleet", root, *engines, "--step", "2", "--name", "f")
    assert out.returncode == 0 and time.monotonic() - t0 < 10, out.stderr
    _assert_fleet_at(root, members, 2)


def test_a_member_down_is_unknown_and_does_not_make_the_others_mixed(root, members):
    from tests.integration.test_fleet import _dead_url

    dead = _dead_url()
    with pytest.raises(FleetSwitchError, match="nobody switched"):
        run_fleet(root, [*_engines(members), f"m0={dead}"], step=1, name="f")
    rec = fleet.read(Root(root), "f")
    assert (rec.outcome, rec.version) == ("aborted", None)
    assert [(m.receiver, m.step) for m in rec.members] == [("f-state-a.safetensors", 0), ("f-state-b.safetensors", 0),
                                                           ("m0", None)]
    status = dcr("status", root, check=0).stdout
    assert "fleet f: version unknown (aborted, target 1" in status and "mixed" not in status


def test_a_switch_is_done_only_when_every_member_says_it_serves_the_step(root, members):
    """A member that applied the step but does not answer when asked afterwards (here: a state file
    whose version cannot be read once it recorded): the record says so (``unconfirmed``, its step
    unknown, no version) and the command fails; the next switch, answered, converges."""
    from flows.receive.fleet_members import MemberError
    from flows.receive.receiver import member

    class Silent(StateFile):
        def record(self):
            super().record()
            self.recorded = True

        def version(self):
            if getattr(self, "recorded", False):
                raise MemberError(f"{self.name}: no answer")
            return super().version()

    def connect(url):
        return Silent(url[len("state:"):]) if url.endswith("b.safetensors") else member(url)

    with pytest.raises(FleetSwitchError, match=rf"^fleet f: every member applied step 2, but state:{members[1]} did not "
                       r"answer \(see the fleet record\)$") as e:
        run_fleet(root, _engines(members), step=2, name="f", connect=connect)
    assert (e.value.result.outcome, e.value.result.version) == ("unconfirmed", None)
    rec = fleet.read(Root(root), "f")
    assert [(m.step, m.outcome) for m in rec.members] == [(2, "switched"), (None, "switched")]
    assert "asked its version after the switch: " in rec.members[1].error
    r = run_fleet(root, _engines(members), step=2, name="f")  # b's step was unknown: it is refitted (to where it is)
    assert (r.outcome, r.version) == ("switched", 2)
    _assert_fleet_at(root, members, 2)


def test_the_record_says_a_switch_is_under_way_before_any_member_changes(root, members):
    """From before the first member changes until the switch's own record, the record names no step
    (``switching``): a coordinator killed in between leaves no record naming a step a member left."""
    seen = []

    def at_update(fields):  # the first member about to be updated
        rec = fleet.read(Root(root), "f")
        seen.append((rec.outcome, rec.version, rec.target, [(m.step, m.outcome) for m in rec.members]))

    with events.listening(_on("fleet.member-update", "f", at_update)):
        r = run_fleet(root, _engines(members), step=2, name="f")
    assert seen == [("switching", None, 2, [(None, "switching"), (None, "switching")])]
    assert (r.outcome, r.version) == ("switched", 2)
    _assert_fleet_at(root, members, 2)
    assert fleet.read(Root(root), "f").generation == 2
    unchanged = run_fleet(root, _engines(members), step=2, name="f")  # nobody changes: no "switching" record
    assert (unchanged.outcome, fleet.read(Root(root), "f").generation) == ("unchanged", 3)


def test_a_step_retracted_while_the_members_prepared_it_switches_nobody(root, members):
    from flows import run_retract

    with events.listening(_on("fleet.record-written", "f", lambda fields: run_retract(root, 2))):
        with pytest.raises(FleetSwitchError, match="^fleet f: nobody switched: step 2 was retracted while the members "
                           "prepared it$") as e:
            run_fleet(root, _engines(members), step=2, name="f")
    assert (e.value.result.outcome, e.value.result.version) == ("aborted", 0)
    for p in members:
        assert_bits_equal(read_state(p), STEPS[0])
    r = run_fleet(root, _engines(members), name="f")  # the newest live step
    assert (r.outcome, r.version) == ("switched", 1)


def test_a_version_that_disagrees_with_the_members_own_record_is_unknown_until_a_switch_sets_it(root):
    """A server whose version lags its weights (a coordinator died after updating it, and its open
    session was then finished without a version) says step 1 while it serves 2, as its own record
    in ROOT says: a switch that does not set it records its step as unknown, one that does, as set."""
    from flows.receive.fleet_members import HttpServer
    from storage.catalog import Catalog
    from tests.support.vllm_answers import VllmAnswers

    lagging, other = VllmAnswers("1"), VllmAnswers("1")
    lagging.weights = 2
    Catalog(Root(root)).record_receiver(2, "m0", {"from_step": 1, "moves": ["delta:2"], "policy_digest": "x"})
    servers = {"http://m0:8000": lagging, "http://m1:8000": other}

    def connect(url):
        return HttpServer(url, timeout=5, call=servers[url], clock=ManualClock())

    engines = ["m0=http://m0:8000", "m1=http://m1:8000"]
    other.failing = {"/start_weight_update": "RuntimeError: preparing step 1 failed"}
    with pytest.raises(FleetSwitchError, match="nobody switched"):
        run_fleet(root, engines, step=1, name="f", connect=connect)
    rec = fleet.read(Root(root), "f")
    assert [(m.receiver, m.step) for m in rec.members] == [("m0", None), ("m1", 1)]
    assert "says step 1, which disagrees with its last recorded refit" in rec.members[0].error
    other.failing = {}
    r = run_fleet(root, engines, step=1, name="f", connect=connect)  # m0 is applied, not left alone as "at 1"
    assert (r.outcome, r.version, lagging.weights, lagging.version) == ("switched", 1, 1, "1")
