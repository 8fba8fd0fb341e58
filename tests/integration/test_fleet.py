"""``dcr fleet`` without vLLM: bad input, a fleet whose members are down, and the fleet record.
(Switches of real vLLM servers: ``tests/vllm``, ``make test-vllm``.)"""

from __future__ import annotations

import json
import os
import socket

import pytest

from dcr_core.errors import IntegrityError, StepNotFoundError, UsageError
from flows import run_publish, run_retract
from flows.options import PublishOptions
from flows.receive.fleet import FleetResult, FleetSwitchError, parse_members, run_fleet
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
                     (["http://h:1", "http://h:1"], "a different member"), (["x y=http://h:1"], "receiver id")):
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
    assert "fleet gen: aborted; version unknown (target 1, previous none)" in out.stdout  # unknown: not "mixed"
    assert f"{dead} (m0): step unknown, failed" in out.stdout
    status = dcr("status", root, check=0)
    assert "fleet gen: version unknown (aborted, target 1, epoch 1; recorded " in status.stdout
    assert f"  m0 ({dead}): step unknown, failed: {dead}/init_weight_transfer_engine:" in status.stdout
    data = json.loads(dcr("status", root, "--json", check=0).stdout)
    assert [f["fleet"] for f in data["fleets"]] == ["gen"]
    assert data["fleets"][0]["epoch"] == 1 and data["switching"] == {}


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


def test_state_file_members_switch_all_or_nothing_through_the_same_calls(root, tmp_path):
    """Two state files as fleet members (``state:PATH``, no vLLM): 0 -> 2 -> 1 exactly (every bit
    equal to the published checkpoints); an update that breaks on one member (an injected fault,
    before its file changes) takes the other back to 1 exactly; a member whose prepare fails means
    nobody switches; a rerun converges."""
    from dcr_core import events
    from flows import run_receive
    from tests.support.helpers import assert_bits_equal, read_state

    steps = chain_of_steps(3, seed=61)
    a, b = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    run_receive(root, "f-state-a.safetensors", a, step=0)  # receivers that held step 0 before joining
    run_receive(root, "sb", b, step=0)
    members = [f"state:{a}", f"sb=state:{b}"]
    assert [m.receiver for m in parse_members("f", members)] == ["f-state-a.safetensors", "sb"]
    r = run_fleet(root, members, step=2, name="f")
    assert (r.outcome, r.version) == ("switched", 2)
    for p in (a, b):
        assert_bits_equal(read_state(p), steps[2])
    full = sum(t.numel() * t.element_size() for t in steps[2].values())
    pulled = [m["bytes_pulled"] for m in fleet.read(Root(root), "f").model_dump()["members"]]
    assert [m["bytes_pulled"] for m in r.members] == pulled and all(0 < p < full for p in pulled), pulled
    r = run_fleet(root, members, step=1, name="f")  # back: the inverse delta
    assert (r.outcome, r.version, r.previous) == ("switched", 1, 2)
    for p in (a, b):
        assert_bits_equal(read_state(p), steps[1])

    reached = []
    with events.listening(lambda point, fields: reached.append(point)), events.failpoints("fleet.member-update@2=fail"):
        with pytest.raises(FleetSwitchError, match="every member was taken back") as e:
            run_fleet(root, members, step=2, name="f")
    assert reached.count("fleet.member-update") == 3  # two updates to 2 (the second failed), one back to 1
    res = e.value.result
    assert (res.outcome, res.version) == ("taken-back", 1)
    assert sorted(m["outcome"] for m in res.members) == ["failed", "taken-back"]
    for p in (a, b):
        assert_bits_equal(read_state(p), steps[1])
    beside = {f for f in os.listdir(tmp_path) if f.startswith((".a", ".b")) or ".tmp" in f}
    assert beside == {".a.safetensors.fleet-epochs", ".b.safetensors.fleet-epochs"}  # their fences; nothing staged

    with open(b, "r+b") as f:  # a damaged member: its held bits no longer verify, so its prepare fails
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(FleetSwitchError, match=f"nobody switched: state:{b} could not prepare step 2"):
        run_fleet(root, members, step=2, name="f")
    assert_bits_equal(read_state(a), steps[1])
    assert fleet.read(Root(root), "f").outcome == "aborted"
    os.unlink(b)  # replaced by an empty receiver: it rejoins with a whole step
    assert run_fleet(root, members, name="f").version == 2  # the newest live step
    for p in (a, b):
        assert_bits_equal(read_state(p), steps[2])


def test_an_unknown_member_url_is_refused_naming_it(root):
    with pytest.raises(UsageError, match="expected http://HOST:PORT, state:PATH or local:NAME"):
        parse_members("f", ["ftp://h/x"])
    with pytest.raises(FleetSwitchError, match="local:nobody: no in-process engine registered"):
        run_fleet(root, ["local:nobody"], name="f")


def test_phase_one_waits_for_each_members_prepare_report_in_root(root):
    """A server member reports its background prepare in ``prepared/<receiver>.json`` (one per TP
    rank): the coordinator waits for the report with its prepare id, stops at the first failure,
    ignores an older prepare's report, and gives up after its timeout (None: the start call waits)."""
    from flows.receive.fleet_members import MemberError, await_prepared
    from storage.catalog import Catalog
    from storage.root import RootRef, open_root

    ref = RootRef(root)
    cat = Catalog(open_root(ref))
    m = {"url": "http://gen-0:8000", "receiver": "f-gen-0-8000"}
    cat.record_prepared("f-gen-0-8000", {"prepare_id": "old", "step": 2, "ok": True, "ranks": 1})
    assert await_prepared(ref, m, "new", timeout=0.3) is None  # an older prepare's report is not this one
    cat.record_prepared("f-gen-0-8000", {"prepare_id": "new", "step": 2, "ok": True, "ranks": 1, "held": 1})
    assert [r["held"] for r in await_prepared(ref, m, "new", timeout=5)] == [1]

    tp = {"url": "http://gen-1:8000", "receiver": "f-gen-1-8000"}
    cat.record_prepared("f-gen-1-8000-rank0", {"prepare_id": "p", "step": 2, "ok": True, "ranks": 2})
    assert await_prepared(ref, tp, "p", timeout=0.3) is None  # rank 1 has not reported yet
    cat.record_prepared("f-gen-1-8000-rank1", {"prepare_id": "p", "step": 2, "ok": False, "ranks": 2,
                                               "error": "IntegrityError: step 2: chunk digest mismatch"})
    with pytest.raises(MemberError, match="gen-1:8000: preparing step 2 failed: IntegrityError"):
        await_prepared(ref, tp, "p", timeout=5)
    cat.record_prepared("f-gen-1-8000-rank1", {"prepare_id": "p", "step": 2, "ok": True, "ranks": 2})
    assert len(await_prepared(ref, tp, "p", timeout=5)) == 2


def _state_members(root, tmp_path, step=0):
    """Two state files holding ``step``, before any fleet switched them."""
    from flows import run_receive

    a, b = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    run_receive(root, "ra", a, step=step)
    run_receive(root, "rb", b, step=step)
    return a, b


def test_one_state_file_named_twice_is_refused_before_anything_changes(root, tmp_path, monkeypatch):
    """By a link and its target, or by a relative and an absolute path: one line naming both,
    before any file, lock or record is touched (two holds of one file would wait for each other)."""
    from tests.support.helpers import tree_snapshot

    a, _ = _state_members(root, tmp_path)
    os.symlink(a, tmp_path / "link.safetensors")
    monkeypatch.chdir(tmp_path)
    before = tree_snapshot(tmp_path)
    with pytest.raises(UsageError, match=rf"^--engine state:{tmp_path}/a\.safetensors and --engine "
                       rf"state:{tmp_path}/link\.safetensors are one member \(state:{tmp_path}/a\.safetensors\)"):
        run_fleet(root, [f"state:{a}", "state:link.safetensors"], step=1, name="f")
    with pytest.raises(UsageError, match=rf"^--engine: state:{tmp_path}/a\.safetensors named twice"):
        run_fleet(root, ["state:a.safetensors", f"ra=state:{a}"], step=1, name="f")
    assert tree_snapshot(tmp_path) == before  # no file, lock or record changed (ROOT lies under tmp_path)


def test_two_switches_over_the_same_state_files_in_opposite_order_both_finish(root, tmp_path):
    """Coordinator 1 names a then b, coordinator 2 b then a; 2 starts while 1 holds its first member
    and is about to take its second, and gets half a second to take one of its own first. Taken in
    each coordinator's order, 1 would wait for b and 2 for a: a deadlock (each then gives up at its
    timeout). Taken in the one order of every coordinator, 2 waits for 1's switch, then makes its own."""
    import threading
    import time

    from dcr_core import events
    from tests.support.helpers import assert_bits_equal, read_state

    steps = chain_of_steps(3, seed=61)
    a, b = _state_members(root, tmp_path)
    results: dict[str, object] = {}
    second_started, second_holds_one = threading.Event(), threading.Event()
    holds = {"f1": 0, "f2": 0}

    def switch(name, members, step):
        try:
            results[name] = run_fleet(root, members, step=step, name=name, timeout=5)
        except Exception as e:  # noqa: BLE001 - reported by the assertions below
            results[name] = e

    second = threading.Thread(target=switch, args=("f2", [f"state:{b}", f"state:{a}"], 2))

    def listener(point, fields):
        if point != "fleet.member-hold":
            return
        holds[fields["fleet"]] += 1
        if fields["fleet"] == "f2":
            (second_holds_one if holds["f2"] == 2 else second_started).set()
        elif holds["f1"] == 2:  # coordinator 1 holds its first member
            second.start()
            assert second_started.wait(5)
            second_holds_one.wait(0.5)  # set only if coordinator 2 got a first member of its own

    t0 = time.monotonic()
    with events.listening(listener):
        switch("f1", [f"state:{a}", f"state:{b}"], 1)
        second.join(10)
    assert not second.is_alive() and time.monotonic() - t0 < 5
    for name, step in (("f1", 1), ("f2", 2)):
        assert isinstance(results[name], FleetResult), results[name]
        assert (results[name].outcome, results[name].version) == ("switched", step)
    for p in (a, b):
        assert_bits_equal(read_state(p), steps[2])  # the switch that waited came last


def test_a_state_file_locked_elsewhere_bounds_dcr_fleet_by_its_timeout(root, tmp_path):
    """Another writer holds b's lock: ``dcr fleet --timeout 2`` gives up after 2 s in one line naming
    the member, and nothing changed: the files, their locks, no fleet record."""
    import time

    from storage.local import state
    from tests.support.helpers import file_bytes

    a, b = _state_members(root, tmp_path)
    before = (file_bytes(a), file_bytes(b))
    with state.exclusive(b):
        t0 = time.monotonic()
        out = dcr("fleet", root, "--engine", f"state:{a}", "--engine", f"state:{b}", "--step", "2", "--timeout", "2")
        took = time.monotonic() - t0
    assert out.returncode == 1 and 2 <= took < 3.5, (out.returncode, took, out.stderr)
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(
        f"dcr: error: fleet default: nobody switched: state:{b} is held by another writer")
    assert out.stderr.endswith("did not come free in 2 s (the timeout)\n")
    assert (file_bytes(a), file_bytes(b)) == before and fleet.read(Root(root), "default") is None
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".lock")]


def test_a_server_member_is_sent_no_credentials_and_an_absolute_root(root, tmp_path, monkeypatch):
    """A credential among the storage options is refused in one line naming it, before any member is
    asked anything (no record); a relative local ROOT travels as an absolute path, the other
    options as they are."""
    from flows.receive.fleet_members import HttpServer
    from flows.receive.receiver import Binding
    from storage.root import RootRef

    dead = _dead_url()
    for options, named in (({"secret": "s3cr3t", "endpoint_url": "http://s3:9000"}, "secret"),
                           ({"client_kwargs": {"aws_session_token": "t"}}, "client_kwargs.aws_session_token")):
        with pytest.raises(UsageError, match=rf"^{dead}: storage option '{named}' is a credential, and none is sent"):
            run_fleet(root, [dead], name="f", storage_options=options)
    out = dcr("fleet", root, "--engine", dead, "--storage-option", "account_key=abc", check=2)
    assert out.stderr.count("\n") == 1 and "storage option 'account_key' is a credential" in out.stderr
    assert "abc" not in out.stderr
    assert fleet.read(Root(root), "f") is None and fleet.read(Root(root), "default") is None

    monkeypatch.chdir(os.path.dirname(root))
    server = HttpServer(dead)
    server.bind(Binding(RootRef("bucket", {"anon": False, "endpoint_url": "http://s3:9000"}), "f-gen"))
    sent = server._init_info(2)
    assert (sent["root"], sent["storage_options"], sent["receiver_id"]) == (
        root, {"anon": False, "endpoint_url": "http://s3:9000"}, "f-gen")
    with pytest.raises(UsageError, match="lives in this process only"):
        server.bind(Binding(RootRef("memory://bucket"), "f-gen"))


def test_a_plain_receive_of_a_member_waits_out_its_fleets_switch(root, tmp_path):
    """A ``dcr receive`` of a state file that a fleet switched (its epochs kept beside it) is refused
    in one line while that fleet's lease is held (another coordinator is switching it), before the
    file or ROOT changes; once the lease is released it goes through."""
    from dcr_core.errors import BusyError
    from flows import run_receive
    from storage import fleet_lease
    from storage.root import open_root
    from tests.support.helpers import assert_one_line, file_bytes

    a, b = _state_members(root, tmp_path)
    run_fleet(root, [f"state:{a}", f"state:{b}"], step=1, name="gen")
    before = file_bytes(a)
    lease = fleet_lease.take(open_root(root), "gen", 30.0, 0.0)  # a coordinator switching fleet gen
    try:
        with pytest.raises(BusyError, match=rf"^{a}: a member of fleet gen, which .* is switching \(lease epoch "
                           r"2, until .*\): a change outside the fleet would race it") as e:
            run_receive(root, "ra", a, step=2)
        assert_one_line(e.value)
        assert file_bytes(a) == before
        run_receive(root, "other", str(tmp_path / "c.safetensors"), step=2)  # a file no fleet switched: as ever
    finally:
        lease.release()
    assert run_receive(root, "ra", a, step=2).step == 2  # nobody switching: the next switch asks it its step
