"""The shared reader: plan a refit from the commit markers, then stream, verify and apply payloads.

Receivers (state files, live modules), the publisher's baseline rebuild, ``dcr materialize`` and
``dcr verify`` all read ROOT through here. A ``RefitPlan`` is a reference: the steps it moves
through and the digest of each manifest it needs (``StepRef``); ``manifests`` loads them verified
(content-addressed, so a plan made in one process is checked again in another).

Order of a refit, tensor by tensor: held bits (verified against the held step's digest by the
caller, or zeros from a keyframe), every move's chunks applied as they arrive (each chunk checked
against its digest on arrival, fetched ahead with a bounded window), the result checked against
the target step's digest. Nothing unverified leaves this module. One qualification, for bundles
(``dcr_core.bundles``): a bundle is yielded once its own digest (and every chunk's) proves every
byte; its members' digests are checked beside the next tensors and the generator raises before its
loop ends if one is wrong (``MemberChecks``), so a caller that installs what it wrote only once its
loop is over, as every caller here does, never installs a member whose digest is wrong.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Container, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from dcr_core import events
from dcr_core.bundles import policy_infos
from dcr_core.chain import Direction, Move, plan_direct, plan_path
from dcr_core.delta import apply_chunk
from dcr_core.dtypes import DTYPES
from dcr_core.errors import IntegrityError, RootNotFoundError, StateMismatchError, StepNotFoundError, UsageError
from storage import layout
from storage.catalog import Catalog, not_committed, unpublished
from storage.chunk_io import IO_WORKERS, Payload, read_chunks, stored_positions, stream_chunks
from storage.manifest import Manifest, TensorEntry
from storage.root import Root, RootRef, open_root

log = logging.getLogger("dcr.receive")


@dataclass(frozen=True)
class StepRef:
    """A committed step by reference: its attempt and the digest of its manifest."""

    step: int
    attempt: str
    manifest_digest: str


@dataclass(frozen=True)
class RefitPlan:
    """How to go from ``current_step`` (None: nothing held) to ``target_step``."""

    root: RootRef
    target_step: int
    current_step: int | None
    moves: tuple[Move, ...]
    steps: dict[int, StepRef] = field(default_factory=dict)  # every step whose manifest is used
    stored: dict[int, int] = field(default_factory=dict)  # stored bytes of each move's step

    @property
    def from_keyframe(self) -> bool:
        return bool(self.moves) and self.moves[0].direction is Direction.KEYFRAME

    def describe(self) -> list[str]:
        return [f"{m.direction.value}:{m.step}" for m in self.moves]


def resolve_target(cat: Catalog, step: int | None) -> int:
    if step is None:
        latest = cat.latest_committed()
        if latest is None:
            raise not_committed(cat.root, "no committed step")
        return latest
    layout.check_step(step)
    cat.require_marker(step)
    retracted = cat.retraction(step)
    if retracted is not None:
        latest = cat.latest_committed()
        raise StepNotFoundError(f"{cat.root.url}: step {step} was retracted ({retracted.retracted_at}"
                                + (f": {retracted.reason}" if retracted.reason else "") + ")"
                                + (f"; the newest live step is {latest}" if latest is not None else "; no step is live"))
    return step


def plan_refit(root: Root, current: int | None, step: int | None, where: str = "state") -> RefitPlan:
    """Resolve the target, plan the cheapest exact moves and pin every manifest they need."""
    cat = Catalog(root)
    target = resolve_target(cat, step)
    return _plan(root, cat, held_or_restart(cat, current, where), target)


def plan_replay(root: Root, step: int) -> RefitPlan:
    """The plan that rebuilds committed ``step`` from nothing (its restart point, then deltas), a
    retracted step too: what ``dcr verify --deep`` replays. No receiver targets it this way."""
    cat = Catalog(root)
    cat.require_marker(step)
    return _plan(root, cat, None, step)


def _plan(root: Root, cat: Catalog, current: int | None, target: int) -> RefitPlan:
    """The cheapest exact moves from ``current`` to ``target``, every manifest they need pinned."""
    # Common case first: one step lies on the other's chain; read only the markers in between.
    moves = plan_direct(cat.step_info, current, target, cat.keyframe_cost(target))
    if moves is None:
        moves = plan_path(cat.chain_infos(target, current), current, target)
    needed = {target} | {m.step for m in moves}
    if current is not None and (not moves or moves[0].direction is not Direction.KEYFRAME):
        needed.add(current)
    refs = {}
    for s in sorted(needed):
        marker = cat.require_marker(s)
        cat.manifest(s)  # read and verified now: a plan names only manifests that check out
        refs[s] = StepRef(s, marker.attempt, marker.manifest_digest)
    return RefitPlan(root.ref, target, current, tuple(moves), refs,
                     {m.step: cat.step_info(m.step).stored_bytes for m in moves})


def held_or_restart(cat: Catalog, current: int | None, where: str) -> int | None:
    """The held step to plan from: ``current``, or None (restart from a restart point) when it is no
    longer committed (``dcr gc`` deleted it) while a newer step is. A held step newer than every
    committed step is refused: the ROOT was rolled back, and following it would silently take
    receivers back to older weights."""
    if current is None or cat.marker(current) is not None:
        return current
    latest = cat.latest_committed()
    if cat.retraction(current) is not None:  # retracted, then deleted by gc: its tombstone remains
        log.warning("%s holds step %d, which was retracted and then deleted by gc in %s; restarting from a "
                    "restart point, the state untouched until the new one is verified", where, current, cat.root.url)
        return None
    if latest is not None and current < latest:
        log.warning("%s holds step %d, which is no longer committed in %s (deleted by gc); restarting from a "
                    "restart point, the state untouched until the new one is verified", where, current, cat.root.url)
        return None
    missing = unpublished(cat.root)
    if missing is not None:
        raise RootNotFoundError(f"{missing} ({where} claims step {current} of it)")
    raise StateMismatchError(f"{where}: claims step {current}, which is not committed in {cat.root.url}"
                             + (f" (the latest committed step is {latest}: a ROOT rolled back?)" if latest is not None else ""))


def manifests(plan: RefitPlan, root: Root | None = None) -> dict[int, Manifest]:
    """The verified manifest of every step the plan uses (from the process cache when possible)."""
    cat = Catalog(root or open_root(plan.root))
    return {s: cat.manifest_at(ref.step, ref.attempt, ref.manifest_digest) for s, ref in plan.steps.items()}


def move_entries(m: Manifest, move: Move) -> dict[str, TensorEntry]:
    """What a move reads from step ``m``: its restart entries for a keyframe move (a keyframe's
    tensors or a delta's snapshot), else its delta entries."""
    if move.direction is not Direction.KEYFRAME:
        return m.tensors
    entries = m.restart_entries()
    if entries is None:
        raise IntegrityError(f"step {m.step}: planned as a restart point, but it stores no full copy")
    return entries


def move_tables(plan: RefitPlan, ms: dict[int, Manifest]) -> tuple[list[Manifest], list[dict[str, TensorEntry]]]:
    """The manifest of every move and the entries each move reads (see ``move_entries``)."""
    chosen = [ms[m.step] for m in plan.moves]
    return chosen, [move_entries(m, move) for m, move in zip(chosen, plan.moves)]


def move_forwards(plan: RefitPlan) -> list[bool]:
    """Per move, whether it applies its step forward (False: it undoes it, ``Direction.BACKWARD``)."""
    return [m.direction is not Direction.BACKWARD for m in plan.moves]


def chunk_jobs(names: Iterable[str], chosen: list[Manifest], tables: list[dict]):
    """Every stored chunk of every move, tensor by tensor in ``names`` order and move by move within
    a tensor: the order a streaming refit applies them in."""
    for name in names:
        for m, table in zip(chosen, tables):
            e = table[name]
            for pos in range(e.n_stored):
                yield m, e, pos


def check_moves(plan: RefitPlan, ms: dict[int, Manifest]) -> None:
    """Every move covers the target's tensors, and a backward move can be undone."""
    target = ms[plan.target_step]
    for move in plan.moves:
        if set(ms[move.step].tensors) != set(target.tensors):
            raise StateMismatchError(f"step {move.step}: its tensors differ from step {plan.target_step}")
        if move.direction is Direction.BACKWARD and not ms[move.step].invertible:
            raise StateMismatchError(f"step {move.step} cannot be undone (it holds overwrites)")


def state_infos(m: Manifest) -> dict:
    """The tensors a receiver holds at step ``m`` (bundles' members by name), in the order its state
    file lays them out: stored-name order, each bundle's members back to back in bundle order."""
    return policy_infos({n: e.info for n, e in m.tensors.items()}, m.bundles())


def check_schema(manifest: Manifest, infos: dict, where: str) -> None:
    """The held tensors (``infos``: name -> TensorInfo) have the step's names, dtypes and shapes."""
    if set(infos) != set(manifest.tensors):
        raise StateMismatchError(f"{where}: its tensor names differ from step {manifest.step}")
    for name, e in manifest.tensors.items():
        if (infos[name].dtype, infos[name].shape) != (e.dtype, e.shape):
            raise StateMismatchError(f"{where}: tensor {name!r} dtype/shape differ from step {manifest.step}")


def held_mismatch(where: str, name: str, step: int) -> StateMismatchError:
    return StateMismatchError(f"{where}: tensor {name!r} is not the bits of step {step} (digest mismatch)")


class MemberChecks:
    """Bundles' member digests, checked on a thread beside the next tensors (``refit_tensors``).

    A bundle's bits are proved by its chunks' digests and its own (every byte) before it is yielded;
    its members' digests (what the policy digest covers) are hashed here meanwhile: one BLAKE3 call
    per member, which overlaps the consumer writing the bundle and the reader reading the next one.
    ``finish`` waits for them and raises ``StateMismatchError`` naming the first wrong member, before
    the last yield returns to the consumer's loop: every consumer installs what it wrote only after
    that loop ends, so nothing whose members are wrong is ever installed. At most two bundles wait
    (their bits are held until checked: bounded memory)."""

    DEPTH = 2

    def __init__(self, step: int):
        self.step = step
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque = deque()

    def submit(self, entry: TensorEntry, bits: np.ndarray) -> None:
        """Check the members of ``entry`` (a bundle; any other tensor has none to check)."""
        if entry.members is None:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dcr-members")
        while len(self._pending) >= self.DEPTH:
            self._wait(*self._pending.popleft())
        self._pending.append((entry, self._pool.submit(entry.members.check, bits, entry.scheme)))

    def _wait(self, entry: TensorEntry, future) -> None:
        wrong = future.result()
        if wrong is not None:
            raise StateMismatchError(f"step {self.step}: tensor {wrong!r} (in {entry.name!r}) does not match its "
                                     "digest after apply; nothing written")

    def finish(self) -> None:
        while self._pending:
            self._wait(*self._pending.popleft())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def result_mismatch(step: int, name: str) -> StateMismatchError:
    return StateMismatchError(f"step {step}: tensor {name!r} does not match its digest after apply; nothing written")


def refit_tensors(
    root: Root, plan: RefitPlan, ms: dict[int, Manifest], held: Callable[[str], np.ndarray] | None,
    workers: int = IO_WORKERS, where: str = "state", names: Iterable[str] | None = None,
) -> Iterator[tuple[str, np.ndarray, int]]:
    """Yield ``(name, bits, bytes pulled)`` of every target tensor (or of ``names`` only: a mapped
    task's group), in name order, verified.

    ``held(name)`` gives the held bits of a tensor (a private, writable copy) unless the plan starts
    from a keyframe; they are checked against the held step's digest before anything is applied.
    Memory: one tensor plus the fetch window."""
    target = ms[plan.target_step]
    check_moves(plan, ms)
    names = sorted(target.tensors if names is None else names)
    chosen, tables = move_tables(plan, ms)
    forwards = move_forwards(plan)
    held_m = None if plan.from_keyframe or plan.current_step is None else ms[plan.current_step]
    if held_m is not None and held is None:
        raise UsageError("a refit from a held step needs the held bits")
    stream = stream_chunks(root, chunk_jobs(names, chosen, tables), workers=workers)
    members = MemberChecks(plan.target_step)
    try:
        for name in names:
            e_target = target.tensors[name]
            if held_m is not None and held is not None:  # (a held step without its bits is refused above)
                bits = held(name)
                if not held_m.tensors[name].matches(bits, members=False):
                    raise held_mismatch(where, name, held_m.step)
            else:
                bits = np.zeros(math.prod(e_target.shape), dtype=DTYPES[e_target.dtype].storage)
            pulled = 0
            for table, forward in zip(tables, forwards):
                e = table[name]
                for pos in range(e.n_stored):
                    _, _, index, payload = next(stream)
                    apply_chunk(bits, e.grid, index, payload, e.encoding_at(pos), forward)
                pulled += e.stored_bytes
            if not e_target.matches(bits, members=False):
                raise result_mismatch(plan.target_step, name)
            members.submit(e_target, bits)
            events.reached("tensor.done", name=name, nbytes=bits.nbytes)
            yield name, bits, pulled
        if next(stream, None) is not None:
            raise StateMismatchError("more chunks fetched than applied")  # pragma: no cover - invariant
        members.finish()
    finally:
        stream.close()  # stops the read-ahead pool on any exit
        members.close()


@dataclass
class Fetched:
    """Verified payloads of every move of a plan, and what fetching them cost."""

    chunks: dict[int, dict[str, list[tuple[int, Payload]]]]
    bytes_pulled: int
    seconds: float


def fetch_payloads(root: Root, plan: RefitPlan, ms: dict[int, Manifest], workers: int = IO_WORKERS,
                   wanted: Callable[[TensorEntry], Container[int] | None] | None = None) -> Fetched:
    """Every payload of every move, verified, in memory: for receivers that must have everything
    before they touch their target (live modules). ``wanted(entry)``: the chunk indices of a
    tensor the receiver reads (None: all); the others are not fetched (their payloads: zeros)."""
    t0 = time.perf_counter()
    chunks, pulled = {}, 0
    for move in plan.moves:
        m = ms[move.step]
        entries = move_entries(m, move)
        positions = {n: stored_positions(e, None if wanted is None else wanted(e)) for n, e in entries.items()}
        chunks[move.step] = read_chunks(root, m, entries, workers=workers, positions=positions)
        pulled += sum(entries[n].stored_nbytes[p] for n in chunks[move.step] for p in positions[n])
    return Fetched(chunks, pulled, time.perf_counter() - t0)
