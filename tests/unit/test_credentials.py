"""Which storage options are credentials (``storage.credentials``), and a ROOT as another process
is sent it: without them, a local path absolute."""

from __future__ import annotations

import os

import pytest

from dcr_core.errors import UsageError
from storage.credentials import find_credential, for_another_process
from storage.root import RootRef


@pytest.mark.parametrize("options, found", [
    ({"key": "AKIA...", "secret": "s"}, ("key",)),
    ({"endpoint_url": "http://s3:9000", "secret": "s"}, ("secret",)),
    ({"token": "IQoJb3JpZ2luX2Vj/session+token"}, ("token",)),  # s3fs: the session token
    ({"token": {"type": "service_account", "private_key": "..."}}, ("token",)),  # gcsfs: inline credentials
    ({"client_kwargs": {"region_name": "eu", "aws_secret_access_key": "s"}}, ("client_kwargs", "aws_secret_access_key")),
    ({"account_name": "acct", "account_key": "k"}, ("account_key",)),
    ({"sas_token": "sv=..."}, ("sas_token",)), ({"connection_string": "AccountKey=..."}, ("connection_string",)),
    ({"client_id": "app", "client_secret": "s"}, ("client_secret",)), ({"Password": "p"}, ("Password",)),
    ({"credential": "k"}, ("credential",)),
])
def test_a_credential_is_found_at_any_depth_by_its_name(options, found):
    assert find_credential(options) == found


@pytest.mark.parametrize("options", [
    None, {}, {"anon": False}, {"anon": True}, {"token": "anon"}, {"token": "google_default"},
    {"token": "/etc/gcs/sa.json"}, {"key": None}, {"secret": ""}, {"account_name": "acct", "tenant_id": "t"},
    {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "us-east-1"}},
    {"config_kwargs": {"max_pool_connections": 64}}, {"profile": "rollout"},
])
def test_names_addresses_modes_and_switches_are_not_credentials(options):
    assert find_credential(options) is None


def test_another_process_gets_an_absolute_local_root_and_no_credentials(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for given in ("bucket", "./bucket/", f"file://{tmp_path}/bucket"):
        sent = for_another_process(RootRef(given, {"auto_mkdir": True}), "http://gen-0:8000")
        assert (sent.url, sent.storage_options) == (os.path.join(tmp_path, "bucket"), {"auto_mkdir": True})
    cloud = RootRef("s3://rl/run", {"endpoint_url": "http://s3:9000", "anon": False})
    assert for_another_process(cloud, "x") == cloud
    with pytest.raises(UsageError) as e:
        for_another_process(RootRef("s3://rl/run", {"client_kwargs": {"aws_session_token": "t0k3n"}}), "http://g:1")
    message = str(e.value)
    assert message.startswith("http://g:1: storage option 'client_kwargs.aws_session_token' is a credential")
    assert "\n" not in message and "t0k3n" not in message
    with pytest.raises(UsageError, match="^x: ROOT 'memory://b' lives in this process only"):
        for_another_process(RootRef("memory://b"), "x")
