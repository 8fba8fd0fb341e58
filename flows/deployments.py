"""The deployments of ``infra/prefect.yaml`` as Prefect objects, so one process can serve them
(``dcr serve``) from the same file ``prefect deploy`` applies to a work pool: one source.

``{{ $NAME }}`` values are taken from the environment, as ``prefect deploy`` does; an unset
variable is an error naming it (an empty parameter would only fail later, in every run).
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

import yaml

from dcr_core.errors import UsageError

DEFAULT_FILE = Path(__file__).resolve().parent.parent / "infra" / "prefect.yaml"
_TEMPLATE = re.compile(r"\{\{\s*\$([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def _fill(value, used: set[str]):
    """``value`` with every ``{{ $NAME }}`` replaced by the environment's NAME."""
    if isinstance(value, dict):
        return {k: _fill(v, used) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, used) for v in value]
    if not isinstance(value, str):
        return value

    def env(m: re.Match) -> str:
        name = m.group(1)
        used.add(name)
        if not os.environ.get(name):
            raise UsageError(f"deployment parameter {value!r} needs the environment variable {name}; set it")
        return os.environ[name]

    return _TEMPLATE.sub(env, value)


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


def deployments(path: str | os.PathLike = DEFAULT_FILE, names: list[str] | None = None) -> list:
    """``RunnerDeployment`` objects of the file's deployments (all, or those in ``names``)."""
    out = []
    for spec in specs(path):
        if names and spec["name"] not in names:
            continue
        used: set[str] = set()
        params = _fill(spec.get("parameters") or {}, used)
        interval = next((s["interval"] for s in spec.get("schedules") or [] if "interval" in s), None)
        out.append(_flow(spec["entrypoint"]).to_deployment(
            name=spec["name"], parameters=params, interval=interval, description=spec.get("description"),
            tags=spec.get("tags"), concurrency_limit=spec.get("concurrency_limit"),
        ))
    missing = set(names or []) - {d.name for d in out}
    if missing:
        raise UsageError(f"{path}: no deployment named {sorted(missing)[0]!r}")
    return out
