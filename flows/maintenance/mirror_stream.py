"""A streaming mirror (``dcr mirror --follow --stream``): forward an upstream attempt while it is written.

A ``Forwarder`` is the mirror's ``Prefetcher``: for each stream index of the attempt upstream
announces, it copies what the index names to the same key downstream, each read and checked
against the index first (size, codec, payload digest of every chunk), then writes downstream an
index of what it forwarded, after announcing the attempt in the downstream ``building.json``. So
the mirror's own followers (receivers, mirrors below it) stream from it as it streams from
upstream: a streaming tree. A chunk that is its own object is forwarded as its index names it. A
packed step's pack is forwarded whole once the chunks announced of it (across indexes, each with
the pack's size) tile it exactly: one read of at most that size, every chunk in it checked, then
the pack and an index listing its chunks; a pack its announced chunks do not tile (a forged or
partial announcement), or larger than ``MAX_FORWARD_PACK_BYTES``, is not forwarded early.
Nothing is committed here: once the upstream marker exists, ``mirror_step`` copies what is still
missing (manifest, Zarr metadata, chunks and packs not forwarded yet) and then the marker, as for
any step; a forwarded pack is read back there and checked against the manifest. An attempt that
loses upstream is never committed downstream (``mirror_step`` copies the attempt the upstream
marker names); its forwarded objects stay invisible until ``dcr gc`` collects them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dcr_core import events
from dcr_core.codec import CodecSpec
from dcr_core.errors import IntegrityError
from storage import layout
from storage.catalog import utc_now
from storage.chunk_io import IO_WORKERS, MAX_RANGE_BYTES, BoundedPool
from storage.prefetch import Prefetcher
from storage.root import Root
from storage.stream import MAX_INDEX_CHUNKS, Building, StreamedChunk, StreamIndex

# The largest pack forwarded before the commit (packs are sealed at 8 MiB by default): a forwarded
# pack is held whole while it is checked, so the forwarding holds at most ``workers`` of these.
MAX_FORWARD_PACK_BYTES = MAX_RANGE_BYTES


@dataclass
class _Pack:
    """The chunks announced so far of one pack (all under one codec and one pack size), by offset."""

    size: int
    codec: CodecSpec
    chunks: dict[int, StreamedChunk] = field(default_factory=dict)
    held: int = 0  # their bytes

    def tiled(self) -> bool:
        """Whether the chunks cover ``[0, size)`` exactly, back to back (none overlapping, no gap)."""
        end = 0
        for offset in sorted(self.chunks):
            if offset != end:
                return False
            end += self.chunks[offset].nbytes
        return end == self.size


class Forwarder(Prefetcher):
    def __init__(self, src: Root, dst: Root, step: int, attempt: str, workers: int = IO_WORKERS, trusted=None):
        super().__init__(src, step, attempt, workers=workers, trusted=trusted)
        self.dst = dst
        self._packs: dict[str, _Pack] = {}  # packs announced in part so far
        self._pending = 0  # chunks held in them: at most MAX_INDEX_CHUNKS (one more index's worth)
        self._closed: set[str] = set()  # packs forwarded, or never to be (see ``_gather``)

    def begin(self) -> None:
        self.dst.write(layout.BUILDING, Building(self.step, self.attempt, utc_now()).to_json())

    def take(self, idx: StreamIndex, pool: BoundedPool) -> bool:
        objects, ready = [], []  # what is not forwarded: copied by mirror_step after the commit
        for c in idx.chunks:
            if not self.admits(c) or (c.pack and not self._gather(idx.codec, c, ready)):
                self.skipped += 1
                events.reached("stream.chunk-skipped", tensor=c.tensor)
            elif not c.pack:
                objects.append(c)
        futures = [pool.submit(self.forward, layout.store_key(self.step, self.attempt, c.key_in_store), idx, c)
                   for c in objects]
        futures += [pool.submit(self.forward_pack, name, p) for name, p in ready]
        for f in futures:
            f.result()  # a chunk that fails its check ends the forwarding; mirror_step copies it after the commit
        listed = objects + [p.chunks[o] for _, p in ready for o in sorted(p.chunks)]  # a pack's chunks in its order
        idx = dataclasses.replace(idx, chunks=tuple(listed))  # downstream followers get an index of what is there
        self.dst.write(layout.stream_key(self.step, self.attempt, idx.seq), idx.to_json())
        events.reached("mirror.index-forwarded", step=self.step, seq=idx.seq, chunks=len(idx.chunks))
        return not self.stopped.is_set()

    def _gather(self, codec: CodecSpec, c: StreamedChunk, ready: list[tuple[str, _Pack]]) -> bool:
        """Add packed chunk ``c`` (announced under ``codec``) to its pack; once the pack's chunks tile
        it, the pack goes to ``ready``. False (the chunk is not forwarded) when its pack is not to be
        forwarded early: its size unknown (an index from before sizes were announced) or above
        ``MAX_FORWARD_PACK_BYTES``, forwarded already, or announced inconsistently (another size or
        codec, a chunk at an offset taken, chunks that overlap or pass its end): a forged or
        partial announcement, so the whole pack is left to ``mirror_step``."""
        if c.pack in self._closed or not 0 < c.pack_bytes <= MAX_FORWARD_PACK_BYTES:
            return False
        p = self._packs.setdefault(c.pack, _Pack(c.pack_bytes, codec))
        if (p.size, p.codec) != (c.pack_bytes, codec) or c.offset in p.chunks or self._pending >= MAX_INDEX_CHUNKS:
            self._close(c.pack)
            return False
        p.chunks[c.offset] = c
        p.held += c.nbytes
        self._pending += 1
        if p.held >= p.size:
            self._close(c.pack)
            if not p.tiled():
                return False
            ready.append((c.pack, p))
        return True

    def _close(self, name: str) -> None:
        p = self._packs.pop(name, None)
        if p is not None:
            self._pending -= len(p.chunks)
        self._closed.add(name)

    def forward(self, key: str, idx: StreamIndex, c: StreamedChunk) -> int:
        data = self.fetch(key, idx, c)
        self.dst.write(key, data)
        return len(data)

    def forward_pack(self, name: str, p: _Pack) -> int:
        """Read pack ``name`` (at most the size announced), check every chunk in it, write it downstream."""
        key = layout.store_key(self.step, self.attempt, layout.pack_key(name))
        if self.stopped.is_set():
            raise IntegrityError(f"{self.root.url}/{key}: forwarding stopped")
        data = self.root.read(key, limit=p.size)  # a larger object is refused having read at most that
        if len(data) != p.size:
            raise IntegrityError(f"{self.root.url}/{key}: pack is {len(data)} bytes, its stream index says {p.size}")
        for offset, c in p.chunks.items():
            self.check(layout.range_ident(key, offset), p.codec, c, data[offset:offset + c.nbytes])
        self.dst.write(key, data)
        events.reached("mirror.pack-forwarded", key=key, nbytes=len(data), chunks=len(p.chunks))
        return len(data)
