"""The Prefect flows, every parameter JSON (what a deployment, the UI and ``prefect deploy``
validate): ``publish_checkpoint`` (``dcr-publish-refit``), ``receive_state`` (``dcr-receive-refit``),
``materialize_refit``, ``verify_refit``, ``mirror_refit``, ``fleet_refit`` and ``gc_refit``.

Objects that live in the caller's process (a trainer's tensors or shards, a live module, a vLLM
``LLM``) are not flow parameters: ``publish_refit`` and ``receive_refit``, the Python entry points,
are plain functions that run a path through the flows above, and hold an object for the run while
its flow (``publish_held``, ``receive_live``) takes a ``LocalRef`` to it (``flows.local_refs``:
a key that resolves only in this process). Dask clusters are named by ``workers`` (N local worker
processes or ``dask://HOST:PORT``), never passed as objects.

Each flow runs the same pipeline as the in-process form (``flows.publish.pipeline`` and friends)
with ``PrefectRunner``: every step of the step table becomes a Prefect task, so the Prefect API
shows each step's state and duration. Tasks take and return references (``flows.steps``), never
tensors or open files (JSON-serializable: ``tests/system/test_prefect_flows.py``); the flows' options are the typed models of
``flows.options`` (deployments pass them as mappings, validated by Prefect). Runs are named
(``publish-step-12``, ``receive-rollout-0-to-12``: renamed to the step it reached, ``gc-keep-5``), tagged (``dcr``, the kind of
run, ``root:<ROOT>``, ``step:<N>``, ``receiver:<id>``) and leave a table artifact of what they did (one row per task with its seconds); a publish also
leaves a markdown artifact linking the step's manifest and commit marker.

What is kept, per flow. A publish on workers keeps each finished ``encode-group`` result (its
manifest entries, a few KB) in Prefect's task cache, keyed by everything the result depends on
(``flows.publish.groups.result_key``: ROOT, step, attempt, base, options, the group's tensors, the
checkpoint's file identity) under the publisher's cache directory; the attempt of a flow run is
derived from its id (``_run_attempt``), so Prefect running the same flow run again (``retries``, a
crashed deployment run retried) skips the groups that finished and encodes only the others; the
results are deleted once the step commits (``tests/system/test_workers.py``). Nothing else is
persisted or cached (``persist_result=False``, ``NO_CACHE``), because no rerun could use it: a
publish without workers encodes in one task; a receive, materialize or fleet switch plans again
from what the target holds now (a finished step is found finished by the plan, not by a cache);
verify is a report on the bucket as it is now; a mirror skips steps the destination already holds
by looking at it; gc plans from the bucket each run. What a run did is in its artifacts (tables,
the publish's links) and its return value.

Retries: none here. Transient request errors are retried by the storage layer's one owner per
backend (``storage.retry``); everything else is DCR's verdict on the data, which a retry cannot
change. A flow run that failed can simply be run again.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import logging
import os
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

# Dask workers preload this module as they start (``dask worker --preload flows.prefect_flows``;
# ``--workers N`` preloads it on its LocalCluster): a worker unpickles the flow with each task's run
# context, and runs the mapped steps (publish.encode, receive.on_workers, maintenance.audit and
# mirror, all imported above), so importing it once then keeps about 2 s out of each worker's first
# task. Prefect's task engine is loaded here for the same reason.
import prefect.task_engine  # noqa: F401 - loaded with the flows: a worker's first task does not import it
from prefect import Flow, get_run_logger, tags, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE, CachePolicy
from prefect.client.orchestration import get_client
from prefect.context import get_run_context
from prefect.events import emit_event
from prefect.runtime import flow_run, task_run

from dcr_core.errors import DCRError, UsageError
from dcr_core.text import plural
from flows import local_refs
from flows import workers as cluster
from flows.local_refs import LocalRef
from flows.maintenance.audit import VerifyReport, verify
from flows.maintenance.gc import GcReport, run_gc
from flows.maintenance.mirror import run_mirror
from flows.options import GcOptions, PublishOptions, ReceiveOptions, refuse_credentials
from flows.publish.pipeline import run_publish
from flows.receive import receiver as receivers
from flows.receive.fleet import FleetResult, FleetSwitchError, run_fleet
from flows.receive.pipeline import run_materialize, run_receive
from flows.results import PublishResult, as_dict
from flows.steps import Step
from storage import layout
from storage.catalog import Catalog
from storage.root import open_root

# Not imported here: the receiver kinds of live targets (a module with ``load_weights``, a vLLM
# engine) import torch (2-3 s). The receivers' registry (``flows.receive.receiver``) imports a kind
# when it refits a target of it (its caller holds torch already). This module is imported by every
# Prefect-orchestrated command and by every Dask worker, which unpickles the flow with each task.


@functools.cache
def _task(step: Step):
    # Nothing to persist or cache (see the module docstring): every task runs every time.
    return task(step.fn, name=step.name, persist_result=False, cache_policy=NO_CACHE, retries=0)


@functools.cache
def _mapped_task(step: Step):
    # Mapped tasks run on workers: their results come back through Dask, not through result
    # storage; a step with a ResultCache keeps them for a rerun (_cached_task).
    return task(step.fn, name=step.name, task_run_name=_mapped_name, persist_result=False, cache_policy=NO_CACHE,
                retries=0)


def _mapped_name() -> str:
    """``encode-group-3`` (a group of tensors, numbered); ``verify-tensors-<first name>``,
    ``copy-object-batch-<first key>`` (a batch, by its first item)."""
    p = task_run.parameters
    if p.get("group") is not None:
        return f"{task_run.task_name}-{getattr(p['group'], 'index', '?')}"
    first = (p.get("names") or p.get("keys") or ("?",))[0]
    return f"{task_run.task_name}-{str(first)[-48:]}"


class PrefectRunner:
    """Runs each step as a Prefect task (call the pipeline inside a flow run); with ``task_runner``
    (a started ``DaskTaskRunner``, ``flows.workers``), mapped steps run on its workers."""

    def __init__(self, task_runner: Any = None):
        self.task_runner = task_runner

    def wrap(self, step: Step):
        return _task(step)

    @property
    def mapped(self) -> bool:
        return self.task_runner is not None

    @property
    def slots(self) -> int:
        return cluster.slots(self.task_runner)

    def map(self, step: Step, items: list[dict], shared: dict, each=None) -> list:
        mapped = _mapped_task(step) if step.cache is None else _cached_task(step, shared)
        return cluster.run_mapped(self.task_runner, mapped, items, shared, each)


def _cached_task(step: Step, shared: dict):
    """``step``'s mapped task with Prefect's task cache: its result kept (``persist_result``) in the
    run's directory (``step.cache.where``) under a key of everything it depends on
    (``step.cache.key``), so a rerun of a failed flow run finds the calls that finished Cached and
    runs only the others."""
    cache = step.cache
    return _mapped_task(step).with_options(
        persist_result=True, cache_policy=CachePolicy.from_cache_key_fn(lambda _context, params: cache.key(params)),
        result_storage=Path(cache.where(shared)), cache_expiration=datetime.timedelta(seconds=cache.seconds))


def _run_attempt(attempt: str | None) -> str | None:
    """The attempt id of this flow run's publish: ``attempt`` if given, else one derived from the
    flow run's id, so that Prefect running the same flow run again (its ``retries``, a crashed
    deployment run retried) writes into the same attempt and finds its finished groups Cached; a
    new run gets a new attempt, as an in-process publish does."""
    if attempt is not None:
        return attempt
    run_id = flow_run.get_id()
    return None if run_id is None else str(run_id).replace("-", "")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", str(text).lower()).strip("-")[:60] or "x"


class _TaggedFlow(Flow):
    """A flow whose runs are created with DCR's tags, computed from the call's arguments.

    Prefect takes a run's tags where the run is created: from ``with prefect.tags(...)`` around a call,
    or from the deployment (``infra/prefect.yaml`` gives each deployment its kind and root). Calling one
    of these flows enters that context itself, so a run is tagged without a call to update it. The flow
    body enters it again for its task runs (a deployment's run does not go through ``__call__``).
    ``with_options`` returns a plain ``Flow``: its runs have the caller's tags only.
    """

    def __init__(self, fn, tags_of, **kwargs):
        super().__init__(fn, **kwargs)
        self.tags_of = tags_of

    def __call__(self, *args, return_state: bool = False, wait_for=None, **kwargs):
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        with tags(*self.tags_of(**bound.arguments)):
            return super().__call__(*args, return_state=return_state, wait_for=wait_for, **kwargs)


def _dcr_flow(name: str, run_name, tags_of):
    """``@flow`` for DCR's flows: named runs, tagged at creation (``_TaggedFlow``), nothing persisted."""
    def decorate(fn):
        return _TaggedFlow(fn, tags_of, name=name, flow_run_name=run_name, log_prints=True, persist_result=False)
    return decorate


def _publish_tags(root, step, **_) -> tuple[str, ...]:
    return ("dcr", "dcr-publish", f"root:{root}", f"step:{step}")


def _receive_tags(root, receiver_id, **_) -> tuple[str, ...]:
    return ("dcr", "dcr-receive", f"root:{root}", f"receiver:{receiver_id}")


def _materialize_tags(root, **_) -> tuple[str, ...]:
    return ("dcr", "dcr-materialize", f"root:{root}")


def _verify_tags(root, **_) -> tuple[str, ...]:
    return ("dcr", "dcr-verify", f"root:{root}")


def _mirror_tags(src, dst, **_) -> tuple[str, ...]:
    return ("dcr", "dcr-mirror", f"root:{src}", f"mirror:{dst}")


def _fleet_tags(root, name, **_) -> tuple[str, ...]:
    return ("dcr", "dcr-fleet", f"root:{root}", f"fleet:{name}")


def _gc_tags(root, **_) -> tuple[str, ...]:
    return ("dcr", "dcr-gc", f"root:{root}")


def _publish_name() -> str:
    return f"publish-step-{flow_run.parameters['step']}"


def _receive_name() -> str:
    p = flow_run.parameters
    return f"receive-{p['receiver_id']}-to-{'latest' if p.get('step') is None else p['step']}"


def _mirror_name() -> str:
    p = flow_run.parameters
    return f"mirror-{'all' if p.get('step') is None else 'step-' + str(p['step'])}"


def _fleet_name() -> str:
    p = flow_run.parameters
    return f"fleet-{p.get('name') or 'default'}-to-{'latest' if p.get('step') is None else p['step']}"


def _materialize_name() -> str:
    step = flow_run.parameters.get("step")
    return f"materialize-{'latest' if step is None else 'step-' + str(step)}"


def _verify_name() -> str:
    step = flow_run.parameters.get("step")
    return f"verify-{'all' if step is None else 'step-' + str(step)}"


def _gc_name() -> str:
    options = flow_run.parameters["options"]
    keep = options.keep_last if isinstance(options, GcOptions) else options.get("keep_last")
    return f"gc-keep-{keep}"


@_dcr_flow("dcr-publish-refit", _publish_name, _publish_tags)
def publish_checkpoint(
    root: str, source: str, step: int, keyframe: bool = False, storage_options: dict | None = None,
    options: PublishOptions | None = None, attempt: str | None = None, workers: int | str | None = None,
) -> dict:
    """Publish the checkpoint at path ``source`` (a ``.safetensors`` file, a Hugging Face sharded
    directory, a torch DCP directory) as ``step`` of ``root``: the flow of the ``publisher``
    deployment and of ``dcr publish --orchestrator prefect``; every parameter is JSON.

    ``workers`` (N worker processes on this machine, or ``dask://HOST:PORT``): the encoding runs as
    tasks mapped over groups of tensors on that Dask cluster (``flows.workers``)."""
    refuse_credentials(storage_options)
    with tags(*_publish_tags(root, step)), cluster.entered(workers) as mapped_on:
        result = run_publish(str(root), str(source), step, keyframe, storage_options, options,
                             PrefectRunner(mapped_on), _run_attempt(attempt))
    _best_effort(_report_publish, str(root), storage_options, result)
    _best_effort(_announce_commit, str(root), result)
    return asdict(result)


@_dcr_flow("dcr-publish-held", _publish_name, _publish_tags)
def publish_held(
    root: str, source: LocalRef, step: int, keyframe: bool = False, storage_options: dict | None = None,
    options: PublishOptions | None = None, attempt: str | None = None,
) -> dict:
    """Publish tensors held in this process as ``step`` of ``root``: ``source`` is the reference
    (``flows.local_refs``) of a name -> tensor mapping, of this rank's ``ShardedSource`` or of a
    list of every rank's. Called by ``publish_refit``, which holds the object for the run."""
    refuse_credentials(storage_options)
    with tags(*_publish_tags(root, step)):
        result = run_publish(str(root), local_refs.get(source), step, keyframe, storage_options, options,
                             PrefectRunner(), attempt)
    _best_effort(_report_publish, str(root), storage_options, result)
    _best_effort(_announce_commit, str(root), result)
    return asdict(result)


def publish_refit(
    root: str | Path, source: Any, step: int, keyframe: bool = False, storage_options: dict | None = None,
    options: PublishOptions | None = None, attempt: str | None = None, workers: int | str | None = None,
    return_state: bool = False,
):
    """Publish ``source`` as ``step`` of ``root`` as a Prefect flow run: a checkpoint path (the
    ``dcr-publish-refit`` flow, ``publish_checkpoint``), a name -> tensor mapping, this rank's
    ``ShardedSource`` (every rank runs it; rank 0 commits) or a list of every rank's (the
    ``dcr-publish-held`` flow, ``publish_held``, given a reference to ``source``). Returns the flow's
    result (its final state with ``return_state=True``).

    ``workers`` (N worker processes on this machine, or ``dask://HOST:PORT``; a checkpoint path
    only): the encoding runs as tasks mapped over groups of tensors on that Dask cluster."""
    if isinstance(source, (str, os.PathLike)):
        return publish_checkpoint(os.fspath(root), os.fspath(source), step, keyframe, storage_options, options,
                                  attempt, workers, return_state=return_state)
    if cluster.parse_workers(workers) is not None:
        raise UsageError("publishing on workers reads a checkpoint file where each task runs; tensors held in this "
                         "process cannot travel: pass a checkpoint path, or publish without workers")
    with local_refs.holding(source, "source") as ref:
        return publish_held(os.fspath(root), ref, step, keyframe, storage_options, options, attempt,
                            return_state=return_state)


@_dcr_flow("dcr-receive-refit", _receive_name, _receive_tags)
def receive_state(
    root: str, receiver_id: str, state: str, step: int | None = None, storage_options: dict | None = None,
    options: ReceiveOptions | None = None, workers: int | str | None = None,
) -> dict:
    """Bring the state file at path ``state`` of receiver ``receiver_id`` to ``step`` (default: the
    latest): the flow of the ``receiver`` deployment and of ``dcr receive --orchestrator prefect``;
    every parameter is JSON.

    ``workers``: a refit that rewrites the file runs as tasks mapped over groups of tensors on that
    Dask cluster (``flows.receive.on_workers``)."""
    refuse_credentials(storage_options)
    with tags(*_receive_tags(root, receiver_id)), cluster.entered(workers) as mapped_on:
        result = as_dict(run_receive(str(root), receiver_id, str(state), step, storage_options, options,
                                     PrefectRunner(mapped_on)))
    _best_effort(_report_receive, str(root), storage_options, receiver_id, result)
    return result


@_dcr_flow("dcr-receive-live", _receive_name, _receive_tags)
def receive_live(
    root: str, receiver_id: str, target: LocalRef, step: int | None = None, storage_options: dict | None = None,
    options: ReceiveOptions | None = None, state_path: str | None = None,
) -> dict:
    """Bring a target held in this process to ``step``: ``target`` is the reference
    (``flows.local_refs``) of a running vLLM engine started with DCR's worker extension
    (``state_path``: each worker's mirror) or of a live module with ``load_weights``
    (``state_path``: its partial mirror). Called by ``receive_refit``, which holds the target."""
    refuse_credentials(storage_options)
    with tags(*_receive_tags(root, receiver_id)):  # the target's kind from the receivers' registry
        result = receivers.refit(local_refs.get(target), str(root), receiver_id, step, storage_options, options,
                                 state_path, runner=PrefectRunner())
    _best_effort(_report_receive, str(root), storage_options, receiver_id, result)
    return result


def receive_refit(
    root: str | Path, receiver_id: str, target: Any, step: int | None = None, storage_options: dict | None = None,
    options: ReceiveOptions | None = None, state_path: str | None = None, workers: int | str | None = None,
    return_state: bool = False,
):
    """Bring ``target`` to ``step`` (default: the latest) as a Prefect flow run: a state file path
    (the ``dcr-receive-refit`` flow, ``receive_state``), a running vLLM engine started with DCR's
    worker extension or a live module with ``load_weights`` (the ``dcr-receive-live`` flow,
    ``receive_live``, given a reference to ``target``; ``state_path``: the mirror). Returns the
    flow's result (its final state with ``return_state=True``).

    ``workers`` (a state file only): a refit that rewrites the file runs as tasks mapped over groups
    of tensors on that Dask cluster."""
    if not receivers.kind_of(target).in_process:  # a state file: named by its path, a flow parameter
        if state_path is not None:
            raise UsageError("state_path is the mirror of a live module or engine; a state file target is its own")
        return receive_state(os.fspath(root), receiver_id, os.fspath(target), step, storage_options, options,
                             workers, return_state=return_state)
    if cluster.parse_workers(workers) is not None:
        raise UsageError("workers rewrite a state file; a live module or an engine receives in its own process")
    with local_refs.holding(target, "target") as ref:
        return receive_live(os.fspath(root), receiver_id, ref, step, storage_options, options, state_path,
                            return_state=return_state)


@_dcr_flow("dcr-materialize", _materialize_name, _materialize_tags)
def materialize_refit(
    root: str | Path, step: int | None, out: str | Path, storage_options: dict | None = None,
    options: ReceiveOptions | None = None, workers: int | str | None = None, force: bool = False,
) -> dict:
    """Write the full checkpoint of committed ``step`` (default: the latest) to ``out``
    (``dcr materialize``); with ``workers``, as tasks mapped over groups of
    tensors on that Dask cluster (``flows.receive.on_workers``: the workers must see ``out``).
    ``force``: replace ``out`` even if DCR did not write it."""
    refuse_credentials(storage_options)
    with tags(*_materialize_tags(root)), cluster.entered(workers) as mapped_on:
        result = as_dict(run_materialize(str(root), step, str(out), storage_options, options, PrefectRunner(mapped_on),
                                         force=force))
    get_run_logger().info("wrote step %d to %s (%d bytes pulled)", result["step"], out, result["bytes_pulled"])
    return result


@_dcr_flow("dcr-verify", _verify_name, _verify_tags)
def verify_refit(
    root: str | Path, step: int | None = None, deep: bool = False, storage_options: dict | None = None,
    io_workers: int = 8, workers: int | str | None = None, group_bytes: int | None = None,
) -> dict:
    """Re-read the stored chunks of ``step`` (default: every committed step) and check them against
    their digests (``dcr verify``; ``deep``: deltas replayed too); with ``workers``, each step's tensors are checked in groups on that Dask cluster. Returns the
    report: a failed check is in ``errors``, not raised."""
    refuse_credentials(storage_options)
    with tags(*_verify_tags(root)), cluster.entered(workers) as mapped_on:
        report = verify(open_root(str(root), storage_options or {}), step, deep, io_workers,
                        PrefectRunner(mapped_on), group_bytes)
    _best_effort(_report_verify, report)
    return asdict(report)


@_dcr_flow("dcr-mirror", _mirror_name, _mirror_tags)
def mirror_refit(src: str, dst: str, step: int | None = None, src_storage_options: dict | None = None,
                 dst_storage_options: dict | None = None, as_id: str | None = None,
                 io_workers: int = 8, workers: int | str | None = None, group_bytes: int | None = None) -> dict:
    """Copy committed steps (``step``, or all newer than ``dst``'s newest) from ROOT ``src`` to ROOT
    ``dst`` (``dcr mirror``); ``as_id``: registered in ``src`` as a receiver (gc there keeps what it needs).
    With ``workers``, each step's objects are copied by tasks mapped over batches
    on that Dask cluster (the marker last, by the flow)."""
    refuse_credentials(src_storage_options, "src_storage_options")
    refuse_credentials(dst_storage_options, "dst_storage_options")
    with tags(*_mirror_tags(src, dst)), cluster.entered(workers) as mapped_on:
        result = run_mirror(str(src), str(dst), step, src_storage_options, dst_storage_options,
                            PrefectRunner(mapped_on), as_id=as_id, io_workers=io_workers, group_bytes=group_bytes)
    get_run_logger().info("mirrored steps %s to %s (%s, %s); already there: %d", result.copied_steps, dst,
                          plural(result.objects_copied, "object"), plural(result.bytes_copied, "byte"),
                          len(result.present_steps))
    return asdict(result)


@_dcr_flow("dcr-fleet", _fleet_name, _fleet_tags)
def fleet_refit(root: str, engines: list[str], step: int | None = None, name: str = "default",
                storage_options: dict | None = None, timeout: float = 600.0) -> dict:
    """Switch every vLLM server of fleet ``name`` to ``step`` (default: the newest live step), all or
    nothing (``dcr fleet``; ``flows.receive.fleet``): prepare-members, apply-members (and
    take-back-members when one fails), record-fleet as tasks; a table artifact of the members."""
    refuse_credentials(storage_options)
    with tags(*_fleet_tags(root, name)):
        try:
            result = run_fleet(str(root), list(engines), step, name, storage_options, PrefectRunner(), timeout)
        except FleetSwitchError as e:
            _best_effort(_report_fleet, e.result)
            raise
    _best_effort(_report_fleet, result)
    return asdict(result)


def _report_fleet(r: FleetResult) -> None:
    get_run_logger().info("fleet %s: %s; version %s (target %s)", r.fleet, r.outcome, r.version, r.target)
    create_table_artifact(
        [{"member": m["url"], "receiver": m["receiver"], "step": m["step"], "outcome": m["outcome"],
          "pause s": round(m["pause_seconds"], 3), "error": m.get("error") or ""} for m in r.members],
        key=f"dcr-fleet-{_slug(r.fleet)}", description=f"fleet {r.fleet}: {r.outcome}, version {r.version}",
    )


@_dcr_flow("dcr-gc", _gc_name, _gc_tags)
def gc_refit(root: str | Path, options: GcOptions, storage_options: dict | None = None) -> dict:
    """Delete the steps retention no longer keeps and attempts that can never commit (``dcr gc``)."""
    refuse_credentials(storage_options)
    with tags(*_gc_tags(root)):
        report = run_gc(str(root), options, storage_options, PrefectRunner())
    _best_effort(_report_gc, report)
    return asdict(report)


def _best_effort(report, *args) -> None:
    """Artifacts, the summary line and the run's final name come after the work is done (a step
    committed, a receive recorded): a Prefect API hiccup there must not fail the run."""
    try:
        report(*args)
    except Exception as e:  # noqa: BLE001 - reported, never raised
        logging.getLogger("dcr.prefect").warning("could not report the run to Prefect: %s: %s", type(e).__name__, e)


def _rename_run(name: str) -> None:
    """Name the current flow run after what it turned out to do (e.g. the step a receive reached)."""
    with get_client(sync_client=True) as client:
        client.update_flow_run(get_run_context().flow_run.id, name=name)


def _ratio(stored, full) -> str:
    return f"{stored / full:.4f}" if stored is not None and full else "-"


def _report_publish(root: str, storage_options: dict | None, r: PublishResult) -> None:
    s = r.summary
    seconds = sum(r.timings.values())
    get_run_logger().info(
        "committed step %d (%s%s): %s/%s tensors changed, %.3f%% of elements, %d of %d bytes stored (%s of full) in %.2f s",
        r.step, r.kind, "" if r.base_step is None else f" against step {r.base_step}", s.get("tensors_changed"),
        s.get("tensors"), 100 * s.get("change_rate", 0.0), s.get("bytes_stored", 0), s.get("bytes_full", 0),
        _ratio(s.get("bytes_stored"), s.get("bytes_full")), seconds,
    )
    create_table_artifact(
        [{"step": r.step, "kind": r.kind, "base": r.base_step, "attempt": r.attempt,
          "tensors changed": f"{s.get('tensors_changed')}/{s.get('tensors')}",
          "change rate %": round(100 * s.get("change_rate", 0.0), 4), "bytes stored": s.get("bytes_stored"),
          "bytes full": s.get("bytes_full"), "stored / full": _ratio(s.get("bytes_stored"), s.get("bytes_full")),
          "seconds": round(seconds, 3)},
         *({"step": f"task {name}", "seconds": round(t, 3)} for name, t in r.timings.items())],
        key="dcr-publish", description=f"step {r.step} committed (policy {r.policy_digest[:16]}); one row per task below",
    )
    manifest = f"{root.rstrip('/')}/{layout.manifest_key(r.step, r.attempt)}"
    marker = f"{root.rstrip('/')}/{layout.commit_key(r.step)}"
    create_markdown_artifact(
        f"# Step {r.step} ({r.kind})\n\n"
        f"- manifest: [`{manifest}`]({_link(manifest)})\n- commit marker: [`{marker}`]({_link(marker)})\n"
        f"- base step: {r.base_step if r.base_step is not None else '-'}; attempt `{r.attempt}`; "
        f"policy digest `{r.policy_digest}`\n"
        f"- inspect: `dcr show {root} --step {r.step}`\n",
        key=f"dcr-step-{r.step}", description=f"where step {r.step} lives",
    )


def _link(url: str) -> str:
    """A clickable form of an object's URL (local paths as file://)."""
    return url if "://" in url else Path(url).resolve().as_uri()


COMMITTED = "dcr.step.committed"  # the event a publish emits once its step is committed


def root_resource(root: str) -> str:
    """The ``prefect.resource.id`` of ROOT in DCR's events: what a deployment trigger matches."""
    return f"dcr.root.{root}"


def _announce_commit(root: str, r: PublishResult) -> None:
    """Emit ``dcr.step.committed`` for ROOT: the receiver deployment (``infra/prefect.yaml``) is
    triggered by it, so receivers run when there is a step to take and not on an idle schedule."""
    emit_event(event=COMMITTED, resource={"prefect.resource.id": root_resource(root), "dcr.step": str(r.step)},
               payload={"step": r.step, "kind": r.kind, "policy_digest": r.policy_digest})


def _report_receive(root: str, storage_options: dict | None, receiver_id: str, r: dict) -> None:
    _rename_run(f"receive-{receiver_id}-to-{r['step']}")
    try:
        latest = Catalog(open_root(root, storage_options or {})).latest_committed()
    except DCRError:  # the report is best effort: the receive itself is done and recorded
        latest = None
    lag = "-" if latest is None else max(0, latest - r["step"])
    moves = ", ".join(r["moves"]) or "already there"
    pause = r.get("pause_seconds")
    behind = "- steps" if lag == "-" else plural(lag, "step")
    get_run_logger().info("receiver %s at step %d (%s; pulled %s; %s behind the latest)",
                          receiver_id, r["step"], moves, plural(r["bytes_pulled"], "byte"), behind)
    if not r["moves"]:  # nothing happened: the log line says so; no artifact for a run with nothing to show
        return
    create_table_artifact(
        [{"receiver": receiver_id, "from": r["from_step"], "to": r["step"], "latest": latest, "lag (steps)": lag,
          "moves": moves, "bytes pulled": r["bytes_pulled"],
          "pause window s": "-" if pause is None else round(pause, 4),
          "seconds": round(sum(r["timings"].values()), 3)},
         *({"receiver": f"task {name}", "seconds": round(t, 3)} for name, t in r["timings"].items())],
        key=f"dcr-receive-{_slug(receiver_id)}", description=f"receiver {receiver_id} at step {r['step']}",
    )


def _report_verify(report: VerifyReport) -> None:
    get_run_logger().info("verify %s: %s, %s, %s checked, %s", "FAILED" if report.errors else "ok",
                          plural(len(report.steps), "step"), plural(report.chunks, "chunk"), plural(report.bytes, "byte"),
                          plural(len(report.errors), "error"))
    create_table_artifact(
        [{"steps": ", ".join(map(str, report.steps)) or "-", "chunks": report.chunks, "bytes": report.bytes,
          "deep": report.deep, "replayed": ", ".join(map(str, report.replayed)) or "-",
          "errors": len(report.errors)},
         *({"steps": "error", "chunks": e} for e in report.errors)],
        key="dcr-verify", description="what verify checked" + (" (FAILED)" if report.errors else ""),
    )


def _report_gc(report: GcReport) -> None:
    p = report.plan
    get_run_logger().info("gc: deleted %s and %s (%s); kept %s", plural(len(report.deleted_steps), "step"),
                          plural(len(report.deleted_attempts), "attempt"), plural(p.bytes_freed, "byte"),
                          plural(len(p.keep), "step"))
    create_table_artifact(
        [{"deleted steps": ", ".join(map(str, report.deleted_steps)) or "-",
          "deleted attempts": len(report.deleted_attempts), "bytes freed": p.bytes_freed,
          "kept steps": ", ".join(map(str, p.keep)) or "-", "dry run": report.dry_run}],
        key="dcr-gc", description="what gc deleted",
    )
