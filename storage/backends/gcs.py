"""``gs://bucket/prefix`` (also ``gcs://``): Google Cloud Storage, through gcsfs.

Endpoint: ``--storage-option endpoint_url``, else ``STORAGE_EMULATOR_HOST`` (an emulator: no
credentials asked for), else Google's; credentials the standard Google way.

Create-if-absent: an upload with ``ifGenerationMatch=0`` (gcsfs's ``mode="create"``). Atomic on
real GCS; the GCS emulator ignores the precondition, so there it degrades to check-then-write: two
publishers racing within the same few milliseconds could both "win" (docs/reference/backends.md).

Retries: gcsfs's ``retry_request`` (408/429/5xx and connection errors), fixed at import by gcsfs and
not to be turned off per filesystem, so ``Root`` does not retry.

Emulator quirk worked around: the emulator's multipart parser drops a trailing carriage return, so
an object ending in ``b"\\r"`` goes through a one-chunk resumable upload instead, which real GCS and
the emulator both store exactly (DCR's digests caught it).
"""

from __future__ import annotations

import os

import fsspec

from storage import access
from storage.access import Endpoint
from storage.backends.base import Backend


class GcsBackend(Backend):
    schemes = ("gs", "gcs")
    form = "gs://bucket/prefix"
    supports_conditional_create = True
    credential_errors = frozenset({"google.auth.exceptions.DefaultCredentialsError", "google.auth.exceptions.GoogleAuthError"})
    credentials_hint = ("no usable Google credentials; set GOOGLE_APPLICATION_CREDENTIALS to a service account key "
                        "file (or run `gcloud auth application-default login`), or STORAGE_EMULATOR_HOST for an emulator")
    endpoint_hint = "is the server running? (infra/start-gcs.sh starts an emulator here)"
    default_endpoint_hint = "check the network, or set STORAGE_EMULATOR_HOST for an emulator"
    server_hint = "infra/start-gcs.sh creates one in a local emulator"

    @classmethod
    def open(cls, url: str, storage_options: dict) -> Backend:
        """gcsfs's core filesystem class: the package default (``ExtendedGcsFileSystem`` unless
        ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``) probes a gRPC endpoint on every call, seconds each."""
        from gcsfs.core import GCSFileSystem  # noqa: PLC0415 - optional heavy dependency: only GCS ROOTs need it

        opts = dict(storage_options)
        endpoint = gcs_endpoint(opts)
        access.probe(url, endpoint, cls.default_endpoint_hint if endpoint.default else cls.endpoint_hint)
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            opts.setdefault("token", "anon")
        fs = GCSFileSystem(**opts)
        return cls(fsspec.utils.get_protocol(url), fs, fs._strip_protocol(url), endpoint=endpoint)

    def write(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data, **_upload_kwargs(data))

    def create_if_absent(self, path: str, data: bytes) -> bool:
        # gcsfs sends ifGenerationMatch=0 for mode="create" and raises FileExistsError on 412. The
        # existence check first narrows the window on servers that ignore the precondition (the
        # emulator); on real GCS the conditional upload alone is atomic.
        if self.fs.exists(path):
            return False
        try:
            self.fs.pipe_file(path, data, mode="create", **_upload_kwargs(data))
        except FileExistsError:
            return False
        return True

    def bucket_exists(self, bucket: str, prefix: str) -> bool | None:
        try:
            self.fs.call("GET", "b/{}/o", bucket, prefix=prefix, maxResults=1, json_out=True)
        except FileNotFoundError:  # gcsfs: 404 on the bucket's object list
            return False
        except Exception:  # noqa: BLE001 - no verdict: the caller's own (empty) result stands
            return None
        return True


def _upload_kwargs(data: bytes) -> dict:
    """Upload options that keep objects intact on every server (the emulator quirk above)."""
    return {"chunksize": len(data)} if data.endswith(b"\r") else {}


def gcs_endpoint(storage_options: dict) -> Endpoint:
    if storage_options.get("endpoint_url"):
        return Endpoint(str(storage_options["endpoint_url"]), "--storage-option endpoint_url")
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return Endpoint(os.environ["STORAGE_EMULATOR_HOST"], "STORAGE_EMULATOR_HOST")
    return Endpoint("https://storage.googleapis.com", "Google Cloud Storage: no STORAGE_EMULATOR_HOST set", default=True)
