"""A ROOT on local disk (``/dir``, ``file:///dir``): objects are files, every operation through
``storage.local.objects`` (no links followed, reads bounded).

Create-if-absent: a private temp file, complete and fsynced, ``os.link``-ed to the final name.
``link`` fails if the name exists and the linked file is whole, so exactly one racing creator wins
and no reader sees a partial marker. Atomic. Nobody retries: file system errors are not transient.
"""

from __future__ import annotations

import os

import fsspec

from dcr_core.errors import UsageError
from storage.backends.base import Backend
from storage.local import objects


class LocalBackend(Backend):
    schemes = ("file", "local")
    form = "a local path"
    local = True
    has_latency = False  # a fetch is a page-cache copy: more threads only contend for the cores
    supports_conditional_create = True

    @classmethod
    def open(cls, url: str, storage_options: dict) -> Backend:
        opts = {"auto_mkdir": True, **storage_options}
        fs, path = fsspec.url_to_fs(url, **opts)
        if os.path.exists(path) and not os.path.isdir(path):
            raise UsageError(f"ROOT {url!r} is a file, not a directory: ROOT is the directory that dcr publish writes into")
        return cls(fsspec.utils.get_protocol(url), fs, path)

    @classmethod
    def canonical_url(cls, url: str) -> str:
        scheme, sep, rest = url.strip().partition("://")
        return os.path.abspath(rest if sep else scheme)

    def read(self, path: str, limit: int | None = None) -> bytes:
        return objects.read(self.path, path, limit)  # a file larger than ``limit`` is refused unread

    def read_range(self, path: str, start: int, length: int) -> bytes:
        return objects.read_range(self.path, path, start, length)

    def write(self, path: str, data: bytes) -> None:
        objects.write_atomically(self.path, path, data)  # like a PUT: never seen half-written

    def create_if_absent(self, path: str, data: bytes) -> bool:
        return objects.create_if_absent(self.path, path, data)

    def exists(self, path: str) -> bool:
        return objects.exists(self.path, path)

    def listdir(self, path: str, prefixes: bool = False) -> list[str]:
        return objects.listdir(self.path, path, prefixes)

    def find(self, path: str) -> list[tuple[str, int, float | None]]:
        return list(objects.find(self.path, path))

    def remove(self, path: str, recursive: bool = False) -> None:
        objects.remove(self.path, path, recursive)
