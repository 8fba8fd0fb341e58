"""A streaming mirror (``dcr mirror --follow --stream``): forward an upstream attempt while it is written.

A ``Forwarder`` is the mirror's ``Prefetcher``: for each stream index of the attempt upstream
announces, it copies every chunk the index names to the same key downstream (each read and
checked against the index first: size, codec, payload digest), then writes the index downstream,
after announcing the attempt in the downstream ``building.json``. So the mirror's own followers
(receivers, mirrors below it) stream from it as it streams from upstream: a streaming tree.
Nothing is committed here: once the upstream marker exists, ``mirror_step`` copies what is still
missing (manifest, Zarr metadata, chunks not forwarded yet) and then the marker, as for any step.
An attempt that loses upstream is never committed downstream (``mirror_step`` copies the attempt
the upstream marker names); its forwarded objects stay invisible until ``dcr gc`` collects them.
"""

from __future__ import annotations

import dataclasses

from dcr_core import events
from storage import layout
from storage.catalog import utc_now
from storage.chunk_io import BoundedPool
from storage.prefetch import Prefetcher
from storage.root import Root
from storage.stream import Building, StreamedChunk, StreamIndex


class Forwarder(Prefetcher):
    def __init__(self, src: Root, dst: Root, step: int, attempt: str, workers: int = 8, trusted=None):
        super().__init__(src, step, attempt, workers=workers, trusted=trusted)
        self.dst = dst

    def begin(self) -> None:
        self.dst.write(layout.BUILDING, Building(self.step, self.attempt, utc_now()).to_json())

    def take(self, idx: StreamIndex, pool: BoundedPool) -> bool:
        admitted = []  # the rest: copied by mirror_step after the commit
        for c in idx.chunks:
            if self.admits(c) and not c.pack:  # a pack is copied whole, checked, after the commit
                admitted.append(c)
            else:
                self.skipped += 1
                events.reached("stream.chunk-skipped", tensor=c.tensor)
        futures = [pool.submit(self.forward, layout.store_key(self.step, self.attempt, c.key_in_store), idx, c)
                   for c in admitted]
        for f in futures:
            f.result()  # a chunk that fails its check ends the forwarding; mirror_step copies it after the commit
        if len(admitted) < len(idx.chunks):  # downstream followers get an index of what is there
            idx = dataclasses.replace(idx, chunks=tuple(admitted))
        self.dst.write(layout.stream_key(self.step, self.attempt, idx.seq), idx.to_json())
        events.reached("mirror.index-forwarded", step=self.step, seq=idx.seq, chunks=len(idx.chunks))
        return not self.stopped.is_set()

    def forward(self, key: str, idx: StreamIndex, c: StreamedChunk) -> int:
        data = self.fetch(key, idx, c)
        self.dst.write(key, data)
        return len(data)
