"""Publisher sources: what the publisher reads the new policy from, as raw bits by tensor name.

- a path: a ``.safetensors`` file or a sharded directory (read tensor by tensor; a path is its own
  serializable reference, so any process can read it);
- a mapping of canonical names to tensors (an in-process trainer's canonical view): the
  ``snapshot`` step copies its bits (training can go on while encoding runs) and steps refer to
  the copy by ``LocalRef``;
- any object with ``infos`` and ``bits(name)`` (the ``Source`` protocol), read as it is.
Sharded sources (training shards) are in ``flows.publish.shards``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol

import numpy as np
import torch

from dcr_core.bits import bits_of, infos_of
from dcr_core.dtypes import TensorInfo
from dcr_core.errors import InvalidCheckpointError, UsageError
from flows import refs
from flows.refs import LocalRef
from storage.local.safetensors import SafetensorsCheckpoint

SourceRef = str | LocalRef  # a checkpoint path, or a snapshot held in this process


class Source(Protocol):
    infos: dict[str, TensorInfo]
    path: str  # what the source is, for messages

    def bits(self, name: str) -> np.ndarray: ...


class MemorySource:
    """A snapshot (bit copy) of in-memory canonical tensors."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        for name, t in tensors.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise UsageError(f"source entry {name!r} is not a (str, torch.Tensor) pair")
        self._tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in tensors.items()}
        self.infos = infos_of(self._tensors)
        self.path = "<memory>"

    def bits(self, name: str) -> np.ndarray:
        return bits_of(self._tensors[name])


def snapshot(source: SourceRef) -> SourceRef:
    """The step that fixes what is published: a checkpoint path is checked (its header read) and
    returned as it is; an in-memory mapping is copied into a ``MemorySource`` held in this process;
    a ``Source`` object is read as it is (its owner keeps it stable)."""
    if isinstance(source, LocalRef):
        obj = refs.get(source)
        return refs.put(MemorySource(obj), "snapshot") if isinstance(obj, Mapping) else source
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
