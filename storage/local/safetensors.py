"""Canonical checkpoints on local disk: safetensors files or Hugging Face sharded directories.

Readers validate the whole header (names, dtypes, shapes, offsets within the file) before any
tensor is used and hand out raw bits (flat unsigned numpy arrays: no torch); writers write a temp
file in the destination directory, fsync it and rename it over the destination, so a crash never
leaves a half-written checkpoint or receiver state.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import json
import math
import mmap
import os
import struct
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from dcr_core.dtypes import DTYPES, TensorInfo, dtype_named
from dcr_core.errors import InvalidCheckpointError
from storage.document_fields import loads
from storage.local.objects import fsync_dir

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20
COPY_BUFFER_BYTES = 4 << 20  # StreamingSafetensorsWriter.copy_from without copy_file_range


@dataclass(frozen=True)
class Header:
    """A safetensors header as stored: its bytes (the 8-byte length prefix included) and parsed form."""

    raw: bytes  # length prefix + JSON (+ padding)
    doc: dict  # the parsed JSON, ``__metadata__`` included

    @property
    def data_start(self) -> int:
        return len(self.raw)

    def with_metadata(self, metadata: Mapping[str, str]) -> bytes | None:
        """The same header with ``metadata`` merged in, padded with spaces to the same length (so
        no tensor moves), or None when it does not fit."""
        doc = dict(self.doc)
        doc["__metadata__"] = {**(doc.get("__metadata__") or {}), **{str(k): str(v) for k, v in metadata.items()}}
        body = json.dumps(doc, separators=(",", ":")).encode()
        room = len(self.raw) - 8
        if len(body) > room:
            return None
        return struct.pack("<Q", room) + body + b" " * (room - len(body))


def _other_format(first: bytes) -> str | None:
    """What a file that is not safetensors looks like from its first bytes, where that is clear."""
    if first.startswith(b"PK\x03\x04"):
        return "a zip archive: torch.save writes .pt and .bin files this way"
    if first[:1] == b"\x80" and 2 <= first[1] <= 5:
        return "a Python pickle: an older torch.save file?"
    if first.startswith(b"\x89HDF"):
        return "an HDF5 file"
    if first.startswith(b"GGUF"):
        return "a GGUF file"
    return None


def read_header(path: str, fd: int) -> Header:
    """Read one safetensors header (from the open file ``fd``) without loading any tensor."""
    try:
        size = os.fstat(fd).st_size
        first = os.pread(fd, 9, 0)
        raw_len = first[:8]
        if len(raw_len) < 8:
            raise InvalidCheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        # A header's JSON opens at byte 8; only a file without it is matched against other formats
        # (a header of 640 bytes starts with the bytes a pickle starts with).
        kind = None if first[8:] == b"{" else _other_format(raw_len)
        if kind:
            raise InvalidCheckpointError(f"{path}: not a safetensors file ({kind}); save it with safetensors "
                                         "(safetensors.torch.save_file) and publish that")
        (n,) = struct.unpack("<Q", raw_len)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise InvalidCheckpointError(f"{path}: truncated or not a safetensors file (header of {n} bytes)")
        raw = b""
        while len(raw) < n:
            more = os.pread(fd, n - len(raw), 8 + len(raw))
            if not more:
                raise InvalidCheckpointError(f"{path}: truncated header")
            raw += more
        doc = header_doc(raw)
    except InvalidCheckpointError:  # a ValueError too: said above, as it is
        raise
    except OSError as e:
        raise InvalidCheckpointError(f"{path}: cannot read checkpoint ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise InvalidCheckpointError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(doc, dict):
        raise InvalidCheckpointError(f"{path}: safetensors header is not an object")
    return Header(raw_len + raw, doc)


def _parse_header(path: str, fd: int) -> tuple[Header, dict[str, TensorInfo], dict[str, str], dict[str, int]]:
    """Parse and check one safetensors header: tensors, metadata and each tensor's data offset."""
    head = read_header(path, fd)
    size = os.fstat(fd).st_size
    n = head.data_start - 8
    try:
        infos, metadata, starts, end_max = header_entries(head.raw)
    except InvalidCheckpointError as e:
        raise InvalidCheckpointError(f"{path}: {e}") from None
    if 8 + n + end_max > size:
        raise InvalidCheckpointError(
            f"{path}: truncated (needs {8 + n + end_max} bytes, file has {size})"
        )
    return head, infos, metadata, _file_offsets(head.raw)


@functools.lru_cache(maxsize=8)
def _file_offsets(raw: bytes) -> dict[str, int]:
    """Each tensor's data offset in the file whose header (length prefix included) is ``raw``: kept
    beside ``header_entries``, as the checkpoint is opened several times. Callers must not change it."""
    return {k: len(raw) + v for k, v in header_entries(raw)[2].items()}


@functools.lru_cache(maxsize=8)
def header_doc(text: bytes):
    """A header's JSON text parsed, kept for the few headers in use (a publish opens its checkpoint
    several times, and the header of 70,000 tensors is 6 MB of JSON): callers must not change it."""
    return loads(text)


_INTS = frozenset({int})  # a shape's dimensions are JSON integers: their types, checked in one pass in C


@functools.lru_cache(maxsize=8)
def header_entries(raw: bytes) -> tuple[dict[str, TensorInfo], dict[str, str], dict[str, int], int]:
    """The tensors, metadata, data starts and data end a header's bytes describe, checked (kept for
    the few headers in use: a publish opens its checkpoint several times). A well-formed header is
    checked column by column (``_entries_whole``); one that is not, entry by entry, for the error
    naming the first bad tensor. Errors name no file: the caller adds it."""
    header = dict(header_doc(raw[8:]))  # a copy: the parsed document is shared
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise InvalidCheckpointError("safetensors metadata is not an object")
    whole = _entries_whole(header)
    if whole is not None:
        return whole[0], {str(k): str(v) for k, v in metadata.items()}, whole[1], whole[2]
    infos: dict[str, TensorInfo] = {}
    starts: dict[str, int] = {}
    spans: list[tuple[int, int, str]] = []
    end_max = 0
    prod = math.prod
    for name, d in header.items():
        try:  # the common case first (a plain entry of JSON integers), one dict lookup per field
            dt = DTYPES[d["dtype"]]
            shape, (start, end) = d["shape"], d["data_offsets"]
            if type(shape) is not list or not _INTS.issuperset(map(type, shape)) or type(start) is not int \
                    or type(end) is not int:
                raise TypeError
            shape = tuple(shape)
        except (KeyError, TypeError, ValueError):
            try:
                dt = dtype_named(d["dtype"])
                shape = tuple(int(x) for x in d["shape"])
                start, end = (int(x) for x in d["data_offsets"])
            except InvalidCheckpointError as e:
                raise InvalidCheckpointError(f"tensor {name!r}: {e}") from None
            except (KeyError, TypeError, ValueError):
                raise InvalidCheckpointError(f"tensor {name!r} has a malformed header entry") from None
        if start < 0 or end - start != prod(shape) * dt.itemsize or (shape and min(shape) < 0):
            raise InvalidCheckpointError(f"tensor {name!r} has inconsistent shape/offsets")
        if end > end_max:
            end_max = end
        infos[name] = TensorInfo(name, dt.name, shape)
        starts[name] = start
        spans.append((start, end, name))
    spans.sort()
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise InvalidCheckpointError(f"tensors {a!r} and {b!r} overlap (data_offsets)")
    return infos, {str(k): str(v) for k, v in metadata.items()}, starts, end_max


def _entries_whole(header: dict) -> tuple[dict[str, TensorInfo], dict[str, int], int] | None:
    """``header_entries`` of a well-formed header, each check one pass over a column in C (types,
    dtypes, bounds, sizes, overlaps: numpy over every tensor at once); None if any check fails or a
    field is not as expected, and the caller checks entry by entry to name the first bad tensor."""
    names = list(header)
    entries = list(header.values())
    try:
        dtypes = [e["dtype"] for e in entries]
        shapes = [e["shape"] for e in entries]
        offsets = [e["data_offsets"] for e in entries]
    except (KeyError, TypeError):
        return None
    if not names:
        return {}, {}, 0
    if set(map(type, dtypes)) != {str} or not DTYPES.keys() >= set(dtypes) or set(map(type, shapes)) != {list} or set(map(type, offsets)) != {list} \
            or set(map(len, offsets)) != {2}:
        return None
    dims = list(itertools.chain.from_iterable(shapes))
    ends = list(itertools.chain.from_iterable(offsets))
    if not _INTS.issuperset(map(type, dims)) or not _INTS.issuperset(map(type, ends)) or (dims and min(dims) < 0):
        return None
    try:
        span = np.array(ends, np.int64).reshape(-1, 2)
        numel = np.fromiter(map(math.prod, shapes), np.int64, len(shapes))
    except OverflowError:  # beyond any file: the entry-by-entry check says which tensor
        return None
    size = np.fromiter(map(_ITEMSIZE.__getitem__, dtypes), np.int64, len(dtypes))
    start, end = span[:, 0], span[:, 1]
    if not ((start >= 0) & (end - start == numel * size)).all():
        return None
    order = np.lexsort((end, start))  # by start, then end: the order the overlap check reads
    if (start[order[1:]] < end[order[:-1]]).any():
        return None
    infos = dict(zip(names, map(TensorInfo, names, dtypes, map(tuple, shapes))))
    return infos, dict(zip(names, start.tolist())), int(end.max())


_ITEMSIZE = {k: d.itemsize for k, d in DTYPES.items()}


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
        self.headers: dict[str, Header] = {}
        self.sizes: dict[str, int] = {}  # each file's size, as opened
        # Files stay open: a reader keeps seeing the file it validated even if a writer atomically
        # replaces the path meanwhile (the publisher's baseline cache is replaced that way).
        self._fh: dict[str, io.FileIO] = {}
        for f in self._files:
            try:
                self._fh[f] = open(f, "rb", buffering=0)
            except OSError as e:
                raise InvalidCheckpointError(f"{f}: cannot read checkpoint ({e.strerror or e})") from None
            self.headers[f], infos, meta, offsets = _parse_header(f, self._fh[f].fileno())
            self.sizes[f] = os.fstat(self._fh[f].fileno()).st_size
            twice = infos.keys() & self.infos.keys() if self.infos else ()
            if twice:
                raise InvalidCheckpointError(f"{self.path}: tensor {min(twice)!r} appears in two files")
            # Whole tables at once (the parsed header's are shared, never changed): no Python loop per tensor.
            self._offset.update(offsets)
            self.metadata.update(meta)
            self.infos.update(infos)
            self._where.update(dict.fromkeys(infos, f))

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

    def bits(self, name: str) -> np.ndarray:
        """A fresh copy of one tensor's raw bits (flat, unsigned), read with plain reads (no mmap:
        the process's resident memory then holds only what DCR allocated, one tensor at a time)."""
        f = self._where[name]
        info = self.infos[name]
        dt = DTYPES[info.dtype]
        buf = np.empty(info.nbytes, dtype=np.uint8)
        fd = self._fh[f].fileno()
        view = buf.data
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
        return buf.view(dt.storage)

    def read_into(self, name: str, start: int, out: np.ndarray) -> np.ndarray:
        """Elements ``[start, start + out.size)`` of one tensor's raw bits, read into ``out`` (flat,
        contiguous, the tensor's unsigned storage dtype) and returned: for readers that reuse
        chunk-sized buffers (no fresh memory per tensor, and a private copy of what was read)."""
        f = self._where[name]
        info = self.infos[name]
        dt = DTYPES[info.dtype]
        if out.dtype != dt.storage or out.ndim != 1 or not out.flags.c_contiguous:
            raise ValueError(f"tensor {name!r}: read_into needs a flat contiguous {dt.storage} buffer")
        nbytes = out.size * dt.itemsize
        first = start * dt.itemsize
        if start < 0 or first + nbytes > info.nbytes:
            raise ValueError(f"tensor {name!r}: elements [{start}, {start + out.size}) out of range")
        view = out.view(np.uint8).data
        fd = self._fh[f].fileno()
        got = 0
        try:
            while got < nbytes:
                n = os.preadv(fd, [view[got:]], self._offset[name] + first + got)
                if not n:
                    break
                got += n
        except OSError as e:
            raise InvalidCheckpointError(f"{f}: cannot read tensor {name!r} ({e.strerror or e})") from None
        if got != nbytes:
            raise InvalidCheckpointError(f"{f}: tensor {name!r} is truncated")
        return out

    def file_of(self, name: str) -> tuple[int, int]:
        """``(fd, byte offset)`` of one tensor's data in the open file that holds it (the file this
        reader validated, even if its path was replaced since): for copies made by the kernel."""
        return self._fh[self._where[name]].fileno(), self._offset[name]

    def files_of(self, names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """``file_of`` for many tensors at once: their file descriptors and data offsets (two arrays)."""
        offsets = np.fromiter(map(self._offset.__getitem__, names), np.int64, len(names))
        if len(self._fh) == 1:
            fds = np.full(len(names), next(iter(self._fh.values())).fileno(), np.int64)
        else:
            fd = {f: h.fileno() for f, h in self._fh.items()}
            fds = np.fromiter(map(fd.__getitem__, map(self._where.__getitem__, names)), np.int64, len(names))
        return fds, offsets

    def file_order(self) -> Mapping[str, int | tuple[int, int]]:
        """A sort key per tensor: where its data lies (its byte offset; in a directory, the file's
        index first). Callers must not change it."""
        if len(self._files) == 1:
            return self._offset
        index = {f: i for i, f in enumerate(self._files)}
        return {n: (index[self._where[n]], self._offset[n]) for n in self.infos}

    def file_named(self, name: str) -> str:
        """The path of the file that holds tensor ``name``."""
        return self._where[name]

    def data_offset(self, name: str) -> int:
        """Byte offset of one tensor's data in its file."""
        return self._offset[name]

    def mapped_bits(self, name: str) -> np.ndarray:
        """One tensor's raw bits as a read-only memory map (flat, unsigned ints): file-backed pages
        the OS can drop, not memory DCR holds. For bits read in place (a publisher's baseline)."""
        info = self.infos[name]
        dt = DTYPES[info.dtype]
        return self.mapped_range(self._where[name], self._offset[name], info.nbytes // dt.itemsize, dt.storage)

    def mapped_range(self, f: str, offset: int, count: int, storage) -> np.ndarray:
        """``count`` elements of numpy dtype ``storage`` at byte ``offset`` of file ``f`` (one of
        this checkpoint's), read-only, through a map of those bytes of the file as it was opened
        (not of the path: a file replaced meanwhile is not read). The map is the array's: unmapped
        once nothing views it (touched pages do not stay in the process), valid after ``close``."""
        if not count:
            return np.empty(0, dtype=storage)
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        m = mmap.mmap(self._fh[f].fileno(), offset - start + count * np.dtype(storage).itemsize,
                      access=mmap.ACCESS_READ, offset=start)
        return np.frombuffer(m, dtype=storage, count=count, offset=offset - start)

    def close(self) -> None:
        for fh in self._fh.values():
            fh.close()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        for fh in getattr(self, "_fh", {}).values():
            fh.close()

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """``(name, bits)`` of every tensor in name order, one tensor at a time."""
        for name in sorted(self.infos):
            yield name, self.bits(name)


class _TempFileWriter:
    """A file written under a temp name beside ``path`` (``_f``), then installed over it: what both
    writers below share. ``finish`` closes the complete temp file and returns its path."""

    path: str
    tmp: str
    durable: bool
    _f: BinaryIO

    @contextlib.contextmanager
    def _naming_the_file(self):
        """An OSError while writing (a full disk, a file-size limit) names the file being written:
        errors of ``write`` carry no file name of their own. The temp file is removed."""
        try:
            yield
        except OSError as e:
            if e.filename is not None:
                raise
            self.abort()
            raise OSError(e.errno, f"{e.strerror or e} while writing", self.path) from None

    def finish(self) -> str:
        raise NotImplementedError

    def _close_temp(self) -> str:
        """Flush, fsync (when durable) and close the temp file, removed if that fails; its path."""
        try:
            with self._naming_the_file():
                self._f.flush()
                if self.durable:
                    os.fsync(self._f.fileno())
                self._f.close()
        except BaseException:
            self.abort()
            raise
        return self.tmp

    def commit(self) -> None:
        """``finish`` then ``install``: the destination now holds the new file."""
        tmp = self.finish()
        try:
            install(tmp, self.path, self.durable)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if not self._f.closed:
            try:
                self._f.close()
            except OSError:  # its buffer could not be written (the disk is full): closed all the same
                pass
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


class StreamingSafetensorsWriter(_TempFileWriter):
    """Writes a safetensors file tensor by tensor, in a fixed order, with bounded memory.

    The header (names, dtypes, shapes, offsets, metadata) is known up front, so tensors are
    appended as they are produced. The file is written under a temp name in the destination's
    directory; ``commit`` fsyncs and renames it over the destination, ``abort`` removes it.
    ``durable=False`` skips both fsyncs (file and directory): the rename still never exposes a
    half-written file to a running reader, but a power loss may; only for files that are checked
    before use, such as the publisher's baseline cache. Receiver state files stay durable.
    ``header_room`` pads the header with that many spaces, so metadata can grow when the header is
    rewritten in place (receiver states patched in place, ``flows.receive.in_place``).
    """

    def __init__(
        self, path: str | os.PathLike, infos: list[TensorInfo], metadata: Mapping[str, str] | None = None,
        durable: bool = True, header_room: int = 0,
    ):
        self.path = os.fspath(path)
        self.durable = durable
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        self.tmp = temp_path(self.path)
        self._order = [i.name for i in infos]
        raw, self.offsets, self._sizes = _header(infos, metadata, header_room)
        self.size = len(raw) + sum(self._sizes.values())  # the finished file's bytes
        self._f = open(self.tmp, "wb")
        with self._naming_the_file():
            self._f.write(raw)
        self._next = 0

    def reserve(self) -> dict[str, int]:
        """Give the temp file its full size at once and return every tensor's byte offset in it:
        the tensors are then written there by others, in any order (``write_at``: the tasks of a
        mapped materialize, each fsyncing what it wrote), and ``finish`` closes the file."""
        self._f.flush()
        os.ftruncate(self._f.fileno(), self.size)
        self._next = len(self._order)
        return dict(self.offsets)

    def write(self, name: str, data) -> None:
        if self._next >= len(self._order) or self._order[self._next] != name:
            raise ValueError(f"tensor {name!r} written out of order")
        view = memoryview(data).cast("B")
        if view.nbytes != self._sizes[name]:
            raise ValueError(f"tensor {name!r}: {view.nbytes} bytes, header says {self._sizes[name]}")
        with self._naming_the_file():
            self._f.write(view)
        self._next += 1

    def write_run(self, names, data) -> None:
        """Write the tensors ``names`` (next in order, back to back in the file) from one buffer."""
        names = list(names)
        if self._order[self._next:self._next + len(names)] != names:
            raise ValueError(f"tensors {names[0]!r}.. written out of order")
        view = memoryview(data).cast("B")
        want = sum(self._sizes[n] for n in names)
        if view.nbytes != want:
            raise ValueError(f"tensors {names[0]!r}..: {view.nbytes} bytes, header says {want}")
        with self._naming_the_file():
            self._f.write(view)
        self._next += len(names)

    def copy_from(self, name: str, fd: int, offset: int) -> None:
        """Append tensor ``name`` from ``fd`` (its bytes at ``offset``), copied by the kernel
        (``copy_file_range``; a bounded buffer where that is unavailable): no user memory holds it."""
        if self._next >= len(self._order) or self._order[self._next] != name:
            raise ValueError(f"tensor {name!r} written out of order")
        size = self._sizes[name]
        self._f.flush()
        out = self._f.fileno()
        at = self._f.tell()
        done = 0
        try:
            while done < size:
                n = os.copy_file_range(fd, out, size - done, offset + done, at + done)
                if not n:
                    break
                done += n
        except (AttributeError, OSError):  # no copy_file_range here (or not between these files)
            pass
        with self._naming_the_file():
            while done < size:
                data = os.pread(fd, min(size - done, COPY_BUFFER_BYTES), offset + done)
                if not data:
                    break
                os.pwrite(out, data, at + done)
                done += len(data)
        if done != size:
            raise ValueError(f"tensor {name!r}: source ended after {done} of {size} bytes")
        self._f.seek(at + size)
        self._next += 1

    def finish(self) -> str:
        """Close the complete temp file (fsynced when durable) and return its path; ``install``
        moves it into place. A finished temp file left by a crash is removed by the next writer
        holding the destination's lock (``storage.local.state.exclusive``)."""
        if self._next != len(self._order):
            raise ValueError(f"only {self._next} of {len(self._order)} tensors written")
        return self._close_temp()



class PlacedWriter(_TempFileWriter):
    """Writes a file whose header bytes and tensor placement are given, tensors in any order: a
    published safetensors file rebuilt byte for byte (``storage.source_layout``). The temp file
    beside ``path`` gets the header and its full size at once; ``write`` puts each tensor at its
    offset; ``finish`` fsyncs and closes it (every tensor written, or ``reserve``d for others to
    write with ``write_placed``); ``commit`` also renames it over ``path``, ``abort`` removes it."""

    def __init__(self, path: str | os.PathLike, header: bytes, placed: Mapping[str, tuple[int, int]], size: int,
                 durable: bool = True):
        self.path = os.fspath(path)
        self.durable = durable
        self.tmp = temp_path(self.path)
        self.offsets = {n: at for n, (at, _) in placed.items()}
        self._sizes = {n: nbytes for n, (_, nbytes) in placed.items()}
        self._left = set(placed)
        self.size = size
        self._f = open(self.tmp, "wb")
        with self._naming_the_file():
            self._f.write(header)
            self._f.flush()
            os.ftruncate(self._f.fileno(), size)

    def reserve(self) -> dict[str, int]:
        """Every tensor's byte offset; the tensors are then written by others (``write_placed``)."""
        self._left.clear()
        return dict(self.offsets)

    def write(self, name: str, data) -> None:
        if name not in self._left:
            raise ValueError(f"tensor {name!r} is not placed in {self.path} or was written already")
        view = memoryview(data).cast("B")
        if view.nbytes != self._sizes[name]:
            raise ValueError(f"tensor {name!r}: {view.nbytes} bytes, the header says {self._sizes[name]}")
        with self._naming_the_file():
            _pwrite_all(self._f.fileno(), view, self.offsets[name], self.path, name)
        self._left.discard(name)

    def finish(self) -> str:
        if self._left:
            raise ValueError(f"{self.path}: {len(self._left)} tensors not written (first {sorted(self._left)[0]!r})")
        return self._close_temp()


def _pwrite_all(fd: int, view: memoryview, at: int, path: str, name: str) -> int:
    done = 0
    while done < view.nbytes:
        n = os.pwrite(fd, view[done:], at + done)
        if n <= 0:
            raise OSError(f"{path}: wrote nothing at offset {at + done} (tensor {name!r})")
        done += n
    return done


def temp_path(path: str) -> str:
    """A fresh temp name beside ``path`` (hidden; removed by the next writer holding its lock)."""
    return os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")


def header_bytes(infos: list[TensorInfo], metadata: Mapping[str, str] | None = None,
                 header_room: int = 0) -> tuple[bytes, dict[str, int]]:
    """The header of a safetensors file of ``infos`` in that order (length prefix, JSON, padding
    to 8 bytes) and each tensor's byte offset in the file."""
    raw, offsets, _ = _header(infos, metadata, header_room)
    return raw, offsets


def _header(infos: list[TensorInfo], metadata: Mapping[str, str] | None,
            header_room: int) -> tuple[bytes, dict[str, int], dict[str, int]]:
    """``header_bytes``, and each tensor's size in bytes. Each entry's JSON is one string, its name
    escaped by ``json``'s own C encoder (what ``json.dumps`` of a string calls), its shape's text
    and size made once per distinct dtype and shape (a model has few): a header of 70,000 tensors
    renders in milliseconds."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset, rel, sizes, items = 0, {}, {}, []
    kinds: dict[tuple[str, tuple[int, ...]], tuple[str, int]] = {}
    quote = _quote
    for info in infos:
        name, kind = info.name, (info.dtype, info.shape)
        known = kinds.get(kind)
        if known is None:
            known = kinds[kind] = (f'":{{"dtype":"{info.dtype}","shape":[{",".join(map(str, info.shape))}],'
                                   f'"data_offsets":[', math.prod(info.shape) * DTYPES[info.dtype].itemsize)
        text, nbytes = known
        items.append(f'{quote(name)[:-1]}{text}{offset},{offset + nbytes}]}}')
        rel[name] = offset
        sizes[name] = nbytes
        offset += nbytes
    if len(rel) != len(items):
        raise ValueError("a tensor is named twice")
    head = json.dumps(header, separators=(",", ":"))
    raw = (head[:-1] + ("," if header and items else "") + ",".join(items) + "}").encode()
    raw += b" " * header_room  # spare room: the header can later be rewritten in place
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    start = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, {n: start + o for n, o in rel.items()}, sizes


_quote = json.encoder.encode_basestring_ascii  # json.dumps(str): the string's JSON text, ASCII


def write_at(path: str, placed: Mapping[str, int], tensors: Iterator[tuple[str, np.ndarray]]) -> int:
    """Write each ``(name, bits)`` of ``tensors`` at its offset ``placed[name]`` of the existing
    file ``path`` (a reserved temp file, ``StreamingSafetensorsWriter.reserve``), then fsync it;
    the bytes written. The file must exist: a worker that cannot see it fails here, naming it."""
    fd = os.open(path, os.O_WRONLY)
    written = 0
    try:
        for name, data in tensors:
            written += _pwrite_all(fd, data.data.cast("B"), placed[name], path, name)
        os.fsync(fd)
    finally:
        os.close(fd)
    return written


def write_placed(placed: Mapping[str, tuple[str, int]], tensors: Iterator[tuple[str, np.ndarray]]) -> int:
    """``write_at`` over several files: each ``(name, bits)`` of ``tensors`` written at
    ``placed[name] = (file, offset)`` (existing files, reserved), then every file written to is
    fsynced; the bytes written."""
    fds: dict[str, int] = {}
    written = 0
    try:
        for name, data in tensors:
            path, at = placed[name]
            if path not in fds:
                fds[path] = os.open(path, os.O_WRONLY)
            written += _pwrite_all(fds[path], data.data.cast("B"), at, path, name)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    return written


def install(tmp: str, path: str, durable: bool = True) -> None:
    """Atomically replace ``path`` with the finished temp file ``tmp`` (same directory)."""
    os.replace(tmp, path)
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))
