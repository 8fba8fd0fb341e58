"""Serve the DCR deployments from one process: the receiver on an interval, the publisher on demand.

    python -m flows.serve ROOT --receiver ID --state PATH [--interval 30]

Needs ``PREFECT_API_URL`` (a Prefect server, e.g. ``infra/start-prefect.sh``).
"""

from __future__ import annotations

import argparse


def deployments(root: str, receiver_id: str, state: str, interval: float, storage_options: dict | None = None):
    from flows.prefect_flows import publish_refit, receive_refit

    receiver = receive_refit.to_deployment(
        name=f"receiver-{receiver_id}",
        interval=interval,
        parameters={"root": root, "receiver_id": receiver_id, "target": state, "storage_options": storage_options or {}},
        concurrency_limit=1,
    )
    publisher = publish_refit.to_deployment(
        name="publisher", parameters={"root": root, "storage_options": storage_options or {}}, concurrency_limit=1
    )
    return [receiver, publisher]


def main(argv: list[str] | None = None) -> int:
    from prefect import serve

    from storage.root import parse_storage_options

    p = argparse.ArgumentParser(prog="python -m flows.serve", description=__doc__.splitlines()[0])
    p.add_argument("root")
    p.add_argument("--receiver", required=True)
    p.add_argument("--state", required=True)
    p.add_argument("--interval", type=float, default=30.0, help="seconds between receiver runs")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    serve(*deployments(args.root, args.receiver, args.state, args.interval, parse_storage_options(args.storage_option)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
