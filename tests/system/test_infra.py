"""The infra/start-*.sh scripts as a new user runs them: no virtualenv activated, a clean PATH.
Each must start its server with the project's environment and print a working export line, and
fail at once, saying why, when it cannot (port taken, no environment with the server)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.support.cli import REPO, dcr
from tests.support.procs import stop_from_file
from tests.support.servers import free_port

VENV_PYTHON = os.path.join(REPO, ".venv", "bin", "python")


def _clean_env(tmp_path, **extra) -> dict:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path), **extra}
    if not os.path.exists(VENV_PYTHON):  # tests run from another environment than `make install`'s
        env["DCR_PYTHON"] = sys.executable
    return env


def _script(name: str, *args, env: dict, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/bash", os.path.join(REPO, "infra", name), *map(str, args)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def _exports(stdout: str) -> dict:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("export "))
    return dict(item.split("=", 1) for item in shlex.split(line)[1:])


def _azurite_install() -> dict:
    """Where infra/start-azurite.sh finds Azurite already installed (not under the test's HOME)."""
    if os.environ.get("DCR_AZURITE_DIR"):
        return {"DCR_AZURITE_DIR": os.environ["DCR_AZURITE_DIR"]}
    return {"XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")}


@pytest.mark.parametrize("name, scheme, pid_name", [
    ("start-s3.sh", "s3", "dcr-moto"), ("start-gcs.sh", "gs", "dcr-gcs"),
    pytest.param("start-azurite.sh", "az", "dcr-azurite", marks=pytest.mark.backend),  # Node.js and Azurite from npm
])
def test_object_store_scripts_start_from_a_clean_path_and_print_what_works(name, scheme, pid_name, tmp_path):
    port = free_port()
    script_env = _clean_env(tmp_path, **(_azurite_install() if scheme == "az" else {}))
    out = _script(name, port, "ops-bucket", env=script_env, timeout=300)
    assert out.returncode == 0, out.stderr
    pid_file = tmp_path / f"{pid_name}-{port}.pid"
    try:
        exports = _exports(out.stdout)
        root = f"{scheme}://ops-bucket/run-1"
        assert f"ROOT={root}" in out.stdout
        env = {**exports, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
        listed = dcr("ls", root, "--allow-empty", env=env, check=0)  # the bucket exists and answers
        assert listed.stdout.startswith("    STEP"), listed
        again = _script(name, port, env=script_env, timeout=30)  # the port is taken now
        assert again.returncode == 1 and f"port {port} on 127.0.0.1 is in use" in again.stderr, again
    finally:
        stop_from_file(pid_file)


def test_scripts_fail_at_once_without_an_environment_that_has_the_server(tmp_path):
    bare = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else None
    if bare is None or subprocess.run([bare, "-c", "import moto"], capture_output=True).returncode == 0:
        pytest.skip("needs a system python3 without moto")
    for name, module in (("start-s3.sh", "moto.server"), ("start-gcs.sh", "gcp_storage_emulator"),
                         ("start-azurite.sh", "azure.storage.blob"), ("start-prefect.sh", "prefect")):
        t0 = time.monotonic()
        out = _script(name, free_port(), env={**_clean_env(tmp_path), "DCR_PYTHON": bare}, cwd=tmp_path, timeout=30)
        assert out.returncode == 1 and f"DCR_PYTHON={bare} cannot import {module}" in out.stderr, out
        assert time.monotonic() - t0 < 10


@pytest.mark.prefect
@pytest.mark.slow  # a Prefect server start: about 10 s
def test_prefect_script_starts_a_server_from_a_clean_path_and_its_ui_calls_that_server(tmp_path):
    port = free_port()
    # DCR_PREFECT_PORT names the port; a PREFECT_API_URL left in the shell from a server started
    # earlier names another one: the UI must call neither 4200 nor that one, but this server
    stale = f"http://127.0.0.1:{free_port()}/api"
    env = _clean_env(tmp_path, PREFECT_HOME=str(tmp_path / "ph"), DCR_PREFECT_PORT=str(port), PREFECT_API_URL=stale)
    out = _script("start-prefect.sh", env=env, cwd=tmp_path, timeout=150)
    assert out.returncode == 0, out.stderr
    try:
        url = _exports(out.stdout)["PREFECT_API_URL"]
        assert url == f"http://127.0.0.1:{port}/api"
        assert urllib.request.urlopen(f"{url}/health", timeout=5).status == 200
        # what the UI in the browser asks first: the API it then calls for everything it shows
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ui-settings", timeout=5) as answer:
            assert json.load(answer)["api_url"] == url
    finally:
        stop_from_file(tmp_path / "ph" / "server.pid")
