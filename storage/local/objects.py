"""A ROOT on local disk: its objects are regular files under the ROOT directory, and nothing else.

Object stores have no links; a directory does. So on a local ROOT every operation checks that no
path component below ROOT is a symbolic link (a ``steps/N/attempts`` link must not let ``dcr gc``
empty a folder elsewhere, nor a ``receivers`` link let a receiver write outside ROOT), reads open
the object with ``O_NOFOLLOW`` and refuse anything but a regular file (a FIFO ``commit.json`` would
block every reader; a chunk linked to ``/dev/zero`` would never end), and a read is bounded: an
object larger than the caller's limit is refused from its size, before a byte is read. Listings
skip links and special files (they are not objects). ROOT itself may be a link: it is the user's
choice of directory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import time
import uuid

from dcr_core.errors import IntegrityError, UnsafeKeyError
from storage.backends import fsync_dir


def check_no_links(base: str, path: str) -> None:
    """Every existing component of ``path`` below ``base`` is a real directory or file, not a link."""
    rel = os.path.relpath(path, base)
    if rel == "." or rel.startswith(".."):
        raise UnsafeKeyError(f"{path}: not under ROOT {base}")
    cur = base
    for part in rel.split(os.sep):
        cur = os.path.join(cur, part)
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeKeyError(f"{cur}: a symbolic link inside ROOT; DCR does not follow links (remove it)")


def read(base: str, path: str, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``: a larger file is refused unread)."""
    check_no_links(base, path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeKeyError(f"{path}: a symbolic link inside ROOT; DCR does not follow links (remove it)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeKeyError(f"{path}: not a regular file (a FIFO, device or directory); DCR reads only files")
        if limit is not None and st.st_size > limit:
            raise IntegrityError(f"{path}: {st.st_size} bytes, more than the {limit} bytes this object may hold")
        chunks, size = [], 0
        while True:
            more = os.read(fd, max(1, min(st.st_size - size, 64 << 20)) if size < st.st_size else 1 << 16)
            if not more:
                break
            size += len(more)
            if limit is not None and size > limit:  # grew while being read
                raise IntegrityError(f"{path}: more than the {limit} bytes this object may hold")
            chunks.append(more)
        return b"".join(chunks)
    finally:
        os.close(fd)


def exists(base: str, path: str) -> bool:
    check_no_links(base, path)
    return os.path.lexists(path)


def write_atomically(base: str, path: str, data: bytes) -> None:
    """Write a temp file beside ``path`` and rename it over ``path``: a concurrent reader sees the
    old object or the new one, never a prefix (the PUT semantics of object stores)."""
    check_no_links(base, path)
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    check_no_links(base, path)  # what makedirs created is a directory; a link raced in is refused
    tmp = os.path.join(directory, f".{name}.put-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def create_if_absent(base: str, path: str, data: bytes) -> bool:
    """Exclusive ``link()`` of a complete, fsynced temp file: exactly one creator wins; a reader
    never sees a partial object."""
    check_no_links(base, path)
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    check_no_links(base, path)
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


def _kind(entry: os.DirEntry) -> str | None:
    if entry.is_symlink():
        return None
    if entry.is_dir(follow_symlinks=False):
        return "dir"
    if entry.is_file(follow_symlinks=False):
        return "file"
    return None  # FIFOs, sockets, devices: not objects


def listdir(base: str, path: str) -> list[str]:
    """Names of everything in ``path``, links and special files included, so that callers see (and
    report) them; reading, writing or deleting through one is refused (``check_no_links``, ``read``)."""
    check_no_links(base, path)
    try:
        with os.scandir(path) as it:
            return sorted(e.name for e in it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def find(base: str, path: str) -> list[tuple[str, int, float]]:
    """``(path, size, mtime)`` of every regular file under ``path``, never through a link."""
    check_no_links(base, path)
    out = []
    todo = [path]
    while todo:
        d = todo.pop()
        try:
            with os.scandir(d) as it:
                for e in it:
                    kind = _kind(e)
                    if kind == "dir":
                        todo.append(e.path)
                    elif kind == "file":
                        st = e.stat(follow_symlinks=False)
                        out.append((e.path, st.st_size, st.st_mtime))
        except (FileNotFoundError, NotADirectoryError):
            if d == path and os.path.isfile(path) and not os.path.islink(path):
                st = os.lstat(path)
                out.append((path, st.st_size, st.st_mtime))
    return out


def remove(base: str, path: str, recursive: bool = False, attempts: int = 5) -> None:
    """Delete ``path`` (a directory only with ``recursive``), never through a link. A directory that
    a concurrent writer adds to while it is being deleted (a receiver recording its commit) is
    deleted again, a few times."""
    check_no_links(base, path)
    st = os.lstat(path)  # FileNotFoundError: nothing to delete
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    if not recursive:
        raise IsADirectoryError(path)
    for n in range(attempts):
        try:
            shutil.rmtree(path)  # removes links inside, never follows them
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or n == attempts - 1:
                raise
            time.sleep(0.05 * (n + 1))
