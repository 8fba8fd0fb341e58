"""``dcr serve [--prefect-file F] [--deployment NAME ...]``: serve DCR's deployments from one process."""

from __future__ import annotations

from prefect import serve

from flows.deployments import DEFAULT_FILE, deployments


def add_arguments(name: str, p) -> None:
    p.add_argument("--prefect-file", default=str(DEFAULT_FILE), help="the deployment source (default infra/prefect.yaml)")
    p.add_argument("--deployment", action="append", default=None, metavar="NAME",
                   help="serve only this deployment (repeatable; default: all of the file's)")


def run(name: str, args) -> int:
    serve(*deployments(args.prefect_file, args.deployment))
    return 0
