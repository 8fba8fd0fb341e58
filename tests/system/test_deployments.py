"""The README's "Deployments" section, line by line, against a real Prefect server and worker.

The bash block runs as written; the only change is the values of the ``export DCR_ROOT=...`` line
and of ``CKPTS`` (a temporary directory instead of a bucket and /data). The test then checks what
the section promises: the publisher deployment's run commits step 6, the receiver run its commit
event triggers brings the receiver's state to step 6 bit for bit (an idle run leaves no artifact,
no run persists a result, a few runs are scheduled ahead), a deploy with a bad setting is refused before
anything changes, and a redeploy leaves no scheduled run with the old parameters.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.support.cli import REPO, evolve, small_checkpoint
from tests.support.helpers import assert_bits_equal, write_safetensors
from tests.support.procs import stop, stop_from_file
from tests.support.servers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.prefect]


def readme_block() -> str:
    text = Path(REPO, "README.md").read_text()
    section = text.split("### Deployments", 1)[1]
    return section.split("```bash\n", 1)[1].split("```", 1)[0]


def test_the_readme_deployment_section_works_as_written(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from storage.catalog import Catalog
    from storage.root import Root

    block = readme_block()
    root, state, ckpts = tmp_path / "bucket", tmp_path / "rollout-0.safetensors", tmp_path / "ckpts"
    lines = block.splitlines()
    assert lines[1].startswith("export DCR_ROOT=") and "CKPTS=" in lines[2], block
    lines[1] = f"export DCR_ROOT={root} DCR_RECEIVER_ID=rollout-0 DCR_RECEIVER_STATE={state}"
    lines[2] = re.sub(r"CKPTS=\S+", f"CKPTS={ckpts}", lines[2])
    ckpts.mkdir()
    c5 = small_checkpoint(5)
    c6 = evolve(c5, 6)
    write_safetensors(ckpts / "ckpt-5.safetensors", c5)
    write_safetensors(ckpts / "ckpt-6.safetensors", c6)

    port = free_port()
    env = {
        "PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path),
        "PREFECT_HOME": str(tmp_path / "prefect"), "DCR_PREFECT_PORT": str(port), "DCR_CACHE_DIR": str(tmp_path / "cache"),
        "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    script = "set -euo pipefail\n" + "\n".join(lines) + '\necho "WORKER_PID=$!"\n'
    # Output to files, not pipes: the worker the block starts in the background keeps them open.
    out_path, err_path = tmp_path / "block.out", tmp_path / "block.err"
    with open(out_path, "w") as out_f, open(err_path, "w") as err_f:
        proc = subprocess.Popen(["/bin/bash", "-c", script], cwd=REPO, env=env, stdout=out_f, stderr=err_f,
                                start_new_session=True)
    proc.wait(timeout=300)
    out, err = out_path.read_text(), err_path.read_text()
    worker = int(m.group(1)) if (m := re.search(r"WORKER_PID=(\d+)", out)) else None
    api = f"http://127.0.0.1:{port}/api"
    try:
        assert proc.returncode == 0, (out[-3000:], err[-3000:])
        assert "committed step 5" in out
        cat = Catalog(Root(str(root)))
        with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:  # the manual publisher run, then a scheduled receiver run
                names = {r.name for r in client.read_flow_runs() if r.state and r.state.is_completed()}
                if "publish-step-6" in names and "receive-rollout-0-to-6" in names:
                    break
                time.sleep(2)
            assert {"publish-step-6", "receive-rollout-0-to-6"} <= names, sorted(names)
            assert cat.latest_committed() == 6
            assert_bits_equal(load_file(state), c6)
            # the receiver ran because the publish committed (its event triggered the deployment), not on a timer
            (to6,) = [r for r in client.read_flow_runs() if r.name == "receive-rollout-0-to-6"]
            assert to6.created_by is not None and to6.created_by.type == "AUTOMATION", to6.created_by
            receiver = client.read_deployment_by_name("dcr-receive-refit/receiver")
            scheduled = [r for r in client.read_flow_runs() if r.deployment_id == receiver.id and r.state
                         and r.state.is_scheduled()]
            assert len(scheduled) <= 4, len(scheduled)  # hourly: a few runs ahead, not one every 30 s
            # a run with nothing to do: no artifact, and no run anywhere persisted a result
            artifacts = len(client.read_artifacts())
            idle = client.create_flow_run_from_deployment(receiver.id)
            deadline = time.monotonic() + 120
            while not (run := client.read_flow_run(idle.id)).state.is_final() and time.monotonic() < deadline:
                time.sleep(1)
            assert run.state.is_completed() and run.name == "receive-rollout-0-to-6", (run.name, run.state)
            assert len(client.read_artifacts()) == artifacts
            kept = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "prefect" / "storage") for f in fs]
            assert kept == [], kept

            # a deploy with a bad setting is refused, naming it; nothing changes
            bad = subprocess.run(
                [os.path.join(os.path.dirname(sys.executable), "prefect"), "--no-prompt", "deploy", "--prefect-file",
                 "infra/prefect.yaml", "--all"], cwd=REPO, capture_output=True, text=True, timeout=120,
                env={**env, "PREFECT_API_URL": api, "DCR_ROOT": str(root), "DCR_RECEIVER_ID": "rollout-0",
                     "DCR_RECEIVER_STATE": "relative.safetensors", "DCR_PROJECT_DIR": REPO})
            assert bad.returncode != 0
            assert "dcr: error: refusing to deploy dcr-receive-refit/receiver: DCR_RECEIVER_STATE='relative.safetensors' " \
                   "must be an absolute path" in bad.stderr, bad.stderr[-2000:]
            dep = client.read_deployment_by_name("dcr-receive-refit/receiver")
            assert dep.parameters["state"] == str(state)

            # a redeploy with another state path: no run keeps the old one
            moved = tmp_path / "moved.safetensors"
            good = subprocess.run(
                [os.path.join(os.path.dirname(sys.executable), "prefect"), "--no-prompt", "deploy", "--prefect-file",
                 "infra/prefect.yaml", "--name", "receiver"], cwd=REPO, capture_output=True, text=True, timeout=120,
                env={**env, "PREFECT_API_URL": api, "DCR_ROOT": str(root), "DCR_RECEIVER_ID": "rollout-0",
                     "DCR_RECEIVER_STATE": str(moved), "DCR_PROJECT_DIR": REPO})
            assert good.returncode == 0, good.stderr[-2000:]
            dep = client.read_deployment_by_name("dcr-receive-refit/receiver")
            pending = [r for r in client.read_flow_runs() if r.deployment_id == dep.id and r.state
                       and r.state.is_scheduled()]
            assert all(r.parameters["state"] == str(moved) for r in pending), [r.parameters for r in pending]
    finally:
        if worker is not None:
            stop(worker, group=True)
        stop(proc.pid, group=True)
        pid_file = tmp_path / "prefect" / "server.pid"
        if pid_file.exists():
            stop_from_file(pid_file)
