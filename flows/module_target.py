"""Refit of a live ``torch.nn.Module`` through its own vLLM-style ``load_weights``.

State machine of one receiver (held on the module as ``_dcr_refit``):

    unknown --dense load of step N--> at N --delta refit--> at N' --...
       ^                                 |
       +---- fingerprint mismatch -------+   (the module was changed outside DCR)

- *Dense load* (first refit, a keyframe path, or after a mismatch): step N is materialized to a
  temp file (streamed) and loaded tensor by tensor through ``load_weights``.
- *Delta refit*: every payload of every move is fetched and verified first (the module is not
  touched while fetching), masks of several steps are combined by XOR, then direct-path tensors
  are XORed in through scratch (``flows.placement``) and overwrite-path tensors are reloaded with
  their new values, from a host-side copy of just those tensors (the *partial mirror*, a state file
  beside the receiver's cache). The time the module is being modified (the pause window) is
  measured separately from fetching.
- *Failure mid-apply*: the apply is all or nothing. Direct-path masks already XORed are XORed
  again and overwrite-path tensors already reloaded get their base values back, so the module
  returns to the exact bits of the step it held (checked by its fingerprint) and stays known to be
  there; a retry then takes the delta path again.
- After each refit a fingerprint of every parameter and buffer bit is recorded; the next refit
  first checks it, so a module changed behind DCR's back is reloaded densely instead of patched.
"""

from __future__ import annotations

import math
import os
import time

import blake3
import numpy as np

from dcr_core.bits import bits_of, tensor_from_bits
from dcr_core.chain import Direction
from dcr_core.delta import Encoding, apply_chunk
from dcr_core.dtypes import DTYPES
from dcr_core.errors import StateMismatchError, UsageError
from flows import placement
from flows import receive_steps as rs
from flows.options import ReceiveOptions, default_cache_dir
from storage import layout
from storage.catalog import Catalog
from storage.checkpoint import SafetensorsCheckpoint, StreamingSafetensorsWriter, TensorInfo
from storage.root import Root

_ATTR = "_dcr_refit"
_PROBE_ATTR = "_dcr_probe"


def default_mirror_path(root: str, receiver_id: str) -> str:
    key = blake3.blake3(os.fspath(root).encode()).hexdigest()[:16]
    return os.path.join(default_cache_dir(), "receivers", key, f"{receiver_id}.safetensors")


def _probe_table(target, manifest) -> placement.ProbeTable:
    schema = tuple(sorted((n, e.dtype, e.shape) for n, e in manifest.tensors.items()))
    table = getattr(target, _PROBE_ATTR, None)
    if table is None or table.schema != schema:
        table = placement.probe_module(target, schema)
        object.__setattr__(target, _PROBE_ATTR, table)
    return table


def _write_mirror(path: str, step: int, manifest, tensors: dict[str, np.ndarray]) -> None:
    names = sorted(tensors)
    infos = [TensorInfo(n, manifest.tensors[n].dtype, manifest.tensors[n].shape) for n in names]
    w = StreamingSafetensorsWriter(path, infos, {rs.STATE_STEP: str(step), rs.STATE_POLICY: manifest.policy_digest})
    try:
        for n in names:
            w.write(n, tensors[n])
        w.commit()
    except BaseException:
        w.abort()
        raise


def _dense(root, so, target, plan, mirror, options) -> dict:
    """Load step N through the loader, tensor by tensor, and keep the overwrite-path tensors."""
    manifest = plan.manifests[plan.target_step]
    table = _probe_table(target, manifest)
    tmp = f"{mirror}.dense-{os.getpid()}.safetensors"
    t_fetch = time.perf_counter()
    if plan.current_step is not None or not plan.moves or plan.moves[0].direction is not Direction.KEYFRAME:
        plan = rs.plan_receive(root, so, None, plan.target_step)
    outcome = rs.refit_file(plan, tmp, options)
    outcome["writer"].commit()
    fetch_s = time.perf_counter() - t_fetch
    try:
        ck = SafetensorsCheckpoint(tmp)
        t0 = time.perf_counter()
        for name in sorted(ck.infos):
            target.load_weights([(name, ck.tensor(name))])
        pause = time.perf_counter() - t0
        keep = {n: bits_of(ck.tensor(n)) for n in table.names(placement.OVERWRITE)}
        _write_mirror(mirror, plan.target_step, manifest, keep)
    finally:
        os.unlink(tmp)
    return {"mode": "dense", "bytes_pulled": outcome["bytes_pulled"], "fetch_seconds": fetch_s,
            "pause_seconds": pause, "tensors_loaded": len(manifest.tensors)}


def _delta(root, so, target, plan, mirror, options) -> dict:
    manifest = plan.manifests[plan.target_step]
    table = _probe_table(target, manifest)
    t_fetch = time.perf_counter()
    fetched = rs.fetch_payloads(plan, options)  # every payload verified before the module is touched
    fetch_s = time.perf_counter() - t_fetch
    # Combine the masks of all moves per tensor (XOR masks compose).
    masks: dict[str, np.ndarray] = {}
    for move in plan.moves:
        m = plan.manifests[move.step]
        for name, items in fetched.chunks[move.step].items():
            e = m.tensors[name]
            if e.encoding is not Encoding.XOR:
                raise StateMismatchError(f"step {move.step}: tensor {name!r} is not an XOR mask")
            acc = masks.setdefault(name, np.zeros(math.prod(e.shape), dtype=DTYPES[e.dtype].storage))
            for index, payload in items:
                apply_chunk(acc, e.grid, index, payload, Encoding.XOR)
    masks = {n: b for n, b in masks.items() if np.count_nonzero(b)}
    over = [n for n in sorted(masks) if table.probes[n].path == placement.OVERWRITE]
    direct = [n for n in sorted(masks) if table.probes[n].path == placement.DIRECT]
    # New values of overwrite-path tensors, from the partial mirror, verified before any change.
    mirror_bits: dict[str, np.ndarray] = {}
    if table.names(placement.OVERWRITE):
        ck = SafetensorsCheckpoint(mirror)
        if ck.metadata.get(rs.STATE_STEP) != str(plan.current_step):
            raise StateMismatchError(f"{mirror}: partial mirror is not at step {plan.current_step}")
        mirror_bits = {n: bits_of(ck.tensor(n)).copy() for n in table.names(placement.OVERWRITE)}
        for n in over:
            np.bitwise_xor(mirror_bits[n], masks[n], out=mirror_bits[n])
        for n, b in mirror_bits.items():
            if not manifest.tensors[n].matches(b):
                raise StateMismatchError(f"{mirror}: tensor {n!r} does not reach step {plan.target_step}'s digest")
    t0 = time.perf_counter()
    direct_masks = [
        (n, tensor_from_bits(masks[n], DTYPES[manifest.tensors[n].dtype], manifest.tensors[n].shape)) for n in direct
    ]
    pause = placement.xor_into_module(target, table, direct_masks)  # all or nothing
    t1 = time.perf_counter()
    loaded: list[str] = []
    try:
        for n in over:
            e = manifest.tensors[n]
            target.load_weights([(n, tensor_from_bits(mirror_bits[n], DTYPES[e.dtype], e.shape))])
            loaded.append(n)
    except BaseException:
        _roll_back(target, table, direct_masks, loaded, masks, mirror_bits, manifest)
        raise
    pause += time.perf_counter() - t1
    modify_wall = time.perf_counter() - t0
    if table.names(placement.OVERWRITE):
        _write_mirror(mirror, plan.target_step, manifest, mirror_bits)
    return {"mode": "delta", "bytes_pulled": fetched.bytes_pulled, "fetch_seconds": fetch_s,
            "pause_seconds": pause, "modify_wall_seconds": modify_wall,
            "tensors_loaded": len(direct) + len(over), "direct": len(direct), "overwrite": len(over)}


def _roll_back(target, table, direct_masks, loaded, masks, mirror_bits, manifest) -> None:
    """Return the module to its base bits after a failed apply: XOR the direct-path masks again
    and reload the overwrite-path tensors already loaded with their base values (new XOR mask)."""
    placement.xor_into_module(target, table, direct_masks)
    for n in loaded:
        e = manifest.tensors[n]
        old = np.bitwise_xor(mirror_bits[n], masks[n])
        target.load_weights([(n, tensor_from_bits(old, DTYPES[e.dtype], e.shape))])


def receive_into_module(
    root, receiver_id, target, step=None, storage_options=None, options=None, state_path=None, tasks=None,
) -> dict:
    """Bring the live ``target`` to ``step`` (default latest) and record the receiver's commit."""
    if not callable(getattr(target, "load_weights", None)):
        raise UsageError(f"{type(target).__name__} has no load_weights(weights) method to place tensors with")
    layout.check_receiver(receiver_id)
    root = os.fspath(root)
    so = dict(storage_options or {})
    options = options or ReceiveOptions()
    mirror = os.fspath(state_path or default_mirror_path(root, receiver_id))
    held = getattr(target, _ATTR, None)
    current = None
    if held and held.get("root") == root and held.get("fingerprint") == placement.fingerprint(target):
        current = held["step"]
    plan = rs.plan_receive(root, so, current, step)
    if current is not None and plan.manifests.get(current) is not None and (
        plan.manifests[current].policy_digest != held.get("policy_digest")
    ):
        # ROOT's step `current` is not the policy this module holds (a reused prefix, say)
        current = None
        plan = rs.plan_receive(root, so, None, step)
    object.__setattr__(target, _ATTR, None)  # unknown until this refit completes
    if current is None or (plan.moves and plan.moves[0].direction is Direction.KEYFRAME):
        info = _dense(root, so, target, plan, mirror, options)
    elif plan.moves:
        try:
            info = _delta(root, so, target, plan, mirror, options)
        except BaseException:
            if placement.fingerprint(target) == held["fingerprint"]:
                object.__setattr__(target, _ATTR, held)  # rolled back (or never touched): still at `current`
            raise
    else:
        info = {"mode": "current", "bytes_pulled": 0, "pause_seconds": 0.0, "tensors_loaded": 0}
    manifest = plan.manifests[plan.target_step]
    object.__setattr__(
        target, _ATTR,
        {"root": root, "step": plan.target_step, "policy_digest": manifest.policy_digest,
         "fingerprint": placement.fingerprint(target)},
    )
    moves = [f"{m.direction.value}:{m.step}" for m in plan.moves]
    table = getattr(target, _PROBE_ATTR, None)
    probe = {} if table is None else {
        path: len(table.names(path)) for path in (placement.DIRECT, placement.OVERWRITE, placement.IGNORED)
    }
    record = {"from_step": current, "moves": moves, "policy_digest": manifest.policy_digest, "probe": probe, **info}
    Catalog(Root(root, so)).record_receiver(plan.target_step, receiver_id, record)
    return {"step": plan.target_step, **record}
