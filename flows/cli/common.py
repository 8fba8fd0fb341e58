"""What every ``dcr`` command shares: common options, printing, the choice of orchestrator."""

from __future__ import annotations

import argparse
import json
import os

from dcr_core.errors import UsageError
from dcr_core.text import printable
from flows.cli.values import WORKERS, Number
from storage import layout
from storage.backends import registry
from storage.root import parse_storage_options

step_arg = Number(int, 0, layout.MAX_STEP)  # a step number, as ROOT's keys can hold it


def add_common(p: argparse.ArgumentParser, orchestrated: bool = False) -> None:
    p.add_argument("root", help=f"the bucket: {registry.forms()}")
    p.add_argument(
        "--storage-option", action="append", default=[], metavar="KEY=VALUE",
        help="extra fsspec option for ROOT (repeatable), e.g. endpoint_url=http://127.0.0.1:9000",
    )
    if orchestrated:
        p.add_argument(
            "--orchestrator", choices=("none", "prefect", "auto"), default=os.environ.get("DCR_ORCHESTRATOR") or "none",
            help="run in-process (none, the default; or $DCR_ORCHESTRATOR) or as a Prefect flow run against "
            "PREFECT_API_URL (prefect); auto: prefect when PREFECT_API_URL is set",
        )
    p.add_argument("--io-workers", type=WORKERS, default=8, help="parallel object reads/writes (default 8)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")


def add_workers(p: argparse.ArgumentParser, what: str) -> None:
    """``--workers N|dask://HOST:PORT`` (``flows.workers``): ``what`` runs as Prefect tasks mapped on a Dask cluster."""
    p.add_argument(
        "--workers", default=None, metavar="N|dask://HOST:PORT",
        help=f"{what} on a Dask cluster, as Prefect tasks mapped over groups: N worker processes on this machine (a "
        "LocalCluster on 127.0.0.1), or the scheduler at dask://HOST:PORT (its workers must reach what the command "
        "reads and writes, and PREFECT_API_URL); runs the command as a Prefect flow. Default: in this process",
    )


def storage_options(args) -> dict:
    return parse_storage_options(args.storage_option)


def use_prefect(args) -> bool:
    if args.orchestrator not in ("none", "prefect", "auto"):  # from $DCR_ORCHESTRATOR: argparse checks only given values
        raise UsageError(f"DCR_ORCHESTRATOR={args.orchestrator!r} must be none, prefect or auto")
    if args.orchestrator == "prefect":
        return True
    return args.orchestrator == "auto" and bool(os.environ.get("PREFECT_API_URL"))


def say(args, human: str, data) -> None:
    if args.quiet:
        return
    if args.json:  # JSON escapes control characters itself
        print(json.dumps(data, indent=1, default=str), flush=True)
    else:  # names and times from the bucket, escaped (the formatters escape line breaks within a field)
        print(printable(human, newlines=True), flush=True)
