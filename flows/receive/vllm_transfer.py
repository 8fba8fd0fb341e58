"""DCR as a vLLM weight-transfer backend: ``--weight-transfer-config '{"backend": "dcr"}'``.

vLLM 0.32's weight-transfer API (``vllm.distributed.weight_transfer``; over HTTP, the routes of
``vllm.entrypoints.rl.online.api_router`` with ``VLLM_SERVER_DEV_MODE=1``) drives every worker of
an engine through ``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights`` and
``finish_weight_update``. With this backend (registered by ``flows.receive.vllm_plugin``) those
calls refit the engine from a DCR ROOT with the same engine-independent code as the worker
extension (``flows.receive.engine.EngineReceiver``: prepare in ``engine_prepare``, apply in
``engine_apply``), given the backend's model as its ``EngineModel`` (``VllmEngineModel``):

- ``init_info`` (``POST /init_weight_transfer_engine``, ``LLM.init_weight_transfer_engine``):
  ``{"root": URL, "receiver_id": ID, "storage_options": {...}}``, optionally ``"options"``
  (``ReceiveOptions`` fields), ``"state_path"`` (the worker's mirror) and ``"prepare": true`` with
  ``"step": N`` (omitted: the latest): every worker then pulls and verifies that step into a
  staged mirror in a thread and the call returns at once; the engine keeps serving. With
  ``"prepare_id": ID`` each worker writes the outcome (done or failed, with that id, and the step
  the engine held as DCR knows it: ``held``, None after a restart) to
  ``prepared/<receiver>.json`` in ROOT when its prepare is over: a coordinator polls that instead
  of calling ``start_weight_update`` early (which waits in vLLM's engine loop, where the server
  generates nothing). Calling it again re-binds (and prepares again). Under ``dcr fleet`` it also
  holds ``"fleet": NAME`` and ``"epoch": E`` (the coordinator's lease epoch, both or neither):
  an epoch older than the highest this engine has seen for that fleet is refused before anything
  is dropped or bound (``FencedError``, "... another coordinator took over"), a newer one is
  remembered (the receivers' fencing, ``flows.receive.receiver``; in this engine's memory: a
  restarted server forgets, and is safe to, since it starts over from its checkpoint directory and
  the next switch reloads it whole).
- ``start_weight_update``: waits for a prepare still pulling (the engine serves nothing while it
  waits: call it once the prepare is done, or accept that) and raises what it failed with;
  nothing in the engine has changed yet. A fleet calls it on every member before pausing any.
- ``update_info`` (``POST /update_weights``): ``{"step": N}`` (omitted: the step prepared, else the
  latest), with ``"fleet"`` and ``"epoch"`` under ``dcr fleet``, fenced as the ``init_info``'s. The pause window: the layers the change touches are reloaded through vLLM's own
  layerwise reload (``vllm.model_executor.model_loader.reload``); a step other than the one
  prepared is pulled now. A reload that fails puts the engine back to its previous step, bit for
  bit, before the error is raised (``EngineRefitError`` if even that failed).
- ``finish_weight_update``: the commit record and lease release are written in a thread once the
  engine serves again; after a ``start`` with no update it drops what was prepared (a fleet's
  "nobody switches"). vLLM's ``start_weight_update`` and ``finish_weight_update`` carry nothing
  to fence with: a stale coordinator's finish can end a newer one's update session (vLLM then
  refuses that one's update or finish, so its switch fails and says so), never change the weights.

The engine result of the last update (``records.WorkerResult``: step, mode, bytes pulled, pause)
is logged, kept as ``last_result`` and in the bucket's receiver record (``receivers/ID.json``),
which is where a fleet reads where each member stands. vLLM internals beyond the public API (still
those of ``flows.receive.vllm_worker``):
``vllm.model_executor.model_loader.reload.inplace.reload_weights`` for the reload, the layer probe
of ``flows.receive.layer_probe`` (``weight_loader`` attributes), the fixes of
``flows.receive.vllm_fixups`` and the CPU kernel read-back of ``flows.receive.live_tensors``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from dcr_core.errors import UsageError
from flows.options import ReceiveOptions
from flows.receive import vllm_fixups
from flows.receive.engine import EngineReceiver
from flows.receive.engine_model import Weights
from flows.receive.receiver import Binding, check_arguments, check_fence, outside_fleets
from flows.receive.records import WorkerResult
from storage import layout
from storage.root import RootRef

log = logging.getLogger("dcr.receive")


@dataclass
class DCRInitInfo(WeightTransferInitInfo):
    root: str
    receiver_id: str = "vllm"
    storage_options: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    state_path: str | None = None
    prepare: bool = False
    step: int | None = None
    prepare_id: str | None = None  # written with the prepare's outcome to prepared/<receiver>.json
    fleet: str | None = None  # with epoch: the fleet coordinator's lease, which fences (see the module docstring)
    epoch: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.root, str) or not self.root:
            raise ValueError(f"init_info: root must be a ROOT URL, got {self.root!r}")
        layout.check_receiver(self.receiver_id)
        if self.step is not None:
            layout.check_step(self.step)
        _check_fence("init_info", self.fleet, self.epoch)


@dataclass
class DCRUpdateInfo(WeightTransferUpdateInfo):
    step: int | None = None
    fleet: str | None = None
    epoch: int | None = None

    def __post_init__(self) -> None:
        if self.step is not None:
            layout.check_step(self.step)
        _check_fence("update_info", self.fleet, self.epoch)


def _check_fence(what: str, fleet: str | None, epoch: int | None) -> None:
    if (fleet is None) != (epoch is None):
        raise UsageError(f"{what}: fleet and epoch come together (a fleet coordinator's lease), got {fleet!r}, {epoch!r}")
    if epoch is not None:
        check_fence(fleet, epoch)


class VllmEngineModel:
    """The model a weight-transfer engine is given, as DCR's ``EngineModel``
    (``flows.receive.engine_model``): its config from the engine, its reload vLLM's
    ``reload.inplace.reload_weights`` (what ``Worker.reload_weights`` runs)."""

    kind = "vllm"

    def __init__(self, engine: WeightTransferEngine):
        self._engine = engine

    @property
    def model(self) -> torch.nn.Module:
        return self._engine.model

    @property
    def ranks(self) -> int:
        return self._engine.parallel_config.tensor_parallel_size

    @property
    def rank(self) -> int:
        if self.ranks == 1:
            return 0
        from vllm.distributed import get_tensor_model_parallel_rank  # noqa: PLC0415 - a TP worker

        return get_tensor_model_parallel_rank()

    def reload(self, weights: Weights | None, layers: set[str] | None) -> None:
        """vLLM's in-place layerwise reload; without weights, every weight from the engine's own model path."""
        from vllm.model_executor.model_loader.reload.inplace import reload_weights  # noqa: PLC0415

        cfg = self._engine.vllm_config

        def run() -> None:
            with vllm_fixups.current_config(cfg):
                reload_weights(cfg, self.model, weights_iterator=weights, weights_path=None, is_checkpoint_format=True)

        vllm_fixups.reload(self.model, cfg, layers, run)

    def abandon_reload(self) -> None:
        vllm_fixups.abandon(self.model, self._engine.vllm_config, self._engine.model_config)


class DCRWeightTransferEngine(WeightTransferEngine[DCRInitInfo, DCRUpdateInfo]):
    """The ``dcr`` backend (see the module docstring)."""

    init_info_cls = DCRInitInfo
    update_info_cls = DCRUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._receiver = EngineReceiver(VllmEngineModel(self))
        self._bound: DCRInitInfo | None = None
        self._updated = False
        self.last_result: WorkerResult | None = None

    def _require_bound(self) -> DCRInitInfo:
        if self._bound is None:
            raise UsageError("the dcr weight-transfer engine has no ROOT: call init_weight_transfer_engine with "
                             '{"root": ..., "receiver_id": ...} first')
        return self._bound

    def init_transfer_engine(self, init_info: DCRInitInfo) -> None:
        r = self._receiver
        options = check_arguments(init_info.receiver_id, init_info.step, ReceiveOptions(**init_info.options))
        binding = Binding(RootRef(os.fspath(init_info.root), dict(init_info.storage_options)), init_info.receiver_id,
                          options, mirror=init_info.state_path, coordinator=init_info.fleet, epoch=init_info.epoch)
        r.admit(binding)  # a fleet epoch older than one seen: refused before anything is dropped
        r.abort()  # a re-init drops what an earlier one prepared
        self._bound = init_info
        r.bind(binding)
        if init_info.prepare:
            r.prepare_in_background(init_info.step, init_info.prepare_id)

    def start_weight_update(self) -> None:
        self._require_bound()
        self._updated = False
        self._receiver.prepared_step()  # waits for a prepare still pulling; raises what it failed with

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # everything is applied when this returns

    def receive_weights(self, update_info: DCRUpdateInfo) -> None:
        self._require_bound()
        r = self._receiver
        if update_info.epoch is not None and update_info.fleet is not None:
            r.fence(update_info.fleet, update_info.epoch)  # before anything changes
        else:  # no fleet's update: not while a fleet this engine belongs to switches
            outside_fleets(r.name, r.seen_fleets(), r.binding.root)
        prepared = r.prepared_step()
        step = update_info.step if update_info.step is not None else prepared
        if prepared is None or step != prepared:
            r.abort()
            r.prepare(step)  # in the pause: a step nobody prepared
        self._updated = True
        r.apply()
        r.record()
        self.last_result = res = r.last
        log.info("dcr: receiver %s at step %s (%s from %s): %d bytes pulled, %.3f s pause", res.receiver, res.to_step,
                 res.mode, res.from_step, res.bytes_pulled, res.pause_seconds)

    def finish_weight_update(self) -> None:
        if not self._updated:
            self._receiver.abort()  # started, never updated: nothing switches, what was prepared is dropped
        self._updated = False

    def shutdown(self) -> None:
        self._receiver.abort()
