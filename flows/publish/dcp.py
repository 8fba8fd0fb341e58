"""A ``torch.distributed.checkpoint`` (DCP) directory as a sharded source, without loading full tensors.

Every saved chunk (``storage.local.dcp_metadata``: its offsets and sizes in the global tensor and
where its bytes are) is exactly a piece (a box of the canonical tensor held contiguously), so the
directory publishes like the shards of a sharded trainer: every data file
(``__<rank>_<i>.distcp``, written by one rank) is one pseudo-rank, and the files are published one
at a time from this process (memory: one file's chunks, never a gathered tensor). Each chunk's
bytes (DCP's default ``torch_save`` serialization) are read as a byte range and loaded with
``torch.load(weights_only=True)``, the restricted loader that only rebuilds tensors. Non-tensor
entries are skipped; DCP's ``safetensors`` serialization is not supported and fails naming the
tensor.
"""

from __future__ import annotations

import io
import os

import torch

from dcr_core.bits import bits_of, dtype_of, torch_dtype
from dcr_core.dtypes import TensorInfo
from dcr_core.errors import InvalidCheckpointError
from dcr_core.shard_spec import Piece, ShardSpec, c_strides
from flows.publish.shards import ShardedSource, ShardSnapshot
from storage.local.dcp_metadata import DcpChunk, read_dcp_metadata


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
    if not isinstance(t, torch.Tensor) or t.dtype != torch_dtype(c.dtype) or tuple(t.shape) != c.sizes:
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
