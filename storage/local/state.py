"""A receiver's state file: a safetensors checkpoint whose metadata says which step it holds.

Metadata keys: ``dcr.step`` (the step), ``dcr.policy_digest`` (that step's policy digest) and
``dcr.root`` (the ROOT it came from). States written by DCR keep ``HEADER_ROOM`` spare header
bytes, so an in-place refit can rewrite the metadata without moving any tensor.

One writer at a time: ``exclusive(path)`` holds ``.<name>.lock`` beside the file while it writes
(``flock``: a killed holder's lock dies with it; the file is removed when the lock is let go) and
removes temp files a killed writer left. Locks and journals
are keyed by the file's real path, so two paths to one file share them. Readers outside DCR that
must never see a half-patched file read inside ``consistent_state(path)``.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import time
from collections.abc import Iterator

from dcr_core.errors import BusyError, InvalidCheckpointError, StateMismatchError, UsageError
from storage import layout
from storage.local import journal, output_record
from storage.local.safetensors import SafetensorsCheckpoint

STEP = "dcr.step"
POLICY = "dcr.policy_digest"
ROOT = "dcr.root"
HEADER_ROOM = 64  # header bytes kept free so an in-place patch can rewrite the metadata


def metadata(step: int, policy_digest: str, root_url: str | None = None) -> dict[str, str]:
    """The metadata of a state (or baseline) file holding ``step``. A local ROOT is recorded as an
    absolute path, so the file names the same ROOT whichever directory reads it."""
    meta = {STEP: str(step), POLICY: policy_digest}
    if root_url is not None:
        meta[ROOT] = absolute_root(root_url)
    return meta


def absolute_root(url: str) -> str:
    """``url`` with a local path made absolute (``./bucket`` -> ``/home/me/bucket``); URLs unchanged."""
    if "://" in url or "::" in url:
        return url
    return os.path.abspath(url)


def claims(path: str, meta: dict[str, str]) -> dict[str, str]:
    """What the file ``path`` with header metadata ``meta`` says it holds: its ``dcr.*`` metadata; for
    a file ``dcr materialize`` wrote byte for byte (no ``dcr.step`` in it), what its record beside it
    says while the record vouches for the file (``storage.local.output_record``)."""
    if STEP in meta:
        return meta
    record = output_record.vouched_file(path)
    if record is None:
        return meta
    out = {STEP: str(record["step"])}
    for key, field in ((POLICY, "policy_digest"), (ROOT, "root")):
        if isinstance(record.get(field), str):
            out[key] = record[field]
    return out


def claimed_step(meta: dict[str, str], path: str) -> int:
    """The step a state file's metadata claims (an error if it claims none)."""
    raw = meta.get(STEP)
    if raw is None or not (raw.isascii() and raw.isdigit()):
        raise StateMismatchError(f"{path}: not a DCR receiver state (no {STEP} metadata); move it away")
    if int(raw) > layout.MAX_STEP:
        raise StateMismatchError(f"{path}: claims step {raw}, beyond any valid step")
    return int(raw)


def peek_step(path: str) -> int | None:
    """The step a receiver's state file holds (header only), or None if the file does not exist.
    With an in-place patch pending, the step it settles at (``journal.settle``)."""
    if not os.path.exists(path):
        return None
    pending = journal.pending_step(path)
    if pending is not None:
        return pending
    with SafetensorsCheckpoint(path) as ck:
        return claimed_step(claims(path, ck.metadata), path)


def peek_origin(path: str) -> tuple[int, str | None, str | None] | None:
    """(step, policy digest, ROOT URL) a state file's metadata records, or None when the file does not
    exist or an in-place patch is pending (settling it decides what it holds)."""
    if not os.path.exists(path) or journal.pending_step(path) is not None:
        return None
    with SafetensorsCheckpoint(path) as ck:
        meta = claims(path, ck.metadata)
    return claimed_step(meta, path), meta.get(POLICY), meta.get(ROOT)


def written_by_dcr(path: str) -> bool:
    """Whether the existing file ``path`` is a DCR state or materialization (a safetensors file whose
    metadata, or record, names the step it holds): what ``dcr materialize`` may replace without
    ``--force``."""
    try:
        with SafetensorsCheckpoint(path) as ck:
            claimed_step(claims(path, ck.metadata), path)
    except (InvalidCheckpointError, StateMismatchError, OSError):
        return False
    return True


def check_path(path: str | os.PathLike) -> str:
    """The file a state (or ``dcr materialize --out``) path names. A symbolic link names its target:
    the target is refitted, rewritten or patched alike, and the link is kept. Anything but a regular
    file (a directory, a FIFO, a device such as ``/dev/null``) is refused."""
    given = os.fspath(path)
    real = os.path.realpath(given)
    if os.path.exists(real) and not os.path.isfile(real):
        raise InvalidCheckpointError(f"{given}: not a regular file (a directory, FIFO or device); a receiver state "
                                     "or materialize output must be a .safetensors file")
    directory = os.path.dirname(real)
    if not os.path.isdir(directory):
        raise UsageError(f"{given}: directory {directory} does not exist; create it first (dcr writes state files "
                         "and materializations into existing directories only)")
    return real


@contextlib.contextmanager
def exclusive(path: str | os.PathLike, wait: bool = True, timeout: float | None = None) -> Iterator[None]:
    """Hold the lock of the file at ``path`` (``.<name>.lock`` beside it, there only while held) for
    one writer at a time, and remove temp files that a writer of ``path`` killed earlier
    (``kill -9``) left behind. The file's directory must exist.

    The lock is advisory (``flock``) and dies with its process, so a killed writer never blocks the
    next one; waiting writers queue. The holder removes the lock file as it lets go, so nothing is
    left beside a user's file: a waiter that then gets the lock of the removed file sees that the
    name no longer leads to it and takes the lock again (the lock file of a writer killed while
    holding it stays until the next writer, which reuses and removes it). ``wait=False``: raise
    ``BlockingIOError`` at once if another holds it; ``timeout``: wait at most that many seconds,
    then raise ``BusyError`` naming the file (``flock`` has no timed wait: the lock is tried every
    few milliseconds, up to 50 ms apart).
    """
    path = os.path.realpath(os.fspath(path))  # one lock per file, whatever path names it
    directory, name = os.path.split(path)
    lock_path = os.path.join(directory, f".{name}.lock")
    deadline = None if timeout is None or not wait else time.monotonic() + max(0.0, timeout)
    while True:
        lock = open(lock_path, "a+b")
        try:
            _flock(lock, wait, deadline)
        except BlockingIOError:
            lock.close()
            if deadline is None:
                raise
            raise BusyError(f"{path}: held by another writer (a receive, a materialize or a fleet switch); "
                            f"it did not come free in {timeout:g} s") from None
        except BaseException:
            lock.close()
            raise
        try:
            if os.fstat(lock.fileno()).st_ino == os.stat(lock_path).st_ino:
                break  # the lock file the name leads to now: held
        except FileNotFoundError:
            pass  # removed by the holder before us
        lock.close()
    with lock:
        try:
            for leftover in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(name)}.tmp-*")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path)  # while held: a waiter on this file retries on the new one
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _flock(lock, wait: bool, deadline: float | None) -> None:
    """Take the lock on ``lock``'s file: at once (``wait=False``), as long as it takes, or until
    ``deadline`` (``BlockingIOError`` then)."""
    if deadline is None:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        return
    pause = 0.002
    while True:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)


@contextlib.contextmanager
def consistent_state(path: str) -> Iterator[str]:
    """Hold the lock of the state file at ``path`` and settle an in-place patch first (a cut-off one
    rolled back, a committed one rolled forward and fsynced), so a reader inside sees exactly one
    step (receives wait meanwhile)::

        with consistent_state(path):
            weights = safetensors.torch.load_file(path)
    """
    with exclusive(path):
        journal.settle(path)
        yield path
