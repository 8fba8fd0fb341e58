"""A live module's receive pipeline: plan, then a dense load or fetch-everything-then-apply (all or
nothing), then record what the module holds and the receiver's commit (see ``flows.receive.module``
for the states, ``flows.receive.held_digests`` for the check before each refit)."""

from __future__ import annotations

import logging
import os

from dcr_core.errors import UsageError
from flows import local_refs
from flows.options import ReceiveOptions
from flows.receive import held_digests, module, state_file
from flows.receive.pipeline import Leases, check_arguments
from flows.results import ReceiveResult, as_dict
from flows.steps import Bound, InProcess, Runner, Step, StepTable
from storage.reader import RefitPlan, manifests
from storage.root import RootRef

log = logging.getLogger("dcr.receive")

MODULE_STEPS = StepTable(
    Step("resolve-module-chain", module.plan_module_refit),
    Step("take-leases", state_file.take_leases),
    Step("load-dense", module.load_dense),
    Step("fetch-verify", module.fetch_module_payloads),
    Step("apply-to-module", module.apply_to_module),
    Step("record-receiver-commit", state_file.record_receiver_commit),
    Step("release-leases", state_file.release_leases),
)


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
    if not callable(getattr(target, "load_weights", None)):
        raise UsageError(f"{type(target).__name__} has no load_weights(weights) method to place tensors with")
    options = check_arguments(receiver_id, step, options)
    ref = RootRef(os.fspath(root), dict(storage_options or {}))
    mirror = os.fspath(state_path or module.default_mirror_path(ref.url, receiver_id))
    tasks = MODULE_STEPS.bind(runner or InProcess())
    with local_refs.holding(target, "module") as mod, \
            Leases(ref, receiver_id, options.lease_seconds, tasks.take_leases, tasks.release_leases) as leases:
        def refit(p: RefitPlan) -> dict:
            leases.take(p)
            return _refit(tasks, p, mod, mirror, options, target)

        before = module.held_by(target)
        plan, info = leases.replanned(lambda: tasks.plan_module_refit(ref, mod, step), refit, type(target).__name__)
        policy = manifests(plan)[plan.target_step].policy_digest
        digests = _digests_after(target, before, info)
        module.set_held(target, {"root": ref.url, "step": plan.target_step, "policy_digest": policy,
                                 "digests": digests, "fingerprint": held_digests.combine(digests)})
        record = {"from_step": plan.current_step, "moves": plan.describe(), "policy_digest": policy,
                  "probe": module.probe_counts(target), **info}
        tasks.record_receiver_commit(ref, receiver_id, plan.target_step, record)
    return as_dict(ReceiveResult(plan.target_step, plan.current_step, plan.describe(), info["bytes_pulled"], policy,
                                 dict(tasks.timings), {"probe": record["probe"], **info}))


def _digests_after(target, before: dict | None, info: dict) -> dict[str, str]:
    """The module digests after the refit: every module after a dense load; after a delta only the
    modules it wrote are hashed again (the plan checked the others); nothing after a no-op."""
    written = info.pop("modules_written", None)
    if info["mode"] == "dense":
        return held_digests.digests_of(target)
    if info["mode"] == "delta":
        return held_digests.after(target, before["digests"], written)
    return before["digests"]


def _refit(tasks: Bound, plan: RefitPlan, mod, mirror: str, options: ReceiveOptions, target) -> dict:
    if plan.current_step is None or plan.from_keyframe or _held_coded(plan):
        module.set_held(target, None)  # unknown until the dense load completes
        return tasks.load_dense(plan, mod, mirror, options)
    if plan.moves:
        return _delta(tasks, plan, mod, mirror, options, target)
    return {"mode": "current", "bytes_pulled": 0, "pause_seconds": 0.0, "tensors_loaded": 0}


def _held_coded(plan: RefitPlan) -> bool:
    """Whether a move's chunks decode only against the canonical bits (codec ``dcr.cond``): a live
    module holds its weights in its own layout (fused, sharded), so it loads such steps whole."""
    ms = manifests(plan)
    return any(ms[m.step].codec.conditional for m in plan.moves)


def _delta(tasks: Bound, plan: RefitPlan, mod, mirror: str, options: ReceiveOptions, target) -> dict:
    held = module.held_by(target)  # the apply drops it right before the module changes
    fetched = None
    try:
        fetched = tasks.fetch_module_payloads(plan, mod, options)  # every payload verified before the module is touched
        return tasks.apply_to_module(plan, mod, fetched, mirror)
    except BaseException:
        if held and module.held_by(target) is None and held_digests.unchanged(target, held["digests"]):
            module.set_held(target, held)  # rolled back: still at the held step, every module hashed to say so
        raise
    finally:
        local_refs.release(fetched)
