"""A fleet's coordinator lease and its record in ROOT (``storage.fleet_lease``, ``storage.fleet``),
without members: one holder at a time, epochs that only grow, expiry and takeover, the record's
write conditional on the epoch, and records written before epochs existed."""

from __future__ import annotations

import threading
import uuid

import pytest

from dcr_core.errors import BusyError, FencedError
from storage import fleet, fleet_lease, layout
from storage.root import Root
from tests.support.clock import ManualClock


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    return Root(str(tmp_path / "bucket") if request.param == "local" else f"memory://lease-{uuid.uuid4().hex}")


def _holder(name: str, **kw) -> fleet_lease.Holder:
    return fleet_lease.Holder(host=f"host-{name}", pid=4242, id=name, **kw)


def _take(root, clock, name, wait=0.0, **kw):
    return fleet_lease.take(root, "gen", 30.0, wait, clock, holder=_holder(name), **kw)


def test_one_holder_at_a_time_refused_in_one_line_then_released_to_the_next_epoch(root):
    clock = ManualClock(start=1_800_000_000.0)
    a = _take(root, clock, "a")
    assert a.epoch == 1
    with pytest.raises(BusyError) as e:
        _take(root, clock, "b")
    assert str(e.value) == ("fleet gen: another coordinator is switching it: host-a pid 4242 (a) holds its lease (epoch 1) "
                            "until 2027-01-15T08:00:30Z (in 30 s, renewed while it switches); retry later, or pass "
                            "--wait SECONDS")
    assert "\n" not in str(e.value) and e.value.exit_code == 1
    clock.advance(20)
    a.renew()  # extended by its length from now
    assert a.expires_at == clock.time() + 30
    a.release()
    b = _take(root, clock, "b")  # released: no wait for its expiry
    assert b.epoch == 2
    assert fleet_lease.newest(root, "gen")[1].holder.id == "b"


def test_an_expired_lease_is_taken_over_and_its_old_holder_finds_it_lost(root):
    clock = ManualClock()
    a = _take(root, clock, "a")
    clock.advance(30 + fleet_lease.CLOCK_MARGIN - 1)  # expired by the holder's clock, still honoured (margin)
    with pytest.raises(BusyError):
        _take(root, clock, "b")
    clock.advance(1)
    b = _take(root, clock, "b")
    assert b.epoch == 2
    with pytest.raises(FencedError, match=r"^fleet gen: this coordinator lost its lease \(epoch 1\): it expired at"):
        a.renew()  # past its own expiry: it stops, whoever holds the lease now
    a.release()  # a lost lease is not touched
    assert fleet_lease.newest(root, "gen")[1].holder.id == "b" and not fleet_lease.newest(root, "gen")[1].released


def test_a_holder_that_finds_a_newer_epoch_has_lost_its_lease(root):
    clock = ManualClock()
    a = _take(root, clock, "a")
    # another coordinator whose clock runs ahead took epoch 2 while a still thinks it holds epoch 1
    fleet_lease.take(root, "gen", 30.0, 0.0, ManualClock(start=clock.time() + 3600), holder=_holder("b"))
    with pytest.raises(FencedError, match=r"lost its lease \(epoch 1\): host-b pid 4242 \(b\) took it over at epoch 2"):
        a.renew()
    with pytest.raises(FencedError):  # and stays lost
        a.renew()


def test_wait_polls_until_the_holder_lets_go(root):
    clock = ManualClock()
    a = _take(root, clock, "a")
    with pytest.raises(BusyError, match=r"; it did not come free in 5 s \(--wait\)$"):
        _take(root, clock, "b", wait=5.0)
    assert 5.0 <= clock.slept < 6.0
    b = _take(root, clock, "b", wait=60.0)  # a's lease (30 s) expires within the wait: taken over then
    assert b.epoch == 2 and clock.slept >= 30 + fleet_lease.CLOCK_MARGIN - 5
    assert a.epoch == 1


def test_racing_takers_one_wins_and_epochs_only_grow(root):
    clock = ManualClock()
    won, busy = [], []
    barrier = threading.Barrier(8)

    def race(i):
        barrier.wait()
        try:
            won.append(_take(root, clock, f"t{i}"))
        except BusyError:
            busy.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(busy) == 7 and won[0].epoch == 1
    for n in range(2, 9):  # released and taken again: one epoch each, the old objects pruned
        won[-1].release()
        won.append(_take(root, clock, f"again{n}"))
        assert won[-1].epoch == n
    kept = sorted(root.listdir(layout.fleet_leases_dir("gen")))
    assert kept == [f"{e:012d}.json" for e in range(5, 9)]  # the last KEEP


def test_a_holder_known_dead_on_this_machine_is_taken_over_at_once(root):
    """A lease records its process's identity on its machine; a taker of the same boot, pid
    namespace and uid takes it at once when that process is gone, never on another machine."""
    clock = ManualClock()
    me = fleet_lease.this_holder()
    if me.started is None:
        pytest.skip("no /proc: a holder's process cannot be told here")
    dead = me.model_copy(update={"id": "dead", "started": me.started + 1})  # the same pid started at another time
    fleet_lease.take(root, "gen", 30.0, 0.0, clock, holder=dead)
    assert fleet_lease.holder_gone(dead) and not fleet_lease.holder_gone(me)
    elsewhere = dead.model_copy(update={"id": "far", "boot": "another-machine"})
    assert not fleet_lease.holder_gone(elsewhere)
    b = fleet_lease.take(root, "gen", 30.0, 0.0, clock, holder=_holder("b"))
    assert b.epoch == 2
    fleet_lease.take(root, "other", 30.0, 0.0, clock, holder=elsewhere)
    with pytest.raises(BusyError, match=r"\(far\) holds its lease \(epoch 1\)"):
        fleet_lease.take(root, "other", 30.0, 0.0, clock, holder=_holder("c"))


def _record(name: str, epoch: int | None, version: int, **kw) -> fleet.FleetRecord:
    member = fleet.Member(url="state:/x", receiver="x", step=version, outcome="switched")
    return fleet.FleetRecord(fleet=name, version=version, target=version, outcome="switched", members=[member],
                             at=0.0, epoch=epoch, **kw)


def test_the_record_is_written_only_by_an_epoch_no_older_than_its_own(root):
    one = fleet.record(root, _record("gen", 1, 5))
    assert (one.generation, fleet.read(root, "gen").version) == (1, 5)
    two = fleet.record(root, _record("gen", 3, 6))
    assert two.generation == 2
    with pytest.raises(FencedError, match=r"^fleet gen: its record \(generation 2\) was written at epoch 3, newer than "
                       r"this coordinator's epoch 2: another coordinator took over; nothing recorded$"):
        fleet.record(root, _record("gen", 2, 7))
    assert fleet.read(root, "gen") == two
    three = fleet.record(root, _record("gen", 3, 8))  # the same epoch again (its own rerun of the record)
    assert (three.generation, fleet.read(root, "gen").version) == (3, 8)


def test_a_writer_killed_before_the_pointer_leaves_the_newest_generation_read(root):
    fleet.record(root, _record("gen", 1, 5))
    newer = _record("gen", 2, 6).model_copy(update={"generation": 2, "at": 1.0})
    assert root.create_if_absent(layout.numbered_key(layout.fleet_records_dir("gen"), 2),
                                 newer.model_dump_json().encode())  # created; fleets/gen.json not pointed at it
    assert fleet.read(root, "gen") == newer
    assert fleet.names(root) == ["gen"]
    fleet.record(root, _record("gen", 2, 7))
    assert fleet.FleetRecord.model_validate_json(root.read(layout.fleet_key("gen"))).version == 7


def test_records_written_before_epochs_still_read_and_the_next_one_follows_them(root):
    old = (b'{"format": "dcr-fleet", "fleet": "gen", "version": 3, "target": 3, "previous": 2, "outcome": "switched", '
           b'"members": [{"url": "http://h:1", "receiver": "gen-h-1", "step": 3, "outcome": "switched", '
           b'"error": null, "pause_seconds": 0.1}], "at": 1700000000.0, "at_utc": "2023-11-14T22:13:20Z"}')
    root.write(layout.fleet_key("gen"), old)
    rec = fleet.read(root, "gen")
    assert (rec.version, rec.epoch, rec.generation, rec.members[0].step) == (3, None, None, 3)
    new = fleet.record(root, _record("gen", 1, 4))
    assert new.generation == 1 and fleet.read(root, "gen") == new


@pytest.mark.parametrize("steps, switch, outcome, version", [
    ([2, 2], "switched", "switched", 2),
    ([2, None], "switched", "unconfirmed", None),
    ([1, 2], "switched", "mixed", None),
    ([1, None], "aborted", "aborted", None),  # a member down, the other where it was: not "mixed"
    ([1, 1], "aborted", "aborted", 1),
    ([1, None], "taken-back", "taken-back", None),
    ([1, 2], "taken-back", "mixed", None),
])
def test_mixed_only_when_members_serve_different_steps(steps, switch, outcome, version):
    assert fleet.served_outcome(switch, 2, steps) == outcome
    assert fleet.version_of(steps) == version
