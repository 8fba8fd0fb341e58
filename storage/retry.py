"""Retries of transient object-store failures: one owner per backend, deciding on status codes
and exception types.

Who retries what (nothing else in the stack retries a request, so attempts never multiply):

| backend | owner | how |
|---|---|---|
| local, memory | nobody | file system errors are not transient |
| S3 (s3fs) | this module, through ``Root`` | s3fs (``retries=1``) and botocore (``total_max_attempts=1``) are told not to retry; botocore's standard mode, measured in its place, does not retry a GET body cut short while it is read and its retry quota stops retrying under a burst of throttling (``docs/benchmarks.md``, "Retries: why DCR owns them (measured)") |
| GCS (gcsfs) | gcsfs's ``retry_request`` | it retries 408/429/5xx and connection errors itself (fixed at import by gcsfs: it cannot be turned off per filesystem), so ``Root`` does not |
| Azure (adlfs) | the Azure SDK's storage retry policy | azure-core's pipeline inside adlfs retries connection errors, 408 and 5xx with exponential backoff, and its downloader reads a body cut short again; adlfs passes no retry settings to the SDK's clients, so it cannot hand them to ``Root``, which does not retry |

Prefect tasks do not retry either: a failed task fails its flow run, and rerunning the flow is
safe (every write path is idempotent or goes to a fresh attempt).

Transient: HTTP 408, 429 and 5xx (except 501), the throttling and timeout error codes of S3, and
connection-level failures (refused, reset, closed, timed out, a body cut short). Final: anything
else, DCR's own errors above all. Types are matched by their qualified names along the exception's
class hierarchy and its ``__cause__``/``__context__`` chain, so neither botocore nor aiohttp is
imported to classify.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from dcr_core.errors import DCRError

T = TypeVar("T")

TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "RequestLimitExceeded",
    "TooManyRequestsException", "ProvisionedThroughputExceededException", "BandwidthLimitExceeded",
    "RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete", "InternalError",
    "ServiceUnavailable",
})
TRANSIENT_TYPES = frozenset({
    "builtins.ConnectionError",  # refused, reset, aborted, broken pipe
    "builtins.TimeoutError",
    "asyncio.exceptions.TimeoutError",
    "http.client.IncompleteRead",
    "http.client.RemoteDisconnected",
    "botocore.exceptions.ConnectionError",  # EndpointConnectionError, ConnectionClosedError, ...
    "botocore.exceptions.HTTPClientError",  # ReadTimeoutError, ConnectTimeoutError
    "botocore.exceptions.ResponseStreamingError",
    "botocore.exceptions.IncompleteReadError",
    "aiohttp.client_exceptions.ClientConnectionError",  # ServerDisconnectedError, ClientOSError, ...
    "aiohttp.client_exceptions.ClientPayloadError",  # a body cut off half way
    "fsspec.exceptions.FSTimeoutError",
    "urllib3.exceptions.ProtocolError",
    "requests.exceptions.ConnectionError",
    "requests.exceptions.Timeout",
    "azure.core.exceptions.ServiceRequestError",  # the request never reached the service
    "azure.core.exceptions.ServiceResponseError",  # the connection broke before a whole answer
})


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _type_names(e: BaseException) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(e).__mro__}


def _status_and_code(e: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and the service's error code carried by ``e``, where it carries them:
    botocore's ``ClientError.response``, gcsfs's ``HttpError.code``, aiohttp's ``.status``, the
    Azure SDK's ``HttpResponseError.status_code`` and ``.error_code``."""
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        code = (response.get("Error") or {}).get("Code")
        return (status if isinstance(status, int) else None), (str(code) if code is not None else None)
    status_code = getattr(e, "status_code", None)
    if isinstance(status_code, int) and 100 <= status_code <= 599:
        code = getattr(e, "error_code", None)
        code = getattr(code, "value", code)  # the SDK's StorageErrorCode enum, or its string
        return status_code, (str(code) if code else None)
    for attr in ("status", "code"):
        v = getattr(e, attr, None)
        if isinstance(v, int) and 100 <= v <= 599:
            return v, None
    return None, None


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the same request may succeed (see the module docstring)."""
    for e in _chain(exc):
        if isinstance(e, DCRError):
            return False
        status, code = _status_and_code(e)
        if code in TRANSIENT_CODES or status in TRANSIENT_STATUS:
            return True
        if status is not None and status < 500:
            return False  # a definite client-side answer (404, 403, 412, ...)
        if _type_names(e) & TRANSIENT_TYPES:
            return True
    return False


class RetryPolicy:
    """Exponential backoff with jitter over ``attempts`` tries (1: no retry)."""

    def __init__(self, attempts: int = 5, base_delay: float = 0.1, max_delay: float = 5.0):
        self.attempts = max(1, attempts)
        self.base_delay = base_delay
        self.max_delay = max_delay

    def call(self, fn: Callable[[], T], on_retry: Callable[[int, BaseException], None] | None = None) -> T:
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except Exception as e:
                if attempt == self.attempts or not is_transient(e):
                    raise
                if on_retry:
                    on_retry(attempt, e)
                delay = min(self.max_delay, self.base_delay * 2 ** (attempt - 1))
                time.sleep(delay * (0.5 + random.random() / 2))
        raise AssertionError("unreachable")


NO_RETRY = RetryPolicy(attempts=1)

# For the modules that explain a final failure (``storage.access``): the same view of an exception.
chain, type_names, status_and_code = _chain, _type_names, _status_and_code
