"""The deployments of ``infra/prefect.yaml``: served from one process (``dcr serve``), or applied
to a work pool by ``prefect deploy``, from the same file.

``{{ $NAME }}`` values are taken from the environment by Prefect's templating, as ``prefect deploy``
does; an unset variable is an error naming it (an empty parameter would only fail later, in every
run).

``check_deployment`` (below) is the file's build step: ``prefect deploy`` runs it before it creates or
updates each deployment, so a deployment is either valid or refused at deploy time (an unset or
malformed setting stops the deploy, naming it), and the runs an earlier deploy already scheduled
(late ones included, which the server keeps on an update) are deleted: no run keeps old parameters.

``dcr serve`` names its deployments ``serve-<name>`` so that a work pool's deployments (from
``prefect deploy``) and a served process never overwrite each other.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.events import DeploymentEventTrigger
from prefect.exceptions import ObjectNotFound
from prefect.utilities.templating import ENV_VAR_PLACEHOLDER_PREFIX, PlaceholderType, apply_values, find_placeholders

from dcr_core.errors import UsageError
from storage import layout
from storage.root import check_root_url

DEFAULT_FILE = Path(__file__).resolve().parent.parent / "infra" / "prefect.yaml"


def _filled(value):
    """``value`` with every ``{{ $NAME }}`` replaced by the environment's NAME, by Prefect's own templating
    (what ``prefect deploy`` does with the file); each DCR setting it names checked first (``check_values``)."""
    names = {p.name.removeprefix(ENV_VAR_PLACEHOLDER_PREFIX) for p in find_placeholders(value)
             if p.type is PlaceholderType.ENV_VAR}
    check_values(names)
    return apply_values(value, os.environ, remove_notset=False)


def _flow(entrypoint: str):
    path, _, name = entrypoint.partition(":")
    module = path.removesuffix(".py").replace("/", ".")
    return getattr(importlib.import_module(module), name)


def specs(path: str | os.PathLike = DEFAULT_FILE) -> list[dict]:
    with open(path) as f:
        doc = yaml.safe_load(f)
    if not isinstance(doc, dict) or not isinstance(doc.get("deployments"), list):
        raise UsageError(f"{path}: not a prefect.yaml with a list of deployments")
    return doc["deployments"]


SERVE_PREFIX = "serve-"


def deployments(path: str | os.PathLike = DEFAULT_FILE, names: list[str] | None = None) -> list:
    """``RunnerDeployment`` objects of the file's deployments (all, or those in ``names``), named
    ``serve-<name>``: what ``dcr serve`` serves."""
    out = []
    for spec in specs(path):
        if names and spec["name"] not in {n.removeprefix(SERVE_PREFIX) for n in names}:
            continue
        params, run_tags = _filled(spec.get("parameters") or {}), _filled(spec.get("tags") or [])
        interval = next((s["interval"] for s in spec.get("schedules") or [] if "interval" in s), None)
        triggers = [DeploymentEventTrigger(**{k: v for k, v in t.items() if k != "type"})
                    for t in _filled(spec.get("triggers") or [])]
        out.append(_flow(spec["entrypoint"]).to_deployment(
            name=SERVE_PREFIX + spec["name"], parameters=params, interval=interval, description=spec.get("description"),
            tags=run_tags, concurrency_limit=spec.get("concurrency_limit"), triggers=triggers or None,
        ))
    missing = {n.removeprefix(SERVE_PREFIX) for n in names or []} - {spec["name"] for spec in specs(path)}
    if missing:
        raise UsageError(f"{path}: no deployment named {sorted(missing)[0]!r}")
    return out


def check_values(names) -> None:
    """The DCR settings among ``names`` (environment variables), each set and well-formed."""
    for name in sorted(names):
        value = os.environ.get(name, "").strip()
        if not value:
            raise UsageError(f"{name} is not set; the deployment needs it (docs/guides/prefect.md, \"Deployments\")")
        if name == "DCR_ROOT":
            check_root_url(value)
        elif name == "DCR_RECEIVER_ID":
            layout.check_receiver(value)
        elif name == "DCR_RECEIVER_STATE" and not os.path.isabs(value):
            raise UsageError(f"DCR_RECEIVER_STATE={value!r} must be an absolute path (runs start in DCR_PROJECT_DIR)")
        elif name == "DCR_PROJECT_DIR" and not os.path.isfile(os.path.join(value, "infra", "prefect.yaml")):
            raise UsageError(f"DCR_PROJECT_DIR={value!r} is not a DCR checkout (no infra/prefect.yaml there)")


def check_deployment(deployment: str, needs: list[str]) -> dict:
    """``prefect deploy``'s build step for ``deployment`` (``flow-name/deployment-name``): refuse the
    deploy unless every setting in ``needs`` is set and well-formed, then delete the deployment's
    runs that are scheduled and not started (they carry the parameters of the previous deploy)."""
    try:
        check_values(needs)
    except UsageError as e:
        print(f"dcr: error: refusing to deploy {deployment}: {e}", file=sys.stderr, flush=True)  # above Prefect's traceback
        raise ValueError(f"refusing to deploy {deployment}: {e}") from None
    deleted = 0
    with get_client(sync_client=True) as client:
        try:
            existing = client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            return {"stale_runs_deleted": 0}
        seen: set = set()
        while True:  # page by page (the server returns at most 200 runs per read)
            runs = [r for r in client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[existing.id])),
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))),
                limit=200,
            ) if r.id not in seen]
            if not runs:
                break
            for run in runs:
                seen.add(run.id)
                if run.run_count == 0:
                    client.delete_flow_run(run.id)
                    deleted += 1
    if deleted:
        print(f"{deployment}: deleted {deleted} scheduled runs of the previous deploy (they carried its parameters)")
    return {"stale_runs_deleted": deleted}
