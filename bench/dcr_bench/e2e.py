"""End-to-end part of ``dcr bench``: a delta publish + receive against moving the full checkpoint.

Each refit is timed twice: in-process (a ``Publisher``, which holds the committed policy in memory
as its next baseline, and ``run_receive`` patching the state file in place, with the object-store
client already open: what a long-running trainer and receiver pay per refit; the default rewrite
receive is timed beside it) and as two ``dcr`` command processes (the same
plus an interpreter start, imports, a new client, reading the new policy from its file, and the
publisher's baseline file instead of the held baseline). Its time splits into
*link time* (its bytes on the wire over the link rate) and *local time* (the rest: encoding,
digests, the commands' baseline file, the receiver's state file, per-request latency). The
full-checkpoint reference uploads and downloads the safetensors file through the same link; its bytes do not
depend on the change rate, so it is measured once per checkpoint size and link rate.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid

from safetensors.torch import load_file

from dcr_bench.command_times import dcr_seconds
from dcr_bench.demo import mismatch
from dcr_bench.netproxy import Proxy
from flows import Publisher, PublishOptions, ReceiveOptions, run_publish, run_receive
from storage.root import open_root

BUCKET = "dcr-bench"
STARTUP_IMPORTS = "import flows.cli, flows.cli.publish, flows.cli.receive"


def _copy_synced(src: str, dst: str) -> None:
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _setup(
    root: str, old, tmp: str, setup_opts: dict, publisher: bool = False
) -> tuple[PublishOptions, str, Publisher | None]:
    """Untimed: a keyframe of ``old`` and a receiver at it. The keyframe leaves the publisher's
    baseline file, or with ``publisher``, its baseline held in memory by the returned ``Publisher``."""
    popts = PublishOptions(cache_dir=os.path.join(tmp, "cache", uuid.uuid4().hex[:8]))
    state = os.path.join(tmp, f"receiver-{uuid.uuid4().hex[:8]}.safetensors")
    pub = Publisher(root, setup_opts, popts) if publisher else None
    if pub is not None:
        pub.publish(old, 0, keyframe=True)
    else:
        run_publish(root, old, 0, keyframe=True, storage_options=setup_opts, options=popts)
    run_receive(root, "bench", state, 0, storage_options=setup_opts)
    return popts, state, pub


def _check_and_clean(new, state: str, popts: PublishOptions | None) -> str | None:
    problem = mismatch(new, load_file(state))
    os.remove(state)
    if popts is not None:
        shutil.rmtree(popts.cache_dir, ignore_errors=True)
    return problem


def dcr_in_process(root: str, old, new, tmp: str, setup_opts: dict, timed_opts: dict, probe=None) -> dict:
    """The timed delta publish (from the in-memory tensors, by the ``Publisher`` that published the
    keyframe and holds it as baseline) and in-place receive of ``new``, in this process.

    ``probe()``, called right after the timed refit, snapshots the link's counters (before the
    comparison receive that follows)."""
    popts, state, publisher = _setup(root, old, tmp, setup_opts, publisher=True)
    publisher.storage_options = timed_opts  # the same ROOT, now through the timed link
    if timed_opts:  # a long-running trainer or receiver has its object-store client open already
        open_root(root, timed_opts).exists("zarr.json")
    t0 = time.perf_counter()
    pub = publisher.publish(new, 1)
    t1 = time.perf_counter()
    rec = run_receive(root, "bench", state, 1, storage_options=timed_opts, options=ReceiveOptions(in_place=True))
    t2 = time.perf_counter()
    counts = probe() if probe is not None else None
    problem = _check_and_clean(new, state, popts)
    # The same receive with the default rewrite of the state file, for comparison (not in total_s).
    other = os.path.join(tmp, f"receiver-{uuid.uuid4().hex[:8]}.safetensors")
    run_receive(root, "bench-rewrite", other, 0, storage_options=setup_opts)
    t3 = time.perf_counter()
    rewrite = run_receive(root, "bench-rewrite", other, 1, storage_options=timed_opts)
    rewrite_s = time.perf_counter() - t3
    problem = problem or _check_and_clean(new, other, None)
    return {
        "publish_s": t1 - t0, "receive_s": t2 - t1, "total_s": t2 - t0,
        "receive_rewrite_s": rewrite_s, "receive_rewrite_timings": rewrite.timings, "counts": counts,
        "bytes_stored": pub.summary["bytes_stored"], "bytes_pulled": rec.bytes_pulled,
        "exact": problem is None, "mismatch": problem,
        "publish_timings": pub.timings, "receive_timings": rec.timings,
    }


def _dcr(args: list[str], env: dict) -> float:
    return dcr_seconds(args, env)


def dcr_cli(root: str, old, new, new_file: str, tmp: str, setup_opts: dict, timed_opts: dict) -> dict:
    """The timed ``dcr publish`` (of the new checkpoint file) and ``dcr receive``, each its own process."""
    popts, state, _ = _setup(root, old, tmp, setup_opts)
    env = {**os.environ, "DCR_CACHE_DIR": popts.cache_dir}
    common = ["--orchestrator", "none", "-q"]
    for k, v in timed_opts.items():
        common += ["--storage-option", f"{k}={v}"]
    pub_s = _dcr(["publish", root, new_file, "--step", "1", *common], env)
    rec_s = _dcr(["receive", root, "--receiver", "bench", "--state", state, "--step", "1", "--in-place", *common], env)
    problem = _check_and_clean(new, state, popts)
    return {"publish_s": pub_s, "receive_s": rec_s, "total_s": pub_s + rec_s,
            "exact": problem is None, "mismatch": problem}


def startup_s(extra_imports: str = "", repeats: int = 3) -> float:
    """Best of ``repeats``: one interpreter start plus the imports a ``dcr publish``/``receive`` needs."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", STARTUP_IMPORTS + extra_imports], check=True)
        best = min(best, time.perf_counter() - t0)
    return best


def e2e_local(old, new, new_file: str, tmp: str, startup: float) -> dict:
    """On a local ROOT: what the pipeline costs without a network; the reference copies the file in and out."""
    root = os.path.join(tmp, f"root-{uuid.uuid4().hex[:8]}")
    dcr = dcr_in_process(root, old, new, tmp, {}, {})
    dcr.pop("counts", None)
    shutil.rmtree(root, ignore_errors=True)
    cli = {**dcr_cli(root, old, new, new_file, tmp, {}, {}), "startup_s": startup}
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root, exist_ok=True)
    stored, back = os.path.join(root, "full.safetensors"), os.path.join(tmp, "full-back.safetensors")
    t0 = time.perf_counter()
    _copy_synced(new_file, stored)
    t1 = time.perf_counter()
    _copy_synced(stored, back)
    t2 = time.perf_counter()
    os.remove(back)
    shutil.rmtree(root, ignore_errors=True)
    full = {"upload_s": t1 - t0, "download_s": t2 - t1, "total_s": t2 - t0, "bytes": os.path.getsize(new_file)}
    return {"dcr": dcr, "cli": cli, "full": full, "bandwidth": None}


class S3Service:
    """A moto S3 server and a bandwidth-capped proxy in front of it, both on 127.0.0.1.

    They run in a child process started here, so the server's request handling does not share
    the interpreter lock with the publisher and receiver being timed (a remote store would not)."""

    ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")

    def __init__(self, bandwidth: float):
        self.bandwidth = bandwidth
        self.bucket = BUCKET
        self.full_cache: dict[tuple[float, int], dict] = {}

    def __enter__(self) -> S3Service:
        import importlib.util
        import multiprocessing

        for mod in ("moto", "boto3", "s3fs", "flask"):
            if importlib.util.find_spec(mod) is None:
                raise ImportError(f"{mod} is not installed")
        self._saved = {k: os.environ.get(k) for k in (*self.ENV, *self.UNSET)}
        os.environ.update(self.ENV)
        for k in self.UNSET:
            os.environ.pop(k, None)
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked threads or locks
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_s3, args=(child, self.bandwidth), daemon=True)
        self._proc.start()
        child.close()
        try:
            if not self._conn.poll(120):
                raise RuntimeError("the S3 server process did not start within 120 s")
            self.direct, proxy_url = self._conn.recv()
        except BaseException:
            self.__exit__()
            raise
        self.proxy = _ProxyHandle(self._conn, proxy_url)
        import boto3

        boto3.client("s3", endpoint_url=self.direct).create_bucket(Bucket=BUCKET)
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(OSError, EOFError):
            self._conn.send("stop")
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(10)
        self._conn.close()
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def set_bandwidth(self, bandwidth: float) -> None:
        self.proxy.set_bandwidth(bandwidth)
        self.bandwidth = bandwidth

    def fs(self, endpoint: str):
        import s3fs

        return s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)


class _ProxyHandle:
    """The proxy of the server process, as seen from here: its URL, its byte counters, its rate."""

    def __init__(self, conn, url: str):
        self._conn, self.url = conn, url

    def counts(self) -> dict:
        self._conn.send("counts")
        return self._conn.recv()

    def set_bandwidth(self, bandwidth: float) -> None:
        self._conn.send(("bandwidth", bandwidth))
        self._conn.recv()


def _serve_s3(conn, bandwidth: float) -> None:
    """Server process: moto and the capped proxy until the parent says "stop" (or goes away)."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no per-request access log
    from moto.server import ThreadedMotoServer


    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    direct = f"http://{host}:{port}"
    proxy = Proxy(direct, bandwidth)
    try:
        conn.send((direct, proxy.url))
        while True:
            msg = conn.recv()
            if msg == "counts":
                # with the CPU seconds this process (server and proxy) has used, on the same cores
                conn.send({**proxy.counts(), "kinds": dict(proxy.kinds), "cpu_s": time.process_time()})
            elif isinstance(msg, tuple) and msg[0] == "bandwidth":
                proxy.bandwidth = msg[1]
                conn.send(True)
            else:
                break
    except (EOFError, OSError):
        pass
    finally:
        proxy.close()
        server.stop()


def _wire(svc: S3Service, before: dict, after: dict | None = None) -> int:
    after = after or svc.proxy.counts()
    return after["bytes_up"] + after["bytes_down"] - before["bytes_up"] - before["bytes_down"]


def _server_cpu(svc: S3Service, before: dict, after: dict | None = None) -> float:
    return (after or svc.proxy.counts())["cpu_s"] - before["cpu_s"]


def _full_s3(svc: S3Service, new_file: str, tmp: str) -> dict:
    """Upload and download the full checkpoint through the capped link (and, for the test server's
    own per-object cost, straight to it)."""
    prefix = f"{BUCKET}/full-{uuid.uuid4().hex[:10]}"
    size = os.path.getsize(new_file)
    fs = svc.fs(svc.proxy.url)
    back = os.path.join(tmp, "full-back.safetensors")
    before = svc.proxy.counts()
    t0 = time.perf_counter()
    # One PUT (as for any object under 5 GB): a multipart upload would add the test server's
    # slow part reassembly to the reference, which real object stores do not charge for.
    fs.put_file(new_file, f"{prefix}/full.safetensors", chunksize=max(50 << 20, size))
    t1 = time.perf_counter()
    fs.get_file(f"{prefix}/full.safetensors", back)
    t2 = time.perf_counter()
    wire = _wire(svc, before)
    direct_fs = svc.fs(svc.direct)
    t3 = time.perf_counter()
    direct_fs.put_file(new_file, f"{prefix}/full-direct.safetensors", chunksize=max(50 << 20, size))
    direct_fs.get_file(f"{prefix}/full-direct.safetensors", back)
    t4 = time.perf_counter()
    os.remove(back)
    direct_fs.rm(prefix, recursive=True)  # moto keeps objects in memory
    return {"upload_s": t1 - t0, "download_s": t2 - t1, "total_s": t2 - t0, "bytes": size,
            "wire_bytes": wire, "unthrottled_direct_s": t4 - t3}


def e2e_s3(svc: S3Service, bandwidth: float, old, new, new_file: str, tmp: str, startup: float) -> dict:
    """Through the link capped at ``bandwidth``: the timed delta refit (in-process and as commands)
    against uploading and downloading the full file."""
    svc.set_bandwidth(bandwidth)
    direct, via = {"endpoint_url": svc.direct}, {"endpoint_url": svc.proxy.url}
    sides = {}
    for name in ("dcr", "cli"):
        prefix = f"{BUCKET}/run-{uuid.uuid4().hex[:10]}"
        before = svc.proxy.counts()
        if name == "dcr":
            sides[name] = dcr_in_process(f"s3://{prefix}", old, new, tmp, direct, via, svc.proxy.counts)
        else:
            sides[name] = {**dcr_cli(f"s3://{prefix}", old, new, new_file, tmp, direct, via), "startup_s": startup}
        after = sides[name].pop("counts", None)
        sides[name]["wire_bytes"] = _wire(svc, before, after)
        # The test server and the proxy run on this machine's cores: CPU a remote store would not take.
        sides[name]["server_cpu_s"] = _server_cpu(svc, before, after)
        end = after or svc.proxy.counts()
        sides[name]["requests"] = end["requests"] - before["requests"]
        kinds = {k: v - before["kinds"].get(k, 0) for k, v in end["kinds"].items()}
        sides[name]["request_kinds"] = {k: v for k, v in sorted(kinds.items()) if v}
        svc.fs(svc.direct).rm(prefix, recursive=True)  # moto keeps objects in memory
    key = (bandwidth, os.path.getsize(new_file))
    if key not in svc.full_cache:
        svc.full_cache[key] = _full_s3(svc, new_file, tmp)
    return {**sides, "full": dict(svc.full_cache[key]), "bandwidth": bandwidth}


def e2e_summary(r: dict) -> dict:
    """Ratios against the full reference, and each side's split into link time and local time.

    ``quotient`` = time ratio / byte ratio; the target is >= 0.8. ``target_dcr_s`` is the DCR
    time that would meet it: the full time over 0.8 x the byte ratio."""
    dcr, cli, full = r["dcr"], r["cli"], r["full"]
    byte_ratio = full["bytes"] / dcr["bytes_stored"] if dcr["bytes_stored"] else None
    r["byte_ratio"] = byte_ratio
    r["target_dcr_s"] = full["total_s"] / (0.8 * byte_ratio) if byte_ratio else None
    bw = r.get("bandwidth")
    for side in (dcr, cli, full):
        # The time the bytes alone need on the link; the rest of a refit's time is local work.
        side["link_s"] = side["wire_bytes"] / bw if bw and "wire_bytes" in side else None
        side["local_s"] = side["total_s"] - (side["link_s"] or 0.0)
    for prefix, side in (("", dcr), ("cli_", cli)):
        time_ratio = full["total_s"] / side["total_s"] if side["total_s"] else None
        r[prefix + "time_ratio"] = time_ratio
        r[prefix + "quotient"] = time_ratio / byte_ratio if time_ratio and byte_ratio else None
    return r
