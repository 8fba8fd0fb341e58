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


def test_every_flow_takes_json_parameters_that_its_schema_describes():
    """A deployment, the UI and ``prefect deploy`` validate a run's parameters against its flow's
    schema: no flow may take an object (``Any``, a task runner, an engine). Live objects reach
    ``publish_held`` and ``receive_live`` as a ``LocalRef`` (a key, two strings and a pid)."""
    import inspect
    import json
    import typing

    from prefect import Flow
    from prefect.utilities.callables import parameter_schema

    import flows.prefect_flows as pf

    flows = {v.name: v for v in vars(pf).values() if isinstance(v, Flow)}
    assert set(flows) == {"dcr-publish-refit", "dcr-publish-held", "dcr-receive-refit", "dcr-receive-live",
                          "dcr-materialize", "dcr-verify", "dcr-mirror", "dcr-fleet", "dcr-gc"}
    for name, flow in flows.items():
        hints = typing.get_type_hints(flow.fn)
        for param in inspect.signature(flow.fn).parameters:
            assert hints.get(param, typing.Any) is not typing.Any, f"{name}: {param} is not typed"
        schema = parameter_schema(flow.fn).model_dump()
        json.dumps(schema)
        for param, prop in schema["properties"].items():
            assert {"type", "anyOf", "$ref", "allOf"} & set(prop), f"{name}: {param} has no JSON type: {prop}"
    assert not isinstance(pf.publish_refit, Flow) and not isinstance(pf.receive_refit, Flow)
