"""The fleet switch's deterministic simulation (``dcr_bench.fleet_sim``): a seeded sample of
schedules breaks no invariant and replays exactly; a protocol bug planted in the coordinator is
caught, with the seed that replays it. ``make sim-fleet`` runs 10,000 schedules (docs/testing.md)."""

from __future__ import annotations

import json
import logging

import pytest

from dcr_bench.fleet_sim import run
from dcr_bench.fleet_sim.invariants import Violation
from dcr_bench.fleet_sim.schedule import Config, run_schedule
from dcr_bench.fleet_sim.vllm_server import transfer_module
from storage import fleet as fleet_record

SAMPLE = range(1, 61)  # the default suite's sample (about 6 s here); `-m slow` runs SLOW_SAMPLE too
SLOW_SAMPLE = range(61, 461)


@pytest.fixture(scope="module")
def world():
    logging.getLogger("dcr").setLevel(logging.CRITICAL)  # the faults' warnings
    try:
        yield run.published(), transfer_module().DCRWeightTransferEngine
    finally:
        logging.getLogger("dcr").setLevel(logging.NOTSET)


def _sample(world, seeds) -> list:
    objects, backend = world
    return [run_schedule(seed, Config(), objects, backend) for seed in seeds]


def _first_violation(world, seeds) -> Violation | None:
    objects, backend = world
    for seed in seeds:
        try:
            run_schedule(seed, Config(), objects, backend)
        except Violation as e:
            return e
    return None


def test_a_seeded_sample_of_schedules_breaks_no_invariant_and_every_one_converges(world):
    outcomes = _sample(world, SAMPLE)
    assert sum(o.events for o in outcomes) > 10_000 and sum(o.checks for o in outcomes) > 20_000
    seen = sum((o.coordinators for o in outcomes), start=type(outcomes[0].coordinators)())
    assert seen["exit 0: switched"] and seen["crashed (kill -9)"] and seen["refused: busy"], seen
    faults = sum((o.faults for o in outcomes), start=type(outcomes[0].faults)())
    assert {"delayed", "lost-response", "duplicated", "member-crash", "coordinator-pause"} <= set(faults), faults


def test_a_seed_replays_exactly(world):
    first, *_, again = _sample(world, [7, 8, 7])
    assert (first.events, first.digest) == (again.events, again.digest)


def test_a_planted_bug_is_caught_with_the_seed_that_replays_it(world, monkeypatch):
    """A coordinator that changes members without first saying in the record that a switch is under
    way (the record keeps naming the old step while a member serves the new one)."""
    from flows.receive import fleet

    monkeypatch.setattr(fleet, "_announce", lambda *args, **kwargs: None)
    caught = _first_violation(world, range(1, 21))
    assert caught is not None
    said = str(caught)
    seed = int(said.split()[1])
    assert said.startswith(f"seed {seed} (") and "invariant 2: the record" in said
    assert said.rstrip().endswith(f"replay: python -m dcr_bench.fleet_sim --seed {seed}")
    again = _first_violation(world, [seed])
    assert again is not None and str(again) == said


def test_the_command_prints_and_writes_its_figures(world, tmp_path, capsys):
    assert run.main(["--schedules", "2", "--seed", "3", "--out", str(tmp_path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((tmp_path / "fleet-sim.json").read_text())
    assert printed == written and (written["schedules"], written["converged"]) == (2, 2)
    assert written["events"] > 0 and written["invariant_checks"] > written["events"]
    assert (tmp_path / "fleet-sim.png").stat().st_size > 10_000


@pytest.mark.slow
def test_a_larger_sample_breaks_no_invariant(world):
    assert sum(o.events for o in _sample(world, SLOW_SAMPLE)) > 100_000


@pytest.mark.slow
def test_a_coordinator_that_ignores_fencing_is_caught(world, monkeypatch):
    """Its lease lost, it goes on; its members do not fence; its records do not check epochs; it
    believes every version a member says."""
    from flows.receive import fleet, fleet_members, receiver

    monkeypatch.setattr(fleet, "_keep", lambda lease, then: None)
    monkeypatch.setattr(receiver.Receiver, "fence", lambda self, name, epoch: None)
    written = fleet_record.record
    monkeypatch.setattr(fleet_record, "record", lambda root, rec, clock=None: written(root, rec.model_copy(
        update={"epoch": None})))
    monkeypatch.setattr(fleet_members._WeightTransfer, "version", lambda self: fleet_members._step(self._weight_version()))
    monkeypatch.setattr(fleet_members._WeightTransfer, "vouched", property(lambda self: True))
    caught = _first_violation(world, range(1, 401))  # 4 of these 400 break an invariant (docs/testing.md)
    assert caught is not None and "invariant" in str(caught)
