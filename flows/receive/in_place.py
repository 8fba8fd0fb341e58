"""Refitting a receiver's state file in place (``ReceiveOptions(in_place=True)``, ``--in-place``).

The default refit writes a whole new state file and renames it over the old one: a reader that has
the file open keeps a consistent old copy, but every refit reads the whole state and writes and
fsyncs a second copy. In place, only the changed elements are written into the file (the page
cache still writes back every page they dirty: with changes scattered at 1% or more that is nearly
every 4 KiB page, so the disk writes about the file once either way; what is saved is the full
read and the second copy):

1. *Compute* (``stage_patch``; the file is not touched), tensor by tensor, with chunks fetched as
   they arrive. One XOR delta (the common case): one pass per chunk over the held bits
   (memory-mapped) gives the new bits of the chunk and every change as (position, old value, new
   value), into arrays sized by the manifest's count of changed elements; the new tensor is hashed
   as it streams by (on a hash lane beside the next chunk's pass): no copy of the tensor. A
   ``dcr.sparse`` chunk comes unchecked (``storage.chunk_io.UncheckedChunk``) and is applied from
   its stored frame (``sparse.xor_frame``, C: its gap and value planes; no dense mask is built,
   decoded or hashed); its digest covers the decoded mask, so it is checked only when the tensor's
   result fails, to name the bad object. Other chunks are decoded, checked and scanned
   (``sparse.xor_changes``). With the held block digests trusted, such a delta's chunks are applied
   and hashed on worker threads (``flows.receive.patch_changes``, which computes every kind of change). Otherwise (several moves, overwrites, shared
   parts, piecewise digests, column blocks): the held bits are copied into a scratch buffer, every
   chunk applied, and the elements that differ kept. Either way the result is checked against the
   target step's digest, and a tensor no move touches is checked in place. For XOR deltas the
   result matches its digest exactly when the held bits were the base's, so this also checks the
   held state. The journal (``storage.local.journal``: positions, old and new values, both headers)
   is written under a temp name as its records are computed (``journal.Stager``) and fsynced at the
   end.
2. *Install* (``flows.receive.state_file.install_state``): the journal is put in force (renamed
   ``.undo``), the new values and the new header (same length, padded) are written into the file's
   page cache, and the journal is renamed ``.redo``: committed. The file is not fsynced here; the
   kernel writes the pages back, and the next receive (or ``consistent_state``) settles the patch:
   an fsync in the same boot, new values where the file differs after a reboot; journal deleted.

A crash before the commit leaves ``.undo``: the next receive of that state (under the state's lock)
rolls the file back to its old step before anything else, so a retry ends bit-exact. A crash or a
power loss after it leaves ``.redo``: the next receive rolls the file forward to the new step. Not atomic
for other readers: a process reading the state file while a patch runs, or after a crash cut one
off (or a power loss followed a committed one) and before the next receive, can see a mix of two
steps. Readers outside DCR read inside
``storage.local.state.consistent_state(path)``, or use the default rewrite. Memory: the journal is
built in memory before it is staged, 8 bytes per changed BF16 element (3.2 GB for an 8B-parameter
model at 5% changed). Chosen only for a held single-file state, no restart from a keyframe, a
header that fits and a journal under half the state file; otherwise the refit rewrites.

Bundles (``dcr_core.bundles``): every state file DCR writes lays each bundle's members out back to
back in bundle order (``reader.state_infos``), so a bundle is one byte range of it, and the patch
treats it as one tensor at its first member's offset (``storage.local.bundled.BundledView``): its
held bits mapped, its chunks applied, its changes journaled as positions in the bundle, its block
digests kept under its name; its result is then checked member by member (``member_mismatch``). A
file whose members lie otherwise (written by another tool), or a plan whose steps lay a bundle out
differently, is rewritten (``eligible``).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import blake3
import numpy as np

from dcr_core import events
from dcr_core.bundles import Members
from dcr_core.digest import block_count, block_leaves, blocks_root
from dcr_core.dtypes import DTYPES
from dcr_core.errors import InvalidCheckpointError, StateMismatchError
from dcr_core.hash_lane import LANE_MIN_BYTES, HashLane
from flows.options import ReceiveOptions
from flows.receive.patch_changes import (
    ChunkWorkers,
    applied_on_copy,
    position_dtype,
    streamable,
    xor_parallel,
    xor_streamed,
)
from storage import reader
from storage.chunk_io import stream_chunks
from storage.local import bundled, journal, sidecar, state
from storage.local.bundled import BundledView
from storage.local.safetensors import SafetensorsCheckpoint
from storage.reader import RefitPlan
from storage.root import open_root

log = logging.getLogger("dcr.receive")
MAX_JOURNAL_FRACTION = 0.5  # a rewrite writes the whole state; a journal this big already costs half


@dataclass(frozen=True)
class StagedPatch:
    journal: str  # the staged (not yet active) journal
    bytes_pulled: int
    journal_bytes: int
    sidecar: str | None = None  # the staged block digests of the new state (``storage.local.sidecar``)
    blocks_hashed: int = 0  # blocks hashed (with block digests: changed, sampled or untrusted ones)


def blocked(*manifests) -> int | None:
    """The block size when every manifest has the same block digests and no piecewise tensor. Block
    digests are kept per stored tensor: a bundle's under its name, over its members' bits back to back
    (one run of the state file; the held manifest and the target share a lineage's bundles)."""
    schemes = {m.digest_scheme for m in manifests}
    if len(schemes) != 1 or not (scheme := schemes.pop()).blocked:
        return None
    if any(e.pieces is not None for m in manifests for e in m.tensors.values()):
        return None  # piecewise digests: hashed whole
    return scheme.block_bytes


def trusted_sidecar(state_path: str, held, ck: SafetensorsCheckpoint | BundledView, block: int) -> sidecar.Sidecar | None:
    """The held state's block digests if the trust policy allows them (``storage.local.sidecar``):
    whole, stamped with the file as it is, consistent with the held step's digests, and a random
    sample of blocks hashing to them. None otherwise: the refit then hashes every tensor."""
    sc = sidecar.load(state_path, held.step, held.policy_digest, block)
    if sc is None or set(sc.leaves) != set(held.tensors):
        return None
    for name, e in held.tensors.items():
        leaves = sc.leaves[name]
        if leaves.shape[0] != block_count(e.nbytes, block) or blocks_root(block, leaves) != e.digest:
            return None
    for name, b in sidecar.sample(sc, {n: e.nbytes for n, e in held.tensors.items()}):
        bits = ck.mapped_bits(name)
        item = bits.dtype.itemsize
        got = blake3.blake3(memoryview(np.ascontiguousarray(bits[b * block // item : (b + 1) * block // item]))
                            .cast("B")).digest()
        if got != sc.leaves[name][b].tobytes():
            log.warning("%s: tensor %r differs from the block digests kept beside it (changed outside DCR?); "
                        "checking every tensor", state_path, name)
            return None
    return sc


def one_layout(plan: RefitPlan, ms) -> dict[str, Members] | None:
    """The bundles every step of the plan shares (the held step's), or None when a step lays them out
    otherwise: a patch addresses a bundle as one tensor, so its members must be the same everywhere."""
    bundles = ms[plan.current_step].bundles()
    for m in ms.values():
        theirs = m.bundles()
        if theirs.keys() != bundles.keys() or not all(theirs[b].same_layout(bundles[b]) for b in bundles):
            return None
    return bundles


def addressable(ck, bundles: dict[str, Members]) -> bool:
    """Whether the held file (``ck``, seen through ``bundled.view``) lays out every bundle as one byte
    range (its members back to back in bundle order, as every state file DCR writes): a patch then
    addresses the bundle as one tensor at its first member's offset. A file written otherwise (by
    hand, by another tool) is rewritten."""
    if not bundles:
        return True
    return ck.bundles.keys() == bundles.keys() and all(ck.one_run(b) for b in bundles)


def _bundles_addressable(plan: RefitPlan, ms, state_path: str) -> bool:
    """``one_layout`` and ``addressable`` for the state file at ``state_path`` (its header read)."""
    bundles = one_layout(plan, ms)
    if not bundles:
        return bundles is not None  # {}: no bundles
    try:
        ck = SafetensorsCheckpoint(state_path)
    except InvalidCheckpointError:
        return False  # the rewrite reports it
    try:
        return addressable(BundledView(ck, bundles), bundles)
    finally:
        ck.close()


def eligible(plan: RefitPlan, state_path: str) -> bool:
    """Whether patching in place is possible and cheaper than rewriting (see the module doc)."""
    if plan.current_step is None or not plan.moves or plan.from_keyframe:
        return False
    if not os.path.isfile(state_path):
        return False
    ms = reader.manifests(plan)
    if not _bundles_addressable(plan, ms, state_path):
        return False
    target = ms[plan.target_step]
    state_bytes = sum(e.nbytes for e in target.tensors.values())
    size = 0
    for move in plan.moves:
        for e in ms[move.step].tensors.values():
            changed = e.changed if e.n_stored else 0
            size += changed * ((4 if e.numel < 1 << 32 else 8) + 2 * DTYPES[e.dtype].itemsize)
    return size <= MAX_JOURNAL_FRACTION * max(state_bytes, 1)


def members_hold(e, bits: np.ndarray) -> bool:
    """Whether every member of bundle ``e`` is its digest in ``bits`` (the bundle's, already proved);
    True for a plain tensor."""
    return e.members is None or e.members.check(bits, e.scheme) is None


def member_mismatch(e_target, e_held, held_bits: np.ndarray, changes, vouched: bool) -> str | None:
    """The first member of bundle ``e_target`` whose bits after the patch (the held bits with
    ``changes``) are not its digest at the target step; None when all are, or for a plain tensor.

    The patch proved the bundle's own digest; its members' digests (what the policy digest covers)
    are proved here, as every receiver proves them. A bundle that trusted block digests vouch for
    unchanged is not hashed again when its member digests are the held step's: block digests are
    kept only for a state whose members were proved (here, ``verify_held_state``, ``dcr verify-state``)."""
    m = e_target.members
    if m is None:
        return None
    if vouched and e_held.members is not None and m.digests == e_held.members.digests:
        return None
    bits = held_bits
    if changes:  # a bundle is at most 4 MiB (``dcr_core.bundles``): its result is copied whole
        bits = np.array(held_bits)
        bits[changes[0]] = changes[2]
    return m.check(bits, e_target.scheme)


def stage_patch(plan: RefitPlan, state_path: str, options: ReceiveOptions) -> StagedPatch | None:
    """Compute the in-place patch of ``state_path`` (step 1 above) without touching it, and stage
    its journal; None when the header has no room for the new metadata, or a bundle is not one range
    of the file (the caller rewrites)."""
    root = open_root(plan.root)
    ms = reader.manifests(plan, root)
    target = ms[plan.target_step]
    held = ms[plan.current_step]
    bundles = held.bundles()
    ck = bundled.view(SafetensorsCheckpoint(state_path), bundles)  # a bundle: one tensor at its first member
    try:
        reader.check_schema(held, ck.infos, state_path)
        reader.check_moves(plan, ms)
        if one_layout(plan, ms) is None or not addressable(ck, bundles):
            return None  # checked by ``eligible``; the file may have been replaced since
        (header,) = ck.headers.values()
        new_header = header.with_metadata(state.metadata(plan.target_step, target.policy_digest, plan.root.url))
        if new_header is None:
            return None
        names = sorted(target.tensors)
        chosen, tables = reader.move_tables(plan, ms)
        forwards = reader.move_forwards(plan)
        # The journal is written as its records are computed (on a thread of its own), fsynced at the end.
        stager = journal.Stager(state_path, plan.current_step, plan.target_step, header.raw, new_header, len(names))
        try:
            pulled = 0
            block = blocked(*ms.values())
            sc = trusted_sidecar(state_path, held, ck, block) if block else None
            new_leaves: dict[str, np.ndarray] = {}
            hashed = 0
            scratch: np.ndarray | None = None  # one buffer for every copied tensor: no fresh pages per tensor
            # XOR deltas of dcr.sparse frames come unchecked and are applied from their stored form; the
            # tensor built from them is checked against the step's digest (``chunk_changes``).
            fused = {n for n in names if streamable([t[n] for t in tables], target.tensors[n]) is not None}
            stream = stream_chunks(root, reader.chunk_jobs(names, chosen, tables), workers=options.io_workers,
                                   unchecked=lambda m, e: e.name in fused and m.codec.sparse)
            lane = HashLane("dcr-hash", depth=2)  # the new chunks' blocks hashed beside the next chunk's pass
            workers = ChunkWorkers(min(4, os.cpu_count() or 1))  # with trusted block digests: chunks in parallel
            try:
                for name in names:
                    e_target = target.tensors[name]
                    held_bits = ck.mapped_bits(name)
                    entries = [t[name] for t in tables]
                    before = None if sc is None else sc.leaves[name]
                    vouched = False  # unchanged, as the trusted block digests say
                    if not any(e.n_stored for e in entries):
                        if before is not None and blocks_root(block, before) == e_target.digest:
                            new_leaves[name] = before  # unchanged, and trusted (the sidecar's policy)
                            vouched = True
                        elif block:
                            new_leaves[name] = block_leaves(held_bits, block)
                            hashed += new_leaves[name].shape[0]
                            if blocks_root(block, new_leaves[name]) != e_target.digest:
                                raise reader.held_mismatch(state_path, name, held.step)
                        elif not e_target.matches(held_bits, members=False):  # members: below
                            raise reader.held_mismatch(state_path, name, held.step)
                        changes = None
                    elif (one := streamable(entries, e_target)) is not None:
                        forward = next(f for e, f in zip(entries, forwards) if e is one)
                        frames = next(m for m, t in zip(chosen, tables) if t[name] is one).codec.sparse
                        chunk_bytes = min(math.prod(one.grid.chunk_shape), held_bits.size) * held_bits.dtype.itemsize
                        if before is not None and block and frames and chunk_bytes >= LANE_MIN_BYTES:
                            changes = xor_parallel(held_bits, one, e_target, stream, plan.target_step, before, workers)
                        else:
                            changes = xor_streamed(held_bits, one, e_target, stream, forward, plan.target_step,
                                                    before if block else None, lane)
                    else:
                        if scratch is None:
                            scratch = np.empty(max(e.nbytes for e in target.tensors.values()), np.uint8)
                        changes = applied_on_copy(held_bits, entries, e_target, stream, scratch, forwards,
                                                   before if block else None)
                    if changes:
                        hashed += changes[4]
                        if changes[3] is not None:
                            new_leaves[name] = changes[3]
                    pulled += sum(e.stored_bytes for e in entries)
                    events.reached("tensor.done", name=name, nbytes=e_target.nbytes)
                    if changes is False:  # the result does not match step N's digest
                        if not held.tensors[name].matches(held_bits, members=False):
                            raise reader.held_mismatch(state_path, name, held.step)
                        raise reader.result_mismatch(plan.target_step, name)
                    bad = member_mismatch(e_target, held.tensors[name], held_bits, changes, vouched)
                    if bad is not None:
                        raise reader.result_mismatch(plan.target_step, bad)
                    if changes is not None and changes[0].size:
                        stager.add(journal.Record(
                            ck.data_offset(name), held_bits.dtype.itemsize,
                            changes[0].astype(position_dtype(held_bits.size), copy=False), *changes[1:3],
                        ))
                if next(stream, None) is not None:
                    raise StateMismatchError("more chunks fetched than applied")  # pragma: no cover - invariant
            finally:
                workers.close()
                lane.close()
                stream.close()
            staged_journal = stager.finish()
        except BaseException:
            stager.abort()
            raise
    finally:
        ck.close()
    staged_blocks = None
    if block and set(new_leaves) == set(target.tensors):
        staged_blocks = sidecar.stage(state_path, sidecar.Sidecar(plan.target_step, target.policy_digest, block, new_leaves))
    events.reached("receive.blocks-hashed", blocks=hashed, trusted=sc is not None)
    return StagedPatch(staged_journal, pulled, stager.journal.nbytes, staged_blocks, hashed)

