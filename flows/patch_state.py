"""Refit a receiver's state file in place (``ReceiveOptions(in_place=True)``, ``dcr receive --in-place``).

The default refit (``receive_steps.refit_file``) writes a whole new state file and renames it
over the old one: a reader that has the file open keeps a consistent old copy, but every refit
reads the whole state and writes and fsyncs a second copy. In place, only the changed elements are
written into the file (the page cache still writes back every page they dirty: with changes
scattered at 1% or more that is nearly every 4 KiB page, so the disk writes about the file once
either way; what is saved is the full read and the second copy):

1. *Compute* (the file is not touched), tensor by tensor, with chunks fetched and verified as they
   arrive. One XOR delta (the common case): the changed positions are the masks' non-zero
   elements, old values are read from the memory-mapped file, and the new tensor (held bits
   between stored chunks, held XOR mask within them) is hashed as it streams by: no copy of the
   tensor. Otherwise (several moves, overwrites, shared parts, piecewise digests): the held bits
   are copied into a scratch buffer, every chunk applied, and the elements that differ kept. Either
   way the result is checked against the target step's digest, and a tensor no move touches is
   checked in place. Every tensor is hashed once: for XOR deltas the result matches its digest
   exactly when the held bits were the base's, so this also checks the held state.
2. *Commit*: write the undo journal (``storage.state_journal``) durably, write the new values
   and the new header (same length, padded) into the file, fsync it, delete the journal.

A crash in step 2 leaves the journal; the next receive of that state (under the state's lock)
rolls the file back to its old step before anything else, so a retry ends bit-exact. Not atomic
for other readers: a process reading the state file while a patch runs, or after a crash cut one
off and before the next receive, can see a mix of two steps. Readers outside DCR read inside
``consistent_state(path)`` (the state's lock, and any cut-off patch rolled back first), or use the
default rewrite. Memory: the journal is built in memory before it is written, 8 bytes per changed
BF16 element (3.2 GB for an 8B-parameter model at 5% changed). Chosen only for a held
single-file state, no restart from a keyframe, a header that fits and a journal under half the
state file; otherwise the refit falls back to the rewrite.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct

import numpy as np

from dcr_core.chain import Direction
from dcr_core import digest, sparse
from dcr_core.delta import Encoding, apply_chunk
from dcr_core.dtypes import DTYPES
from dcr_core.errors import StateMismatchError
from flows.options import ReceiveOptions
from storage import state_journal
from storage.checkpoint import SafetensorsCheckpoint
from storage.root import Root
from storage.step_io import stream_chunks

MAX_JOURNAL_FRACTION = 0.5  # a rewrite writes the whole state; a journal this big already costs half


@contextlib.contextmanager
def consistent_state(state_path: str):
    """Hold the lock of the state file at ``state_path`` and undo a cut-off in-place patch first,
    so a reader inside sees exactly one step (receives wait meanwhile)::

        with consistent_state(path):
            weights = safetensors.torch.load_file(path)
    """
    from storage.checkpoint import exclusive

    with exclusive(state_path):
        state_journal.roll_back(state_path)
        yield state_path


class InPlacePatch:
    """A computed patch of a state file; ``commit`` applies it (crash-safe), ``abort`` drops it."""

    def __init__(self, state_path: str, journal: state_journal.Journal, after_record=None):
        self.state_path = state_path
        self.journal = journal
        self.after_record = after_record  # fault injection in tests

    def commit(self) -> None:
        state_journal.write(self.state_path, self.journal)
        try:
            state_journal.put(self.state_path, self.journal, "new", self.after_record)
        except BaseException:
            with contextlib.suppress(Exception):  # best effort now; the next receive rolls back anyway
                state_journal.roll_back(self.state_path)
            raise
        state_journal.remove(self.state_path)

    def abort(self) -> None:
        """Nothing to undo: the state file was not touched."""


def _header(path: str) -> tuple[bytes, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
    return struct.pack("<Q", n) + raw, json.loads(raw)


def _new_header(old: bytes, header: dict, metadata: dict[str, str]) -> bytes | None:
    """``old`` with its metadata replaced, padded with spaces to the same length (None: no fit)."""
    header = dict(header)
    header["__metadata__"] = {**header.get("__metadata__", {}), **metadata}
    raw = json.dumps(header, separators=(",", ":")).encode()
    room = len(old) - 8
    if len(raw) > room:
        return None
    return struct.pack("<Q", room) + raw + b" " * (room - len(raw))


def _merged(ranges: set[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for start, stop in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop])
    return [(a, b) for a, b in out]


def _held_mismatch(state_path: str, name: str, step: int):
    raise StateMismatchError(f"{state_path}: tensor {name!r} is not the bits of step {step} (digest mismatch)")


def _streamable(entries, e_target):
    """The one move that stores chunks of this tensor, if it is an XOR delta of main chunks only and
    the target has a plain digest (patched chunk by chunk, no copy); else None."""
    stored = [e for e in entries if e.n_stored]
    if len(stored) != 1 or stored[0].parts is not None or e_target.pieces is not None:
        return None
    e = stored[0]
    return e if all(e.encoding_at(p) is Encoding.XOR for p in range(e.n_stored)) else None


def _xor_streamed(held_bits: np.ndarray, e, e_target, stream):
    """The changes one XOR delta makes to a tensor, from its masks alone (chunks in index order):
    positions are the masks' non-zero elements; the new tensor is hashed as it streams by (held
    bits between stored chunks, held XOR mask within them). False if the result misses its digest."""
    h = digest.TensorHasher()
    grid = e.grid
    buf = np.empty(min(math.prod(grid.chunk_shape), held_bits.size), held_bits.dtype)  # reused per chunk
    at = 0
    positions, old, new = [], [], []
    for _ in range(e.n_stored):
        _, _, index, payload = next(stream)
        start, stop = grid.chunk_range(index)
        if start < at or payload.shape != (stop - start,):
            raise StateMismatchError(f"tensor {e.name!r}: chunk {index} out of order or of the wrong size")
        h.update(held_bits[at:start])
        held_chunk = np.asarray(held_bits[start:stop])
        chunk = np.bitwise_xor(held_chunk, payload, out=buf[: stop - start])
        h.update(chunk)
        nz, _ = sparse.nonzero(payload)
        positions.append(nz + start)
        old.append(held_chunk[nz])
        new.append(chunk[nz])
        at = stop
    h.update(held_bits[at:])
    if h.hexdigest() != e_target.digest:
        return False
    return np.concatenate(positions), np.concatenate(old), np.concatenate(new)


def _applied_on_copy(held_bits: np.ndarray, entries, e_target, stream, scratch: np.ndarray):
    """The general case (several moves, overwrites, shared parts, piecewise digests): apply every
    chunk to a copy of the tensor and compare it with the held bits where chunks landed."""
    work = scratch[: held_bits.nbytes].view(held_bits.dtype)
    np.copyto(work, held_bits)
    touched: set[tuple[int, int]] = set()
    for e in entries:
        grid = e.grid
        for pos in range(e.n_stored):
            _, _, index, payload = next(stream)
            apply_chunk(work, grid, index, payload, e.encoding_at(pos))
            touched.add(grid.chunk_range(index))
    if not e_target.matches(work):
        return False
    positions = np.concatenate([np.flatnonzero(work[a:b] != held_bits[a:b]) + a for a, b in _merged(touched)] or [np.empty(0, np.int64)])
    return positions, np.asarray(held_bits[positions]), work[positions].copy()


def eligible(plan, state_path: str) -> bool:
    """Whether patching in place is possible and cheaper than rewriting (see the module doc)."""
    if plan.current_step is None or not plan.moves or plan.moves[0].direction is Direction.KEYFRAME:
        return False
    if not os.path.isfile(state_path):
        return False
    target = plan.manifests[plan.target_step]
    state_bytes = sum(e.nbytes for e in target.tensors.values())
    journal = 0
    for move in plan.moves:
        for e in plan.manifests[move.step].tensors.values():
            changed = e.changed if e.n_stored else 0
            journal += changed * ((4 if e.numel < 1 << 32 else 8) + 2 * DTYPES[e.dtype].itemsize)
    return journal <= MAX_JOURNAL_FRACTION * max(state_bytes, 1)


def refit_in_place(plan, state_path: str, options: ReceiveOptions | None = None, checks=None) -> dict | None:
    """Compute the in-place patch of ``state_path`` (step 1 above) without touching it.

    Returns the outcome ``replace_state`` commits (like ``refit_file``'s), or None when the
    header has no room for the new metadata (the caller rewrites instead). ``checks(plan, infos)``
    runs the shared pre-flight checks of ``refit_file``."""
    from flows import receive_steps as rs

    options = options or ReceiveOptions()
    root = Root(plan.root_url, plan.storage_options)
    target = plan.manifests[plan.target_step]
    held = plan.manifests[plan.current_step]
    reader = SafetensorsCheckpoint(state_path)
    try:
        rs._check_schema(held, reader.infos, state_path)
        if checks is not None:
            checks(plan)
        old_header, header = _header(state_path)
        meta = {rs.STATE_STEP: str(plan.target_step), rs.STATE_POLICY: target.policy_digest, rs.STATE_ROOT: plan.root_url}
        new_header = _new_header(old_header, header, meta)
        if new_header is None:
            return None
        names = sorted(target.tensors)
        manifests, tables = rs.move_tables_of(plan)
        jobs = rs.chunk_jobs(names, manifests, tables)

        records: list[state_journal.Record] = []
        pulled = 0
        scratch: np.ndarray | None = None  # one buffer for every copied tensor: no fresh pages per tensor
        with contextlib.closing(stream_chunks(root, jobs, workers=options.io_workers)) as stream:
            for name in names:
                e_target = target.tensors[name]
                held_bits = reader.mapped_bits(name)
                entries = [t[name] for t in tables]
                if not any(e.n_stored for e in entries):
                    changes = None if e_target.matches(held_bits) else _held_mismatch(state_path, name, held.step)
                elif (one := _streamable(entries, e_target)) is not None:
                    changes = _xor_streamed(held_bits, one, e_target, stream)
                else:
                    if scratch is None:
                        scratch = np.empty(max(e.nbytes for e in target.tensors.values()), np.uint8)
                    changes = _applied_on_copy(held_bits, entries, e_target, stream, scratch)
                pulled += sum(e.stored_bytes for e in entries)
                if changes is False:  # the result does not match step N's digest
                    if not held.tensors[name].matches(held_bits):
                        _held_mismatch(state_path, name, held.step)
                    raise StateMismatchError(
                        f"step {plan.target_step}: tensor {name!r} does not match its digest after apply; nothing written"
                    )
                if changes is not None and changes[0].size:
                    pos_dtype = np.dtype("<u4") if held_bits.size < 1 << 32 else np.dtype("<i8")
                    records.append(state_journal.Record(
                        reader.data_offset(name), held_bits.dtype.itemsize, changes[0].astype(pos_dtype), *changes[1:],
                    ))
            if next(stream, None) is not None:
                raise StateMismatchError("more chunks fetched than applied")  # pragma: no cover - invariant
    finally:
        reader.close()
    journal = state_journal.Journal(plan.current_step, plan.target_step, old_header, new_header, records)
    return {"writer": InPlacePatch(state_path, journal), "bytes_pulled": pulled, "in_place": True,
            "journal_bytes": journal.nbytes}
