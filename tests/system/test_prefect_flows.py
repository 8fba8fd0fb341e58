"""The Prefect flows against a real Prefect API server started by the fixture."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch
import yaml

from tests.support.fused_module import TinyFused
from tests.support.helpers import assert_bits_equal

pytestmark = pytest.mark.prefect

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def prefect_settings(prefect_api):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_api}):
        yield prefect_api


def _bits_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in module.state_dict().items()}


def _next(ck: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in ck.items()}
    flat = out["layer.k_proj.weight"].view(-1).view(torch.int16)
    flat[step % flat.numel()] ^= 1
    if step % 2:
        out["layer.gate_proj.weight"].view(-1).view(torch.int16)[::5] ^= 0x8000  # sign flips, incl. +-0.0
    return out


def test_flows_publish_and_receive_through_the_prefect_api_bit_exact(prefect_settings, tmp_path):
    from prefect.client.orchestration import get_client

    from flows import publish_refit, receive_refit

    root = str(tmp_path / "bucket")
    ck = TinyFused.checkpoint(0)
    history = []
    for step in range(4):
        res = publish_refit(root, ck, step)
        assert res["step"] == step and res["kind"] == ("keyframe" if step == 0 else "delta")
        history.append(ck)
        ck = _next(ck, step + 1)
    state = str(tmp_path / "state.safetensors")
    res = receive_refit(root, "rollout-0", state)
    assert res["step"] == 3
    from safetensors.torch import load_file

    assert_bits_equal(load_file(state), history[3])
    res = receive_refit(root, "rollout-0", state, step=1)
    assert res["moves"] == ["backward:3", "backward:2"]
    assert_bits_equal(load_file(state), history[1])

    with get_client(sync_client=True) as client:
        names = {fr.name for fr in client.read_flow_runs()}
        tasks = {tr.name.rsplit("-", 1)[0] for tr in client.read_task_runs()}
    assert names, "flow runs are recorded by the API"
    assert {"encode-and-write-chunks", "commit", "fetch-apply-verify", "replace-state"} <= tasks


def test_receive_refit_into_a_module_equals_a_dense_load_after_every_step(prefect_settings, tmp_path):
    from flows import publish_refit, receive_refit

    root = f"memory://prefect-{uuid.uuid4().hex}"
    live = TinyFused()
    ck = TinyFused.checkpoint(1)
    for step in range(4):
        publish_refit(root, ck, step)
        res = receive_refit(root, "rollout-m", live, state_path=str(tmp_path / "mirror.safetensors"))
        dense = TinyFused()
        dense.load_weights(ck.items())
        assert_bits_equal(_bits_state(live), _bits_state(dense))
        if step:
            assert res["tensors_loaded"] < len(ck), "only changed tensors go through the loader"
        ck = _next(ck, step + 1)


def test_the_prefect_publish_tasks_use_and_keep_a_held_baseline(prefect_settings, tmp_path):
    """``run_publish(held=...)`` with the Prefect tasks, inside a flow: the baseline stays in memory
    (no baseline file is written or rebuilt) and every step is received bit-exact."""
    from prefect import flow
    from safetensors.torch import load_file

    from flows.options import PublishOptions
    from flows import run_publish, run_receive
    from flows.prefect_flows import PREFECT_TASKS
    from flows.publish.baseline import BaselineSlot

    root, slot = str(tmp_path / "bucket"), BaselineSlot()
    opts = PublishOptions(cache_dir=str(tmp_path / "cache"))

    @flow(name="dcr-publish-held", validate_parameters=False)
    def publish_held(ck, step):
        return run_publish(root, ck, step, options=opts, tasks=PREFECT_TASKS, held=slot)

    ck = TinyFused.checkpoint(3)
    state = str(tmp_path / "state.safetensors")
    for step in range(3):
        res = publish_held(ck, step)
        assert res.kind == ("keyframe" if step == 0 else "delta") and slot.baseline.step == step
        run_receive(root, "rx", state)
        assert_bits_equal(load_file(state), ck)
        ck = _next(ck, step + 1)
    assert not os.path.exists(tmp_path / "cache")


def test_deployments_build_with_an_interval_schedule_and_the_yaml_entrypoints_import(prefect_settings):
    from prefect.utilities.importtools import import_object

    from flows.serve import deployments

    receiver, publisher = deployments("memory://x", "rollout-0", "/tmp/x.safetensors", 15)
    assert receiver.schedules and receiver.schedules[0].schedule.interval.total_seconds() == 15
    assert not publisher.schedules
    with open(os.path.join(REPO, "infra", "prefect.yaml")) as f:
        spec = yaml.safe_load(f)
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        for d in spec["deployments"]:
            assert callable(import_object(d["entrypoint"]))
    finally:
        os.chdir(cwd)
    assert any(d.get("schedules") for d in spec["deployments"] if d["name"] == "receiver")


def test_cli_runs_the_prefect_flows_when_asked(prefect_api, tmp_path):
    from tests.support.helpers import write_safetensors

    ck = tmp_path / "c.safetensors"
    write_safetensors(ck, TinyFused.checkpoint(2))
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    cmd = [sys.executable, "-m", "flows.cli"]
    out = subprocess.run(
        cmd + ["publish", str(tmp_path / "b"), str(ck), "--step", "0", "--orchestrator", "prefect"],
        env=env, capture_output=True, text=True, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert "committed step 0" in out.stdout
