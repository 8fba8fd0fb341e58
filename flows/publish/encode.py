"""Encoding a publish: every tensor chunk by chunk into the attempt's Zarr store, streamed.

Per tensor: read its bits (and the baseline's), XOR per chunk (or take the values of a keyframe),
skip chunks that are all zero, compress and upload the rest on a bounded pool while later tensors
are still being encoded. Memory: one tensor of the source and of a file baseline at a time, plus
the upload window. Nothing is visible to readers yet: no marker names the attempt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from concurrent.futures import Future

from dcr_core import events
from dcr_core.chain import KEYFRAME
from dcr_core.chunking import ChunkGrid, choose_chunk_shape
from dcr_core.delta import Encoding, choose_encoding, count_changed, encode_chunks
from dcr_core.digest import tensor_digest
from dcr_core.dtypes import DTYPES
from dcr_core.errors import IntegrityError, SchemaMismatchError
from flows.publish.plan import PublishPlan
from flows.publish.sources import SourceRef, opened
from storage import layout
from storage.chunk_io import StepWriter, StoredChunk
from storage.manifest import ChunkTable, TensorEntry
from storage.root import open_root
from storage.stream import StreamAnnouncer


def _chunk_table(futures: list[Future]) -> ChunkTable:
    stored: list[StoredChunk] = sorted((f.result() for f in futures), key=lambda s: s.index)
    return ChunkTable(tuple(s.index for s in stored), tuple(s.digest for s in stored), tuple(s.nbytes for s in stored))


def _unique(array: str, used: set[str]) -> str:
    while array in used:  # two names escaping alike: keep arrays distinct
        array += "_"
    used.add(array)
    return array


def encode_and_write(plan: PublishPlan, source: SourceRef, baseline: SourceRef | None) -> dict[str, TensorEntry]:
    """Encode every tensor and upload its stored chunks; return the manifest entries.

    ``baseline``: a file (checked tensor by tensor against the base step's digests as it is read:
    a file can change after it was verified) or a held in-memory snapshot (not re-checked, see
    ``flows.publish.baseline``)."""
    opts = plan.options
    stack = contextlib.ExitStack()
    src = stack.enter_context(opened(source))
    if src.infos != plan.infos:
        stack.close()
        raise SchemaMismatchError(f"{src.path}: its tensors changed after the publish was planned; publish again")
    base_entries = plan.base_entries()
    from_file = isinstance(baseline, str)
    base_src = None if baseline is None else stack.enter_context(opened(baseline))
    pending: list[tuple[dict, Future, list[Future]]] = []
    used: set[str] = set()
    root = open_root(plan.root)
    announcer = stack.enter_context(StreamAnnouncer(root, plan.step, plan.attempt, plan.codec)) if opts.stream else None
    with stack, StepWriter(root, plan.step, plan.attempt, plan.codec, workers=opts.io_workers) as w:
        w.write_group({"dcr": {"step": plan.step, "kind": plan.kind, "base_step": plan.base_step}})
        for name in sorted(plan.infos):
            info = plan.infos[name]
            new = src.bits(name)
            grid = ChunkGrid(info.shape, choose_chunk_shape(info.shape, DTYPES[info.dtype].itemsize, opts.chunk_bytes))
            base = None
            if plan.kind == KEYFRAME:
                encoding = Encoding.FULL
            else:
                base = base_src.bits(name)
                if from_file and not base_entries[name].matches(base):
                    raise IntegrityError(f"{baseline}: tensor {name!r} changed since it was verified")
                if opts.overwrite_above >= 1.0:
                    encoding = Encoding.XOR  # the default: no extra pass to count changes first
                else:
                    encoding = choose_encoding(count_changed(new, base), new.size, opts.overwrite_above)
            array = _unique(layout.array_segment(name), used)
            changed = 0
            chunk_futs = []
            announce = None if announcer is None else functools.partial(announcer.stored, name, info.dtype, grid)
            for c in encode_chunks(new, base, grid, encoding):
                changed += c.changed
                held = None  # the old bits of the chunk, for codecs that code masks against them
                if encoding is Encoding.XOR and plan.codec.conditional:
                    held = base[slice(*grid.chunk_range(c.index))]
                chunk_futs.append(w.write_chunk(array, grid, c.index, c.payload, announce, held, info.dtype))
            if encoding is Encoding.XOR and not changed:
                encoding = Encoding.UNCHANGED
            attrs = {"dcr": {"tensor": name, "dtype": info.dtype, "encoding": encoding.value, "step": plan.step}}
            meta = {
                "name": name, "dtype": info.dtype, "shape": info.shape, "digest": tensor_digest(new),
                "encoding": encoding, "array": array, "chunk_shape": grid.chunk_shape,
                "base_digest": None if base is None else base_entries[name].digest, "changed": changed,
            }
            pending.append((meta, w.write_array(array, info.shape, grid.chunk_shape, info.dtype, attrs), chunk_futs))
            events.reached("tensor.done", name=name, nbytes=new.nbytes)
        entries = {}
        for meta, array_fut, chunk_futs in pending:
            table = _chunk_table(chunk_futs)
            array_fut.result()
            entries[meta["name"]] = TensorEntry(chunks=table, **meta)
        if announcer is not None:
            announcer.finish()  # the last index, before the manifest: followers know they have it all
    events.reached("publish.tensors-stored", step=plan.step, tensors=len(entries))
    return entries


def write_snapshot(plan: PublishPlan, source: SourceRef, entries: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """Store a full copy of the step beside its delta, in the same attempt (keyframe policy): new
    and far-behind receivers start from it, up-to-date receivers keep pulling only the delta.

    Arrays are named ``<tensor array>.full`` (kept distinct from every delta array); chunks use the
    delta codec, whose dense form stores values as byte planes. One tensor at a time."""
    used = {e.array for e in entries.values()}
    out: dict[str, TensorEntry] = {}
    opts = plan.options
    with opened(source) as src, StepWriter(open_root(plan.root), plan.step, plan.attempt, opts.delta_codec,
                                           workers=opts.io_workers) as w:
        pending = []
        for name in sorted(plan.infos):
            info, e = plan.infos[name], entries[name]
            new = src.bits(name)
            if not e.matches(new):
                raise IntegrityError(f"{plan.source_name or 'source'}: tensor {name!r} changed while publishing")
            array = _unique(e.array + layout.SNAPSHOT_SUFFIX, used)
            grid = ChunkGrid(info.shape, e.chunk_shape)
            attrs = {"dcr": {"tensor": name, "dtype": info.dtype, "encoding": Encoding.FULL.value,
                             "step": plan.step, "snapshot": True}}
            array_fut = w.write_array(array, info.shape, grid.chunk_shape, info.dtype, attrs)
            futs = [w.write_chunk(array, grid, c.index, c.payload, dtype=info.dtype)
                    for c in encode_chunks(new, None, grid, Encoding.FULL)]
            pending.append((e, array, array_fut, futs))
        for e, array, array_fut, futs in pending:
            table = _chunk_table(futs)
            array_fut.result()
            out[e.name] = dataclasses.replace(
                e, encoding=Encoding.FULL, array=array, chunks=table, base_digest=None, changed=0, parts=None
            )
    return out


