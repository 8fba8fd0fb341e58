"""Publisher sources: what the publisher reads the new policy from.

- a path: a ``.safetensors`` file or a sharded directory (read tensor by tensor);
- a mapping of canonical names to tensors (an in-process trainer's canonical view).
Snapshotting an in-memory source copies its bits, so training can go on while encoding runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Protocol

import torch

from dcr_core.errors import InvalidCheckpointError, UsageError
from storage.checkpoint import SafetensorsCheckpoint, TensorInfo, infos_of


class Source(Protocol):
    infos: dict[str, TensorInfo]

    def tensor(self, name: str) -> torch.Tensor: ...


class MemorySource:
    """A snapshot (bit copy) of in-memory canonical tensors."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        for name, t in tensors.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise UsageError(f"source entry {name!r} is not a (str, torch.Tensor) pair")
        self._tensors = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in tensors.items()}
        self.infos = infos_of(self._tensors)
        self.path = "<memory>"

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]


def open_source(source) -> Source:
    if isinstance(source, (str, os.PathLike)):
        return SafetensorsCheckpoint(source)
    if isinstance(source, Mapping):
        return MemorySource(source)
    if hasattr(source, "infos") and hasattr(source, "tensor"):
        return source
    raise InvalidCheckpointError(
        f"cannot publish from {type(source).__name__}: pass a checkpoint path or a mapping of name -> tensor"
    )
