"""ROOT: an fsspec URL or local path, and every byte DCR reads or writes under it.

All keys are relative, '/'-separated and checked to stay under ROOT; nothing else is touched.
Every request goes through ``Root``, which applies the backend's retry owner (``storage.retry``)
and counts requests and bytes (``storage.stats``). ``open_root`` keeps one ``Root`` per ROOT URL
and storage options in the process, so steps that receive a ``RootRef`` do not reopen anything.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import fsspec

from dcr_core.errors import IntegrityError, UnsafeKeyError, UsageError
from storage import stats
from storage.backends import registry
from storage.retry import RetryPolicy

log = logging.getLogger("dcr.storage")

# A scheme is letters, digits, '+', '-', '.', starting with a letter (RFC 3986). Anything that looks
# like one but is not a protocol fsspec knows, or lacks the "//", is refused: "s3:/b/x" or "s4://b/x"
# must not become local directories.
_URLISH = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def check_root_url(url: str) -> str:
    """``url`` if it is a local path or a well-formed fsspec URL, else a one-line UsageError.
    (Publishing needs a backend with create-if-absent: ``storage.backends``.)"""
    if not isinstance(url, str) or not url:
        raise UsageError(f"ROOT must be a non-empty path or URL, got {url!r}")
    if "::" in url:  # a chained fsspec URL (simplecache::s3://...): fsspec checks each part
        return url
    if _URLISH.match(url):
        scheme, _, rest = url.partition(":")
        if scheme.lower() not in fsspec.available_protocols() or not rest.startswith("//"):
            raise UsageError(f"ROOT {url!r} is not a valid URL; use {registry.forms()}")
    return url


def same_root(a: str, b: str) -> bool:
    """Whether two ROOT spellings name the same place (``storage.backends.registry.canonical_url``)."""
    return registry.canonical_url(a) == registry.canonical_url(b)


@dataclass(frozen=True)
class RootRef:
    """A ROOT by reference: what a task receives instead of an open filesystem (serializable)."""

    url: str
    storage_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", check_root_url(os.fspath(self.url)))
        if not isinstance(self.storage_options, Mapping):
            raise UsageError(f"storage_options must be a mapping, got {type(self.storage_options).__name__}")
        object.__setattr__(self, "storage_options", dict(self.storage_options))

    def __hash__(self) -> int:
        return hash((self.url, _options_key(self.storage_options)))


def _options_key(options: Mapping) -> str:
    return json.dumps(options, sort_keys=True, default=repr)


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
            nested = target.setdefault(p, {})
            if not isinstance(nested, dict):
                raise UsageError(f"--storage-option {pair!r}: {p!r} is already set to a value")
            target = nested
        target[leaf] = value
    return out


def _check_rel(key: str) -> str:
    if not key or key.startswith("/") or "\\" in key or "//" in key:
        raise UnsafeKeyError(f"key {key!r} is not a relative path under ROOT")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise UnsafeKeyError(f"key {key!r} leaves ROOT")
    return key


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str  # relative to ROOT
    size: int
    mtime: float | None  # seconds since the epoch; None when the backend does not say


class Root:
    """One ROOT opened through fsspec (prefer ``open_root``, which shares instances)."""

    def __init__(self, url: str | os.PathLike, storage_options: Mapping[str, object] | None = None,
                 retry: RetryPolicy | None = None):
        self.ref = RootRef(os.fspath(url), dict(storage_options or {}))
        self.url = self.ref.url
        self.storage_options = self.ref.storage_options
        self.backend = registry.open_backend(self.url, self.storage_options)
        self.fs, self.path, self.protocol = self.backend.fs, self.backend.path, self.backend.protocol
        self.retry = retry or self.backend.retry
        self._bucket_seen = self.backend.endpoint is None  # cloud: checked on the first empty listing

    def __repr__(self) -> str:
        return f"Root({self.url!r})"

    def _call(self, what: str, key: str, fn):
        def on_retry(attempt: int, e: BaseException) -> None:
            # Counted (io_stats) and logged at INFO: a retry that succeeds is routine, and a command's
            # stderr stays the one line of its error when the retries run out.
            stats.count(self.url, retries=1)
            log.info("retrying %s %s/%s after %s: %s (attempt %d)", what, self.url, key, type(e).__name__, e, attempt)

        try:
            return self.retry.call(fn, on_retry)
        except Exception as e:
            explained = self.backend.explain(self.url, e)
            if explained is None:
                raise
            raise explained from e

    def _empty_listing(self, key: str) -> None:
        """An empty listing of a cloud ROOT: make sure the bucket exists (once per Root)."""
        if not self._bucket_seen:
            self.backend.check_bucket(self.url, self.full(key))
            self._bucket_seen = True

    def full(self, key: str) -> str:
        return posixpath.join(self.path, _check_rel(key))

    def read(self, key: str, limit: int | None = None) -> bytes:
        """The object's bytes. With ``limit``, an object larger than that is refused (an
        ``IntegrityError`` naming it) having read at most ``limit + 1`` bytes (a ranged GET), so a
        hostile or damaged object cannot exhaust memory."""
        path = self.full(key)

        def get() -> bytes:
            stats.count(self.url, gets=1)
            data = self.backend.read(path, limit)
            stats.count(self.url, bytes_read=len(data))
            return data

        data = self._call("GET", key, get)
        if limit is not None and len(data) > limit:
            raise IntegrityError(f"{self.url}/{key}: more than the {limit} bytes this object may hold")
        return data

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """Bytes ``[start, start + length)`` of the object (one ranged GET); an object that ends
        sooner gives fewer bytes, for the caller to refuse by size."""
        path = self.full(key)

        def get() -> bytes:
            stats.count(self.url, gets=1)
            data = self.backend.read_range(path, start, length)
            stats.count(self.url, bytes_read=len(data))
            return data

        return self._call("GET", key, get)

    def write(self, key: str, data: bytes) -> None:
        """Write (or replace) an object. Only for objects no reader trusts before a commit."""
        path = self.full(key)

        def put() -> None:
            stats.count(self.url, puts=1, bytes_written=len(data))
            self.backend.write(path, data)

        self._call("PUT", key, put)

    def create_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` with ``data`` unless it exists; True if this call created it."""
        path = self.full(key)

        def put() -> bool:
            stats.count(self.url, puts=1, bytes_written=len(data))
            return self.backend.create_if_absent(path, data)

        return self._call("PUT-if-absent", key, put)

    def exists(self, key: str) -> bool:
        path = self.full(key)

        def head() -> bool:
            stats.count(self.url, heads=1)
            return self.backend.exists(path)

        return self._call("HEAD", key, head)

    def listdir(self, key: str, prefixes: bool = False) -> list[str]:
        """Names of the children of ``key`` ([] if it does not exist). Always a fresh listing.
        ``prefixes``: only the children that can hold objects (an object's name is left out), in the
        same one listing."""
        path = self.full(key)

        def ls() -> list[str]:
            stats.count(self.url, lists=1)
            return self.backend.listdir(path, prefixes)

        names = self._call("LIST", key, ls)
        if not names:
            self._empty_listing(key)
        return names

    def objects(self, key: str) -> list[ObjectInfo]:
        """Every object under ``key`` (recursive; [] if none), with size and modification time."""
        path = self.full(key)
        prefix = self.path.rstrip("/") + "/"

        def rel(full: str) -> str:
            return full[len(prefix):] if full.startswith(prefix) else full

        def find() -> list[ObjectInfo]:
            stats.count(self.url, lists=1)
            return sorted((ObjectInfo(rel(p), size, mtime) for p, size, mtime in self.backend.find(path)),
                          key=lambda o: o.key)

        found = self._call("LIST", key, find)
        if not found:
            self._empty_listing(key)
        return found

    def remove(self, key: str, recursive: bool = False) -> None:
        path = self.full(key)

        def delete() -> None:
            stats.count(self.url, deletes=1)
            self.backend.remove(path, recursive)

        self._call("DELETE", key, delete)


_ROOTS: dict[tuple[str, str], Root] = {}
_ROOTS_LOCK = threading.Lock()


def open_root(ref: RootRef | str | os.PathLike, storage_options: Mapping | None = None) -> Root:
    """The process's ``Root`` for a ROOT reference (opened once, then shared: roots hold no state
    but their filesystem, which fsspec caches per options anyway)."""
    if not isinstance(ref, RootRef):
        ref = RootRef(os.fspath(ref), dict(storage_options or {}))
    key = (ref.url, _options_key(ref.storage_options))
    with _ROOTS_LOCK:
        root = _ROOTS.get(key)
    if root is None:
        root = Root(ref.url, ref.storage_options)
        with _ROOTS_LOCK:
            root = _ROOTS.setdefault(key, root)
    return root
