"""Publisher sources: what the publisher reads the new policy from, as raw bits by tensor name.

- a path: a ``.safetensors`` file or a sharded directory (read tensor by tensor; a path is its own
  serializable reference, so any process can read it);
- a mapping of canonical names to tensors (an in-process trainer's canonical view): the
  ``snapshot`` step copies its bits (training can go on while encoding runs) and steps refer to
  the copy by ``LocalRef`` (``flows.publish.memory_source``: torch, imported by name only for a
  mapping, whose tensors mean torch is loaded anyway);
- any object with ``infos`` and ``bits(name)`` (the ``Source`` protocol), read as it is.
Sharded sources (training shards) are in ``flows.publish.shards``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol

import numpy as np

from dcr_core.dtypes import TensorInfo
from dcr_core.errors import InvalidCheckpointError
from flows import refs
from flows.refs import LocalRef
from storage.local.safetensors import SafetensorsCheckpoint

SourceRef = str | LocalRef  # a checkpoint path, or a snapshot held in this process


class Source(Protocol):
    infos: dict[str, TensorInfo]
    path: str  # what the source is, for messages

    def bits(self, name: str) -> np.ndarray: ...


MEMORY_SOURCE = "flows.publish.memory_source"  # MemorySource (torch)


def __getattr__(name: str):
    """``sources.MemorySource``, imported on first use (torch)."""
    if name == "MemorySource":
        return importlib.import_module(MEMORY_SOURCE).MemorySource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def snapshot(source: SourceRef) -> SourceRef:
    """The step that fixes what is published: a checkpoint path is checked (its header read) and
    returned as it is; an in-memory mapping is copied into a ``MemorySource`` held in this process;
    a ``Source`` object is read as it is (its owner keeps it stable)."""
    if isinstance(source, LocalRef):
        obj = refs.get(source)
        if isinstance(obj, Mapping):
            return refs.put(importlib.import_module(MEMORY_SOURCE).MemorySource(obj), "snapshot")
        return source
    SafetensorsCheckpoint(source).close()
    return source


def open_source(source: SourceRef) -> Source:
    """The source behind a reference (a checkpoint opened from its path: close it, or use ``opened``)."""
    if isinstance(source, LocalRef):
        return refs.get(source)
    return SafetensorsCheckpoint(source)


@contextmanager
def opened(source: SourceRef) -> Iterator[Source]:
    """The source behind a reference; a checkpoint opened here from its path is closed afterwards
    (objects held in this process belong to their owner)."""
    src = open_source(source)
    try:
        yield src
    finally:
        if isinstance(src, SafetensorsCheckpoint):
            src.close()


def as_source_ref(source) -> tuple[SourceRef, LocalRef | None]:
    """A user's source as a reference the snapshot step takes, and the handle to release after."""
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source), None
    if isinstance(source, Mapping) or (hasattr(source, "infos") and callable(getattr(source, "bits", None))):
        ref = refs.put(source, "tensors" if isinstance(source, Mapping) else "source")
        return ref, ref
    raise InvalidCheckpointError(
        f"cannot publish from {type(source).__name__}: pass a checkpoint path, a mapping of name -> tensor, "
        "or training shards (ShardedSource)"
    )
