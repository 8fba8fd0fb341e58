"""DCR's orchestration: the refit pipelines, their Prefect flows, and the ``dcr`` command.

The public API, importable from here (loaded on first use: Prefect and torch are slow to import)::

    from flows import publish_refit, receive_refit, gc_refit        # Prefect flows
    from flows import materialize_refit, verify_refit               # (with workers=: on a Dask cluster)
    from flows import mirror_refit, run_mirror, receive_nearest     # a relay tree of ROOTs
    from flows import run_retract                                   # take back the newest step(s)
    from flows import run_fleet, fleet_refit                        # one step across vLLM servers
    from flows import register_fleet_engine                         # an in-process LLM as a member
    from flows import run_publish, run_receive, run_materialize     # the same pipelines, in-process
    from flows import follow_receive                                # follow ROOT (streaming with stream=True)
    from flows import receive_into_module, Publisher                # a live module; a trainer's publisher
    from flows import PublishOptions, ReceiveOptions, GcOptions     # typed options
    from flows import Shard, ShardedSource, dtensor_pieces          # training shards
    from flows import consistent_state                              # read a state file safely
"""

from __future__ import annotations

import importlib

_PUBLIC = {
    "publish_refit": "flows.prefect_flows",
    "receive_refit": "flows.prefect_flows",
    "gc_refit": "flows.prefect_flows",
    "mirror_refit": "flows.prefect_flows",
    "materialize_refit": "flows.prefect_flows",
    "verify_refit": "flows.prefect_flows",
    "run_mirror": "flows.maintenance.mirror",
    "run_fleet": "flows.receive.fleet",
    "register_fleet_engine": "flows.receive.fleet_members",
    "fleet_refit": "flows.prefect_flows",
    "run_retract": "flows.maintenance.retract",
    "receive_nearest": "flows.receive.nearest",
    "PrefectRunner": "flows.orchestration.runner",
    "run_publish": "flows.publish.pipeline",
    "Publisher": "flows.publish.publisher",
    "run_receive": "flows.receive.pipeline",
    "run_materialize": "flows.receive.pipeline",
    "follow_receive": "flows.receive.follow",
    "receive_into_module": "flows.receive.module_pipeline",
    "PublishOptions": "flows.options",
    "ReceiveOptions": "flows.options",
    "GcOptions": "flows.options",
    "Shard": "flows.publish.shards",
    "ShardedSource": "flows.publish.shards",
    "dtensor_pieces": "flows.publish.shards",
    "consistent_state": "storage.local.state",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'flows' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
