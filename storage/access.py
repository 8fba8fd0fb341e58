"""Reaching a cloud ROOT, and saying what to set when it cannot be used.

Two things, both about the store behind ROOT rather than the data in it:

- ``probe(endpoint)``: when a cloud ROOT is first opened in a process, one TCP connection to an
  endpoint the user set (3 s at most), or a name lookup of the cloud's own endpoint. An emulator
  that is not running or a host that does not resolve then fails the command in about a second,
  instead of after the client's own retry loop (gcsfs retries a refused connection six times over
  half a minute). Skipped when a proxy is configured: the proxy decides then.
- reading a backend's exception, once retries are over (``storage.backends.base.Backend.explain``
  turns it into a one-line DCR error that names the ROOT, the bucket or endpoint, and the setting to
  fix: no credentials, a bucket that does not exist, access denied, an endpoint that does not
  answer). Exit codes stay the documented ones: configuration a user must fix is 2 (bad input),
  anything else 1.

Nothing here imports boto, gcsfs, the Azure SDK or aiohttp: exceptions are matched by qualified type
names and the status and code they carry (``storage.retry``).
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


def type_names(exc: BaseException) -> set[str]:
    """The qualified type names along ``exc``'s chain (its classes' hierarchies included)."""
    return {n for e in retry.chain(exc) for n in retry.type_names(e)}


def statuses_and_codes(exc: BaseException) -> tuple[set[int], set[str]]:
    """The HTTP statuses and the service error codes along ``exc``'s chain."""
    statuses, codes = set(), set()
    for e in retry.chain(exc):
        status, code = retry.status_and_code(e)
        if status is not None:
            statuses.add(status)
        if code is not None:
            codes.add(code)
    return statuses, codes


def messages(exc: BaseException) -> list[str]:
    return [str(e) for e in retry.chain(exc)]


def bucket_of(path: str) -> str:
    return path.lstrip("/").split("/", 1)[0]


def denied(root_url: str, endpoint: Endpoint, exc: BaseException, denied_codes: frozenset[str]) -> StoreUnreachableError | None:
    """``exc`` as access denied (a 401 or 403, or one of the service's ``denied_codes``), else None."""
    statuses, codes = statuses_and_codes(exc)
    forbidden = str(exc).startswith("Forbidden:")  # gcsfs's 403, as an OSError whose message starts so
    if not (codes & denied_codes or 403 in statuses or 401 in statuses or "builtins.PermissionError" in type_names(exc)
            or forbidden):
        return None
    code = sorted(codes & denied_codes)[0] if codes & denied_codes else "access denied"
    return StoreUnreachableError(f"{root_url}: {code} at {endpoint}; check the credentials and that they grant what "
                                 "docs/guides/operations.md, \"Permissions\", lists for this role")


def unreachable(root_url: str, endpoint: Endpoint, exc: BaseException) -> StoreUnreachableError | None:
    """``exc`` as an endpoint that does not answer (connection level, the retries spent), else None."""
    if not (retry.is_transient(exc) and type_names(exc) & retry.TRANSIENT_TYPES):
        return None
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return StoreUnreachableError(f"{root_url}: cannot reach {endpoint}: {first[:200]}")
