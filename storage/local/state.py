"""A receiver's state file: a safetensors checkpoint whose metadata says which step it holds.

Metadata keys: ``dcr.step`` (the step), ``dcr.policy_digest`` (that step's policy digest) and
``dcr.root`` (the ROOT it came from). States written by DCR keep ``HEADER_ROOM`` spare header
bytes, so an in-place refit can rewrite the metadata without moving any tensor.

One writer at a time: ``exclusive(path)`` holds ``.<name>.lock`` beside the file (``flock``: a
killed holder's lock dies with it) and removes temp files a killed writer left. Locks and journals
are keyed by the file's real path, so two paths to one file share them. Readers outside DCR that
must never see a half-patched file read inside ``consistent_state(path)``.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
from collections.abc import Iterator

from dcr_core.errors import InvalidCheckpointError, StateMismatchError
from storage import layout
from storage.local import journal
from storage.local.safetensors import SafetensorsCheckpoint

STEP = "dcr.step"
POLICY = "dcr.policy_digest"
ROOT = "dcr.root"
HEADER_ROOM = 64  # header bytes kept free so an in-place patch can rewrite the metadata


def metadata(step: int, policy_digest: str, root_url: str | None = None) -> dict[str, str]:
    """The metadata of a state (or baseline) file holding ``step``."""
    meta = {STEP: str(step), POLICY: policy_digest}
    if root_url is not None:
        meta[ROOT] = root_url
    return meta


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
        return claimed_step(ck.metadata, path)


def peek_origin(path: str) -> tuple[int, str | None, str | None] | None:
    """(step, policy digest, ROOT URL) a state file's metadata records, or None when the file does not
    exist or an in-place patch is pending (settling it decides what it holds)."""
    if not os.path.exists(path) or journal.pending_step(path) is not None:
        return None
    with SafetensorsCheckpoint(path) as ck:
        return claimed_step(ck.metadata, path), ck.metadata.get(POLICY), ck.metadata.get(ROOT)


def check_path(path: str | os.PathLike) -> str:
    """The file a state (or ``dcr materialize --out``) path names. A symbolic link names its target:
    the target is refitted, rewritten or patched alike, and the link is kept. Anything but a regular
    file (a directory, a FIFO, a device such as ``/dev/null``) is refused."""
    given = os.fspath(path)
    real = os.path.realpath(given)
    if os.path.exists(real) and not os.path.isfile(real):
        raise InvalidCheckpointError(f"{given}: not a regular file (a directory, FIFO or device); a receiver state "
                                     "or materialize output must be a .safetensors file")
    return real


@contextlib.contextmanager
def exclusive(path: str | os.PathLike) -> Iterator[None]:
    """Hold the lock of the file at ``path`` (``.<name>.lock`` beside it) for one writer at a time,
    and remove temp files that a writer of ``path`` killed earlier (``kill -9``) left behind.

    The lock is advisory (``flock``) and dies with its process, so a killed writer never blocks the
    next one; waiting writers queue.
    """
    path = os.path.realpath(os.fspath(path))  # one lock per file, whatever path names it
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f".{name}.lock"), "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            for leftover in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(name)}.tmp-*")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


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
