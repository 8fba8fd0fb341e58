"""Chunk objects of one step's Zarr store: bounded-parallel writes and verified reads.

Writers compress, digest and upload chunks on a thread pool with a bounded number in flight, so
uploading starts while later tensors are still being encoded and memory stays bounded. Readers
fetch chunks in parallel, decompress into buffers of exactly the expected size and check each
chunk's digest before returning anything; a bad chunk raises an error naming its object.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from dcr_core.chunking import ChunkGrid
from dcr_core.codec import CodecSpec
from dcr_core.delta import pad
from dcr_core.digest import chunk_digest
from dcr_core.dtypes import DTYPES
from dcr_core.errors import IntegrityError
from storage import layout, zarr_meta
from storage.manifest import Manifest, TensorEntry
from storage.root import Root


@dataclass(frozen=True, slots=True)
class StoredChunk:
    index: int
    digest: str
    nbytes: int


class StepWriter:
    """Writes one attempt's Zarr store. Use as a context manager; ``close`` waits for all uploads."""

    def __init__(self, root: Root, step: int, attempt: str, codec: CodecSpec, workers: int = 8):
        self.root = root
        self.prefix = layout.store_dir(step, attempt)
        self.codec = codec
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="dcr-put")
        self._slots = threading.BoundedSemaphore(max(1, workers) * 2)
        self.bytes_written = 0
        self._lock = threading.Lock()

    def __enter__(self) -> StepWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True, cancel_futures=exc[0] is not None)

    def write_group(self, attributes: dict) -> None:
        self.root.write(f"{self.prefix}/zarr.json", zarr_meta.group_json(attributes))

    def write_array(self, array: str, shape, chunk_shape, dtype: str, attributes: dict) -> Future:
        data = zarr_meta.array_json(tuple(shape), tuple(chunk_shape), dtype, self.codec, attributes)
        return self._submit(self.root.write, f"{self.prefix}/{array}/zarr.json", data)

    def write_chunk(self, array: str, grid: ChunkGrid, index: int, payload: np.ndarray) -> Future:
        """Compress, digest and upload one chunk; the future gives its StoredChunk."""
        key = f"{self.prefix}/{array}/{grid.chunk_key(index)}"

        def work() -> StoredChunk:
            data = self.codec.encode(pad(payload, grid.chunk_numel))
            self.root.write(key, data)
            with self._lock:
                self.bytes_written += len(data)
            return StoredChunk(index, chunk_digest(payload), len(data))

        return self._submit(work)

    def write_part(self, array: str, grid: ChunkGrid, slot: int, index: int, payload: np.ndarray) -> Future:
        """Compress, digest and upload one contributor's part of a shared chunk, at ``[slot, chunk]``
        of the parts array (shape ``(slots, *shape)``, chunks ``(1, *chunk_shape)``)."""
        key = f"{self.prefix}/{array}/" + "/".join(["c", str(slot), *map(str, grid.grid_index(index))])

        def work() -> StoredChunk:
            data = self.codec.encode(pad(payload, grid.chunk_numel))
            self.root.write(key, data)
            with self._lock:
                self.bytes_written += len(data)
            return StoredChunk(index, chunk_digest(payload), len(data))

        return self._submit(work)

    def _submit(self, fn, *args) -> Future:
        self._slots.acquire()
        fut = self._pool.submit(fn, *args)
        fut.add_done_callback(lambda _: self._slots.release())
        return fut


def chunk_object_key(manifest: Manifest, entry: TensorEntry, index: int) -> str:
    return f"{layout.store_dir(manifest.step, manifest.attempt)}/{entry.array}/{entry.grid.chunk_key(index)}"


def read_chunk(root: Root, manifest: Manifest, entry: TensorEntry, pos: int) -> tuple[int, np.ndarray]:
    """Fetch, decompress and verify the ``pos``-th stored chunk of ``entry`` (main chunks, then parts)."""
    rel, index, digest, nbytes = entry.stored_at(pos)
    key = f"{layout.store_dir(manifest.step, manifest.attempt)}/{rel}"
    grid = entry.grid
    try:
        data = root.read(key)
    except FileNotFoundError:
        raise IntegrityError(f"{root.url}/{key}: chunk listed in the manifest is missing") from None
    if len(data) != nbytes:
        raise IntegrityError(f"{root.url}/{key}: chunk is {len(data)} bytes, the manifest says {nbytes}")
    try:
        padded = manifest.codec.decode(data, DTYPES[entry.dtype].storage, grid.chunk_numel)
    except IntegrityError as e:
        raise IntegrityError(f"{root.url}/{key}: {e}") from None
    start, stop = grid.chunk_range(index)
    payload = padded[: stop - start]
    if chunk_digest(payload) != digest:
        raise IntegrityError(f"{root.url}/{key}: chunk digest does not match the manifest")
    return index, payload


def read_chunks(
    root: Root, manifest: Manifest, names: Iterable[str], workers: int = 8, entries: dict | None = None
) -> dict[str, list[tuple[int, np.ndarray]]]:
    """All stored chunks of the named tensors (of ``entries``, default the manifest's tensors),
    verified, in stored-position order (main chunks in chunk order, then parts; apply position
    ``pos`` with ``entry.encoding_at(pos)``)."""
    entries = manifest.tensors if entries is None else entries
    names = [n for n in names if entries[n].n_stored]
    out: dict[str, list[tuple[int, np.ndarray]]] = {n: [] for n in names}
    jobs = [(n, p) for n in names for p in range(entries[n].n_stored)]
    if not jobs:
        return out
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="dcr-get") as pool:
        futures = [(n, pool.submit(read_chunk, root, manifest, entries[n], p)) for n, p in jobs]
        try:
            for n, fut in futures:
                out[n].append(fut.result())
        except BaseException:
            for _, fut in futures:
                fut.cancel()
            raise
    return out



def stream_chunks(
    root: Root, jobs: Iterable[tuple[Manifest, TensorEntry, int]], workers: int = 8, window: int | None = None
) -> Iterator[tuple[Manifest, TensorEntry, int, np.ndarray]]:
    """Fetch and verify chunks in the order of ``jobs`` (manifest, entry, stored position), reading
    ahead across tensors and steps with at most ``window`` chunks in flight.

    Memory stays bounded by the window however large the model is, and many small tensors do not
    cost one round trip each: later chunks are already in flight while earlier ones are applied.
    """
    window = max(1, window or 2 * workers)
    it = iter(jobs)
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="dcr-get") as pool:
        pending: deque = deque()
        try:
            while True:
                while len(pending) < window:
                    job = next(it, None)
                    if job is None:
                        break
                    m, e, pos = job
                    pending.append((m, e, pool.submit(read_chunk, root, m, e, pos)))
                if not pending:
                    return
                m, e, fut = pending.popleft()
                index, payload = fut.result()
                yield m, e, index, payload
        finally:
            for _, _, f in pending:
                f.cancel()
