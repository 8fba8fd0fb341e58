"""A ``torch.distributed.checkpoint`` (DCP) directory as a sharded source, without loading full tensors.

The directory's ``.metadata`` lists, for every tensor, its dtype, global shape and the chunks that
were saved (each chunk: ``offsets`` and ``sizes`` in the global tensor) and where each chunk's
bytes are (file, byte offset, length). Each chunk is exactly a piece (a box of the canonical
tensor held contiguously), so the directory publishes like the shards of a sharded trainer: every
data file (``__<rank>_<i>.distcp``, written by one rank) is one pseudo-rank, and the files are
published one at a time from this process (``flows.shard_publish.run_ranks_in_process``): memory is
one file's chunks, never a gathered tensor.

What is read and how (no unpickling of arbitrary objects):
- ``.metadata`` is a pickle; it is *not* unpickled. ``storage.pickle_data`` tokenizes it with
  ``pickletools`` and evaluates only data opcodes, accepting references to the DCP metadata
  classes below (never imported or called) and rejecting anything else.
- each chunk's bytes (the default ``torch_save`` serialization) are read as a byte range and
  loaded with ``torch.load(weights_only=True)``, the restricted loader that only rebuilds tensors.
Non-tensor entries (``BytesStorageMetadata``: counters, extra state) are skipped; DCP's
``safetensors`` serialization and storage transforms (compression extensions) are not supported
and fail with an error naming the tensor.
"""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass

import torch

from dcr_core.bits import bits_of
from dcr_core.dtypes import DTYPES, dtype_of
from dcr_core.errors import InvalidCheckpointError
from dcr_core.shard_spec import Piece, ShardSpec, c_strides
from flows.shard_source import ShardedSource, ShardSnapshot
from storage.checkpoint import TensorInfo
from storage.pickle_data import Global, Obj, load_data

METADATA = ".metadata"
MAX_METADATA_BYTES = 1 << 30
_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_MD, n) for n in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id (a path; kept as an inert marker)
    ("pathlib", "PurePosixPath"),
} | {("torch", str(d.torch).removeprefix("torch.")) for d in DTYPES.values()}
_FILE = re.compile(r"^[A-Za-z0-9_.-]{1,255}$")


def is_dcp_dir(path) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA))


@dataclass(frozen=True)
class DcpChunk:
    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


def _state(o, what: str) -> dict:
    if not isinstance(o, Obj):
        raise InvalidCheckpointError(f"{what}: expected an object")
    if isinstance(o.state, dict):
        return o.state
    if isinstance(o.state, tuple) and len(o.state) == 2 and isinstance(o.state[1], dict):  # (dict, slots)
        return {**(o.state[0] or {}), **o.state[1]}
    return {}


def _size(o, what: str) -> tuple[int, ...]:
    if isinstance(o, Obj) and o.cls == Global("torch", "Size") and len(o.args) == 1 and isinstance(o.args[0], tuple):
        dims = o.args[0]
    elif isinstance(o, (tuple, list)):
        dims = tuple(o)
    else:
        raise InvalidCheckpointError(f"{what}: expected a size")
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 48 for d in dims):
        raise InvalidCheckpointError(f"{what}: bad size {dims!r}")
    return tuple(dims)


def read_dcp_metadata(path: str) -> list[DcpChunk]:
    """Every saved tensor chunk of the DCP directory ``path`` (see module docstring)."""
    mpath = os.path.join(path, METADATA)
    try:
        if os.path.getsize(mpath) > MAX_METADATA_BYTES:
            raise InvalidCheckpointError(f"{mpath}: larger than {MAX_METADATA_BYTES} bytes")
        with open(mpath, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise InvalidCheckpointError(f"{mpath}: cannot read ({e.strerror or e})") from None
    md = _state(load_data(raw, _ALLOWED, mpath), mpath)
    sdm, storage = md.get("state_dict_metadata"), md.get("storage_data")
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise InvalidCheckpointError(f"{mpath}: not DCP metadata (no state_dict_metadata / storage_data)")
    where: dict[tuple[str, tuple[int, ...]], tuple[str, int, int]] = {}
    for key, info in storage.items():
        k, s = _state(key, mpath), _state(info, mpath)
        if "offset" not in k:
            continue  # a bytes entry
        if s.get("transform_descriptors"):
            raise InvalidCheckpointError(f"{mpath}: tensor {k.get('fqn')!r} uses storage transforms {s['transform_descriptors']!r}, not supported")
        rel = s.get("relative_path")
        if not isinstance(rel, str) or not _FILE.match(rel) or rel in (".", ".."):
            raise InvalidCheckpointError(f"{mpath}: data file {rel!r} is not a plain file name in the directory")
        off, length = s.get("offset"), s.get("length")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (off, length)):
            raise InvalidCheckpointError(f"{mpath}: bad byte range for {k.get('fqn')!r}")
        where[(str(k.get("fqn")), _size(k["offset"], mpath))] = (rel, off, length)
    chunks = []
    for fqn, tmd in sdm.items():
        if not isinstance(tmd, Obj) or tmd.cls.name != "TensorStorageMetadata":
            continue  # BytesStorageMetadata and the like: not tensors
        t = _state(tmd, mpath)
        # TensorProperties pickles its fields as a tuple (dtype, layout, requires_grad, ...)
        props = t["properties"].state if isinstance(t.get("properties"), Obj) else None
        dt = props.get("dtype") if isinstance(props, dict) else (props[0] if isinstance(props, tuple) and props else None)
        if not isinstance(dt, Global) or dt.module != "torch" or not isinstance(getattr(torch, dt.name, None), torch.dtype):
            raise InvalidCheckpointError(f"{mpath}: tensor {fqn!r} has no known dtype")
        dtype = getattr(torch, dt.name)
        shape = _size(t.get("size"), mpath)
        for c in t.get("chunks") or []:
            cs = _state(c, mpath)
            offsets, sizes = _size(cs.get("offsets"), mpath), _size(cs.get("sizes"), mpath)
            loc = where.get((fqn, offsets))
            if loc is None:
                raise InvalidCheckpointError(f"{mpath}: chunk of {fqn!r} at {list(offsets)} has no stored bytes")
            chunks.append(DcpChunk(fqn, dtype, shape, offsets, sizes, *loc))
    return chunks


def _read_chunk(path: str, c: DcpChunk) -> torch.Tensor:
    fpath = os.path.join(path, c.file)
    what = f"{fpath}: chunk of {c.fqn!r} at {list(c.offsets)}"
    try:
        with open(fpath, "rb") as f:
            f.seek(c.offset)
            data = f.read(c.length)
    except OSError as e:
        raise InvalidCheckpointError(f"{what}: cannot read ({e.strerror or e})") from None
    if len(data) != c.length:
        raise InvalidCheckpointError(f"{what}: file is truncated")
    if not data.startswith(b"PK"):
        raise InvalidCheckpointError(f"{what}: not torch_save serialized (only DCP's default serialization is supported)")
    try:
        t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to load is an unreadable checkpoint
        raise InvalidCheckpointError(f"{what}: cannot load ({type(e).__name__}: {e})") from None
    if not isinstance(t, torch.Tensor) or t.dtype != c.dtype or tuple(t.shape) != c.sizes:
        raise InvalidCheckpointError(f"{what}: holds {getattr(t, 'dtype', type(t).__name__)}{list(getattr(t, 'shape', []))}, metadata says {c.dtype}{list(c.sizes)}")
    return t.contiguous()


class DcpFileSource(ShardedSource):
    """The chunks of one DCP data file, as one (pseudo-)rank of a sharded publish."""

    def __init__(self, path: str, chunks: list[DcpChunk], rank: int, world: int, rename=None):
        self.path_dir, self.chunks, self.rank, self.world = path, chunks, rank, world
        self.rename = rename or (lambda n: n)
        self.shards = []

    def snapshot(self) -> ShardSnapshot:
        specs, bits, dtypes, infos = [], [], [], {}
        for c in self.chunks:
            name = self.rename(c.fqn)
            t = _read_chunk(self.path_dir, c)
            dt = dtype_of(t)
            piece = Piece(name, c.shape, c.offsets, c.sizes, 0, c_strides(c.sizes))
            specs.append(ShardSpec(f"{c.fqn}@{','.join(map(str, c.offsets))}", c.sizes, (piece,)))
            bits.append(bits_of(t))
            dtypes.append(dt.name)
            infos[name] = TensorInfo(name, dt.name, c.shape)
        return ShardSnapshot(self.rank, self.world, specs, bits, dtypes, infos, path=self.path_dir)


def dcp_sources(path, prefix: str | None = None) -> list[DcpFileSource]:
    """One source per data file of the DCP directory ``path``. ``prefix``: publish only the tensors
    whose names start with it, with it removed (e.g. ``"model."`` for ``{"model": ..., "optim": ...}``)."""
    path = os.fspath(path)
    chunks = read_dcp_metadata(path)
    if prefix:
        chunks = [c for c in chunks if c.fqn.startswith(prefix)]
    if not chunks:
        raise InvalidCheckpointError(f"{path}: no tensors to publish" + (f" under prefix {prefix!r}" if prefix else ""))
    rename = (lambda n: n[len(prefix):]) if prefix else None
    files = sorted({c.file for c in chunks})
    by_file = {f: [c for c in chunks if c.file == f] for f in files}
    for f in files:
        if not os.path.isfile(os.path.join(path, f)):
            raise InvalidCheckpointError(f"{os.path.join(path, f)}: data file named in the metadata is missing")
    return [DcpFileSource(path, by_file[f], r, len(files), rename) for r, f in enumerate(files)]
