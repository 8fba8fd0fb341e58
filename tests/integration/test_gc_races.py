"""``dcr gc`` racing receivers, stopped at the worst points: no receiver is ever stranded.

Each test runs gc and a receiver in two threads of this process and holds each at a point it
reports reaching (``dcr_core.events``), so the interleaving is exactly the one named; every
gate asserts it was reached. The chain: 0 keyframe, 1 and 2 deltas, 3 a requested keyframe, 4 a
delta. A receiver registered at step 1 keeps step 1; with ``--keep-last 1`` gc keeps 3 and 4 (the
latest step's restart chain) and deletes 0 and 2: the worst case is a receiver reading step 2.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from dcr_core import events
from dcr_core.errors import StepNotFoundError
from dcr_core.retention import KeyframePolicy
from flows import run_publish, run_receive
from flows.maintenance.gc import run_gc
from flows.options import GcOptions, PublishOptions, ReceiveOptions
from storage import layout, leases
from storage.catalog import Catalog
from storage.root import Root
from tests.support.helpers import assert_bits_equal, chain_of_steps, read_state

pytestmark = pytest.mark.faults(component="gc", outcome="no receiver stranded; every refit bit-exact or refused with its state untouched")

KEEP_1 = GcOptions(keep_last=1, grace_seconds=0)


class Gate:
    """Holds the thread named ``thread`` (None: any) the first time it reaches ``point`` with
    ``fields`` matching (a value or a predicate) until ``open()``; ``wait_arrived()`` fails the
    test if it never gets there."""

    def __init__(self, thread: str | None, point: str, **fields):
        self.thread, self.point, self.fields = thread, point, fields
        self.arrived, self.released = threading.Event(), threading.Event()
        self._lock = threading.Lock()

    def _matches(self, point: str, fields: dict) -> bool:
        if point != self.point or (self.thread is not None and threading.current_thread().name != self.thread):
            return False
        return all(v(fields.get(k)) if callable(v) else fields.get(k) == v for k, v in self.fields.items())

    def __call__(self, point: str, fields: dict) -> None:
        with self._lock:
            if self.arrived.is_set() or not self._matches(point, fields):
                return
        self.arrived.set()
        assert self.released.wait(60), f"{self.thread} held at {self.point} for 60 s"

    def wait_arrived(self) -> None:
        assert self.arrived.wait(60), f"{self.thread} never reached {self.point} {self.fields}"

    def open(self) -> None:
        self.released.set()


def _in_thread(name: str, fn):
    """Start ``fn`` in a thread named ``name``; returns a future."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    fut = pool.submit(lambda: (setattr(threading.current_thread(), "name", name), fn())[1])
    pool.shutdown(wait=False)
    return fut


@pytest.fixture
def chain(tmp_path):
    cks = chain_of_steps(5, seed=3, dtypes=["BF16", "F32", "I64", "F8_E4M3"])
    root = str(tmp_path / "bucket")
    opts = PublishOptions(chunk_bytes=256, cache_dir=str(tmp_path / "cache"))
    for s, ck in enumerate(cks):
        run_publish(root, ck, s, keyframe=(s == 3), options=opts)
    state = str(tmp_path / "r.safetensors")
    run_receive(root, "r", state, 1)
    return root, cks, state


def _gc_and_receive(root, state, gc_gate, rx_gate, target, in_place=False, receiver="r"):
    """Run gc and a receive (to ``target``) in two threads under ``gc_gate`` and ``rx_gate``."""
    ropts = ReceiveOptions(in_place=in_place)
    gc = _in_thread("gc", lambda: run_gc(root, KEEP_1))
    gc_gate.wait_arrived()
    rx = _in_thread("rx", lambda: run_receive(root, receiver, state, target, options=ropts,
                                              record=receiver is not None))
    return gc, rx, ropts


@pytest.mark.parametrize("in_place", [False, True], ids=["rewrite", "in-place"])
def test_a_receiver_holding_a_step_gc_deleted_after_it_finished_restarts_instead_of_failing(chain, in_place):
    """gc plans while the receiver is registered at 1; the receiver then finishes step 2; gc deletes
    step 2. The receiver's state is valid but holds a step no longer committed: the next receive
    restarts from the restart point (3) and lands bit-exact at 4; it never exits on "not committed"."""
    root, cks, state = chain
    gate = Gate("gc", "gc.planned")
    with events.listening(gate):
        gc = _in_thread("gc", lambda: run_gc(root, KEEP_1))
        gate.wait_arrived()
        run_receive(root, "r", state, 2, options=ReceiveOptions(in_place=in_place))  # finishes before gc deletes
        gate.open()
        report = gc.result(60)
    assert report.deleted_steps == [0, 2] and not report.spared and not report.hidden
    assert Catalog(Root(root)).marker(2) is None
    res = run_receive(root, "r", state, options=ReceiveOptions(in_place=in_place))
    assert res.step == 4 and res.moves[0] == "keyframe:3", res.moves
    assert_bits_equal(read_state(state), cks[4])


def test_a_lease_taken_after_gc_planned_spares_the_step(chain):
    """gc plans (step 2 doomed); the receiver plans and leases step 2; gc looks again before deleting
    the marker, finds the lease and spares the step; the receiver finishes bit-exact at 2."""
    root, cks, state = chain
    gc_gate, rx_gate = Gate("gc", "gc.planned"), Gate("rx", "receive.leased")
    with events.listening(gc_gate), events.listening(rx_gate):
        gc, rx, _ = _gc_and_receive(root, state, gc_gate, rx_gate, 2)
        rx_gate.wait_arrived()
        gc_gate.open()
        report = gc.result(60)
        rx_gate.open()
        res = rx.result(60)
    assert report.deleted_steps == [0] and report.spared == {2: ["r"]}
    assert res.step == 2
    assert_bits_equal(read_state(state), cks[2])
    assert leases.live(Root(root), 2) == []  # released once the refit was recorded


@pytest.mark.parametrize("in_place", [False, True], ids=["rewrite", "in-place"])
def test_a_lease_landing_between_gcs_last_look_and_the_marker_delete_keeps_the_data(chain, in_place):
    """The narrowest window: gc has checked step 2's leases (none) and is about to delete its marker;
    the receiver leases step 2 and still sees the marker. gc deletes the marker, looks at the leases
    once more, and keeps the data until the receiver is done: the refit completes bit-exact. A later
    gc deletes the data; the receiver then restarts from the restart point."""
    root, cks, state = chain
    gc_gate, rx_gate = Gate("gc", "gc.leases-checked", step=2), Gate("rx", "receive.leased")
    with events.listening(gc_gate), events.listening(rx_gate):
        gc, rx, ropts = _gc_and_receive(root, state, gc_gate, rx_gate, 2, in_place)
        rx_gate.wait_arrived()
        gc_gate.open()
        report = gc.result(60)
        assert report.hidden == {2: ["r"]} and 2 not in report.deleted_steps
        assert Catalog(Root(root)).marker(2) is None  # invisible to new readers already
        rx_gate.open()
        res = rx.result(60)
    assert res.step == 2
    assert_bits_equal(read_state(state), cks[2])
    later = run_gc(root, KEEP_1)
    assert 2 in later.plan.leftover_steps and not Root(root).exists(layout.step_dir(2))
    res = run_receive(root, "r", state, options=ropts)
    assert res.step == 4
    assert_bits_equal(read_state(state), cks[4])


def test_a_step_deleted_between_plan_and_lease_is_planned_again(chain, monkeypatch):
    """The receiver plans a refit to step 2, then gc deletes step 2 before the lease lands: the check
    after leasing finds it gone before anything is fetched, the receiver plans again, and says the
    step is gone (exit 4), its state untouched."""
    from flows.receive.pipeline import StateSteps
    from tests.support.steps import patch_step

    root, cks, state = chain
    # an anonymous state at 1 (not registered: gc keeps nothing for it)
    anon = state.replace("r.safetensors", "anon.safetensors")
    run_receive(root, "anon", anon, 1, record=False)
    before = open(anon, "rb").read()
    staged = []
    patch_step(monkeypatch, StateSteps, "stage_refit", lambda real, *a, **k: staged.append(1) or real(*a, **k))
    gc_gate, rx_gate = Gate("gc", "gc.planned"), Gate("rx", "receive.planned")
    with events.listening(gc_gate), events.listening(rx_gate):
        gc, rx, _ = _gc_and_receive(root, anon, gc_gate, rx_gate, 2, receiver="a2")
        rx_gate.wait_arrived()
        gc_gate.open()
        report = gc.result(60)
        assert 2 in report.deleted_steps
        rx_gate.open()
        with pytest.raises(StepNotFoundError, match="step 2 is not committed"):
            rx.result(60)
    assert staged == []  # stopped by the check after leasing, not by a missing chunk
    assert open(anon, "rb").read() == before
    res = run_receive(root, "a2", anon)
    assert res.step == 4
    assert_bits_equal(read_state(anon), cks[4])


@pytest.mark.parametrize("pack_bytes", [0, 256], ids=["per-object", "packed"])
def test_a_step_deleted_mid_fetch_under_a_receiver_without_a_lease_is_planned_again(tmp_path, caplog, pack_bytes):
    """A read-only receiver (no record, so no lease) at step 1 is fetching the deltas 2, 3, 4 when gc
    deletes steps 0-2: the missing chunk makes it plan again, from the restart point (step 3's full
    snapshot), and it lands bit-exact at the latest step with nothing half-applied. "Mid-fetch" is
    between two GETs of step 2: one object per chunk, or packs small enough that step 2 is several
    (a step in one pack is read by one ranged GET, whole, before the first chunk of it is applied)."""
    cks = chain_of_steps(5, seed=4, dtypes=["BF16", "F16", "U8"])
    root = str(tmp_path / "bucket")
    opts = PublishOptions(chunk_bytes=256, cache_dir=str(tmp_path / "cache"), keyframe_policy=KeyframePolicy(every=3),
                          pack_bytes=pack_bytes)
    for s, ck in enumerate(cks):
        run_publish(root, ck, s, options=opts)
    # more packs than the receiver reads ahead of the chunk it holds (one read worker, a window of two)
    assert pack_bytes == 0 or len(Catalog(Root(root)).manifest(2).packs()) > 3
    state = str(tmp_path / "s.safetensors")
    run_receive(root, None, state, 1, record=False)
    rx_gate = Gate(None, "chunk.fetched", key=lambda k: k.startswith(layout.step_dir(2) + "/"))
    ropts = ReceiveOptions(io_workers=1)
    with events.listening(rx_gate):
        rx = _in_thread("rx", lambda: run_receive(root, None, state, options=ropts, record=False))
        rx_gate.wait_arrived()
        report = run_gc(root, KEEP_1)
        assert report.deleted_steps == [0, 1, 2]
        rx_gate.open()
        res = rx.result(60)
    assert res.step == 4 and res.moves[0] == "keyframe:3", res.moves
    assert "planning again" in caplog.text  # the first plan (forward:2, ...) lost step 2 mid-fetch
    assert_bits_equal(read_state(state), cks[4])


def test_a_follower_retries_what_may_pass_with_backoff_and_stops_on_a_state_that_lies(chain, monkeypatch):
    """``follow`` retries a failed refit (a step gone, a damaged object, a refused connection),
    saying so each time and waiting longer; a state that is not what it claims stops it."""
    from dcr_core.errors import IntegrityError, StateMismatchError, UntrustedError
    from flows.receive import follow as follow_mod
    from storage.root import RootRef

    root, cks, state = chain
    sleeps: list[float] = []
    monkeypatch.setattr(follow_mod.time, "sleep", sleeps.append)
    failures = [IntegrityError("chunk x: missing"), ConnectionRefusedError("refused"), StepNotFoundError("step 9 gone")]
    warned: list[str] = []

    def receive(step):
        if failures:
            raise failures.pop(0)
        return run_receive(root, "r", state, step)

    got = list(follow_mod.follow(RootRef(root), state, receive, interval=0.01, until_step=4, warn=warned.append))
    assert [r.step for r in got] == [4] and len(warned) == 3
    assert "IntegrityError: chunk x: missing; retrying in" in warned[0] and "ConnectionRefusedError" in warned[1]
    assert [s for s in sleeps if s >= 0.01][:3] == sorted([s for s in sleeps if s >= 0.01][:3])  # backs off
    assert_bits_equal(read_state(state), cks[4])

    def lies(step):
        raise StateMismatchError("state claims step 4 but holds other bits")

    run_publish(root, cks[4], 5, keyframe=True,
                options=PublishOptions(chunk_bytes=256, cache_dir=str(Path(state).parent / "cache")))
    with pytest.raises(StateMismatchError):
        list(follow_mod.follow(RootRef(root), state, lies, interval=0.01, warn=warned.append))

    def forged(step):
        raise UntrustedError("commit marker signature does not match")

    with pytest.raises(UntrustedError):
        list(follow_mod.follow(RootRef(root), state, forged, interval=0.01, warn=warned.append))
    assert len(warned) == 3


def test_a_live_module_whose_plan_loses_steps_to_gc_plans_again(tmp_path, monkeypatch, caplog):
    """A live module at step 1 (no receiver record protects it) plans deltas 2, 3, 4; gc deletes steps
    0-2 right after the plan, before the lease: the module receiver plans again from the restart
    point and lands bit-exact, like a dense load of step 4."""
    import shutil

    from dcr_bench.models.llama_vllm import LlamaConfig, VllmLlama, canonical_checkpoint
    from flows import receive_into_module
    from flows.receive.module_pipeline import ModuleSteps
    from tests.support.steps import patch_step

    cfg = LlamaConfig()
    cks = [canonical_checkpoint(cfg, seed=0)]
    for s in range(1, 5):
        nxt = {n: t.clone() for n, t in cks[-1].items()}
        for t in nxt.values():
            if t.dtype == torch.bfloat16:
                t.view(-1).view(torch.int16)[s::53] ^= 1
        cks.append(nxt)
    root = str(tmp_path / "bucket")
    opts = PublishOptions(chunk_bytes=2048, cache_dir=str(tmp_path / "cache"), keyframe_policy=KeyframePolicy(every=3))
    for s, ck in enumerate(cks):
        run_publish(root, ck, s, options=opts)
    mod = VllmLlama(cfg, 0, 1)
    mirror = str(tmp_path / "mirror.safetensors")
    receive_into_module(root, "m", mod, 1, state_path=mirror)
    for s in range(5):  # forget the records and the position: gc keeps nothing for this receiver
        shutil.rmtree(Path(root) / layout.receivers_dir(s), ignore_errors=True)
    (Path(root) / layout.position_key("m")).unlink()
    deleted = []

    def plan_then_gc(real, *args, **kwargs):
        plan = real(*args, **kwargs)
        if not deleted:
            assert [m.step for m in plan.moves] == [2, 3, 4], plan.moves
            deleted.extend(run_gc(root, KEEP_1).deleted_steps)
        return plan

    patch_step(monkeypatch, ModuleSteps, "plan_module_refit", plan_then_gc)
    res = receive_into_module(root, "m", mod, state_path=mirror)
    assert deleted == [0, 1, 2] and res["step"] == 4 and "planning again" in caplog.text
    dense = VllmLlama(cfg, 0, 1)
    dense.load_weights(list(cks[4].items()))
    assert_bits_equal(dict(mod.state_dict()), dict(dense.state_dict()))
