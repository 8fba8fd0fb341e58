"""Real servers for the tests, on 127.0.0.1 and free ports: moto (S3), the GCS emulator, Prefect.

Registered as a pytest plugin from conftest. Each test gets a fresh prefix (S3/GCS) or directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

S3_BUCKET = "dcr-test"
GCS_BUCKET = "dcr-test"
BACKENDS = ("local", "memory", "s3", "gcs")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(cmd: list[str], health_url: str, log_path, env: dict | None = None, timeout: float = 120):
    """Run a server process until the block ends; wait until ``health_url`` answers first."""
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + timeout
    try:
        while True:
            try:
                urllib.request.urlopen(health_url, timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"{cmd[0]} did not start; see {log_path}") from None
                time.sleep(0.3)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server over HTTP; sets the standard AWS environment for the session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    mp = pytest.MonkeyPatch()
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": url,
    }.items():
        mp.setenv(k, v)
    mp.delenv("AWS_PROFILE", raising=False)
    import boto3

    boto3.client("s3", endpoint_url=url).create_bucket(Bucket=S3_BUCKET)
    try:
        yield url
    finally:
        mp.undo()
        server.stop()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """The GCS emulator (gcp-storage-emulator) in a subprocess; sets STORAGE_EMULATOR_HOST."""
    port = _free_port()
    exe = shutil.which("gcp-storage-emulator", path=os.path.dirname(sys.executable)) or "gcp-storage-emulator"
    url = f"http://127.0.0.1:{port}"
    cmd = [exe, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory", "--default-bucket", GCS_BUCKET]
    with running(cmd, f"{url}/storage/v1/b", tmp_path_factory.mktemp("gcs") / "emulator.log", timeout=60):
        mp = pytest.MonkeyPatch()
        mp.setenv("STORAGE_EMULATOR_HOST", url)
        mp.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        try:
            yield url
        finally:
            mp.undo()


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
    url = f"http://127.0.0.1:{port}/api"
    cmd = [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with running(cmd, f"{url}/health", home / "server.log", env=env):
        mp = pytest.MonkeyPatch()
        mp.setenv("PREFECT_API_URL", url)
        mp.setenv("PREFECT_HOME", str(home))
        try:
            yield url
        finally:
            mp.undo()


@pytest.fixture(params=[
    "local", pytest.param("memory", marks=pytest.mark.backend), pytest.param("s3", marks=pytest.mark.backend), pytest.param("gcs", marks=pytest.mark.backend),
])
def backend(request, tmp_path):
    """The name of a backend, with its server running (if it has one)."""
    if request.param == "s3":
        request.getfixturevalue("s3_server")
    elif request.param == "gcs":
        request.getfixturevalue("gcs_server")
    return request.param


def new_root(backend: str, tmp_path) -> str:
    """A fresh, empty ROOT URL on ``backend``."""
    tag = uuid.uuid4().hex[:12]
    if backend == "local":
        return str(tmp_path / f"root-{tag}")
    if backend == "memory":
        return f"memory://dcr-{tag}"
    if backend == "s3":
        return f"s3://{S3_BUCKET}/t-{tag}"
    if backend == "gcs":
        return f"gs://{GCS_BUCKET}/t-{tag}"
    raise ValueError(backend)


@pytest.fixture
def make_root(backend, tmp_path):
    return lambda: new_root(backend, tmp_path)
