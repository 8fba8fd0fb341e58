"""A live module's receive pipeline: plan, then a dense load or fetch-everything-then-apply (all or
nothing), then record what the module holds and the receiver's commit (see ``flows.receive.module``
for the states, ``flows.receive.held_digests`` for the check before each refit). The receiver kind
``LiveModule`` (``flows.receive.receiver``) runs the steps below as its lifecycle."""

from __future__ import annotations

import contextlib
import logging
import os

from dcr_core.errors import UsageError
from flows import local_refs
from flows.local_refs import LocalRef
from flows.options import ReceiveOptions
from flows.receive import held_digests, module, state_file
from flows.receive import receiver as receivers
from flows.receive.module import DenseStaged
from flows.receive.pipeline import Leases
from flows.receive.receiver import Binding, Receiver, check_arguments
from flows.receive.records import ReceiverCommit
from flows.results import ReceiveResult, as_dict
from flows.steps import InProcess, Runner, Step, StepTable
from storage.reader import RefitPlan, manifests
from storage.root import RootRef

log = logging.getLogger("dcr.receive")


class ModuleSteps(StepTable):
    """A live module's steps, in order."""

    plan_module_refit = Step(module.plan_module_refit)
    take_leases = Step(state_file.take_leases)
    stage_dense = Step(module.stage_dense)  # and load-dense: a dense load; or the two after them: a delta
    load_dense = Step(module.load_dense)
    fetch_module_payloads = Step(module.fetch_module_payloads)
    apply_to_module = Step(module.apply_to_module)
    record_receiver_commit = Step(state_file.record_receiver_commit)
    release_leases = Step(state_file.release_leases)


class LiveModule(Receiver):
    """A ``torch.nn.Module`` of this process whose parameters and buffers are receiver storage,
    placed by its own vLLM-style ``load_weights(weights)``; its partial mirror (overwrite-path
    tensors, bundles' members) is kept at the binding's ``mirror`` (default: under the DCR cache
    directory, keyed by ROOT and receiver). Its states: ``flows.receive.module``."""

    def __init__(self, target, runner: Runner | None = None):
        if not receivers.holds(target, LiveModule):
            raise UsageError(f"{type(target).__name__} has no load_weights(weights) method to place tensors with")
        super().__init__(type(target).__name__)
        self.target = target
        self.tasks = ModuleSteps(runner or InProcess())
        self._module: LocalRef | None = None
        self._leases: Leases | None = None
        self._plan: RefitPlan | None = None
        self._staged: DenseStaged | LocalRef | None = None  # a dense load's file, or a delta's payloads
        self._before: dict | None = None
        self._info: dict | None = None
        self._record: ReceiverCommit | None = None

    @classmethod
    def from_target(cls, target, runner: Runner | None = None, **how) -> LiveModule:
        return cls(target, runner)

    @property
    def mirror(self) -> str:
        b = self.binding
        return os.fspath(b.mirror or module.default_mirror_path(b.root.url, b.receiver_id))

    def version(self) -> int | None:
        held = module.held_by(self.target)
        return None if held is None else held["step"]

    def stage(self, step: int | None) -> None:
        """Plan and lease; a dense load's step materialized beside the mirror, or a delta's payloads
        fetched and verified (the module untouched). A step gc deleted meanwhile: plan again."""
        b, tasks = self.binding, self.tasks
        self.release()
        mod = self._module = local_refs.put(self.target, "module")
        leases = self._leases = Leases(b.root, b.receiver_id, b.options.lease_seconds, tasks.take_leases,
                                       tasks.release_leases)
        self._before = module.held_by(self.target)

        def fetch(p: RefitPlan) -> DenseStaged | LocalRef | None:
            leases.take(p)
            if _dense(p):
                return tasks.stage_dense(p, self.mirror, b.options)
            return tasks.fetch_module_payloads(p, mod, b.options) if p.moves else None

        self._plan, self._staged = leases.replanned(lambda: tasks.plan_module_refit(b.root, mod, step), fetch,
                                                    self.name)

    def install(self, step: int | None) -> None:
        """The pause window: a dense load, or the fetched payloads applied all or nothing."""
        p, mod, staged = self._plan, self._module, self._staged
        if p is None or mod is None:
            raise UsageError(f"{self.name}: nothing prepared: prepare first")
        if isinstance(staged, DenseStaged):
            module.set_held(self.target, None)  # unknown until the dense load completes
            self._staged = None  # the load removes the file, whatever happens
            self._info = self.tasks.load_dense(mod, staged, self.mirror)
        elif staged is not None:
            self._info = self._delta(p, mod, staged)
        else:
            self._info = {"mode": "current", "bytes_pulled": 0, "pause_seconds": 0.0, "tensors_loaded": 0}

    def record(self) -> None:
        """What the module holds now (its digests, for the next refit's check), then the receiver's commit."""
        p, info, b = self._plan, dict(self._info or {}), self.binding
        if p is None or not info:
            raise UsageError(f"{self.name}: nothing applied: apply first")
        policy = manifests(p)[p.target_step].policy_digest
        digests = _digests_after(self.target, self._before, info)
        module.set_held(self.target, {"root": b.root.url, "step": p.target_step, "policy_digest": policy,
                                      "digests": digests, "fingerprint": held_digests.combine(digests)})
        self._info = info
        self._record = ReceiverCommit(from_step=p.current_step, moves=p.describe(), policy_digest=policy,
                                      probe=module.probe_counts(self.target), **info)
        self.tasks.record_receiver_commit(b.root, b.receiver_id, p.target_step, self._record)

    def release(self) -> None:
        staged, self._staged = self._staged, None
        if isinstance(staged, DenseStaged):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged.path)
        else:
            local_refs.release(staged)
        if self._leases is not None:
            self._leases.release()
        ref, self._module = self._module, None
        local_refs.release(ref)

    def result(self) -> ReceiveResult:
        p, r = self._plan, self._record
        if p is None or r is None:
            raise UsageError(f"{self.name}: no refit recorded")
        return ReceiveResult(p.target_step, p.current_step, p.describe(), r.bytes_pulled, r.policy_digest,
                             dict(self.tasks.timings), {"probe": r.probe, **(self._info or {})})

    def _delta(self, plan: RefitPlan, mod: LocalRef, fetched: LocalRef) -> dict:
        held = module.held_by(self.target)  # the apply drops it right before the module changes
        try:
            return self.tasks.apply_to_module(plan, mod, fetched, self.mirror)
        except BaseException:
            if held and module.held_by(self.target) is None and held_digests.unchanged(self.target, held["digests"]):
                module.set_held(self.target, held)  # rolled back: still at the held step, every module hashed to say so
            raise


def receive_into_module(
    root: str | os.PathLike, receiver_id: str, target, step: int | None = None, storage_options: dict | None = None,
    options: ReceiveOptions | None = None, state_path: str | os.PathLike | None = None, runner: Runner | None = None,
) -> dict:
    """Bring the live ``target`` to ``step`` (default latest) and record the receiver's commit.

    ``state_path``: where the partial mirror (overwrite-path tensors, bundles' members) is kept (default: under the
    DCR cache directory, keyed by ROOT and receiver). Returns the ``ReceiveResult`` as one flat dict:
    the common fields and how the refit went (``mode`` dense/delta/current, ``bytes_pulled``,
    ``fetch_seconds``, ``pause_seconds``: the time live storage was being modified,
    ``modify_wall_seconds``, ``tensors_loaded``, the ``probe`` counts)."""
    receiver = LiveModule(target, runner)
    options = check_arguments(receiver_id, step, options)
    mirror = None if state_path is None else os.fspath(state_path)
    receiver.bind(Binding(RootRef(os.fspath(root), dict(storage_options or {})), receiver_id, options, mirror=mirror))
    return as_dict(receiver.refit(step))


def _dense(plan: RefitPlan) -> bool:
    """Whether the refit loads step N whole: the module's step is unknown, the plan goes through a
    keyframe, or a move's chunks decode only against the canonical bits (codec ``dcr.cond``: a live
    module holds its weights in its own layout, fused or sharded, so it loads such steps whole)."""
    if plan.current_step is None or plan.from_keyframe:
        return True
    ms = manifests(plan)
    return any(ms[m.step].codec.conditional for m in plan.moves)


def _digests_after(target, before: dict | None, info: dict) -> dict[str, str]:
    """The module digests after the refit: every module after a dense load; after a delta only the
    modules it wrote are hashed again (the plan checked the others); nothing after a no-op."""
    written = info.pop("modules_written", None)
    if info["mode"] == "dense" or before is None:
        return held_digests.digests_of(target)
    if info["mode"] == "delta":
        return held_digests.after(target, before["digests"], written)
    return before["digests"]
