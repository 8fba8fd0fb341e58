"""Handles of objects that live in this process, so steps can exchange references to them.

A trainer's tensors, a publisher's snapshot, a rank's shard bits, a live module and payloads
fetched for it cannot leave the process that holds them (copying a model through a task result
would defeat the point). Steps pass ``LocalRef`` instead: a small, serializable key that resolves
only in the process that registered the object, with an error naming the process otherwise.
Pipelines register what they pass for as long as they run (``holding``) and drop it afterwards.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from dcr_core.errors import UsageError

_objects: dict[str, object] = {}
_lock = threading.Lock()
_ids = itertools.count()


@dataclass(frozen=True)
class LocalRef:
    key: str
    kind: str  # what the object is, for messages ("tensors", "snapshot", "module", ...)
    pid: int


def put(obj: object, kind: str) -> LocalRef:
    ref = LocalRef(f"{kind}-{os.getpid()}-{next(_ids)}", kind, os.getpid())
    with _lock:
        _objects[ref.key] = obj
    return ref


def get(ref: LocalRef) -> object:
    with _lock:
        obj = _objects.get(ref.key)
    if obj is None:
        where = "another process" if ref.pid != os.getpid() else "this process (released)"
        raise UsageError(
            f"{ref.kind} {ref.key} lives in {where}: in-memory sources, shards and live modules are "
            "refitted by steps that run in the process holding them"
        )
    return obj


def release(ref: LocalRef | None) -> None:
    if ref is not None:
        with _lock:
            _objects.pop(ref.key, None)


@contextmanager
def holding(obj: object, kind: str) -> Iterator[LocalRef]:
    ref = put(obj, kind)
    try:
        yield ref
    finally:
        release(ref)


def live_count() -> int:
    """Objects registered now (tests check that pipelines release what they registered)."""
    with _lock:
        return len(_objects)
