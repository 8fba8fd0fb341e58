"""Who retries and when (``storage.retry``), and the points a refit reports (``dcr_core.events``)."""

from __future__ import annotations

import errno
import http.client
import os
import time

import pytest

from dcr_core import events
from dcr_core.errors import IntegrityError, StepConflictError
from storage.retry import RetryPolicy, is_transient


class FakeClientError(Exception):
    """Shaped like botocore's ClientError: a ``response`` with the status and the service's code."""

    def __init__(self, status: int, code: str):
        super().__init__(f"An error occurred ({code})")
        self.response = {"ResponseMetadata": {"HTTPStatusCode": status}, "Error": {"Code": code}}


def translated(cause: BaseException) -> OSError:
    """What s3fs raises: an OSError whose ``__cause__`` is the botocore error."""
    err = OSError(errno.EIO, str(cause))
    err.__cause__ = cause
    return err


@pytest.mark.parametrize("exc", [
    translated(FakeClientError(500, "InternalError")),
    translated(FakeClientError(503, "SlowDown")),
    translated(FakeClientError(400, "RequestTimeout")),  # S3's own timeout code, sent with 400
    translated(FakeClientError(429, "TooManyRequests")),
    ConnectionResetError("reset by peer"),
    ConnectionRefusedError("refused"),
    TimeoutError("timed out"),
    TimeoutError("read timed out"),
    http.client.IncompleteRead(b"partial"),
], ids=lambda e: type(e).__name__ + ":" + str(getattr(e.__cause__, "response", {}).get("Error", {}).get("Code", "")))
def test_transient_failures_are_recognised_by_status_code_and_type(exc):
    assert is_transient(exc)


@pytest.mark.parametrize("exc", [
    translated(FakeClientError(404, "NoSuchKey")),
    translated(FakeClientError(403, "AccessDenied")),
    translated(FakeClientError(412, "PreconditionFailed")),
    FileNotFoundError("gone"),
    PermissionError("denied"),
    IntegrityError("chunk digest does not match"),
    StepConflictError("already committed"),
    ValueError("error 1504 in a message that mentions 50x and timeouts"),  # text alone decides nothing
    OSError(errno.EIO, "Internal error 500 somewhere in the text"),
])
def test_final_failures_are_not_retried(exc):
    assert not is_transient(exc)


def test_the_policy_retries_only_transient_failures_and_gives_up_after_its_attempts():
    calls = []

    def flaky():
        calls.append(1)
        raise translated(FakeClientError(503, "SlowDown"))

    retries = []
    with pytest.raises(OSError):
        RetryPolicy(attempts=4, base_delay=0.0).call(flaky, lambda n, e: retries.append(n))
    assert len(calls) == 4 and retries == [1, 2, 3]
    calls.clear()

    def final():
        calls.append(1)
        raise FileNotFoundError("gone")

    with pytest.raises(FileNotFoundError):
        RetryPolicy(attempts=4, base_delay=0.0).call(final)
    assert len(calls) == 1


def test_failpoints_parse_and_refuse_what_is_not_a_known_point_or_action():
    assert events.parse_failpoints("chunk.stored@3=pause, receive.staged=raise") == {
        ("chunk.stored", 3): "pause", ("receive.staged", 1): "raise",
    }
    assert events.parse_failpoints("receive.staged@*=sleep(0.25)") == {("receive.staged", events.EVERY): "sleep(0.25)"}
    for bad in ("nope=pause", "chunk.stored=explode", "chunk.stored", "chunk.stored@x=raise", "chunk.stored=sleep(S)",
                "chunk.stored=sleep(-1)", "chunk.stored=sleep(x)"):
        with pytest.raises(ValueError):
            events.parse_failpoints(bad)


def test_a_report_failpoint_says_the_point_was_reached_and_goes_on(capsys):
    with events.failpoints("follow.waiting@2=report"):
        events.reached("follow.waiting")
        events.reached("follow.waiting")  # said, and returned
        events.reached("follow.waiting")
    err = capsys.readouterr().err.splitlines()
    assert err == [f"dcr: failpoint follow.waiting@2 reached (pid {os.getpid()})"]


def test_a_raise_failpoint_fires_at_the_nth_reach_only_and_listeners_see_every_point():
    seen = []
    with events.listening(lambda p, f: seen.append((p, f.get("i")))), events.failpoints("chunk.stored@2=raise"):
        events.reached("chunk.stored", i=1)
        with pytest.raises(events.FailpointError):
            events.reached("chunk.stored", i=2)
        events.reached("chunk.stored", i=3)
    assert seen == [("chunk.stored", 1), ("chunk.stored", 2), ("chunk.stored", 3)]
    events.reached("chunk.stored")  # nothing active: nothing happens
    with events.failpoints("chunk.stored@*=sleep(0.05),chunk.stored@2=raise"):
        t = time.monotonic()
        events.reached("chunk.stored")
        assert time.monotonic() - t >= 0.05  # every reach sleeps...
        with pytest.raises(events.FailpointError):  # ...but an @N action wins at its N
            events.reached("chunk.stored")
    with pytest.raises(ValueError):
        with events.listening(lambda p, f: None):
            events.reached("not.a.point")
