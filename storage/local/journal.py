"""The journal of a state file patched in place (``dcr receive --in-place``).

Before the first byte of a state file changes, the receiver writes ``.<name>.undo`` beside it
(temp file, fsync, rename, directory fsync): every element it is about to change, as (file
offset of its tensor, element size, positions, old values, new values), plus the old and the new
safetensors header. Then it writes the new values and the new header in place (into the page
cache: no fsync of the file) and renames the journal to ``.<name>.redo`` (directory fsync): the
refit is committed. The header keeps its length (it is padded), so no tensor moves.

- ``.undo``: a patch may have been cut off anywhere. ``roll_back`` puts the old values and the
  old header back (idempotent: it only writes absolute values, so a crash during a roll back is
  repaired by rolling back again), fsyncs the file and deletes the journal: the file holds its
  old step again, byte for byte, and the next receive redoes the refit.
- ``.redo``: the patch was written whole, but the file's pages may not be on disk yet (a power
  loss can still tear them). ``roll_forward`` writes the new values where the file differs (so no
  page is dirtied twice), fsyncs the file and deletes the journal; a journal committed in this boot
  (its head names it) over a file whose header is the new one needs the fsync alone: the page cache
  holds the whole patch, and its records are not read. The disk writes the patched pages in the background meanwhile (the
  kernel's writeback), so a receive does not wait for them; the next writer of the file, or a
  reader inside ``consistent_state``, does (``settle``), usually finding them written.

A journal is written while its records are computed (``Stager``: records on a thread of their own,
the head last into room reserved for it, padded with spaces), and the process that staged it applies
it from memory (``take_staged``); a recovery reads the file.

File layout: ``DCRUNDO1``, u64 length of a JSON head, the head, then per record the positions
(uint32, or int64 for tensors past 2^32 elements), the old values and the new values, then a
32-byte BLAKE3 of everything before it: a damaged journal (head or records) is refused instead of
applied. A roll back also checks that the file's header is one of the journal's two headers, so a
journal left beside another file of the same name is refused too.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import blake3
import numpy as np

from dcr_core import events
from dcr_core.dtypes import UINT_BY_SIZE
from dcr_core.errors import StateMismatchError
from storage.local.objects import fsync_dir

MAGIC = b"DCRUNDO1"
_POS: dict[str, np.dtype] = {"<u4": np.dtype("<u4"), "<i8": np.dtype("<i8")}


def journal_path(state_path: str, kind: str = "undo") -> str:
    """The journal of a patch in progress (``undo``) or committed and not yet on disk (``redo``)."""
    directory, name = os.path.split(os.path.realpath(state_path))  # one journal per file, whatever the path
    return os.path.join(directory, f".{name}.{kind}")


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
    return activate(state_path, stage(state_path, journal))


def stage(state_path: str, journal: Journal) -> str:
    """Write the journal durably under a temp name beside ``state_path`` (not yet in force: the
    state's lock removes it if this process dies); ``activate`` puts it in force."""
    stager = Stager(state_path, journal.from_step, journal.to_step, journal.old_header, journal.new_header,
                    len(journal.records))
    try:
        for r in journal.records:
            stager.add(r)
    except BaseException:
        stager.abort()
        raise
    return stager.finish()


_RECORD_ROOM = 64  # room in the head per record: `[offset, itemsize, count, "<u4"], ` takes at most 56 characters


class Stager:
    """Stages a journal while its records are still being computed: each record goes to the temp
    file on a thread of its own as it is added, so writing it overlaps computing the next. The head
    (which lists the records) is written last, into room reserved for ``max_records`` records and
    padded with spaces (it is JSON); then the trailer (hashed from the records in memory) and one
    fsync. ``finish`` returns the staged path (``activate`` puts it in force); ``abort`` removes it.
    The file is the layout of the module doc, whatever order its parts were written in."""

    def __init__(self, state_path: str, from_step: int, to_step: int, old_header: bytes, new_header: bytes,
                 max_records: int):
        if len(old_header) != len(new_header):
            raise ValueError("old and new headers differ in length")  # pragma: no cover - caller invariant
        self.state_path, self.max_records = state_path, max_records
        self.journal = Journal(from_step, to_step, old_header, new_header, [])
        self._room = len(self._head()) + _RECORD_ROOM * max_records
        directory = os.path.dirname(journal_path(state_path))
        state_name = os.path.basename(os.path.realpath(state_path))
        # A killed write's leftover matches the temp files the state's lock removes (checkpoint.exclusive).
        self.path = os.path.join(directory, f".{state_name}.tmp-undo-{uuid.uuid4().hex}")
        self._f = open(self.path, "wb")  # closed by finish or abort
        self._f.seek(16 + self._room)
        self._writer = ThreadPoolExecutor(1, "dcr-journal")
        self._writes: list = []

    def _head(self) -> bytes:
        j = self.journal
        return json.dumps({
            "state": os.path.basename(self.state_path),
            "boot_id": boot_id(),
            "from_step": j.from_step,
            "to_step": j.to_step,
            "old_header": j.old_header.hex(),
            "new_header": j.new_header.hex(),
            "records": [[r.offset, r.itemsize, int(r.positions.size), r.positions.dtype.str] for r in j.records],
        }).encode()

    def _write(self, r: Record) -> None:
        for a in (r.positions, r.old, r.new):
            self._f.write(a.data.cast("B"))

    def add(self, r: Record) -> None:
        """Append one record (its arrays are kept, and must not change, until the journal is applied)."""
        if r.positions.dtype.str not in _POS or r.itemsize not in UINT_BY_SIZE:
            raise ValueError("journal records need uint32/int64 positions and 1/2/4/8-byte values")
        if len(self.journal.records) == self.max_records:
            raise ValueError(f"more than the {self.max_records} records room was made for")
        r = Record(r.offset, r.itemsize, *(np.ascontiguousarray(a) for a in (r.positions, r.old, r.new)))
        self.journal.records.append(r)
        self._writes.append(self._writer.submit(self._write, r))

    def finish(self) -> str:
        try:
            for w in self._writes:
                w.result()
            head = self._head()
            head += b" " * (self._room - len(head))
            prefix = MAGIC + struct.pack("<Q", len(head)) + head
            h = blake3.blake3(prefix)
            for r in self.journal.records:
                for a in (r.positions, r.old, r.new):
                    h.update(a.data.cast("B"))
            self._f.write(h.digest())  # trailer: BLAKE3 of everything before it, head included
            self._f.seek(0)
            self._f.write(prefix)
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        except BaseException:
            self.abort()
            raise
        finally:
            self._writer.shutdown()
        _STAGED.clear()  # the latest staged journal only: an abandoned one is not kept alive
        _STAGED[self.path] = self.journal
        return self.path

    def abort(self) -> None:
        self._writer.shutdown(cancel_futures=True)
        self._f.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


# The journal this process staged last, by its temp path: the patch applies what it just made
# durable instead of reading it back (``take_staged``); a recovery reads the file.
_STAGED: dict[str, Journal] = {}


def take_staged(staged: str) -> Journal | None:
    """The journal staged at ``staged`` if this process staged it (once), else None: ``read`` it."""
    return _STAGED.pop(staged, None)


def boot_id() -> str | None:
    """This boot of the machine (Linux), or None: a redo journal committed in the same boot needs no
    roll forward, only an fsync (the page cache still holds the patch; ``roll_forward``)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def activate(state_path: str, staged: str) -> str:
    """Put a staged journal in force (atomic rename, directory fsync): from here on, the next
    receive of ``state_path`` rolls the file back unless the patch completes and removes it."""
    path = journal_path(state_path)
    os.replace(staged, path)
    fsync_dir(os.path.dirname(path))
    events.reached("receive.journal-written", path=path)
    return path


def _damaged(path: str, state_path: str) -> StateMismatchError:
    return StateMismatchError(
        f"{path}: damaged journal; {state_path} may be half patched: remove both and receive again"
    )


def _head(data: bytes | memoryview, path: str, state_path: str) -> tuple[dict, int]:
    if bytes(data[:8]) != MAGIC or len(data) < 16:
        raise _damaged(path, state_path)
    (n,) = struct.unpack("<Q", data[8:16])
    try:
        head = json.loads(bytes(data[16:16 + n]))
        if not isinstance(head, dict):
            raise ValueError
    except (ValueError, RecursionError):
        raise _damaged(path, state_path) from None
    return head, 16 + n


def _read_head(path: str, state_path: str) -> dict | None:
    """The head of the journal at ``path`` (not verified: the trailer covers the whole file), or None."""
    try:
        with open(path, "rb") as f:
            data = f.read(16)
            if len(data) == 16 and data[:8] == MAGIC:
                data += f.read(min(struct.unpack("<Q", data[8:16])[0], 64 << 20))
    except FileNotFoundError:
        return None
    return _head(data, path, state_path)[0]


def pending_step(state_path: str) -> int | None:
    """The step ``settle`` leaves ``state_path`` at (heads only, unverified): a committed patch's new
    step (``.redo``), a cut-off one's old step (``.undo``); None when no journal is pending."""
    for kind, key in (("redo", "to_step"), ("undo", "from_step")):
        path = journal_path(state_path, kind)
        head = _read_head(path, state_path)
        if head is None:
            continue
        step = head.get(key)
        if not isinstance(step, int) or step < 0:
            raise _damaged(path, state_path)
        return step
    return None


def read(state_path: str, path: str | None = None) -> Journal | None:
    """The undo journal of ``state_path`` (or the journal at ``path``), or None if there is none;
    refuses a damaged one (its trailer digest covers the head and every record)."""
    path = path or journal_path(state_path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    bad = _damaged(path, state_path)
    if len(data) < 16 + 32 or blake3.blake3(memoryview(data)[:-32]).digest() != data[-32:]:
        raise bad
    head, start = _head(memoryview(data)[:-32], path, state_path)  # a view: the records are not copied
    try:
        records_meta = [(int(o), int(s), int(c), _POS[p]) for o, s, c, p in head["records"]]
        old_header, new_header = bytes.fromhex(head["old_header"]), bytes.fromhex(head["new_header"])
        from_step, to_step = int(head["from_step"]), int(head["to_step"])
    except (ValueError, KeyError, TypeError):
        raise bad from None
    if len(old_header) != len(new_header) or len(old_header) < 8:
        raise bad
    body = memoryview(data)[start:-32]
    records, at = [], 0
    for offset, size, count, pos_dtype in records_meta:
        if size not in UINT_BY_SIZE or offset < 0 or count < 0:
            raise bad
        p = pos_dtype.itemsize
        need = count * (p + 2 * size)
        if at + need > len(body):
            raise bad
        pos = np.frombuffer(body, pos_dtype, count, at)
        old = np.frombuffer(body, UINT_BY_SIZE[size], count, at + p * count)
        new = np.frombuffer(body, UINT_BY_SIZE[size], count, at + (p + size) * count)
        records.append(Record(offset, size, pos, old, new))
        at += need
    if at != len(body):
        raise bad
    return Journal(from_step, to_step, old_header, new_header, records)


def put(state_path: str, journal: Journal, which: str, durable: bool = True, differing: bool = False) -> None:
    """Write the ``which`` ("old" or "new") values and header into the state file, then fsync it
    unless ``durable`` is false (the point ``receive.patch-record``, or ``receive.rollback-record``,
    is reached after each record). With ``differing``, only elements that differ are written (a
    roll forward over a patch that is mostly in place dirties no page twice)."""
    with open(state_path, "r+b") as f, ThreadPoolExecutor(_SCATTER_THREADS, "dcr-put") as pool:
        size = os.fstat(f.fileno()).st_size
        for i, r in enumerate(journal.records):
            if r.positions.size:
                count = int(r.positions[-1]) + 1
                if r.offset + count * r.itemsize > size:
                    raise StateMismatchError(f"{state_path}: shorter than its journal says; remove both and receive again")
                view = np.memmap(f, dtype=UINT_BY_SIZE[r.itemsize], mode="r+", offset=r.offset, shape=(count,))
                values = r.old if which == "old" else r.new

                # Each page written is a fault of the map: a large record is split across threads
                # (numpy's indexed assignment releases the GIL), 1.7x faster on two cores.
                n, parts = r.positions.size, _SCATTER_THREADS if r.positions.size >= _SCATTER_SPLIT else 1
                cuts = [n * j // parts for j in range(parts + 1)]
                for fut in [pool.submit(_put_part, view, r.positions[a:b], values[a:b], differing)
                            for a, b in zip(cuts, cuts[1:])]:
                    fut.result()
                del view
            events.reached("receive.patch-record" if which == "new" else "receive.rollback-record",
                           index=i, of=len(journal.records))
        header = journal.old_header if which == "old" else journal.new_header
        f.seek(0)
        if not differing or f.read(len(header)) != header:
            f.seek(0)
            f.write(header)
        f.flush()
        if durable:
            os.fsync(f.fileno())


def _put_part(view: np.ndarray, positions: np.ndarray, values: np.ndarray, differing: bool) -> None:
    if differing:
        off = np.flatnonzero(view[positions] != values)
        view[positions[off]] = values[off]
    else:
        view[positions] = values  # the page cache has it; fsync below or later writes it back


_SCATTER_THREADS = max(1, min(4, os.cpu_count() or 1))
_SCATTER_SPLIT = 1 << 18  # changes in a record from which it is written by every thread


def commit(state_path: str) -> str:
    """The patch is written whole (not yet fsynced): rename the undo journal to the redo journal
    (directory fsync). From here on the file settles forward, to the new step."""
    undo, redo = journal_path(state_path), journal_path(state_path, "redo")
    os.replace(undo, redo)
    fsync_dir(os.path.dirname(redo))
    return redo


def roll_forward(state_path: str) -> int | None:
    """Finish a committed patch of ``state_path``: its new values where the file differs, fsync,
    delete the redo journal; returns the step it holds (None: no redo journal).

    A journal committed in this boot (its head names this boot, the file's header is the patch's
    new one, no fsync of it failed before) is finished by an fsync alone: the whole patch was in
    the page cache before the commit, and without a reboot the kernel loses no page of it (it
    writes it back, or reports the failure to the fsync). Its records are not read."""
    path = journal_path(state_path, "redo")
    failed = path + FAILED_SUFFIX
    if os.path.exists(state_path) and not os.path.exists(failed):
        quick = _committed_this_boot(state_path, path)
        if quick is not None:
            try:
                _fsync(state_path)
            except OSError:
                with contextlib.suppress(OSError):
                    _touch_durably(failed)
                raise
            os.unlink(path)
            fsync_dir(os.path.dirname(path))
            events.reached("receive.settled", path=state_path, records_read=False)
            return quick
    journal = read(state_path, path)
    if journal is None:
        return None
    if os.path.exists(state_path):
        _check_header(state_path, journal, path)
        # After a failed fsync the page cache may hold values the disk never got, and Linux reports
        # a write-back error once: every value is written again until an fsync succeeds.
        try:
            put(state_path, journal, "new", differing=not os.path.exists(failed))
        except OSError:
            with contextlib.suppress(OSError):
                _touch_durably(failed)
            raise
        if os.path.exists(failed):
            os.unlink(failed)
    os.unlink(path)
    fsync_dir(os.path.dirname(path))
    events.reached("receive.settled", path=state_path, records_read=True)
    return journal.to_step


def _committed_this_boot(state_path: str, path: str) -> int | None:
    """The step of the redo journal at ``path`` if it was committed in this boot and the file's
    header is its new header; else None (or no such journal)."""
    head = _read_head(path, state_path)
    if head is None:
        return None
    this_boot, step = boot_id(), head.get("to_step")
    if this_boot is None or head.get("boot_id") != this_boot or not isinstance(step, int):
        return None
    try:
        new_header = bytes.fromhex(head["new_header"])
    except (KeyError, TypeError, ValueError):
        return None
    with open(state_path, "rb") as f:
        return step if f.read(len(new_header)) == new_header else None


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


FAILED_SUFFIX = ".fsync-failed"  # beside a redo journal: a roll forward's write or fsync failed once


def _touch_durably(path: str) -> None:
    with open(path, "wb") as f:
        os.fsync(f.fileno())
    fsync_dir(os.path.dirname(path))


def settle(state_path: str) -> int | None:
    """Leave ``state_path`` holding one whole step on disk: a committed patch rolled forward, a
    cut-off one rolled back. Returns the step it settled at, or None when no journal was pending."""
    forward = roll_forward(state_path)
    back = roll_back(state_path)  # none after a redo journal, unless a foreign tool left both
    return back if back is not None else forward


def _check_header(state_path: str, journal: Journal, path: str) -> None:
    """The file's header is one side of the journal's patch, or a mix of the two byte by byte (a
    power loss can write back some of its pages and not others); else the journal belongs to
    another file."""
    with open(state_path, "rb") as f:
        head = f.read(len(journal.old_header))
    if head in (journal.old_header, journal.new_header):
        return
    if len(head) == len(journal.old_header):
        h, a, b = (np.frombuffer(x, np.uint8) for x in (head, journal.old_header, journal.new_header))
        if bool(np.all((h == a) | (h == b))):
            return
    raise StateMismatchError(
        f"{path}: journal of another file (the header of {state_path} is neither side of its patch); "
        "remove the journal if the file is intact"
    )


def remove(state_path: str) -> None:
    """Delete both journals of ``state_path`` (a fresh rewrite replaces the whole file)."""
    for kind in ("undo", "redo", "redo" + FAILED_SUFFIX):
        path = journal_path(state_path, kind)
        if os.path.exists(path):
            os.unlink(path)
            fsync_dir(os.path.dirname(path))


def roll_back(state_path: str) -> int | None:
    """Undo a cut-off patch of ``state_path``; returns the step it holds again (None: no journal)."""
    journal = read(state_path)
    if journal is None:
        return None
    if os.path.exists(state_path):
        _check_header(state_path, journal, journal_path(state_path))
        put(state_path, journal, "old")
    path = journal_path(state_path)  # only the undo journal: a redo journal is settled forward
    os.unlink(path)
    fsync_dir(os.path.dirname(path))
    return journal.from_step
