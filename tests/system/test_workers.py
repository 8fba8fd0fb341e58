"""Publishing on a Dask cluster (``flows.workers``): a real ``LocalCluster`` of 2 worker processes on
127.0.0.1 and a real Prefect API server, both started here. What is stored, the manifest and the
policy digest must equal an in-process publish of the same checkpoints, whatever the grouping; a
worker killed (SIGKILL) in the middle of its group has the group run again elsewhere and the step
commits once, bit-exact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from dcr_core import events
from dcr_core.errors import UsageError
from storage import layout
from tests.support.helpers import assert_bits_equal, chain_of_steps, read_state, write_safetensors

pytestmark = pytest.mark.prefect

dask = pytest.importorskip("distributed")

from tests.support.dask_cluster import EventLog, local_cluster, read_log  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    c = local_cluster(2)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def client(cluster):
    from distributed import Client

    with Client(cluster) as cl:
        cl.wait_for_workers(2, timeout=60)
        yield cl


@pytest.fixture
def prefect_settings(prefect_api):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_api}):
        yield prefect_api


def _address(cluster) -> str:
    return "dask://" + cluster.scheduler_address.removeprefix("tcp://")


def _checkpoints(tmp_path, n: int = 3) -> list[str]:
    paths = []
    for i, ck in enumerate(chain_of_steps(n, seed=7, ulps=0.5, big=300)):
        path = str(tmp_path / f"ck{i}.safetensors")
        write_safetensors(path, ck)
        paths.append(path)
    return paths


def _attempt_objects(root: str, step: int) -> tuple[dict[str, bytes], dict]:
    """Every stored object of ``step``'s committed attempt (relative to it, stream indexes aside) and
    its manifest with what differs between any two publishes (attempt id, time) taken out."""
    marker = json.loads(open(os.path.join(root, layout.commit_key(step))).read())
    attempt_dir = os.path.dirname(os.path.join(root, layout.manifest_key(step, marker["attempt"])))
    objects = {}
    for dirpath, _, files in os.walk(attempt_dir):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), attempt_dir)
            if not rel.startswith("stream/"):  # announcements: per chunk in one process, per group on workers
                objects[rel] = open(os.path.join(dirpath, f), "rb").read()
    manifest = json.loads(objects.pop(os.path.basename(layout.manifest_key(step, marker["attempt"]))))
    for k in ("attempt", "created_at", "created", "time"):
        manifest.pop(k, None)
    return objects, manifest


@pytest.mark.parametrize("codec", ["sparse", pytest.param("cond", marks=pytest.mark.slow)])
def test_workers_store_what_one_process_stores(cluster, prefect_settings, tmp_path, codec):
    """In-process, and on 2 workers with groups of every size from one tensor up: the same objects
    byte for byte, the same manifests and policy digests; then a receive is bit-exact."""
    from flows import publish_refit
    from flows.options import DELTA_CODECS, PublishOptions
    from flows.publish.pipeline import run_publish
    from flows.receive.pipeline import run_receive

    paths = _checkpoints(tmp_path)
    roots = {}
    for how, group_bytes in (("local", None), ("one-tensor groups", 1), ("8 KiB groups", 8 << 10)):
        root = str(tmp_path / how.replace(" ", "-"))
        digests = []
        for step, path in enumerate(paths):
            options = PublishOptions(cache_dir=str(tmp_path / f"cache-{how}"), chunk_bytes=1 << 12,
                                     delta_codec=DELTA_CODECS[codec], group_bytes=group_bytes)
            if how == "local":
                digests.append(run_publish(root, path, step, options=options).policy_digest)
            else:
                digests.append(publish_refit(root, path, step, options=options, workers=_address(cluster))["policy_digest"])
        roots[how] = (root, digests)
    base_root, base_digests = roots["local"]
    for how, (root, digests) in roots.items():
        assert digests == base_digests, how
        for step in range(len(paths)):
            objs, manifest = _attempt_objects(root, step)
            want_objs, want_manifest = _attempt_objects(base_root, step)
            assert sorted(objs) == sorted(want_objs), how
            assert all(objs[k] == want_objs[k] for k in objs), how
            assert manifest == want_manifest, how
    state = str(tmp_path / "state.safetensors")
    run_receive(roots["8 KiB groups"][0], "r", state)
    assert_bits_equal(read_state(state), read_state(paths[-1]))


@pytest.mark.slow
@pytest.mark.faults(component="Dask workers", outcome="the group runs again on another worker; the step commits once, "
                    "bit-exact")
def test_a_worker_killed_mid_group_has_its_group_run_again(cluster, client, prefect_settings, tmp_path):
    """SIGKILL of the worker process that is inside a group (paused there, as it reported): Dask
    runs the group again on another worker, the step commits once and equals an in-process publish."""
    from flows import publish_refit
    from flows.options import PublishOptions
    from flows.publish.pipeline import run_publish

    paths = _checkpoints(tmp_path, 2)
    log = str(tmp_path / "events.jsonl")
    client.register_plugin(EventLog(log))
    pids = client.run(os.getpid)
    victim_addr = sorted(pids)[0]
    victim = pids[victim_addr]
    opts = {"chunk_bytes": 1 << 12, "group_bytes": 8 << 10}
    root, ref = str(tmp_path / "dask"), str(tmp_path / "local")
    for step, path in enumerate(paths[:1]):
        run_publish(ref, path, step, options=PublishOptions(cache_dir=str(tmp_path / "c1"), **opts))
        publish_refit(root, path, step, options=PublishOptions(cache_dir=str(tmp_path / "c2"), **opts),
                      workers=_address(cluster))
    run_publish(ref, paths[1], 1, options=PublishOptions(cache_dir=str(tmp_path / "c1"), **opts))
    client.run(events.set_failpoints, "publish.group-started@1=pause", workers=[victim_addr])
    killed: dict = {}

    def kill_when_paused():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            hits = [e for e in read_log(log) if e["pid"] == victim and e["point"] == "publish.group-started"
                    and e["step"] == 1]
            if hits:
                time.sleep(0.2)  # it is blocked at the point now (pause never returns)
                killed["group"] = hits[0]["group"]
                os.kill(victim, signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_when_paused, daemon=True)
    killer.start()
    res = publish_refit(root, paths[1], 1, options=PublishOptions(cache_dir=str(tmp_path / "c2"), **opts),
                        workers=_address(cluster))
    killer.join(10)
    assert "group" in killed, "the victim never reached a group"
    group = killed["group"]
    step1 = [e for e in read_log(log) if e["step"] == 1]
    done = [e for e in step1 if e["point"] == "publish.group-done" and e["group"] == group]
    assert done and all(e["pid"] != victim for e in done), "the killed group was not run again elsewhere"
    assert not [e for e in step1 if e["pid"] == victim and e["point"] == "publish.group-done"]
    assert {e["group"] for e in step1 if e["point"] == "publish.group-done"} == set(range(step1[0]["groups"]))
    marker = json.loads(open(os.path.join(root, layout.commit_key(1))).read())
    attempts = os.path.dirname(os.path.dirname(os.path.join(root, layout.manifest_key(1, marker["attempt"]))))
    assert os.listdir(attempts) == [marker["attempt"]]  # the group ran again in the same attempt: one attempt
    objs, manifest = _attempt_objects(root, 1)
    want_objs, want_manifest = _attempt_objects(ref, 1)
    assert objs == want_objs and manifest == want_manifest
    assert res["step"] == 1
    client.wait_for_workers(2, timeout=60)  # the nanny restarted the victim: the cluster is whole again


def test_what_cannot_travel_is_refused_in_one_line(cluster, prefect_settings, tmp_path):
    from flows import publish_refit
    from flows.workers import parse_workers

    ck = chain_of_steps(1, seed=1)[0]
    with pytest.raises(UsageError, match="tensors held in this process cannot travel"):
        publish_refit(str(tmp_path / "r"), ck, 0, workers=_address(cluster))
    path = str(tmp_path / "ck.safetensors")
    write_safetensors(path, ck)
    with pytest.raises(UsageError, match="memory:// ROOT lives in one process"):
        publish_refit("memory://dask-test", path, 0, workers=_address(cluster))
    for bad in ("tcp://h:1", "dask://h", "dask://h:0", "-1", "two", True, 5000):
        with pytest.raises(UsageError, match="workers must be"):
            parse_workers(bad)
    assert parse_workers(0) is None and parse_workers("2") == 2 and parse_workers("dask://[::1]:8786") == "tcp://[::1]:8786"


@pytest.mark.slow
def test_cli_publishes_on_its_own_local_cluster(tmp_path):
    """``dcr publish --workers 2`` with no Prefect API configured: the CLI starts one local API
    and a LocalCluster of 2 processes; receivers get the bits."""
    paths = _checkpoints(tmp_path, 2)
    root = str(tmp_path / "bucket")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), DCR_CACHE_DIR=str(tmp_path / "cache"))
    dcr = [sys.executable, "-m", "flows.cli"]
    for step, path in enumerate(paths):
        out = subprocess.run([*dcr, "publish", root, path, "--step", str(step), "--workers", "2", "--chunk-bytes",
                              "4096", "--json"], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout)["step"] == step
    state = str(tmp_path / "state.safetensors")
    out = subprocess.run([*dcr, "receive", root, "--receiver", "r", "--state", state, "-q"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_bits_equal(read_state(state), read_state(paths[-1]))


def _start_cluster(tmp_path, tag: str, failpoints: str | None = None) -> tuple[subprocess.Popen, subprocess.Popen, str]:
    """A scheduler and a worker (2 processes of 1 thread), each its own process group, on 127.0.0.1."""
    sched_file = str(tmp_path / f"scheduler-{tag}.json")
    env = {k: v for k, v in os.environ.items() if k != "DCR_FAILPOINTS"}
    sched = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port",
                              "0", "--no-dashboard", "--scheduler-file", sched_file], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(sched_file) and time.monotonic() < deadline:
        time.sleep(0.1)
    address = json.loads(open(sched_file).read())["address"]
    wenv = dict(env, **({"DCR_FAILPOINTS": failpoints} if failpoints else {}))
    worker = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file", sched_file,
                               "--nworkers", "2", "--nthreads", "1", "--no-dashboard", "--host", "127.0.0.1"],
                              env=wenv, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"worker-{tag}.log", "w"),
                              start_new_session=True)
    return sched, worker, "dask://" + address.removeprefix("tcp://")


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(30)


@pytest.mark.slow
@pytest.mark.faults(component="Dask workers", outcome="the publish fails in one line, nothing is committed; a rerun "
                    "commits the step bit-exact")
def test_losing_the_scheduler_commits_nothing_and_a_rerun_succeeds(prefect_settings, tmp_path):
    from flows import publish_refit
    from flows.options import PublishOptions
    from flows.publish.pipeline import run_publish
    from flows.workers import WorkersLostError

    paths = _checkpoints(tmp_path, 2)
    opts = {"chunk_bytes": 1 << 12, "group_bytes": 8 << 10}
    root, ref = str(tmp_path / "dask"), str(tmp_path / "local")
    for step, path in enumerate(paths):
        run_publish(ref, path, step, options=PublishOptions(cache_dir=str(tmp_path / "c1"), **opts))
    run_publish(root, paths[0], 0, options=PublishOptions(cache_dir=str(tmp_path / "c2"), **opts))
    sched, worker, address = _start_cluster(tmp_path, "lost", "publish.group-started@1=pause")
    log = tmp_path / "worker-lost.log"
    outcome: dict = {}

    def publish():
        try:
            publish_refit(root, paths[1], 1, options=PublishOptions(cache_dir=str(tmp_path / "c2"), **opts),
                          workers=address)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            outcome["error"] = e

    try:
        t = threading.Thread(target=publish, daemon=True)
        t.start()
        deadline = time.monotonic() + 120
        while "failpoint publish.group-started@1 reached" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "failpoint publish.group-started@1 reached" in log.read_text(), "no worker reached a group"
        _stop(sched)  # kill -9 of the scheduler, with a group paused inside a worker
        t.join(180)
        assert not t.is_alive(), "the publish did not notice the scheduler was gone"
    finally:
        _stop(sched, worker)
    assert isinstance(outcome.get("error"), WorkersLostError), outcome
    assert "nothing was committed" in str(outcome["error"]) and "\n" not in str(outcome["error"])
    assert not os.path.exists(os.path.join(root, layout.commit_key(1)))
    sched, worker, address = _start_cluster(tmp_path, "again")
    try:
        publish_refit(root, paths[1], 1, options=PublishOptions(cache_dir=str(tmp_path / "c2"), **opts),
                      workers=address)
    finally:
        _stop(sched, worker)
    objs, manifest = _attempt_objects(root, 1)
    want_objs, want_manifest = _attempt_objects(ref, 1)
    assert objs == want_objs and manifest == want_manifest
