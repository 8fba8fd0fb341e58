"""The receiver's half of streaming: fetch and verify an attempt's chunks while it is being written.

A ``Prefetcher`` (one thread) reads the attempt's stream indexes in order (``storage.stream``),
fetches every chunk they name on a bounded pool, checks it against the index (size, decodes under
the codec, payload digest) and holds its stored bytes in ``storage.held_chunks.PREFETCHED``, where the
refit that follows the commit takes them (``read_chunk``, which uses them only for a manifest entry
asking for exactly that digest). After the last index it watches for the step's commit marker (one
HEAD of a known key per poll) and sets ``committed``, so a follower wakes at once. It never applies
anything and never decides what is committed: a chunk that fails its check is not held (the refit
reads it itself, and refuses it if it is bad), and an index that cannot be parsed ends the
prefetch (everything else is read after the commit, as without streaming). Nor does it allocate
for what an index alone claims: only chunks of the schema and chunk grid of the step the follower
holds (signed, committed) are fetched and decoded (``admits``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from concurrent.futures import Future

from dcr_core import events
from dcr_core.chunking import ChunkGrid
from dcr_core.codec import CodecSpec
from dcr_core.dtypes import DTYPES
from dcr_core.errors import DCRError, IntegrityError
from storage import layout
from storage.chunk_io import IO_WORKERS, MAX_RANGE_BYTES, BoundedPool, decode_chunk, payload_digest, verified_as
from storage.held_chunks import PREFETCHED, Prefetched
from storage.marker import MAX_MARKER_BYTES
from storage.root import Root
from storage.stream import StreamedChunk, StreamIndex, read_index

log = logging.getLogger("dcr.stream")
COMMIT_POLL = 0.05  # seconds between looks for the marker once the last index is read


def marker_exists(root: Root, step: int) -> bool:
    """Whether step ``step``'s commit marker exists: one GET (on S3 a HEAD of a missing key costs a
    listing as well). Nothing of it is trusted: the refit reads and checks the marker itself."""
    try:
        root.read(layout.commit_key(step), limit=MAX_MARKER_BYTES)
    except FileNotFoundError:
        return False
    return True


class Prefetcher:
    """``Prefetcher(root, step, attempt).start()``; ``stop()`` ends it, ``close()`` also drops what
    it holds. ``committed`` is set once the step's marker exists (whatever attempt it names)."""

    def __init__(self, root: Root, step: int, attempt: str, store: Prefetched = PREFETCHED, workers: int = IO_WORKERS,
                 poll: float = 0.02, max_poll: float = 0.2, trusted: Mapping[str, tuple[str, ChunkGrid]] | None = None):
        self.root, self.step, self.attempt, self.store = root, step, attempt, store
        # What a chunk may decode to, from a committed (signed) step: tensor -> (dtype, grid). See
        # ``admits``: nothing an index alone claims is allocated.
        self.trusted = dict(trusted or {})
        self.skipped = 0  # chunks not prefetched: outside what is trusted (the refit reads them after the commit)
        self.workers, self.poll, self.max_poll = workers, poll, max_poll
        self.committed = threading.Event()
        self.stopped = threading.Event()
        self.indexes = 0
        self.chunks = 0
        self.bytes = 0
        self.error: str | None = None
        self._count = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"dcr-prefetch-{step}", daemon=True)

    @property
    def prefix(self) -> str:
        return layout.attempt_dir(self.step, self.attempt) + "/"

    def start(self) -> Prefetcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def close(self) -> None:
        """Stop, and drop every chunk of this attempt still held."""
        self.stop()
        self.store.drop(self.root.url, self.prefix)

    @property
    def active(self) -> bool:
        """Still fetching or watching for the commit."""
        return self._thread.is_alive() and not self.committed.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the commit; True if it is there."""
        return self.committed.wait(timeout)

    def begin(self) -> None:
        """Called first in the thread (a ``Forwarder`` announces the attempt downstream)."""

    def _run(self) -> None:
        try:
            self.begin()
            with BoundedPool(self.workers, name="dcr-prefetch") as pool:
                self._follow_indexes(pool)
            self._await_commit()
        except (DCRError, OSError) as e:  # ends streaming only: the refit reads what is missing itself
            self.error = f"{type(e).__name__}: {e}"
            log.warning("streaming step %d stopped: %s", self.step, self.error)

    def _sleep(self, delay: float) -> float:
        self.stopped.wait(delay)
        return min(self.max_poll, delay * 2)

    def _is_committed(self) -> bool:
        if not self.committed.is_set() and marker_exists(self.root, self.step):
            self.committed.set()
        return self.committed.is_set()

    def _follow_indexes(self, pool: BoundedPool) -> None:
        seq, delay = 0, self.poll
        while not self.stopped.is_set():
            idx = read_index(self.root, self.step, self.attempt, seq)
            if idx is None:
                if self._is_committed():
                    return  # committed (maybe by another attempt) with no more indexes: done
                delay = self._sleep(delay)
                continue
            events.reached("stream.index-read", step=self.step, seq=seq, chunks=len(idx.chunks))
            self.indexes += 1
            if not self.take(idx, pool):
                return
            if idx.last:
                return
            seq, delay = seq + 1, self.poll

    def admits(self, c: StreamedChunk) -> bool:
        """Whether chunk ``c`` may be fetched and decoded before the commit: its tensor, dtype and
        chunk grid are those of the step the follower holds (a delta keeps its base's schema), and its
        stored size is within what a chunk of that grid can take. A stream index is a hint anyone
        who can write the bucket could forge: what it names beyond that is read after the commit,
        against the signed manifest. So decoding costs at most ``workers`` chunks of the held step's
        grid at a time, and holding at most the stored-bytes budget (``--stream-memory``)."""
        t = self.trusted.get(c.tensor)
        if t is None or t != (c.dtype, c.grid):
            return False
        raw = c.grid.chunk_numel * DTYPES[c.dtype].itemsize
        return c.nbytes <= 2 * raw + 4096  # a codec's frame around incompressible bits is far smaller

    def take(self, idx: StreamIndex, pool: BoundedPool) -> bool:
        """Start fetching the chunks ``idx`` names (those it ``admits``) into the store; False if
        stopped meanwhile."""
        run: list[StreamedChunk] = []  # packed chunks back to back in one pack: one ranged GET
        for c in idx.chunks:
            if not self.admits(c):
                self.skipped += 1
                events.reached("stream.chunk-skipped", tensor=c.tensor)
                continue
            if not self.store.reserve(c.nbytes, self.stopped):
                if run:  # reserved already: held as entries (failing: stopped), so that close() releases them
                    self._fetch_run(idx, run, pool)
                return False
            if c.pack:
                if run and (run[-1].pack != c.pack or run[-1].offset + run[-1].nbytes != c.offset
                            or c.offset + c.nbytes - run[0].offset > MAX_RANGE_BYTES):
                    self._fetch_run(idx, run, pool)
                    run = []
                run.append(c)
                continue
            key = layout.store_key(self.step, self.attempt, c.key_in_store)
            verified = verified_as(idx.codec, c.dtype, c.grid, c.index, c.digest, c.nbytes)
            self.store.put(self.root.url, key, verified, pool.submit(self.fetch, key, idx, c), c.nbytes)
        if run:
            self._fetch_run(idx, run, pool)
        return True

    def _fetch_run(self, idx: StreamIndex, run: list[StreamedChunk], pool: BoundedPool) -> None:
        """Fetch chunks that lie back to back in one pack with one ranged GET; each is checked and
        held on its own."""
        key = layout.store_key(self.step, self.attempt, layout.pack_key(run[0].pack))  # a run lies in one pack
        start = run[0].offset
        whole = pool.submit(self._read_range, key, start, run[-1].offset + run[-1].nbytes - start)
        for c in run:
            fut: Future = Future()

            def done(f: Future, c: StreamedChunk = c, fut: Future = fut) -> None:
                try:
                    data = f.result()[c.offset - start:c.offset - start + c.nbytes]
                    fut.set_result(self.check(layout.range_ident(key, c.offset), idx.codec, c, data))
                except BaseException as e:  # noqa: BLE001 - the chunk's future carries it to whoever takes it
                    fut.set_exception(e)

            whole.add_done_callback(done)
            verified = verified_as(idx.codec, c.dtype, c.grid, c.index, c.digest, c.nbytes)
            self.store.put(self.root.url, layout.range_ident(key, c.offset), verified, fut, c.nbytes)

    def _read_range(self, key: str, start: int, length: int) -> bytes:
        if self.stopped.is_set():
            raise IntegrityError(f"{self.root.url}/{key}: prefetch stopped")
        return self.root.read_range(key, start, length)

    def _await_commit(self) -> None:
        """After the last index the manifest and the marker are moments away: poll often (not so
        often that the polls load the store the publisher is writing to)."""
        while not self.stopped.is_set() and not self._is_committed():
            self.stopped.wait(COMMIT_POLL)

    def fetch(self, key: str, idx: StreamIndex, c: StreamedChunk) -> bytes:
        """Read one chunk and check it as the index describes it (runs on the pool)."""
        if self.stopped.is_set():
            raise IntegrityError(f"{self.root.url}/{key}: prefetch stopped")
        return self.check(key, idx.codec, c, self.root.read(key, limit=c.nbytes))

    def check(self, key: str, codec: CodecSpec, c: StreamedChunk, data: bytes) -> bytes:
        """``data``, once it decodes under ``codec`` (its index's) to a payload with the digest the index gives ``c``."""
        payload = decode_chunk(self.root.url, key, data, codec, c.dtype, c.grid, c.index, c.nbytes)
        if payload_digest(payload) != c.digest:
            raise IntegrityError(f"{self.root.url}/{key}: chunk digest does not match its stream index")
        with self._count:
            self.chunks += 1
            self.bytes += len(data)
        events.reached("stream.chunk-prefetched", key=key, nbytes=len(data))
        return data
