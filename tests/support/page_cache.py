"""How much of a file the page cache holds (``mincore(2)`` over a shared read-only map of it), and
the file system a path is on: tests of what DCR drops from the page cache."""

from __future__ import annotations

import ctypes
import mmap
import os

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
MAP_FAILED = ctypes.c_void_p(-1).value


def resident_pages(path: str) -> int:
    """The pages of ``path`` in the page cache now (mapping it faults nothing in)."""
    size = os.path.getsize(path)
    if not size:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = ctypes.create_string_buffer(pages)
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(b & 1 for b in vec.raw)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def fs_type(path: str) -> str:
    """The type of the file system ``path`` is on (the longest mount point above it)."""
    path = os.path.realpath(path)
    best, kind = "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            _, point, typ = line.split()[:3]
            point = point.replace("\\040", " ")
            if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                best, kind = point, typ
    return kind


def drops_pages(path: str) -> bool:
    """Whether the file system of ``path`` lets ``POSIX_FADV_DONTNEED`` drop clean pages (tmpfs and
    ramfs pages are the file's only copy)."""
    return fs_type(path) not in ("tmpfs", "ramfs", "")
