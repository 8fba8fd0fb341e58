"""Refit of a live ``torch.nn.Module`` through its own vLLM-style ``load_weights``.

State machine of one receiver (held on the module as ``_dcr_refit``):

    unknown --dense load of step N--> at N --delta refit--> at N' --...
       ^                                 |
       +---- module digests mismatch ----+   (the module was changed outside DCR)

- *Dense load* (first refit, a keyframe path, or after a mismatch): step N is materialized to a
  temp file (streamed) and loaded tensor by tensor through ``load_weights``.
- *Delta refit*: every payload of every move is fetched and verified first (the module is not
  touched while fetching), masks of several steps are combined by XOR, then direct-path tensors
  are XORed in through scratch (``flows.receive.placement``) and overwrite-path tensors are
  reloaded with their new values, from a host-side copy of just those tensors (the *partial
  mirror*, a state file beside the receiver's cache). The time the module is being modified (the
  pause window) is measured separately from fetching.
- *Failure mid-apply*: the apply is all or nothing. Direct-path masks already XORed are XORed
  again and overwrite-path tensors already reloaded get their base values back, so the module
  returns to the exact bits of the step it held (checked by its digests) and stays known to be
  there; a retry then takes the delta path again.
- What the module holds is checked as a vLLM engine's is (``flows.receive.held_digests``): every
  module's digest before each refit (a module changed behind DCR's back, by any path, is reloaded
  densely instead of patched), the modules a delta writes again right before it writes them, and
  after the refit only those are hashed again for the record.

The steps exchange the module, and the payloads fetched for it, as ``LocalRef`` handles: they run
in the process that holds the module.
"""

from __future__ import annotations

import math
import os
import time

import blake3
import numpy as np

from dcr_core.bits import tensor_from_bits
from dcr_core.delta import Encoding, apply_chunk
from dcr_core.dtypes import DTYPES
from dcr_core.errors import StateMismatchError
from flows import local_refs
from flows.local_refs import LocalRef
from flows.options import ReceiveOptions, default_cache_dir
from flows.receive import held_digests, placement
from flows.receive.state_file import stage_rewrite
from storage import reader
from storage.local import state
from storage.local.safetensors import SafetensorsCheckpoint, StreamingSafetensorsWriter, install
from storage.reader import RefitPlan
from storage.root import RootRef, open_root

HELD_ATTR = "_dcr_refit"
PROBE_ATTR = "_dcr_probe"


def default_mirror_path(root: str, receiver_id: str) -> str:
    key = blake3.blake3(os.fspath(root).encode()).hexdigest()[:16]
    directory = os.path.join(default_cache_dir(), "receivers", key)
    os.makedirs(directory, exist_ok=True)  # DCR's own cache: created here (a user's --state directory is not)
    return os.path.join(directory, f"{receiver_id}.safetensors")


def held_by(target) -> dict | None:
    return getattr(target, HELD_ATTR, None)


def set_held(target, held: dict | None) -> None:
    object.__setattr__(target, HELD_ATTR, held)


def _tensor(bits: np.ndarray, entry):
    return tensor_from_bits(bits, DTYPES[entry.dtype], entry.shape)


def plan_module_refit(root: RootRef, module: LocalRef, step: int | None) -> RefitPlan:
    """Plan the refit of the module from the step it is known to hold (None: unknown, dense)."""
    target = local_refs.get(module)
    held = held_by(target)
    current = None
    if held and held.get("root") == root.url and held_digests.unchanged(target, held.get("digests")):
        current = held["step"]
    r = open_root(root)
    plan = reader.plan_refit(r, current, step, where=type(target).__name__)
    if current is not None and current in plan.steps and (
        reader.manifests(plan, r)[current].policy_digest != held.get("policy_digest")
    ):  # ROOT's step `current` is not the policy this module holds (a reused prefix, say)
        plan = reader.plan_refit(r, None, step, where=type(target).__name__)
    reader.refuse_bundles(plan, reader.manifests(plan, r), "a live-module receiver")
    return plan


def _probe_table(target, manifest) -> placement.ProbeTable:
    schema = tuple(sorted((n, e.dtype, e.shape) for n, e in manifest.tensors.items()))
    table = getattr(target, PROBE_ATTR, None)
    if table is None or table.schema != schema:
        table = placement.probe_module(target, schema)
        object.__setattr__(target, PROBE_ATTR, table)
    return table


def _write_mirror(path: str, step: int, manifest, tensors: dict[str, np.ndarray]) -> None:
    names = sorted(tensors)
    w = StreamingSafetensorsWriter(path, [manifest.tensors[n].info for n in names],
                                   state.metadata(step, manifest.policy_digest))
    try:
        for n in names:
            w.write(n, tensors[n])
        w.commit()
    except BaseException:
        w.abort()
        raise


def load_dense(plan: RefitPlan, module: LocalRef, mirror: str, options: ReceiveOptions) -> dict:
    """Load step N through the loader, tensor by tensor, and keep the overwrite-path tensors."""
    target = local_refs.get(module)
    root = open_root(plan.root)
    if not plan.from_keyframe or plan.current_step is not None:
        plan = reader.plan_refit(root, None, plan.target_step)
    manifest = reader.manifests(plan, root)[plan.target_step]
    table = _probe_table(target, manifest)
    tmp = f"{mirror}.dense-{os.getpid()}.safetensors"
    t_fetch = time.perf_counter()
    staged = stage_rewrite(plan, tmp, options)
    install(staged.path, tmp, durable=False)
    fetch_s = time.perf_counter() - t_fetch
    try:
        with SafetensorsCheckpoint(tmp) as ck:
            t0 = time.perf_counter()
            for name in sorted(ck.infos):
                target.load_weights([(name, _tensor(ck.bits(name), manifest.tensors[name]))])
            pause = time.perf_counter() - t0
            keep = {n: ck.bits(n) for n in table.names(placement.OVERWRITE)}
        _write_mirror(mirror, plan.target_step, manifest, keep)
    finally:
        os.unlink(tmp)
    return {"mode": "dense", "bytes_pulled": staged.bytes_pulled, "fetch_seconds": fetch_s,
            "pause_seconds": pause, "tensors_loaded": len(manifest.tensors)}


def fetch_module_payloads(plan: RefitPlan, module: LocalRef, options: ReceiveOptions) -> LocalRef:
    """Every payload of every move that the module's loader reads (its probed demand: a
    tensor-parallel rank's own chunks), verified, held in this process (the module is not touched)."""
    root = open_root(plan.root)
    ms = reader.manifests(plan, root)
    table = _probe_table(local_refs.get(module), ms[plan.target_step])

    def wanted(entry) -> frozenset[int] | None:
        probe = table.probes.get(entry.name)
        if probe is not None and probe.path == placement.IGNORED:
            return frozenset()  # the loader writes nothing for it (a tied head, say)
        if probe is None or probe.path != placement.DIRECT or probe.demand is None:
            return None  # overwrite-path tensors keep whole canonical copies: every chunk
        return probe.demand.chunks(entry.grid)

    return local_refs.put(reader.fetch_payloads(root, plan, ms, options.io_workers, wanted), "payloads")


def apply_to_module(plan: RefitPlan, module: LocalRef, fetched: LocalRef, mirror: str) -> dict:
    """Apply the fetched payloads to the module, all or nothing (see the module docstring)."""
    target = local_refs.get(module)
    payloads: reader.Fetched = local_refs.get(fetched)
    ms = reader.manifests(plan)
    manifest = ms[plan.target_step]
    table = _probe_table(target, manifest)
    masks: dict[str, np.ndarray] = {}  # the masks of all moves per tensor (XOR masks compose)
    for move in plan.moves:
        m = ms[move.step]
        for name, items in payloads.chunks[move.step].items():
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
        with SafetensorsCheckpoint(mirror) as ck:
            if ck.metadata.get(state.STEP) != str(plan.current_step):
                raise StateMismatchError(f"{mirror}: partial mirror is not at step {plan.current_step}")
            mirror_bits = {n: ck.bits(n) for n in table.names(placement.OVERWRITE)}
        for n in over:
            np.bitwise_xor(mirror_bits[n], masks[n], out=mirror_bits[n])
        for n, b in mirror_bits.items():
            if not manifest.tensors[n].matches(b):
                raise StateMismatchError(f"{mirror}: tensor {n!r} does not reach step {plan.target_step}'s digest")
    slots = placement.slots_of(target)
    touched = held_digests.holders(target, [slots[i].get() for n in direct + over for i in table.probes[n].slots])
    t_check = time.perf_counter()
    _take_held(target, plan, touched)
    check_s = time.perf_counter() - t_check
    t0 = time.perf_counter()
    direct_masks = [(n, _tensor(masks[n], manifest.tensors[n])) for n in direct]
    pause = placement.xor_into_module(target, table, direct_masks)  # all or nothing
    t1 = time.perf_counter()
    loaded: list[str] = []
    try:
        for n in over:
            target.load_weights([(n, _tensor(mirror_bits[n], manifest.tensors[n]))])
            loaded.append(n)
    except BaseException:
        _roll_back(target, table, direct_masks, loaded, masks, mirror_bits, manifest)
        raise
    pause += time.perf_counter() - t1
    modify_wall = time.perf_counter() - t0
    if table.names(placement.OVERWRITE):
        _write_mirror(mirror, plan.target_step, manifest, mirror_bits)
    return {"mode": "delta", "bytes_pulled": payloads.bytes_pulled, "fetch_seconds": payloads.seconds,
            "modules_written": sorted(touched), "check_seconds": check_s,
            "pause_seconds": pause, "modify_wall_seconds": modify_wall,
            "tensors_loaded": len(direct) + len(over), "direct": len(direct), "overwrite": len(over)}


def _take_held(target, plan: RefitPlan, touched: set[str]) -> None:
    """Right before the module changes: the modules the apply writes must still hash to what DCR
    recorded (``held_digests``, step 2), else nothing is applied; from here until the apply
    completes the module is unknown (the pipeline restores the record after a rollback)."""
    held = held_by(target)
    set_held(target, None)
    if held is None or held.get("step") != plan.current_step or not held_digests.unchanged(target, held["digests"], touched):
        raise StateMismatchError("the module was written outside DCR since this refit was planned; nothing was "
                                 "applied: receive again (it loads the step densely)")


def _roll_back(target, table, direct_masks, loaded, masks, mirror_bits, manifest) -> None:
    """Return the module to its base bits after a failed apply: XOR the direct-path masks again
    and reload the overwrite-path tensors already loaded with their base values (new XOR mask)."""
    placement.xor_into_module(target, table, direct_masks)
    for n in loaded:
        old = np.bitwise_xor(mirror_bits[n], masks[n])
        target.load_weights([(n, _tensor(old, manifest.tensors[n]))])


def probe_counts(target) -> dict:
    table = getattr(target, PROBE_ATTR, None)
    if table is None:
        return {}
    return {path: len(table.names(path)) for path in (placement.DIRECT, placement.OVERWRITE, placement.IGNORED)}
