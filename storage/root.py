"""ROOT: an fsspec URL or local path, and every byte DCR reads or writes under it.

All keys are relative, '/'-separated and checked to stay under ROOT; nothing else is touched.
Every operation goes through this class, which retries transient failures (``storage.retry``)
and counts requests and bytes per ROOT (``io_stats``), so what a refit moved can be measured.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import posixpath
import threading
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass

# gcsfs 2026.x otherwise probes a gRPC endpoint on every call (seconds each); set before import.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import fsspec  # noqa: E402

from dcr_core.errors import UnsafeKeyError, UsageError  # noqa: E402
from storage import commit  # noqa: E402
from storage.retry import RetryPolicy  # noqa: E402

log = logging.getLogger("dcr.storage")

DEFAULT_POOL = 32


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


@dataclass
class IOStats:
    """Requests and bytes moved under one ROOT in this process."""

    gets: int = 0
    bytes_read: int = 0
    puts: int = 0
    bytes_written: int = 0
    lists: int = 0
    heads: int = 0
    retries: int = 0

    def copy(self) -> IOStats:
        return IOStats(**asdict(self))

    def minus(self, other: IOStats) -> IOStats:
        return IOStats(**{k: v - getattr(other, k) for k, v in asdict(self).items()})


_STATS: dict[str, IOStats] = {}
_STATS_LOCK = threading.Lock()


def io_stats(url: str | os.PathLike) -> IOStats:
    """A snapshot of the counters of ROOT ``url`` in this process."""
    with _STATS_LOCK:
        return _STATS.setdefault(os.fspath(url), IOStats()).copy()


def _backend_defaults(protocol: str, opts: dict) -> dict:
    if protocol in ("file", "local"):
        opts.setdefault("auto_mkdir", True)
    elif protocol in ("s3", "s3a"):
        # botocore's pool is 10 connections by default; DCR moves many chunks in parallel.
        cfg = dict(opts.get("config_kwargs") or {})
        cfg.setdefault("max_pool_connections", DEFAULT_POOL)
        opts["config_kwargs"] = cfg
        # One GET per object: with max_concurrency > 1 s3fs first HEADs every object to split it.
        opts.setdefault("max_concurrency", 1)
    elif protocol in ("gs", "gcs") and os.environ.get("STORAGE_EMULATOR_HOST"):
        opts.setdefault("token", "anon")
    return opts


def gcs_upload_kwargs(protocol: str, data: bytes) -> dict:
    """Upload options that keep GCS objects intact on every server.

    The GCS emulator's multipart parser drops a trailing carriage return, so an object ending in
    b"\\r" comes back one byte short (DCR's digests catch it). Such objects go through a one-chunk
    resumable upload instead, which real GCS and the emulator both store exactly.
    """
    if protocol in ("gs", "gcs") and data.endswith(b"\r"):
        return {"chunksize": len(data)}
    return {}


def _write_local_atomically(path: str, data: bytes) -> None:
    """Write a temp file beside ``path`` and rename it over ``path``: a concurrent reader sees the
    old object or the new one, never a prefix (the PUT semantics of object stores)."""
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{name}.put-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str  # relative to ROOT
    size: int
    mtime: float | None  # seconds since the epoch; None when the backend does not say


def _mtime(info: Mapping[str, object]) -> float | None:
    """The modification time in an fsspec info dict (each backend names and types it its own way)."""
    for field_name in ("mtime", "LastModified", "updated", "created"):
        v = info.get(field_name)
        if v is None:
            continue
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, datetime.datetime):
            return (v if v.tzinfo else v.replace(tzinfo=datetime.timezone.utc)).timestamp()
        if isinstance(v, str):
            try:
                d = datetime.datetime.fromisoformat(v.replace("Z", "+00:00"))
            except ValueError:
                continue
            return (d if d.tzinfo else d.replace(tzinfo=datetime.timezone.utc)).timestamp()
    return None


class Root:
    """One ROOT opened through fsspec."""

    def __init__(
        self,
        url: str | os.PathLike,
        storage_options: Mapping[str, object] | None = None,
        retry: RetryPolicy | None = None,
    ):
        url = os.fspath(url)
        protocol = fsspec.utils.get_protocol(url)
        opts = _backend_defaults(protocol, dict(storage_options or {}))
        try:
            self.fs, self.path = fsspec.url_to_fs(url, **opts)
        except (ImportError, ValueError, TypeError) as e:
            raise UsageError(f"cannot open ROOT {url!r}: {e}") from None
        self.url = url
        self.storage_options = dict(storage_options or {})
        self.protocol = protocol
        self.path = self.path.rstrip("/") or "/"
        self.retry = retry or RetryPolicy()
        with _STATS_LOCK:
            self._stats = _STATS.setdefault(url, IOStats())

    def __repr__(self) -> str:
        return f"Root({self.url!r})"

    def _count(self, **deltas: int) -> None:
        with _STATS_LOCK:
            for k, v in deltas.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    def _call(self, what: str, key: str, fn):
        def on_retry(attempt: int, e: BaseException) -> None:
            self._count(retries=1)
            log.warning("retrying %s %s/%s after %s: %s (attempt %d)", what, self.url, key, type(e).__name__, e, attempt)

        return self.retry.call(fn, on_retry)

    def full(self, key: str) -> str:
        return posixpath.join(self.path, _check_rel(key))

    def read(self, key: str) -> bytes:
        path = self.full(key)

        def get() -> bytes:
            self._count(gets=1)
            data = self.fs.cat_file(path)
            self._count(bytes_read=len(data))
            return data

        return self._call("GET", key, get)

    def write(self, key: str, data: bytes) -> None:
        """Write (or replace) an object. Only for objects no reader trusts before a commit."""
        path = self.full(key)

        def put() -> None:
            self._count(puts=1, bytes_written=len(data))
            if self.protocol in ("file", "local"):
                _write_local_atomically(path, data)  # like an object store PUT: never seen half-written
                return
            self.fs.pipe_file(path, data, **gcs_upload_kwargs(self.protocol, data))

        self._call("PUT", key, put)

    def create_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` with ``data`` unless it exists; True if this call created it."""
        path = self.full(key)

        def put() -> bool:
            self._count(puts=1, bytes_written=len(data))
            return commit.create_if_absent(self.fs, self.protocol, path, data)

        return self._call("PUT-if-absent", key, put)

    def exists(self, key: str) -> bool:
        path = self.full(key)

        def head() -> bool:
            self._count(heads=1)
            self.fs.invalidate_cache(path)
            return self.fs.exists(path)

        return self._call("HEAD", key, head)

    def listdir(self, key: str) -> list[str]:
        """Names of the children of ``key`` ([] if it does not exist). Always a fresh listing."""
        path = self.full(key)

        def ls() -> list[str]:
            self._count(lists=1)
            self.fs.invalidate_cache(path)
            try:
                entries = self.fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
            return sorted({posixpath.basename(e.rstrip("/")) for e in entries} - {""})

        return self._call("LIST", key, ls)

    def objects(self, key: str) -> list[ObjectInfo]:
        """Every object under ``key`` (recursive; [] if none), with size and modification time."""
        path = self.full(key)

        def find() -> list[ObjectInfo]:
            self._count(lists=1)
            self.fs.invalidate_cache(path)
            try:
                found = self.fs.find(path, detail=True)
            except FileNotFoundError:
                return []
            prefix = self.path.rstrip("/") + "/"
            out = []
            for full, info in found.items():
                rel = full[len(prefix):] if full.startswith(prefix) else full
                out.append(ObjectInfo(rel, int(info.get("size") or 0), _mtime(info)))
            return sorted(out, key=lambda o: o.key)

        return self._call("LIST", key, find)

    def remove(self, key: str, recursive: bool = False) -> None:
        path = self.full(key)
        self._call("DELETE", key, lambda: self.fs.rm(path, recursive=recursive))
