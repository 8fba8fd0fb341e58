"""Canonical checkpoints on local disk: safetensors files or Hugging Face sharded directories.

Readers validate the whole header (names, dtypes, shapes, offsets within the file) before any
tensor is used; writers write a temp file in the destination directory, fsync it and rename it
over the destination, so a crash never leaves a half-written checkpoint or receiver state.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import math
import os
import struct
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from dcr_core.dtypes import DTYPES, dtype_named, dtype_of
from dcr_core.errors import InvalidCheckpointError
from storage.commit import fsync_dir

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def _read_header(path: str, f) -> tuple[dict[str, TensorInfo], dict[str, str], dict[str, int]]:
    """Parse and check one safetensors header (from the open file ``f``) without loading any tensor."""
    try:
        size = os.fstat(f.fileno()).st_size
        raw_len = os.pread(f.fileno(), 8, 0)
        if len(raw_len) < 8:
            raise InvalidCheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw_len)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise InvalidCheckpointError(f"{path}: truncated or not a safetensors file (header of {n} bytes)")
        raw = b""
        while len(raw) < n:
            more = os.pread(f.fileno(), n - len(raw), 8 + len(raw))
            if not more:
                raise InvalidCheckpointError(f"{path}: truncated header")
            raw += more
        header = json.loads(raw)
    except OSError as e:
        raise InvalidCheckpointError(f"{path}: cannot read checkpoint ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError):
        raise InvalidCheckpointError(f"{path}: safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise InvalidCheckpointError(f"{path}: safetensors header is not an object")
    metadata = header.pop("__metadata__", None) or {}
    infos: dict[str, TensorInfo] = {}
    offsets: dict[str, int] = {}
    end_max = 0
    for name, d in header.items():
        try:
            dt = dtype_named(d["dtype"])
            shape = tuple(int(x) for x in d["shape"])
            start, end = (int(x) for x in d["data_offsets"])
        except InvalidCheckpointError as e:
            raise InvalidCheckpointError(f"{path}: tensor {name!r}: {e}") from None
        except (KeyError, TypeError, ValueError):
            raise InvalidCheckpointError(f"{path}: tensor {name!r} has a malformed header entry") from None
        if any(x < 0 for x in shape) or end - start != math.prod(shape) * dt.itemsize or start < 0:
            raise InvalidCheckpointError(f"{path}: tensor {name!r} has inconsistent shape/offsets")
        end_max = max(end_max, end)
        infos[name] = TensorInfo(name, dt.name, shape)
        offsets[name] = 8 + n + start
    if 8 + n + end_max > size:
        raise InvalidCheckpointError(
            f"{path}: truncated (needs {8 + n + end_max} bytes, file has {size})"
        )
    return infos, {str(k): str(v) for k, v in metadata.items()}, offsets


class SafetensorsCheckpoint:
    """A ``.safetensors`` file or a sharded directory, opened for reading tensor by tensor."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if os.path.isdir(self.path):
            self._files = self._index_files()
        elif os.path.exists(self.path):
            self._files = [self.path]
        else:
            raise InvalidCheckpointError(f"{self.path}: no such checkpoint")
        self.infos: dict[str, TensorInfo] = {}
        self._where: dict[str, str] = {}
        self._offset: dict[str, int] = {}
        self.metadata: dict[str, str] = {}
        # Files stay open: a reader keeps seeing the file it validated even if a writer atomically
        # replaces the path meanwhile (the publisher's baseline cache is replaced that way).
        self._fh: dict[str, object] = {}
        for f in self._files:
            try:
                self._fh[f] = open(f, "rb", buffering=0)
            except OSError as e:
                raise InvalidCheckpointError(f"{f}: cannot read checkpoint ({e.strerror or e})") from None
            infos, meta, offsets = _read_header(f, self._fh[f])
            self._offset.update(offsets)
            self.metadata.update(meta)
            for name, info in infos.items():
                if name in self.infos:
                    raise InvalidCheckpointError(f"{self.path}: tensor {name!r} appears in two files")
                self.infos[name] = info
                self._where[name] = f

    def _index_files(self) -> list[str]:
        index = os.path.join(self.path, INDEX_NAME)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                files = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                raise InvalidCheckpointError(f"{index}: not a valid safetensors index") from None
            for name in files:
                if os.path.basename(name) != name:
                    raise InvalidCheckpointError(f"{index}: shard {name!r} lies outside the directory")
        else:
            files = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors"))
        if not files:
            raise InvalidCheckpointError(f"{self.path}: directory holds no .safetensors files")
        return [os.path.join(self.path, n) for n in files]

    def tensor(self, name: str) -> torch.Tensor:
        """A fresh copy of one tensor, read with plain reads (no mmap: the process's resident
        memory then holds only what DCR allocated, one tensor at a time)."""
        f = self._where[name]
        info = self.infos[name]
        dt = DTYPES[info.dtype]
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        fd = self._fh[f].fileno()
        view = memoryview(buf.numpy())
        got = 0
        try:
            while got < info.nbytes:
                n = os.preadv(fd, [view[got:]], self._offset[name] + got)
                if not n:
                    break
                got += n
        except OSError as e:
            raise InvalidCheckpointError(f"{f}: cannot read tensor {name!r} ({e.strerror or e})") from None
        if got != info.nbytes:
            raise InvalidCheckpointError(f"{f}: tensor {name!r} is truncated")
        return buf.view(dt.torch).reshape(info.shape)

    def data_offset(self, name: str) -> int:
        """Byte offset of one tensor's data in its file."""
        return self._offset[name]

    def mapped_bits(self, name: str):
        """One tensor's raw bits as a read-only memory map (flat, unsigned ints): file-backed pages
        the OS can drop, not memory DCR holds. For bits read in place (a publisher's baseline)."""
        import numpy as np

        info = self.infos[name]
        dt = DTYPES[info.dtype]
        count = info.nbytes // dt.itemsize
        if not count:
            return np.empty(0, dtype=dt.storage)
        return np.memmap(self._where[name], dtype=dt.storage, mode="r", offset=self._offset[name], shape=(count,))

    def close(self) -> None:
        for fh in self._fh.values():
            fh.close()

    def __del__(self) -> None:
        for fh in getattr(self, "_fh", {}).values():
            fh.close()

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in sorted(self.infos):
            yield name, self.tensor(name)


def infos_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorInfo]:
    return {n: TensorInfo(n, dtype_of(t).name, tuple(t.shape)) for n, t in tensors.items()}


def write_safetensors(
    path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` to ``path`` atomically (temp file, fsync, rename)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
    try:
        save_file({n: t.contiguous() for n, t in tensors.items()}, tmp, metadata=dict(metadata or {}))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class StreamingSafetensorsWriter:
    """Writes a safetensors file tensor by tensor, in a fixed order, with bounded memory.

    The header (names, dtypes, shapes, offsets, metadata) is known up front, so tensors are
    appended as they are produced. The file is written under a temp name in the destination's
    directory; ``commit`` fsyncs and renames it over the destination, ``abort`` removes it.
    ``durable=False`` skips both fsyncs (file and directory): the rename still never exposes a
    half-written file to a running reader, but a power loss may; only for files that are checked
    before use, such as the publisher's baseline cache. Receiver state files stay durable.
    ``header_room`` pads the header with that many spaces, so metadata can grow when the header is
    rewritten in place (receiver states patched in place, ``flows.patch_state``).
    """

    def __init__(
        self, path: str | os.PathLike, infos: list[TensorInfo], metadata: Mapping[str, str] | None = None,
        durable: bool = True, header_room: int = 0,
    ):
        self.path = os.fspath(path)
        self.durable = durable
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        self.tmp = os.path.join(directory, f".{os.path.basename(self.path)}.tmp-{uuid.uuid4().hex}")
        self._order = [i.name for i in infos]
        self._sizes = {i.name: i.nbytes for i in infos}
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for info in infos:
            header[info.name] = {
                "dtype": info.dtype, "shape": list(info.shape), "data_offsets": [offset, offset + info.nbytes],
            }
            offset += info.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * header_room  # spare room: the header can later be rewritten in place
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        self._f = open(self.tmp, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, data) -> None:
        if self._next >= len(self._order) or self._order[self._next] != name:
            raise ValueError(f"tensor {name!r} written out of order")
        view = memoryview(data).cast("B")
        if view.nbytes != self._sizes[name]:
            raise ValueError(f"tensor {name!r}: {view.nbytes} bytes, header says {self._sizes[name]}")
        self._f.write(view)
        self._next += 1

    def commit(self) -> None:
        if self._next != len(self._order):
            raise ValueError(f"only {self._next} of {len(self._order)} tensors written")
        try:
            self._f.flush()
            if self.durable:
                os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        if self.durable:
            fsync_dir(os.path.dirname(os.path.abspath(self.path)))

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


@contextlib.contextmanager
def exclusive(path: str | os.PathLike):
    """Hold the lock of the file at ``path`` (``.<name>.lock`` beside it) for one writer at a time,
    and remove temp files that a writer of ``path`` killed earlier (``kill -9``) left behind.

    The lock is advisory (``flock``) and dies with its process, so a killed writer never blocks the
    next one; waiting writers queue.
    """
    path = os.path.realpath(os.fspath(path))  # one lock per file, whatever path names it
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f".{name}.lock"), "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            for leftover in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(name)}.tmp-*")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
