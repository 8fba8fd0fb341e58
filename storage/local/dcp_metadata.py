"""The metadata of a ``torch.distributed.checkpoint`` (DCP) directory, read without unpickling.

The directory's ``.metadata`` lists, for every tensor, its dtype, global shape and the chunks that
were saved (each chunk: ``offsets`` and ``sizes`` in the global tensor) and where each chunk's
bytes are (file, byte offset, length). ``.metadata`` is a pickle; it is *not* unpickled:
``storage.local.pickle_data`` tokenizes it with ``pickletools`` and evaluates only data opcodes,
accepting references to the DCP metadata classes below (never imported or called) and rejecting
anything else. Storage transforms (compression extensions) are refused naming the tensor.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from dcr_core.dtypes import DTYPES
from dcr_core.errors import InvalidCheckpointError
from storage.local.pickle_data import Global, Obj, load_data

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
} | {("torch", d.torch_name) for d in DTYPES.values()}
_BY_TORCH_NAME = {d.torch_name: d.name for d in DTYPES.values()}
_FILE = re.compile(r"^[A-Za-z0-9_.-]{1,255}$")


@dataclass(frozen=True)
class DcpChunk:
    """One saved chunk of a tensor: a box of the global tensor, held contiguously in one file."""

    fqn: str
    dtype: str  # safetensors dtype name
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


def _byte_count(v: object) -> int | None:
    """``v`` if it is a count of bytes (an int, not a bool, at least 0), else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


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
        off, length = _byte_count(s.get("offset")), _byte_count(s.get("length"))
        if off is None or length is None:
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
        if not isinstance(dt, Global) or dt.module != "torch" or dt.name not in _BY_TORCH_NAME:
            raise InvalidCheckpointError(f"{mpath}: tensor {fqn!r} has no supported dtype ({dt!r})")
        dtype = _BY_TORCH_NAME[dt.name]
        shape = _size(t.get("size"), mpath)
        for c in t.get("chunks") or []:
            cs = _state(c, mpath)
            offsets, sizes = _size(cs.get("offsets"), mpath), _size(cs.get("sizes"), mpath)
            loc = where.get((fqn, offsets))
            if loc is None:
                raise InvalidCheckpointError(f"{mpath}: chunk of {fqn!r} at {list(offsets)} has no stored bytes")
            chunks.append(DcpChunk(fqn, dtype, shape, offsets, sizes, *loc))
    return chunks


def is_dcp_dir(path) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA))
