"""A directory replaced as a whole: a reader sees the old one or the new one, never a mix of the
two, whatever moment its writer is killed at (``dcr materialize`` of a sharded step).

The new directory is built beside the old one, ``.<name>.dcr-next``: its own files, and everything
else the old one holds carried over (hard links; a copy where no link can be made), all fsynced,
before anything visible changes. Then the journal ``.<name>.dcr-swap`` names the new directory (its
device and inode) and holds the record to write once it is in place; then the two directories are
exchanged by one ``renameat2(RENAME_EXCHANGE)``. Where the platform or filesystem has no exchange,
the old directory is renamed aside (``.<name>.dcr-prev``) and the new one into its place: for that
moment the name is absent (a reader finds no directory, never a mix). Then the record is written,
the journal removed and the old directory deleted.

``settle`` (under the directory's lock, before anything else touches it) finishes what a kill cut
off: with a journal, the swap is rolled forward (the new directory was complete before the journal
was written); without one, a partial new directory (or an old one left to delete) is removed and the
name keeps what it held. The name must be a real directory, never a link: a link swapped instead
would be a reader-visible change of what it names, and the tools that load a model directory follow
it once.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import shutil
import stat

from dcr_core import events
from dcr_core.errors import UsageError
from storage.local.objects import fsync_dir
from storage.local.safetensors import temp_path

FORMAT = "dcr-swap"
MAX_JOURNAL_BYTES = 64 << 20
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


@functools.cache
def _renameat2():
    """libc's ``renameat2`` (glibc 2.28 on), or None: looked up in the running process, on first use."""
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except OSError:
        return None


def staging(path: str) -> str:
    """Where the new directory of ``path`` is built (and where the old one waits to be deleted)."""
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.dcr-next")


def _aside(path: str) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.dcr-prev")


def journal_path(path: str) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.dcr-swap")


def exchange(a: str, b: str) -> bool:
    """Swap the directories ``a`` and ``b`` in one step; False where the platform or filesystem
    cannot (then nothing changed)."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def _remove(path: str) -> None:
    """Remove one of this module's own names (a link there is removed, never followed)."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def begin(path: str) -> str:
    """A fresh, empty directory to build the new ``path`` in (with ``path``'s permissions); its path."""
    staged = staging(path)
    _remove(staged)
    os.mkdir(staged)
    with contextlib.suppress(FileNotFoundError):
        os.chmod(staged, stat.S_IMODE(os.stat(path).st_mode))
    return staged


def discard(path: str) -> None:
    """Remove the new directory of ``path`` (a materialize that failed before its journal)."""
    with contextlib.suppress(FileNotFoundError):
        _remove(staging(path))


def carry(path: str, staged: str, skip: set[str]) -> None:
    """Everything in ``path`` but the names in ``skip``, into ``staged``: files as hard links (a
    copy where no link can be made), directories rebuilt, links as links."""
    if not os.path.isdir(path):
        return
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.name not in skip:
            _carry(entry.path, os.path.join(staged, entry.name))


def _carry(src: str, dst: str) -> None:
    st = os.lstat(src)
    if stat.S_ISDIR(st.st_mode):
        os.mkdir(dst, stat.S_IMODE(st.st_mode))
        for entry in sorted(os.scandir(src), key=lambda e: e.name):
            _carry(entry.path, os.path.join(dst, entry.name))
        fsync_dir(dst)
    elif stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISREG(st.st_mode):
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError:
            shutil.copy2(src, dst, follow_symlinks=False)
    else:
        raise UsageError(f"{src}: neither a file, a directory nor a link; dcr materialize replaces the directory "
                         "as a whole and cannot carry it over (move it out of the way)")


def commit(path: str, staged: str, record_path: str, record: bytes) -> None:
    """Put the complete directory ``staged`` in the place of ``path`` and write ``record`` (the
    bytes of the file at ``record_path``), rolled forward by ``settle`` if cut off after the
    journal."""
    fsync_dir(staged)
    st = os.stat(staged)
    ident = [st.st_dev, st.st_ino]
    doc = {"format": FORMAT, "directory": ident, "record": record.decode()}
    _write(journal_path(path), json.dumps(doc).encode(), path)
    events.reached("receive.swap-journaled", path=path)
    _finish(path, staged, record_path, ident, record)


def settle(path: str, record_path: str) -> None:
    """Finish a swap of ``path`` that a kill cut off (see the module doc); the caller holds
    ``path``'s lock."""
    doc = _journal(path)
    if doc is not None:
        ident, record = doc["directory"], doc["record"].encode()
        if _is(path, ident) or _is(staging(path), ident):
            _finish(path, staging(path), record_path, ident, record)
            return
    with contextlib.suppress(FileNotFoundError):  # a journal naming neither directory: nothing to finish
        os.unlink(journal_path(path))
    for leftover in (staging(path), _aside(path)):
        with contextlib.suppress(FileNotFoundError):
            _remove(leftover)


def journaled_record(path: str) -> bytes | None:
    """The record a cut-off swap will write once settled, if ``path`` already is its new directory."""
    doc = _journal(path)
    return doc["record"].encode() if doc is not None and _is(path, doc["directory"]) else None


def _finish(path: str, staged: str, record_path: str, ident: list, record: bytes) -> None:
    if not _is(path, ident):
        _swap(path, staged)
    events.reached("receive.swapped", path=path)
    _write(record_path, record, path)
    os.unlink(journal_path(path))
    fsync_dir(os.path.dirname(path))
    for old in (staged, _aside(path)):  # the old directory, wherever the swap left it
        with contextlib.suppress(FileNotFoundError):
            _remove(old)


def _swap(path: str, staged: str) -> None:
    if os.path.lexists(path) and not exchange(staged, path):
        aside = _aside(path)
        os.rename(path, aside)
        events.reached("receive.moved-aside", path=path)
        try:
            os.rename(staged, path)
        except BaseException:
            os.rename(aside, path)
            raise
    elif not os.path.lexists(path):
        os.rename(staged, path)
    fsync_dir(os.path.dirname(path))


def _is(path: str, ident: list) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode) and [st.st_dev, st.st_ino] == ident


def _journal(path: str) -> dict | None:
    try:
        with open(journal_path(path), "rb") as f:
            doc = json.loads(f.read(MAX_JOURNAL_BYTES + 1))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    ident = doc.get("directory")
    if (doc.get("format") != FORMAT or not isinstance(doc.get("record"), str) or not isinstance(ident, list)
            or len(ident) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in ident)):
        return None
    return doc


def _write(path: str, data: bytes, owner: str) -> None:
    """``data`` at ``path`` by a fsynced temp file renamed over it (the temp file is named as
    ``owner``'s: the next writer holding its lock removes it if a kill left it)."""
    tmp = temp_path(owner)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path))
