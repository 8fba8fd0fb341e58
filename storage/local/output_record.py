"""The record beside a file that ``dcr materialize`` wrote byte for byte: ``.<name>.dcr``.

A materialized file is exactly the published one, so nothing in it says which step it holds or that
DCR wrote it. Its record does: the step, its policy digest, the ROOT and, for every file written,
its stamp as DCR left it (device, inode, size, modification time). A stamp that still matches
*vouches* for the file: a rename keeps it; a rewrite in place or a new file under the name does not.
``storage.local.materialized`` writes records; ``storage.local.state`` reads one where a file's
header names no step (a receive that starts from a materialized file).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping

from storage.local.safetensors import temp_path

FORMAT = "dcr-materialized"
MAX_RECORD_BYTES = 64 << 20


def record_path(out: str) -> str:
    directory, name = os.path.split(os.path.realpath(out))
    return os.path.join(directory, f".{name}.dcr")


def stamp(path: str) -> list[int]:
    """What identifies a file as DCR left it (a rename keeps it; a rewrite in place or a new file does not)."""
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def read_record(out: str) -> dict | None:
    """The record beside ``out``, or None (absent, damaged, or not one)."""
    try:
        with open(record_path(out), "rb") as f:
            return parse_record(f.read(MAX_RECORD_BYTES + 1))
    except OSError:
        return None


def parse_record(data: bytes) -> dict | None:
    """A record's bytes as a record, or None (damaged, or not one)."""
    try:
        d = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(d, dict) or d.get("format") != FORMAT or not isinstance(d.get("files"), dict):
        return None
    return d


def vouched(out: str, record: dict | None, name: str) -> bool:
    """``record`` vouches for file ``name`` (``out`` itself for a file) as it is now."""
    if record is None:
        return False
    path = out if record.get("kind") == "file" else os.path.join(out, name)
    try:
        return record["files"].get(name) == stamp(path)
    except OSError:
        return False


def vouched_file(path: str) -> dict | None:
    """The record of the single file ``path`` if it vouches for the file as it is now (and names a
    step), else None."""
    path = os.path.realpath(path)
    record = read_record(path)
    if record is None or record.get("kind") != "file" or not vouched(path, record, os.path.basename(path)):
        return None
    step = record.get("step")
    return record if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def record_bytes(kind: str, files: Mapping[str, str], about: dict) -> bytes:
    """The record of an output of ``kind`` ("file" or "directory") whose ``files`` (name: the path
    where it is now; a rename keeps its stamp) DCR wrote, with ``about`` (step, policy digest, ROOT)."""
    doc = {"format": FORMAT, "kind": kind, **about, "files": {n: stamp(p) for n, p in sorted(files.items())}}
    return (json.dumps(doc, indent=1) + "\n").encode()


def write_record(out: str, about: dict) -> None:
    """Record that DCR wrote the file ``out``, with ``about`` (step, policy digest, ROOT). (A
    directory's record is written as its swap ends: ``storage.local.dir_swap``.)"""
    out = os.path.realpath(out)
    data = record_bytes("file", {os.path.basename(out): out}, about)
    tmp = temp_path(out)  # a leftover of a killed writer is swept as the output's (storage.local.state.exclusive)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, record_path(out))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
