"""What ``dcr materialize`` writes byte for byte, and the record that says DCR wrote it.

A step published from a safetensors file or a sharded directory materializes as exactly the bytes
that were published (``storage.source_layout``): the file at ``--out``, or the directory's files
(same names, same index) inside ``--out``. Each file is written as a temp file with the published
header and its full size, the tensors put at the offsets the header names, and fsynced. A file's
temp file lies beside it and is renamed over it once complete (``install``). A directory is replaced
as a whole (``storage.local.dir_swap``): its files are built in a new directory beside it, with
everything else the old one held carried over, and the two are swapped once every file is
complete, so a reader (a server started from it) sees one step or the other, never shards of both,
and a materialize killed at any point is finished or undone by the next one (``settle``).

Such a file holds nothing that says DCR wrote it, so the output's record ``.<name>.dcr`` lies beside
it (beside the file, or beside the directory): the step, its policy digest, the ROOT and, for every
file written, its stamp as DCR left it (device, inode, size, modification time). A later materialize
replaces what the record vouches for, and refuses a file that anything else wrote or rewrote since
(a trainer's checkpoint named by mistake) unless forced (``foreign``).
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterable

from storage.local import dir_swap, state
from storage.local.output_record import parse_record, read_record, record_bytes, record_path, write_record
from storage.local.output_record import vouched as _vouched
from storage.local.safetensors import INDEX_NAME, PlacedWriter, install, temp_path

SUFFIX = ".safetensors"


def checkpoint_files(directory: str) -> list[str]:
    """The names in ``directory`` that belong to a safetensors checkpoint (shards and index)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(n for n in names if not n.startswith(".") and (n.endswith(SUFFIX) or n == INDEX_NAME)
                  and os.path.isfile(os.path.join(directory, n)))


def foreign(out: str, directory: bool) -> list[str]:
    """What materializing to ``out`` would replace that DCR did not write: ``out`` itself (a file that
    is neither a DCR state nor a materialization its record vouches for), or the checkpoint files in
    the directory ``out`` that its record does not vouch for."""
    out = os.path.realpath(out)
    record = current_record(out)
    if not directory:
        if not os.path.exists(out) or state.written_by_dcr(out):
            return []
        vouched = record is not None and _vouched(out, record, os.path.basename(out)) and record.get("kind") == "file"
        return [] if vouched else [out]
    if record is not None and record.get("kind") != "directory":
        record = None
    return [os.path.join(out, n) for n in checkpoint_files(out) if not _vouched(out, record, n)]


def current_record(out: str) -> dict | None:
    """The record of ``out`` as it is now: where a kill cut off the end of a directory's swap (the
    new directory in place, its record not yet written), the record its journal holds."""
    journaled = dir_swap.journaled_record(os.path.realpath(out))
    return parse_record(journaled) if journaled is not None else read_record(out)


def settle(out: str) -> None:
    """Finish the swap of the directory ``out`` that a kill cut off, or undo a partial one (the
    caller holds the output's lock)."""
    out = os.path.realpath(out)
    dir_swap.settle(out, record_path(out))


def remove_record(out: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(record_path(out))


def sweep(directory: str) -> None:
    """Remove the temp files a materialize killed while it renamed them into ``directory`` left
    among its checkpoint files (earlier versions did; the caller holds the output's lock)."""
    for pattern in (f".*{SUFFIX}.tmp-*", f".{INDEX_NAME}.tmp-*"):
        for leftover in glob.glob(os.path.join(glob.escape(directory), pattern)):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(leftover)


def write_index(directory: str, data: bytes) -> str:
    """The index file's bytes in a fsynced temp file beside its place in ``directory``; its path."""
    tmp = temp_path(os.path.join(directory, INDEX_NAME))
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp


def discard(moves: Iterable[tuple[str, str]], writers: Iterable[PlacedWriter] = ()) -> None:
    """Remove staged temp files (a failed materialize: nothing is installed)."""
    for w in writers:
        w.abort()
    for tmp, _ in moves:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def install_all(out: str, kind: str, moves: tuple[tuple[str, str], ...], about: dict) -> None:
    """Install the staged files and record the output: a file renamed over ``out``; or the new
    directory (each temp file renamed into it, the index last) swapped with ``out``, after the
    files an earlier materialization of ``out`` wrote that this one does not (a step with other
    shard names) are left behind, and everything else in ``out`` carried over."""
    out = os.path.realpath(out)
    if kind == "file":
        ((tmp, _),) = moves
        install(tmp, out)
        write_record(out, about)
        return
    staged = dir_swap.staging(out)
    try:
        for tmp, dest in moves:
            os.replace(tmp, dest)
        names = [os.path.basename(dest) for _, dest in moves]
        earlier = read_record(out)
        ours = set()
        if earlier is not None and earlier.get("kind") == "directory":
            ours = {n for n in earlier["files"] if _vouched(out, earlier, n)}
        if os.path.isdir(out):
            sweep(out)
        dir_swap.carry(out, staged, set(names) | ours)
        record = record_bytes(kind, {n: os.path.join(staged, n) for n in names}, about)
    except BaseException:
        dir_swap.discard(out)
        raise
    dir_swap.commit(out, staged, record_path(out), record)
