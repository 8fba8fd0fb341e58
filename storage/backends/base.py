"""What a storage backend is: one opened store under a ROOT, what it can do, and the object
operations ``storage.root.Root`` makes on it.

Modelled on zarr's ``Store``: code above asks the backend what it can do (``local``,
``has_latency``, ``supports_conditional_create``, ...) and never tests a URL's scheme. The object
operations are fsspec's here; a backend overrides the ones it does its own way (local files, the
conditional create of each cloud). A backend class is registered in ``storage.backends`` under its
URL schemes.
"""

from __future__ import annotations

import datetime
import os
import posixpath
from collections.abc import Mapping
from typing import ClassVar

import fsspec

from dcr_core.errors import DCRError, UsageError
from storage import access
from storage.access import Endpoint
from storage.retry import NO_RETRY, RetryPolicy


class Backend:
    """One opened filesystem and what DCR needs to know about it (``open`` makes one)."""

    # What the backend is (each class sets its own).
    schemes: ClassVar[tuple[str, ...]] = ()  # the URL schemes it serves; the first is its canonical one
    form: ClassVar[str] = ""  # how a ROOT on it is written, for messages: "s3://bucket/prefix"
    local: ClassVar[bool] = False  # a directory on this machine: objects are files (storage.local.objects)
    has_latency: ClassVar[bool] = True  # every request crosses a network: parallel requests hide the wait
    shared_between_processes: ClassVar[bool] = True  # another process (a Dask worker) reaches the same objects
    supports_conditional_create: ClassVar[bool] = False  # an atomic create-if-absent: what a publisher commits with

    # Cloud stores: what their errors mean (storage.access.explain), and what to tell the user.
    bucket_word: ClassVar[str] = "bucket"  # what the store calls the top of a path ("container" on Azure)
    credential_errors: ClassVar[frozenset[str]] = frozenset()  # qualified type names meaning "no credentials"
    credentials_hint: ClassVar[str] = ""  # what to set when there are none
    missing_bucket_codes: ClassVar[frozenset[str]] = frozenset()  # the service's error codes for "no such bucket"
    missing_bucket_message: ClassVar[str] = ""  # how the client's own message for it starts, where it has one
    denied_codes: ClassVar[frozenset[str]] = frozenset()  # the service's error codes for a refused credential
    endpoint_hint: ClassVar[str] = ""  # an endpoint the user set does not answer: what to check
    default_endpoint_hint: ClassVar[str] = ""  # the cloud's own endpoint does not resolve: what to check
    server_hint: ClassVar[str] = ""  # where a local server with a bucket comes from (infra/)

    def __init__(self, protocol: str, fs: fsspec.AbstractFileSystem, path: str, retry: RetryPolicy = NO_RETRY,
                 endpoint: Endpoint | None = None):
        self.protocol = protocol  # the scheme as ROOT spells it (``s3a`` stays ``s3a``)
        self.fs = fs
        self.path = path.rstrip("/") or "/"  # the ROOT's path inside ``fs``, without a trailing slash
        self.retry = retry  # NO_RETRY where another layer owns retries (see storage.retry)
        self.endpoint = endpoint  # cloud stores: where requests go, and which setting chose it

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.protocol}://{self.path})"

    # --- opening ---------------------------------------------------------------------------------

    @classmethod
    def open(cls, url: str, storage_options: dict) -> Backend:
        """ROOT ``url`` opened with DCR's defaults for this backend (``storage_options`` win)."""
        fs, path = fsspec.url_to_fs(url, **storage_options)
        return cls(fsspec.utils.get_protocol(url), fs, path)

    @classmethod
    def canonical_url(cls, url: str) -> str:
        """``url`` spelt one way for every spelling of the same place (``storage.root.same_root``)."""
        scheme, _, rest = url.strip().partition("://")
        return f"{cls.schemes[0] if cls.schemes else scheme.lower()}://{rest.rstrip('/')}"

    def read_workers(self, requested: int) -> int:
        """Threads worth fetching chunks on. A ROOT without latency (local, in memory) has none to
        hide: a fetch is a page-cache copy and the decode and digest of the chunk, all CPU, while the
        caller applies what arrives on a core of its own; more threads than the other cores only
        contend (an in-place refit of 1.35 GB on 2 cores: 1.7 s with 1 thread, 2.6 s with 4)."""
        if self.has_latency:
            return requested
        return max(1, min(requested, _cores() - 1))

    # --- objects (full paths inside ``fs``; Root makes them from keys) ---------------------------

    def read(self, path: str, limit: int | None = None) -> bytes:
        """The object's bytes; with ``limit``, at most ``limit + 1`` of them (one ranged GET)."""
        return self.fs.cat_file(path) if limit is None else self.fs.cat_file(path, start=0, end=limit + 1)

    def read_range(self, path: str, start: int, length: int) -> bytes:
        return self.fs.cat_file(path, start=start, end=start + length)

    def write(self, path: str, data: bytes) -> None:
        """Write (or replace) an object; readers see the old object or the new one, never a part."""
        self.fs.pipe_file(path, data)

    def create_if_absent(self, path: str, data: bytes) -> bool:
        """Create ``path`` holding ``data`` unless it exists; True if this call created it. Atomic:
        of racing callers exactly one gets True. A backend without a conditional create refuses,
        rather than silently racing."""
        raise UsageError(f"no atomic create-if-absent for {self.protocol}:// ROOTs")

    def create_by_condition(self, path: str, data: bytes) -> bool:
        """``create_if_absent`` by one conditional write, fsspec's ``mode="create"`` (the server
        refuses the write if the object exists, and the filesystem raises ``FileExistsError``): for
        stores that decide it atomically (S3's ``If-None-Match: *``, Azure's the same)."""
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        return True

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return self.fs.exists(path)

    def listdir(self, path: str, prefixes: bool = False) -> list[str]:
        """Names of the children of ``path`` ([] if none), from a fresh listing; ``prefixes``: only
        the children that can hold objects."""
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        names = {posixpath.basename(e["name"].rstrip("/")) for e in entries
                 if not (prefixes and e.get("type") == "file")}
        return sorted(names - {""})

    def find(self, path: str) -> list[tuple[str, int, float | None]]:
        """Every object under ``path`` (recursive): its full path, size and modification time."""
        self.fs.invalidate_cache(path)
        try:
            found = self.fs.find(path, detail=True)
        except FileNotFoundError:
            return []
        return [(name, int(info.get("size") or 0), info_mtime(info)) for name, info in found.items()]

    def remove(self, path: str, recursive: bool = False) -> None:
        self.fs.rm(path, recursive=recursive)

    # --- cloud stores: the bucket, and what an error means ---------------------------------------

    def bucket_exists(self, bucket: str, prefix: str) -> bool | None:
        """Whether ``bucket`` exists, from one listing of at most one key under ``prefix`` (the
        permission every reader has); None when the answer says neither."""
        return None

    def check_bucket(self, root_url: str, path: str) -> None:
        """Called when a listing under ROOT came back empty (fsspec lists a missing bucket as empty):
        a bucket that does not exist is a ``StoreConfigError``; any other answer (the bucket is there,
        or the check itself fails) leaves the empty listing as it is: nothing is claimed that was not
        seen."""
        bucket, _, key = path.lstrip("/").partition("/")
        if self.endpoint is not None and self.bucket_exists(bucket, key.rstrip("/") + "/" if key else "") is False:
            raise self._missing_bucket(root_url, bucket)

    def explain(self, root_url: str, exc: BaseException) -> DCRError | None:
        """``exc`` (raised by this backend's client, retries over) as a DCR error saying what to set,
        or None when it is not about reaching or using the store (the caller re-raises it as it is)."""
        if isinstance(exc, DCRError) or self.endpoint is None:
            return None
        statuses, codes = access.statuses_and_codes(exc)
        no_bucket = self.is_missing_bucket(access.messages(exc), codes)
        if isinstance(exc, FileNotFoundError) and not no_bucket:
            return None  # a missing object: callers decide what that means (no marker yet, ...)
        if self.lacks_credentials(access.type_names(exc), statuses):
            return access.StoreConfigError(f"{root_url}: {self.credentials_hint} for {self.endpoint}")
        if no_bucket:
            return self._missing_bucket(root_url, access.bucket_of(self.path))
        return access.denied(root_url, self.endpoint, exc, self.denied_codes) or access.unreachable(root_url, self.endpoint, exc)

    def _missing_bucket(self, root_url: str, bucket: str) -> access.StoreConfigError:
        return access.StoreConfigError(f"{root_url}: {self.bucket_word} {bucket!r} does not exist at {self.endpoint}; "
                                       f"create it ({self.server_hint}) or fix ROOT")

    @classmethod
    def lacks_credentials(cls, type_names: set[str], statuses: set[int]) -> bool:
        """Whether an error (its exceptions' qualified type names and HTTP statuses) says that no
        usable credentials were found."""
        return bool(type_names & cls.credential_errors)

    @classmethod
    def is_missing_bucket(cls, messages: list[str], codes: set[str]) -> bool:
        """Whether an error says the bucket does not exist: by the service's error code, or by the
        client's own message for it; never a path that happens to contain the words."""
        return bool(codes & cls.missing_bucket_codes) or bool(
            cls.missing_bucket_message and any(m.startswith(cls.missing_bucket_message) for m in messages))


class OtherBackend(Backend):
    """Any other filesystem fsspec knows (``http://``, a chained ``simplecache::s3://``): read with
    fsspec's defaults; no conditional create, so nothing is published there."""


def _cores() -> int:
    """The cores this process may run on (its affinity where the platform says)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else (os.cpu_count() or 1)


def info_mtime(info: Mapping[str, object]) -> float | None:
    """The modification time in an fsspec info dict (each backend names and types it its own way)."""
    for field_name in ("mtime", "LastModified", "updated", "last_modified", "created"):
        v = info.get(field_name)
        if v is None:
            continue
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, datetime.datetime):
            return (v if v.tzinfo else v.replace(tzinfo=datetime.UTC)).timestamp()
        if isinstance(v, str):
            try:
                d = datetime.datetime.fromisoformat(v.replace("Z", "+00:00"))
            except ValueError:
                continue
            return (d if d.tzinfo else d.replace(tzinfo=datetime.UTC)).timestamp()
    return None
