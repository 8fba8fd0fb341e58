"""Flow parameters land in Prefect's database: credentials among them are refused in one line."""

from __future__ import annotations

import pytest

from dcr_core.errors import UsageError
from flows.options import refuse_credentials


@pytest.mark.parametrize("options, named", [
    ({"key": "AKIA...", "secret": "s"}, "storage_options['key']"),
    ({"client_kwargs": {"aws_session_token": "t"}}, "storage_options['client_kwargs']['aws_session_token']"),
    ({"token": {"type": "service_account", "private_key": "..."}}, "storage_options['token']"),
    ({"account_key": "k"}, "storage_options['account_key']"),
])
def test_a_credential_in_a_flow_parameter_is_refused_naming_it(options, named):
    with pytest.raises(UsageError, match=f"^{__import__('re').escape(named)}: a credential in a flow parameter"):
        refuse_credentials(options)


@pytest.mark.parametrize("options", [
    None, {}, {"anon": True}, {"token": "anon"}, {"token": "/etc/gcs/sa.json"},
    {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "us-east-1"}},
    {"key": None}, {"secret": ""},
])
def test_modes_paths_and_endpoints_are_not_credentials(options):
    refuse_credentials(options)
