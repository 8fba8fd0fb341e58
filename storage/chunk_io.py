"""Chunk objects of one step's Zarr store: bounded-parallel writes and verified reads.

One mechanism moves every chunk: ``BoundedPool``, a thread pool that admits at most ``window``
jobs at a time, so uploads start while later tensors are still being encoded, reads run ahead of
the apply, and memory stays bounded by the window however large the model is. Writers compress,
digest and upload; readers fetch, decompress into buffers of exactly the expected size and check
each chunk's digest before returning anything (a bad chunk raises an error naming its object). A
reader that applies a chunk's stored form directly (the in-place refit) takes it unchecked
(``UncheckedChunk``) and checks what it builds from it against a digest that covers that instead.
"""

from __future__ import annotations

import functools
import json
import secrets
import threading
from collections import deque
from collections.abc import Callable, Container, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import overload

import numpy as np

from dcr_core import events
from dcr_core.chunking import ChunkGrid
from dcr_core.codec import CodecSpec, check_conditional
from dcr_core.delta import HeldCoded, pad
from dcr_core.digest import chunk_digest
from dcr_core.dtypes import DTYPES
from dcr_core.errors import IntegrityError
from storage import layout, zarr_meta
from storage.held_chunks import PREFETCHED
from storage.manifest import Manifest, TensorEntry
from storage.root import Root

# Parallel object reads and writes of one transfer (a pool's threads), unless told otherwise: what
# --io-workers and the options models (flows.options) default to.
IO_WORKERS = 8


class BoundedPool:
    """``workers`` threads; ``submit`` blocks while ``window`` jobs are admitted and unfinished."""

    def __init__(self, workers: int, window: int | None = None, name: str = "dcr-io"):
        workers = max(1, workers)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._slots = threading.BoundedSemaphore(max(1, window or 2 * workers))

    def submit(self, fn: Callable, *args) -> Future:
        self._slots.acquire()
        try:
            fut = self._pool.submit(fn, *args)
        except BaseException:
            self._slots.release()
            raise
        fut.add_done_callback(lambda _: self._slots.release())
        return fut

    def close(self, cancel: bool = False) -> None:
        self._pool.shutdown(wait=True, cancel_futures=cancel)

    def __enter__(self) -> BoundedPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close(cancel=exc[0] is not None)


@dataclass(frozen=True, slots=True)
class StoredChunk:
    index: int
    digest: str
    nbytes: int
    pack: str = ""  # the pack holding it (packed steps), at ``offset``; "": its own object
    offset: int = 0
    pack_bytes: int = 0  # the size of that pack, once it is written (announced chunks); 0: not known


class _Packer:
    """Stored chunks appended back to back into pack objects (``layout.pack_key``): a pack is
    sealed once it holds at least ``pack_bytes`` and written by the thread that sealed it, while the
    others go on encoding into the next. So a step costs about one PUT per ``pack_bytes`` stored,
    however many tensors and chunks it holds. Pack names carry a tag random to this writer, so the
    writers of one attempt (a publish mapped over workers, a snapshot beside its delta) never meet."""

    def __init__(self, root: Root, step: int, attempt: str, pack_bytes: int):
        self.root, self.step, self.attempt, self.pack_bytes = root, step, attempt, pack_bytes
        self.tag = secrets.token_hex(4)
        self._lock = threading.Lock()
        self._seq, self._size = 0, 0
        self._parts: list[bytes] = []  # the open pack's chunks
        self._calls: list[Callable[[int], None]] = []  # told the pack's size once it is written
        self.written = 0  # bytes of the packs written

    def _name(self) -> str:
        return f"{self.tag}.{self._seq:06d}"

    def add(self, data: bytes, stored: Callable[[str, int, int], None] | None = None) -> tuple[str, int]:
        """Append ``data`` to the open pack: (its pack, its offset there). Writes the pack if this
        sealed it (an error then fails this chunk, hence the publish). ``stored(pack, offset, pack
        size)`` is called once the pack is written (streaming announces the chunk then, with the
        size a mirror needs to forward the pack whole)."""
        with self._lock:
            name, offset = self._name(), self._size
            self._parts.append(data)
            if stored is not None:
                self._calls.append(functools.partial(stored, name, offset))
            self._size += len(data)
            sealed = self._seal() if self._size >= self.pack_bytes else None
        if sealed is not None:
            self._write(*sealed)
        return name, offset

    def _seal(self) -> tuple[str, list[bytes], list[Callable[[int], None]]] | None:
        if not self._parts:
            return None
        sealed = (self._name(), self._parts, self._calls)
        self._seq, self._parts, self._size, self._calls = self._seq + 1, [], 0, []
        return sealed

    def _write(self, name: str, parts: list[bytes], calls: list[Callable[[int], None]]) -> None:
        data = b"".join(parts)
        key = layout.store_key(self.step, self.attempt, layout.pack_key(name))
        self.root.write(key, data)
        with self._lock:
            self.written += len(data)
        events.reached("pack.stored", key=key, nbytes=len(data), chunks=len(parts))
        for call in calls:
            call(len(data))

    def flush(self) -> None:
        """Write the open pack, if it holds anything (every chunk was added)."""
        with self._lock:
            sealed = self._seal()
        if sealed is not None:
            self._write(*sealed)


class StepWriter:
    """Writes one attempt's Zarr store. Use as a context manager; leaving it waits for all uploads
    (and cancels the ones not started if the block raised).

    ``pack_bytes`` > 0: a packed store (``_Packer``): chunks go into packs of about that size, the
    manifest says where each is, and no Zarr metadata document is written (readers take everything
    from the manifest; an auditor opens a packed step with ``dcr_zarr_codec.open_tensor``). 0: one
    object per chunk, and a ``zarr.json`` per array, as steps were written before packs."""

    def __init__(self, root: Root, step: int, attempt: str, codec: CodecSpec, workers: int = IO_WORKERS,
                 pack_bytes: int = 0):
        self.root, self.step, self.attempt, self.codec = root, step, attempt, codec
        self._store_prefix = layout.store_key(step, attempt, "")
        self._pool = BoundedPool(workers, name="dcr-put")
        self._packer = _Packer(root, step, attempt, pack_bytes) if pack_bytes > 0 else None
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def bytes_written(self) -> int:
        return self._bytes + (self._packer.written if self._packer is not None else 0)

    def __enter__(self) -> StepWriter:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.finish()
        else:
            self._pool.close(cancel=True)

    def finish(self) -> None:
        """Wait for every upload and write the last pack: every chunk is then stored (and announced,
        so a publish that streams calls this before its last stream index) before the manifest is
        written. Nothing is written after it."""
        self._pool.close()
        if self._packer is not None:
            self._packer.flush()

    def _key(self, key_in_store: str) -> str:
        """``layout.store_key`` of this writer's step (its checked prefix made once, not per chunk)."""
        return self._store_prefix + key_in_store

    def write_group(self, attributes: dict) -> None:
        if self._packer is None:
            self.root.write(self._key(layout.GROUP_META), zarr_meta.group_json(attributes))

    def write_array(self, array: str, shape, chunk_shape, dtype: str, attributes: dict) -> Future | Ready:
        if self._packer is not None:
            return _done(None)
        data = zarr_meta.array_json(tuple(shape), tuple(chunk_shape), dtype, self.codec, attributes)
        return self._pool.submit(self.root.write, self._key(layout.array_meta_key(array)), data)

    def write_chunk(self, array: str, grid: ChunkGrid, index: int, payload: np.ndarray,
                    announce: Callable[[str, StoredChunk], None] | None = None,
                    base: np.ndarray | None = None, dtype: str | None = None,
                    changes: tuple[np.ndarray, np.ndarray] | None = None) -> Future:
        """Compress, digest and upload one chunk; the future gives its StoredChunk. ``announce(key
        in the store, stored chunk)`` is called once it is stored (streaming, ``storage.stream``).
        ``base``: the chunk's old bits, when ``payload`` is an XOR mask and the codec codes against
        them (``dcr.cond``, which also needs the tensor's ``dtype``). ``changes``: the payload's
        non-zero elements (positions, values), if the caller found them (``CodecSpec.encode``)."""
        return self._upload(layout.chunk_key(array, grid.grid_index(index)), grid, index, payload, announce,
                            base, dtype, changes)

    def write_part(self, array: str, grid: ChunkGrid, slot: int, index: int, payload: np.ndarray) -> Future:
        """Compress, digest and upload one contributor's part of a shared chunk, at ``[slot, chunk]``
        of the parts array (shape ``(slots, *shape)``, chunks ``(1, *chunk_shape)``)."""
        return self._upload(layout.part_key(array, slot, grid.grid_index(index)), grid, index, payload)

    def _upload(self, key_in_store: str, grid: ChunkGrid, index: int, payload: np.ndarray,
                announce: Callable[[str, StoredChunk], None] | None = None,
                base: np.ndarray | None = None, dtype: str | None = None,
                changes: tuple[np.ndarray, np.ndarray] | None = None) -> Future:
        key = self._key(key_in_store)
        n = grid.chunk_numel

        def work() -> StoredChunk:
            data = self.codec.encode(pad(payload, n), None if base is None else pad(base, n), dtype, changes)
            digest = stored_digest(data) if self.codec.conditional else chunk_digest(payload)
            if self._packer is not None:
                tell = None if announce is None else functools.partial(
                    _announce_packed, announce, key_in_store, StoredChunk(index, digest, len(data)))
                pack, offset = self._packer.add(data, tell)
                events.reached("chunk.stored", key=key, nbytes=len(data), pack=pack)
                return StoredChunk(index, digest, len(data), pack, offset)
            self.root.write(key, data)
            with self._lock:
                self._bytes += len(data)
            events.reached("chunk.stored", key=key, nbytes=len(data))
            stored = StoredChunk(index, digest, len(data))
            if announce is not None:
                announce(key_in_store, stored)
            return stored

        return self._pool.submit(work)


class Ready:
    """A result known already, read like a finished ``Future`` (``result``, ``done``,
    ``add_done_callback``): a ``Future`` builds a condition and a lock, asked for several times per
    tensor of a step whose work was done in place."""

    __slots__ = ("value",)

    def __init__(self, value=None):
        self.value = value

    def result(self, timeout: float | None = None):
        return self.value

    def exception(self, timeout: float | None = None) -> None:
        return None

    def done(self) -> bool:
        return True

    def add_done_callback(self, fn) -> None:
        fn(self)


def _done(value) -> Ready:
    return Ready(value)


@dataclass(frozen=True)
class UncheckedChunk:
    """A chunk's stored bytes, fetched and size-checked but neither decoded nor digest-checked: for a
    reader that applies the stored form directly and verifies what it builds from it against a digest
    that covers it (the in-place refit: the new tensor against the step's tensor digest). ``checked``
    decodes and verifies it as ``read_chunk`` does, to name the object when the result is wrong."""

    url: str
    key: str
    data: bytes
    codec: CodecSpec
    dtype: str
    grid: ChunkGrid
    index: int
    digest: str

    def checked(self) -> np.ndarray | HeldCoded:
        payload = decode_chunk(self.url, self.key, self.data, self.codec, self.dtype, self.grid, self.index,
                               len(self.data))
        if payload_digest(payload) != self.digest:
            raise IntegrityError(f"{self.url}/{self.key}: chunk digest does not match the manifest")
        return payload


def chunk_where(key: str, offset: int | None, nbytes: int) -> str:
    """How errors name a stored chunk: its object, and for a packed chunk its bytes there."""
    return key if offset is None else f"{key} bytes {offset}..{offset + nbytes}"


def read_chunk(root: Root, manifest: Manifest, entry: TensorEntry, pos: int, checked: bool = True,
               fetched: _RangeRead | None = None) -> tuple[int, np.ndarray | HeldCoded | UncheckedChunk]:
    """Fetch (or take from the prefetched chunks, ``storage.held_chunks``, or from ``fetched``: a
    coalesced range read holding it), decompress and verify the ``pos``-th stored chunk of ``entry``
    (main chunks, then parts); unless ``checked`` is false: then its stored bytes, size-checked only
    (``UncheckedChunk``)."""
    rel, index, digest, nbytes = entry.stored_at(pos)
    offset = entry.offset_at(pos)
    key = layout.store_key(manifest.step, manifest.attempt, rel)
    where = chunk_where(key, offset, nbytes)
    grid = entry.grid
    held = PREFETCHED.take(root.url, layout.range_ident(key, offset),
                           verified_as(manifest.codec, entry.dtype, grid, index, digest, nbytes))
    prefetched = held is not None  # then verified against this very digest, size, dtype, range and codec when it landed
    if held is not None:
        data = held
        if fetched is not None:
            fetched.drop()
    else:
        try:
            if offset is None:
                data = root.read(key, limit=nbytes)  # a larger object is refused without being read
            elif fetched is not None:  # a coalesced range read of the pack holds it
                data = fetched.take(offset, nbytes)
            else:
                data = root.read_range(key, offset, nbytes)
        except FileNotFoundError:
            raise IntegrityError(f"{root.url}/{key}: {'pack' if offset is not None else 'chunk'} listed in the "
                                 "manifest is missing") from None
    if len(data) != nbytes:
        raise IntegrityError(f"{root.url}/{where}: chunk is {len(data)} bytes, the manifest says {nbytes}")
    chunk: np.ndarray | HeldCoded | UncheckedChunk
    chunk = UncheckedChunk(root.url, where, data, manifest.codec, entry.dtype, grid, index, digest)
    if checked:  # a prefetched chunk was checked when it landed: decoded only
        chunk = chunk.checked() if not prefetched else decode_chunk(root.url, where, data, manifest.codec,
                                                                     entry.dtype, grid, index, nbytes)
    events.reached("chunk.fetched", key=key, nbytes=nbytes, prefetched=prefetched)
    return index, chunk


def decode_chunk(url: str, key: str, data: bytes, codec: CodecSpec, dtype: str, grid: ChunkGrid, index: int,
                 nbytes: int) -> np.ndarray | HeldCoded:
    """The payload of chunk ``index`` from its stored bytes (size and format checked; not its
    digest). A ``dcr.cond`` chunk stays coded (``HeldCoded``): it decodes against the held bits."""
    if len(data) != nbytes:
        raise IntegrityError(f"{url}/{key}: chunk is {len(data)} bytes, the manifest says {nbytes}")
    size = grid.chunk_size(index)
    try:
        if codec.conditional:
            check_conditional(data, DTYPES[dtype].storage, grid.chunk_numel, dtype)
            return HeldCoded(bytes(data), codec, dtype, grid.chunk_numel, size)
        padded = codec.decode(data, DTYPES[dtype].storage, grid.chunk_numel)
    except IntegrityError as e:
        raise IntegrityError(f"{url}/{key}: {e}") from None
    return padded[:size]


def stored_digest(data: bytes) -> str:
    """The digest of a chunk's stored bytes: what the manifest records for ``dcr.cond`` chunks,
    whose payload exists only against the held bits."""
    return chunk_digest(np.frombuffer(data, dtype=np.uint8))


def _announce_packed(announce: Callable[[str, StoredChunk], None], key_in_store: str, chunk: StoredChunk,
                     pack: str, offset: int, pack_bytes: int) -> None:
    """Tell ``announce`` of a packed chunk once its pack is written: where it lies, and the pack's size."""
    announce(key_in_store, replace(chunk, pack=pack, offset=offset, pack_bytes=pack_bytes))


def payload_digest(payload: np.ndarray | HeldCoded) -> str:
    """What a manifest's chunk digest covers: the payload bits, or a ``HeldCoded`` chunk's stored bytes."""
    return stored_digest(payload.data) if isinstance(payload, HeldCoded) else chunk_digest(payload)


def verified_as(codec: CodecSpec, dtype: str, grid: ChunkGrid, index: int, digest: str, nbytes: int) -> tuple:
    """Everything a chunk's check depends on: stored bytes that decode under these to a payload with
    this digest are the chunk (the key of ``storage.held_chunks``)."""
    return (digest, nbytes, dtype, grid.chunk_numel, *grid.chunk_span(index), grid.chunk_size(index), json.dumps(codec.to_dict(), sort_keys=True))


ChunkJob = tuple[Manifest, TensorEntry, int]  # a manifest, one of its entries, a stored position

# Coalesced reads of packed chunks: the chunks a refit wants from one pack are read with one ranged
# GET per run of them, a run spanning at most MAX_RANGE_BYTES and skipping at most MAX_GAP_BYTES of
# chunks nobody here wants (a tensor-parallel rank's neighbours' slices), and holding chunks applied
# within RANGE_SPREAD_BYTES of stored chunks of each other (a range is held until its last chunk is
# applied: this bounds what waits for its turn when a pack's order is not the order of the apply).
MAX_RANGE_BYTES = 64 << 20
MAX_GAP_BYTES = 256 << 10
RANGE_SPREAD_BYTES = 256 << 20


class _RangeRead:
    """One ranged GET of a pack, shared by the chunks it holds; its bytes are dropped once the last
    of them is taken."""

    def __init__(self, root: Root, key: str, start: int, end: int, users: int):
        self.root, self.key, self.start, self.end, self.users = root, key, start, end, users
        self._future: Future | None = None
        self._lock = threading.Lock()

    def submit(self, pool: BoundedPool) -> None:
        if self._future is None:
            self._future = pool.submit(self.root.read_range, self.key, self.start, self.end - self.start)

    def take(self, offset: int, nbytes: int) -> bytes:
        if self._future is None:
            raise RuntimeError(f"{self.key}: a range read taken before it was submitted")
        data = self._future.result()
        self.drop()
        lo = offset - self.start
        return data[lo:lo + nbytes] if len(data) >= lo + nbytes else data[lo:]

    def drop(self) -> None:
        """One of its chunks is done without it (a streaming prefetcher held that one meanwhile)."""
        with self._lock:
            self.users -= 1
            if self.users == 0:
                self._future = None  # its bytes go with the last chunk taken from them


def _plan_ranges(root: Root, jobs: list[ChunkJob]) -> list[_RangeRead | None]:
    """For each job, the coalesced range read that fetches its chunk (None: a chunk that is its own
    object, or one a streaming prefetcher already holds)."""
    wanted: dict[str, list[tuple[int, int, int]]] = {}  # pack key -> (offset, nbytes, job)
    applied = [0]  # stored bytes of the jobs before each job, in the order they are applied
    for i, (m, e, pos) in enumerate(jobs):
        applied.append(applied[-1] + e.stored_nbytes[pos])
        offset = e.offset_at(pos)
        if offset is None:
            continue
        key = layout.store_key(m.step, m.attempt, e.stored_at(pos)[0])
        if (root.url, layout.range_ident(key, offset)) in PREFETCHED:
            continue
        wanted.setdefault(key, []).append((offset, e.stored_nbytes[pos], i))
    reads: list[_RangeRead | None] = [None] * len(jobs)
    for key, chunks in wanted.items():
        chunks.sort()
        runs, run = [], [chunks[0]]
        for c in chunks[1:]:
            start, end, first = run[0][0], run[-1][0] + run[-1][1], run[0][2]
            if (c[0] - end > MAX_GAP_BYTES or c[0] + c[1] - start > MAX_RANGE_BYTES
                    or abs(applied[c[2]] - applied[first]) > RANGE_SPREAD_BYTES):
                runs.append(run)
                run = []
            run.append(c)
        runs.append(run)
        for run in runs:
            r = _RangeRead(root, key, run[0][0], max(o + n for o, n, _ in run), len(run))
            for _, _, j in run:
                reads[j] = r
    return reads


Payload = np.ndarray | HeldCoded  # a verified chunk: its bits, or a HeldCoded chunk to decode against the held bits
Streamed = Generator[tuple[Manifest, TensorEntry, int, Payload], None, None]


@overload
def stream_chunks(root: Root, jobs: Iterable[ChunkJob], workers: int = ..., window: int | None = ...,
                  unchecked: None = ...) -> Streamed: ...


@overload
def stream_chunks(root: Root, jobs: Iterable[ChunkJob], workers: int = ..., window: int | None = ..., *,
                  unchecked: Callable[[Manifest, TensorEntry], bool]
                  ) -> Generator[tuple[Manifest, TensorEntry, int, Payload | UncheckedChunk], None, None]: ...


def stream_chunks(root: Root, jobs: Iterable[ChunkJob], workers: int = IO_WORKERS, window: int | None = None,
                  unchecked: Callable[[Manifest, TensorEntry], bool] | None = None
                  ) -> Generator[tuple[Manifest, TensorEntry, int, Payload | UncheckedChunk], None, None]:
    """Fetch and verify chunks in the order of ``jobs``, reading ahead across tensors and steps
    with at most ``window`` chunks in flight (default ``2 * workers``): memory stays bounded, and
    many small tensors do not cost one round trip each. Packed chunks are read by coalesced ranged
    GETs (``_plan_ranges``: GETs follow the bytes pulled, not the chunks), each started when the
    first chunk it holds is admitted. Chunks of the entries ``unchecked`` picks come as
    ``UncheckedChunk`` (the caller verifies what it builds from them)."""
    jobs = list(jobs)
    reads = _plan_ranges(root, jobs)
    workers = root.backend.read_workers(workers)
    window = max(1, window or 2 * workers)
    pending: deque = deque()
    with BoundedPool(workers, window=window + 1, name="dcr-get") as pool, \
            BoundedPool(workers, window=window + 1, name="dcr-range") as ranges:
        try:
            for (m, e, pos), read in zip(jobs, reads):
                if len(pending) >= window:
                    yield _next(pending)
                if read is not None:
                    read.submit(ranges)
                pending.append((m, e, pool.submit(read_chunk, root, m, e, pos,
                                                  unchecked is None or not unchecked(m, e), read)))
            while pending:
                yield _next(pending)
        finally:
            for _, _, f in pending:
                f.cancel()


def _next(pending: deque) -> tuple:
    m, e, fut = pending.popleft()
    index, payload = fut.result()
    return m, e, index, payload


def stored_positions(entry: TensorEntry, wanted: Container[int] | None = None) -> list[int]:
    """The stored positions of ``entry`` whose chunk index is in ``wanted`` (None: all)."""
    if wanted is None:
        return list(range(entry.n_stored))
    return [p for p, index in enumerate(entry.stored_indices) if index in wanted]


def read_chunks(root: Root, manifest: Manifest, entries: dict[str, TensorEntry], workers: int = IO_WORKERS,
                positions: dict[str, list[int]] | None = None) -> dict[str, list[tuple[int, Payload]]]:
    """All stored chunks of ``entries`` (of ``manifest``; ``positions``: only these stored positions
    per tensor), verified, in stored-position order per tensor (main chunks in chunk order, then
    parts: apply position ``pos`` with ``entry.encoding_at(pos)``). Memory: everything read (for
    callers that must hold it all)."""
    names = [n for n in entries if entries[n].n_stored]
    out: dict[str, list[tuple[int, Payload]]] = {n: [] for n in names}
    jobs = ((manifest, entries[n], p) for n in names
            for p in (range(entries[n].n_stored) if positions is None else positions.get(n, range(entries[n].n_stored))))
    for _, e, index, payload in stream_chunks(root, jobs, workers):
        out[e.name].append((index, payload))
    return out
