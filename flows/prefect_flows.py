"""The Prefect flows, every parameter JSON (what a deployment, the UI and ``prefect deploy``
validate): ``publish_checkpoint`` (``dcr-publish-refit``), ``receive_state`` (``dcr-receive-refit``),
``materialize_refit``, ``verify_refit``, ``mirror_refit``, ``fleet_refit`` and ``gc_refit``; and
``publish_refit`` and ``receive_refit``, the Python entry points.

Objects that live in the caller's process (a trainer's tensors or shards, a live module, a vLLM
``LLM``) are not flow parameters: ``publish_refit`` and ``receive_refit`` are plain functions that
run a path through the flows above, and hold an object for the run while its flow
(``publish_held``, ``receive_live``) takes a ``LocalRef`` to it (``flows.local_refs``: a key that
resolves only in this process). Dask clusters are named by ``workers`` (N local worker processes or
``dask://HOST:PORT``), never passed as objects.

Each flow runs the same pipeline as the in-process form (``flows.publish.pipeline`` and friends)
with ``PrefectRunner`` (``flows.orchestration.runner``): every step of the step table becomes a
Prefect task, so the Prefect API shows each step's state and duration. Tasks take and return
references (``flows.steps``), never tensors or open files (JSON-serializable:
``tests/system/test_prefect_flows.py``); the flows' options are the typed models of
``flows.options`` (deployments pass them as mappings, validated by Prefect). Runs are named and
tagged (``flows.orchestration.runs``) and leave artifacts (``flows.orchestration.reports``); what a
rerun of a flow run can reuse, and why nothing else is kept, is in ``flows.orchestration.task_cache``.
This file is the deployments' entrypoint (``infra/prefect.yaml``: ``flows/prefect_flows.py:<flow>``).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

# Dask workers preload this module as they start (``dask worker --preload flows.prefect_flows``;
# ``--workers N`` preloads it on its LocalCluster): a worker unpickles the flow with each task's run
# context, and runs the mapped steps (publish.encode, receive.on_workers, maintenance.audit and
# mirror, all imported above), so importing it once then keeps about 2 s out of each worker's first
# task. Prefect's task engine is loaded here for the same reason.
import prefect.task_engine  # noqa: F401 - loaded with the flows: a worker's first task does not import it
from prefect import get_run_logger, tags

from dcr_core.errors import UsageError
from dcr_core.text import plural
from flows import local_refs
from flows import workers as cluster
from flows.local_refs import LocalRef
from flows.maintenance.audit import verify
from flows.maintenance.gc import run_gc
from flows.maintenance.mirror import run_mirror
from flows.options import GcOptions, PublishOptions, ReceiveOptions, refuse_credentials
from flows.orchestration import reports, runs
from flows.orchestration.runner import PrefectRunner
from flows.orchestration.runs import dcr_flow
from flows.orchestration.task_cache import run_attempt
from flows.publish.pipeline import run_publish
from flows.receive import receiver as receivers
from flows.receive.fleet import FleetSwitchError, run_fleet
from flows.receive.pipeline import run_materialize, run_receive
from flows.results import as_dict
from storage.chunk_io import IO_WORKERS
from storage.root import open_root

# Not imported here: the receiver kinds of live targets (a module with ``load_weights``, a vLLM
# engine) import torch (2-3 s). The receivers' registry (``flows.receive.receiver``) imports a kind
# when it refits a target of it (its caller holds torch already). This module is imported by every
# Prefect-orchestrated command and by every Dask worker, which unpickles the flow with each task.


@dcr_flow("dcr-publish-refit", runs.publish_name, runs.publish_tags)
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
    with tags(*runs.publish_tags(root, step)), cluster.entered(workers) as mapped_on:
        result = run_publish(str(root), str(source), step, keyframe, storage_options, options,
                             PrefectRunner(mapped_on), run_attempt(attempt))
    reports.best_effort(reports.report_publish, str(root), storage_options, result)
    reports.best_effort(reports.announce_commit, str(root), result)
    return asdict(result)


@dcr_flow("dcr-publish-held", runs.publish_name, runs.publish_tags)
def publish_held(
    root: str, source: LocalRef, step: int, keyframe: bool = False, storage_options: dict | None = None,
    options: PublishOptions | None = None, attempt: str | None = None,
) -> dict:
    """Publish tensors held in this process as ``step`` of ``root``: ``source`` is the reference
    (``flows.local_refs``) of a name -> tensor mapping, of this rank's ``ShardedSource`` or of a
    list of every rank's. Called by ``publish_refit``, which holds the object for the run."""
    refuse_credentials(storage_options)
    with tags(*runs.publish_tags(root, step)):
        result = run_publish(str(root), local_refs.get(source), step, keyframe, storage_options, options,
                             PrefectRunner(), attempt)
    reports.best_effort(reports.report_publish, str(root), storage_options, result)
    reports.best_effort(reports.announce_commit, str(root), result)
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


@dcr_flow("dcr-receive-refit", runs.receive_name, runs.receive_tags)
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
    with tags(*runs.receive_tags(root, receiver_id)), cluster.entered(workers) as mapped_on:
        result = as_dict(run_receive(str(root), receiver_id, str(state), step, storage_options, options,
                                     PrefectRunner(mapped_on)))
    reports.best_effort(reports.report_receive, str(root), storage_options, receiver_id, result)
    return result


@dcr_flow("dcr-receive-live", runs.receive_name, runs.receive_tags)
def receive_live(
    root: str, receiver_id: str, target: LocalRef, step: int | None = None, storage_options: dict | None = None,
    options: ReceiveOptions | None = None, state_path: str | None = None,
) -> dict:
    """Bring a target held in this process to ``step``: ``target`` is the reference
    (``flows.local_refs``) of a running vLLM engine started with DCR's worker extension
    (``state_path``: each worker's mirror) or of a live module with ``load_weights``
    (``state_path``: its partial mirror). Called by ``receive_refit``, which holds the target."""
    refuse_credentials(storage_options)
    with tags(*runs.receive_tags(root, receiver_id)):  # the target's kind from the receivers' registry
        result = receivers.refit(local_refs.get(target), str(root), receiver_id, step, storage_options, options,
                                 state_path, runner=PrefectRunner())
    reports.best_effort(reports.report_receive, str(root), storage_options, receiver_id, result)
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


@dcr_flow("dcr-materialize", runs.materialize_name, runs.materialize_tags)
def materialize_refit(
    root: str | Path, step: int | None, out: str | Path, storage_options: dict | None = None,
    options: ReceiveOptions | None = None, workers: int | str | None = None, force: bool = False,
) -> dict:
    """Write the full checkpoint of committed ``step`` (default: the latest) to ``out``
    (``dcr materialize``); with ``workers``, as tasks mapped over groups of
    tensors on that Dask cluster (``flows.receive.on_workers``: the workers must see ``out``).
    ``force``: replace ``out`` even if DCR did not write it."""
    refuse_credentials(storage_options)
    with tags(*runs.materialize_tags(root)), cluster.entered(workers) as mapped_on:
        result = as_dict(run_materialize(str(root), step, str(out), storage_options, options, PrefectRunner(mapped_on),
                                         force=force))
    get_run_logger().info("wrote step %d to %s (%d bytes pulled)", result["step"], out, result["bytes_pulled"])
    return result


@dcr_flow("dcr-verify", runs.verify_name, runs.verify_tags)
def verify_refit(
    root: str | Path, step: int | None = None, deep: bool = False, storage_options: dict | None = None,
    io_workers: int = IO_WORKERS, workers: int | str | None = None, group_bytes: int | None = None,
) -> dict:
    """Re-read the stored chunks of ``step`` (default: every committed step) and check them against
    their digests (``dcr verify``; ``deep``: deltas replayed too); with ``workers``, each step's tensors are checked in groups on that Dask cluster. Returns the
    report: a failed check is in ``errors``, not raised."""
    refuse_credentials(storage_options)
    with tags(*runs.verify_tags(root)), cluster.entered(workers) as mapped_on:
        report = verify(open_root(str(root), storage_options or {}), step, deep, io_workers,
                        PrefectRunner(mapped_on), group_bytes)
    reports.best_effort(reports.report_verify, report)
    return asdict(report)


@dcr_flow("dcr-mirror", runs.mirror_name, runs.mirror_tags)
def mirror_refit(src: str, dst: str, step: int | None = None, src_storage_options: dict | None = None,
                 dst_storage_options: dict | None = None, as_id: str | None = None,
                 io_workers: int = IO_WORKERS, workers: int | str | None = None, group_bytes: int | None = None) -> dict:
    """Copy committed steps (``step``, or all newer than ``dst``'s newest) from ROOT ``src`` to ROOT
    ``dst`` (``dcr mirror``); ``as_id``: registered in ``src`` as a receiver (gc there keeps what it needs).
    With ``workers``, each step's objects are copied by tasks mapped over batches
    on that Dask cluster (the marker last, by the flow)."""
    refuse_credentials(src_storage_options, "src_storage_options")
    refuse_credentials(dst_storage_options, "dst_storage_options")
    with tags(*runs.mirror_tags(src, dst)), cluster.entered(workers) as mapped_on:
        result = run_mirror(str(src), str(dst), step, src_storage_options, dst_storage_options,
                            PrefectRunner(mapped_on), as_id=as_id, io_workers=io_workers, group_bytes=group_bytes)
    get_run_logger().info("mirrored steps %s to %s (%s, %s); already there: %d", result.copied_steps, dst,
                          plural(result.objects_copied, "object"), plural(result.bytes_copied, "byte"),
                          len(result.present_steps))
    return asdict(result)


@dcr_flow("dcr-fleet", runs.fleet_name, runs.fleet_tags)
def fleet_refit(root: str, engines: list[str], step: int | None = None, name: str = "default",
                storage_options: dict | None = None, timeout: float = 600.0, wait: float = 0.0) -> dict:
    """Switch every vLLM server of fleet ``name`` to ``step`` (default: the newest live step), all or
    nothing (``dcr fleet``; ``flows.receive.fleet``), once it holds the fleet's lease (waiting up
    to ``wait`` seconds for another coordinator): prepare-members, apply-members (and
    take-back-members when one fails), read-back-members, record-fleet as tasks; a table artifact
    of the members."""
    refuse_credentials(storage_options)
    with tags(*runs.fleet_tags(root, name)):
        try:
            result = run_fleet(str(root), list(engines), step, name, storage_options, PrefectRunner(), timeout, wait)
        except FleetSwitchError as e:
            if e.result is not None:
                reports.best_effort(reports.report_fleet, e.result)
            raise
    reports.best_effort(reports.report_fleet, result)
    return asdict(result)


@dcr_flow("dcr-gc", runs.gc_name, runs.gc_tags)
def gc_refit(root: str | Path, options: GcOptions, storage_options: dict | None = None) -> dict:
    """Delete the steps retention no longer keeps and attempts that can never commit (``dcr gc``)."""
    refuse_credentials(storage_options)
    with tags(*runs.gc_tags(root)):
        report = run_gc(str(root), options, storage_options, PrefectRunner())
    reports.best_effort(reports.report_gc, report)
    return asdict(report)
