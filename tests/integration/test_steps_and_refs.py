"""Steps exchange serializable references; handles of in-process objects never outlive a pipeline."""

from __future__ import annotations

import pydantic_core
import pytest
import torch

from flows import Publisher, PublishOptions, local_refs, receive_into_module, run_publish, run_receive
from flows.publish.pipeline import PublishSteps
from flows.steps import InProcess, Step
from storage.root import check_root_url
from tests.support.fused_module import TinyFused
from tests.support.helpers import chain_of_steps
from tests.support.steps import patch_step


class Checking(InProcess):
    """Runs steps in-process, and checks that every argument and result of every step serializes
    to JSON (what Prefect's JSON result serializer needs) and stays small."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}

    def wrap(self, step: Step):
        call = super().wrap(step)

        def checked(*args, **kwargs):
            out = call(*args, **kwargs)
            for what in (*args, *kwargs.values(), out):
                data = pydantic_core.to_json(what, fallback=_refuse)
                self.sizes[step.name] = max(self.sizes.get(step.name, 0), len(data))
            return out

        return checked


def _refuse(obj):
    raise TypeError(f"{type(obj).__name__} is not serializable")


def test_every_publish_and_receive_step_takes_and_returns_serializable_references(tmp_path):
    root, state = str(tmp_path / "root"), str(tmp_path / "s.safetensors")
    steps = chain_of_steps(3, seed=31)
    runner = Checking()
    opts = PublishOptions(chunk_bytes=256, cache_dir=str(tmp_path / "cache"))
    for i, ck in enumerate(steps):
        run_publish(root, ck, i, options=opts, runner=runner)
        run_receive(root, "r", state, runner=runner)
    assert {"snapshot", "plan-from-source", "encode-and-write", "commit-step", "stage-refit", "install-state"} <= set(runner.sizes)
    assert max(runner.sizes.values()) < 1 << 20, runner.sizes


def test_handles_of_in_process_objects_are_released_whatever_happens(tmp_path, monkeypatch):
    root = str(tmp_path / "root")
    steps = chain_of_steps(4, seed=32)
    opts = PublishOptions(chunk_bytes=256, cache_dir=str(tmp_path / "cache"))
    before = local_refs.live_count()
    pub = Publisher(root, options=opts)
    pub.publish(steps[0], 0)
    run_publish(root, steps[1], 1, options=opts)

    def crash(real, *a, **kw):
        raise RuntimeError("crashed")

    with pytest.MonkeyPatch.context() as mp:
        patch_step(mp, PublishSteps, "write_manifest", crash)
        with pytest.raises(RuntimeError):
            pub.publish(steps[2], 2)
    pub.publish(steps[2], 2)
    live = TinyFused()
    ck = TinyFused.checkpoint(0)
    run_publish(str(tmp_path / "m"), ck, 0, options=opts)
    receive_into_module(str(tmp_path / "m"), "m", live, state_path=str(tmp_path / "mirror.safetensors"))
    assert local_refs.live_count() == before


def test_a_handle_resolves_only_in_the_process_that_made_it():
    ref = local_refs.put(torch.zeros(1), "tensors")
    assert local_refs.get(ref) is not None
    local_refs.release(ref)
    with pytest.raises(Exception, match="lives in this process \\(released\\)"):
        local_refs.get(ref)
    foreign = local_refs.LocalRef("tensors-1-1", "tensors", pid=1)
    with pytest.raises(Exception, match="lives in another process"):
        local_refs.get(foreign)


@pytest.mark.parametrize("url", ["s3:/dcr/run-1", "gcs:/dcr/x", "s4://dcr/x", "run:1"])
def test_a_root_that_looks_like_a_url_but_is_not_one_is_refused(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception, match="is not a valid URL") as ei:
        run_publish(url, {"w": torch.zeros(3)}, 0)
    assert "\n" not in str(ei.value)
    assert list(tmp_path.iterdir()) == [], "nothing written locally"
    assert check_root_url("simplecache::s3://b/p") and check_root_url("rel/dir")
