"""The Prefect flows against a real Prefect API server started by the fixture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest
import torch

from dcr_core.errors import UsageError
from tests.support.fused_module import TinyFused
from tests.support.helpers import assert_bits_equal, module_bits

pytestmark = pytest.mark.prefect

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def _next(ck: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in ck.items()}
    flat = out["layer.k_proj.weight"].view(-1).view(torch.int16)
    flat[step % flat.numel()] ^= 1
    if step % 2:
        out["layer.gate_proj.weight"].view(-1).view(torch.int16)[::5] ^= 0x8000  # sign flips, incl. +-0.0
    return out


def test_flows_publish_and_receive_through_the_prefect_api_bit_exact(prefect_settings, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import TaskRunSort

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
        # the newest first: the session's API also holds other tests' runs, beyond one page
        tasks = {tr.name.rsplit("-", 1)[0] for tr in client.read_task_runs(sort=TaskRunSort.END_TIME_DESC, limit=200)}
    assert names, "flow runs are recorded by the API"
    assert {"encode-and-write", "commit-step", "stage-refit", "install-state"} <= tasks


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
        assert_bits_equal(module_bits(live), module_bits(dense))
        if step:
            assert res["tensors_loaded"] < len(ck), "only changed tensors go through the loader"
        ck = _next(ck, step + 1)


def test_the_prefect_publish_tasks_use_and_keep_a_held_baseline(prefect_settings, tmp_path):
    """A ``Publisher`` whose steps run as Prefect tasks inside a flow: the baseline stays in memory
    (no baseline file is written or rebuilt) and every step is received bit-exact."""
    from prefect import flow
    from safetensors.torch import load_file

    from flows import Publisher, PublishOptions, run_receive
    from flows.orchestration.runner import PrefectRunner

    root = str(tmp_path / "bucket")
    opts = PublishOptions(cache_dir=str(tmp_path / "cache"))

    @flow(name="dcr-publish-held")
    def publish_held(pub, step: int):
        pub.runner = PrefectRunner()
        return pub.publish(ck, step)

    pub = Publisher(root, options=opts)
    ck = TinyFused.checkpoint(3)
    state = str(tmp_path / "state.safetensors")
    for step in range(3):
        res = publish_held(pub, step)
        assert res.kind == ("keyframe" if step == 0 else "delta") and pub.step == step
        assert "encode-and-write" in res.timings
        run_receive(root, "rx", state)
        assert_bits_equal(load_file(state), ck)
        ck = _next(ck, step + 1)
    assert not os.path.exists(tmp_path / "cache")


def test_task_results_are_serializable_references_and_nothing_is_persisted(prefect_settings, tmp_path):
    """Every step's arguments and result pass Prefect's JSON serializer (the steps exchange
    references and small records, never tensors or open files), and no result is written to
    Prefect's result storage even where persistence is on by default: no rerun could use one."""
    from prefect.serializers import JSONSerializer
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, PREFECT_RESULTS_PERSIST_BY_DEFAULT, temporary_settings

    from flows import publish_refit, receive_refit, run_publish, run_receive
    from flows.orchestration.runner import PrefectRunner

    seen: list[str] = []
    serializer = JSONSerializer()

    class Checking(PrefectRunner):  # each step as a Prefect task, its inputs and output serialized
        def wrap(self, step):
            run = super().wrap(step)

            def checked(*args, **kwargs):
                out = run(*args, **kwargs)
                for what in (args, kwargs, out):
                    blob = serializer.dumps(what)
                    assert len(blob) < 1 << 20, f"{step.name}: {len(blob)} bytes: steps pass references, not data"
                seen.append(step.name)
                return out

            return checked

    store = tmp_path / "results"
    root = str(tmp_path / "bucket")
    ck = TinyFused.checkpoint(4)
    with temporary_settings({PREFECT_RESULTS_PERSIST_BY_DEFAULT: True, PREFECT_LOCAL_STORAGE_PATH: str(store)}):
        from prefect import flow

        @flow(persist_result=False)
        def checked_pipelines():
            run_publish(root, ck, 0, runner=Checking())
            run_publish(root, _next(ck, 1), 1, runner=Checking())
            run_receive(root, "rx", str(tmp_path / "s.safetensors"), runner=Checking())

        checked_pipelines()
        publish_refit(root, _next(ck, 2), 2)
        receive_refit(root, "rx", str(tmp_path / "s.safetensors"))
    assert {"plan-from-source", "encode-and-write", "write-manifest", "commit-step", "plan-receive",
            "stage-refit", "install-state", "record-receiver-commit"} <= set(seen), seen
    assert not [p for p in store.rglob("*") if p.is_file()], "results were persisted"


@pytest.mark.slow  # about 16 s: the slow suite (make test-slow)
def test_deployments_from_the_one_source_run_with_typed_options_through_a_served_process(prefect_settings, tmp_path):
    """``dcr serve`` serves infra/prefect.yaml; runs of its deployments get their options as
    mappings (as a deployment or the UI passes them), validated into the typed models; the server
    refuses a run with bad options against the flow's parameter schema before anything runs."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.exceptions import PrefectHTTPStatusError
    from safetensors.torch import load_file

    from storage.catalog import Catalog
    from storage.root import Root
    from tests.support.helpers import write_safetensors

    root, state = str(tmp_path / "bucket"), str(tmp_path / "rx.safetensors")
    ck0 = TinyFused.checkpoint(5)
    ck1 = _next(ck0, 1)
    write_safetensors(tmp_path / "c0.safetensors", ck0)
    write_safetensors(tmp_path / "c1.safetensors", ck1)
    env = {**os.environ, "PREFECT_API_URL": prefect_settings, "DCR_ROOT": root, "DCR_RECEIVER_ID": "rx",
           "DCR_RECEIVER_STATE": state, "DCR_GC_KEEP_LAST": "3", "DCR_CACHE_DIR": str(tmp_path / "cache"),
           "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    served = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve"], env=env, cwd=REPO,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with get_client(sync_client=True) as client:
            for _ in range(120):
                try:
                    client.read_deployment_by_name("dcr-gc/serve-gc")
                    break
                except Exception:  # noqa: BLE001 - not registered yet
                    time.sleep(0.5)
        run = run_deployment("dcr-publish-refit/serve-publisher", parameters={
            "source": str(tmp_path / "c0.safetensors"), "step": 0, "options": {"chunk_bytes": 4096, "io_workers": 2},
        }, timeout=180, poll_interval=1)
        assert run.state.is_completed(), run.state
        assert run.name == "publish-step-0"
        assert Catalog(Root(root)).manifest(0).chunk_bytes == 4096, "the run's options reached the publisher"
        with pytest.raises(PrefectHTTPStatusError, match="options.io_workers"):  # refused: no run is created
            run_deployment("dcr-publish-refit/serve-publisher", parameters={
                "source": str(tmp_path / "c1.safetensors"), "step": 1, "options": {"io_workers": 0},
            }, timeout=180, poll_interval=1)
        assert Catalog(Root(root)).latest_committed() == 0
        assert run_deployment("dcr-publish-refit/serve-publisher", parameters={
            "source": str(tmp_path / "c1.safetensors"), "step": 1}, timeout=180, poll_interval=1).state.is_completed()
        rx = run_deployment("dcr-receive-refit/serve-receiver", timeout=180, poll_interval=1)
        assert rx.state.is_completed(), rx.state
        assert_bits_equal(load_file(state), ck1)
        assert "rx" in Catalog(Root(root)).receivers(1)
        with get_client(sync_client=True) as client:
            fr = client.read_flow_run(rx.id)
            assert {"dcr", "dcr-receive", "receiver:rx"} <= set(fr.tags)
    finally:
        served.terminate()
        served.wait(30)


@pytest.mark.slow  # five CLI processes importing Prefect: about 20 s
def test_cli_runs_the_prefect_flows_only_when_asked_and_keeps_its_output_contract(prefect_settings, tmp_path):
    """With PREFECT_API_URL set, a plain ``dcr`` call still runs in-process (no flow run is made); with
    ``--orchestrator prefect`` it makes a named, tagged run with artifacts and a summary log line, and
    the terminal shows only the command's lines: ``-q`` prints nothing, an error is one line."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags, LogFilter, LogFilterFlowRunId

    from tests.support.helpers import write_safetensors

    ck0, ck1 = TinyFused.checkpoint(2), None
    ck1 = _next(ck0, 1)
    write_safetensors(tmp_path / "c0.safetensors", ck0)
    write_safetensors(tmp_path / "c1.safetensors", ck1)
    root = str(tmp_path / f"b-{uuid.uuid4().hex[:8]}")
    env = {**os.environ, "PREFECT_API_URL": prefect_settings, "DCR_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("DCR_ORCHESTRATOR", None)

    def dcr(*args):
        return subprocess.run([sys.executable, "-m", "flows.cli", *map(str, args)], env=env, capture_output=True,
                              text=True, cwd=REPO, timeout=300)

    def runs():
        with get_client(sync_client=True) as client:
            return client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"root:{root}"])))

    out = dcr("publish", root, tmp_path / "c0.safetensors", "--step", 0)  # in-process despite PREFECT_API_URL
    assert out.returncode == 0 and out.stderr == "" and "committed step 0" in out.stdout, out
    assert runs() == []
    out = dcr("publish", root, tmp_path / "c1.safetensors", "--step", 1, "--orchestrator", "prefect", "-q")
    assert (out.returncode, out.stdout, out.stderr) == (0, "", ""), out
    out = dcr("publish", root, tmp_path / "c1.safetensors", "--step", 1, "--orchestrator", "prefect")
    assert out.returncode == 3 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert lines[-1] == f"dcr: error: {root}: step 1 is already committed", lines
    assert len(lines) == 2 and lines[0].startswith("dcr: prefect: flow run 'publish-step-1' failed: http"), lines
    out = dcr("publish", root, tmp_path / "c1.safetensors", "--step", 1, "--orchestrator", "prefect", "-q")
    assert (out.returncode, out.stdout, out.stderr.strip()) == (3, "", f"dcr: error: {root}: step 1 is already committed")
    out = dcr("receive", root, "--receiver", "rollout-0", "--state", tmp_path / "rx.safetensors", "--orchestrator", "prefect")
    assert out.returncode == 0 and "receiver rollout-0 at step 1" in out.stdout, out
    assert out.stderr.startswith("dcr: prefect: flow run 'receive-rollout-0-to-1' completed: http"), out.stderr

    by_name = {r.name: r for r in runs()}
    assert {"publish-step-1", "receive-rollout-0-to-1"} <= set(by_name), sorted(by_name)
    pub = next(r for r in runs() if r.name == "publish-step-1" and r.state.is_completed())
    rx = by_name["receive-rollout-0-to-1"]
    assert {"dcr", "dcr-publish", f"root:{root}", "step:1"} <= set(pub.tags)
    assert {"dcr", "dcr-receive", f"root:{root}", "receiver:rollout-0"} <= set(rx.tags)
    with get_client(sync_client=True) as client:
        arts = {a.key: a for a in client.read_artifacts() if a.flow_run_id in (pub.id, rx.id)}
        table = json.loads(arts["dcr-publish"].data)
        assert table[0]["step"] == 1 and table[0]["tensors changed"].endswith(f"/{len(ck0)}")
        assert table[0]["stored / full"] != "-" and any(str(r["step"]).startswith("task ") for r in table[1:])
        assert "manifest.json" in arts["dcr-step-1"].data and "commit.json" in arts["dcr-step-1"].data
        rx_row = json.loads(arts["dcr-receive-rollout-0"].data)[0]
        assert (rx_row["to"], rx_row["latest"], rx_row["lag (steps)"]) == (1, 1, 0)
        assert rx_row["bytes pulled"] > 0
        logs = [lg.message for lg in client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[pub.id])))]
    assert any(m.startswith("committed step 1 (delta against step 0)") for m in logs), logs


def test_the_mirror_flow_copies_committed_steps_as_one_task_per_step(prefect_settings, tmp_path):
    from safetensors.torch import load_file

    from flows import mirror_refit, run_publish, run_receive

    g = torch.Generator().manual_seed(0)
    cks = [{"w": torch.randn(64, 32, generator=g).bfloat16()}]
    cks.append({"w": cks[0]["w"].clone()})
    cks[1]["w"].view(-1).view(torch.int16)[::5] ^= 1
    src, dst = str(tmp_path / "origin"), str(tmp_path / "mirror")
    for s, ck in enumerate(cks):
        run_publish(src, ck, s)
    r = mirror_refit(src, dst)
    assert r["copied_steps"] == [0, 1] and r["bytes_copied"] > 0
    state = tmp_path / "s.safetensors"
    run_receive(dst, "r", str(state))
    assert_bits_equal(load_file(state), cks[1])


def test_the_fleet_flow_is_a_named_tagged_run_whose_members_table_says_who_failed(prefect_settings, tmp_path):
    """``fleet_refit`` with a member that is down: the run (``fleet-gen-to-0``) fails with the
    one-line error, its tasks are the fleet's phases, and its table artifact lists the member."""
    import socket

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    from flows import fleet_refit, run_publish
    from flows.receive.fleet import FleetSwitchError

    root = str(tmp_path / f"f-{uuid.uuid4().hex[:8]}")
    run_publish(root, TinyFused.checkpoint(2), 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(FleetSwitchError, match="nobody switched"):
        fleet_refit(root, [f"m0={dead}"], 0, "gen")
    with get_client(sync_client=True) as client:
        (run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"root:{root}"])))
        assert run.name == "fleet-gen-to-0" and run.state.is_failed()
        assert {"dcr", "dcr-fleet", "fleet:gen"} <= set(run.tags)
        tasks = {t.name.rsplit("-", 1)[0] for t in client.read_task_runs() if t.flow_run_id == run.id}
        assert {"resolve-fleet", "prepare-members", "drop-prepared", "read-back-members", "record-fleet"} <= tasks, tasks
        (art,) = [a for a in client.read_artifacts() if a.flow_run_id == run.id and a.key == "dcr-fleet-gen"]
        (row,) = json.loads(art.data)
        assert (row["member"], row["receiver"], row["outcome"]) == (dead, "m0", "failed")
    # another coordinator holds the fleet's lease: the flow waits as long as it is told (wait), then gives up
    from dcr_core.errors import BusyError
    from storage import fleet_lease
    from storage.root import Root

    other = fleet_lease.take(Root(root), "gen")
    with pytest.raises(BusyError, match=r"holds its lease \(epoch 2\) .*did not come free in 0\.5 s \(--wait\)$"):
        fleet_refit(root, [f"m0={dead}"], 0, "gen", None, 600.0, 0.5)
    other.release()
    # a credential in a flow parameter would be stored in Prefect's database: refused before anything runs
    with pytest.raises(UsageError, match=r"storage_options\['client_kwargs'\]\['aws_secret_access_key'\]: a credential"):
        fleet_refit(root, [f"m0={dead}"], 0, "gen", {"client_kwargs": {"aws_secret_access_key": "x"}})
