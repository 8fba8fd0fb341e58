"""Typed records of a refit: what a receiver records of its commit, and what an engine's refit did.

- ``ReceiverCommit``: the receiver's own account of reaching a step, written by every receiver kind
  through ``state_file.record_receiver_commit`` to ``steps/N/receivers/ID.json`` and
  ``receivers/ID.json`` (``Catalog.record_receiver`` adds ``receiver``, ``step``, ``committed_at``
  and the earlier visits). Only the fields a kind sets are written (``exclude_unset``), so the JSON
  is the one each kind always wrote; ``storage.receiver_record`` reads it back without pydantic
  (``dcr ls`` and ``dcr verify`` start without it) and keeps fields it does not read.
- ``WorkerPrepared`` and ``WorkerResult``: one engine worker's (one tensor-parallel rank's) phase 1
  and its whole refit (``flows.receive.engine``); they cross process boundaries (vLLM's
  ``collective_rpc``, its HTTP routes) as plain dicts (``model_dump``) and are read back here.
- ``EngineResult``: an engine's refit, every worker's summed or maximised (the slowest worker's
  fetch and pause).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from storage import layout

Mode = Literal["dense", "delta", "current", "full", "fleet"]


class ReceiverCommit(BaseModel):
    """What a receiver records of its commit of a step (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    from_step: int | None = Field(ge=0, le=layout.MAX_STEP)
    moves: list[str]
    bytes_pulled: int = Field(0, ge=0)
    policy_digest: str
    # how the target was brought there: a live module "dense", "delta" or "current"; an engine
    # "full", "delta" or "current"; a state file switched by a fleet "fleet" (a state file's own
    # receive says nothing)
    mode: Mode | None = None
    engine: str | None = None  # the engine kind ("vllm")
    probe: dict[str, int] | None = None  # a live module: tensors per placement path
    fetch_seconds: float | None = Field(None, ge=0)
    pause_seconds: float | None = Field(None, ge=0)  # the time the target was being modified
    modify_wall_seconds: float | None = Field(None, ge=0)
    reload_seconds: float | None = Field(None, ge=0)
    check_seconds: float | None = Field(None, ge=0)
    digest_seconds: float | None = Field(None, ge=0)
    tensors_loaded: int | None = Field(None, ge=0)
    direct: int | None = Field(None, ge=0)
    overwrite: int | None = Field(None, ge=0)
    reloaded_tensors: int | None = Field(None, ge=0)
    patched_tensors: int | None = Field(None, ge=0)
    patched_elements: int | None = Field(None, ge=0)
    hashed_modules: int | None = Field(None, ge=0)

    def document(self) -> dict:
        """The fields this record sets, as JSON values: what ``Catalog.record_receiver`` writes."""
        return self.model_dump(mode="json", exclude_unset=True)


class WorkerPrepared(BaseModel):
    """One engine worker's phase 1: the step it staged and what it pulled (the engine unchanged)."""

    model_config = ConfigDict(extra="forbid")

    receiver: str
    from_step: int | None
    to_step: int
    mode: Literal["full", "delta", "current"]
    moves: list[str]
    changed_tensors: int
    bytes_pulled: int
    fetch_seconds: float
    policy_digest: str


class WorkerResult(WorkerPrepared):
    """One engine worker's refit: phase 1, then the pause window's timings and counts."""

    pause_seconds: float
    reload_seconds: float
    check_seconds: float
    digest_seconds: float
    reloaded_tensors: int
    patched_tensors: int
    patched_elements: int
    hashed_modules: int


class EngineResult(BaseModel):
    """An engine's refit from its driver: its workers' results, and the figures that describe them
    together (bytes summed; seconds and counts of the slowest or busiest worker)."""

    model_config = ConfigDict(extra="forbid")

    step: int
    from_step: int | None
    mode: str
    moves: list[str]
    policy_digest: str
    bytes_pulled: int
    fetch_seconds: float
    pause_seconds: float
    reload_seconds: float
    reloaded_tensors: int
    patched_tensors: int
    workers: list[WorkerResult]

    @classmethod
    def of(cls, workers: list[WorkerResult]) -> EngineResult:
        first = workers[0]
        return cls(step=first.to_step, from_step=first.from_step, mode=first.mode, moves=first.moves,
                   policy_digest=first.policy_digest, bytes_pulled=sum(w.bytes_pulled for w in workers),
                   fetch_seconds=max(w.fetch_seconds for w in workers),
                   pause_seconds=max(w.pause_seconds for w in workers),
                   reload_seconds=max(w.reload_seconds for w in workers),
                   reloaded_tensors=max(w.reloaded_tensors for w in workers),
                   patched_tensors=max(w.patched_tensors for w in workers), workers=workers)
