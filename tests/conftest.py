"""Shared fixtures: an isolated cache per test, and a real Prefect API server for flow tests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Publisher baselines and receiver mirrors go under the test's own tmp dir."""
    monkeypatch.setenv("DCR_CACHE_DIR", str(tmp_path / "dcr-cache"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A Prefect API server on 127.0.0.1 (or the one PREFECT_API_URL already names)."""
    existing = os.environ.get("PREFECT_API_URL")
    if existing:
        yield existing
        return
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db",
    }
    prefect = shutil.which("prefect", path=os.path.dirname(sys.executable)) or "prefect"
    log = open(home / "server.log", "wb")
    proc = subprocess.Popen(
        [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"Prefect server did not start; see {home / 'server.log'}")
            time.sleep(0.5)
    mp = pytest.MonkeyPatch()
    mp.setenv("PREFECT_API_URL", url)
    mp.setenv("PREFECT_HOME", str(home))
    try:
        yield url
    finally:
        mp.undo()
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


pytest_plugins = ["tests.servers"]
