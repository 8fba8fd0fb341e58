"""The registry of storage backends: URL scheme -> backend class (``storage.backends``), and what
is asked of it by URL: which backend serves a ROOT, how to open it, how to spell it."""

from __future__ import annotations

import fsspec

from dcr_core.errors import DCRError, UsageError
from storage.backends.azure import AzureBackend
from storage.backends.base import Backend, OtherBackend
from storage.backends.gcs import GcsBackend
from storage.backends.local import LocalBackend
from storage.backends.memory import MemoryBackend
from storage.backends.s3 import S3Backend

BACKENDS: tuple[type[Backend], ...] = (LocalBackend, MemoryBackend, S3Backend, GcsBackend, AzureBackend)

_BY_SCHEME: dict[str, type[Backend]] = {scheme: b for b in BACKENDS for scheme in b.schemes}


def backend_class(url: str) -> type[Backend]:
    """The backend that serves ROOT ``url`` (a local path is a ``file`` URL; a scheme no backend
    registers is read through fsspec as it is: ``OtherBackend``)."""
    return _BY_SCHEME.get(fsspec.utils.get_protocol(url).lower(), OtherBackend)


def open_backend(url: str, storage_options: dict) -> Backend:
    """Open ROOT ``url`` with DCR's defaults for its backend (``storage_options`` win)."""
    try:
        return backend_class(url).open(url, dict(storage_options))
    except DCRError:
        raise
    except (ImportError, ValueError, TypeError) as e:  # a missing client package, options it refuses
        raise UsageError(f"cannot open ROOT {url!r}: {e}") from None


def canonical_url(url: str) -> str:
    """One spelling for every spelling of the same place: ``./bucket``, ``bucket/`` and
    ``file:///abs/bucket`` alike; ``s3a://`` as ``s3://``, ``gcs://`` as ``gs://``, ``abfs://`` as
    ``az://``."""
    return backend_class(url).canonical_url(url)


def schemes() -> tuple[str, ...]:
    """Every registered URL scheme."""
    return tuple(_BY_SCHEME)


def forms(publishable: bool = False) -> str:
    """How ROOTs are written, for messages (``publishable``: only the backends a publisher can
    commit to, the ones with an atomic create-if-absent)."""
    found = [b.form for b in BACKENDS if b.supports_conditional_create or not publishable]
    return ", ".join(found[:-1]) + " or " + found[-1]
