"""Refitting a running vLLM engine from the driver: prepare on every worker, apply, reset caches.

The engine must have been started with ``worker_extension_cls=EXTENSION``
(``flows.receive.vllm_worker``)::

    from vllm import LLM
    from flows.receive.vllm_refit import EXTENSION, refit_engine

    llm = LLM(model=checkpoint_dir, worker_extension_cls=EXTENSION, ...)
    result = refit_engine(llm, "s3://bucket/run", receiver_id="rollout-0")

The engine is a receiver kind (``VllmEngine``, in the registry of ``flows.receive.receiver``), whose
lifecycle runs these steps (each a Prefect task under ``receive_refit``; the engine is passed as a
``LocalRef``, so they run in the driver's process):

1. ``prepare-on-workers``: every worker pulls and verifies the step into a staged mirror while the
   engine keeps serving (``background=True`` returns at once; generation goes on meanwhile);
2. ``apply-on-workers``: the pause window, every worker reloads the layers the change touches;
3. ``reset-prefix-cache``: cached KV blocks were computed with the old weights; a fresh engine on
   the new step would not have them, so they are dropped (vLLM's ``LLM.reset_prefix_cache``);
4. ``await-receiver-commit``: every worker recorded its commit in ROOT (written in the background
   once its engine serves again; ``apply_refit`` leaves it to finish on its own).

A failure in step 1 leaves every worker's engine untouched. In step 2 a worker whose reload fails
rolls back to its previous step (see ``flows.receive.engine_apply``); with tensor parallelism the
other ranks may have applied, and the error is raised to the caller. Retrying converges: ranks
already at the step have nothing to do, the others refit.
"""

from __future__ import annotations

import os

from dcr_core.errors import UsageError
from flows import local_refs
from flows.local_refs import LocalRef
from flows.options import ReceiveOptions
from flows.receive import receiver as receivers
from flows.receive.receiver import Binding, Receiver, check_arguments
from flows.receive.records import EngineResult, WorkerResult
from flows.receive.vllm_worker import EXTENSION
from flows.results import ReceiveResult, as_dict
from flows.steps import InProcess, Runner, Step, StepTable
from storage.root import RootRef

__all__ = ["EXTENSION", "VllmEngine", "refit_engine", "prepare_refit", "apply_refit"]


def _rpc(llm, method: str, **kwargs) -> list:
    return llm.collective_rpc(method, kwargs=kwargs)


def prepare_on_workers(engine: LocalRef, root: str, step: int | None, receiver_id: str, storage_options: dict,
                       options: dict, state_path: str | None, background: bool) -> list[dict]:
    return _rpc(local_refs.get(engine), "dcr_prepare", root=root, step=step, receiver_id=receiver_id,
                storage_options=storage_options, options=options, state_path=state_path, background=background)


def apply_on_workers(engine: LocalRef) -> list[WorkerResult]:
    llm = local_refs.get(engine)
    try:
        return [WorkerResult.model_validate(w) for w in _rpc(llm, "dcr_apply")]
    except BaseException:
        _rpc(llm, "dcr_abort")  # workers whose apply failed already dropped theirs; the others drop it now
        raise


def await_receiver_commit(engine: LocalRef) -> list[dict]:
    """Wait until every worker recorded its commit (written in the background after the apply)."""
    return _rpc(local_refs.get(engine), "dcr_wait")


def reset_prefix_cache(engine: LocalRef) -> bool:
    llm = local_refs.get(engine)
    reset = getattr(llm, "reset_prefix_cache", None)
    return bool(reset()) if callable(reset) else False


class EngineSteps(StepTable):
    """A vLLM engine's steps, from its driver, in order."""

    prepare_on_workers = Step(prepare_on_workers)
    apply_on_workers = Step(apply_on_workers)
    reset_prefix_cache = Step(reset_prefix_cache)
    await_receiver_commit = Step(await_receiver_commit)


class VllmEngine(Receiver):
    """A vLLM engine in this process, started with ``worker_extension_cls=EXTENSION``, refitted from
    its driver: each worker is an ``flows.receive.engine.EngineReceiver`` reached through
    ``collective_rpc`` (``flows.receive.vllm_worker``); the steps above are its lifecycle (the
    engine passed to them as a ``LocalRef``, so they run in the driver's process)."""

    def __init__(self, llm, runner: Runner | None = None):
        if not receivers.holds(llm, VllmEngine):
            raise TypeError(f"{type(llm).__name__} is not a vLLM engine (no collective_rpc)")
        super().__init__(type(llm).__name__)
        self.llm = llm
        self.tasks = EngineSteps(runner or InProcess())
        self._engine: LocalRef | None = None
        self._workers: list[WorkerResult] = []

    @classmethod
    def from_target(cls, target, runner: Runner | None = None, **how) -> VllmEngine:
        return cls(target, runner)

    def version(self) -> int | None:
        held = _rpc(self.llm, "dcr_status")[0]["held"]
        return None if held is None else held["step"]

    def stage(self, step: int | None) -> None:
        b = self.binding
        self._engine = self._engine or local_refs.put(self.llm, "engine")
        self.tasks.prepare_on_workers(self._engine, b.root.url, step, b.receiver_id, dict(b.root.storage_options),
                                      b.options.model_dump(), b.mirror, False)

    def install(self, step: int | None) -> None:
        if self._engine is None:
            raise UsageError(f"{self.name}: nothing prepared: prepare first")
        self._workers = self.tasks.apply_on_workers(self._engine)
        self.tasks.reset_prefix_cache(self._engine)

    def record(self) -> None:
        if self._engine is not None:
            self.tasks.await_receiver_commit(self._engine)

    def release(self) -> None:
        engine, self._engine = self._engine, None
        local_refs.release(engine)

    def result(self) -> ReceiveResult:
        r = EngineResult.of(self._workers).model_dump()
        return ReceiveResult(r.pop("step"), r.pop("from_step"), r.pop("moves"), r.pop("bytes_pulled"),
                             r.pop("policy_digest"), dict(self.tasks.timings), r)


def prepare_refit(llm, root: str | os.PathLike, receiver_id: str = "vllm", step: int | None = None,
                  storage_options: dict | None = None, options: ReceiveOptions | None = None,
                  state_path: str | None = None, background: bool = True) -> list[dict]:
    """Phase 1 alone: every worker pulls and verifies ``step`` (default latest); with ``background``
    it returns at once and the engine serves meanwhile. ``apply_refit`` completes it."""
    VllmEngine(llm)  # refused here if it is not one
    options = check_arguments(receiver_id, step, options)
    with local_refs.holding(llm, "engine") as engine:
        return prepare_on_workers(engine, os.fspath(root), step, receiver_id, dict(storage_options or {}),
                                  options.model_dump(), state_path, background)


def apply_refit(llm) -> dict:
    """Phase 2: the pause window (every worker reloads what changed), then the prefix cache reset;
    returns the ``EngineResult`` as a dict."""
    VllmEngine(llm)
    with local_refs.holding(llm, "engine") as engine:
        workers = apply_on_workers(engine)
        reset_prefix_cache(engine)
    return EngineResult.of(workers).model_dump()


def refit_engine(llm, root: str | os.PathLike, receiver_id: str = "vllm", step: int | None = None,
                 storage_options: dict | None = None, options: ReceiveOptions | None = None,
                 state_path: str | None = None, runner: Runner | None = None) -> dict:
    """Bring every worker of ``llm`` to ``step`` (default: the latest) of ``root``; returns a summary
    (``records.EngineResult``: step, bytes pulled, the slowest worker's fetch and pause seconds, each
    worker's result) with the steps' ``timings``."""
    engine = VllmEngine(llm, runner)
    options = check_arguments(receiver_id, step, options)
    engine.bind(Binding(RootRef(os.fspath(root), dict(storage_options or {})), receiver_id, options, mirror=state_path))
    return as_dict(engine.refit(step))
