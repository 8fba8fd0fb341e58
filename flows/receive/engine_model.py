"""What DCR needs of an inference engine to refit it in place: the seam an engine plugs in by.

An engine worker (one tensor-parallel rank) is an ``EngineModel``: the torch model it serves (read
and hashed, never written by DCR but through the engine's own reload or an in-place patch of a
parameter that keeps the checkpoint's layout), where it sits among the engine's ranks, and its
own in-place reload. Everything else (the mirror, planning, leases, staging, the pause window,
the roll back, the records) is the engine-independent code of ``flows.receive.engine``,
``engine_prepare`` and ``engine_apply``. vLLM's adapters: ``flows.receive.vllm_worker.VllmWorker``
(a worker, through DCR's worker extension) and ``flows.receive.vllm_transfer.VllmEngineModel``
(the model a weight-transfer backend is given).

``EngineState`` is what DCR keeps per worker between refits: what it knows the engine holds, and
the layer map probed for the mirror's schema.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

Weights = Iterator[tuple[str, torch.Tensor]]


class EngineModel(Protocol):
    """One worker of an inference engine, as DCR refits it (see the module docstring)."""

    @property
    def kind(self) -> str:
        """The engine's name, recorded in the receiver's commit (``"vllm"``)."""

    @property
    def model(self) -> torch.nn.Module:
        """The model the worker serves: its modules are what DCR hashes (``held_digests``)."""

    @property
    def rank(self) -> int:
        """This worker's tensor-parallel rank (0 without tensor parallelism)."""

    @property
    def ranks(self) -> int:
        """The engine's tensor-parallel size: with more than one, each rank is its own receiver."""

    def reload(self, weights: Weights | None, layers: set[str] | None) -> None:
        """Reload ``weights`` (checkpoint names and tensors) in place through the engine's own
        loading path, post-load processing included (a layer's kernels rebuilt); ``layers``: the
        layers they feed (None: all). ``weights`` None: every weight from the engine's own
        checkpoint (where it was loaded from). A layer is given every tensor that feeds it. A
        kernel it rebuilds is a new callable (``live_tensors.has_kernel``: DCR's record tells
        kernels apart by identity between a pause and the next read-back, ``held_digests.Pending``)."""

    def abandon_reload(self) -> None:
        """Close a reload an exception cut off, so that the next reload starts from the engine's
        real tensors (the roll back's)."""


@dataclass
class EngineState:
    """What DCR keeps per worker: ``held`` (what DCR knows the engine holds: root, step, policy
    digest, mirror, module digests and their fingerprint; None when unknown) and ``layers`` (the
    layer map of the mirror's schema and the names patchable in place, probed once per schema)."""

    held: dict[str, Any] | None = None
    layers: tuple[Any, dict[str, str]] | None = None
