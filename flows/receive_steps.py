"""The receiver's refit, as plain functions (the Prefect flow wraps each one as a task).

Order and why: plan (read and verify markers and manifests), then stream the refit tensor by
tensor into a temp file (held bits verified against the held step, chunks verified as they
arrive, every result verified against the target step) and only then atomically replace the state
file. A failure anywhere before the final rename leaves the state file exactly as it was.
``fetch_payloads`` (every payload of a plan, in memory) serves receivers that must have everything
fetched and verified before they touch their target (live modules); ``apply_payloads`` is the
in-memory refit that ``dcr verify`` replays.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from dcr_core.bits import bits_of
from dcr_core.chain import Direction, Move, plan_direct, plan_path
from dcr_core.delta import Encoding, apply_chunk
from dcr_core.dtypes import DTYPES
from dcr_core.errors import IntegrityError, InvalidCheckpointError, StateMismatchError, StepNotFoundError, UsageError
from flows.options import ReceiveOptions
from storage import layout
from storage.catalog import Catalog, utc_now
from storage.checkpoint import SafetensorsCheckpoint, StreamingSafetensorsWriter, TensorInfo
from storage.manifest import Manifest
from storage.root import Root
from storage.step_io import read_chunks, stream_chunks

STATE_STEP = "dcr.step"
STATE_POLICY = "dcr.policy_digest"
STATE_ROOT = "dcr.root"
STATE_HEADER_ROOM = 64  # header bytes kept free so an in-place patch can rewrite the metadata


@dataclass
class State:
    """Canonical tensors as raw bits (flat, writable), plus the step they are known to hold."""

    step: int | None
    dtypes: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    bits: dict[str, np.ndarray] = field(default_factory=dict)

@dataclass
class ReceivePlan:
    root_url: str
    storage_options: dict
    target_step: int
    current_step: int | None
    moves: list[Move]

    stored: dict[int, int] = field(default_factory=dict)
    manifests: dict[int, Manifest] = field(default_factory=dict)  # verified, for every step used


def resolve_target(root: Root, step: int | None, cat: Catalog | None = None) -> int:
    cat = cat or Catalog(root)
    if step is None:
        latest = cat.latest_committed()
        if latest is None:
            raise StepNotFoundError(f"{root.url}: no committed step")
        return latest
    layout.check_step(step)
    cat.require_marker(step)
    return step


def peek_state_step(path: str) -> int | None:
    """The step a receiver's state file claims (header only), or None if the file does not exist."""
    if not os.path.exists(path):
        return None
    from storage import state_journal

    from_step = state_journal.read_from_step(path)
    if from_step is not None:  # a cut-off in-place patch: the next receive rolls it back to this step
        return from_step
    raw = SafetensorsCheckpoint(path).metadata.get(STATE_STEP)
    if raw is None or not (raw.isascii() and raw.isdigit()):
        raise StateMismatchError(f"{path}: not a DCR receiver state (no {STATE_STEP} metadata); move it away")
    if int(raw) > layout.MAX_STEP:
        raise StateMismatchError(f"{path}: claims step {raw}, beyond any valid step")
    return int(raw)


def plan_receive(
    root_url: str, storage_options: dict, current: int | None, step: int | None, state_path: str | None = None
) -> ReceivePlan:
    """Resolve the target, plan the moves and read (and verify) every manifest they need."""
    root = Root(root_url, storage_options)
    cat = Catalog(root)
    target = resolve_target(root, step, cat)
    if current is not None and cat.marker(current) is None:
        raise StateMismatchError(
            f"{state_path or 'state'}: claims step {current}, which is not committed in {root.url}"
        )

    # Common case first: one step lies on the other's chain; read only the markers in between.
    moves = plan_direct(cat.step_info, current, target, cat.keyframe_cost(target))
    if moves is None:
        moves = plan_path(cat.chain_infos(target, current), current, target)
    infos = {m.step: cat.step_info(m.step) for m in moves}
    needed = {target} | {m.step for m in moves}
    if current is not None and (not moves or moves[0].direction is not Direction.KEYFRAME):
        needed.add(current)
    return ReceivePlan(
        root_url, storage_options, target, current, moves,
        {s: i.stored_bytes for s, i in infos.items()},
        {s: cat.manifest(s) for s in sorted(needed)},
    )


def move_entries(m: Manifest, move: Move) -> dict:
    """What a move reads from step ``m``: its restart entries for a keyframe move (a keyframe's
    tensors or a delta's snapshot), else its delta entries."""
    if move.direction is not Direction.KEYFRAME:
        return m.tensors
    entries = m.restart_entries()
    if entries is None:
        raise IntegrityError(f"step {m.step}: planned as a restart point, but it stores no full copy")
    return entries


@dataclass
class Fetched:
    """Verified payloads of every move of a plan, and what fetching them cost."""

    manifests: dict[int, Manifest]
    chunks: dict[int, dict[str, list[tuple[int, np.ndarray]]]]
    bytes_pulled: int
    seconds: float


def fetch_payloads(plan: ReceivePlan, options: ReceiveOptions | None = None) -> Fetched:
    options = options or ReceiveOptions()
    t0 = time.perf_counter()
    root = Root(plan.root_url, plan.storage_options)
    manifests = plan.manifests
    chunks = {}
    pulled = 0
    for move in plan.moves:
        m = manifests[move.step]
        entries = move_entries(m, move)
        chunks[move.step] = read_chunks(root, m, entries, workers=options.io_workers, entries=entries)
        pulled += sum(entries[n].stored_bytes for n in chunks[move.step])
    return Fetched(manifests, chunks, pulled, time.perf_counter() - t0)


def apply_payloads(plan: ReceivePlan, state: State | None, fetched: Fetched) -> State:
    """Apply every move to ``state`` (modified in place unless a keyframe replaces it) and verify."""
    for move in plan.moves:
        m = fetched.manifests[move.step]
        chunks = fetched.chunks[move.step]
        if move.direction is Direction.KEYFRAME:
            state = State(None)
            for name, e in m.tensors.items():
                state.dtypes[name], state.shapes[name] = e.dtype, e.shape
                state.bits[name] = np.zeros(math.prod(e.shape), dtype=DTYPES[e.dtype].storage)
        elif state is None or set(state.bits) != set(m.tensors):
            raise StateMismatchError(f"step {move.step}: the held tensors do not match its manifest")
        entries = move_entries(m, move)
        for name, items in chunks.items():
            e = entries[name]
            encoding = e.encoding
            if move.direction is Direction.BACKWARD and encoding is not Encoding.XOR:
                raise StateMismatchError(f"step {move.step}: tensor {name!r} ({encoding.value}) cannot be undone")
            grid = e.grid
            target = state.bits[name]
            for pos, (index, payload) in enumerate(items):
                apply_chunk(target, grid, index, payload, e.encoding_at(pos))
        state.step = m.base_step if move.direction is Direction.BACKWARD else m.step
    if state is None:
        raise UsageError("nothing to apply and no state held")
    target = fetched.manifests[plan.target_step]
    if state.step != plan.target_step:
        raise StateMismatchError(f"refit ended at step {state.step}, not {plan.target_step}")
    for name, e in target.tensors.items():
        if not e.matches(state.bits[name]):
            raise StateMismatchError(
                f"step {plan.target_step}: tensor {name!r} does not match its digest after apply; nothing written"
            )
    return state


def _check_schema(manifest: Manifest, infos: dict, where: str) -> None:
    if set(infos) != set(manifest.tensors):
        raise StateMismatchError(f"{where}: its tensor names differ from step {manifest.step}")
    for name, e in manifest.tensors.items():
        if (infos[name].dtype, infos[name].shape) != (e.dtype, e.shape):
            raise StateMismatchError(f"{where}: tensor {name!r} dtype/shape differ from step {manifest.step}")


def move_tables_of(plan: ReceivePlan) -> tuple[list[Manifest], list[dict]]:
    """The manifest of every move and the entries each move reads (see ``move_entries``)."""
    manifests = [plan.manifests[m.step] for m in plan.moves]
    return manifests, [move_entries(m, move) for m, move in zip(manifests, plan.moves)]


def chunk_jobs(names, manifests, tables):
    """Every stored chunk of every move, tensor by tensor in ``names`` order and move by move within
    a tensor: the order a streaming refit applies them in."""
    for name in names:
        for m, table in zip(manifests, tables):
            e = table[name]
            for pos in range(e.n_stored):
                yield m, e, pos


def _check_moves(plan: ReceivePlan) -> None:
    target = plan.manifests[plan.target_step]
    for move in plan.moves:
        if set(plan.manifests[move.step].tensors) != set(target.tensors):
            raise StateMismatchError(f"step {move.step}: its tensors differ from step {plan.target_step}")
        if move.direction is Direction.BACKWARD and not plan.manifests[move.step].invertible:
            raise StateMismatchError(f"step {move.step} cannot be undone (it holds overwrites)")


def refit_file(plan: ReceivePlan, state_path: str, options: ReceiveOptions | None = None) -> dict:
    """Stream the refit into a temp file beside ``state_path``; return its path and what it cost.

    Tensor by tensor: read the held bits (verified against the held step's digest), apply every
    move's chunks as they arrive (fetched ahead with a bounded window), verify against the target
    digest, append to the new file. Memory: one tensor plus the fetch window. The state file
    itself is not touched; ``replace_state`` moves the verified result into place.
    """
    options = options or ReceiveOptions()
    t0 = time.perf_counter()
    if options.in_place:
        from flows import patch_state

        if patch_state.eligible(plan, state_path):
            outcome = patch_state.refit_in_place(plan, state_path, options, _check_moves)
            if outcome is not None:
                return {**outcome, "seconds": time.perf_counter() - t0}
    root = Root(plan.root_url, plan.storage_options)
    target = plan.manifests[plan.target_step]
    from_keyframe = bool(plan.moves) and plan.moves[0].direction is Direction.KEYFRAME
    reader = None
    held = None
    if plan.current_step is not None and not from_keyframe:
        reader = SafetensorsCheckpoint(state_path)
        held = plan.manifests[plan.current_step]
        _check_schema(held, reader.infos, state_path)
    _check_moves(plan)
    names = sorted(target.tensors)
    manifests, move_tables = move_tables_of(plan)

    infos = [TensorInfo(n, target.tensors[n].dtype, target.tensors[n].shape) for n in names]
    meta = {STATE_STEP: str(plan.target_step), STATE_POLICY: target.policy_digest, STATE_ROOT: plan.root_url}
    writer = StreamingSafetensorsWriter(state_path, infos, meta, header_room=STATE_HEADER_ROOM)
    pulled = 0
    stack = contextlib.ExitStack()
    try:
        jobs = chunk_jobs(names, manifests, move_tables)
        stream = stack.enter_context(contextlib.closing(stream_chunks(root, jobs, workers=options.io_workers)))
        for name in names:
            e_target = target.tensors[name]
            if reader is not None:
                bits = bits_of(reader.tensor(name))
                if not held.tensors[name].matches(bits):
                    raise StateMismatchError(
                        f"{state_path}: tensor {name!r} is not the bits of step {held.step} (digest mismatch)"
                    )
            else:
                bits = np.zeros(math.prod(e_target.shape), dtype=DTYPES[e_target.dtype].storage)
            for table in move_tables:
                e = table[name]
                for pos in range(e.n_stored):
                    _, _, index, payload = next(stream)
                    apply_chunk(bits, e.grid, index, payload, e.encoding_at(pos))
                pulled += e.stored_bytes
            if not e_target.matches(bits):
                raise StateMismatchError(
                    f"step {plan.target_step}: tensor {name!r} does not match its digest after apply; nothing written"
                )
            writer.write(name, bits)
        if next(stream, None) is not None:
            raise StateMismatchError("more chunks fetched than applied")  # pragma: no cover - invariant
    except BaseException:
        writer.abort()
        raise
    finally:
        stack.close()  # stops the read-ahead pool on any exit
    return {"tmp_path": writer.tmp, "writer": writer, "bytes_pulled": pulled, "seconds": time.perf_counter() - t0}


def replace_state(outcome: dict) -> None:
    """Move the verified new state into place (fsync + atomic rename)."""
    outcome["writer"].commit()


def verify_state_file(plan: ReceivePlan, state_path: str) -> None:
    """Check, tensor by tensor, that the state file holds exactly the step it claims."""
    held = plan.manifests[plan.current_step]
    reader = SafetensorsCheckpoint(state_path)
    _check_schema(held, reader.infos, state_path)
    for name, e in held.tensors.items():
        if not e.matches(bits_of(reader.tensor(name))):
            raise StateMismatchError(
                f"{state_path}: tensor {name!r} is not the bits of step {held.step} (digest mismatch)"
            )


def record_commit(root_url: str, storage_options: dict, receiver_id: str, step: int, record: dict) -> None:
    Catalog(Root(root_url, storage_options)).record_receiver(
        step, receiver_id, {"committed_at": utc_now(), **record}
    )


def check_state_path(path: str) -> str:
    path = os.fspath(path)
    if os.path.isdir(path):
        raise InvalidCheckpointError(f"{path}: the receiver state must be a .safetensors file, not a directory")
    return path
