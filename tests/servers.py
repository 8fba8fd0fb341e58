"""Real storage servers for the tests, on 127.0.0.1 and free ports: moto (S3) and the GCS emulator.

Registered as a pytest plugin from conftest. Each test gets a fresh prefix (S3/GCS) or directory.
"""

from __future__ import annotations

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
    log = open(tmp_path_factory.mktemp("gcs") / "emulator.log", "wb")
    proc = subprocess.Popen(
        [exe, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory", "--default-bucket", GCS_BUCKET],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError("GCS emulator did not start")
            time.sleep(0.3)
    mp = pytest.MonkeyPatch()
    mp.setenv("STORAGE_EMULATOR_HOST", url)
    mp.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    try:
        yield url
    finally:
        mp.undo()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(params=BACKENDS)
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
