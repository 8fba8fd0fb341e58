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
from storage.chunk_io import IO_WORKERS
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
    p.add_argument("--io-workers", type=WORKERS, default=IO_WORKERS,
                   help=f"parallel object reads/writes (default {IO_WORKERS})")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")


def model_default(model: type, field: str):
    """The default of ``field`` in the typed options model ``model`` (``flows.options``): the one
    source of the default of the option that sets it (the caller imports the model: this module
    imports no pydantic, for the bucket commands)."""
    return model.model_fields[field].get_default(call_default_factory=True)


def from_model(model: type, field: str, help: str | None = None) -> dict:
    """``default`` and ``help`` of the option that sets ``model.field``: the model's default, and the
    field's description (or ``help``, where the command says more) followed by that default."""
    default = model_default(model, field)
    text = help or model.model_fields[field].description
    return {"default": default, "help": f"{text} (default {default_text(default)})".replace("%", "%%")}


def default_text(value) -> str:
    """A default as help text shows it: whole MiB as such, numbers short (3600, not 3600.0)."""
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 20} MiB"
    return f"{value:g}" if isinstance(value, float) else str(value)


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
