"""Create-if-absent: the one write that makes a step (or anything else) real.

Atomicity per backend (the publisher relies on it to let exactly one racing publisher win):
- local files: write a private temp file, then ``os.link`` it to the final name. ``link`` fails if
  the name exists and the linked file is complete, so readers never see a partial marker. Atomic.
- ``memory://``: check and write under a process-wide lock. Atomic within the process, which is
  the whole extent of that filesystem.
- S3 (s3fs): ``PutObject`` with ``If-None-Match: *``; the server refuses (412) if the key exists.
  Atomic on AWS S3 and on servers that honour the header (moto 5 does).
- GCS (gcsfs): upload with ``ifGenerationMatch=0`` (``mode="create"``). Atomic on real GCS; the
  GCS emulator ignores the precondition, so there it degrades to check-then-write: two publishers
  racing within the same few milliseconds could both "win" (documented in the README).
- anything else: refused, rather than silently racy.
"""

from __future__ import annotations

import os
import threading
import uuid

_MEMORY_LOCK = threading.Lock()


class UnsupportedBackendError(RuntimeError):
    pass


_SUPPORTED = ("file", "local", "memory", "s3", "s3a", "gs", "gcs")


def supports(protocol: str | tuple) -> bool:
    """Whether ``create_if_absent`` has a create-if-absent for this protocol."""
    proto = protocol[0] if isinstance(protocol, (tuple, list)) else protocol
    return proto in _SUPPORTED


def create_if_absent(fs, protocol: str | tuple, path: str, data: bytes) -> bool:
    proto = protocol[0] if isinstance(protocol, (tuple, list)) else protocol
    if proto in ("file", "local"):
        return _local(path, data)
    if proto == "memory":
        with _MEMORY_LOCK:
            if fs.exists(path):
                return False
            fs.pipe_file(path, data)
            return True
    if proto in ("s3", "s3a"):
        try:
            fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        return True
    if proto in ("gs", "gcs"):
        return _gcs(fs, path, data)
    raise UnsupportedBackendError(
        f"no atomic create-if-absent for protocol {proto!r}; use a local path, memory://, s3:// or gs://"
    )


def _local(path: str, data: bytes) -> bool:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    fsync_dir(directory)
    return True


def fsync_dir(directory: str) -> None:
    """Make a rename or link durable (best effort: not every file system fsyncs directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _gcs(fs, path: str, data: bytes) -> bool:
    # gcsfs sends ifGenerationMatch=0 for mode="create" and raises FileExistsError on 412. The
    # existence check first narrows the window on servers that ignore the precondition (the GCS
    # emulator); on real GCS the conditional upload alone is atomic.
    if fs.exists(path):
        return False
    try:
        from storage.root import gcs_upload_kwargs

        fs.pipe_file(path, data, mode="create", **gcs_upload_kwargs("gs", data))
    except FileExistsError:
        return False
    return True
