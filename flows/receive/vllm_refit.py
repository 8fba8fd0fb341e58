"""Refitting a running vLLM engine from the driver: prepare on every worker, apply, reset caches.

The engine must have been started with ``worker_extension_cls=EXTENSION``
(``flows.receive.vllm_worker``)::

    from vllm import LLM
    from flows.receive.vllm_refit import EXTENSION, refit_engine

    llm = LLM(model=checkpoint_dir, worker_extension_cls=EXTENSION, ...)
    result = refit_engine(llm, "s3://bucket/run", receiver_id="rollout-0")

Steps (each a Prefect task under ``receive_refit``; the engine is passed as a ``LocalRef``, so they
run in the driver's process):

1. ``prepare-on-workers``: every worker pulls and verifies the step into a staged mirror while the
   engine keeps serving (``background=True`` returns at once; generation goes on meanwhile);
2. ``apply-on-workers``: the pause window, every worker reloads the layers the change touches;
3. ``reset-prefix-cache``: cached KV blocks were computed with the old weights; a fresh engine on
   the new step would not have them, so they are dropped (vLLM's ``LLM.reset_prefix_cache``);
4. ``await-receiver-commit``: every worker recorded its commit in ROOT (written in the background
   once its engine serves again; ``apply_refit`` leaves it to finish on its own).

A failure in step 1 leaves every worker's engine untouched. In step 2 a worker whose reload fails
rolls back to its previous step (see ``flows.receive.vllm_apply``); with tensor parallelism the
other ranks may have applied, and the error is raised to the caller. Retrying converges: ranks
already at the step have nothing to do, the others refit.
"""

from __future__ import annotations

import os

from flows import local_refs
from flows.local_refs import LocalRef
from flows.options import ReceiveOptions
from flows.receive.pipeline import check_arguments
from flows.receive.vllm_worker import EXTENSION
from flows.steps import InProcess, Runner, Step, StepTable

__all__ = ["EXTENSION", "refit_engine", "prepare_refit", "apply_refit"]


def _rpc(llm, method: str, **kwargs) -> list:
    return llm.collective_rpc(method, kwargs=kwargs)


def prepare_on_workers(engine: LocalRef, root: str, step: int | None, receiver_id: str, storage_options: dict,
                       options: dict, state_path: str | None, background: bool) -> list[dict]:
    return _rpc(local_refs.get(engine), "dcr_prepare", root=root, step=step, receiver_id=receiver_id,
                storage_options=storage_options, options=options, state_path=state_path, background=background)


def apply_on_workers(engine: LocalRef) -> list[dict]:
    llm = local_refs.get(engine)
    try:
        return _rpc(llm, "dcr_apply")
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


def _check_engine(llm) -> None:
    if not callable(getattr(llm, "collective_rpc", None)):
        raise TypeError(f"{type(llm).__name__} is not a vLLM engine (no collective_rpc)")


def prepare_refit(llm, root: str | os.PathLike, receiver_id: str = "vllm", step: int | None = None,
                  storage_options: dict | None = None, options: ReceiveOptions | None = None,
                  state_path: str | None = None, background: bool = True) -> list[dict]:
    """Phase 1 alone: every worker pulls and verifies ``step`` (default latest); with ``background``
    it returns at once and the engine serves meanwhile. ``apply_refit`` completes it."""
    _check_engine(llm)
    options = check_arguments(receiver_id, step, options)
    with local_refs.holding(llm, "engine") as engine:
        return prepare_on_workers(engine, os.fspath(root), step, receiver_id, dict(storage_options or {}),
                                  options.model_dump(), state_path, background)


def apply_refit(llm) -> dict:
    """Phase 2: the pause window (every worker reloads what changed), then the prefix cache reset."""
    _check_engine(llm)
    with local_refs.holding(llm, "engine") as engine:
        workers = apply_on_workers(engine)
        reset_prefix_cache(engine)
    return summarize(workers)


def refit_engine(llm, root: str | os.PathLike, receiver_id: str = "vllm", step: int | None = None,
                 storage_options: dict | None = None, options: ReceiveOptions | None = None,
                 state_path: str | None = None, runner: Runner | None = None) -> dict:
    """Bring every worker of ``llm`` to ``step`` (default: the latest) of ``root``; returns a summary
    (step, bytes pulled, the slowest worker's fetch and pause seconds) and each worker's result."""
    _check_engine(llm)
    options = check_arguments(receiver_id, step, options)
    tasks = EngineSteps(runner or InProcess())
    with local_refs.holding(llm, "engine") as engine:
        tasks.prepare_on_workers(engine, os.fspath(root), step, receiver_id, dict(storage_options or {}),
                                 options.model_dump(), state_path, False)
        workers = tasks.apply_on_workers(engine)
        tasks.reset_prefix_cache(engine)
        tasks.await_receiver_commit(engine)
    return {**summarize(workers), "timings": dict(tasks.timings)}


def summarize(workers: list[dict]) -> dict:
    first = workers[0]
    return {
        "step": first["to_step"], "from_step": first["from_step"], "mode": first["mode"], "moves": first["moves"],
        "bytes_pulled": sum(w["bytes_pulled"] for w in workers),
        "fetch_seconds": max(w["fetch_seconds"] for w in workers),
        "pause_seconds": max(w["pause_seconds"] for w in workers),
        "reload_seconds": max(w.get("reload_seconds", 0.0) for w in workers),
        "reloaded_tensors": max(w["reloaded_tensors"] for w in workers),
        "patched_tensors": max(w.get("patched_tensors", 0) for w in workers),
        "workers": workers,
    }
