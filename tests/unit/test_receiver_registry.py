"""The receivers' registry (``flows.receive.receiver``): every URL scheme, path and in-process
object picks its kind there, and nothing else; what names no kind is one line naming it."""

from __future__ import annotations

import pathlib

import pytest

from dcr_core.errors import UsageError
from flows.receive import receiver as receivers
from flows.receive.receiver import Kind, Receiver


class _Engine:
    def collective_rpc(self, method, kwargs=None):
        return []


class _Module:
    def load_weights(self, weights):
        return None


@pytest.mark.parametrize("url, kind", [
    ("http://10.0.0.7:8000", "http-server"), ("https://gen-0:443", "http-server"), ("HTTP://h:1", "http-server"),
    ("state:/data/rollout.safetensors", "state-file"), ("state:relative/r.safetensors", "state-file"),
    ("local:gen", "local-engine"),
])
def test_each_url_scheme_picks_its_kind(url, kind):
    found = receivers.kind_of_url(url)
    cls = found.load()  # these kinds import neither torch nor vLLM
    assert found.name == kind and issubclass(cls, Receiver) and cls.__name__ == found.cls


@pytest.mark.parametrize("target, kind", [
    ("/data/rollout.safetensors", "state-file"), (pathlib.Path("r.safetensors"), "state-file"),
    ("state:x.safetensors", "state-file"),  # a refit's target string is a path, whatever it looks like
    (_Engine(), "vllm-engine"), (_Module(), "live-module"),
])
def test_a_refit_target_is_a_state_file_path_or_an_object_an_in_process_kind_holds(target, kind):
    k = receivers.kind_of(target)
    assert k.name == kind and k.in_process == (kind in ("vllm-engine", "live-module"))


@pytest.mark.parametrize("url, why", [
    ("ftp://h/x", "no receiver kind for scheme 'ftp'"), ("nope", "no scheme"), ("s3://bucket/run", "scheme 's3'"),
])
def test_an_unknown_scheme_is_one_line_naming_the_url_and_the_known_forms(url, why):
    with pytest.raises(UsageError) as e:
        receivers.kind_of_url(url)
    message = str(e.value)
    assert "\n" not in message and repr(url) in message and why in message
    assert message.endswith("(expected http://HOST:PORT, state:PATH or local:NAME)")


def test_an_object_no_kind_holds_is_one_line_naming_its_type():
    with pytest.raises(UsageError) as e:
        receivers.kind_of(object())
    assert "\n" not in str(e.value) and str(e.value).startswith("object is not a receiver: expected a state file path or")


def test_a_kind_is_registered_once_and_each_scheme_has_one_kind(monkeypatch):
    monkeypatch.setattr(receivers, "KINDS", list(receivers.KINDS))
    toy = Kind("toy", __name__, "Toy", "toy:NAME", schemes=("toy",))
    receivers.register(toy)
    assert receivers.kind_of_url("toy:a") is toy and "toy:NAME" in receivers.url_forms()
    for again in (toy, Kind("other", __name__, "Toy", "x", schemes=("http",))):
        with pytest.raises(ValueError, match="registered already"):
            receivers.register(again)


def test_the_fleet_names_members_through_the_kinds():
    from flows.receive.fleet import parse_members

    a, b, c = parse_members("f", ["state:rel/a=b.safetensors", "http://h:9/", "gen=local:g"])
    assert a.url == "state:" + str(pathlib.Path("rel/a=b.safetensors").absolute()) and a.receiver == "f-state-a-b.safetensors"
    assert (b.url, b.receiver) == ("http://h:9", "f-h-9")
    assert (c.url, c.receiver) == ("local:g", "gen")
    with pytest.raises(UsageError, match=r"^--engine 'state:': expected http://HOST:PORT, state:PATH or local:NAME"):
        parse_members("f", ["state:"])
