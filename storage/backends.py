"""What differs between object stores: opening them, their defaults, who retries, create-if-absent.

Create-if-absent is the one write that makes a step (or anything else) real. Atomicity per backend
(the publisher relies on it to let exactly one racing publisher win):
- local files: write a private temp file, then ``os.link`` it to the final name. ``link`` fails if
  the name exists and the linked file is complete, so readers never see a partial marker. Atomic.
  (``storage.local.objects``, with every other operation on a local ROOT.)
- ``memory://``: check and write under a process-wide lock. Atomic within the process, which is
  the whole extent of that filesystem.
- S3 (s3fs): ``PutObject`` with ``If-None-Match: *``; the server refuses (412) if the key exists.
  Atomic on AWS S3 and on servers that honour the header (moto 5 does).
- GCS (gcsfs): upload with ``ifGenerationMatch=0`` (``mode="create"``). Atomic on real GCS; the
  GCS emulator ignores the precondition, so there it degrades to check-then-write: two publishers
  racing within the same few milliseconds could both "win" (docs/reference/backends.md).
- anything else: refused, rather than silently racy.

Emulator quirk worked around: the GCS emulator's multipart parser drops a trailing carriage
return, so an object ending in ``b"\\r"`` goes through a one-chunk resumable upload instead, which
real GCS and the emulator both store exactly (DCR's digests caught it).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import fsspec

from dcr_core.errors import UsageError
from storage import access
from storage.retry import NO_RETRY, RetryPolicy

DEFAULT_POOL = 32  # connections per S3 filesystem: DCR moves many chunks in parallel (botocore: 10)
LOCAL = ("file", "local")
S3 = ("s3", "s3a")
GCS = ("gs", "gcs")
SUPPORTED = (*LOCAL, "memory", *S3, *GCS)

_MEMORY_LOCK = threading.Lock()


@dataclass(frozen=True)
class Backend:
    """One opened filesystem and what DCR needs to know about it."""

    protocol: str
    fs: fsspec.AbstractFileSystem
    path: str  # the ROOT's path inside ``fs``, without a trailing slash
    retry: RetryPolicy  # NO_RETRY where another layer owns retries (see storage.retry)
    endpoint: access.Endpoint | None = None  # cloud stores: where requests go, and which setting chose it

    @property
    def local(self) -> bool:
        return self.protocol in LOCAL

    def read_workers(self, requested: int) -> int:
        """Threads worth fetching chunks on. A local or in-memory ROOT has no latency to hide: a
        fetch is a page-cache copy and the decode and digest of the chunk, all CPU, while the caller
        applies what arrives on a core of its own; more threads than the other cores only contend
        (an in-place refit of 1.35 GB on 2 cores: 1.7 s with 1 thread, 2.6 s with 4)."""
        if self.protocol not in (*LOCAL, "memory"):
            return requested
        return max(1, min(requested, _cores() - 1))


def _cores() -> int:
    """The cores this process may run on (its affinity where the platform says)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else (os.cpu_count() or 1)


def protocol_of(url: str) -> str:
    return fsspec.utils.get_protocol(url)


def open_backend(url: str, storage_options: dict) -> Backend:
    """Open ROOT ``url`` with DCR's defaults for its backend (``storage_options`` win)."""
    protocol = protocol_of(url)
    opts = dict(storage_options)
    endpoint = None
    if protocol in S3:
        endpoint = access.s3_endpoint(opts)
        access.probe(url, endpoint, "check the network, or set AWS_ENDPOINT_URL for an S3-compatible server"
                     if endpoint.default else "is the server running? (infra/start-s3.sh starts one here)")
    elif protocol in GCS:
        endpoint = access.gcs_endpoint(opts)
        access.probe(url, endpoint, "check the network, or set STORAGE_EMULATOR_HOST for an emulator"
                     if endpoint.default else "is the server running? (infra/start-gcs.sh starts an emulator here)")
    try:
        if protocol in GCS:
            fs, path = _open_gcs(url, opts), None
        else:
            if protocol in LOCAL:
                opts.setdefault("auto_mkdir", True)
            elif protocol in S3:
                cfg = dict(opts.get("config_kwargs") or {})
                cfg.setdefault("max_pool_connections", DEFAULT_POOL)
                cfg.setdefault("retries", {"total_max_attempts": 1})  # DCR owns S3 retries
                opts["config_kwargs"] = cfg
                opts.setdefault("max_concurrency", 1)  # one GET per object; >1 HEADs first to split it
            fs, path = fsspec.url_to_fs(url, **opts)
    except (ImportError, ValueError, TypeError) as e:
        raise UsageError(f"cannot open ROOT {url!r}: {e}") from None
    if protocol in S3:
        fs.retries = 1  # s3fs's own retry loop (an attribute, not a constructor option)
    if path is None:
        path = fs._strip_protocol(url)
    if protocol in LOCAL and os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"ROOT {url!r} is a file, not a directory: ROOT is the directory that dcr publish writes into")
    retry = RetryPolicy() if protocol in S3 else NO_RETRY
    return Backend(protocol, fs, path.rstrip("/") or "/", retry, endpoint)


def _open_gcs(url: str, opts: dict):
    """gcsfs's core filesystem class: the package default (``ExtendedGcsFileSystem`` unless
    ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``) probes a gRPC endpoint on every call, seconds each."""
    from gcsfs.core import GCSFileSystem  # noqa: PLC0415 - optional heavy dependency: only GCS ROOTs need it

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        opts.setdefault("token", "anon")
    return GCSFileSystem(**opts)


def upload_kwargs(protocol: str, data: bytes) -> dict:
    """Upload options that keep objects intact on every server (the emulator quirk above)."""
    if protocol in GCS and data.endswith(b"\r"):
        return {"chunksize": len(data)}
    return {}


def supports_create_if_absent(protocol: str) -> bool:
    return protocol in SUPPORTED


def create_if_absent(backend: Backend, path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` unless it exists; True if this call created it."""
    protocol, fs = backend.protocol, backend.fs
    if protocol == "memory":
        with _MEMORY_LOCK:
            if fs.exists(path):
                return False
            fs.pipe_file(path, data)
            return True
    if protocol in S3:
        try:
            fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        return True
    if protocol in GCS:
        # gcsfs sends ifGenerationMatch=0 for mode="create" and raises FileExistsError on 412. The
        # existence check first narrows the window on servers that ignore the precondition (the
        # emulator); on real GCS the conditional upload alone is atomic.
        if fs.exists(path):
            return False
        try:
            fs.pipe_file(path, data, mode="create", **upload_kwargs(protocol, data))
        except FileExistsError:
            return False
        return True
    raise UsageError(f"no atomic create-if-absent for protocol {protocol!r}; use a local path, memory://, s3:// or gs://")


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
