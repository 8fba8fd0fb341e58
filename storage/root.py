"""ROOT: an fsspec URL or local path, and every byte DCR reads or writes under it.

All keys are relative, '/'-separated and checked to stay under ROOT; nothing else is touched.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping

import fsspec

from dcr_core.errors import UnsafeKeyError, UsageError
from storage import commit


def parse_storage_options(pairs: list[str] | None) -> dict[str, object]:
    """``KEY=VALUE`` strings (from ``--storage-option``) to fsspec keyword arguments.

    Values ``true``/``false``/integers are converted; a ``KEY.SUB=VALUE`` sets a nested dict
    entry (e.g. ``client_kwargs.region_name=us-east-1``).
    """
    out: dict[str, object] = {}
    for pair in pairs or []:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option {pair!r} is not KEY=VALUE")
        value: object = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            try:
                value = int(raw)
            except ValueError:
                pass
        target = out
        *parents, leaf = key.split(".")
        for p in parents:
            target = target.setdefault(p, {})  # type: ignore[assignment]
        target[leaf] = value
    return out


def _check_rel(key: str) -> str:
    if not key or key.startswith("/") or "\\" in key or "//" in key:
        raise UnsafeKeyError(f"key {key!r} is not a relative path under ROOT")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise UnsafeKeyError(f"key {key!r} leaves ROOT")
    return key


class Root:
    """One ROOT opened through fsspec."""

    def __init__(self, url: str | os.PathLike, storage_options: Mapping[str, object] | None = None):
        url = os.fspath(url)
        opts = dict(storage_options or {})
        protocol = fsspec.utils.get_protocol(url)
        if protocol in ("file", "local"):
            opts.setdefault("auto_mkdir", True)
        try:
            self.fs, self.path = fsspec.url_to_fs(url, **opts)
        except (ImportError, ValueError) as e:
            raise UsageError(f"cannot open ROOT {url!r}: {e}") from None
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.protocol = protocol
        self.path = self.path.rstrip("/") or "/"

    def __repr__(self) -> str:
        return f"Root({self.url!r})"

    def full(self, key: str) -> str:
        return posixpath.join(self.path, _check_rel(key))

    def read(self, key: str) -> bytes:
        return self.fs.cat_file(self.full(key))

    def write(self, key: str, data: bytes) -> None:
        """Write (or replace) an object. Only for objects no reader trusts before a commit."""
        path = self.full(key)
        if self.protocol in ("file", "local"):
            self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        self.fs.pipe_file(path, data)

    def create_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` with ``data`` unless it exists; True if this call created it."""
        return commit.create_if_absent(self.fs, self.protocol, self.full(key), data)

    def exists(self, key: str) -> bool:
        return self.fs.exists(self.full(key))

    def listdir(self, key: str) -> list[str]:
        """Names of the children of ``key`` ([] if it does not exist). Always a fresh listing."""
        path = self.full(key)
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted({posixpath.basename(e.rstrip("/")) for e in entries} - {""})

    def remove(self, key: str, recursive: bool = False) -> None:
        self.fs.rm(self.full(key), recursive=recursive)
