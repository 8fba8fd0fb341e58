"""Phase 2 of an engine refit, the pause window (the engine serves nothing meanwhile): check the
modules the apply may change, write the in-place patches (``param_patch``), reload the touched
layers through the engine's own in-place reload from the staged mirror (``reload``: for vLLM its
layerwise reload), put the staged mirror in place, and record what the engine now holds. Any
engine: it is reached through its ``EngineModel`` (``flows.receive.engine_model``).

The pause holds no full read of the engine (``held_digests``, "An engine's pause window"):

- before anything changes, the modules patched in place are hashed in full and compared with the
  prepare's digests (a patch writes some elements, so the others must be what the prepare saw),
  and every module's stamps (sampled blocks) with the prepare's: another reload of the engine
  since the prepare is refused (``StateMismatchError``, nothing applied). A layer reloaded whole
  does not depend on what it held.
- after the reload, the modules the apply may change (``Prepared.touched``) are stamped and the
  kernels they compute through kept by reference (``kernels_of``: no kernel runs in the pause);
  ``known.held`` (root, step, policy digest, mirror) is set, its digests still to come;
- once the engine serves again, ``settle`` (in a thread, ``EngineReceiver``) hashes those modules'
  bytes for the record (``EngineState.held``: module digests and their fingerprint), and compares
  their stamps again: a write by anyone else in between leaves the engine unknown (the next refit
  reloads it whole). Every other module keeps the digest the prepare took while the engine served.
  The mirror's directory is synced and the old mirror's pages freed there too (``Prepared.settle``).
  A kernel module's digest stays ``Pending`` until the next call in the engine's own thread reads
  its kernel back (the next prepare, which reads every kernel anyway, or ``status``): the record is
  completed then (``engine_prepare.complete_record``), if the module still computes through the
  kernel the pause left.

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
    if not held_digests.unchanged(model, p.digests, patched_modules(model, p)) \
            or held_digests.stamps_of(model) != p.stamps:
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
        state_file.install_state(p.staged, later=p.settle)  # its directory synced after the pause
        p.staged = None
    t1 = time.perf_counter()
    kernels = held_digests.kernels_of(model, p.touched)  # read back by the next prepare, not here
    stamps = held_digests.stamps_of(model, p.touched)
    digest_s = time.perf_counter() - t1
    held = {"root": p.ref.url, "step": p.plan.target_step, "policy_digest": target.policy_digest,
            "mirror": p.mirror, "fingerprint": None, "digests": None}  # the digests: once settled
    known.held = held
    p.after = lambda: settle(known, model, held, p, kernels, stamps)
    pause = time.perf_counter() - t_apply  # the engine serves nothing while this RPC runs
    events.reached("receive.engine-reloaded", step=p.plan.target_step)
    hashed = len(stamps) if p.touched is None else len(p.touched & (set(stamps) | set(kernels)))
    timing = {"pause_seconds": pause, "reload_seconds": reload_s, "check_seconds": check_s,
              "digest_seconds": digest_s, "reloaded_tensors": len(names), "patched_tensors": len(p.patches),
              "patched_elements": patched, "hashed_modules": hashed}
    p.record = ReceiverCommit(from_step=p.plan.current_step, moves=p.plan.describe(), bytes_pulled=out.bytes_pulled,
                              policy_digest=target.policy_digest, engine=engine.kind, mode=p.mode, **timing)
    return WorkerResult(**out.model_dump(), **timing)


def settle(known: EngineState, model, held: dict, p: Prepared, kernels: dict, stamps: dict[str, str]) -> float:
    """After the pause, while the engine serves (see the module docstring): the touched modules'
    digests for ``held`` (what ``known.held`` was set to in the pause; a kernel module's ``Pending``
    on its kernel, ``kernels``), checked against the stamps taken at its end; then the mirror's
    directory synced and the old mirror freed. Returns the seconds it took. Reads only: safe beside
    the engine's forward passes (no kernel runs)."""
    t0 = time.perf_counter()
    try:
        digests = held_digests.after(model, p.digests, p.touched, kernels)
        still = held_digests.stamps_of(model, p.touched) == stamps
        p.settle.close()
    except BaseException:
        if known.held is held:
            known.held = None
        raise
    if known.held is held:
        if still:  # the fingerprint: once every kernel part is read (engine_prepare.complete_record)
            held.update(digests=digests, fingerprint=None if held_digests.pending(digests)
                        else held_digests.combine(digests))
        else:
            known.held = None
            log.warning("the engine's weights changed right after DCR applied step %s (another reload?): "
                        "the next refit reloads it whole", p.plan.target_step)
    return time.perf_counter() - t0


def patched_modules(model, p: Prepared) -> set[str]:
    """The modules that hold a tensor patched in place (tied twins included)."""
    if not p.patches:
        return set()
    return {pt.module for pt in p.patches} | held_digests.holders(model, [pt.param for pt in p.patches])


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
