"""Reaching a cloud ROOT, and saying what to set when it cannot be used.

Two things, both about the store behind ROOT rather than the data in it:

- ``probe(endpoint)``: when a cloud ROOT is first opened in a process, one TCP connection to an
  endpoint the user set (3 s at most), or a name lookup of the cloud's own endpoint. An emulator
  that is not running or a host that does not resolve then fails the command in about a second,
  instead of after the client's own retry loop (gcsfs retries a refused connection six times over
  half a minute). Skipped when a proxy is configured: the proxy decides then.
- ``explain(...)``: the backend's exception, once retries are over, as a one-line DCR error that
  names the ROOT, the bucket or endpoint, and the setting to fix: no credentials, a bucket that
  does not exist, access denied, an endpoint that does not answer. Exit codes stay the documented
  ones: configuration a user must fix is 2 (bad input), anything else 1.

Nothing here imports boto, gcsfs or aiohttp: exceptions are matched by qualified type names and the
status and code they carry (``storage.retry``).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from dcr_core.errors import DCRError, UsageError
from storage import retry

PROBE_TIMEOUT = 3.0
_PROXIES = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy")


class StoreConfigError(UsageError):
    """The store behind ROOT is not set up for this call: no credentials, no such bucket."""


class StoreUnreachableError(DCRError):
    """The store's endpoint does not answer, or refuses this caller's access."""


@dataclass(frozen=True)
class Endpoint:
    url: str  # where requests go, e.g. http://127.0.0.1:9000 or https://storage.googleapis.com
    setting: str  # how the user chose it: "AWS_ENDPOINT_URL", "--storage-option endpoint_url", or the default
    default: bool = False  # the cloud's own endpoint, nothing set

    @property
    def host_port(self) -> tuple[str, int]:
        u = urlsplit(self.url if "://" in self.url else f"http://{self.url}")
        return u.hostname or "", u.port or (443 if u.scheme == "https" else 80)

    def __str__(self) -> str:
        return f"{self.url} ({self.setting})"


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


def gcs_endpoint(storage_options: dict) -> Endpoint:
    if storage_options.get("endpoint_url"):
        return Endpoint(str(storage_options["endpoint_url"]), "--storage-option endpoint_url")
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return Endpoint(os.environ["STORAGE_EMULATOR_HOST"], "STORAGE_EMULATOR_HOST")
    return Endpoint("https://storage.googleapis.com", "Google Cloud Storage: no STORAGE_EMULATOR_HOST set", default=True)


_REACHED: set[tuple[str, int]] = set()
_LOCK = threading.Lock()


def probe(root_url: str, endpoint: Endpoint, hint: str) -> None:
    """Fail fast (``StoreUnreachableError``) if ``endpoint`` cannot answer: an endpoint the user set
    (an emulator, an S3-compatible server) must take a TCP connection; the cloud's own endpoint
    must resolve (a host that has no address cannot work; whether it is routable is the client's
    business: VPC endpoints, regions from ~/.aws/config). Once per endpoint and process when it
    answers; every time while it does not."""
    if any(os.environ.get(p) for p in _PROXIES):
        return
    target = endpoint.host_port
    with _LOCK:
        if target in _REACHED:
            return
    t0 = time.monotonic()
    try:
        if endpoint.default:
            socket.getaddrinfo(target[0], target[1], type=socket.SOCK_STREAM)
        else:
            socket.create_connection(target, timeout=PROBE_TIMEOUT).close()
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e) or type(e).__name__)
        raise StoreUnreachableError(
            f"{root_url}: cannot reach {endpoint}: {why} after {time.monotonic() - t0:.1f} s; {hint}"
        ) from None
    with _LOCK:
        _REACHED.add(target)


def _names(exc: BaseException) -> set[str]:
    return {n for e in retry.chain(exc) for n in retry.type_names(e)}


def _codes(exc: BaseException) -> tuple[set[int], set[str]]:
    statuses, codes = set(), set()
    for e in retry.chain(exc):
        status, code = retry.status_and_code(e)
        if status is not None:
            statuses.add(status)
        if code is not None:
            codes.add(code)
    return statuses, codes


def _no_such_bucket(exc: BaseException, codes: set[str]) -> bool:
    """S3's NoSuchBucket (by its error code, or s3fs's message for it); never a path that happens to
    contain the words."""
    return "NoSuchBucket" in codes or any(str(e).startswith("The specified bucket does not exist")
                                          for e in retry.chain(exc))


def bucket_of(path: str) -> str:
    return path.lstrip("/").split("/", 1)[0]


def explain(root_url: str, protocol: str, path: str, endpoint: Endpoint | None, exc: BaseException) -> DCRError | None:
    """``exc`` (raised by a cloud backend) as a DCR error saying what to set, or None when it is
    not about reaching or using the store (the caller re-raises it as it is)."""
    if isinstance(exc, DCRError) or endpoint is None:
        return None
    names, (statuses, codes) = _names(exc), _codes(exc)
    bucket = bucket_of(path)
    if isinstance(exc, FileNotFoundError) and not _no_such_bucket(exc, codes):
        return None  # a missing object: callers decide what that means (no marker yet, ...)
    s3 = protocol in ("s3", "s3a")
    if names & {"botocore.exceptions.NoCredentialsError", "botocore.exceptions.PartialCredentialsError"}:
        return StoreConfigError(
            f"{root_url}: no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
            f" for {endpoint}")
    if "google.auth.exceptions.DefaultCredentialsError" in names or (
            not s3 and "google.auth.exceptions.GoogleAuthError" in names):
        return StoreConfigError(
            f"{root_url}: no usable Google credentials; set GOOGLE_APPLICATION_CREDENTIALS to a service account key "
            "file (or run `gcloud auth application-default login`), or STORAGE_EMULATOR_HOST for an emulator")
    if _no_such_bucket(exc, codes):
        return StoreConfigError(
            f"{root_url}: bucket {bucket!r} does not exist at {endpoint}; create it (infra/start-s3.sh and "
            "infra/start-gcs.sh create one for local servers) or fix ROOT")
    denied = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled", "ExpiredToken"}
    forbidden = str(exc).startswith("Forbidden:")  # gcsfs's 403, as an OSError whose message starts so
    if codes & denied or 403 in statuses or 401 in statuses or "builtins.PermissionError" in names or forbidden:
        code = sorted(codes & denied)[0] if codes & denied else "access denied"
        return StoreUnreachableError(
            f"{root_url}: {code} at {endpoint}; check the credentials and that they grant what "
            "docs/guides/operations.md, \"Permissions\", lists for this role")
    if retry.is_transient(exc) and names & retry.TRANSIENT_TYPES:  # connection level, retries spent
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return StoreUnreachableError(f"{root_url}: cannot reach {endpoint}: {first[:200]}")
    return None


def check_bucket(root_url: str, fs, protocol: str, path: str, endpoint: Endpoint) -> None:
    """Called when a listing under ROOT came back empty (fsspec lists a missing bucket as empty): one
    object listing of at most one key under ``path``, the permission every reader has. A bucket that
    does not exist is a ``StoreConfigError``; any other answer (the bucket is there, or the check
    itself fails) leaves the empty listing as it is: nothing is claimed that was not seen."""
    bucket, _, key = path.lstrip("/").partition("/")
    prefix = key.rstrip("/") + "/" if key else ""
    try:
        if protocol in ("s3", "s3a"):
            fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1)
        else:
            fs.call("GET", "b/{}/o", bucket, prefix=prefix, maxResults=1, json_out=True)
    except FileNotFoundError as e:  # s3fs: NoSuchBucket; gcsfs: 404 on the bucket's object list
        if protocol in ("s3", "s3a") and not _no_such_bucket(e, _codes(e)[1]):
            return
        raise StoreConfigError(
            f"{root_url}: bucket {bucket!r} does not exist at {endpoint}; create it (infra/start-s3.sh and "
            "infra/start-gcs.sh create one for local servers) or fix ROOT") from None
    except Exception:  # noqa: BLE001 - no verdict: the listing's own (empty) result stands
        return
