"""The undo journal of a state file patched in place (``dcr receive --in-place``).

Before the first byte of a state file changes, the receiver writes ``.<name>.undo`` beside it
(temp file, fsync, rename, directory fsync): every element it is about to change, as (file
offset of its tensor, element size, positions, old values, new values), plus the old and the new
safetensors header. Then it writes the new values and the new header in place, fsyncs the file
and deletes the journal. The header keeps its length (it is padded), so no tensor moves.

A journal that exists means a patch may have been cut off anywhere. ``roll_back`` puts the old
values and the old header back (idempotent: it only writes absolute values, so a crash during a
roll back is repaired by rolling back again) and then deletes the journal: the file holds its old
step again, byte for byte, and the next receive redoes the refit.

File layout: ``DCRUNDO1``, u64 length of a JSON head, the head, then per record the positions
(uint32, or int64 for tensors past 2^32 elements), the old values and the new values. The head carries a BLAKE3 digest of everything after
it, so a damaged journal is refused instead of applied.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from dataclasses import dataclass

import blake3
import numpy as np

from dcr_core.errors import StateMismatchError
from storage.commit import fsync_dir

MAGIC = b"DCRUNDO1"
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_POS = {"<u4": np.dtype("<u4"), "<i8": np.dtype("<i8")}


def journal_path(state_path: str) -> str:
    directory, name = os.path.split(os.path.abspath(state_path))
    return os.path.join(directory, f".{name}.undo")


@dataclass
class Record:
    """The elements of one tensor that a patch changes."""

    offset: int  # byte offset of the tensor's data in the state file
    itemsize: int
    positions: np.ndarray  # element indices, ascending (uint32, or int64 past 2^32 elements)
    old: np.ndarray  # unsigned ints of ``itemsize`` bytes
    new: np.ndarray


@dataclass
class Journal:
    from_step: int
    to_step: int
    old_header: bytes  # the first 8 + n bytes of the file (length prefix and header)
    new_header: bytes  # same length
    records: list[Record]

    @property
    def nbytes(self) -> int:
        return sum(r.positions.nbytes + r.old.nbytes + r.new.nbytes for r in self.records)


def write(state_path: str, journal: Journal) -> str:
    """Make the journal durable beside ``state_path`` (atomic: it exists whole or not at all)."""
    if len(journal.old_header) != len(journal.new_header):
        raise ValueError("old and new headers differ in length")  # pragma: no cover - caller invariant
    path = journal_path(state_path)
    h = blake3.blake3()
    for r in journal.records:
        for a in (r.positions, r.old, r.new):
            h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    head = json.dumps({
        "state": os.path.basename(state_path),
        "from_step": journal.from_step,
        "to_step": journal.to_step,
        "old_header": journal.old_header.hex(),
        "new_header": journal.new_header.hex(),
        "records": [[r.offset, r.itemsize, int(r.positions.size), r.positions.dtype.str] for r in journal.records],
        "digest": h.hexdigest(),
    }).encode()
    directory, name = os.path.split(os.path.abspath(state_path))
    tmp = os.path.join(directory, f".{name}.tmp-undo-{uuid.uuid4().hex}")  # a killed write's leftover
    # matches the temp files the state's lock removes (storage.checkpoint.exclusive)
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(head)) + head)
            for r in journal.records:
                for a in (r.positions, r.old, r.new):
                    f.write(memoryview(np.ascontiguousarray(a)).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path))
    return path


def read(state_path: str) -> Journal | None:
    """The journal of ``state_path``, or None if there is none; refuses a damaged one."""
    path = journal_path(state_path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    bad = StateMismatchError(
        f"{path}: damaged undo journal; {state_path} may be half patched: remove both and receive again"
    )
    if data[:8] != MAGIC or len(data) < 16:
        raise bad
    (n,) = struct.unpack("<Q", data[8:16])
    try:
        head = json.loads(data[16:16 + n])
        records_meta = [(int(o), int(s), int(c), _POS[p]) for o, s, c, p in head["records"]]
        old_header, new_header = bytes.fromhex(head["old_header"]), bytes.fromhex(head["new_header"])
        from_step, to_step = int(head["from_step"]), int(head["to_step"])
    except (ValueError, KeyError, TypeError):
        raise bad from None
    except Exception:  # noqa: BLE001 - any malformed head is the same damage
        raise bad from None
    body = memoryview(data)[16 + n:]
    if blake3.blake3(body).hexdigest() != head.get("digest") or any(s not in _UINT for _, s, _, _ in records_meta):
        raise bad
    records, at = [], 0
    for offset, size, count, pos_dtype in records_meta:
        p = pos_dtype.itemsize
        need = count * (p + 2 * size)
        if at + need > len(body):
            raise bad
        pos = np.frombuffer(body, pos_dtype, count, at)
        old = np.frombuffer(body, _UINT[size], count, at + p * count)
        new = np.frombuffer(body, _UINT[size], count, at + (p + size) * count)
        records.append(Record(offset, size, pos, old, new))
        at += need
    return Journal(from_step, to_step, old_header, new_header, records)


def put(state_path: str, journal: Journal, which: str, after_record=None) -> None:
    """Write the ``which`` ("old" or "new") values and header into the state file and fsync it.

    ``after_record(i)`` is called after record ``i`` is written (fault injection in tests)."""
    with open(state_path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        for i, r in enumerate(journal.records):
            if r.positions.size:
                count = int(r.positions[-1]) + 1
                if r.offset + count * r.itemsize > size:
                    raise StateMismatchError(f"{state_path}: shorter than its undo journal says; receive with --fresh")
                view = np.memmap(f, dtype=_UINT[r.itemsize], mode="r+", offset=r.offset, shape=(count,))
                view[r.positions] = r.old if which == "old" else r.new  # fsync below writes it back
                del view
            if after_record is not None:
                after_record(i)
        f.seek(0)
        f.write(journal.old_header if which == "old" else journal.new_header)
        f.flush()
        os.fsync(f.fileno())


def remove(state_path: str) -> None:
    path = journal_path(state_path)
    if os.path.exists(path):
        os.unlink(path)
        fsync_dir(os.path.dirname(path))


def roll_back(state_path: str) -> int | None:
    """Undo a cut-off patch of ``state_path``; returns the step it holds again (None: no journal)."""
    journal = read(state_path)
    if journal is None:
        return None
    if os.path.exists(state_path):
        put(state_path, journal, "old")
    remove(state_path)
    return journal.from_step
