"""A log of the elements a publish changed, to patch the publisher's baseline cache in place.

A delta publish compares every new tensor with the baseline anyway; beside each changed chunk it
appends the positions and new raw values of the chunk's changed elements to this log (a file in
the cache directory, written sequentially while encoding). Once the step is committed the cache
file is patched with them (``apply``): only the changed elements are written, through the page
cache, instead of a copy of the whole checkpoint. Memory stays bounded by one chunk: the log is on
disk, one record per chunk, and ``apply`` streams it record by record.

The log is only ever applied to the cache it was computed against, after the commit, and never
trusted blindly: its BLAKE3 trailer is checked over the whole file before the first element is
written, every record must name a tensor of the cache with its element size and positions inside
it, and the patched cache is checked as the next delta reads it (``flows.publish.baseline``,
"Trust"). A log cut off by a crash has no trailer (it is written under a temp name and renamed
when whole) and is never applied.

Layout: ``DCRPLOG1``, u64 length of a JSON head (free-form: the steps it takes the cache from and
to), the head; per record a ``<IQBB`` prefix (length of the tensor's UTF-8 name, count, element
size, 1 when positions are int64 instead of uint32), the name, the positions (ascending) and the
values; an end prefix (name length ``0xFFFFFFFF``); then a 32-byte BLAKE3 of everything before it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import uuid
from collections.abc import Callable, Mapping
from typing import BinaryIO

import blake3
import numpy as np

from dcr_core.dtypes import DTYPES, UINT_BY_SIZE
from dcr_core.errors import IntegrityError
from storage.local.safetensors import SafetensorsCheckpoint, read_header

MAGIC = b"DCRPLOG1"
_RECORD = struct.Struct("<IQBB")
_END = 0xFFFFFFFF
READ_BYTES = 4 << 20  # the trailer check reads the log through one buffer of this size
MAX_HEAD_BYTES = 1 << 20  # a header longer than this is damage, not a head to parse
log = logging.getLogger("dcr.publish")


class PatchLogWriter:
    """Appends records to a new log under a temp name; ``finish`` renames it into place whole.

    Best effort, as the cache it serves: a log that cannot be written (a full or read-only cache
    directory) is dropped with a warning and nothing is raised; ``finish`` then returns None and the
    caller copies the checkpoint into the cache whole. So is a log that grows past ``limit_bytes``
    (a step that changed so much that writing its changes costs more than a copy)."""

    def __init__(self, path: str, head: Mapping[str, object], limit_bytes: int | None = None):
        self.path = path
        self.limit_bytes = limit_bytes
        self.nbytes = 0
        self.tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
        self._f: BinaryIO | None = None  # None once dropped
        self._h = blake3.blake3()
        self.elements = 0
        raw = json.dumps(dict(head)).encode()
        try:
            os.makedirs(os.path.dirname(self.tmp) or ".", exist_ok=True)
            self._f = open(self.tmp, "wb", buffering=1 << 20)
            self._put(MAGIC + struct.pack("<Q", len(raw)) + raw)
        except OSError as e:
            self._drop(e)

    @property
    def dropped(self) -> bool:
        return self._f is None

    def _drop(self, error: OSError | None) -> None:
        if error is None:
            log.info("the changes outgrow a copy of the checkpoint; the cache will be copied whole")
        else:
            log.warning("cannot write the patch log %s (%s); the cache will be copied whole", self.path, error)
        self.abort()

    def _put(self, data: bytes | memoryview) -> None:
        f = self._f
        if f is None:  # dropped: nothing more is written
            return
        f.write(data)
        self._h.update(data)
        self.nbytes += len(data) if isinstance(data, bytes) else data.nbytes

    def add(self, name: str, numel: int, positions: np.ndarray, values: np.ndarray) -> None:
        """The changed elements of tensor ``name`` (``numel`` elements): ascending positions in the
        flat tensor and its new raw values (unsigned ints of the element size) there."""
        if not positions.size or self._f is None:
            return
        wide = numel > 0xFFFFFFFF
        pos = np.ascontiguousarray(positions, dtype="<i8" if wide else "<u4")
        vals = np.ascontiguousarray(values).reshape(-1)
        encoded = name.encode()
        try:
            self._put(_RECORD.pack(len(encoded), pos.size, vals.dtype.itemsize, int(wide)) + encoded)
            self._put(pos.data.cast("B"))
            self._put(vals.view(UINT_BY_SIZE[vals.dtype.itemsize]).data.cast("B"))
        except OSError as e:
            self._drop(e)
            return
        self.elements += pos.size
        if self.limit_bytes is not None and self.nbytes > self.limit_bytes:
            self._drop(None)

    def finish(self) -> str | None:
        """Close the log and put it in place (no fsync: a log lost to a power loss costs one copy of
        the whole checkpoint into the cache, nothing else); None when it was dropped."""
        f = self._f
        if f is None:
            return None
        try:
            self._put(_RECORD.pack(_END, 0, 0, 0))
            f.write(self._h.digest())
            f.close()
            os.replace(self.tmp, self.path)
        except OSError as e:
            self._drop(e)
            return None
        self._f = None
        return self.path

    def abort(self) -> None:
        """Close and remove the unfinished log (a no-op once finished or dropped)."""
        f, self._f = self._f, None
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)


def _damaged(path: str, why: str) -> IntegrityError:
    return IntegrityError(f"{path}: not a whole patch log ({why}); nothing was applied")


def _check_trailer(path: str) -> int:
    """The log's size once its trailer has been checked (every byte before it hashed)."""
    size = os.path.getsize(path)
    if size < len(MAGIC) + 8 + 32:
        raise _damaged(path, "too short")
    h = blake3.blake3()
    buf = bytearray(READ_BYTES)
    with open(path, "rb") as f:
        left = size - 32
        while left:
            n = f.readinto(memoryview(buf)[: min(left, len(buf))])
            if not n:
                raise _damaged(path, "truncated")
            h.update(memoryview(buf)[:n])
            left -= n
        if f.read(32) != h.digest():
            raise _damaged(path, "trailer digest")
    return size


def read_head(path: str) -> dict:
    """The log's head (unchecked: ``apply`` checks the whole log before using it)."""
    with open(path, "rb") as f:
        data = f.read(16)
        if len(data) < 16 or data[:8] != MAGIC:
            raise _damaged(path, "no header")
        (n,) = struct.unpack("<Q", data[8:])
        if n > MAX_HEAD_BYTES:
            raise _damaged(path, "header length")
        try:
            head = json.loads(f.read(n))
        except ValueError:
            raise _damaged(path, "header") from None
    if not isinstance(head, dict):
        raise _damaged(path, "header")
    return head


def apply(path: str, target: str, metadata: Mapping[str, str],
          progress: Callable[[int], None] | None = None) -> int:
    """Write the log's values into the safetensors file ``target`` in place, then merge ``metadata``
    into its header (same length: nothing moves). The whole log is checked first; a record that
    does not fit ``target`` raises ``IntegrityError`` before that record is written (``target`` may
    then hold part of the patch: the caller discards it). ``progress(i)`` after the i-th record.
    Returns the number of elements written."""
    size = _check_trailer(path)
    with SafetensorsCheckpoint(target) as ck:
        layout = {n: (ck.data_offset(n), i.nbytes, DTYPES[i.dtype].itemsize) for n, i in ck.infos.items()}
    written = 0
    with open(path, "rb") as log, open(target, "r+b") as f:
        header = read_header(target, f.fileno())
        new_header = header.with_metadata(metadata)
        if new_header is None:
            raise IntegrityError(f"{target}: no room in its header for the new step's metadata")
        log.seek(16 + struct.unpack("<Q", log.read(16)[8:])[0])
        i = 0
        while True:
            prefix = log.read(_RECORD.size)
            if len(prefix) != _RECORD.size:
                raise _damaged(path, "truncated record")
            name_len, count, itemsize, wide = _RECORD.unpack(prefix)
            if name_len == _END:
                break
            name = log.read(name_len).decode(errors="replace")
            if name not in layout or layout[name][2] != itemsize:
                raise IntegrityError(f"{path}: record {i} names {name!r}, which {target} does not hold as logged")
            offset, nbytes, _ = layout[name]
            pos = np.frombuffer(log.read(count * (8 if wide else 4)), "<i8" if wide else "<u4")
            vals = np.frombuffer(log.read(count * itemsize), UINT_BY_SIZE[itemsize])
            if pos.size != count or vals.size != count:
                raise _damaged(path, "truncated record")
            if count and not 0 <= int(pos[0]) <= int(pos[-1]) < nbytes // itemsize:
                raise IntegrityError(f"{path}: record {i} for {name!r} falls outside it in {target}")
            if count:  # mapped for this record only: its pages are not kept mapped after it
                first = int(pos[0])
                view = np.memmap(f, UINT_BY_SIZE[itemsize], "r+", offset + first * itemsize, (int(pos[-1]) - first + 1,))
                idx = (pos - first).view(np.uint64) if wide else pos - first  # out of order: huge, refused
                try:
                    view[idx] = vals
                except IndexError:  # positions out of order
                    raise IntegrityError(f"{path}: record {i} for {name!r} falls outside it in {target}") from None
                del view
            written += count
            if progress is not None:
                progress(i)
            i += 1
        if log.tell() != size - 32:
            raise _damaged(path, "bytes after the end record")
        f.seek(0)
        f.write(new_header)
    return written
