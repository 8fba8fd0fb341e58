"""A ROOT on local disk: its objects are regular files under the ROOT directory, and nothing else.

Object stores have no links; a directory does. So on a local ROOT no path component below ROOT is
ever followed if it is a symbolic link (a ``steps/N/attempts`` link must not let ``dcr gc`` empty a
folder elsewhere, nor a ``receivers`` link let a receiver write outside ROOT), reads refuse anything
but a regular file (a FIFO ``commit.json`` would block every reader; a chunk linked to
``/dev/zero`` would never end), and a read is bounded: an object larger than the caller's limit is
refused from its size, before a byte is read.

Every operation walks from ROOT one component at a time, opening each directory relative to the
previous one with ``O_NOFOLLOW | O_DIRECTORY`` and acting on the last component relative to its
directory (``dir_fd``): a link swapped in between a check and a use cannot redirect it, because
nothing is ever resolved by name from ROOT again. Listings name everything they find, links and
special files included, so that callers can report them; any access through one is refused. ROOT
itself may be a link: it is the user's choice of directory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import time
import uuid
from collections.abc import Iterator

from dcr_core.errors import IntegrityError, UnsafeKeyError

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: opening a FIFO must not hang


def _parts(base: str, path: str) -> list[str]:
    rel = os.path.relpath(path, base)
    if rel == "." or rel.startswith(".."):
        raise UnsafeKeyError(f"{path}: not under ROOT {base}")
    return rel.split(os.sep)


def _refuse(path: str, dir_fd: int, name: str) -> UnsafeKeyError:
    """The error for a component that is not what DCR writes (a link, or a file where a directory
    belongs)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        return UnsafeKeyError(f"{path}: a symbolic link inside ROOT; DCR does not follow links (remove it)")
    return UnsafeKeyError(f"{path}: not a directory or regular file DCR wrote (a FIFO, device, or a file in a directory's place)")


def _open_dir(dir_fd: int, name: str, path: str, create: bool = False) -> int:
    """Open directory ``name`` in ``dir_fd`` without following a link (created if ``create``)."""
    try:
        return os.open(name, _DIR, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, dir_fd=dir_fd)
        return _open_dir(dir_fd, name, path)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refuse(path, dir_fd, name) from None
        raise


@contextlib.contextmanager
def _parent(base: str, path: str, create: bool = False) -> Iterator[tuple[int, str]]:
    """``(fd of the directory holding path's last component, that component)``, reached from ROOT
    without following links (missing directories: FileNotFoundError, or created with ``create``)."""
    parts = _parts(base, path)
    if create:
        os.makedirs(base, exist_ok=True)  # ROOT itself (and above it): the user's path, links allowed
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        cur = base
        for part in parts[:-1]:
            cur = os.path.join(cur, part)
            nxt = _open_dir(fd, part, cur, create)
            os.close(fd)
            fd = nxt
        yield fd, parts[-1]
    finally:
        os.close(fd)


def _open_file(base: str, path: str) -> tuple[int, os.stat_result]:
    """An fd of the regular file ``path`` (no link followed on the way) and its stat."""
    with _parent(base, path) as (dfd, name):
        try:
            fd = os.open(name, _FILE, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _refuse(path, dfd, name) from None
            raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafeKeyError(f"{path}: not a regular file (a FIFO, device or directory); DCR reads only files")
    return fd, st


def read_range(base: str, path: str, start: int, length: int) -> bytes:
    """Bytes ``[start, start + length)`` of the regular file ``path`` (fewer where it ends sooner)."""
    fd, _ = _open_file(base, path)
    try:
        parts, got = [], 0
        while got < length:
            more = os.pread(fd, min(length - got, 64 << 20), start + got)
            if not more:
                break
            parts.append(more)
            got += len(more)
        return b"".join(parts)
    finally:
        os.close(fd)


def read(base: str, path: str, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``: a larger file is refused unread)."""
    fd, st = _open_file(base, path)
    try:
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
    """Whether ``path`` exists (a link there is refused, not reported)."""
    try:
        with _parent(base, path) as (dfd, name):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise _refuse(path, dfd, name)
            return True
    except FileNotFoundError:
        return False


def _write_temp(dfd: int, name: str, data: bytes, durable: bool) -> str:
    tmp = f".{name}.put-{uuid.uuid4().hex}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=dfd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    os.close(fd)
    return tmp


def _refuse_link(path: str, dfd: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISLNK(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
            raise _refuse(path, dfd, name)


def write_atomically(base: str, path: str, data: bytes) -> None:
    """Write a temp file beside ``path`` and rename it over ``path``: a concurrent reader sees the
    old object or the new one, never a prefix (the PUT semantics of object stores)."""
    with _parent(base, path, create=True) as (dfd, name):
        _refuse_link(path, dfd, name)  # (a rename replaces a link raced in after this, never follows it)
        tmp = _write_temp(dfd, name, data, durable=False)
        try:
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            raise


def create_if_absent(base: str, path: str, data: bytes) -> bool:
    """Exclusive ``link()`` of a complete, fsynced temp file: exactly one creator wins; a reader
    never sees a partial object."""
    with _parent(base, path, create=True) as (dfd, name):
        tmp = _write_temp(dfd, name, data, durable=True)
        try:
            os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp, dir_fd=dfd)
        os.fsync(dfd)
        return True


@contextlib.contextmanager
def _dir(base: str, path: str) -> Iterator[int | None]:
    """An fd of directory ``path`` (None if it does not exist or is a regular file)."""
    try:
        with _parent(base, path) as (dfd, name):
            try:
                fd = os.open(name, _DIR, dir_fd=dfd)
            except FileNotFoundError:
                fd = None
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    raise _refuse(path, dfd, name) from None
                fd = None
    except FileNotFoundError:
        fd = None
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def listdir(base: str, path: str, prefixes: bool = False) -> list[str]:
    """Names of everything in directory ``path`` ([] if there is none), links and special files
    included, so that callers see (and report) them; any access through one is refused. With
    ``prefixes``, regular files are left out (what an object store lists as common prefixes)."""
    with _dir(base, path) as fd:
        if fd is None:
            return []
        with os.scandir(fd) as it:
            return sorted(e.name for e in it if not (prefixes and e.is_file(follow_symlinks=False)))


def find(base: str, path: str) -> list[tuple[str, int, float]]:
    """``(path, size, mtime)`` of every regular file under ``path`` (``path`` itself if it is one),
    never through a link; links and special files are skipped."""
    with _dir(base, path) as fd:
        if fd is None:
            try:
                with _parent(base, path) as (dfd, name):
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                return []
            return [(path, st.st_size, st.st_mtime)] if stat.S_ISREG(st.st_mode) else []
        out: list[tuple[str, int, float]] = []
        _walk(fd, path, out)
        return out


def _walk(fd: int, path: str, out: list) -> None:
    with os.scandir(fd) as it:
        entries = list(it)
    for e in entries:
        try:
            st = os.stat(e.name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # deleted meanwhile
        if stat.S_ISREG(st.st_mode):
            out.append((os.path.join(path, e.name), st.st_size, st.st_mtime))
        elif stat.S_ISDIR(st.st_mode):
            try:
                sub = os.open(e.name, _DIR, dir_fd=fd)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as err:
                if err.errno == errno.ELOOP:
                    continue  # replaced by a link meanwhile: not followed
                raise
            try:
                _walk(sub, os.path.join(path, e.name), out)
            finally:
                os.close(sub)


def remove(base: str, path: str, recursive: bool = False, attempts: int = 5) -> None:
    """Delete ``path`` (a directory only with ``recursive``), never through a link (a link itself is
    removed, not what it points to). A directory that a concurrent writer adds to while it is being
    deleted (a receiver recording its commit) is deleted again, a few times."""
    with _parent(base, path) as (dfd, name):
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)  # FileNotFoundError: nothing to delete
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dfd)
            return
        if not recursive:
            raise IsADirectoryError(path)
        for n in range(attempts):
            try:
                shutil.rmtree(name, dir_fd=dfd)  # fd-based: removes links inside, never follows them
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or n == attempts - 1:
                    raise
                time.sleep(0.05 * (n + 1))


def drop_cached(path: str) -> None:
    """Ask the kernel to drop ``path``'s clean pages from the page cache (``POSIX_FADV_DONTNEED``;
    dirty ones are only queued for writeback and stay, and so do pages mapped by a process). Best
    effort: a file that is gone, or a file system that keeps its pages (tmpfs), is left as it is;
    reading the file still gives its bytes."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_dir(directory: str) -> None:
    """Make a rename or link durable (best effort: not every file system fsyncs directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # e.g. EINVAL on file systems without directory fsync: nothing more can be done
    finally:
        os.close(fd)
