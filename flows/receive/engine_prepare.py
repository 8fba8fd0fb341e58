"""Phase 1 of an engine refit, while the engine serves: what the worker holds, the next step
staged beside it, and what the pause will reload or patch. Nothing in the engine changes. Any
engine: it is reached through its ``EngineModel`` (``flows.receive.engine_model``).

``begin`` runs in the calling thread (the engine's: it runs the engine's kernels, never beside a
forward pass): it locks the worker's *mirror* (a DCR state file holding the canonical checkpoint of
the step the engine serves, one per ROOT and receiver) and reads back every module's kernel and
stamps (``held_digests``), which completes the last apply's record (its kernels' digests, left
``Pending`` by the pause: ``complete_record``); ``digest``, at the start of ``stage`` (which may run
in a thread, beside forward passes: it only reads), hashes every module of the engine with those
read-backs (step 1) and decides whether DCR knows the engine: its digests are those recorded after
DCR's last apply (``EngineState.held``) and the mirror holds that step. ``stage`` only reads the bucket and the
mirror (it may run in a thread): plan from the mirror's step, lease the steps read, stage the next
mirror (only the changed chunks pulled, every tensor verified against the step's digest), and, for
a known engine, split the changed tensors into those patched in place (``param_patch``: their
changed elements found now) and the layers reloaded whole (``layer_probe``), and name every module
the apply may change (``Prepared.touched``: hashed again after the pause, see ``engine_apply``).

Bundled steps (manifest schema 4, ``dcr_core.bundles``): the mirror holds a bundle's members by
name, as the engine's loader knows them, so everything after the staging works on members: the
layer map and its schema are the policy's tensors (``reader.state_infos``), a changed bundle is the
members whose digests changed (``changed_names``), and a member is patched in place or reloaded
from the mirror like any tensor (both read the mirrors by name).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dcr_core.bits import tensor_from_bits
from dcr_core.chain import Direction
from dcr_core.dtypes import DTYPES
from flows.options import ReceiveOptions
from flows.receive import held_digests, layer_probe, param_patch, state_file
from flows.receive.engine_model import EngineModel, EngineState
from flows.receive.module import default_mirror_path
from flows.receive.pipeline import Leases
from flows.receive.records import ReceiverCommit, WorkerPrepared
from storage import reader
from storage.local import journal, objects, state
from storage.local.safetensors import SafetensorsCheckpoint
from storage.manifest import Manifest
from storage.reader import RefitPlan
from storage.root import RootRef


@dataclass
class Begun:
    ref: RootRef
    receiver_id: str
    mirror: str
    digests: dict[str, str]  # the engine's module digests, when prepared
    known: bool
    layer_map: layer_probe.LayerMap | None
    patchable: dict[str, str]  # names that can be patched in place (param_patch.candidates)
    lock: contextlib.ExitStack = field(repr=False)
    stamps: dict[str, str] = field(default_factory=dict)  # the engine's module stamps, when prepared
    probes: dict | None = field(default=None, repr=False)  # its kernels' read-backs, until ``digest``
    expected: dict[str, str] | None = field(default=None, repr=False)  # the digests DCR recorded, if plausible


@dataclass
class Prepared:
    ref: RootRef
    receiver_id: str
    mirror: str
    plan: RefitPlan
    staged: state_file.Staged | None
    reload: list[str] | None  # None: every tensor
    layers: set[str] | None  # the layers those feed (None: all)
    patches: list[param_patch.Patch]  # changed elements written in place, not reloaded
    touched: set[str] | None  # the modules the apply may change (None: all): re-hashed for the record
    changed: int
    known: bool
    digests: dict[str, str]  # the engine's module digests, when prepared
    leases: Leases
    fetch_seconds: float
    lock: contextlib.ExitStack = field(repr=False)
    stamps: dict[str, str] = field(default_factory=dict)  # the engine's module stamps, when prepared
    record: ReceiverCommit | None = None  # the receiver's commit record, once applied
    settle: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)  # after the pause
    after: Callable[[], float] | None = field(default=None, repr=False)  # engine_apply.settle, once applied

    @property
    def mode(self) -> str:
        if not self.plan.moves and self.known:
            return "current"
        return "delta" if self.known and self.reload is not None else "full"


def receiver_of(engine: EngineModel, receiver_id: str) -> str:
    """With tensor parallelism each rank is its own receiver (``<id>-rank<r>``), with its own mirror."""
    return receiver_id if engine.ranks == 1 else f"{receiver_id}-rank{engine.rank}"


def begin(engine: EngineModel, known_state: EngineState, ref: RootRef, receiver_id: str,
          state_path: str | None) -> Begun:
    """Lock the mirror and read what only the engine's own thread may (its kernels' read-backs, and
    the stamps); ``digest`` then hashes the rest and says whether DCR knows the engine (see the
    module docstring)."""
    rid = receiver_of(engine, receiver_id)
    mirror = state_file.check_path(
        f"{state_path}.rank{engine.rank}" if state_path and rid != receiver_id else state_path
        or default_mirror_path(ref.url, rid))
    lock = contextlib.ExitStack()
    lock.enter_context(state.exclusive(mirror))  # one refit per mirror; held until applied or aborted
    try:
        journal.settle(mirror)  # a mirror is never patched in place; a foreign journal is settled
        probes = held_digests.probes_of(engine.model)  # kernels run in the engine's thread only
        stamps = held_digests.stamps_of(engine.model)  # what the pause compares (held_digests)
        complete_record(known_state, engine.model, probes)  # the last apply's kernels, read back now
        held = known_state.held
        plausible = bool(held) and held["root"] == ref.url and held["mirror"] == mirror \
            and held["digests"] is not None and state.peek_step(mirror) == held["step"]
        layer_map, patchable = None, {}
        if plausible:
            with SafetensorsCheckpoint(mirror) as ck:
                schema = tuple(sorted((n, i.dtype, tuple(i.shape)) for n, i in ck.infos.items()))
            layer_map, patchable = _layer_map(engine, known_state, schema)
        return Begun(ref, rid, mirror, {}, False, layer_map, patchable, lock, stamps, probes,
                     dict(held["digests"]) if plausible else None)
    except BaseException:
        lock.close()
        raise


def complete_record(known: EngineState, model, probes: dict | None = None) -> None:
    """In the engine's own thread, after the last apply settled: read the kernel part of every
    ``Pending`` digest of ``known.held`` (``probes``: the kernels' outputs, already read), so that
    the record is whole again (its fingerprint set). A module that no longer computes through the
    kernel the pause left gets a digest no module has: the engine is unknown to the next prepare."""
    held = known.held
    if held is None or not held_digests.pending(held.get("digests")):
        return
    digests = held_digests.resolve(model, held["digests"], probes)
    held.update(digests=digests, fingerprint=held_digests.combine(digests))


def digest(engine: EngineModel, b: Begun) -> None:
    """Step 1 of the check (``held_digests``): every module's digest, with the kernels' read-backs
    ``begin`` took; DCR knows the engine when they are the digests it recorded after its last apply.
    Reads only, no kernel: it may run beside the engine's forward passes (a background prepare's
    thread), so the engine's own thread pays only for the read-backs."""
    if b.probes is None:
        return
    b.digests = held_digests.digests_of(engine.model, probes=b.probes)
    b.known = b.expected is not None and b.digests == b.expected
    b.probes = None


def stage(engine: EngineModel, b: Begun, step: int | None, opts: ReceiveOptions) -> Prepared:
    """Plan, lease, stage the next mirror (verified), and choose what to reload and patch."""
    leases = Leases(b.ref, b.receiver_id, opts.lease_seconds)  # released after the apply (or an abort)
    t0 = time.perf_counter()
    try:
        digest(engine, b)
        def staged_for(p: RefitPlan):
            if not p.moves:
                return None
            leases.take(p)
            return state_file.stage_refit(p, b.mirror, opts)

        plan, staged = leases.replanned(lambda: state_file.plan_receive(b.ref, b.mirror, step), staged_for, b.mirror)
        target = reader.manifests(plan)[plan.target_step]
        if staged is None and not b.known:  # the engine is reloaded from the mirror as it is: check it
            state_file.verify_held_state(plan, b.mirror)
        changed = changed_names(plan)
        reload = layers = touched = None
        patches: list[param_patch.Patch] = []
        schema = tuple(sorted((n, i.dtype, tuple(i.shape)) for n, i in reader.state_infos(target).items()))
        if b.known and b.layer_map is not None and b.layer_map.schema == schema:
            patch, reload = param_patch.split(changed, b.patchable, b.layer_map)
            if patch:
                patches = _patches(engine.model, b, staged, patch)
                if patches is None:  # a parameter's bytes are not the checkpoint's: reload its layer
                    patches, reload = [], b.layer_map.reload_set(changed)
            if reload is not None:
                layers = b.layer_map.layers_of(reload)
                touched = _touched(engine.model, layers, patches)
        if staged is not None and not staged.in_place and staged.exact is None:
            # The old mirror is read again only by a failed apply's roll-back: its pages leave the
            # page cache now, while the engine serves, not after the pause. Two copies of the
            # checkpoint cached at once left the pause's reload (whose allocations churn about three
            # times the model's size) short of free memory, reclaiming beside it (docs/vllm.md).
            objects.drop_cached(b.mirror)
        return Prepared(b.ref, b.receiver_id, b.mirror, plan, staged, reload, layers, patches, touched,
                        len(changed), b.known, b.digests, leases, time.perf_counter() - t0, b.lock, b.stamps)
    except BaseException:
        leases.release()
        b.lock.close()
        raise


def release(p: Prepared) -> None:
    """Drop what a prepared refit holds: its staged mirror (if not installed), its leases, the lock."""
    try:
        p.settle.close()
        if p.staged is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p.staged.path)
        p.leases.release()
    finally:
        p.lock.close()


def summary(p: Prepared) -> WorkerPrepared:
    return WorkerPrepared(receiver=p.receiver_id, from_step=p.plan.current_step, to_step=p.plan.target_step,
                          mode=p.mode, moves=p.plan.describe(), changed_tensors=p.changed,
                          bytes_pulled=p.staged.bytes_pulled if p.staged else 0, fetch_seconds=p.fetch_seconds,
                          policy_digest=reader.manifests(p.plan)[p.plan.target_step].policy_digest)


def changed_names(plan: RefitPlan) -> list[str]:
    """The policy tensors (bundles' members by name, as the mirror and the engine hold them) whose
    bits the refit may change. A plan through a keyframe rebuilds the mirror whole: every tensor (a
    keyframe stores no chunk of an all-zero tensor, so its stored names are not enough). Otherwise
    every tensor a move stores chunks of; of a bundle a move stores chunks of, the members whose
    digests differ between the held and the target step (``changed_members``): a bundle holds many
    small tensors, and reloading all of them for one changed member would cost the pause the layers
    of every one."""
    ms = reader.manifests(plan)
    target = ms[plan.target_step]
    if any(m.direction is Direction.KEYFRAME for m in plan.moves):
        return sorted(reader.state_infos(target))
    out: set[str] = set()
    members: set[str] = set()
    for move in plan.moves:
        for n, e in ms[move.step].tensors.items():
            if e.n_stored and e.members is None:
                out.add(n)
            elif e.n_stored:
                members.update(e.members.names)
    if members:
        out.update(changed_members(ms[plan.current_step], target, members))
    return sorted(out)


def changed_members(held: Manifest, target: Manifest, names: set[str]) -> list[str]:
    """Of bundles' members ``names``, those whose digest at ``target`` is not the one at ``held``
    (all of them when the two steps digest in different schemes: their digests cannot be compared).
    Exact: the staged mirror's members are checked against the target's digests, and a known
    engine's mirror holds the held step."""
    if held.digest_scheme != target.digest_scheme:
        return sorted(names)
    was = {n: d for n, _, _, d in held.policy_entries()}
    now = {n: d for n, _, _, d in target.policy_entries()}
    return sorted(n for n in names if was.get(n) is None or was[n] != now.get(n))


def _layer_map(engine: EngineModel, known_state: EngineState, schema: tuple) -> tuple[layer_probe.LayerMap, dict[str, str]]:
    """The layer map for ``schema`` and the names patchable in place (probed once per schema and
    kept in the worker's ``EngineState``)."""
    cached = known_state.layers
    if cached is None or cached[0].schema != schema:
        layer_map = layer_probe.probe_layers(engine.model, schema)
        cached = (layer_map, param_patch.candidates(engine.model, layer_map))
        known_state.layers = cached
    return cached


def _patches(model, b: Begun, staged, names: list[str]) -> list[param_patch.Patch] | None:
    """The in-place patches of ``names``: the held step's bits from the mirror, the target's from
    the staged mirror (reads the model; writes nothing)."""
    def reader_of(ck: SafetensorsCheckpoint):
        return lambda n: tensor_from_bits(ck.bits(n), DTYPES[ck.infos[n].dtype], tuple(ck.infos[n].shape))

    with SafetensorsCheckpoint(b.mirror) as held, SafetensorsCheckpoint(staged.path) as target:
        return param_patch.prepare(model, b.patchable, names, reader_of(held), reader_of(target))


def _touched(model, layers: set[str], patches: list[param_patch.Patch]) -> set[str]:
    """Every module an apply reloading ``layers`` and writing ``patches`` may change: the layers
    and their submodules, modules tied to them (``vllm_fixups.after_reload`` processes those) and
    the patched modules."""
    out = {pt.module for pt in patches} | {name for name, _ in layer_probe.tied_followers(model, layers)}
    for name, _ in model.named_modules():
        parts = name.split(".")
        if any(".".join(parts[:i]) in layers for i in range(1, len(parts) + 1)):
            out.add(name)
    return out
