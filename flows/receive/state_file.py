"""A receiver's state file, step by step: plan, stage the refit beside the file, install it, record.

Order and why: plan (read and verify markers and manifests), then stage the refit next to the
state file without touching it (a whole new file, or the journal of an in-place patch: see
``flows.receive.in_place``), and only then install it (an atomic rename, or the journal put in
force and the patch written). A failure anywhere before the install leaves the state file exactly
as it was; a staged file left by a crash is removed by the next receive (the state's lock). Every
step passes references (the plan, the staged file's path), so each can run as its own task.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

from dcr_core import events
from dcr_core.digest import block_leaves, blocks_root
from dcr_core.errors import StateMismatchError, StepVanishedError
from flows.options import ReceiveOptions
from flows.receive import exact as exact_files
from flows.receive import in_place
from flows.receive.records import ReceiverCommit
from storage import layout, leases, reader
from storage.catalog import Catalog, unpublished, utc_now
from storage.local import bundled, journal, materialized, sidecar, state
from storage.local.objects import fsync_dir
from storage.local.safetensors import SafetensorsCheckpoint, StreamingSafetensorsWriter, install
from storage.reader import RefitPlan
from storage.root import RootRef, open_root, same_root

log = logging.getLogger("dcr.receive")


@dataclass(frozen=True)
class Staged:
    """A refit ready to install: a finished new state file, or a staged journal (in place)."""

    state_path: str
    path: str  # the new file, or the staged journal
    in_place: bool
    bytes_pulled: int
    journal_bytes: int = 0
    sidecar: str | None = None  # in place: the staged block digests of the new state
    # An exact materialization (``flows.receive.exact``): "file" or "directory", its staged files
    # (temp file, destination) in install order, and what its record says (step, policy, ROOT).
    exact: str | None = None
    moves: tuple[tuple[str, str], ...] = ()
    about: dict | None = None


def plan_receive(root: RootRef, state_path: str, step: int | None, fresh: bool = False) -> RefitPlan:
    """Plan bringing the state file (its claimed step; nothing with ``fresh``) to ``step``."""
    r = open_root(root)
    current = None
    if not fresh:
        origin = state.peek_origin(state_path)  # None: no file, or a pending patch (settling it decides)
        if origin is not None:
            check_origin(Catalog(r), state_path, origin)
        current = origin[0] if origin is not None else state.peek_step(state_path)
    plan = reader.plan_refit(r, current, step, where=state_path)
    events.reached("receive.planned", target=plan.target_step, moves=len(plan.moves))
    if plan.moves and events.listened():  # a progress bar's total
        target = reader.manifests(plan, r)[plan.target_step]
        events.reached("work.planned", what="refit", nbytes=sum(e.nbytes for e in target.tensors.values()))
    return plan


def check_origin(cat: Catalog, state_path: str, origin: tuple[int, str | None, str | None]) -> None:
    """Refuse, naming both, a state file written from another ROOT whose steps this ROOT does not hold
    (the same weights under another URL, a mirror, pass). ``origin``: what the file's header records
    (``storage.local.state.peek_origin``)."""
    held, policy, origin_root = origin
    if origin_root is None or same_root(origin_root, cat.root.url):
        return  # this ROOT's own state: the held-state checks judge it
    marker = cat.marker(held)
    if marker is not None and marker.policy_digest == policy:
        return
    missing = unpublished(cat.root) if marker is None else None
    if missing is not None:
        raise missing
    what = f"which has no committed step {held}" if marker is None else (
        f"whose step {held} holds other weights (policy digest {marker.policy_digest[:16]}, the file's {str(policy)[:16]})")
    raise StateMismatchError(f"{state_path}: holds step {held} of {origin_root}, not of {cat.root.url}, {what}; "
                             "move it away or give another --state")


def take_leases(root: RootRef, receiver_id: str, plan: RefitPlan, ttl: float) -> list[int]:
    """Lease every step the plan reads (``storage.leases``), then check each is still committed: a
    gc that planned before the leases existed may have deleted one (``StepVanishedError``: plan again).
    A plan with no move reads no stored chunk (the held state is checked against a manifest already
    read): it leases nothing, so a receiver polling an idle ROOT writes nothing."""
    if not plan.moves:
        return []
    r = open_root(root)
    steps = sorted(plan.steps)
    if r.backend.local:  # a link in place of receivers/ fails now, not after the refit (stores have no links)
        r.exists(layout.receiver_key(plan.target_step, receiver_id))
    try:
        leases.take(r, receiver_id, steps, plan.target_step, ttl)
        cat = Catalog(r)
        for s in steps:
            if cat.marker(s) is None:
                raise StepVanishedError(f"{r.url}: step {s} was deleted while this refit was planned (gc); planning again")
    except BaseException:  # nothing leased is left behind, whatever failed
        leases.release(r, receiver_id, steps)
        raise
    events.reached("receive.leased", steps=steps)
    return steps


def release_leases(root: RootRef, receiver_id: str, steps: list[int]) -> None:
    leases.release(open_root(root), receiver_id, steps)


def vanished(plan: RefitPlan) -> list[int]:
    """The steps of ``plan`` that are no longer committed (a gc ran meanwhile)."""
    cat = Catalog(open_root(plan.root))
    return [s for s in sorted(plan.steps) if cat.marker(s) is None]


def stage_refit(plan: RefitPlan, state_path: str, options: ReceiveOptions | None = None,
                exact: str | None = None) -> Staged:
    """Stage the refit beside ``state_path`` (the file is not touched): an in-place patch when
    asked for and possible (``flows.receive.in_place.eligible``), else a whole new file; with
    ``exact`` (a materialization: "file" or "directory"), the published files byte for byte."""
    options = options or ReceiveOptions()
    if exact is not None:
        moves, pulled = exact_files.stage(plan, state_path, options, exact)
        events.reached("receive.staged", path=moves[0][0])
        return Staged(state_path, moves[0][0], False, pulled, exact=exact, moves=moves, about=exact_files.about(plan))
    if options.in_place and in_place.eligible(plan, state_path):
        patch = in_place.stage_patch(plan, state_path, options)
        if patch is not None:
            events.reached("receive.staged", path=patch.journal)
            return Staged(state_path, patch.journal, True, patch.bytes_pulled, patch.journal_bytes, patch.sidecar)
    return stage_rewrite(plan, state_path, options)


def stage_rewrite(plan: RefitPlan, state_path: str, options: ReceiveOptions) -> Staged:
    """Stream the refit into a new file beside ``state_path``: held bits read (and verified against
    the held step) tensor by tensor, chunks applied as they arrive, every result verified against
    the target step, appended. Memory: one tensor plus the fetch window."""
    root = open_root(plan.root)
    ms = reader.manifests(plan, root)
    target = ms[plan.target_step]
    held = None
    if plan.current_step is not None and not plan.from_keyframe:
        held = SafetensorsCheckpoint(state_path)
        try:  # held by name; bundles read as the step stores them (one read each where laid out so)
            held = bundled.view(held, ms[plan.current_step].bundles())
            reader.check_schema(ms[plan.current_step], held.infos, state_path)
        except BaseException:
            held.close()
            raise
    meta = state.metadata(plan.target_step, target.policy_digest, plan.root.url)
    pulled = 0
    try:
        writer = StreamingSafetensorsWriter(state_path, list(reader.state_infos(target).values()), meta,
                                            header_room=state.HEADER_ROOM)
    except BaseException:
        if held is not None:
            held.close()
        raise
    try:
        for name, bits, n in reader.refit_tensors(root, plan, ms, None if held is None else held.bits,
                                                  options.io_workers, state_path):
            bundled.write_stored(writer, target.tensors[name], bits)
            pulled += n
            events.reached("receive.tensor-staged", name=name)
        tmp = writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        if held is not None:
            held.close()
    events.reached("receive.staged", path=tmp)
    return Staged(state_path, tmp, False, pulled)


def install_state(staged: Staged, later: contextlib.ExitStack | None = None) -> None:
    """Make the staged refit the state: rename the new file over it, or put the journal in force,
    patch the file (page cache) and commit the patch (the journal becomes a redo journal; the file's
    fsync is left to the kernel's writeback and the next ``journal.settle``). A crash before the
    commit is rolled back by the next receive, one after it rolled forward. ``later`` (a rename:
    an engine's pause window): the directory's sync and the freeing of the old file's pages (the
    kernel frees them when its last reference goes: milliseconds per hundred MB) are left to it,
    closed after the pause and before anything is recorded."""
    if staged.exact is not None:
        materialized.install_all(staged.state_path, staged.exact, staged.moves, staged.about or {})
        events.reached("receive.replaced", path=staged.state_path)
        return
    if not staged.in_place and later is not None:
        with contextlib.suppress(FileNotFoundError):
            later.enter_context(open(staged.state_path, "rb"))  # the old file lives on until then
        install(staged.path, staged.state_path, durable=False)
        later.callback(fsync_dir, os.path.dirname(os.path.abspath(staged.state_path)))
        materialized.remove_record(staged.state_path)
        events.reached("receive.replaced", path=staged.state_path)
        return
    if not staged.in_place:
        install(staged.path, staged.state_path)
        materialized.remove_record(staged.state_path)  # a materialization's record no longer describes it
        events.reached("receive.replaced", path=staged.state_path)
        return
    patch = journal.take_staged(staged.path)  # staged by this process: applied without reading it back
    journal.activate(staged.state_path, staged.path)
    patch = patch or journal.read(staged.state_path)
    try:
        journal.put(staged.state_path, patch, "new", durable=False)
    except BaseException:
        try:  # at once if possible; the next receive rolls back anyway
            journal.roll_back(staged.state_path)
        except Exception as undo:  # noqa: BLE001 - the original error is the one to report
            log.warning("%s: roll back after a failed patch failed too (%s); the next receive rolls it back",
                        staged.state_path, undo)
        raise
    events.reached("receive.patch-written", path=staged.state_path)
    if staged.sidecar is not None:  # stamped with the patched file; a crash before the commit rolls back (new stamp)
        sidecar.install(staged.state_path, staged.sidecar)
        events.reached("receive.blocks-written", path=staged.state_path)
    journal.commit(staged.state_path)
    events.reached("receive.patched", path=staged.state_path)


def verify_held_state(plan: RefitPlan, state_path: str) -> None:
    """Check, tensor by tensor, that the state file holds exactly the step it claims; with block
    digests kept beside it and trusted (``in_place.trusted_sidecar``: its stamp and a sample of
    blocks), only those checks run: a receiver polling an idle ROOT does not re-hash its state.
    Otherwise every block is hashed, and the digests are kept for the next time."""
    held = reader.manifests(plan)[plan.current_step]
    ck = bundled.view(SafetensorsCheckpoint(state_path), held.bundles())
    try:
        reader.check_schema(held, ck.infos, state_path)
        block = in_place.blocked(held)
        if block and in_place.trusted_sidecar(state_path, held, ck, block) is not None:
            events.reached("receive.blocks-hashed", blocks=0, trusted=True)
            return
        leaves = {}
        for name, e in held.tensors.items():
            if block:  # a bundle's members too: block digests are kept only for a state whose members were proved
                bits = ck.mapped_bits(name)
                leaves[name] = block_leaves(bits, block)
                ok = blocks_root(block, leaves[name]) == e.digest and in_place.members_hold(e, bits)
            else:
                ok = e.matches(ck.bits(name))
            if not ok:
                raise reader.held_mismatch(state_path, name, held.step)
    finally:
        ck.close()
    if block:
        sidecar.keep(state_path, sidecar.Sidecar(held.step, held.policy_digest, block, leaves))
        events.reached("receive.blocks-hashed", blocks=sum(x.shape[0] for x in leaves.values()), trusted=False)


def record_receiver_commit(root: RootRef, receiver_id: str, step: int, record: ReceiverCommit) -> bool:
    """Record the receiver's commit of ``step`` (any receiver kind's: ``records.ReceiverCommit``)
    and its position; True if written. A refit that moved nothing writes nothing when the
    receiver's position already says this step (a scheduled receiver polling an idle ROOT costs
    one GET, not a PUT, and keeps what its last refit did)."""
    cat = Catalog(open_root(root))
    written = False
    if record.moves or not _already_recorded(_position(cat, receiver_id), step, record.policy_digest):
        cat.record_receiver(step, receiver_id, {"committed_at": utc_now(), **record.document()})
        written = True
    events.reached("receive.recorded", step=step, receiver=receiver_id)
    return written


def _position(cat: Catalog, receiver_id: str) -> dict | None:
    """The receiver's position, or None when it cannot be read (a role allowed to write it but not to
    read it back: the commit is then simply recorded again)."""
    try:
        return cat.position(receiver_id)
    except Exception as e:  # noqa: BLE001 - any failure only costs one more PUT
        log.info("%s: cannot read receiver %s's position (%s); recording the commit", cat.root.url, receiver_id, e)
        return None


def _already_recorded(position: dict | None, step: int, policy: str | None) -> bool:
    return position is not None and position.get("step") == step and position.get("policy_digest") == policy


def check_path(path) -> str:
    return state.check_path(os.fspath(path))
