"""The build step of ``infra/prefect.yaml``'s deployments: ``prefect deploy`` runs it before it
creates or updates each deployment (see ``flows.deployments``)."""

from __future__ import annotations

import sys

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectNotFound

from dcr_core.errors import UsageError
from flows.deployments import check_values


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
