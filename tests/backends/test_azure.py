"""Azure Blob Storage (against Azurite) beyond the conformance suite, which runs there too: a mirror
from S3 to Azure and back, byte for byte; and what an Azure ROOT says when it cannot be used."""

from __future__ import annotations

import socket
import time
import uuid

import pytest
from safetensors.torch import load_file

from flows import run_publish, run_receive
from flows.maintenance.mirror import run_mirror
from flows.options import PublishOptions
from storage import layout
from storage.root import Root
from tests.support.cli import dcr, one_line_error
from tests.support.helpers import assert_bits_equal, nasty_checkpoint, next_step
from tests.support.servers import AZURE_CONTAINER, S3_BUCKET, azurite_connection_string

pytestmark = pytest.mark.backend


def _tag() -> str:
    return uuid.uuid4().hex[:8]


def _stored(url: str) -> dict[str, bytes]:
    root = Root(url)
    return {o.key: root.read(o.key) for o in root.objects(layout.STEPS)}


def test_a_mirror_from_s3_to_azure_and_back_keeps_every_byte(s3_server, azure_server, tmp_path):
    src, azure, back = f"s3://{S3_BUCKET}/origin-{_tag()}", f"az://{AZURE_CONTAINER}/mirror-{_tag()}", \
        f"s3://{S3_BUCKET}/back-{_tag()}"
    cks = [nasty_checkpoint(seed=8)]
    cks.append(next_step(cks[0], seed=9))
    for s, ck in enumerate(cks):
        run_publish(src, ck, s, options=PublishOptions(chunk_bytes=4096, cache_dir=str(tmp_path / "pub")))
    assert run_mirror(src, azure).copied_steps == [0, 1]
    assert run_mirror(azure, back).copied_steps == [0, 1]
    origin = _stored(src)
    assert _stored(azure) == origin and _stored(back) == origin  # every object of every step, byte for byte
    for url in (azure, back):
        state = tmp_path / f"{url.split(':')[0]}.safetensors"
        run_receive(url, "r", str(state))
        assert_bits_equal(load_file(state), cks[1])


def test_an_azure_root_without_an_account_names_the_variables(azure_server, monkeypatch):
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
    one_line_error(dcr("ls", f"az://{AZURE_CONTAINER}/run"), 2,
                   "no Azure storage account set; set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME")


def test_a_container_that_does_not_exist_is_named(azure_server):
    missing = f"no-such-container-{_tag()}"
    one_line_error(dcr("ls", f"az://{missing}/run"), 2,
                   f"container '{missing}' does not exist at {azure_server} (AZURE_STORAGE_CONNECTION_STRING)")


def test_a_wrong_key_is_access_denied(azure_server):
    wrong = azurite_connection_string(azure_server).replace("AccountKey=", "AccountKey=AAAA")
    one_line_error(dcr("ls", f"az://{AZURE_CONTAINER}/run", env={"AZURE_STORAGE_CONNECTION_STRING": wrong}), 1,
                   f"AuthorizationFailure at {azure_server}", "check the credentials")


def test_an_endpoint_that_is_down_fails_within_seconds_naming_it(tmp_path):
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/devstoreaccount1"
        t0 = time.monotonic()
        out = dcr("receive", "az://c/run", "--receiver", "r", "--state", tmp_path / "s.safetensors",
                  env={"AZURE_STORAGE_CONNECTION_STRING": azurite_connection_string(url)})
    one_line_error(out, 1, f"az://c/run: cannot reach {url} (AZURE_STORAGE_CONNECTION_STRING)", "is the server running?")
    assert time.monotonic() - t0 < 10  # the SDK's own retries back off 15 s and more
    assert not (tmp_path / "s.safetensors").exists()
