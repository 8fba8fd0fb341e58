"""A committed step as a read-only Zarr group, built from its commit marker and manifest alone.

A step's arrays are not always Zarr stores of their own: a packed step keeps many tensors' chunks
in a few pack objects and writes no ``zarr.json``. The manifest says everything a reader needs
(dtype, shape, chunk shape, codec, and where every stored chunk lies), so this module turns it
into references (kerchunk's format, version 1) held in memory: ``<array>/zarr.json`` is the array
document DCR would write (``dcr_zarr_codec.metadata``), ``<array>/c/i/j`` points at the chunk's
object, or at its byte range inside a pack (``data.zarr/%packs/<name>``). fsspec's
``ReferenceFileSystem`` serves them to stock zarr. Steps written before packs (one object per chunk)
read the same way.

Chunks the manifest does not list have no reference and read as the fill value, zeros (for a
delta: "no change"); a listed chunk whose object is missing is an error, never zeros. Nothing here
checks digests (``dcr verify`` does): this is a reader for people and tools, not for refits.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import fsspec
import zarr
from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
from fsspec.implementations.reference import ReferenceFileSystem
from zarr.storage import FsspecStore

from dcr_zarr_codec import metadata

STEP_WIDTH = 12
MAX_STEP = 10**STEP_WIDTH - 1
COMMIT = "commit.json"
MANIFEST = "manifest.json"
STORE = "data.zarr"
PACKS = "%packs"  # the packs' folder in the store: no array's name starts with '%p'
MAX_COMMIT_BYTES = 1 << 20
MAX_MANIFEST_BYTES = 512 << 20
MAX_NDIM = 16
MAX_CHUNK_BYTES = 1 << 30  # a chunk decompressed (zarr allocates it whole): DCR's own limit
SCHEMA_VERSIONS = (1, 2, 3, 4)
_ATTEMPT = re.compile(r"^[0-9a-f]{16,64}$")
_SEGMENT = re.compile(r"^[A-Za-z0-9_.%-]{1,255}$")
_PACK = re.compile(r"^[0-9a-f]{8}\.[0-9]{6}$")  # <writer tag>.<k>


class StepNotCommittedError(FileNotFoundError):
    """The step has no commit marker under ROOT: it was never committed (or was deleted)."""


class StepDocumentError(ValueError):
    """A commit marker or manifest that this reader cannot take: not DCR's, damaged or hostile."""


@dataclass(frozen=True)
class StepGroup(zarr.Group):
    """The step's Zarr group (members named by array), that also takes tensor names:
    ``group[tensor name]`` is the tensor's array even where the name needed escaping."""

    tensors: Mapping[str, str] = field(default_factory=dict)  # tensor name -> array name

    def __getitem__(self, name: str):
        return super().__getitem__(self.tensors.get(name, name))

    def __contains__(self, name: str) -> bool:
        return super().__contains__(self.tensors.get(name, name))


def open_step(root_url: str, step: int, storage_options: dict | None = None) -> StepGroup:
    """The committed ``step`` of ROOT ``root_url`` (a local path or an fsspec URL: ``s3://...``,
    ``gs://...``), read-only: one array per tensor (and per snapshot tensor, and per parts array
    of a sharded publish), named as the manifest names them, also found by tensor name."""
    docs = _StepDocs.read(root_url, step, storage_options)
    entries = docs.entries(None)
    arrays = [e.array for e in entries]
    if len(set(arrays)) != len(arrays):
        raise StepDocumentError(f"{docs.manifest_url}: two tensors share one array")
    return docs.group(entries)


def open_tensor(root_url: str, step: int, name: str, storage_options: dict | None = None):
    """The array of tensor ``name`` at the committed ``step``: a keyframe's holds the values' bits,
    a delta's the XOR mask (or the new values of an ``overwrite`` tensor). A zarr array; a tensor
    stored in a bundle (manifest schema 4: small tensors of a dtype as one flat array) comes back as
    a numpy array of the same bits, read from its bundle's array and shaped as the tensor."""
    docs = _StepDocs.read(root_url, step, storage_options)
    if name not in docs.tensors or name in docs.bundles:
        where = docs.member(name)
        if where is None:
            raise KeyError(f"{docs.manifest_url}: step {step} has no tensor {name!r}")
        bundle, start, stop, shape = where
        return docs.group(docs.entries(bundle))[bundle][start:stop].reshape(shape)
    return docs.group(docs.entries(name))[name]


@dataclass(frozen=True)
class _Entry:
    """One array of the step: where its stored chunks lie and the document that describes it."""

    tensor: str
    array: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    bits: int
    attributes: dict
    chunks: tuple[tuple[tuple[int, ...], list], ...]  # (grid index, reference) per stored chunk
    main: bool = True  # the tensor's own array (not a snapshot copy, not a parts array)


@dataclass(frozen=True)
class _StepDocs:
    """A step's commit marker and manifest, read and checked; tensor entries are checked as they
    are taken (one tensor's reader does not pay for the whole manifest's references)."""

    fs: fsspec.AbstractFileSystem
    storage_options: dict
    step: int
    attempt_dir: str
    manifest_url: str
    codec: dict
    group_attributes: dict
    packs: list[tuple[str, int]]  # (URL, size in bytes) of each pack, in the manifest's order
    tensors: dict  # tensor name -> its manifest entry (unchecked)
    snapshot: dict  # the same, of a restart point's full copy
    bundles: dict = field(default_factory=dict)  # bundle name -> its members' columns (schema 4)

    @classmethod
    def read(cls, root_url: str, step: int, storage_options: dict | None) -> _StepDocs:
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
            raise ValueError(f"step must be an integer in 0..{MAX_STEP}, got {step!r}")
        options = dict(storage_options or {})
        fs, root = fsspec.core.url_to_fs(root_url, **options)
        step_dir = f"{root.rstrip('/')}/steps/{step:0{STEP_WIDTH}d}"
        commit_url = fs.unstrip_protocol(f"{step_dir}/{COMMIT}")
        commit = _document(fs, f"{step_dir}/{COMMIT}", MAX_COMMIT_BYTES, StepNotCommittedError(
            f"{commit_url}: no commit marker: step {step} is not committed"))
        attempt = _commit_attempt(commit, step, commit_url)
        attempt_dir = f"{step_dir}/attempts/{attempt}"
        manifest_url = fs.unstrip_protocol(f"{attempt_dir}/{MANIFEST}")
        m = _document(fs, f"{attempt_dir}/{MANIFEST}", MAX_MANIFEST_BYTES,
                      StepDocumentError(f"{manifest_url}: missing, but {commit_url} names it"))
        with _named(manifest_url):
            if not isinstance(m, dict) or m.get("format") != "dcr-manifest":
                raise StepDocumentError("not a DCR manifest")
            version = m.get("schema_version")
            if version not in SCHEMA_VERSIONS or isinstance(version, bool):
                raise StepDocumentError(f"schema_version {version!r} is not one this reader knows "
                                        f"({', '.join(map(str, SCHEMA_VERSIONS))})")
            if m.get("step") != step or m.get("attempt") != attempt:
                raise StepDocumentError(f"the manifest of step {m.get('step')!r}, attempt {m.get('attempt')!r}, "
                                        f"where the commit marker names step {step}, attempt {attempt}")
            codec = m.get("codec")
            if not isinstance(codec, dict):
                raise StepDocumentError("codec must be an object")
            metadata.compressor(codec, 1)  # an unknown or incomplete codec fails here, before any array opens
            tensors, snapshot = m.get("tensors"), m.get("snapshot") or {}
            if not isinstance(tensors, dict) or not isinstance(snapshot, dict):
                raise StepDocumentError("tensors and snapshot must be objects")
            attrs = {"dcr": {"step": step, "kind": m.get("kind"), "base_step": m.get("base_step")}}
            packs = _packs(m.get("packs", []), (tensors, snapshot), fs, f"{attempt_dir}/{STORE}")
            bundles = m.get("bundles") or {}
            if not isinstance(bundles, dict):
                raise StepDocumentError("bundles must be an object")
        return cls(fs, options, step, attempt_dir, manifest_url, codec, attrs, packs, tensors, snapshot, bundles)

    def member(self, name: str) -> tuple[str, int, int, tuple[int, ...]] | None:
        """Where a bundled tensor lies (manifest schema 4): its bundle, its elements there, its shape."""
        for bundle, cols in self.bundles.items():
            names = cols.get("names") if isinstance(cols, dict) else None
            if isinstance(names, list) and name in names:
                shapes = cols.get("shapes")
                if not isinstance(shapes, list) or len(shapes) != len(names):
                    raise StepDocumentError(f"bundle {bundle!r}: shapes must be as many as names")
                i = names.index(name)
                start = sum(math.prod(s) for s in shapes[:i])
                return bundle, start, start + math.prod(shapes[i]), tuple(shapes[i])
        return None

    def entries(self, name: str | None) -> list[_Entry]:
        """The arrays of tensor ``name`` (None: of every tensor and snapshot tensor), checked."""
        out = []
        with _named(self.manifest_url):
            for snapshot, table in ((False, self.tensors), (True, self.snapshot)):
                for tensor in table if name is None else [name] if not snapshot else []:
                    out.extend(_entries(tensor, table[tensor], self, snapshot))
        return out

    def group(self, entries: list[_Entry]) -> StepGroup:
        """A read-only group of these arrays, served from references held in memory."""
        refs = {f"{STORE}/zarr.json": json.dumps(metadata.group_metadata(self.group_attributes))}
        for e in entries:
            doc = metadata.array_metadata(e.shape, e.chunk_shape, e.bits, self.codec, e.attributes)
            refs[f"{STORE}/{e.array}/zarr.json"] = json.dumps(doc)
            for grid_index, ref in e.chunks:
                refs["/".join([STORE, e.array, "c", *map(str, grid_index)])] = ref
        # zarr reads through fsspec's async interface: an async instance of the ROOT's filesystem
        # (s3fs, gcsfs), or the synchronous one (local, memory) run on threads.
        if self.fs.async_impl:
            protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
            target = fsspec.filesystem(protocol, asynchronous=True, **self.storage_options)
        else:
            target = AsyncFileSystemWrapper(self.fs, asynchronous=True)
        refs_fs = ReferenceFileSystem({"version": 1, "refs": refs}, fs=target, asynchronous=True)
        group = zarr.open_group(store=FsspecStore(refs_fs, read_only=True, path=STORE), mode="r")
        return StepGroup(group._async_group, {e.tensor: e.array for e in entries if e.main})


@contextmanager
def _named(url: str):
    """Errors of a document's content, as one line naming the document."""
    try:
        yield
    except StepDocumentError as e:
        raise StepDocumentError(f"{url}: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise StepDocumentError(f"{url}: not a readable DCR manifest ({e!r})") from None


def _read_json(fs, path: str, limit: int, url: str):
    data = fs.cat_file(path, start=0, end=limit + 1)
    if len(data) > limit:
        raise StepDocumentError(f"{url}: larger than {limit} bytes")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise StepDocumentError(f"{url}: not valid JSON ({e})") from None


def _commit_attempt(commit, step: int, where: str) -> str:
    """The attempt a commit marker names (checked: it becomes part of every key read after it)."""
    if not isinstance(commit, dict) or commit.get("format") != "dcr-commit":
        raise StepDocumentError(f"{where}: not a DCR commit marker")
    if commit.get("step") != step:
        raise StepDocumentError(f"{where}: commit marker of step {commit.get('step')!r} found under step {step}")
    attempt = commit.get("attempt")
    if not isinstance(attempt, str) or not _ATTEMPT.match(attempt):
        raise StepDocumentError(f"{where}: attempt {attempt!r} is not 16-64 lowercase hex digits")
    if commit.get("manifest") != f"attempts/{attempt}/{MANIFEST}":
        raise StepDocumentError(f"{where}: manifest {commit.get('manifest')!r} lies outside attempt {attempt}")
    return attempt


def _segment(v, what: str) -> str:
    """A name from the manifest that becomes one segment of a key: no separators, no ``.``/``..``."""
    if not isinstance(v, str) or not _SEGMENT.match(v) or v in (".", ".."):
        raise StepDocumentError(f"{what} {v!r} is not a safe path segment")
    return v


def _int(v, what: str, lo: int = 0, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise StepDocumentError(f"{what}: expected an integer in {lo}..{'' if hi is None else hi}, got {v!r}")
    return v


def _ints(v, what: str, n: int | None = None) -> list:
    if not isinstance(v, list) or (n is not None and len(v) != n):
        raise StepDocumentError(f"{what}: expected a list{'' if n is None else f' of {n}'}")
    return v


def _document(fs, path: str, limit: int, missing: Exception):
    """The JSON document at ``path`` (at most ``limit`` bytes); ``missing`` is raised if it is absent."""
    try:
        return _read_json(fs, path, limit, fs.unstrip_protocol(path))
    except FileNotFoundError:
        raise missing from None


def _packs(v, tables: tuple[dict, dict], fs, store_dir: str) -> list[tuple[str, int]]:
    """``(url, bytes)`` of every pack object the manifest lists (schema 3: a list of names). A pack's
    size is the sum of its chunks' sizes (its chunks tile it; the manifest records no other), so
    every tensor's pack columns (chunks and parts) are summed here, whichever tensor is opened."""
    names = _ints(v, "packs")
    for name in names:
        if not isinstance(name, str) or not _PACK.match(name):
            raise StepDocumentError(f"pack name {name!r} is not <8 hex digits>.<6 digits>")
    if len(set(names)) != len(names):
        raise StepDocumentError("a pack is listed twice")
    sizes = [0] * len(names)
    for label, table in zip(("tensor", "snapshot tensor"), tables):
        for tensor, d in table.items():
            for column in ("chunks", "parts"):
                chunks = d.get(column) if isinstance(d, dict) else None
                if not isinstance(chunks, dict) or chunks.get("pack") is None:
                    continue  # not packed (or malformed: refused when the tensor is opened)
                what = f"{label} {tensor!r} {column}"
                if not names:
                    raise StepDocumentError(f"{what} name packs, but the manifest lists none")
                pack = _ints(chunks["pack"], f"{what} pack")
                for p, n in zip(pack, _ints(chunks.get("nbytes"), f"{what} nbytes", len(pack))):
                    sizes[_int(p, f"{what} pack", 0, len(names) - 1)] += _int(n, f"{what} nbytes")
    return [(fs.unstrip_protocol(f"{store_dir}/{PACKS}/{name}"), size) for name, size in zip(names, sizes)]


def _grid_index(flat: int, grid_shape: tuple[int, ...]) -> tuple[int, ...]:
    idx = []
    for g in reversed(grid_shape):
        idx.append(flat % g)
        flat //= g
    return tuple(reversed(idx))


def _chunk_refs(d, what: str, n_chunks: int, grid_shape, slots: int | None, store_url: str,
                packs: list[tuple[str, int]]) -> list:
    """``(grid index, reference)`` of the stored chunks a chunk (or parts) table lists: a byte range
    of a pack where it names one, the chunk's own object otherwise."""
    if not isinstance(d, dict):
        raise StepDocumentError(f"{what}: must be an object")
    indices = _ints(d.get("indices"), f"{what} indices")
    nbytes = _ints(d.get("nbytes"), f"{what} nbytes", len(indices))
    slot = None if slots is None else _ints(d.get("slot"), f"{what} slot", len(indices))
    pack, offset = d.get("pack"), d.get("offset")
    if (pack is None) != (offset is None):
        raise StepDocumentError(f"{what}: pack and offset go together")
    if pack is not None:
        _ints(pack, f"{what} pack", len(indices))
        _ints(offset, f"{what} offset", len(indices))
    out, seen = [], set()
    for j, i in enumerate(indices):
        index = _int(i, f"{what} index", 0, n_chunks - 1)
        grid_index = _grid_index(index, grid_shape)
        if slot is not None:
            grid_index = (_int(slot[j], f"{what} slot", 0, slots - 1), *grid_index)
        if grid_index in seen:
            raise StepDocumentError(f"{what}: chunk {list(grid_index)} is listed twice")
        seen.add(grid_index)
        size = _int(nbytes[j], f"{what} nbytes")
        if pack is None:
            ref = [f"{store_url}/{'/'.join(['c', *map(str, grid_index)])}"]
        else:
            url, pack_bytes = packs[_int(pack[j], f"{what} pack", 0, len(packs) - 1)]
            start = _int(offset[j], f"{what} offset")
            if start + size > pack_bytes:
                raise StepDocumentError(f"{what}: chunk {index} ends at byte {start + size} of a {pack_bytes}-byte pack")
            ref = [url, start, size]
        out.append((grid_index, ref))
    return out


def _entries(name: str, d, docs: _StepDocs, snapshot: bool) -> list[_Entry]:
    """The tensor's array (and its parts array, if a sharded publish shared some of its chunks)."""
    what = f"{'snapshot ' if snapshot else ''}tensor {name!r}"
    if not isinstance(d, dict):
        raise StepDocumentError(f"{what}: entry must be an object")
    dtype = d.get("dtype")
    if dtype not in metadata.DTYPE_BITS:
        raise StepDocumentError(f"{what}: unsupported dtype {dtype!r}")
    shape = tuple(_int(x, f"{what} shape") for x in _ints(d.get("shape"), f"{what} shape"))
    if len(shape) > MAX_NDIM:
        raise StepDocumentError(f"{what}: {len(shape)} dimensions, more than {MAX_NDIM}")
    chunk_shape = tuple(_int(x, f"{what} chunk_shape", 1)
                        for x in _ints(d.get("chunk_shape"), f"{what} chunk_shape", len(shape)))
    bits = metadata.DTYPE_BITS[dtype]
    if math.prod(chunk_shape) * bits // 8 > MAX_CHUNK_BYTES:
        raise StepDocumentError(f"{what}: chunk shape {list(chunk_shape)} exceeds {MAX_CHUNK_BYTES} bytes per chunk")
    grid_shape = tuple(-(-s // c) for s, c in zip(shape, chunk_shape))
    n_chunks = math.prod(grid_shape) if math.prod(shape) else 0
    array = _segment(d.get("array"), f"{what} array")
    store_dir = f"{docs.attempt_dir}/{STORE}"
    attrs = {"tensor": name, "dtype": dtype, "encoding": d.get("encoding"), "step": docs.step}
    attrs |= {"snapshot": True} if snapshot else {}
    chunks = _chunk_refs(d.get("chunks"), f"{what} chunks", n_chunks, grid_shape, None,
                         docs.fs.unstrip_protocol(f"{store_dir}/{array}"), docs.packs)
    out = [_Entry(name, array, shape, chunk_shape, bits, {"dcr": attrs}, tuple(chunks), not snapshot)]
    p = d.get("parts")
    if p is not None:
        if not isinstance(p, dict):
            raise StepDocumentError(f"{what}: parts must be an object")
        parts = _segment(p.get("array"), f"{what} parts array")
        slots = _int(p.get("slots"), f"{what} parts slots", 1, 1 << 16)
        refs = _chunk_refs(p, f"{what} parts", n_chunks, grid_shape, slots,
                           docs.fs.unstrip_protocol(f"{store_dir}/{parts}"), docs.packs)
        pattrs = {"dcr": {**attrs, "parts_of": array, "combine": "XOR over axis 0, then XOR with the main array"}}
        out.append(_Entry(name, parts, (slots, *shape), (1, *chunk_shape), bits, pattrs, tuple(refs), False))
    return out
