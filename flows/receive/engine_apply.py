"""Phase 2 of an engine refit, the pause window (the engine serves nothing meanwhile): check the
modules the apply may change, write the in-place patches (``param_patch``), reload the touched
layers through the engine's own in-place reload from the staged mirror (``reload``: for vLLM its
layerwise reload), put the staged mirror in place, and record what the engine now holds. Any
engine: it is reached through its ``EngineModel`` (``flows.receive.engine_model``).

Only the modules the apply may change (``Prepared.touched``) are hashed here (``held_digests``):
before, to check they are what the prepare saw; after, for the record (``EngineState.held``: root,
step, policy digest, mirror and module digests). The rest of the engine was hashed by the prepare,
while it served: the pause's cost follows the change.

A failed reload is rolled back (``roll_back``): the same layers reloaded with the old step's values
from the current mirror (a known engine), or every weight from the engine's own model path (an
engine not yet known); patched elements get their old values back; then the touched modules'
digests must equal the prepare's: the engine serves the old step, bit for bit. If even that fails,
``EngineRefitError`` says the engine must be reloaded.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from dcr_core import events
from dcr_core.bits import tensor_from_bits, torch_dtype
from dcr_core.dtypes import DTYPES, TensorInfo
from dcr_core.errors import DCRError, StateMismatchError
from flows.receive import held_digests, param_patch, state_file
from flows.receive.engine_model import EngineModel, EngineState
from flows.receive.engine_prepare import Prepared, summary
from flows.receive.records import ReceiverCommit, WorkerResult
from storage import reader
from storage.local.safetensors import SafetensorsCheckpoint

log = logging.getLogger("dcr.receive")


class EngineRefitError(DCRError):
    """A refit of an engine failed after its weights started changing and could not be undone."""

    exit_code = 5


def apply(engine: EngineModel, known: EngineState, p: Prepared) -> WorkerResult:
    """The pause window (see the module docstring); sets ``p.record`` (the receiver's commit record)
    and ``known.held``, and returns the worker's result: the summary and the pause's timings."""
    t_apply = time.perf_counter()
    model = engine.model
    out = summary(p)
    target = reader.manifests(p.plan)[p.plan.target_step]
    if p.mode == "current":
        p.record = ReceiverCommit(from_step=p.plan.current_step, moves=[], bytes_pulled=0,
                                  policy_digest=target.policy_digest)
        return WorkerResult(**out.model_dump(), pause_seconds=0.0, reload_seconds=0.0, reloaded_tensors=0,
                            patched_tensors=0, patched_elements=0, check_seconds=0.0, digest_seconds=0.0,
                            hashed_modules=0)
    if not held_digests.unchanged(model, p.digests, p.touched):
        raise StateMismatchError("the engine's weights changed since dcr_prepare (reloaded outside DCR?); "
                                 "nothing was applied: prepare again")
    check_s = time.perf_counter() - t_apply
    infos = reader.state_infos(target)  # bundles' members by name, as the mirror holds them
    names = sorted(infos) if p.reload is None else p.reload
    source = p.staged.path if p.staged else p.mirror
    t0 = time.perf_counter()
    patched = 0
    try:
        patched = param_patch.apply(p.patches)
        if names or not p.patches:
            reload(engine, source, infos, names, p.layers)
    except BaseException as e:
        param_patch.undo(p.patches)
        roll_back(engine, known, p, names, e)
        raise
    reload_s = time.perf_counter() - t0
    known.held = None  # unknown until the mirror is in place
    if p.staged is not None:
        state_file.install_state(p.staged)
        p.staged = None
    t1 = time.perf_counter()
    digests = held_digests.after(model, p.digests, p.touched)
    digest_s = time.perf_counter() - t1
    known.held = {"root": p.ref.url, "step": p.plan.target_step, "policy_digest": target.policy_digest,
                  "mirror": p.mirror, "fingerprint": held_digests.combine(digests), "digests": digests}
    pause = time.perf_counter() - t_apply  # the engine serves nothing while this RPC runs
    events.reached("receive.engine-reloaded", step=p.plan.target_step)
    timing = {"pause_seconds": pause, "reload_seconds": reload_s, "check_seconds": check_s,
              "digest_seconds": digest_s, "reloaded_tensors": len(names), "patched_tensors": len(p.patches),
              "patched_elements": patched, "hashed_modules": len(digests if p.touched is None else p.touched & set(digests))}
    p.record = ReceiverCommit(from_step=p.plan.current_step, moves=p.plan.describe(), bytes_pulled=out.bytes_pulled,
                              policy_digest=target.policy_digest, engine=engine.kind, mode=p.mode, **timing)
    return WorkerResult(**out.model_dump(), **timing)


def reload(engine: EngineModel, path: str | None, infos: dict[str, TensorInfo] | None, names: list[str],
           layers: set[str] | None) -> None:
    """The engine's in-place reload of ``names`` read from the state file at ``path`` (None: every
    weight from the engine's own checkpoint), each viewed with its dtype and shape in ``infos``
    (the step's tensors, bundles' members by name; None: the file's own header)."""
    if path is None:
        engine.reload(None, layers)  # from where the engine was loaded
        return
    with SafetensorsCheckpoint(path) as ck:
        held = ck.infos if infos is None else infos

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            for n in names:
                i = held[n]
                t = _mapped(ck.mapped_bits(n), DTYPES[i.dtype], tuple(i.shape))
                events.reached("receive.engine-tensor", name=n)
                yield n, t

        engine.reload(weights(), layers)


def roll_back(engine: EngineModel, known: EngineState, p: Prepared, names: list[str], error: BaseException) -> None:
    """Bring the engine back to the bits it had when prepared, or say it could not be."""
    model = engine.model
    how = "the old step's tensors from the mirror" if p.known else "the engine's own checkpoint"
    try:
        engine.abandon_reload()  # a cut-off reload leaves layers half loaded
        if not p.known:
            reload(engine, None, None, [], None)
        elif names:  # the mirror holds the old step as its header lays it out (a plan through a keyframe
            reload(engine, p.mirror, None, names, p.layers)  # names no manifest of that step)
        restored = held_digests.unchanged(model, p.digests, p.touched)
    except BaseException as undo:  # noqa: BLE001 - reported with the original error
        known.held = None
        raise EngineRefitError(
            f"reloading step {p.plan.target_step} failed ({type(error).__name__}: {error}) and reloading "
            f"{how} failed too ({type(undo).__name__}: {undo}); the engine must be reloaded") from error
    if not restored:
        known.held = None
        raise EngineRefitError(
            f"reloading step {p.plan.target_step} failed ({type(error).__name__}: {error}); reloading {how} "
            "did not give back the engine's weights; the engine must be reloaded") from error
    log.warning("reloading step %s failed (%s: %s); the engine is back at its previous weights",
                p.plan.target_step, type(error).__name__, error)


def _mapped(bits, dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A read-only tensor over the staged mirror's pages (a memory map: no copy, no fresh pages to
    fault in; vLLM's loaders copy out of it, as they copy out of a safetensors file they map)."""
    if not bits.size:
        return tensor_from_bits(bits, dtype, shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": the loaders only read it
        u8 = torch.from_numpy(bits.view(np.uint8))
    return u8.view(torch_dtype(dtype)).reshape(shape)
