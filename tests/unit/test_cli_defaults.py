"""The command line takes its option defaults (and their help's "(default ...)") from the typed
options models (``flows.options``): a command run with no option builds the model's own defaults,
so one change to a model moves the command too."""

from __future__ import annotations

import argparse
import importlib
import os

import pytest

from flows.cli.common import default_text
from flows.cli.publish import publish_options
from flows.cli.receive import receive_options
from flows.options import DELTA_CODECS, GcOptions, PublishOptions, ReceiveOptions

COMMANDS = [
    ("publish", "flows.cli.publish", PublishOptions, ["ROOT", "CKPT", "--step", "1"]),
    ("receive", "flows.cli.receive", ReceiveOptions, ["ROOT", "--receiver", "r", "--state", "s.safetensors"]),
    ("materialize", "flows.cli.receive", ReceiveOptions, ["ROOT", "--out", "o.safetensors"]),
    ("gc", "flows.cli.gc", GcOptions, ["ROOT"]),
]


def _parser(name: str, module: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"dcr {name}")
    importlib.import_module(module).add_arguments(name, p)
    return p


@pytest.mark.parametrize("name,module,model,argv", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_option_named_after_a_field_defaults_to_the_fields_default_and_says_it(name, module, model, argv):
    actions = {a.dest: a for a in _parser(name, module)._actions}
    fields = {d: f for d, f in model.model_fields.items() if d in actions and not f.is_required()}
    assert len(fields) >= 2, sorted(actions)
    for dest, field in fields.items():
        default = field.get_default(call_default_factory=True)
        assert actions[dest].default == default, f"--{dest.replace('_', '-')}: {actions[dest].default!r} != {default!r}"
        if default is not None and not isinstance(default, bool):
            assert f"(default {default_text(default)})" in actions[dest].help, dest


def test_publish_options_named_otherwise_default_to_the_models_defaults():
    actions = {a.dest: a for a in _parser("publish", "flows.cli.publish")._actions}
    model = PublishOptions()
    assert DELTA_CODECS[actions["codec"].default] == model.delta_codec
    assert (not actions["no_cache"].default) is model.use_cache
    assert (actions["keyframe_every"].default, actions["keyframe_above"].default) == (
        model.keyframe_policy.every, model.keyframe_policy.above)


@pytest.mark.parametrize("name,build", [("publish", publish_options), ("receive", receive_options),
                                        ("materialize", receive_options)])
def test_a_command_given_no_option_builds_the_models_default_options(name, build):
    module, model, argv = next((m, o, a) for n, m, o, a in COMMANDS if n == name)
    args = _parser(name, module).parse_args(argv)
    built = build(args) if build is publish_options else build(name, args)
    expected = model()
    if model is PublishOptions:  # the one default read from the environment, at each construction
        expected = expected.model_copy(update={"cache_dir": built.cache_dir})
    assert built == expected


def test_require_signed_is_the_receives_option_not_the_processes_environment(monkeypatch):
    monkeypatch.delenv("DCR_REQUIRE_SIGNED", raising=False)
    args = _parser("receive", "flows.cli.receive").parse_args(COMMANDS[1][3] + ["--require-signed"])
    assert receive_options("receive", args).require_signed is True
    assert "DCR_REQUIRE_SIGNED" not in os.environ
