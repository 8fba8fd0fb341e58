"""Manifests: versioned, human-readable JSON with strict parsing.

A manifest describes one publish attempt of one step: every tensor of the policy (name, dtype,
shape, target digest), how its change is encoded, the chunk grid and, for every stored chunk, its
digest and stored size (``storage.marker``: the commit marker names the one attempt that is real
and binds its manifest by digest). Parsing checks every field's type and range before anything is used, so a
hostile or corrupted manifest fails with an error naming it instead of exhausting memory.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import operator
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dcr_core.bundles import Members
from dcr_core.chain import DELTA, KEYFRAME
from dcr_core.chunking import ChunkGrid, grid_of
from dcr_core.codec import CodecSpec
from dcr_core.delta import Encoding
from dcr_core.digest import (
    BLOCKS_SCHEME,
    DIGEST_ALGORITHM,
    FLAT,
    PIECES_SCHEME,
    DigestScheme,
    box_digest,
    pieces_digest,
    policy_digest,
)
from dcr_core.dtypes import DTYPES, TensorInfo
from dcr_core.errors import IntegrityError, UsageError
from dcr_core.shard_spec import Piece, c_strides, check_cover
from storage import layout
from storage.document_fields import (
    MAX_DIM,
    MAX_NDIM,
    all_digests,
    all_ints,
    dumps_line,
    fail,
    loads,
    parse_attempt,
    parse_codec,
    parse_columns,
    parse_digest,
    parse_int,
    parse_shape,
)

# Schema 2: tensor digests are block digests (``dcr_core.digest``, named by ``digest_scheme``).
# Schema 1 (flat digests) is still read, and written where a publisher asks for flat digests.
# Schema 3: chunks may be packed, many to an object (``packs``; ``storage.layout.pack_key``); its
# digest scheme is named as in schema 2, flat when absent. Written whenever a step holds a pack.
# Schema 4: schema 3 with bundles (``dcr_core.bundles``: small tensors of a dtype stored as one flat
# tensor; the ``bundles`` table names each bundle's members, their shapes and digests).
SCHEMA_VERSION = 2
FLAT_SCHEMA_VERSION = 1
PACKED_SCHEMA_VERSION = 3
BUNDLED_SCHEMA_VERSION = 4
READABLE_SCHEMA_VERSIONS = (FLAT_SCHEMA_VERSION, SCHEMA_VERSION, PACKED_SCHEMA_VERSION, BUNDLED_SCHEMA_VERSION)
MIN_BLOCK_BYTES, MAX_BLOCK_BYTES = 1 << 12, 1 << 30
FORMAT = "dcr-manifest"

# Limits a manifest must respect (a hostile one must not exhaust memory).
MAX_MANIFEST_BYTES = 512 << 20
MAX_TENSORS = 1_000_000
MAX_CHUNKS_PER_TENSOR = 50_000_000
MAX_TENSOR_ELEMENTS = 1 << 40
MAX_CHUNK_BYTES = 1 << 30  # a padded chunk, decompressed
MAX_PIECES_PER_TENSOR = 1_000_000
MAX_PIECE_RUNS_PER_TENSOR = 1 << 23  # contiguous runs the pieces' boxes decompose into
MAX_PART_SLOTS = 1 << 16
MAX_PACKS = 1 << 24
MAX_PACK_BYTES = 1 << 40  # a pack is sealed at about ``pack_bytes`` (8 MiB by default) plus one chunk
_ENCODINGS = {e.value: e for e in Encoding}  # a stored encoding name -> its member (a dict lookup per entry)

def refusal(shape: tuple[int, ...], dtype: str, chunk_shape: tuple[int, ...]) -> str | None:
    """Why every receiver would refuse a tensor of this shape and chunking (the limits a manifest
    is parsed against), or None. The publisher asks before it writes anything."""
    if len(shape) > MAX_NDIM:
        return f"{len(shape)} dimensions, more than the {MAX_NDIM} a manifest may hold"
    if any(d > MAX_DIM for d in shape):
        return f"a dimension larger than {MAX_DIM}"
    if math.prod(shape) > MAX_TENSOR_ELEMENTS:
        return f"{math.prod(shape)} elements, more than {MAX_TENSOR_ELEMENTS}"
    if math.prod(chunk_shape) * DTYPES[dtype].itemsize > MAX_CHUNK_BYTES:
        return f"its chunks {list(chunk_shape)} exceed {MAX_CHUNK_BYTES} bytes (an empty tensor with a huge dimension?)"
    grid = grid_of(shape, chunk_shape)
    if grid.n_chunks > MAX_CHUNKS_PER_TENSOR:
        return f"{grid.n_chunks} chunks, more than {MAX_CHUNKS_PER_TENSOR}; publish with larger chunks"
    return None


@dataclass(frozen=True, slots=True)
class ChunkTable:
    """Stored chunks of one tensor, as parallel columns (compact for large models). ``packs``:
    for a packed step (``storage.layout.pack_key``), the pack object holding each chunk and
    ``offsets`` its first byte there; empty: each chunk is its own object (``layout.chunk_key``)."""

    indices: tuple[int, ...] = ()
    digests: tuple[str, ...] = ()
    nbytes: tuple[int, ...] = ()
    packs: tuple[str, ...] = ()
    offsets: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def packed(self) -> bool:
        return bool(self.packs)

    def content(self) -> tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...]]:
        """What is stored, wherever it lies: chunk indices, digests and sizes (which pack holds a
        chunk, and where, depends on which upload finished first)."""
        return self.indices, self.digests, self.nbytes

    def to_dict(self, pack_numbers: dict[str, int] | None = None) -> dict:
        return {"indices": list(self.indices), "digests": list(self.digests), "nbytes": list(self.nbytes),
                **_pack_columns(self.packs, self.offsets, pack_numbers)}

    @classmethod
    def from_dict(cls, d: Any, what: str, n_chunks: int, packs: tuple[str, ...] = ()) -> ChunkTable:
        if not isinstance(d, dict):
            raise fail(what, "chunks must be an object")
        idx, dig, nb = parse_columns(d, what, "chunks", "indices", "digests", "nbytes")
        if len(idx) > n_chunks:
            raise fail(what, f"{len(idx)} stored chunks but the grid has {n_chunks}")
        # Each column checked whole in C where it is well formed; item by item (naming the bad one) if not.
        indices = tuple(idx) if all_ints(idx, 0, max(0, n_chunks - 1)) else \
            tuple(parse_int(i, what, 0, max(0, n_chunks - 1)) for i in idx)
        if not all(map(operator.lt, indices, indices[1:])):
            raise fail(what, "chunk indices must be strictly increasing")
        in_packs, offsets = _parse_pack_columns(d, what, "chunks", len(idx), packs)
        digests = tuple(dig) if all_digests(dig) else tuple(parse_digest(x, what) for x in dig)
        return cls(indices, digests, tuple(nb) if all_ints(nb) else tuple(parse_int(x, what) for x in nb),
                   in_packs, offsets)


def _pack_columns(packs: tuple[str, ...], offsets: tuple[int, ...], pack_numbers: dict[str, int] | None) -> dict:
    """A table's ``pack``/``offset`` columns (none: its chunks are their own objects); a packed
    table's packs are numbered by ``pack_numbers`` (the manifest's list of packs)."""
    if not packs:
        return {}
    if pack_numbers is None:
        raise ValueError("a packed table is written with the manifest's pack numbers")
    return {"pack": [pack_numbers[p] for p in packs], "offset": list(offsets)}


def _parse_pack_columns(d: dict, what: str, table: str, n: int,
                        packs: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The pack holding each of a table's ``n`` rows and its offset there; () () when it names none."""
    pk, off = d.get("pack"), d.get("offset")
    if pk is None and off is None:
        return (), ()
    if not packs:
        raise fail(what, f"{table} name packs, but the manifest lists none")
    if not isinstance(pk, list) or not isinstance(off, list) or not len(pk) == len(off) == n:
        raise fail(what, f"{table}.pack/offset must be lists as long as {table}.indices")
    if all_ints(pk, 0, len(packs) - 1) and all_ints(off, 0, MAX_PACK_BYTES):  # the common case, in C
        return tuple(map(packs.__getitem__, pk)), tuple(off)
    return (tuple(packs[parse_int(p, f"{what} {table}.pack", 0, len(packs) - 1)] for p in pk),
            tuple(parse_int(o, f"{what} {table}.offset", 0, MAX_PACK_BYTES) for o in off))


@dataclass(frozen=True, slots=True)
class PieceTable:
    """The piecewise digest of a tensor published from shards (``dcr_core.digest.pieces_digest``):
    one box per piece (``starts``/``extents`` in the tensor's coordinates) and its digest. The boxes
    partition the tensor; the entry's digest is the combination of the records."""

    starts: tuple[tuple[int, ...], ...]
    extents: tuple[tuple[int, ...], ...]
    digests: tuple[str, ...]

    def records(self):
        return zip(self.starts, self.extents, self.digests)

    def to_dict(self) -> dict:
        return {
            "scheme": PIECES_SCHEME,
            "starts": [list(x) for x in self.starts],
            "extents": [list(x) for x in self.extents],
            "digests": list(self.digests),
        }

    @classmethod
    def from_dict(cls, d: Any, what: str, shape: tuple[int, ...], digest: str) -> PieceTable:
        if not isinstance(d, dict) or d.get("scheme") != PIECES_SCHEME:
            raise fail(what, f"pieces must be an object with scheme {PIECES_SCHEME!r}")
        st, ex, dg = parse_columns(d, what, "pieces", "starts", "extents", "digests")
        if len(st) > MAX_PIECES_PER_TENSOR:  # before parsing them: a hostile manifest must not exhaust memory
            raise fail(what, f"{len(st)} pieces exceeds the limit {MAX_PIECES_PER_TENSOR}")
        starts = tuple(parse_shape(x, what) for x in st)
        extents = tuple(parse_shape(x, what) for x in ex)
        digests = tuple(parse_digest(x, what) for x in dg)
        table = cls.checked(starts, extents, digests, shape, what)
        if pieces_digest(table.records()) != digest:
            raise fail(what, "digest does not match its pieces")
        return table

    @classmethod
    def checked(cls, starts, extents, digests, shape: tuple[int, ...], what: str) -> PieceTable:
        """The table of these pieces if their boxes partition a tensor of ``shape`` exactly (the
        check every reader makes; rank 0 makes it too before committing a sharded step)."""
        if len(starts) > MAX_PIECES_PER_TENSOR:
            raise fail(what, f"{len(starts)} pieces exceeds the limit {MAX_PIECES_PER_TENSOR}")
        cs = c_strides(shape)
        runs, total_runs = [], 0
        for a, e in zip(starts, extents):
            if len(a) != len(shape) or len(e) != len(shape):
                raise fail(what, f"piece box {list(a)}+{list(e)} does not have {len(shape)} dims")
            try:
                p = Piece("", shape, a, e, 0, cs)
            except UsageError as err:
                raise fail(what, str(err)) from None
            total_runs += p.n_runs()
            if total_runs > MAX_PIECE_RUNS_PER_TENSOR:
                raise fail(what, f"pieces decompose into more than {MAX_PIECE_RUNS_PER_TENSOR} runs")
            c, _, n = p.runs()
            if n:
                runs.append((c, n))
        try:
            check_cover("", math.prod(shape), runs)
        except UsageError as err:
            raise fail(what, f"pieces do not partition the tensor ({err})") from None
        return cls(tuple(map(tuple, starts)), tuple(map(tuple, extents)), tuple(digests))


@dataclass(frozen=True, slots=True)
class PartTable:
    """Chunks shared by several ranks: each contributor's zero-padded XOR part, stored in the sibling
    array ``array`` of shape ``(slots, *shape)`` at ``[slot, chunk]``. A chunk's value is the XOR of
    the main array's chunk (absent: zeros) and all its parts; stock zarr reads the parts array of
    an unpacked step. ``packs``/``offsets``: where each part lies in a packed step, as in
    ``ChunkTable`` (each rank packs its own parts); empty: each part is its own object."""

    array: str
    slots: int
    slot: tuple[int, ...] = ()
    indices: tuple[int, ...] = ()
    digests: tuple[str, ...] = ()
    nbytes: tuple[int, ...] = ()
    packs: tuple[str, ...] = ()
    offsets: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.indices)

    def to_dict(self, pack_numbers: dict[str, int] | None = None) -> dict:
        return {
            "array": self.array, "slots": self.slots, "slot": list(self.slot), "indices": list(self.indices),
            "digests": list(self.digests), "nbytes": list(self.nbytes),
            **_pack_columns(self.packs, self.offsets, pack_numbers),
        }

    @classmethod
    def from_dict(cls, d: Any, what: str, n_chunks: int, packs: tuple[str, ...] = ()) -> PartTable:
        if not isinstance(d, dict):
            raise fail(what, "parts must be an object")
        sl, idx, dig, nb = parse_columns(d, what, "parts", "slot", "indices", "digests", "nbytes")
        slots = parse_int(d.get("slots"), what, 1, MAX_PART_SLOTS)
        if len(idx) > n_chunks * slots:
            raise fail(what, f"{len(idx)} parts but the grid has {n_chunks} chunks of {slots} slots")
        slot = tuple(parse_int(x, what, 0, slots - 1) for x in sl)
        indices = tuple(parse_int(i, what, 0, max(0, n_chunks - 1)) for i in idx)
        keys = list(zip(indices, slot))
        if any(a >= b for a, b in zip(keys, keys[1:])):
            raise fail(what, "parts must be strictly increasing by (chunk, slot)")
        return cls(
            layout.check_segment(d.get("array"), f"{what} parts array"), slots, slot, indices,
            tuple(parse_digest(x, what) for x in dig), tuple(parse_int(x, what) for x in nb),
            *_parse_pack_columns(d, what, "parts", len(idx), packs),
        )


SOURCE_KINDS = ("file", "directory")  # a single .safetensors file; a (Hugging Face sharded) directory
MAX_SOURCE_BYTES = 512 << 20  # the source layout document (headers of every file of the checkpoint)


@dataclass(frozen=True, slots=True)
class SourceRecord:
    """The published checkpoint's own layout (``storage.source_layout``): the object of the
    attempt that holds it, its digest and size (the manifest binds it, so the commit marker and
    any signature cover it), and what was published: one file or a directory of them."""

    kind: str
    digest: str
    nbytes: int

    def to_dict(self) -> dict:
        return {"object": layout.SOURCE, "kind": self.kind, "digest": self.digest, "bytes": self.nbytes}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> SourceRecord:
        what = f"{where} source"
        if not isinstance(d, dict) or d.get("object") != layout.SOURCE:
            raise fail(what, f"must be an object naming {layout.SOURCE!r}")
        if d.get("kind") not in SOURCE_KINDS:
            raise fail(what, f"kind must be one of {', '.join(SOURCE_KINDS)}, got {d.get('kind')!r}")
        return cls(d["kind"], parse_digest(d.get("digest"), what), parse_int(d.get("bytes"), what, 1, MAX_SOURCE_BYTES))


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    digest: str  # digest of the tensor's bits at this step
    encoding: Encoding
    array: str  # Zarr array name inside the step's store
    chunk_shape: tuple[int, ...]
    chunks: ChunkTable = field(default_factory=ChunkTable)
    base_digest: str | None = None  # digest at the base step (deltas)
    changed: int = 0  # elements whose bits differ from the base (keyframes: non-zero elements)
    pieces: PieceTable | None = None  # piecewise digest (published from shards); None: plain digest
    parts: PartTable | None = None  # chunks shared by several ranks (published from shards)
    scheme: DigestScheme = FLAT  # the manifest's digest scheme (plain digests; pieces have their own)
    members: Members | None = None  # a bundle (``dcr_core.bundles``): the tensors it holds; None: a tensor

    @property
    def grid(self) -> ChunkGrid:
        return grid_of(self.shape, self.chunk_shape)

    @property
    def info(self) -> TensorInfo:
        return TensorInfo(self.name, self.dtype, self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize

    @property
    def stored_bytes(self) -> int:
        return sum(self.chunks.nbytes) + (sum(self.parts.nbytes) if self.parts else 0)

    @property
    def n_stored(self) -> int:
        """Stored chunk objects: main chunks first, then parts (positions ``0..n_stored-1``)."""
        return len(self.chunks) + (len(self.parts) if self.parts else 0)

    @property
    def stored_indices(self) -> tuple[int, ...]:
        """The chunk index of every stored position (main chunks, then parts)."""
        return self.chunks.indices + (self.parts.indices if self.parts else ())

    @property
    def stored_nbytes(self) -> tuple[int, ...]:
        """The stored bytes of every stored position (main chunks, then parts)."""
        return self.chunks.nbytes + (self.parts.nbytes if self.parts else ())

    def stored_at(self, pos: int) -> tuple[str, int, str, int]:
        """``(object key inside the store, chunk index, payload digest, stored bytes)`` of position ``pos``."""
        n = len(self.chunks)
        if pos < n:
            c = self.chunks
            index = c.indices[pos]
            key = layout.pack_key(c.packs[pos]) if c.packs else layout.chunk_key(self.array, self.grid.grid_index(index))
            return key, index, c.digests[pos], c.nbytes[pos]
        p, q = self.parts, pos - n
        if p is None:
            raise IndexError(f"stored position {pos} of a tensor of {n} stored chunks and no parts")
        index = p.indices[q]
        key = layout.pack_key(p.packs[q]) if p.packs else layout.part_key(p.array, p.slot[q], self.grid.grid_index(index))
        return key, index, p.digests[q], p.nbytes[q]

    def offset_at(self, pos: int) -> int | None:
        """Where position ``pos``'s bytes start in the object ``stored_at`` names: an offset into a
        pack, or None (the chunk or part is the whole object)."""
        n = len(self.chunks)
        table: ChunkTable | PartTable | None
        table, q = (self.chunks, pos) if pos < n else (self.parts, pos - n)
        if table is None:
            raise IndexError(f"stored position {pos} of a tensor of {n} stored chunks and no parts")
        return table.offsets[q] if table.packs else None

    @property
    def packed(self) -> bool:
        """Whether any of its chunks or parts lies in a pack."""
        return bool(self.chunks.packs or (self.parts is not None and self.parts.packs))

    def packed_spans(self) -> list[tuple[str, int, int]]:
        """``(pack, offset, stored bytes)`` of every packed position, main chunks then parts."""
        out = list(zip(self.chunks.packs, self.chunks.offsets, self.chunks.nbytes))
        if self.parts is not None:
            out += zip(self.parts.packs, self.parts.offsets, self.parts.nbytes)
        return out

    def encoding_at(self, pos: int) -> Encoding:
        """How position ``pos`` applies: the entry's encoding for main chunks, XOR for parts
        (zero-padded disjoint parts combine by XOR, also into the zeros a keyframe starts from)."""
        return self.encoding if pos < len(self.chunks) else Encoding.XOR

    def matches(self, bits, members: bool = True) -> bool:
        """Whether ``bits`` (the whole tensor, flat raw bits) are this entry's bits at its step (a
        bundle: and, with ``members``, every member's bits its digest: what proves the member
        digests a step's policy digest covers; a held state checked against its own step needs
        only the bundle's)."""
        if self.pieces is None:
            if self.scheme.digest(bits) != self.digest:
                return False
            return not members or self.members is None or self.members.check(bits, self.scheme) is None
        for start, extent, digest in self.pieces.records():
            if box_digest(bits, self.shape, start, extent) != digest:
                return False
        return pieces_digest(self.pieces.records()) == self.digest

    def to_dict(self, pack_numbers: dict[str, int] | None = None) -> dict:
        d = {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "digest": self.digest,
            "base_digest": self.base_digest,
            "encoding": self.encoding.value,
            "changed_elements": self.changed,
            "array": self.array,
            "chunk_shape": list(self.chunk_shape),
            "chunks": self.chunks.to_dict(pack_numbers),
        }
        if self.pieces is not None:
            d["pieces"] = self.pieces.to_dict()
        if self.parts is not None:
            d["parts"] = self.parts.to_dict(pack_numbers)
        return d

    @classmethod
    def from_dict(cls, name: str, d: Any, where: str, scheme: DigestScheme = FLAT,
                  packs: tuple[str, ...] = (), members: Any = None) -> TensorEntry:
        what = f"{where} tensor {name!r}"
        if not isinstance(d, dict):
            raise fail(what, "entry must be an object")
        dtype = d.get("dtype")
        if dtype not in DTYPES:
            raise fail(what, f"unsupported dtype {dtype!r}")
        stored = d.get("encoding")
        encoding = _ENCODINGS.get(stored) if isinstance(stored, str) else None
        if encoding is None:
            raise fail(what, f"unknown encoding {d.get('encoding')!r}")
        shape = parse_shape(d.get("shape"), what)
        chunk_shape = parse_shape(d.get("chunk_shape"), what)
        if math.prod(shape) > MAX_TENSOR_ELEMENTS:
            raise fail(what, f"{math.prod(shape)} elements exceeds the limit {MAX_TENSOR_ELEMENTS}")
        if math.prod(chunk_shape) * DTYPES[dtype].itemsize > MAX_CHUNK_BYTES:
            raise fail(what, f"chunk shape {list(chunk_shape)} exceeds {MAX_CHUNK_BYTES} bytes per chunk")
        try:
            grid = grid_of(shape, chunk_shape)  # validates contiguity and ranks
        except IntegrityError as e:
            raise fail(what, str(e)) from None
        if grid.n_chunks > MAX_CHUNKS_PER_TENSOR:
            raise fail(what, f"{grid.n_chunks} chunks exceeds the limit {MAX_CHUNKS_PER_TENSOR}")
        base = d.get("base_digest")
        chunks = ChunkTable.from_dict(d.get("chunks"), what, grid.n_chunks, packs)
        digest = parse_digest(d.get("digest"), what)
        pieces = None if d.get("pieces") is None else PieceTable.from_dict(d["pieces"], what, shape, digest)
        parts = None if d.get("parts") is None else PartTable.from_dict(d["parts"], what, grid.n_chunks, packs)
        if encoding is Encoding.UNCHANGED and (len(chunks) or (parts and len(parts))):
            raise fail(what, "an unchanged tensor lists stored chunks")
        if parts is not None:
            if encoding is Encoding.OVERWRITE:
                raise fail(what, "overwrites cannot have parts")
            if set(parts.indices) & set(chunks.indices):
                raise fail(what, "a chunk is stored both whole and in parts")
        if members is not None:
            if not isinstance(members, Members):  # a snapshot's entry takes the step's bundle as parsed
                members = _parse_members(members, f"{where} bundle {name!r}", dtype)
            elif members.dtype != dtype:
                raise fail(what, f"a bundle of {members.dtype} stored as {dtype}")
            if shape != (members.numel,) or pieces is not None or parts is not None:
                raise fail(what, f"a bundle is a flat tensor of its members' {members.numel} elements "
                                 "(no pieces, no parts)")
        return cls(
            name=name,
            dtype=dtype,
            shape=shape,
            digest=digest,
            encoding=encoding,
            array=layout.check_segment(d.get("array"), f"{what} array"),
            chunk_shape=chunk_shape,
            chunks=chunks,
            base_digest=None if base is None else parse_digest(base, what),
            changed=parse_int(d.get("changed_elements", 0), what),
            pieces=pieces,
            parts=parts,
            scheme=scheme,
            members=members,
        )


def policy_entries(entries: dict[str, TensorEntry]) -> Iterator[tuple[str, str, tuple[int, ...], str]]:
    """``(name, dtype, shape, digest)`` of every tensor of the policy ``entries`` store: bundles'
    members included, bundles themselves not (what the policy digest covers). A bundle's members
    come from its columns in C (``zip``), not one Python step per member."""
    return itertools.chain.from_iterable(
        ((t.name, t.dtype, t.shape, t.digest),) if t.members is None
        else zip(t.members.names, itertools.repeat(t.members.dtype), t.members.shapes, t.members.digests)
        for t in entries.values())


@dataclass(frozen=True)
class Manifest:
    step: int
    kind: str
    base_step: int | None
    base_policy_digest: str | None
    policy_digest: str
    attempt: str
    codec: CodecSpec
    chunk_bytes: int
    tensors: dict[str, TensorEntry]
    created_at: str = ""
    producer: dict = field(default_factory=dict)
    digest_scheme: DigestScheme = FLAT  # how its tensor digests are built (schema 1: flat)
    # A delta may also carry a full copy of its step (a restart point for new or far-behind
    # receivers, written by the keyframe policy); same names, digests and codec, encoding full.
    snapshot: dict[str, TensorEntry] = field(default_factory=dict)
    # Published from a safetensors file or directory: its header bytes, kept so that the step
    # materializes byte for byte (None: published from tensors or shards, or a file that could not be).
    source: SourceRecord | None = None

    def restart_entries(self) -> dict[str, TensorEntry] | None:
        """The entries a receiver loads to start from this step: a keyframe's tensors, a delta's
        snapshot, or None (a plain delta is no restart point)."""
        if self.kind == KEYFRAME:
            return self.tensors
        return self.snapshot or None

    @property
    def invertible(self) -> bool:
        return self.kind == DELTA and all(t.encoding.invertible for t in self.tensors.values())

    def summary(self) -> dict:
        total = sum(t.numel for t in self.tensors.values())
        changed = sum(t.changed for t in self.tensors.values()) if self.kind == DELTA else total
        count = sum(1 if t.members is None else len(t.members) for t in self.tensors.values())
        return {
            "tensors": count,
            "tensors_changed": sum(
                (1 if t.members is None else len(t.members.changed_names)) for t in self.tensors.values()
                if t.encoding is not Encoding.UNCHANGED
            ) if self.kind == DELTA else count,
            "elements": total,
            "elements_changed": changed,
            "change_rate": (changed / total) if total else 0.0,
            "bytes_full": sum(t.nbytes for t in self.tensors.values()),
            "bytes_stored": sum(t.stored_bytes for t in self.tensors.values()),
            "chunks_stored": sum(t.n_stored for t in self.tensors.values()),
            "invertible": self.invertible,
        } | ({"bundles": len(self.bundles())} if self.bundles() else {}) | ({"snapshot_bytes": sum(t.stored_bytes for t in self.snapshot.values())} if self.snapshot else {})

    def bundles(self) -> dict[str, Members]:
        """Every bundle of the step (``dcr_core.bundles``) and its members, in name order (found once:
        callers must not change it)."""
        return self._bundles

    @functools.cached_property
    def _bundles(self) -> dict[str, Members]:
        return {n: m for n in sorted(self.tensors) if (m := self.tensors[n].members) is not None}

    def policy_entries(self):
        """``(name, dtype, shape, digest)`` of every tensor of the policy: bundles' members included,
        bundles themselves not (what the policy digest covers)."""
        return policy_entries(self.tensors)

    @property
    def schema_version(self) -> int:
        if any(t.members is not None for t in self.tensors.values()):
            return BUNDLED_SCHEMA_VERSION
        if any(e.packed for entries in (self.tensors, self.snapshot) for e in entries.values()):
            return PACKED_SCHEMA_VERSION
        return SCHEMA_VERSION if self.digest_scheme.blocked else FLAT_SCHEMA_VERSION

    def packs(self) -> dict[str, int]:
        """Every pack object of the step, in name order, and its size in bytes (its chunks tile it)."""
        sizes: dict[str, int] = {}
        for entries in (self.tensors, self.snapshot):
            for e in entries.values():
                for p, _, n in e.packed_spans():
                    sizes[p] = sizes.get(p, 0) + n
        return dict(sorted(sizes.items()))

    def computed_policy_digest(self) -> str:
        return policy_digest(self.policy_entries())

    def to_dict(self) -> dict:
        packs = self.packs()
        numbers = {p: i for i, p in enumerate(packs)}
        return {
            "format": FORMAT,
            "schema_version": self.schema_version,
            **({"digest_scheme": self.digest_scheme.to_dict()} if self.digest_scheme.blocked else {}),
            "step": self.step,
            "kind": self.kind,
            "base_step": self.base_step,
            "base_policy_digest": self.base_policy_digest,
            "policy_digest": self.policy_digest,
            "digest_algorithm": DIGEST_ALGORITHM,
            "attempt": self.attempt,
            "store": layout.STORE,
            "created_at": self.created_at,
            "producer": self.producer,
            "codec": self.codec.to_dict(),
            "chunk_bytes": self.chunk_bytes,
            **({"source": self.source.to_dict()} if self.source is not None else {}),
            "summary": self.summary(),
            **({"packs": list(packs)} if packs else {}),
            **({"bundles": {n: m.to_dict() for n, m in self.bundles().items()}} if self.bundles() else {}),
            "tensors": {name: self.tensors[name].to_dict(numbers) for name in sorted(self.tensors)},
        } | ({"snapshot": {n: self.snapshot[n].to_dict(numbers) for n in sorted(self.snapshot)}} if self.snapshot else {})

    def to_json(self) -> bytes:
        """The manifest as people read it: its fields indented, then one line per tensor (a step of
        70,000 tensors renders in a fraction of a second: ``json``'s indenting encoder is pure Python;
        each tensor's line is compact JSON, ``document_fields.dumps_line``)."""
        d = self.to_dict()
        tables = {k: d.pop(k) for k in ("bundles", "tensors", "snapshot") if k in d}
        head = json.dumps(d, indent=1)
        rendered = [
            f' {json.dumps(k)}: {{\n' + ",\n".join(f"  {dumps_line(n)}: {dumps_line(e)}" for n, e in table.items()) + "\n }"
            for k, table in tables.items()
        ]
        return (head[:-2] + ",\n" + ",\n".join(rendered) + "\n}\n").encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        if len(data) > MAX_MANIFEST_BYTES:
            raise fail(where, f"{len(data)} bytes exceeds the manifest limit {MAX_MANIFEST_BYTES}")
        try:
            d = loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise fail(where, f"not valid JSON ({e})") from None
        return cls.from_dict(d, where)

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Manifest:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise fail(where, "not a DCR manifest")
        version = d.get("schema_version")
        if version not in READABLE_SCHEMA_VERSIONS or isinstance(version, bool):
            raise fail(where, f"schema_version {version!r} is not supported (this DCR reads "
                              f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))})")
        scheme = _parse_scheme(d.get("digest_scheme"), version, where)
        if d.get("digest_algorithm", DIGEST_ALGORITHM) != DIGEST_ALGORITHM:
            raise fail(where, f"digest algorithm {d.get('digest_algorithm')!r} is not supported")
        kind = d.get("kind")
        if kind not in (KEYFRAME, DELTA):
            raise fail(where, f"kind must be keyframe or delta, got {kind!r}")
        step = parse_int(d.get("step"), where, 0, layout.MAX_STEP)
        base_step = d.get("base_step")
        if kind == DELTA:
            base_step = parse_int(base_step, where, 0, step - 1) if step > 0 else parse_int(base_step, where, 1, 0)
            base_policy = parse_digest(d.get("base_policy_digest"), where)
        else:
            if base_step is not None:
                raise fail(where, "a keyframe has no base step")
            base_policy = None
        tensors_d = d.get("tensors")
        if not isinstance(tensors_d, dict) or len(tensors_d) > MAX_TENSORS:
            raise fail(where, f"tensors must be an object of at most {MAX_TENSORS} entries")
        packs = _parse_packs(d.get("packs"), version, where)
        bundles = _parse_bundles(d.get("bundles"), version, tensors_d, where)
        tensors = {}
        for name, td in tensors_d.items():
            entry = TensorEntry.from_dict(name, td, where, scheme, packs, bundles.get(name))
            if kind == KEYFRAME and entry.encoding not in (Encoding.FULL,):
                raise fail(where, f"keyframe tensor {name!r} has encoding {entry.encoding.value}")
            if kind == DELTA and entry.encoding is Encoding.FULL:
                raise fail(where, f"delta tensor {name!r} has encoding full")
            tensors[name] = entry
        snapshot = {}
        snap_d = d.get("snapshot")
        if snap_d is not None:
            if kind != DELTA or not isinstance(snap_d, dict) or set(snap_d) != set(tensors):
                raise fail(where, "a snapshot belongs to a delta and holds exactly its tensors")
            for name, td in snap_d.items():
                entry = TensorEntry.from_dict(name, td, f"{where} snapshot", scheme, packs, tensors[name].members)
                t = tensors[name]
                if entry.encoding is not Encoding.FULL or (entry.dtype, entry.shape, entry.digest) != (
                    t.dtype, t.shape, t.digest
                ):
                    raise fail(where, f"snapshot tensor {name!r} is not a full copy of the step's tensor")
                snapshot[name] = entry
        arrays = [t.array for t in tensors.values()] + [t.parts.array for t in tensors.values() if t.parts]
        arrays += [t.array for t in snapshot.values()]
        if len(set(arrays)) != len(arrays):
            raise fail(where, "two tensors share one array")
        codec = parse_codec(d.get("codec"), where)
        producer = d.get("producer")
        m = cls(
            step=step,
            kind=kind,
            base_step=base_step,
            base_policy_digest=base_policy,
            policy_digest=parse_digest(d.get("policy_digest"), where),
            attempt=parse_attempt(d.get("attempt"), where),
            codec=codec,
            chunk_bytes=parse_int(d.get("chunk_bytes"), where, 1),
            tensors=tensors,
            created_at=str(d.get("created_at", "")),
            producer=producer if isinstance(producer, dict) else {},
            snapshot=snapshot,
            digest_scheme=scheme,
            source=None if d.get("source") is None else SourceRecord.from_dict(d["source"], where),
        )
        if m.computed_policy_digest() != m.policy_digest:
            raise fail(where, "policy digest does not match its tensors")
        _check_packs_tiled(m, packs, where)
        return m


def _parse_bundles(d: Any, version: int, tensors_d: dict, where: str) -> dict[str, dict]:
    """The ``bundles`` table (bundle name -> its members' columns, parsed with the entry): members
    named once across the step, never as a tensor of their own."""
    if d is None:
        return {}
    if version != BUNDLED_SCHEMA_VERSION:
        raise fail(where, f"bundles belong to schema {BUNDLED_SCHEMA_VERSION} manifests")
    if not isinstance(d, dict) or not d:
        raise fail(where, "bundles must be a non-empty object")
    seen: set[str] = set()
    total = 0
    for b, cols in d.items():
        if b not in tensors_d:
            raise fail(where, f"bundle {b!r} is not one of its tensors")
        names = cols.get("names") if isinstance(cols, dict) else None
        if not isinstance(names, list) or not {str}.issuperset(map(type, names)):
            raise fail(where, f"bundle {b!r}: names must be a list of strings")
        total += len(names)
        if total > MAX_TENSORS:
            raise fail(where, f"bundles hold more than {MAX_TENSORS} tensors")
        seen.update(names)
        if len(seen) != total:
            raise fail(where, f"bundle {b!r}: a tensor is named twice")
    clash = seen & set(tensors_d)
    if clash:
        raise fail(where, f"tensor {min(clash)!r} is both bundled and stored alone")
    return d


def _parse_members(d: dict, what: str, dtype: str) -> Members:
    """A bundle's members from their columns, checked column by column (a bundle of 70,000 tensors
    parses in milliseconds)."""
    names, shapes, digests, changed = d.get("names"), d.get("shapes"), d.get("digests"), d.get("changed")
    if set(d) - {"names", "shapes", "digests", "changed"}:
        raise fail(what, f"unknown member columns {sorted(set(d) - {'names', 'shapes', 'digests', 'changed'})}")
    if not (isinstance(names, list) and isinstance(shapes, list) and isinstance(digests, list)) or not (
            len(names) == len(shapes) == len(digests)):
        raise fail(what, "members need names, shapes and digests of equal length")
    if not names:
        raise fail(what, "a bundle holds at least one tensor")
    # Column by column, each check one pass in C (set/map/min/max): no Python loop per member.
    if set(map(type, shapes)) != {list} or max(map(len, shapes)) > MAX_NDIM:
        raise fail(what, f"member shapes must be lists of at most {MAX_NDIM} dimensions")
    dims = list(itertools.chain.from_iterable(shapes))
    if dims and (not set(map(type, dims)) <= {int} or min(dims) < 0 or max(dims) > MAX_DIM):
        raise fail(what, f"member shapes must hold integers in [0, {MAX_DIM}]")
    if not all_digests(digests):
        raise fail(what, "member digests must be 64 lowercase hex digits each")
    if changed is not None and (not isinstance(changed, list) or len(changed) != len(names) or (
            changed and (not set(map(type, changed)) <= {int} or min(changed) < 0))):
        raise fail(what, "members' changed counts must be a list of non-negative integers, one per member")
    m = Members(dtype, tuple(names), tuple(map(tuple, shapes)), tuple(digests), tuple(changed or ()))
    if m.numel > MAX_TENSOR_ELEMENTS:
        raise fail(what, f"{m.numel} elements exceeds the limit {MAX_TENSOR_ELEMENTS}")
    return m


def _parse_packs(d: Any, version: int, where: str) -> tuple[str, ...]:
    if d is None:
        return ()
    if version not in (PACKED_SCHEMA_VERSION, BUNDLED_SCHEMA_VERSION):
        raise fail(where, f"packs belong to schema {PACKED_SCHEMA_VERSION} and {BUNDLED_SCHEMA_VERSION} manifests")
    if not isinstance(d, list) or not 0 < len(d) <= MAX_PACKS:
        raise fail(where, f"packs must be a list of 1..{MAX_PACKS} pack names")
    names = tuple(layout.check_pack(p) for p in d)
    if list(names) != sorted(set(names)):
        raise fail(where, "packs must be distinct and in name order")
    return names


def _check_packs_tiled(m: Manifest, packs: tuple[str, ...], where: str) -> None:
    """Each pack's chunks tile it from its first byte, none overlapping and no byte unaccounted
    for: its size is then known from the manifest (a mirror checks the object against it), and no
    byte of it escapes a digest."""
    spans: dict[str, list[tuple[int, int]]] = {p: [] for p in packs}
    for entries in (m.tensors, m.snapshot):
        for e in entries.values():
            for p, off, n in e.packed_spans():
                spans[p].append((off, n))
    for p, s in spans.items():
        if not s:
            raise fail(where, f"pack {p!r} holds no chunk")
        end = 0
        for off, n in sorted(s):
            if off != end:
                raise fail(where, f"pack {p!r}: its chunks do not tile it (a gap or an overlap at byte {min(off, end)})")
            end = off + n


def _parse_scheme(d: Any, version: int, where: str) -> DigestScheme:
    if version in (PACKED_SCHEMA_VERSION, BUNDLED_SCHEMA_VERSION) and d is None:
        return FLAT
    if version == FLAT_SCHEMA_VERSION:
        if d is not None:
            raise fail(where, "a schema 1 manifest has flat digests (no digest_scheme)")
        return FLAT
    if not isinstance(d, dict) or d.get("name") != BLOCKS_SCHEME or set(d) != {"name", "block_bytes"}:
        raise fail(where, f"digest_scheme must be {{'name': {BLOCKS_SCHEME!r}, 'block_bytes': N}}")
    block = parse_int(d.get("block_bytes"), f"{where} digest_scheme block_bytes", MIN_BLOCK_BYTES, MAX_BLOCK_BYTES)
    if block % 8:
        raise fail(where, "digest_scheme block_bytes must be a multiple of 8 (no element straddles two blocks)")
    return DigestScheme(block)
