"""Encoding a publish: every tensor chunk by chunk into the attempt's Zarr store, streamed.

Per tensor: read its bits (and the baseline's), XOR per chunk (or take the values of a keyframe),
skip chunks that are all zero, compress and upload the rest on a bounded pool while later tensors
are still being encoded. A delta chunk's mask and its changes (positions, mask values, new bits)
come from one C pass over the two chunks (``sparse.xor_diff``); the codec and the patch log both
take those changes, so no mask is scanned twice. Nothing is visible to readers yet: no marker names the attempt.

Reading: a checkpoint file (the source, or a file baseline) is read chunk by chunk into a few
chunk-sized buffers that are reused across chunks and tensors (``_Buffers``: mapped and populated
in one call each), never into a fresh tensor-sized array: fresh memory costs a page fault per 4 KiB
on first touch, which on some machines (VMs) is slower than reading the file. Each chunk read is a
private copy, so the digest, the XOR and the codec all see the same bits even if the file changes
meanwhile. Memory: the buffers of the chunks in flight (``_window``), whatever the model's size.
Sources held in memory (a snapshot, a held baseline) are sliced in place.

A delta whose baseline is the publisher's cache file also logs, per changed chunk, the positions and
new values of its changed elements (``storage.local.patch_log``); once the step is committed the
cache is patched with them in place instead of copied whole (``flows.publish.baseline``); a
publish mapped over groups on workers writes one log per group, and the cache is patched with all.

Hashing runs beside the encoding: the new tensors' bits and the base's are fed, chunk by chunk and
in order, to one thread each (``dcr_core.hash_lane``; a chunk's buffer goes back once it is hashed), so on a
machine with a spare core a delta costs about one read of the two checkpoints, not a read plus two
hashes in a row.

A file baseline is checked as a by-product of this pass: the bits of every base chunk are hashed
as they are XORed, and each tensor's digest must be the base step's before the manifest is written
(``BaselineMismatchError`` otherwise: the pipeline discards the attempt and publishes again from a
baseline checked in full or rebuilt from ROOT). So a baseline file trusted without hashing it first
(``flows.publish.baseline``) can never make a wrong delta.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import mmap
import os
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait

import numpy as np

from dcr_core import events
from dcr_core.bundles import MembersHasher
from dcr_core.chain import KEYFRAME
from dcr_core.chunking import ChunkGrid, choose_chunk_shape, grid_of
from dcr_core.delta import Encoding, choose_encoding, count_changed, encode_chunks
from dcr_core.dtypes import DTYPES
from dcr_core.errors import IntegrityError, SchemaMismatchError
from dcr_core.hash_lane import LANE_MIN_BYTES, HashLane
from dcr_core.sparse import DENSE_ABOVE, nonzero, xor_diff
from flows.publish import baseline as baseline_cache
from flows.publish.groups import TensorGroup, array_names, unique_array
from flows.publish.plan import PublishPlan
from flows.publish.sources import Source, SourceRef, opened
from storage import layout
from storage.chunk_io import Ready, StepWriter, StoredChunk
from storage.local import bundled
from storage.local.patch_log import PatchLogWriter
from storage.local.safetensors import SafetensorsCheckpoint
from storage.manifest import ChunkTable, TensorEntry
from storage.root import open_root
from storage.stream import StreamAnnouncer

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: fault a buffer's pages in with one call


class BaselineMismatchError(IntegrityError):
    """A file baseline's bits, hashed as they were used, are not the base step's (see module doc)."""


def _chunk_table(futures: list[Future]) -> ChunkTable:
    stored: list[StoredChunk] = sorted((f.result() for f in futures), key=lambda s: s.index)
    packed = any(s.pack for s in stored)
    return ChunkTable(tuple(s.index for s in stored), tuple(s.digest for s in stored), tuple(s.nbytes for s in stored),
                      tuple(s.pack for s in stored) if packed else (), tuple(s.offset for s in stored) if packed else ())


def _window(plan: PublishPlan, root) -> int:
    """Chunks encoded ahead of the uploads (each holds a mask, and its base for ``dcr.cond``).
    ROOTs with latency: the pool's own window (uploads wait on the network). Local and memory ROOTs:
    writing is compression, CPU-bound, so a chunk per core and one more keep every core busy;
    more would only touch more memory."""
    pool_window = 2 * max(1, plan.options.io_workers)
    if not root.backend.has_latency:
        return min(pool_window, (os.cpu_count() or 1) + 1)
    return pool_window


class _Buffers:
    """Chunk-sized byte buffers, reused: taken for a chunk, given back once nothing uses it."""

    def __init__(self, nbytes: int):
        self.nbytes = max(1, nbytes)
        self._free: list[np.ndarray] = []

    def take(self) -> np.ndarray:
        if self._free:
            return self._free.pop()
        try:
            m = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
        except (OSError, ValueError):
            return np.empty(self.nbytes, dtype=np.uint8)
        return np.frombuffer(m, dtype=np.uint8)

    def give(self, *raws: np.ndarray | None) -> None:
        self._free.extend(r for r in raws if r is not None)

    def give_after(self, futures: list[Future | None], *raws: np.ndarray | None) -> None:
        """Give ``raws`` back once every one of ``futures`` is done (from the thread that ends the
        last one: list appends and pops are atomic, and only the encoding thread takes)."""
        pending = [f for f in futures if f is not None and not f.done()]
        if not pending:
            self.give(*raws)
            return
        left, lock = [len(pending)], threading.Lock()

        def done(_):
            with lock:
                left[0] -= 1
                last = not left[0]
            if last:
                self.give(*raws)

        for f in pending:
            f.add_done_callback(done)


@dataclasses.dataclass
class _Lanes:
    new: HashLane
    base: HashLane

    @classmethod
    def open(cls, stack: contextlib.ExitStack) -> _Lanes:
        lanes = cls(HashLane("dcr-hash-new"), HashLane("dcr-hash-base"))
        stack.callback(lanes.base.close)
        stack.callback(lanes.new.close)
        return lanes


class _Reader:
    """One tensor's bits, chunk by chunk: a checkpoint file read into a buffer (a private copy), any
    other source sliced in place (its bits are already in memory)."""

    def __init__(self, src: Source, name: str, buffers: _Buffers):
        self.name, self.buffers = name, buffers
        self.file = src if isinstance(src, SafetensorsCheckpoint) or getattr(src, "file", False) else None
        self.storage = np.dtype(DTYPES[src.infos[name].dtype].storage)
        self.bits = None if self.file is not None else src.bits(name)

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The bits ``[start, stop)`` and the buffer holding them (None: a view of the source)."""
        if self.file is None:
            return self.bits[start:stop], None
        raw = self.buffers.take()
        out = raw[: (stop - start) * self.storage.itemsize].view(self.storage)
        try:
            return self.file.read_into(self.name, start, out), raw
        except BaseException:
            self.buffers.give(raw)
            raise


class _Uploads:
    """Chunks handed to the writer, oldest first, with the buffers each holds until it is stored:
    at most ``window`` at a time (``submit`` waits for the oldest, then reuses its buffers)."""

    def __init__(self, writer: StepWriter, buffers: _Buffers, window: int):
        self.writer, self.buffers, self.window = writer, buffers, max(1, window)
        self._inflight: deque[tuple[Future, tuple]] = deque()

    def submit(self, holds: tuple, *args) -> Future:
        while len(self._inflight) >= self.window:
            fut, raws = self._inflight.popleft()
            wait([fut])  # its error, if any, is raised where its result is read
            self.buffers.give(*raws)
        fut = self.writer.write_chunk(*args)
        self._inflight.append((fut, holds))
        return fut


def _grids(plan: PublishPlan) -> dict[str, ChunkGrid]:
    opts = plan.options
    return {n: grid_of(i.shape, choose_chunk_shape(i.shape, DTYPES[i.dtype].itemsize, opts.chunk_bytes,
                                                     opts.column_blocks))
            for n, i in plan.infos.items()}


def _buffer_bytes(plan: PublishPlan, grids: dict[str, ChunkGrid]) -> int:
    return max((g.chunk_numel * DTYPES[plan.infos[n].dtype].itemsize for n, g in grids.items()), default=1)


def encode_group(plan: PublishPlan, source: str, baseline: str | None, group: TensorGroup) -> dict[str, TensorEntry]:
    """The tensors of ``group`` encoded and their chunks uploaded, where this runs (a worker of a
    mapped publish, ``flows.publish.groups``): the source and the baseline are files it reads
    itself; its manifest entries come back. A baseline file this worker cannot see (the
    publisher's cache on another machine) is rebuilt for the group's tensors from ROOT into a temp
    file here (verified chunk by chunk and tensor by tensor), never shipped; the cache is then
    copied whole after the commit, else patched with every group's log. No stream announcements
    (the flow announces a group's chunks as it returns: ``announcing``)."""
    events.reached("publish.group-started", step=plan.step, group=group.index, groups=group.count,
                   tensors=len(group.names))
    with contextlib.ExitStack() as stack:
        if baseline is not None and not os.path.exists(baseline):
            _sweep_group_baselines()
            baseline = os.path.join(tempfile.gettempdir(), f"{GROUP_BASELINE}{plan.attempt}-{group.index}-"
                                    f"{uuid.uuid4().hex[:8]}.safetensors")
            stack.callback(_remove, baseline)
            baseline_cache.rebuild(plan, baseline, group.names)
            events.reached("publish.group-baseline-rebuilt", step=plan.step, group=group.index)
        entries = encode_and_write(plan, source, baseline, group)
    events.reached("publish.group-done", step=plan.step, group=group.index, groups=group.count,
                   tensors=len(group.names))
    return entries


GROUP_BASELINE = "dcr-group-baseline-"  # a group's baseline rebuilt from ROOT, in the worker's temp directory
STALE_GROUP_BASELINE_SECONDS = 3600  # one left this long belongs to a worker killed mid-group


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _sweep_group_baselines() -> None:
    """Remove group baselines (and their writers' temp files) that killed workers left behind."""
    tmp, now = tempfile.gettempdir(), time.time()
    for name in os.listdir(tmp):
        if name.startswith((GROUP_BASELINE, f".{GROUP_BASELINE}")):
            path = os.path.join(tmp, name)
            with contextlib.suppress(OSError):
                if now - os.stat(path).st_mtime > STALE_GROUP_BASELINE_SECONDS:
                    os.unlink(path)


@contextlib.contextmanager
def announcing(plan: PublishPlan) -> Iterator[Callable[[dict[str, TensorEntry]], None] | None]:
    """For a mapped publish that streams (``options.stream``): a call that announces the chunks of a
    group's entries (``storage.stream``); the last index once the block ends without error. None
    when the plan does not stream."""
    if not plan.options.stream:
        yield None
        return
    with StreamAnnouncer(open_root(plan.root), plan.step, plan.attempt, plan.codec) as announcer:

        def announce(entries: dict[str, TensorEntry]) -> None:
            sizes: dict[str, int] = {}  # a group's packs hold its chunks alone (its writer's tag): their sizes
            for e in entries.values():
                for p, n in zip(e.chunks.packs, e.chunks.nbytes):
                    sizes[p] = sizes.get(p, 0) + n
            for name, e in entries.items():
                grid = grid_of(plan.infos[name].shape, e.chunk_shape)
                c = e.chunks
                for pos, (index, digest, nbytes) in enumerate(zip(c.indices, c.digests, c.nbytes)):
                    where = (c.packs[pos], c.offsets[pos], sizes[c.packs[pos]]) if c.packs else ()
                    announcer.stored(name, e.dtype, grid, layout.chunk_key(e.array, grid.grid_index(index)),
                                     StoredChunk(index, digest, nbytes, *where))

        yield announce
        announcer.finish()  # the last index, before the manifest: followers know they have it all


def encode_and_write(plan: PublishPlan, source: SourceRef, baseline: SourceRef | None,
                     group: TensorGroup | None = None) -> dict[str, TensorEntry]:
    """Encode every tensor (of ``group`` only, if given) and upload its stored chunks; return the
    manifest entries.

    ``baseline``: a file (each tensor's bits checked against the base step's digest as they are
    used: ``BaselineMismatchError``) or a held in-memory snapshot (not re-checked, see
    ``flows.publish.baseline``)."""
    opts = plan.options
    whole = group is None
    arrays = array_names(plan.infos) if whole else dict(zip(group.names, group.arrays))
    stack = contextlib.ExitStack()
    src = bundled.view(stack.enter_context(opened(source)), plan.bundles)
    if src.infos != plan.infos:
        stack.close()
        raise SchemaMismatchError(f"{src.path}: its tensors changed after the publish was planned; publish again")
    base_entries = plan.base_entries()
    from_file = isinstance(baseline, str)
    base_src = None if baseline is None else bundled.view(stack.enter_context(opened(baseline)), plan.bundles)
    pending: list[tuple[dict, Future, list[Future]]] = []
    root = open_root(plan.root)
    stream = opts.stream and whole
    announcer = stack.enter_context(StreamAnnouncer(root, plan.step, plan.attempt, plan.codec)) if stream else None
    grids = _grids(plan)
    buffers = _Buffers(_buffer_bytes(plan, grids))
    lanes = _Lanes.open(stack)
    patch = None
    cached = from_file and opts.use_cache and baseline == baseline_cache.cache_path(plan)
    if cached:
        baseline_cache.share_cache(getattr(base_src, "inner", base_src))
    if cached:  # the cache is patched with this log (a group's: with every group's) after the commit
        index, count = (None, None) if whole else (group.index, group.count)
        patch = PatchLogWriter(baseline_cache.patch_log_path(plan, index), baseline_cache.patch_log_head(plan, index, count),
                               limit_bytes=baseline_cache.patch_log_limit(plan, None if whole else group.nbytes))
        stack.callback(patch.abort)  # a no-op once finished
    with stack, StepWriter(root, plan.step, plan.attempt, plan.codec, workers=opts.io_workers,
                           pack_bytes=opts.pack_bytes) as w:
        uploads = _Uploads(w, buffers, _window(plan, root))
        w.write_group({"dcr": {"step": plan.step, "kind": plan.kind, "base_step": plan.base_step}})
        unchecked: deque[_Digest] = deque()  # bases still hashing on their lane, in lane order
        for name in sorted(arrays):
            while unchecked and unchecked[0].check_base():  # a base found wrong stops the encoding here
                unchecked.popleft()
            info, grid = plan.infos[name], grids[name]
            array = arrays[name]
            announce = None if announcer is None else functools.partial(announcer.stored, name, info.dtype, grid)
            if plan.kind == KEYFRAME:
                encoding = Encoding.FULL
            elif opts.overwrite_above >= 1.0:
                encoding = Encoding.XOR  # the default: no extra pass to count changes first
            else:
                encoding = None  # chosen from a count of the changes: the whole tensor first
            base_entry = base_entries.get(name)
            bundle = plan.bundles.get(name)
            members = None if bundle is None else MembersHasher(bundle, plan.scheme)
            if encoding is None or grid.is_blocked:  # blocks are not flat ranges: the whole tensor at once
                encoding, whole_digest, changed, chunk_futs = _encode_whole(
                    plan, uploads, src, base_src, baseline if from_file else None, base_entry, name, grid, array,
                    announce, encoding, patch, members)
                digest = functools.partial(str, whole_digest)
            else:
                check = baseline if from_file and encoding is Encoding.XOR else None
                digest, changed, chunk_futs = _encode_streamed(
                    plan, uploads, src, base_src, check, base_entry, name, grid, array, announce, encoding, patch,
                    lanes, members)
                unchecked.append(digest)
            if encoding is Encoding.XOR and not changed:
                encoding = Encoding.UNCHANGED
            attrs = {"dcr": {"tensor": name, "dtype": info.dtype, "encoding": encoding.value, "step": plan.step}}
            meta = {
                "name": name, "dtype": info.dtype, "shape": info.shape, "digest": digest,
                "encoding": encoding, "array": array, "chunk_shape": grid.chunk_shape,
                "base_digest": None if plan.kind == KEYFRAME else base_entry.digest, "changed": changed,
                "members": members,  # finished once its lane is done (below)
            }
            pending.append((meta, w.write_array(array, info.shape, grid.chunk_shape, info.dtype, attrs), chunk_futs))
            events.reached("tensor.done", name=name, nbytes=info.nbytes)
        entries = {}
        for meta, array_fut, chunk_futs in pending:
            table = _chunk_table(chunk_futs)
            array_fut.result()
            meta["digest"] = meta["digest"]()  # once its hash lanes are done; may raise BaselineMismatchError
            if meta["members"] is not None:  # its members were hashed on the lane before the digest
                meta["members"] = meta["members"].finish(plan.kind != KEYFRAME)
            entries[meta["name"]] = TensorEntry(chunks=table, scheme=plan.scheme, **meta)
        w.finish()  # the last pack is written and its chunks announced before the last index
        if announcer is not None:
            announcer.finish()  # the last index, before the manifest: followers know they have it all
        if patch is not None:
            patch.finish()
    events.reached("publish.tensors-stored", step=plan.step, tensors=len(entries))
    return entries


def _mismatch(baseline: str, name: str, plan: PublishPlan) -> BaselineMismatchError:
    return BaselineMismatchError(f"{baseline}: tensor {name!r} is not the bits of step {plan.base_step} "
                                 "(the baseline file changed or is damaged)")


def _encode_streamed(
    plan: PublishPlan, uploads: _Uploads, src: Source, base_src: Source | None, check: str | None,
    base_entry: TensorEntry | None, name: str, grid: ChunkGrid, array: str, announce, encoding: Encoding,
    patch: PatchLogWriter | None = None, lanes: _Lanes | None = None, members: MembersHasher | None = None,
) -> tuple[_Digest, int, list[Future]]:
    """One tensor, chunk by chunk (``full`` or ``xor``): its digest (a call that waits for the hash
    lanes), changed elements and uploads. ``check``: the baseline file, whose bits are hashed as
    they are used and must be the base's (``BaselineMismatchError`` otherwise, from the digest's
    check). ``patch``: where the changed elements' positions and new values go (``xor`` only).
    ``lanes``: hash there, beside the encoding, when chunks are large enough (else inline, and a
    wrong base raises here, before the next tensor). A chunk's buffers are given back once
    nothing uses them: its hash, its upload (which may carry the old bits), the XOR. ``members``: a
    bundle's members, hashed from the same private copy as the bundle (inline)."""
    dtype = plan.infos[name].dtype
    buffers = uploads.buffers
    conditional = encoding is Encoding.XOR and plan.codec.conditional
    new_r = _Reader(src, name, buffers)
    base_r = None if encoding is Encoding.FULL else _Reader(base_src, name, buffers)
    base_hash = None
    if check is not None:
        if base_entry.pieces is not None:  # a base published from shards: a piecewise digest, checked whole
            if not base_entry.matches(base_src.bits(name)):
                raise _mismatch(check, name, plan)
        else:
            base_hash = base_entry.scheme.hasher()
    new_hash = plan.scheme.hasher()

    def hashed(lane: HashLane | None, hasher, bits: np.ndarray) -> Future | None:
        if lane is None:
            hasher.update(bits)
            return None
        return lane.update(hasher, bits)

    chunk_bytes = grid.chunk_numel * np.dtype(DTYPES[dtype].storage).itemsize
    use_lanes = lanes is not None and chunk_bytes >= LANE_MIN_BYTES
    new_lane, base_lane = (lanes.new, lanes.base) if use_lanes else (None, None)
    changed = 0
    futs: list[Future] = []
    for i in range(grid.n_chunks):
        start, stop = grid.chunk_range(i)
        n, n_raw = new_r.read(start, stop)
        n_hashed = hashed(new_lane, new_hash, n)
        if members is not None:  # on the same lane, after the bundle's digest: its future covers both
            n_hashed = hashed(new_lane, members, n) or n_hashed
        if base_r is None:  # full values (a keyframe): all-zero chunks are not stored
            nz = int(np.count_nonzero(n))
            if nz:
                changed += nz
                up = uploads.submit((), array, grid, i, n, announce, None, dtype)
                futs.append(up)
                buffers.give_after([n_hashed, up], n_raw)
            else:
                buffers.give_after([n_hashed], n_raw)
            continue
        b, b_raw = base_r.read(start, stop)
        b_hashed = None if base_hash is None else hashed(base_lane, base_hash, b)
        m_raw = buffers.take()
        mask = m_raw[: n.nbytes].view(n.dtype)
        pos, values, news = _diff(n, b, mask)  # the codec takes the changes too: the mask is scanned once
        c = int(pos.size)
        if members is not None:
            members.count(pos + start)
        if patch is not None:  # the changed elements' positions in the tensor and their new bits
            patch.add(name, grid.numel, pos.astype(np.int64) + start, news)
        buffers.give_after([n_hashed], n_raw)
        if not c:  # unchanged chunks are not stored
            buffers.give(m_raw)
            buffers.give_after([b_hashed], b_raw)
            continue
        changed += c
        # The codec codes the mask against the old bits when it is conditional: they travel with it.
        up = uploads.submit((m_raw,), array, grid, i, mask, announce, b if conditional else None, dtype, (pos, values))
        futs.append(up)
        buffers.give_after([b_hashed, up] if conditional else [b_hashed], b_raw)
    new_digest = _done(new_hash.hexdigest()) if new_lane is None else new_lane.digest(new_hash)
    base_digest = None
    if base_hash is not None:
        base_digest = _done(base_hash.hexdigest()) if base_lane is None else base_lane.digest(base_hash)
    digest = _Digest(name, new_digest, base_digest, None if base_entry is None else base_entry.digest, check, plan)
    digest.check_base()  # inline: before the next tensor; on the lanes, once they get there
    return digest, changed, futs


def _diff(new: np.ndarray, old: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``mask = new ^ old`` (flat) and its changes: positions (ascending), the mask's values and the
    new bits there. One C pass (``xor_diff``); a chunk changed past ``DENSE_ABOVE`` (the codec stores
    it dense) has its changes found in the mask instead."""
    found = xor_diff(new, old, mask, int(mask.size * DENSE_ABOVE) + 1)
    if found is None:
        pos, values = nonzero(mask)
        return pos, values, new[pos]
    return found


def _done(value: str) -> Ready:
    return Ready(value)


@dataclasses.dataclass
class _Digest:
    """A tensor's digest as its lanes finish it, with its base's check (``BaselineMismatchError``).
    ``check_base`` raises as soon as the base's digest is known to be wrong (the encoding thread
    asks before each tensor), so a damaged baseline stops the encoding early; calling it waits."""

    name: str
    new: Future
    base: Future | None
    want: str | None
    baseline: str | None
    plan: PublishPlan

    def check_base(self, wait_for_it: bool = False) -> bool:
        """Whether the base is checked (raises if it is wrong); False while its hash is not done."""
        if self.base is None:
            return True
        if not (wait_for_it or self.base.done()):
            return False
        if self.base.result() != self.want:
            raise _mismatch(self.baseline, self.name, self.plan)
        return True

    def __call__(self) -> str:
        self.check_base(wait_for_it=True)
        return self.new.result()


def _encode_whole(
    plan: PublishPlan, uploads: _Uploads, src: Source, base_src: Source, check: str | None,
    base_entry: TensorEntry, name: str, grid: ChunkGrid, array: str, announce, encoding: Encoding | None = None,
    patch: PatchLogWriter | None = None, members: MembersHasher | None = None,
) -> tuple[Encoding, str, int, list[Future]]:
    """One tensor read whole, then encoded (the form without reused buffers): for an encoding that
    depends on how much of it changed (``encoding`` None: ``overwrite_above`` below 1) and for
    column-block grids, whose chunks are not flat ranges to stream."""
    new = src.bits(name)
    base = None if encoding is Encoding.FULL else base_src.bits(name)
    if check is not None and base is not None and not base_entry.matches(base):
        raise _mismatch(check, name, plan)
    if members is not None:
        members.update(new)
        if base is not None:
            members.count(np.flatnonzero(np.ascontiguousarray(new).reshape(-1) != np.ascontiguousarray(base).reshape(-1)))  # ascending
    if encoding is None:
        encoding = choose_encoding(count_changed(new, base), new.size, plan.options.overwrite_above)
    if patch is not None and base is not None:  # flat runs of a chunk's size: bounded temporaries
        flat, old = np.ascontiguousarray(new).reshape(-1), np.ascontiguousarray(base).reshape(-1)
        run = max(1, grid.chunk_numel)
        mask = np.empty(min(run, flat.size), dtype=flat.dtype)
        for start in range(0, flat.size, run):
            n = flat[start:start + run]
            pos, _, news = _diff(n, old[start:start + run], mask[: n.size])
            patch.add(name, flat.size, pos.astype(np.int64) + start, news)
    dtype = plan.infos[name].dtype
    changed = 0
    futs = []
    for c in encode_chunks(new, base, grid, encoding):
        changed += c.changed
        held = None  # the old bits of the chunk, for codecs that code masks against them
        if encoding is Encoding.XOR and plan.codec.conditional:
            held = grid.take(base, c.index)
        futs.append(uploads.submit((), array, grid, c.index, c.payload, announce, held, dtype))
    return encoding, plan.scheme.digest(new), changed, futs


def write_snapshot(plan: PublishPlan, source: SourceRef, entries: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """Store a full copy of the step beside its delta, in the same attempt (keyframe policy): new
    and far-behind receivers start from it, up-to-date receivers keep pulling only the delta.

    Arrays are named ``<tensor array>.full`` (kept distinct from every delta array); chunks use the
    delta codec, whose dense form stores values as byte planes. Read chunk by chunk like the delta
    (reused buffers); each tensor must hash to the digest its delta entry recorded."""
    used = {e.array for e in entries.values()}
    out: dict[str, TensorEntry] = {}
    opts = plan.options
    grids = _grids(plan)
    root = open_root(plan.root)
    buffers = _Buffers(_buffer_bytes(plan, grids))
    with opened(source) as opened_src, StepWriter(root, plan.step, plan.attempt, opts.delta_codec,
                                                  workers=opts.io_workers, pack_bytes=opts.pack_bytes) as w:
        src = bundled.view(opened_src, plan.bundles)
        uploads = _Uploads(w, buffers, _window(plan, root))
        pending = []
        for name in sorted(plan.infos):
            info, e = plan.infos[name], entries[name]
            array = unique_array(e.array + layout.SNAPSHOT_SUFFIX, used)
            grid = grid_of(info.shape, e.chunk_shape)
            attrs = {"dcr": {"tensor": name, "dtype": info.dtype, "encoding": Encoding.FULL.value,
                             "step": plan.step, "snapshot": True}}
            array_fut = w.write_array(array, info.shape, grid.chunk_shape, info.dtype, attrs)
            digest, _, futs = _encode_streamed(plan, uploads, src, None, None, None, name, grid, array, None,
                                               Encoding.FULL)
            if digest() != e.digest:
                raise IntegrityError(f"{plan.source_name or 'source'}: tensor {name!r} changed while publishing")
            pending.append((e, array, array_fut, futs))
        for e, array, array_fut, futs in pending:
            table = _chunk_table(futs)
            array_fut.result()
            out[e.name] = dataclasses.replace(
                e, encoding=Encoding.FULL, array=array, chunks=table, base_digest=None, changed=0, parts=None,
                members=None if e.members is None else e.members.with_digests(e.members.digests),
            )
    return out
