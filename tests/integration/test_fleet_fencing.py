"""Fencing on the member side, without vLLM: the ``dcr`` weight-transfer backend (the code a vLLM
server runs, its vLLM base class stood in for) and a server member's requests (its transport
stood in for) carry the fleet's epoch and refuse an older one, before anything changes."""

from __future__ import annotations

import importlib
import sys
import types
from dataclasses import dataclass
from typing import Generic, TypeVar

import pytest
import torch

from dcr_core.errors import FencedError, UsageError
from flows.receive.fleet_members import HttpServer, MemberError
from flows.receive.receiver import Binding, Epochs
from storage.catalog import Catalog
from storage.root import RootRef, open_root
from tests.support.clock import ManualClock
from tests.support.vllm_answers import VllmAnswers

TOOK_OVER = "fleet f epoch 1 is older than epoch 2 this member has seen: another coordinator took over"


@pytest.fixture
def vllm_transfer(monkeypatch):
    """``flows.receive.vllm_transfer`` imported against a stand-in for the one vLLM module it
    imports (``vllm.distributed.weight_transfer.base``: the engine's base class and info types)."""
    init, update = TypeVar("init"), TypeVar("update")

    class WeightTransferEngine(Generic[init, update]):
        init_info_cls: type
        update_info_cls: type

        def __init__(self, config, vllm_config, device, model):
            self.model = model

        def parse_init_info(self, d):
            return self.init_info_cls(**d)

        def parse_update_info(self, d):
            return self.update_info_cls(**d)

    @dataclass
    class WeightTransferInitInfo:
        pass

    @dataclass
    class WeightTransferUpdateInfo:
        pass

    base = types.ModuleType("vllm.distributed.weight_transfer.base")
    base.WeightTransferEngine, base.WeightTransferInitInfo = WeightTransferEngine, WeightTransferInitInfo
    base.WeightTransferUpdateInfo = WeightTransferUpdateInfo
    for name in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, base.__name__, base)
    sys.modules.pop("flows.receive.vllm_transfer", None)
    try:
        yield importlib.import_module("flows.receive.vllm_transfer")
    finally:
        sys.modules.pop("flows.receive.vllm_transfer", None)


def test_the_dcr_backend_refuses_an_older_epoch_before_it_drops_or_binds_anything(vllm_transfer, tmp_path):
    eng = vllm_transfer.DCRWeightTransferEngine(None, None, torch.device("cpu"), torch.nn.Linear(2, 2))
    root, other = str(tmp_path / "bucket"), str(tmp_path / "elsewhere")
    eng.init_transfer_engine(eng.parse_init_info({"root": root, "receiver_id": "f-a", "fleet": "f", "epoch": 2}))
    with pytest.raises(FencedError, match=f"^{TOOK_OVER}$"):
        eng.init_transfer_engine(eng.parse_init_info({"root": other, "receiver_id": "f-a", "fleet": "f", "epoch": 1}))
    assert (eng._bound.root, eng._bound.epoch) == (root, 2)  # still bound as the newer coordinator left it
    with pytest.raises(FencedError, match=f"^{TOOK_OVER}$"):
        eng.update_weights({"step": 1, "fleet": "f", "epoch": 1})  # before anything is pulled or reloaded
    eng.init_transfer_engine(eng.parse_init_info({"root": root, "receiver_id": "f-a", "fleet": "g", "epoch": 1}))
    eng.init_transfer_engine(eng.parse_init_info({"root": root, "receiver_id": "vllm"}))  # no fleet: not fenced
    eng.init_transfer_engine(eng.parse_init_info({"root": root, "receiver_id": "f-a", "fleet": "f", "epoch": 3}))
    assert eng._receiver.epochs.highest("f") == 3 and eng._receiver.epochs.highest("g") == 1
    for bad in ({"fleet": "f"}, {"epoch": 4}, {"fleet": "f", "epoch": 0}, {"fleet": "../f", "epoch": 4}):
        with pytest.raises(UsageError):
            eng.parse_init_info({"root": root, **bad})
        with pytest.raises(UsageError):
            eng.parse_update_info({"step": 1, **bad})


def test_a_server_member_sends_its_epoch_and_leaves_a_newer_coordinators_update_alone(tmp_path):
    calls = []

    def transport(url, route, body=None, method="POST", timeout=None):
        calls.append(route)
        if route == "/update_weights" and body["update_info"].get("epoch", 0) < 2:
            raise MemberError(f"{url}{route}: HTTP 500: {TOOK_OVER}", 500)
        return {"weight_version": "1"} if route == "/weight_info" else {}

    server = HttpServer("http://gen-0:8000", timeout=5, call=transport)
    server.bind(Binding(RootRef(str(tmp_path / "bucket")), "f-gen-0", coordinator="f", epoch=1))
    assert {k: server._init_info(2)[k] for k in ("fleet", "epoch", "step")} == {"fleet": "f", "epoch": 1, "step": 2}
    with pytest.raises(MemberError, match="another coordinator took over"):
        server.install(2)  # start (its own session), then the update, refused by the member
    server.release()
    assert calls == ["/start_weight_update", "/update_weights"]  # no finish: the session is the newer coordinator's
    assert server.version() is None  # it never answered this coordinator's init: it may not keep its epoch

    server.bind(Binding(RootRef(str(tmp_path / "bucket")), "f-gen-0", coordinator="f", epoch=2))
    server.install(2)
    server.record()
    assert calls[-2:] == ["/update_weights", "/finish_weight_update"]


def test_fencing_is_one_rule_for_every_kind():
    seen = Epochs()
    seen.admit("f", 2)
    seen.admit("f", 2)  # the same coordinator again
    with pytest.raises(FencedError, match=f"^{TOOK_OVER}$"):
        seen.admit("f", 1)
    seen.admit("g", 1)
    assert (seen.highest("f"), seen.highest("g"), seen.highest("h")) == (2, 1, None)
    with pytest.raises(UsageError, match="without the fleet"):
        Binding(RootRef("x"), "r", epoch=3)
    with pytest.raises(UsageError, match="epoch must be an integer"):
        Binding(RootRef("x"), "r", coordinator="f", epoch=True)


def _member(server: VllmAnswers, tmp_path, asked: int | None = 1) -> HttpServer:
    """A server member as a switch has it: asked its version (the resolve), bound under epoch 1, and
    prepared to step 2 (its init answered: it has seen the epoch)."""
    m = HttpServer("http://gen-0:8000", timeout=5, call=server, clock=ManualClock())  # a missing report: no wait
    assert m.version() == asked
    m.bind(Binding(RootRef(str(tmp_path / "bucket")), "f-gen-0", coordinator="f", epoch=1))
    m.stage(2)
    return m


def test_a_members_version_is_believed_only_where_the_switch_can_vouch_for_it(tmp_path):
    """vLLM's weight version lags the weights until a finish names it, and any finish sets it:
    the member's step is unknown (None) when an update went unanswered, when another finish ended
    the session or set another version, when its prepare reports its engine holding another step,
    when another coordinator prepared it since, when it did not answer this switch's init, and
    before this switch's own finish named its step."""
    server = VllmAnswers("1")
    m = _member(server, tmp_path)
    assert m.vouched and m.version() == 1
    server.unanswered = {"/update_weights"}  # applied, its answer lost
    with pytest.raises(MemberError, match="timed out"):
        m.install(2)
    m.release()
    assert (server.weights, server.version) == (2, "1") and (m.version(), m.vouched) == (None, False)

    server = VllmAnswers("1")
    m = _member(server, tmp_path)
    m.install(2)
    assert m.version() is None  # the weights are at 2, the version still says 1
    m.record()
    assert (m.version(), m.vouched) == (2, True)
    server.session, server.version = True, "3"  # a finish of another coordinator, later
    server.session = False
    assert m.version() is None

    server = VllmAnswers("1")
    m = _member(server, tmp_path)
    server.session, server.version = False, "3"  # another's finish (naming 3) ends this switch's session
    with pytest.raises(MemberError, match="must be called before update_weights"):
        m.install(2)
    assert server.weights == 1 and m.version() is None  # it says 3, and serves 1

    server = VllmAnswers("3")
    server.held = None  # restarted (its engine DCR does not know), then a stray finish named step 3
    m = _member(server, tmp_path, asked=3)
    assert not m.vouched and m.version() is None
    m.install(2)
    m.record()
    assert (m.version(), m.vouched) == (2, True)

    server = VllmAnswers("1")
    m = _member(server, tmp_path)
    m.install(2)
    m.record()
    assert m.version() == 2
    Catalog(open_root(m.binding.root)).record_prepared("f-gen-0", {"prepare_id": "another", "step": 3, "ok": True})
    assert m.version() is None  # prepared by another coordinator since: a finish of its own may have named 2

    server = VllmAnswers("1")
    server.session = True  # left open by a coordinator that died after its update (the version lags)
    m = _member(server, tmp_path)  # its start refused once: the open session finished, prepared again
    assert not m.vouched
    m.install(2)
    m.record()
    assert (m.version(), m.vouched) == (2, True)

    server = VllmAnswers("1")
    server.unanswered = {"/init_weight_transfer_engine"}  # it may not have seen epoch 1
    m = HttpServer("http://gen-0:8000", timeout=5, call=server, clock=ManualClock())
    assert m.version() == 1
    m.bind(Binding(RootRef(str(tmp_path / "bucket")), "f-gen-0", coordinator="f", epoch=1))
    with pytest.raises(MemberError, match="timed out"):
        m.stage(2)
    assert (server.version, m.version()) == ("1", None)  # a coordinator that lost its lease can still move it


def test_the_dcr_backend_takes_no_change_from_outside_a_fleet_that_is_switching_it(vllm_transfer, tmp_path):
    """An init or update without a fleet's epoch, to an engine a fleet has switched, is refused in one
    line while that fleet's lease is held in ROOT, before anything is bound, dropped or applied."""
    from dcr_core.errors import BusyError
    from storage import fleet_lease

    eng = vllm_transfer.DCRWeightTransferEngine(None, None, torch.device("cpu"), torch.nn.Linear(2, 2))
    root = str(tmp_path / "bucket")
    eng.init_transfer_engine(eng.parse_init_info({"root": root, "receiver_id": "f-a", "fleet": "f", "epoch": 2}))
    lease = fleet_lease.take(open_root(root), "f", 30.0, 0.0)
    try:
        for call in (lambda: eng.init_transfer_engine(eng.parse_init_info({"root": root, "receiver_id": "vllm"})),
                     lambda: eng.update_weights({"step": 1})):
            with pytest.raises(BusyError, match=r"^.*: a member of fleet f, which .* is switching \(lease epoch 1, "):
                call()
        assert (eng._bound.root, eng._bound.epoch) == (root, 2)  # still bound as the fleet left it
    finally:
        lease.release()
    eng.init_transfer_engine(eng.parse_init_info({"root": root, "receiver_id": "vllm"}))  # nobody switching
