"""The house rules, checked on the source: data flows one way (dcr_core <- storage <- flows <-
flows.cli), no import cycles, no imports hidden in functions (except optional heavy dependencies,
listed here), no torch where only bits move, and nothing changes the process when imported."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("dcr_core", "storage", "flows")
# Imports allowed inside functions: optional heavy dependencies, loaded only by the paths that need them.
LAZY_OK = {
    "gcsfs.core",  # storage.backends.gcs: only GCS ROOTs
    "torch.distributed.tensor", "torch.distributed.tensor._utils",  # flows.publish.shards: only FSDP2 (DTensor) callers
    "flows.cli.orchestrated",  # flows.cli: Prefect only with --orchestrator prefect
    "storage.fleet",  # flows.cli.bucket: fleet records (pydantic) for dcr status only; ls and verify start without
    "ctypes",  # flows.cli: only on Linux
    "importlib.metadata",  # flows.cli: only to list plugins (25 ms of every command's start otherwise)
    "prefect.server.api.server",  # flows.cli.orchestrated: a local API for --workers only (1.3 s to import)
    # flows.workers: Dask only when workers are asked for
    "prefect_dask", "distributed", "distributed.comm.core", "distributed.scheduler", "prefect.context",
    # flows.receive.vllm_apply and vllm_fixups: only inside a vLLM worker
    "vllm.config", "vllm.model_executor.model_loader.reload", "vllm.model_executor.layers.attention",
    # flows.receive.vllm_plugin (run by vLLM in its processes) and vllm_transfer (the engine inside them)
    "vllm.distributed.weight_transfer.factory", "vllm.distributed", "vllm.model_executor.model_loader.reload.inplace",
}
# Modules that exist only inside a vLLM process: the dcr weight-transfer engine subclasses vLLM's
# WeightTransferEngine at import (tested by make test-vllm, where vLLM is installed).
VLLM_ONLY = {"flows.receive.vllm_transfer"}
# Which top-level layers each layer may import (its own included).
ALLOWED = {"dcr_core": {"dcr_core"}, "storage": {"dcr_core", "storage"}, "flows": {"dcr_core", "storage", "flows"}}
# Inside flows: the domains do not import each other; only the orchestration, the CLI and the Dask
# workers' preload combine them.
DOMAINS = ("flows.publish", "flows.receive", "flows.maintenance")
COMBINERS = ("flows.prefect_flows", "flows.orchestration", "flows.cli", "flows.deployments", "flows.__init__")
PREFECT_FLOWS = COMBINERS[:2]  # the flows and what they are made of: imported by combiners only


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            name = ".".join(rel.parts)
            out[name.removesuffix(".__init__") if name.endswith(".__init__") else name] = path
    return out


def _resolve(node: ast.ImportFrom | ast.Import, module: str, is_pkg: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        parts = parts if is_pkg else parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    known = modules()
    out = []
    for a in node.names:  # `from pkg import submodule` imports the submodule
        sub = f"{base}.{a.name}"
        out.append(sub if sub in known else base)
    return out


def imports(name: str, path: Path) -> tuple[set[str], list[tuple[str, int]]]:
    """Module-level imports, and (name, line) of imports inside functions."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    top: set[str] = set()
    lazy: list[tuple[str, int]] = []

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _resolve(child, name, is_pkg):
                    (lazy.append((target, child.lineno)) if in_function else top.add(target))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True)
            else:
                visit(child, in_function)

    visit(tree, False)
    return top, lazy


def _project(target: str) -> str | None:
    return target if target.split(".")[0] in PACKAGES else None


def test_every_layer_imports_only_the_layers_below_it():
    bad = []
    for name, path in modules().items():
        layer = name.split(".")[0]
        top, lazy = imports(name, path)
        for target in top | {t for t, _ in lazy}:
            if _project(target) and target.split(".")[0] not in ALLOWED[layer]:
                bad.append(f"{name} imports {target}")
            if name.startswith(DOMAINS) and target.startswith(DOMAINS) and target.split(".")[1] != name.split(".")[1]:
                bad.append(f"{name} (a domain) imports {target} (another domain)")
            if target.startswith("flows.cli") and not name.startswith("flows.cli"):
                bad.append(f"{name} imports the CLI ({target})")
            if target.startswith(PREFECT_FLOWS) and not name.startswith(COMBINERS):
                bad.append(f"{name} imports the Prefect flows ({target})")
    assert not bad, "\n".join(bad)


def test_no_imports_hidden_in_functions_except_optional_heavy_dependencies():
    bad = []
    for name, path in modules().items():
        _, lazy = imports(name, path)
        bad += [f"{path.relative_to(REPO)}:{line} imports {t} inside a function" for t, line in lazy if t not in LAZY_OK]
    assert not bad, "\n".join(bad)


def test_the_import_graph_has_no_cycles():
    known = modules()
    graph = {name: {t for t in imports(name, path)[0] if t in known and t != name} for name, path in known.items()}
    for name in known:  # a package's __init__ runs before its submodules: the parent is an edge too
        parent = name.rpartition(".")[0]
        if parent in known:
            graph[name].add(parent)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycle = stack[stack.index(m):] + [m]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)


def _import_report(mods: list[str]) -> dict:
    code = (
        "import json, os, sys\n"
        "before = dict(os.environ)\n"
        "import numcodecs.blosc as b\n"
        "import zarr\n"  # zarr sets numcodecs.blosc.use_threads itself when imported: not DCR's doing
        "threads = (b.use_threads, b.get_nthreads())\n"
        f"for m in {mods!r}: __import__(m)\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'prefect': 'prefect' in sys.modules,\n"
        "  'environ_changed': sorted(k for k in set(os.environ) | set(before) if os.environ.get(k) != before.get(k)),\n"
        "  'blosc_changed': threads != (b.use_threads, b.get_nthreads())}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


BITS_ONLY = [  # what bucket-only commands and state-file receivers load
    "dcr_core", "dcr_core.chain", "dcr_core.codec", "dcr_core.delta", "dcr_core.digest", "dcr_core.dtypes",
    "dcr_core.events", "dcr_core.projection", "dcr_core.retention", "dcr_core.shard_spec", "dcr_core.sparse",
    *[m for m in modules() if m.startswith("storage")],
    "flows", "flows.cli", "flows.cli.bucket", "flows.cli.gc", "flows.cli.receive", "flows.receive.pipeline", "flows.maintenance.gc",
    "flows.maintenance.audit", "flows.options", "flows.steps",
]


def test_bucket_commands_and_state_file_receivers_import_neither_torch_nor_prefect():
    report = _import_report(BITS_ONLY)
    assert not report["torch"] and not report["prefect"], report


def test_dask_workers_import_no_torch():
    """A worker runs bits-only tasks: it preloads the flows module (``flows.prefect_flows``), which it also unpickles
    (``flows.prefect_flows``) with every task's run context; torch there would cost each worker's
    first task 2-3 s."""
    report = _import_report(["flows.prefect_flows"])
    assert not report["torch"], report


def test_importing_the_runtime_changes_nothing_in_the_process():
    report = _import_report(sorted(m for m in modules() if m != "flows.cli.__main__" and m not in VLLM_ONLY))
    assert report["environ_changed"] == [] and not report["blosc_changed"], report


def test_every_command_module_exists_and_the_plugins_are_registered():
    from importlib.metadata import entry_points

    from flows.cli import COMMANDS, PLUGIN_GROUP

    for name, (module, _) in COMMANDS.items():
        assert module in modules(), name
    assert {"bench", "demo"} <= {ep.name for ep in entry_points(group=PLUGIN_GROUP)}
    assert os.path.exists(REPO / "infra" / "prefect.yaml")
