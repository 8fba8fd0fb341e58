"""``s3://bucket/prefix`` (also ``s3a://``): AWS S3 and S3-compatible servers, through s3fs.

Endpoint: ``--storage-option endpoint_url``, else ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``,
else AWS S3 in ``AWS_DEFAULT_REGION``; credentials the standard AWS way (botocore's chain).

Create-if-absent: ``PutObject`` with ``If-None-Match: *`` (s3fs's ``mode="create"``); the server
refuses (412) if the key exists. Atomic on AWS S3 and on servers that honour the header (moto 5
does).

Retries: DCR's ``RetryPolicy`` (``storage.retry``); s3fs and botocore are told not to retry, so
attempts never multiply.
"""

from __future__ import annotations

import os

import fsspec

from storage import access
from storage.access import Endpoint
from storage.backends.base import Backend
from storage.retry import RetryPolicy

DEFAULT_POOL = 32  # connections per S3 filesystem: DCR moves many chunks in parallel (botocore: 10)


class S3Backend(Backend):
    schemes = ("s3", "s3a")
    form = "s3://bucket/prefix"
    supports_conditional_create = True
    credential_errors = frozenset({"botocore.exceptions.NoCredentialsError", "botocore.exceptions.PartialCredentialsError"})
    credentials_hint = "no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
    missing_bucket_codes = frozenset({"NoSuchBucket"})
    missing_bucket_message = "The specified bucket does not exist"  # s3fs's message for NoSuchBucket
    denied_codes = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
                              "ExpiredToken"})
    endpoint_hint = "is the server running? (infra/start-s3.sh starts one here)"
    default_endpoint_hint = "check the network, or set AWS_ENDPOINT_URL for an S3-compatible server"
    server_hint = "infra/start-s3.sh creates one on a local server"

    @classmethod
    def open(cls, url: str, storage_options: dict) -> Backend:
        opts = dict(storage_options)
        endpoint = s3_endpoint(opts)
        access.probe(url, endpoint, cls.default_endpoint_hint if endpoint.default else cls.endpoint_hint)
        cfg = dict(opts.get("config_kwargs") or {})
        cfg.setdefault("max_pool_connections", DEFAULT_POOL)
        cfg.setdefault("retries", {"total_max_attempts": 1})  # DCR owns S3 retries
        opts["config_kwargs"] = cfg
        opts.setdefault("max_concurrency", 1)  # one GET per object; >1 HEADs first to split it
        fs, path = fsspec.url_to_fs(url, **opts)
        fs.retries = 1  # s3fs's own retry loop (an attribute, not a constructor option)
        return cls(fsspec.utils.get_protocol(url), fs, path, RetryPolicy(), endpoint)

    def create_if_absent(self, path: str, data: bytes) -> bool:
        return self.create_by_condition(path, data)

    def bucket_exists(self, bucket: str, prefix: str) -> bool | None:
        try:
            self.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1)
        except FileNotFoundError as e:  # s3fs: NoSuchBucket, or another 404
            return False if self.is_missing_bucket(access.messages(e), access.statuses_and_codes(e)[1]) else None
        except Exception:  # noqa: BLE001 - no verdict: the caller's own (empty) result stands
            return None
        return True


def s3_endpoint(storage_options: dict) -> Endpoint:
    given = storage_options.get("endpoint_url") or (storage_options.get("client_kwargs") or {}).get("endpoint_url")
    if given:
        return Endpoint(str(given), "--storage-option endpoint_url")
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(var):
            return Endpoint(os.environ[var], var)
    region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION")
    host = f"s3.{region}.amazonaws.com" if region else "s3.amazonaws.com"
    return Endpoint(f"https://{host}", "AWS S3: no AWS_ENDPOINT_URL set", default=True)
