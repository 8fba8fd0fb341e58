"""Publishing on a Dask cluster (``flows.workers``): a real ``LocalCluster`` of 2 worker processes on
127.0.0.1 and a real Prefect API server, both started here. What is stored, the manifest and the
policy digest must equal an in-process publish of the same checkpoints, whatever the grouping; a
worker killed (SIGKILL) in the middle of its group has the group run again elsewhere and the step
commits once, bit-exact."""

from __future__ import annotations

import contextvars
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
from tests.support.helpers import attempt_objects as _attempt_objects

pytestmark = [pytest.mark.prefect, pytest.mark.slow]  # a LocalCluster and a Prefect server per module: make test-slow (CI runs it)

dask = pytest.importorskip("distributed")

from tests.support.dask_cluster import EventLog, local_cluster, read_log  # noqa: E402

# how long a nanny may take to bring a killed worker back (a fresh process importing torch and
# Prefect: seconds on a quiet machine, over a minute on a loaded one)
WORKERS_BACK_S = 180


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
        cl.wait_for_workers(2, timeout=WORKERS_BACK_S)
        yield cl


@pytest.fixture
def event_log(client, tmp_path):
    """The file the workers append the points they reach to, for this test only: the plugin is
    removed when the test ends (the cluster outlives it, and the test's tmp_path goes with it)."""
    log = str(tmp_path / "events.jsonl")
    client.register_plugin(EventLog(log))
    try:
        yield log
    finally:
        client.unregister_worker_plugin(EventLog.name)


def _address(cluster) -> str:
    return "dask://" + cluster.scheduler_address.removeprefix("tcp://")


def _kill_when_reached(log: str, victim: int, point: str, **match) -> tuple[threading.Thread, dict]:
    """A thread that SIGKILLs worker process ``victim`` once the event log shows it reached ``point``
    (with ``match``'s fields) and paused there; it notes the group it killed in the dict."""
    killed: dict = {}

    def kill_when_paused():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            hits = [e for e in read_log(log) if e["pid"] == victim and e["point"] == point
                    and all(e.get(k) == v for k, v in match.items())]
            if hits:  # logged by its listener, which runs just before the failpoint blocks it there
                killed["group"] = hits[0]["group"]
                os.kill(victim, signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_when_paused, daemon=True)
    killer.start()
    return killer, killed


def _damage_a_chunk(root: str, step: int) -> str:
    """Flip a bit in the middle of the largest stored chunk of committed ``step``; its path."""
    marker = json.loads(open(os.path.join(root, layout.commit_key(step))).read())
    store = os.path.join(root, layout.store_dir(step, marker["attempt"]))
    chunk = max((os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs if f != "zarr.json"),
                key=os.path.getsize)
    data = bytearray(open(chunk, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(chunk, "wb").write(bytes(data))
    return chunk


def _checkpoints(tmp_path, n: int = 3) -> list[str]:
    paths = []
    for i, ck in enumerate(chain_of_steps(n, seed=7, ulps=0.5, big=300)):
        path = str(tmp_path / f"ck{i}.safetensors")
        write_safetensors(path, ck)
        paths.append(path)
    return paths


@pytest.mark.parametrize(("codec", "group_bytes", "steps"), [
    ("sparse", 8 << 10, 3),
    ("cond", 8 << 10, 3),
    # a group per tensor (a mapped task each, about 100 per step): the grouping does not depend on the
    # codec, so one codec, over a keyframe and one delta
    pytest.param("sparse", 1, 2, id="sparse-one-tensor-groups"),
])
def test_workers_store_what_one_process_stores(cluster, prefect_settings, tmp_path, codec, group_bytes, steps):
    """In-process, and on 2 workers with groups of 8 KiB or of one tensor each: the same objects
    byte for byte, the same manifests and policy digests; then a receive is bit-exact."""
    from flows import publish_refit
    from flows.options import DELTA_CODECS, PublishOptions
    from flows.publish.pipeline import run_publish
    from flows.receive.pipeline import run_receive

    paths = _checkpoints(tmp_path, steps)
    roots = {}
    for how in ("local", "workers"):
        root = str(tmp_path / how)
        digests = []
        for step, path in enumerate(paths):
            options = PublishOptions(cache_dir=str(tmp_path / f"cache-{how}"), chunk_bytes=1 << 12,
                                     delta_codec=DELTA_CODECS[codec], group_bytes=group_bytes)
            if how == "local":
                digests.append(run_publish(root, path, step, options=options).policy_digest)
            else:
                digests.append(publish_refit(root, path, step, options=options, workers=_address(cluster))["policy_digest"])
        roots[how] = (root, digests)
    (base_root, base_digests), (root, digests) = roots["local"], roots["workers"]
    assert digests == base_digests
    for step in range(len(paths)):
        objs, manifest = _attempt_objects(root, step)
        want_objs, want_manifest = _attempt_objects(base_root, step)
        assert sorted(objs) == sorted(want_objs)
        assert all(objs[k] == want_objs[k] for k in objs)
        assert manifest == want_manifest
    state = str(tmp_path / "state.safetensors")
    run_receive(root, "r", state)
    assert_bits_equal(read_state(state), read_state(paths[-1]))


@pytest.mark.faults(component="Dask workers", outcome="the group runs again on another worker; the step commits once, "
                    "bit-exact")
def test_a_worker_killed_mid_group_has_its_group_run_again(cluster, client, event_log, prefect_settings, tmp_path):
    """SIGKILL of the worker process that is inside a group (paused there, as it reported): Dask
    runs the group again on another worker, the step commits once and equals an in-process publish."""
    from flows import publish_refit
    from flows.options import PublishOptions
    from flows.publish.pipeline import run_publish

    paths = _checkpoints(tmp_path, 2)
    log = event_log
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
    killer, killed = _kill_when_reached(log, victim, "publish.group-started", step=1)
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
    client.wait_for_workers(2, timeout=WORKERS_BACK_S)  # the nanny restarted the victim: the cluster is whole again


@pytest.mark.faults(component="Prefect task cache", outcome="the flow run runs again in its attempt: the groups that "
                    "finished are Cached, only the others encode; the step commits bit-exact (a fresh attempt if "
                    "objects of the kept groups are gone)")
@pytest.mark.parametrize("lost", [False, True], ids=["kept", "objects-gone"])
def test_a_failed_publish_run_again_encodes_only_the_groups_that_had_not_finished(cluster, prefect_settings, tmp_path,
                                                                                   lost):
    """A ``--workers`` publish whose flow fails as its third group's result comes back, run again by
    Prefect (the flow's ``retries``): the same flow run keeps its attempt, so the groups that had
    finished come from Prefect's task cache (Cached) and only the others are encoded; the step equals
    an in-process publish byte for byte, and the kept results are deleted once it commits. With one
    object of a kept group deleted in between (what a ``dcr gc`` of the failed attempt does), the
    rerun notices before writing the manifest and encodes everything in a fresh attempt."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.options import PublishOptions
    from flows.prefect_flows import publish_checkpoint
    from flows.publish.groups import RESULTS
    from flows.publish.pipeline import run_publish

    paths = _checkpoints(tmp_path, 2)
    opts = {"chunk_bytes": 1 << 12, "group_bytes": 2 << 10}  # 9 groups
    root, ref, cache = str(tmp_path / "dask"), str(tmp_path / "local"), str(tmp_path / "c2")
    for step, path in enumerate(paths):
        run_publish(ref, path, step, options=PublishOptions(cache_dir=str(tmp_path / "c1"), **opts))
    run_publish(root, paths[0], 0, options=PublishOptions(cache_dir=cache, **opts))
    returned, gone = [], []

    def on_point(point, fields):
        if point != "publish.group-returned":
            return
        returned.append(fields)
        if lost and len(returned) == 4:  # the rerun's first result (group 0, kept): take an object away
            attempts = os.path.join(root, "steps", f"{1:012d}", "attempts")
            (attempt,) = os.listdir(attempts)
            packs = os.path.join(root, layout.store_key(1, attempt, layout.PACKS))
            victim = os.path.join(packs, sorted(os.listdir(packs))[0])  # a pack a group's result names
            os.unlink(victim)
            gone.append(victim)

    events.set_failpoints("publish.group-returned@3=fail")  # this process: the flow fails at the third result
    try:
        with events.listening(on_point):
            state = publish_checkpoint.with_options(retries=1)(
                root, paths[1], 1, options=PublishOptions(cache_dir=cache, **opts), workers=_address(cluster),
                return_state=True)
    finally:
        events.set_failpoints(None)
    assert state.is_completed(), state
    run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        runs = [t for t in client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
                if t.name.startswith("encode-group-")]
    groups = {t.name for t in runs}
    assert len(groups) >= 6, groups
    done = {g: [t.state.name for t in runs if t.name == g] for g in groups}
    marker = json.loads(open(os.path.join(root, layout.commit_key(1))).read())
    if not lost:
        assert marker["attempt"] == str(run_id).replace("-", "")  # the rerun kept the flow run's attempt
        for g in ("encode-group-0", "encode-group-1", "encode-group-2"):  # finished before the failure
            assert sorted(done[g]) == ["Cached", "Completed"], (g, done[g])
        cached = [g for g, states in done.items() if "Cached" in states]
        # encoded once each, but for at most the 2 groups that were running on the 2 workers as the flow failed
        assert sum(states.count("Completed") for states in done.values()) <= len(groups) + 2, done
        # at least the 3 that had returned; all of them where the workers finished every group before the
        # flow saw its third result (a loaded machine): then the rerun encodes none
        assert 3 <= len(cached) <= len(groups), done
    else:
        assert gone and marker["attempt"] != str(run_id).replace("-", "")  # everything again, in a fresh attempt
    assert all("Completed" in states or "Cached" in states for states in done.values())
    objs, manifest = _attempt_objects(root, 1)
    want_objs, want_manifest = _attempt_objects(ref, 1)
    assert objs == want_objs and manifest == want_manifest
    assert os.listdir(os.path.join(cache, RESULTS)) == []  # the kept results went with the commit


@pytest.mark.faults(component="Dask workers", outcome="the group runs again on another worker; the materialized file "
                    "is the one-process file, byte for byte")
def test_a_worker_killed_mid_rewrite_group_has_its_group_run_again(cluster, client, event_log, prefect_settings, tmp_path):
    """SIGKILL of the worker process paused inside a ``rewrite-group`` of a materialize (as it
    reported): Dask runs the group again elsewhere; the file equals an in-process materialize."""
    from flows import materialize_refit
    from flows.options import PublishOptions, ReceiveOptions
    from flows.publish.pipeline import run_publish
    from flows.receive.pipeline import run_materialize

    paths = _checkpoints(tmp_path, 2)
    root = str(tmp_path / "root")
    for step, path in enumerate(paths):
        run_publish(root, path, step, options=PublishOptions(cache_dir=str(tmp_path / "c"), chunk_bytes=1 << 12))
    log = event_log
    pids = client.run(os.getpid)
    victim_addr = sorted(pids)[0]
    victim = pids[victim_addr]
    client.run(events.set_failpoints, "receive.group-started@1=pause", workers=[victim_addr])
    killer, killed = _kill_when_reached(log, victim, "receive.group-started")
    out, want = str(tmp_path / "w.safetensors"), str(tmp_path / "l.safetensors")
    materialize_refit(root, 1, out, options=ReceiveOptions(group_bytes=8 << 10), workers=_address(cluster))
    killer.join(10)
    assert "group" in killed, "the victim never reached a group"
    done = [e for e in read_log(log) if e["point"] == "receive.group-done"]
    assert [e for e in done if e["group"] == killed["group"]] and all(e["pid"] != victim for e in done)
    assert {e["group"] for e in done} == set(range(done[0]["groups"]))
    run_materialize(root, 1, want)
    assert open(out, "rb").read() == open(want, "rb").read()
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    client.wait_for_workers(2, timeout=WORKERS_BACK_S)


def test_what_cannot_travel_is_refused_in_one_line(cluster, prefect_settings, tmp_path):
    import torch

    from flows import materialize_refit, publish_refit, receive_refit
    from flows.workers import parse_workers

    ck = chain_of_steps(1, seed=1)[0]
    with pytest.raises(UsageError, match="tensors held in this process cannot travel"):
        publish_refit(str(tmp_path / "r"), ck, 0, workers=_address(cluster))
    path = str(tmp_path / "ck.safetensors")
    write_safetensors(path, ck)
    with pytest.raises(UsageError, match="memory:// ROOT lives in one process"):
        publish_refit("memory://dask-test", path, 0, workers=_address(cluster))
    with pytest.raises(UsageError, match="memory:// ROOT lives in one process"):
        materialize_refit("memory://dask-test", None, str(tmp_path / "m.safetensors"), workers=_address(cluster))
    class Live(torch.nn.Linear):  # a live module (a receiver kind): it loads weights by name
        def load_weights(self, weights):
            return set()

    with pytest.raises(UsageError, match="a live module or an engine receives in its own process"):
        receive_refit(str(tmp_path / "r"), "x", Live(2, 2), workers=_address(cluster))
    with pytest.raises(UsageError, match="Linear is not a receiver"):
        receive_refit(str(tmp_path / "r"), "x", torch.nn.Linear(2, 2), workers=_address(cluster))
    for bad in ("tcp://h:1", "dask://h", "dask://h:0", "-1", "two", True, 5000):
        with pytest.raises(UsageError, match="workers must be"):
            parse_workers(bad)
    assert parse_workers(0) is None and parse_workers("2") == 2 and parse_workers("dask://[::1]:8786") == "tcp://[::1]:8786"


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


def test_cli_mirrors_materializes_receives_and_verifies_on_workers(cluster, prefect_settings, tmp_path):
    """``dcr mirror|materialize|receive|verify --workers dask://...``: the results are bit-exact,
    and a damaged chunk fails ``verify --workers`` naming it. (How a command starts its own API and
    LocalCluster for ``--workers N`` is one code path for every command: the publish test above
    covers it; these run on the module's cluster and the run's API.)"""
    paths = _checkpoints(tmp_path, 2)
    origin, mirror = str(tmp_path / "origin"), str(tmp_path / "mirror")
    env = dict(os.environ, PREFECT_API_URL=prefect_settings, DCR_CACHE_DIR=str(tmp_path / "cache"))
    dcr = [sys.executable, "-m", "flows.cli"]
    workers = _address(cluster)

    def run(*argv: str, ok: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([*dcr, *argv], env=env, capture_output=True, text=True, timeout=300)
        assert (out.returncode == 0) == ok, out.stderr[-3000:]
        return out

    for step, path in enumerate(paths):
        run("publish", origin, path, "--step", str(step), "--chunk-bytes", "4096", "-q")
    assert json.loads(run("mirror", origin, mirror, "--workers", workers, "--json").stdout)["copied_steps"] == [0, 1]
    out = str(tmp_path / "full.safetensors")
    run("materialize", mirror, "--step", "1", "--out", out, "--workers", workers, "-q")
    assert_bits_equal(read_state(out), read_state(paths[1]))
    state = str(tmp_path / "state.safetensors")
    run("receive", mirror, "--receiver", "r", "--state", state, "--step", "0", "-q")
    run("receive", mirror, "--receiver", "r", "--state", state, "--workers", workers, "-q")
    assert_bits_equal(read_state(state), read_state(paths[1]))
    report = json.loads(run("verify", mirror, "--deep", "--workers", workers, "--json").stdout)
    assert report["steps"] == [0, 1] and report["replayed"] == [1] and not report["errors"]
    chunk = _damage_a_chunk(mirror, 1)
    failed = run("verify", mirror, "--workers", workers, ok=False)
    assert "dcr: verify:" in failed.stderr and os.path.basename(chunk) in failed.stderr, failed.stderr[-2000:]
    for argv, why in ((["mirror", origin, mirror, "--workers", workers, "--follow"], "does not --follow"),
                      (["receive", mirror, "--receiver", "r", "--state", state, "--workers", workers, "--in-place"],
                       "not with --in-place"),
                      (["verify", mirror, "--workers", "dask://nowhere"], "workers must be")):
        bad = run(*argv, ok=False)
        assert why in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


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
        # in this context: Prefect's settings (the test's API) are a context variable, which a new
        # thread does not inherit (without them the publish starts a temporary API server of its own)
        t = threading.Thread(target=contextvars.copy_context().run, args=(publish,), daemon=True)
        t.start()
        deadline = time.monotonic() + 120
        while ("failpoint publish.group-started@1 reached" not in log.read_text() and t.is_alive()
               and time.monotonic() < deadline):
            time.sleep(0.1)
        assert "failpoint publish.group-started@1 reached" in log.read_text(), f"no worker reached a group: {outcome}"
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


def _files(root: str) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            path = os.path.join(dirpath, f)
            out[os.path.relpath(path, root)] = open(path, "rb").read()
    return out


def test_mirror_materialize_receive_and_verify_through_workers(cluster, client, event_log, prefect_settings, tmp_path):
    """The way down from the origin through one LocalCluster of 2 processes: mirror on workers
    (the mirror holds the origin's committed objects byte for byte), materialize and receive on
    workers (the files an in-process materialize and receive write, byte for byte), verify on
    workers (the in-process report; a damaged chunk named)."""
    from flows import materialize_refit, mirror_refit, receive_refit, run_publish, verify_refit
    from flows.maintenance.audit import verify
    from flows.options import PublishOptions, ReceiveOptions
    from flows.receive.pipeline import run_materialize, run_receive
    from storage.root import open_root

    paths = _checkpoints(tmp_path)
    origin, mirror, address = str(tmp_path / "origin"), str(tmp_path / "mirror"), _address(cluster)
    log = event_log
    workers = set(client.run(os.getpid).values())
    for step, path in enumerate(paths):  # publishing on workers: test_workers_store_what_one_process_stores
        run_publish(origin, path, step, options=PublishOptions(cache_dir=str(tmp_path / "cache"), chunk_bytes=1 << 12))

    res = mirror_refit(origin, mirror, workers=address, group_bytes=16 << 10)
    assert res["copied_steps"] == [0, 1, 2] and res["objects_copied"] > 3
    held = _files(mirror)
    origin_files = _files(origin)
    assert held and all(origin_files[k] == v for k, v in held.items())  # byte for byte, the origin's objects
    for step in range(3):
        objs, _ = _attempt_objects(mirror, step)
        want, _ = _attempt_objects(origin, step)
        assert objs == want
    copied = [e for e in read_log(log) if e["point"] == "mirror.object-copied"]
    assert len(copied) == res["objects_copied"] and {e["pid"] for e in copied} <= workers

    mapped, local = str(tmp_path / "w.safetensors"), str(tmp_path / "l.safetensors")
    r = materialize_refit(mirror, 2, mapped, options=ReceiveOptions(group_bytes=8 << 10), workers=address)
    run_materialize(mirror, 2, local)
    assert r["step"] == 2 and r["bytes_pulled"] > 0
    assert open(mapped, "rb").read() == open(local, "rb").read()
    assert_bits_equal(read_state(mapped), read_state(paths[2]))
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    done = [e for e in read_log(log) if e["point"] == "receive.group-done"]
    assert {e["pid"] for e in done} <= workers and len({(e["step"], e["group"]) for e in done}) == len(done)
    assert {e["group"] for e in done if e["step"] == 2} == set(range(done[-1]["groups"])) and done[-1]["groups"] > 3

    # A receiver on workers: from nothing to step 1, then from its held step 1 to 2 (the held bits
    # read and checked where each group runs); the same files as a receiver in one process.
    before = len(read_log(log))
    on_workers, here = str(tmp_path / "state-w.safetensors"), str(tmp_path / "state-l.safetensors")
    for step in (1, None):
        r = receive_refit(mirror, "rw", on_workers, step, options=ReceiveOptions(group_bytes=8 << 10), workers=address)
        run_receive(mirror, "rl", here, step)
        assert open(on_workers, "rb").read() == open(here, "rb").read()
    assert r["moves"] == ["forward:2"] and r["bytes_pulled"] > 0
    assert_bits_equal(read_state(on_workers), read_state(paths[-1]))
    grouped = [e for e in read_log(log)[before:] if e["point"] == "receive.group-done"]
    assert {e["step"] for e in grouped} == {1, 2} and {e["pid"] for e in grouped} <= workers

    checked = verify_refit(mirror, deep=True, workers=address, group_bytes=8 << 10)
    local = verify(open_root(mirror), deep=True)
    assert not checked["errors"] and not local.errors
    assert (checked["chunks"], checked["bytes"], checked["replayed"]) == (local.chunks, local.bytes, local.replayed)
    assert checked["replayed"] == [1, 2] and checked["steps"] == [0, 1, 2]

    chunk = _damage_a_chunk(mirror, 1)
    damaged = verify_refit(mirror, 1, workers=address, group_bytes=8 << 10)
    assert damaged["errors"] and damaged["steps"] == [1]
    assert any(os.path.relpath(chunk, mirror) in e or os.path.basename(chunk) in e for e in damaged["errors"]), damaged
    assert all("\n" not in e for e in damaged["errors"])


def test_mapped_tasks_run_untagged_in_their_tagged_flow_run(cluster, prefect_settings, tmp_path):
    """The ``encode-group`` task runs carry no tags (``flows.workers.untagged``: no tag-concurrency
    call to the API as each starts), while the flow run and its own tasks keep DCR's tags."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.options import PublishOptions
    from flows.prefect_flows import publish_checkpoint

    (path,) = _checkpoints(tmp_path, 1)
    root = str(tmp_path / "root")
    state = publish_checkpoint(root, path, 0, options=PublishOptions(cache_dir=str(tmp_path / "c"), chunk_bytes=1 << 12,
                                                                     group_bytes=8 << 10),
                               workers=_address(cluster), return_state=True)
    assert state.is_completed(), state
    run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(run_id)
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    mapped = [t for t in runs if t.name.startswith("encode-group-")]
    here = [t for t in runs if not t.name.startswith("encode-group-")]
    assert len(mapped) > 1 and all(t.tags == [] for t in mapped), [(t.name, t.tags) for t in mapped]
    assert here and all({"dcr", "dcr-publish", "step:0"} <= set(t.tags) for t in here), [(t.name, t.tags) for t in here]
    assert {"dcr", "dcr-publish", f"root:{root}", "step:0"} <= set(flow_run.tags)
