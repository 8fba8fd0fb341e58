"""Streaming during construction: what a publisher exposes while it writes a step.

    ROOT/building.json                                            the step being written now
    ROOT/steps/<step>/attempts/<attempt>/stream/<k:06d>.json      the k-th index of chunks stored so far

A publisher announces its attempt in ``building.json`` before its first chunk, then, while it
uploads, writes numbered stream indexes into the attempt: each lists chunks whose upload has
finished (array, tensor, dtype, shapes, chunk index, payload digest, stored bytes). The last index
says so (``last``) and is written before the manifest. A receiver that follows ROOT reads
``building.json`` (one GET of a known key), then indexes ``0, 1, 2, ...`` (GETs of known keys: nobody
lists the bucket in a loop), and fetches and verifies the chunks they name while the publisher is
still writing (``storage.prefetch``).

None of this is trusted for applying anything: ``building.json`` is a hint (any publisher of the
ROOT overwrites it; a stale or forged one costs a receiver some wasted reads, never its state), and
an index only says where to look early. What a receiver applies is decided, as for every refit, by
the commit marker and the manifest it names: a prefetched chunk is used only if the committed
manifest lists the same object with the same digest, and it is decoded and checked against that
digest like any chunk (``storage.chunk_io.read_chunk``). An attempt that loses (or never commits)
is never named by a marker, so nothing prefetched from it is ever used.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from dcr_core import events
from dcr_core.chunking import ChunkGrid, grid_of
from dcr_core.codec import CodecSpec
from dcr_core.dtypes import DTYPES
from dcr_core.errors import DCRError, IntegrityError
from storage import layout
from storage.catalog import utc_now
from storage.chunk_io import StoredChunk
from storage.document_fields import (
    document,
    fail,
    parse_attempt,
    parse_codec,
    parse_columns,
    parse_digest,
    parse_int,
    parse_shape,
)
from storage.manifest import MAX_PACK_BYTES
from storage.root import Root

log = logging.getLogger("dcr.stream")

BUILDING_FORMAT = "dcr-building"
INDEX_FORMAT = "dcr-stream-index"
MAX_BUILDING_BYTES = 4096
MAX_INDEX_BYTES = 64 << 20
MAX_INDEX_CHUNKS = 1 << 20
FLUSH_SECONDS = 0.1  # a publisher writes an index at most this often while chunks keep landing


@dataclass(frozen=True)
class Building:
    """``building.json``: a publisher is writing ``step`` into ``attempt`` (a hint, see the module doc)."""

    step: int
    attempt: str
    started_at: str = ""

    def to_json(self) -> bytes:
        return json.dumps({"format": BUILDING_FORMAT, "step": self.step, "attempt": self.attempt,
                           "started_at": self.started_at}).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Building:
        d = document(data, where, BUILDING_FORMAT, f"{BUILDING_FORMAT} document")
        return cls(parse_int(d.get("step"), where, 0, layout.MAX_STEP), parse_attempt(d.get("attempt"), where),
                   str(d.get("started_at", ""))[:64])


@dataclass(frozen=True, slots=True)
class StreamedChunk:
    """One stored chunk named by a stream index: where it is and what verifies it."""

    tensor: str
    dtype: str
    grid: ChunkGrid
    key_in_store: str
    index: int
    digest: str
    nbytes: int
    pack: str = ""  # packed steps: the pack holding it, at ``offset``
    offset: int = 0
    pack_bytes: int = 0  # packed steps: the size of that pack (0: not announced; it is then not forwarded early)

    def location(self, step: int, attempt: str) -> tuple[str, int | None]:
        """The object holding the chunk, and its offset there (None: the whole object)."""
        if self.pack:
            return layout.store_key(step, attempt, layout.pack_key(self.pack)), self.offset
        return layout.store_key(step, attempt, self.key_in_store), None


@dataclass(frozen=True)
class StreamIndex:
    step: int
    attempt: str
    seq: int
    codec: CodecSpec
    chunks: tuple[StreamedChunk, ...]
    last: bool

    def to_json(self) -> bytes:
        arrays: dict[str, dict] = {}
        for c in self.chunks:
            array = c.key_in_store.split("/", 1)[0]
            a = arrays.setdefault(array, {"tensor": c.tensor, "dtype": c.dtype, "shape": list(c.grid.shape),
                                          "chunk_shape": list(c.grid.chunk_shape), "indices": [], "digests": [],
                                          "nbytes": []})
            a["indices"].append(c.index)
            a["digests"].append(c.digest)
            a["nbytes"].append(c.nbytes)
            if c.pack:
                a.setdefault("pack", []).append(c.pack)
                a.setdefault("offset", []).append(c.offset)
                a.setdefault("pack_bytes", []).append(c.pack_bytes)
        return json.dumps({"format": INDEX_FORMAT, "step": self.step, "attempt": self.attempt, "seq": self.seq,
                           "codec": self.codec.to_dict(), "last": self.last, "arrays": arrays}).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> StreamIndex:
        d = document(data, where, INDEX_FORMAT, f"{INDEX_FORMAT} document")
        codec = parse_codec(d.get("codec"), where)
        arrays = d.get("arrays")
        if not isinstance(arrays, dict) or not isinstance(d.get("last"), bool):
            raise fail(where, "arrays must be an object and last a boolean")
        chunks: list[StreamedChunk] = []
        for array, a in arrays.items():
            chunks += _array_chunks(layout.check_segment(array, f"{where} array"), a, f"{where} array {array!r}")
            if len(chunks) > MAX_INDEX_CHUNKS:
                raise fail(where, f"more than {MAX_INDEX_CHUNKS} chunks")
        return cls(parse_int(d.get("step"), where, 0, layout.MAX_STEP), parse_attempt(d.get("attempt"), where),
                   parse_int(d.get("seq"), where, 0, 10**6 - 1), codec, tuple(chunks), d["last"])


def _array_chunks(array: str, a: Any, what: str) -> list[StreamedChunk]:
    if not isinstance(a, dict) or a.get("dtype") not in DTYPES or not isinstance(a.get("tensor"), str):
        raise fail(what, "needs a tensor name and a supported dtype")
    try:
        grid = grid_of(parse_shape(a.get("shape"), what), parse_shape(a.get("chunk_shape"), what))
    except IntegrityError as e:
        raise fail(what, str(e)) from None
    indices, digests, nbytes = parse_columns(a, what, "chunks", "indices", "digests", "nbytes")
    packs, offsets, sizes = a.get("pack"), a.get("offset"), a.get("pack_bytes")
    if packs is None and offsets is None and sizes is None:
        packs, offsets, sizes = [""] * len(indices), [0] * len(indices), [0] * len(indices)
    elif not isinstance(packs, list) or not isinstance(offsets, list) or not len(packs) == len(offsets) == len(indices):
        raise fail(what, "pack and offset must be lists as long as indices")
    elif sizes is not None and (not isinstance(sizes, list) or len(sizes) != len(indices)):
        raise fail(what, "pack_bytes must be a list as long as indices")
    else:
        packs = [layout.check_pack(p) for p in packs]
        sizes = [0] * len(indices) if sizes is None else sizes  # an index from before pack sizes were announced
    out = []
    for i, dg, nb, pk, off, size in zip(indices, digests, nbytes, packs, offsets, sizes):
        index = parse_int(i, what, 0, grid.n_chunks - 1)
        nb, off = parse_int(nb, what, 1, 1 << 34), parse_int(off, what, 0, 1 << 40)
        # a chunk lies inside its pack, whose size is at most what a manifest allows (0: not announced)
        size = parse_int(size, what, 0, MAX_PACK_BYTES)
        if size and off + nb > size:
            raise fail(what, f"chunk {index} ends at byte {off + nb} of a {size}-byte pack")
        out.append(StreamedChunk(a["tensor"], a["dtype"], grid, layout.chunk_key(array, grid.grid_index(index)),
                                 index, parse_digest(dg, what), nb, pk, off, size))
    return out


def read_building(root: Root) -> Building | None:
    """What ``building.json`` says, or None (absent, unreadable or malformed: it is only a hint)."""
    try:
        return Building.from_json(root.read(layout.BUILDING, limit=MAX_BUILDING_BYTES),
                                  f"{root.url}/{layout.BUILDING}")
    except FileNotFoundError:
        return None
    except (DCRError, OSError) as e:
        log.info("ignoring %s/%s: %s", root.url, layout.BUILDING, e)
        return None


def read_index(root: Root, step: int, attempt: str, seq: int) -> StreamIndex | None:
    """Stream index ``seq`` of the attempt, or None while it does not exist; a malformed one (or
    one that names another step, attempt or position) raises ``IntegrityError``."""
    key = layout.stream_key(step, attempt, seq)
    try:
        data = root.read(key, limit=MAX_INDEX_BYTES)
    except FileNotFoundError:
        return None
    return index_at(data, f"{root.url}/{key}", step, attempt, seq)


def index_at(data: bytes, where: str, step: int, attempt: str, seq: int) -> StreamIndex:
    """The stream index ``data`` holds, which must be index ``seq`` of the attempt (else ``IntegrityError``)."""
    idx = StreamIndex.from_json(data, where)
    if (idx.step, idx.attempt, idx.seq) != (step, attempt, seq):
        raise fail(where, f"names step {idx.step} attempt {idx.attempt} index {idx.seq}")
    return idx


@dataclass
class StreamAnnouncer:
    """The publisher's half: announce the attempt, then write an index of the chunks stored so far
    at most every ``FLUSH_SECONDS`` (from a thread of its own, so uploads never wait for it), and
    the last index on ``finish``. Use as a context manager around the uploads; an exception stops
    it without a last index (receivers then just never see a commit for this attempt)."""

    root: Root
    step: int
    attempt: str
    codec: CodecSpec
    period: float = FLUSH_SECONDS
    seq: int = 0
    _ready: list[StreamedChunk] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _wake: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _error: BaseException | None = None

    def __enter__(self) -> StreamAnnouncer:
        self.root.write(layout.BUILDING, Building(self.step, self.attempt, utc_now()).to_json())
        self._thread = threading.Thread(target=self._run, name="dcr-stream", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def stored(self, tensor: str, dtype: str, grid: ChunkGrid, key_in_store: str, chunk: StoredChunk) -> None:
        """A chunk's upload finished (called from the upload threads)."""
        with self._lock:
            self._ready.append(StreamedChunk(tensor, dtype, grid, key_in_store, chunk.index, chunk.digest,
                                             chunk.nbytes, chunk.pack, chunk.offset, chunk.pack_bytes))

    def finish(self) -> None:
        """Every chunk is stored: write what is left as the last index."""
        self._stop()
        if self._error is not None:
            raise self._error
        self._flush(last=True)

    def _stop(self) -> None:
        if self._thread is not None:
            self._wake.set()
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        try:
            while not self._wake.wait(self.period):
                self._flush(last=False)
        except BaseException as e:  # noqa: BLE001 - reported by finish(): the publish fails rather than stream half
            self._error = e

    def _flush(self, last: bool) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
        if not ready and not last:
            return
        idx = StreamIndex(self.step, self.attempt, self.seq, self.codec, tuple(ready), last)
        self.root.write(layout.stream_key(self.step, self.attempt, self.seq), idx.to_json())
        events.reached("stream.index-written", step=self.step, seq=self.seq, chunks=len(ready), last=last)
        self.seq += 1
