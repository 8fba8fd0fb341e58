"""A receiver kind added in one class and one registration (what docs/guides/receiver-kinds.md
describes) goes through the same lifecycle as DCR's own: refitted on its own, and switched by
``dcr fleet`` beside a state file, every bit compared with the published checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

from flows import run_publish
from flows.options import PublishOptions
from flows.receive import receiver as receivers
from flows.receive import state_file
from flows.receive.fleet import run_fleet
from flows.receive.receiver import Kind, Receiver
from flows.receive.records import ReceiverCommit
from flows.results import ReceiveResult
from storage import reader
from storage.catalog import Catalog
from storage.root import open_root
from tests.support.helpers import assert_bits_equal, chain_of_steps, raw_bits, read_state


class ToyTarget:
    """The smallest target there is: each tensor's stored bits by name, and the step it holds."""

    def __init__(self) -> None:
        self.bits: dict[str, np.ndarray] = {}
        self.step: int | None = None


MEMBERS: dict[str, ToyTarget] = {}  # toy:NAME members of a fleet


class ToyReceiver(Receiver):
    """A toy target as a receiver: staged in memory beside the target, swapped in by the apply."""

    def __init__(self, target: ToyTarget, name: str = "toy"):
        super().__init__(name)
        self.target = target
        self.calls: list[str] = []
        self._plan: reader.RefitPlan | None = None
        self._staged: dict[str, np.ndarray] | None = None
        self._leased: list[int] = []

    @classmethod
    def from_target(cls, target, **how) -> ToyReceiver:
        return cls(target)

    @classmethod
    def from_url(cls, url: str, **how) -> ToyReceiver:
        return cls(MEMBERS[url.partition(":")[2]], url)

    def version(self) -> int | None:
        return self.target.step

    def stage(self, step: int | None) -> None:
        self.calls.append("stage")
        b = self.binding
        root = open_root(b.root)
        plan = reader.plan_refit(root, self.target.step, step, where=self.name)
        self._leased = state_file.take_leases(b.root, b.receiver_id, plan, b.options.lease_seconds)
        held = None if plan.from_keyframe or plan.current_step is None else (lambda n: self.target.bits[n].copy())
        ms = reader.manifests(plan, root)
        self._staged = {n: bits.copy() for n, bits, _ in reader.refit_tensors(root, plan, ms, held, where=self.name)}
        self._plan = plan

    def install(self, step: int | None) -> None:
        self.calls.append("install")
        if self._plan is None or self._staged is None or step not in (None, self._plan.target_step):
            self.stage(step)
        self.target.bits, self.target.step, self._staged = self._staged, self._plan.target_step, None

    def record(self) -> None:
        self.calls.append("record")
        b, p = self.binding, self._plan
        policy = reader.manifests(p)[p.target_step].policy_digest
        state_file.record_receiver_commit(b.root, b.receiver_id, p.target_step,
                                          ReceiverCommit(from_step=p.current_step, moves=p.describe(), policy_digest=policy))

    def release(self) -> None:
        self.calls.append("release")
        leased, self._leased, self._staged = self._leased, [], None
        if leased:
            state_file.release_leases(self.binding.root, self.binding.receiver_id, leased)

    def result(self) -> ReceiveResult:
        p = self._plan
        return ReceiveResult(p.target_step, p.current_step, p.describe(), 0,
                             reader.manifests(p)[p.target_step].policy_digest)


@pytest.fixture
def toy_kind(monkeypatch):
    monkeypatch.setattr(receivers, "KINDS", list(receivers.KINDS))
    receivers.register(Kind("toy", __name__, "ToyReceiver", "toy:NAME", schemes=("toy",),
                            holds=lambda obj: isinstance(obj, ToyTarget)))


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kinds")
    root, steps = str(tmp / "bucket"), chain_of_steps(3, seed=47)
    opts = PublishOptions(chunk_bytes=256, bundle_below=0, cache_dir=str(tmp / "cache"))  # the toy holds stored names
    for i, ck in enumerate(steps):
        run_publish(root, ck, i, options=opts)
    return root, steps


def _same_bits(target: ToyTarget, ck) -> None:
    assert set(target.bits) == set(ck)
    for name, t in ck.items():
        assert target.bits[name].tobytes() == raw_bits(t).tobytes(), name


def test_a_kind_registered_in_one_line_refits_through_the_same_lifecycle(chain, toy_kind):
    root, steps = chain
    target = ToyTarget()
    assert receivers.kind_of(target).name == "toy"
    r = receivers.refit(target, root, "toy-1", step=1)  # what receive_refit's flow runs for an in-process target
    assert (r["step"], r["from_step"], r["moves"]) == (1, None, ["keyframe:0", "forward:1"])
    _same_bits(target, steps[1])
    r = receivers.refit(target, root, "toy-1")  # a delta forward, from what it holds
    assert (r["step"], r["from_step"], r["moves"]) == (2, 1, ["forward:2"])
    _same_bits(target, steps[2])
    assert Catalog(open_root(root)).position("toy-1")["moves"] == ["forward:2"]  # its record, like any receiver's

    receiver = receivers.receiver_of(target)
    receiver.bind(receivers.Binding(open_root(root).ref, "toy-1"))
    receiver.refit(0)  # back, through the inverse deltas
    assert receiver.calls == ["stage", "install", "record", "release"]
    _same_bits(target, steps[0])


def test_a_kind_registered_in_one_line_joins_a_fleet_beside_a_state_file(chain, toy_kind, tmp_path):
    root, steps = chain
    MEMBERS["a"] = ToyTarget()
    state = str(tmp_path / "member.safetensors")
    for step in (2, 1):
        r = run_fleet(root, ["toy:a", f"state:{state}"], step=step, name="kinds")
        assert (r.outcome, r.version) == ("switched", step)
        _same_bits(MEMBERS["a"], steps[step])
        assert_bits_equal(read_state(state), steps[step])
    assert Catalog(open_root(root)).position("kinds-a")["step"] == 1
