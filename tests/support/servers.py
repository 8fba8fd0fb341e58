"""Real servers for the tests, on 127.0.0.1 and free ports: moto (S3), the GCS emulator, Azurite
(Azure Blob Storage), Prefect.

Registered as a pytest plugin from conftest. One server of each kind serves the whole run (every
xdist worker); each test gets a fresh prefix (S3/GCS) or directory.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from filelock import FileLock

from tests.support.procs import stop

REPO = Path(__file__).resolve().parents[2]
S3_BUCKET = "dcr-test"
GCS_BUCKET = "dcr-test"
AZURE_CONTAINER = "dcr-test"
# Azurite's development account and its key, published in Azure's documentation (not a secret)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
BACKENDS = ("local", "memory", "s3", "gcs", "azure")


def free_port() -> int:
    """A port on 127.0.0.1 free a moment ago (nothing listens there: connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One server of each kind for the whole run, shared by every pytest-xdist worker (or started by
# .ci/run and named in the environment): the first worker that needs one starts it, under a file
# lock in the run's shared temp directory, and the run's last act (pytest_sessionfinish of the
# controller, or of the lone process) stops it. A server outside pytest is named by
# DCR_TEST_S3_URL (a moto server with the bucket dcr-test), DCR_TEST_GCS_URL (the GCS emulator, its
# default bucket dcr-test), DCR_TEST_AZURE_URL (Azurite's blob endpoint for its development account,
# http://127.0.0.1:PORT/devstoreaccount1, with the container dcr-test) or DCR_TEST_PREFECT_URL (a
# Prefect API); a PREFECT_API_URL already set is used as it is.


def _run_dir(tmp_path_factory) -> Path:
    """The temp directory every process of this run shares: under xdist a worker's base temp is
    ``<run>/popen-gwN``."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _start_detached(cmd: list[str], health_url: str, log_path: Path, env: dict | None = None, timeout: float = 120) -> int:
    """Start a server that outlives the caller's fixture; its pid once ``health_url`` answers."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    deadline = time.time() + timeout
    while True:
        try:
            urllib.request.urlopen(health_url, timeout=2)
            return proc.pid
        except urllib.error.HTTPError:
            return proc.pid  # it answered
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"{cmd[0]} did not start; see {log_path}") from None
            time.sleep(0.2)


def _shared(name: str, tmp_path_factory, start) -> dict:
    """The run's server ``name``: ``start(directory) -> {"url": ..., "pid": ...}`` runs once per run."""
    d = _run_dir(tmp_path_factory)
    info = d / f"server-{name}.json"
    with FileLock(str(info) + ".lock"):
        if info.exists():
            return json.loads(info.read_text())
        server = start(d)
        info.write_text(json.dumps(server))
        return server


def stop_shared_servers(run_dir: Path) -> None:
    """Stop the servers this run started (called once, when the whole run is over)."""
    for info in sorted(run_dir.glob("server-*.json")):
        stop(json.loads(info.read_text())["pid"], group=True)
        info.unlink()


def pytest_sessionfinish(session) -> None:
    drain_prefect_workers()
    if hasattr(session.config, "workerinput"):  # an xdist worker: its controller stops them at the end
        return
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is not None:
        stop_shared_servers(factory.getbasetemp())


def _moto(d: Path) -> dict:
    port = free_port()
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
    pid = _start_detached([exe, "-H", "127.0.0.1", "-p", str(port)], f"http://127.0.0.1:{port}/", d / "moto.log")
    return {"url": f"http://127.0.0.1:{port}", "pid": pid}


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A moto S3 server over HTTP (one per run); sets the standard AWS environment for the session."""
    url = os.environ.get("DCR_TEST_S3_URL") or _shared("s3", tmp_path_factory, _moto)["url"]
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

    s3 = boto3.client("s3", endpoint_url=url)
    try:
        s3.create_bucket(Bucket=S3_BUCKET)
    except s3.exceptions.BucketAlreadyOwnedByYou:  # another worker of this run made it
        pass
    try:
        yield url
    finally:
        mp.undo()


def _gcs(d: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, str(REPO / "infra" / "gcs_emulator.py"), "start", "--host", "127.0.0.1", "--port", str(port),
           "--in-memory", "--default-bucket", GCS_BUCKET]
    return {"url": url, "pid": _start_detached(cmd, f"{url}/storage/v1/b", d / "gcs.log", timeout=60)}


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """The GCS emulator (one per run); sets STORAGE_EMULATOR_HOST."""
    url = os.environ.get("DCR_TEST_GCS_URL") or _shared("gcs", tmp_path_factory, _gcs)["url"]
    mp = pytest.MonkeyPatch()
    mp.setenv("STORAGE_EMULATOR_HOST", url)
    mp.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    try:
        yield url
    finally:
        mp.undo()


def azurite_connection_string(blob_url: str) -> str:
    """The connection string of Azurite's development account at ``blob_url``."""
    return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={blob_url};")


def _azurite(d: Path) -> dict:
    """infra/start-azurite.sh (Azurite from npm, installed on its first use, and the container), in a
    process group of its own: the script exits once Azurite answers, and the group's id stops it."""
    port = free_port()
    env = {**os.environ, "TMPDIR": str(d), "DCR_PYTHON": sys.executable}
    proc = subprocess.Popen(["bash", str(REPO / "infra" / "start-azurite.sh"), str(port), AZURE_CONTAINER], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=REPO)
    out, err = proc.communicate(timeout=300)
    if proc.returncode:
        raise RuntimeError(f"infra/start-azurite.sh failed: {err.strip()[-2000:]}")
    return {"url": f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}", "pid": proc.pid}


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory):
    """Azurite's blob service (one per run); sets AZURE_STORAGE_CONNECTION_STRING for the session."""
    url = os.environ.get("DCR_TEST_AZURE_URL") or _shared("azure", tmp_path_factory, _azurite)["url"]
    mp = pytest.MonkeyPatch()
    mp.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_connection_string(url))
    try:
        yield url
    finally:
        mp.undo()


def _prefect(d: Path) -> dict:
    home = d / "prefect-home"
    home.mkdir(exist_ok=True)
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home}/prefect.db",
    }
    prefect = shutil.which("prefect", path=os.path.dirname(sys.executable)) or "prefect"
    url = f"http://127.0.0.1:{port}/api"
    cmd = [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    return {"url": url, "home": str(home), "pid": _start_detached(cmd, f"{url}/health", home / "server.log", env=env)}


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A Prefect API server on 127.0.0.1 (one per run), or the one PREFECT_API_URL already names."""
    existing = os.environ.get("PREFECT_API_URL")
    if existing:
        yield existing
        return
    url = os.environ.get("DCR_TEST_PREFECT_URL") or _shared("prefect", tmp_path_factory, _prefect)["url"]
    mp = pytest.MonkeyPatch()
    mp.setenv("PREFECT_API_URL", url)
    mp.setenv("PREFECT_HOME", str(tmp_path_factory.mktemp("prefect-client")))
    try:
        yield url
    finally:
        drain_prefect_workers()
        mp.undo()


@pytest.fixture
def prefect_settings(prefect_api):
    """Prefect's client settings pointed at the run's API server for one test."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_api}):
        yield prefect_api


def drain_prefect_workers() -> None:
    """Send what Prefect's log and event workers still hold while the server is up: once it stops,
    they retry against it for over a minute at interpreter exit ("Error logging to API")."""
    if "prefect" not in sys.modules:  # nothing ran through Prefect in this process
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)


SERVERS = {"s3": "s3_server", "gcs": "gcs_server", "azure": "azure_server"}  # backend -> its server's fixture


@pytest.fixture(params=["local", *(pytest.param(b, marks=pytest.mark.backend) for b in BACKENDS[1:])])
def backend(request, tmp_path):
    """The name of a backend, with its server running (if it has one)."""
    if request.param in SERVERS:
        request.getfixturevalue(SERVERS[request.param])
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
    if backend == "azure":
        return f"az://{AZURE_CONTAINER}/t-{tag}"
    raise ValueError(backend)


@pytest.fixture
def make_root(backend, tmp_path):
    return lambda: new_root(backend, tmp_path)
