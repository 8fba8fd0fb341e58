"""Publisher sources: what the publisher reads the new policy from, as raw bits by tensor name.

- a path: a ``.safetensors`` file or a sharded directory (read tensor by tensor as raw bits, no torch;
  a path is its own serializable reference, so any process can read it);
- a mapping of canonical names to tensors (an in-process trainer's canonical view): the
  ``snapshot`` step copies its bits into a ``MemorySource`` (training can go on while encoding runs)
  and steps refer to the copy by ``LocalRef``; it lives with the training shards in
  ``flows.publish.shards`` (torch), imported by name only for a mapping, whose tensors mean the
  caller holds torch already;
- any object with ``infos`` and ``bits(name)`` (the ``Source`` protocol), read as it is;
- a sharded checkpoint path (a DCP directory, a per-rank layout file): ``sharded_kind`` tells it from
  a canonical one without torch, and ``sharded_sources`` imports its reader (``flows.publish.dcp``,
  ``flows.publish.layout_file``: torch) only for such a path. The sources of training shards are in
  ``flows.publish.shards``.
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
from flows import local_refs
from flows.local_refs import LocalRef
from storage.local.dcp_metadata import is_dcp_dir
from storage.local.safetensors import SafetensorsCheckpoint

SourceRef = str | LocalRef  # a checkpoint path, or a snapshot held in this process


class Source(Protocol):
    infos: dict[str, TensorInfo]
    path: str  # what the source is, for messages

    def bits(self, name: str) -> np.ndarray: ...


MEMORY_SOURCE = "flows.publish.shards"  # MemorySource: what a trainer holds in memory (torch)


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
        obj = local_refs.get(source)
        if isinstance(obj, Mapping):
            return local_refs.put(importlib.import_module(MEMORY_SOURCE).MemorySource(obj), "snapshot")
        return source
    SafetensorsCheckpoint(source).close()
    return source


def open_source(source: SourceRef) -> Source:
    """The source behind a reference (a checkpoint opened from its path: close it, or use ``opened``)."""
    if isinstance(source, LocalRef):
        return local_refs.get(source)
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
        ref = local_refs.put(source, "tensors" if isinstance(source, Mapping) else "source")
        return ref, ref
    raise InvalidCheckpointError(
        f"cannot publish from {type(source).__name__}: pass a checkpoint path, a mapping of name -> tensor, "
        "or training shards (ShardedSource)"
    )


# What a checkpoint path holds, decided without torch; the reader of a sharded one, imported on use.
LAYOUT_FORMAT = "dcr-shard-layout"

# kind -> (module, function(path, *args) -> list of ShardedSource): read with torch, imported on use
SHARDED_READERS = {
    "dcp": ("flows.publish.dcp", "dcp_sources"),
    "layout": ("flows.publish.layout_file", "layout_sources"),
}


def is_layout_file(path) -> bool:
    """A per-rank layout file (JSON naming its format near the start)."""
    path = os.fspath(path)
    if not (path.endswith(".json") and os.path.isfile(path)):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return LAYOUT_FORMAT.encode() in head


def sharded_kind(path) -> str | None:
    """``"dcp"`` (a torch.distributed.checkpoint directory), ``"layout"`` (a layout file) or None
    (a canonical checkpoint: a safetensors file or directory)."""
    if is_dcp_dir(path):
        return "dcp"
    if is_layout_file(path):
        return "layout"
    return None


def sharded_sources(kind: str, path, *args) -> list:
    """The sources of every rank of a sharded checkpoint of ``kind`` (imports its reader: torch)."""
    module, function = SHARDED_READERS[kind]
    return getattr(importlib.import_module(module), function)(path, *args)
