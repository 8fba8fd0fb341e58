"""Imported by each Dask worker process as it starts (``dask worker --preload flows.worker_setup``;
``--workers N`` preloads it on its LocalCluster): what a mapped DCR task needs (Prefect's task
engine, the encoder and its codecs, the receiver's and the maintenance tasks) is imported once per
worker then, not inside the first task each worker runs (about 2 s here, which would otherwise land
in the middle of a publish). A worker also unpickles the flow (``flows.prefect_flows``) with each
task's run context: it is preloaded too, and imports no torch (``tests/unit/test_layering.py``),
which would otherwise cost each worker's first task 2-3 s."""

from __future__ import annotations

import prefect.task_engine  # noqa: F401 - imported for its side effect: loaded before the first task

import flows.maintenance.audit
import flows.maintenance.mirror
import flows.prefect_flows
import flows.publish.encode
import flows.receive.on_workers  # noqa: F401
