"""A snapshot of in-memory canonical tensors (an in-process trainer's view): torch, so it lives apart
from ``flows.publish.sources`` (which a checkpoint path's publish imports) and is found there by name."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from dcr_core.bits import bits_of, infos_of
from dcr_core.errors import UsageError


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
