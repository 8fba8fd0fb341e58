"""What a flow run leaves besides its result: a summary line in its log, table artifacts (one row
per task with its seconds), a markdown artifact per published step (links to its manifest and
marker), the ``dcr.step.committed`` event that triggers receivers, and a receive run renamed to the
step it reached. All of it after the work is done, and best effort (``best_effort``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.client.orchestration import get_client
from prefect.context import get_run_context
from prefect.events import emit_event

from dcr_core.errors import DCRError
from dcr_core.text import plural
from flows.maintenance.audit import VerifyReport
from flows.maintenance.gc import GcReport
from flows.orchestration.runs import slug
from flows.receive.fleet import FleetResult
from flows.results import PublishResult
from storage import layout
from storage.catalog import Catalog
from storage.root import open_root


def best_effort(report, *args) -> None:
    """Artifacts, the summary line and the run's final name come after the work is done (a step
    committed, a receive recorded): a Prefect API hiccup there must not fail the run."""
    try:
        report(*args)
    except Exception as e:  # noqa: BLE001 - reported, never raised
        logging.getLogger("dcr.prefect").warning("could not report the run to Prefect: %s: %s", type(e).__name__, e)


def rename_run(name: str) -> None:
    """Name the current flow run after what it turned out to do (e.g. the step a receive reached)."""
    with get_client(sync_client=True) as client:
        client.update_flow_run(get_run_context().flow_run.id, name=name)


def _ratio(stored, full) -> str:
    return f"{stored / full:.4f}" if stored is not None and full else "-"


def report_publish(root: str, storage_options: dict | None, r: PublishResult) -> None:
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


def announce_commit(root: str, r: PublishResult) -> None:
    """Emit ``dcr.step.committed`` for ROOT: the receiver deployment (``infra/prefect.yaml``) is
    triggered by it, so receivers run when there is a step to take and not on an idle schedule."""
    emit_event(event=COMMITTED, resource={"prefect.resource.id": root_resource(root), "dcr.step": str(r.step)},
               payload={"step": r.step, "kind": r.kind, "policy_digest": r.policy_digest})


def report_receive(root: str, storage_options: dict | None, receiver_id: str, r: dict) -> None:
    rename_run(f"receive-{receiver_id}-to-{r['step']}")
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
        key=f"dcr-receive-{slug(receiver_id)}", description=f"receiver {receiver_id} at step {r['step']}",
    )


def report_verify(report: VerifyReport) -> None:
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


def report_gc(report: GcReport) -> None:
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


def report_fleet(r: FleetResult) -> None:
    get_run_logger().info("fleet %s: %s; version %s (target %s)", r.fleet, r.outcome, r.version, r.target)
    create_table_artifact(
        [{"member": m["url"], "receiver": m["receiver"], "step": m["step"], "outcome": m["outcome"],
          "pause s": round(m["pause_seconds"], 3), "error": m.get("error") or ""} for m in r.members],
        key=f"dcr-fleet-{slug(r.fleet)}", description=f"fleet {r.fleet}: {r.outcome}, version {r.version}",
    )
