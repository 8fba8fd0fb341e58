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
- *Bundles* (manifest schema 4: small tensors of a dtype stored as one flat tensor): the module
  holds members by name, in its own layout, so a bundle is applied whole on the canonical bits the
  partial mirror keeps of every bundle's members: the mirror's bundle with its masks XORed in must
  reach the bundle's digest and every member's before anything changes; then each member a mask
  changes is placed like any tensor of its path (its slice of the mask XORed in, or its new values
  reloaded), so the loader only ever sees member names. Bundles are fetched whole (every chunk,
  whatever a rank's demand), since the mirror keeps them whole.
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
from dataclasses import dataclass

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
from storage.local import bundled, state
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
    return plan


def _probe_table(target, manifest) -> placement.ProbeTable:
    """The probes of the tensors the module holds: the policy's (a bundle's members by name, never
    the bundle, which no loader knows)."""
    schema = tuple(sorted((n, d, tuple(s)) for n, d, s, _ in manifest.policy_entries()))
    table = getattr(target, PROBE_ATTR, None)
    if table is None or table.schema != schema:
        table = placement.probe_module(target, schema)
        object.__setattr__(target, PROBE_ATTR, table)
    return table


def _mirrored(table: placement.ProbeTable, manifest) -> list[str]:
    """The stored tensors the partial mirror keeps whole: the overwrite-path tensors (their new
    values are what the loader takes) and every bundle (applied and checked whole, on canonical
    bits the module, holding its members in its own layout, cannot give back)."""
    bundles = manifest.bundles()
    inside = {n for m in bundles.values() for n in m.names}
    return sorted(set(bundles) | {n for n in table.names(placement.OVERWRITE) if n not in inside})


def _write_mirror(path: str, step: int, manifest, tensors: dict[str, np.ndarray]) -> None:
    """Write the held tensors ``tensors`` (by name) in state-file order: a bundle's members back to
    back, so the next apply reads each bundle in one read."""
    infos = [i for n, i in reader.state_infos(manifest).items() if n in tensors]
    w = StreamingSafetensorsWriter(path, infos, state.metadata(step, manifest.policy_digest))
    try:
        for i in infos:
            w.write(i.name, tensors[i.name])
        w.commit()
    except BaseException:
        w.abort()
        raise


@dataclass(frozen=True)
class DenseStaged:
    """Step N materialized beside the mirror for a dense load (``path``), by ``plan`` (from its
    nearest keyframe), and what fetching it cost."""

    plan: RefitPlan
    path: str
    bytes_pulled: int
    fetch_seconds: float


def stage_dense(plan: RefitPlan, mirror: str, options: ReceiveOptions) -> DenseStaged:
    """Materialize step N beside the mirror for a dense load (streamed; the module is not touched)."""
    root = open_root(plan.root)
    if not plan.from_keyframe or plan.current_step is not None:
        plan = reader.plan_refit(root, None, plan.target_step)
    tmp = f"{mirror}.dense-{os.getpid()}.safetensors"
    t_fetch = time.perf_counter()
    staged = stage_rewrite(plan, tmp, options)
    install(staged.path, tmp, durable=False)
    return DenseStaged(plan, tmp, staged.bytes_pulled, time.perf_counter() - t_fetch)


def load_dense(module: LocalRef, staged: DenseStaged, mirror: str) -> dict:
    """Load the staged step through the loader, tensor by tensor, and keep the overwrite-path
    tensors; the staged file is removed."""
    target = local_refs.get(module)
    plan = staged.plan
    manifest = reader.manifests(plan)[plan.target_step]
    table = _probe_table(target, manifest)
    try:
        with SafetensorsCheckpoint(staged.path) as ck:  # the held tensors by name (a bundle's members)
            t0 = time.perf_counter()
            for name in sorted(ck.infos):
                target.load_weights([(name, _tensor(ck.bits(name), ck.infos[name]))])
            pause = time.perf_counter() - t0
            keep = {n: ck.bits(n) for n in bundled.member_names(manifest.tensors, _mirrored(table, manifest))}
            loaded = len(ck.infos)
        _write_mirror(mirror, plan.target_step, manifest, keep)
    finally:
        os.unlink(staged.path)
    return {"mode": "dense", "bytes_pulled": staged.bytes_pulled, "fetch_seconds": staged.fetch_seconds,
            "pause_seconds": pause, "tensors_loaded": loaded}


def fetch_module_payloads(plan: RefitPlan, module: LocalRef, options: ReceiveOptions) -> LocalRef:
    """Every payload of every move that the module's loader reads (its probed demand: a
    tensor-parallel rank's own chunks), verified, held in this process (the module is not touched)."""
    root = open_root(plan.root)
    ms = reader.manifests(plan, root)
    table = _probe_table(local_refs.get(module), ms[plan.target_step])

    def wanted(entry) -> frozenset[int] | None:
        if entry.members is not None:
            return None  # a bundle: every chunk (the mirror keeps it whole, see ``_mirrored``)
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
    infos = reader.state_infos(manifest)
    table = _probe_table(target, manifest)
    stored_masks = _stored_masks(plan, ms, payloads)
    kept = _mirrored(table, manifest)
    # New values of what the partial mirror keeps, verified before any change.
    mirror_bits = _mirror_after(mirror, plan, manifest, kept, stored_masks)
    masks = _held_masks(manifest, stored_masks)
    over = [n for n in sorted(masks) if table.probes[n].path == placement.OVERWRITE]
    direct = [n for n in sorted(masks) if table.probes[n].path == placement.DIRECT]
    slots = placement.slots_of(target)
    touched = held_digests.holders(target, [slots[i].get() for n in direct + over for i in table.probes[n].slots])
    t_check = time.perf_counter()
    _take_held(target, plan, touched)
    check_s = time.perf_counter() - t_check
    t0 = time.perf_counter()
    direct_masks = [(n, _tensor(masks[n], infos[n])) for n in direct]
    pause = placement.xor_into_module(target, table, direct_masks)  # all or nothing
    t1 = time.perf_counter()
    loaded: list[str] = []
    try:
        for n in over:
            target.load_weights([(n, _tensor(mirror_bits[n], infos[n]))])
            loaded.append(n)
    except BaseException:
        _roll_back(target, table, direct_masks, loaded, masks, mirror_bits, infos)
        raise
    pause += time.perf_counter() - t1
    modify_wall = time.perf_counter() - t0
    if kept:
        _write_mirror(mirror, plan.target_step, manifest, mirror_bits)
    return {"mode": "delta", "bytes_pulled": payloads.bytes_pulled, "fetch_seconds": payloads.seconds,
            "modules_written": sorted(touched), "check_seconds": check_s,
            "pause_seconds": pause, "modify_wall_seconds": modify_wall,
            "tensors_loaded": len(direct) + len(over), "direct": len(direct), "overwrite": len(over)}


def _stored_masks(plan: RefitPlan, ms: dict, payloads: reader.Fetched) -> dict[str, np.ndarray]:
    """The XOR mask of all moves per stored tensor (a bundle: one flat mask), the non-zero ones:
    XOR masks compose, so several steps cost one pass over the module."""
    masks: dict[str, np.ndarray] = {}
    for move in plan.moves:
        m = ms[move.step]
        for name, items in payloads.chunks[move.step].items():
            e = m.tensors[name]
            if e.encoding is not Encoding.XOR:
                raise StateMismatchError(f"step {move.step}: tensor {name!r} is not an XOR mask")
            acc = masks.setdefault(name, np.zeros(math.prod(e.shape), dtype=DTYPES[e.dtype].storage))
            for index, payload in items:
                apply_chunk(acc, e.grid, index, payload, Encoding.XOR)
    return {n: b for n, b in masks.items() if np.count_nonzero(b)}


def _held_masks(manifest, stored_masks: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The masks by held name: a bundle's mask split into its members' (views), the members it
    leaves unchanged dropped (the loader is never called for them)."""
    out = {}
    for name, flat in stored_masks.items():
        for n, b in bundled.expand(manifest.tensors[name], flat):
            if b is flat or np.count_nonzero(b):
                out[n] = b
    return out


def _mirror_after(mirror: str, plan: RefitPlan, manifest, kept: list[str], masks: dict[str, np.ndarray]) -> dict:
    """The new bits of the stored tensors ``kept``, by held name (a bundle's members: views of its
    flat bits): the partial mirror's bits at the held step (a bundle gathered from its members) with
    the masks XORed in, each checked against the target step's digest (a bundle: its own and every
    member's) before the module changes."""
    if not kept:
        return {}
    out: dict[str, np.ndarray] = {}
    with SafetensorsCheckpoint(mirror) as ck:
        if ck.metadata.get(state.STEP) != str(plan.current_step):
            raise StateMismatchError(f"{mirror}: partial mirror is not at step {plan.current_step}")
        held = bundled.view(ck, manifest.bundles())
        for n in kept:
            if n not in held.infos:
                raise StateMismatchError(f"{mirror}: partial mirror lacks tensor {n!r} of step {plan.current_step}")
            bits = held.bits(n)
            if n in masks:
                np.bitwise_xor(bits, masks[n], out=bits)
            e = manifest.tensors[n]
            if not e.matches(bits):
                raise StateMismatchError(f"{mirror}: tensor {n!r} does not reach step {plan.target_step}'s digest")
            out.update(bundled.expand(e, bits))
    return out


def _take_held(target, plan: RefitPlan, touched: set[str]) -> None:
    """Right before the module changes: the modules the apply writes must still hash to what DCR
    recorded (``held_digests``, step 2), else nothing is applied; from here until the apply
    completes the module is unknown (the pipeline restores the record after a rollback)."""
    held = held_by(target)
    set_held(target, None)
    if held is None or held.get("step") != plan.current_step or not held_digests.unchanged(target, held["digests"], touched):
        raise StateMismatchError("the module was written outside DCR since this refit was planned; nothing was "
                                 "applied: receive again (it loads the step densely)")


def _roll_back(target, table, direct_masks, loaded, masks, mirror_bits, infos) -> None:
    """Return the module to its base bits after a failed apply: XOR the direct-path masks again
    and reload the overwrite-path tensors already loaded with their base values (new XOR mask)."""
    placement.xor_into_module(target, table, direct_masks)
    for n in loaded:
        old = np.bitwise_xor(mirror_bits[n], masks[n])
        target.load_weights([(n, _tensor(old, infos[n]))])


def probe_counts(target) -> dict:
    table = getattr(target, PROBE_ATTR, None)
    if table is None:
        return {}
    return {path: len(table.names(path)) for path in (placement.DIRECT, placement.OVERWRITE, placement.IGNORED)}
