"""A member of a simulated fleet: one life of a vLLM server whose weight-transfer backend is DCR's.

What decides is the real code: the ``dcr`` weight-transfer backend
(``flows.receive.vllm_transfer.DCRWeightTransferEngine``: its ``init_info`` and ``update_info``,
the fence it keeps, its session of prepare, start, update and finish) over the real engine receiver
(``flows.receive.engine.EngineReceiver``: the background prepare, its report in ROOT, the staged
step, the apply, the commit record written after it, ``abort``), with the receivers' fencing rule
(``flows.receive.receiver``). Stood in for:

- **vLLM**, what the server does around the backend, as vLLM 0.32 does it
  (``vllm/entrypoints/rl/online/api_router.py``, ``v1/engine/async_llm.py``,
  ``v1/worker/gpu_worker.py``): its routes; requests handled one at a time (they are utility calls
  of the engine core); a weight-update session (``start_weight_update`` refused while one is open,
  ``update_weights`` and ``finish_weight_update`` refused without one, a failed update closing it);
  the weight version (``"default"`` until a ``finish_weight_update`` names one); pause and resume.
  The backend's vLLM base class (``vllm.distributed.weight_transfer.base``) is vLLM's where vLLM is
  installed, else ``STAND_IN`` (its constructor and parsers, as 0.32 has them).
- **The engine's data path** (``engine_prepare`` and ``engine_apply`` inside
  ``flows.receive.engine``, ``SimDataPath``): the weights are the step the engine holds
  (``SimWeights.step``). Staging plans the refit with the real planner (``storage.reader.
  plan_refit``: the target must be committed and not retracted, every manifest it needs read and
  verified) and takes simulated time to pull; the apply puts the step in place at once (all or
  nothing), or fails and leaves the engine as it was (a reload that fails is rolled back).

A crash ends the life where it stands (its requests, its background prepare and record stop); a
restart is a new life: the server loads its checkpoint directory again (``boot_step``), with the
version ``"default"``, no session, and a backend that has seen no epoch.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Generic, TypeVar

import torch

from dcr_bench.fleet_sim.scheduler import Process, Scheduler, SimThread, current
from flows.receive.engine_prepare import Begun, Prepared
from flows.receive.pipeline import Leases
from flows.receive.records import ReceiverCommit, WorkerResult
from storage import reader
from storage.root import open_root

TRANSFER_MODULE = "flows.receive.vllm_transfer"


# -- the backend, with vLLM's base class or a stand-in --------------------------------------------

def _stand_in_base() -> types.ModuleType:
    """``vllm.distributed.weight_transfer.base`` as the backend uses it (vLLM 0.32)."""
    init, update = TypeVar("init"), TypeVar("update")

    class WeightTransferEngine(Generic[init, update]):
        init_info_cls: type
        update_info_cls: type

        def __init__(self, config, vllm_config, device, model):
            self.config, self.vllm_config, self.device, self.model = config, vllm_config, device, model
            self.parallel_config = vllm_config.parallel_config
            self.model_config = vllm_config.model_config

        def parse_init_info(self, init_dict):
            try:
                return self.init_info_cls(**init_dict)
            except TypeError as e:
                raise ValueError(f"Invalid init_info for {type(self).__name__}: {e}") from e

        def parse_update_info(self, update_dict):
            try:
                return self.update_info_cls(**update_dict)
            except TypeError as e:
                raise ValueError(f"Invalid update_info for {type(self).__name__}: {e}") from e

    class WeightTransferInitInfo:
        pass

    class WeightTransferUpdateInfo:
        pass

    base = types.ModuleType("vllm.distributed.weight_transfer.base")
    base.WeightTransferEngine = WeightTransferEngine  # type: ignore[attr-defined]
    base.WeightTransferInitInfo = WeightTransferInitInfo  # type: ignore[attr-defined]
    base.WeightTransferUpdateInfo = WeightTransferUpdateInfo  # type: ignore[attr-defined]
    return base


def transfer_module() -> types.ModuleType:
    """``flows.receive.vllm_transfer``, imported against vLLM if it is installed, else against the
    stand-in of its base module (which is then taken out of ``sys.modules`` again: nothing else in
    the process sees a fake vLLM)."""
    try:
        importlib.import_module("vllm.distributed.weight_transfer.base")
        return importlib.import_module(TRANSFER_MODULE)
    except ImportError:
        pass
    names = ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer")
    saved = {n: sys.modules.get(n) for n in (*names, "vllm.distributed.weight_transfer.base", TRANSFER_MODULE)}
    try:
        for n in names:
            sys.modules[n] = types.ModuleType(n)
        sys.modules["vllm.distributed.weight_transfer.base"] = _stand_in_base()
        sys.modules.pop(TRANSFER_MODULE, None)
        return importlib.import_module(TRANSFER_MODULE)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


# -- the engine's data path -------------------------------------------------------------------------

class SimWeights(torch.nn.Module):
    """The weights of a simulated engine: the step it holds (None: none DCR knows)."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step


@dataclass
class Faults:
    """How often the engine's work fails or takes long (drawn from the schedule's generator)."""

    pull_seconds: float = 1.0  # the longest a prepare pulls (uniform)
    reload_seconds: float = 0.2  # the longest an apply's reload takes (uniform)
    reload_fails: float = 0.03  # an apply's reload fails (the engine put back)


class SimDataPath:
    """``engine_prepare`` and ``engine_apply`` of ``flows.receive.engine`` in the simulation (see
    the module docstring): ``begin``, ``digest``, ``stage``, ``release`` and ``apply`` with their
    signatures."""

    def __init__(self, faults: Faults, on_apply):
        self.faults = faults
        self._on_apply = on_apply  # (engine, step): the world notes who serves what since when

    @staticmethod
    def _sched() -> Scheduler:
        return current().scheduler

    def begin(self, engine, known_state, ref, receiver_id, state_path) -> Begun:
        step = engine.model.step
        digests = {"": f"step-{step}"}
        held = known_state.held
        known = bool(held) and held["root"] == ref.url and held["digests"] == digests
        return Begun(ref, receiver_id, "sim-mirror", digests, known, None, {}, contextlib.ExitStack())

    def digest(self, engine, b: Begun) -> None:
        return None  # ``begin`` already said whether the engine is known

    def stage(self, engine, b: Begun, step: int | None, opts) -> Prepared:
        sched = self._sched()
        current_step = engine.model.step if b.known else None
        plan = reader.plan_refit(open_root(b.ref), current_step, step)  # the real planner: live steps only
        sched.sleep(sched.rng.uniform(0.0, self.faults.pull_seconds), "pulling")
        leases = Leases(b.ref, b.receiver_id, 0.0)  # receivers' step leases keep gc away: no gc here
        return Prepared(b.ref, b.receiver_id, b.mirror, plan, None, None, None, [], None, 0, b.known, b.digests,
                        leases, 0.0, b.lock)

    def release(self, p: Prepared) -> None:
        p.lock.close()

    def summary(self, p: Prepared):
        raise NotImplementedError("not used by the weight-transfer backend")

    def apply(self, engine, known_state, p: Prepared) -> WorkerResult:
        sched = self._sched()
        sched.sleep(sched.rng.uniform(0.0, self.faults.reload_seconds), "reloading")
        if sched.rng.random() < self.faults.reload_fails:
            raise RuntimeError(f"reload of step {p.plan.target_step} failed (simulated); the engine was put back")
        target = p.plan.target_step
        policy = p.plan.steps[target].manifest_digest
        mode = "current" if not p.plan.moves and p.known else "full" if not p.known else "delta"
        engine.model.step = target
        self._on_apply(engine, target)
        known_state.held = {"root": p.ref.url, "step": target, "mirror": p.mirror, "digests": {"": f"step-{target}"},
                            "policy_digest": policy}
        p.record = ReceiverCommit(from_step=p.plan.current_step, moves=p.plan.describe(), policy_digest=policy,
                                  mode=mode, engine="vllm")
        return WorkerResult(receiver=p.receiver_id, from_step=p.plan.current_step, to_step=target, mode=mode,
                            moves=p.plan.describe(), changed_tensors=0, bytes_pulled=0, fetch_seconds=0.0,
                            policy_digest=policy, pause_seconds=0.0, reload_seconds=0.0, check_seconds=0.0,
                            digest_seconds=0.0, reloaded_tensors=0, patched_tensors=0, patched_elements=0,
                            hashed_modules=0)


# -- one life of a server ---------------------------------------------------------------------------

class RequestError(Exception):
    """What the server answered a request with: an HTTP status and its body."""

    def __init__(self, status: int, body: str):
        super().__init__(body)
        self.status = status


class VllmServer:
    """One life of a member server (see the module docstring); ``handle`` serves one request."""

    def __init__(self, name: str, life: int, process: Process, boot_step: int, backend_cls: type):
        self.name, self.life, self.process = name, life, process
        self.weights = SimWeights(boot_step)
        config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1), model_config=None)
        self.backend = backend_cls(None, config, torch.device("cpu"), self.weights)
        self.weight_version = "default"
        self.paused = False
        self.session = False  # vLLM's worker: a weight update is active
        self.busy: SimThread | None = None  # the request the engine core is handling
        self.update_began: float = 0  # the event its last update request began at
        self.update_epoch: int | None = None  # the fleet epoch it carried

    def handle(self, route: str, body: dict | None) -> dict:
        """One request, as vLLM serves it: one at a time (the engine core's utility calls)."""
        me = current()
        me.scheduler.wait_until(lambda: self.busy is None, f"{self.name} queued {route}")
        self.busy = me.thread
        try:
            return self._route(route, body or {})
        except RequestError:
            raise
        except Exception as e:  # noqa: BLE001 - the server answers 500 with the error, as vLLM's does
            raise RequestError(500, f"{type(e).__name__}: {e}") from None
        finally:
            self.busy = None

    def _route(self, route: str, body: dict) -> dict:
        if route == "/weight_info":
            return {"weight_version": self.weight_version}
        if route == "/pause":
            self.paused = True
            return {"status": "paused"}
        if route == "/resume":
            self.paused = False
            return {"status": "resumed"}
        if route == "/init_weight_transfer_engine":
            self.backend.init_transfer_engine(self.backend.parse_init_info(body["init_info"]))
            return {"message": "Weight transfer initialized"}
        if route == "/start_weight_update":
            if self.session:
                raise RuntimeError("start_weight_update called while a weight update is already active. "
                                   "Call finish_weight_update first.")
            self.backend.start_weight_update()
            self.session = True
            return {"message": "Weight update started"}
        if route == "/update_weights":
            if not self.session:
                raise RuntimeError("start_weight_update must be called before update_weights.")
            self.update_began = current().scheduler.events
            self.update_epoch = body["update_info"].get("epoch")
            try:
                self.backend.update_weights(body["update_info"])
            except BaseException:
                self.session = False
                raise
            return {"message": "Weights updated"}
        if route == "/finish_weight_update":
            if not self.session:
                raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
            self.backend.finish_weight_update()
            self.session = False
            if body.get("weight_version") is not None:
                self.weight_version = body["weight_version"]
            return {"message": "Weight update finished"}
        raise RequestError(404, f"no route {route}")


@contextlib.contextmanager
def engine_seams(data_path: SimDataPath, start) -> Iterator[None]:
    """``flows.receive.engine``'s data path and threads replaced for the block."""
    from flows.receive import engine

    old = {k: getattr(engine, k) for k in ("engine_prepare", "engine_apply", "_start")}
    engine.engine_prepare = data_path  # type: ignore[assignment]
    engine.engine_apply = data_path  # type: ignore[assignment]
    engine._start = start  # type: ignore[assignment]
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(engine, k, v)
