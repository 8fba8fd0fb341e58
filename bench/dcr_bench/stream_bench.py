"""``make bench-stream`` (``python -m dcr_bench.stream_bench``): streamed vs publish-then-receive.

On the benchmark's throttled S3 link (a moto server behind a proxy capping each direction, as in
``dcr bench``), one delta refit is timed from the start of the publish to the receiver's commit:

- sequential: the receiver is a ``dcr receive --follow`` process (polling every 0.05 s) that
  reads the step once it is committed;
- streamed: the same process with ``--stream``: it fetches and verifies the step's chunks while
  the publisher (a ``Publisher`` holding its baseline in memory, in this process) is still
  uploading them, and applies them after the commit.

The receiver patches its state file in place in both cases and is checked bit for bit against the
new weights. ``upload_s`` is the publish alone, ``download_s`` the sequential receiver's refit
alone (commit seen to commit recorded); the goal is streamed <= 0.6x sequential at 3% on the
10 MB/s link and within 20% of max(upload_s, download_s). Writes ``results.json``, ``results.md``
and ``latency.png`` under ``--out`` (default ``docs/bench-stream``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from safetensors.torch import load_file

from dcr_bench import data as bench_data
from dcr_bench.bench import machine_info, parse_size
from dcr_bench.demo import mismatch
from dcr_bench.e2e import BUCKET, S3Service
from dcr_bench.sim.calibrate import fp32_pair
from flows import Publisher, PublishOptions, run_receive
from storage.root import open_root

MB = 1e6
FOLLOWER_POLL_S = 0.05  # the follower's --interval


class Follower:
    """A ``dcr receive --follow`` process; ``done_at`` is when its report line arrived."""

    def __init__(self, root: str, state: str, endpoint: str, stream: bool, until: int):
        cmd = [sys.executable, "-m", "flows.cli", "receive", root, "--receiver", "follower", "--state", state,
               "--follow", "--until-step", str(until), "--interval", str(FOLLOWER_POLL_S), "--in-place", "--orchestrator", "none",
               "--json", "--storage-option", f"endpoint_url={endpoint}"] + (["--stream"] if stream else [])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.done_at: float | None = None
        self.out: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if self.done_at is None and line.strip():
                self.done_at = time.perf_counter()
            self.out.append(line)

    def wait(self, timeout: float = 600) -> dict:
        rc = self.proc.wait(timeout)
        self._reader.join(10)
        if rc:
            raise RuntimeError(f"dcr receive --follow failed ({rc}): {self.proc.stderr.read().strip()[-800:]}")
        return json.loads("".join(self.out))


def one_refit(svc: S3Service, old, new, tmp: str, stream: bool, chunk_bytes: int | None = None) -> dict:
    root = f"s3://{BUCKET}/stream-{uuid.uuid4().hex[:10]}"
    direct, via = {"endpoint_url": svc.direct}, {"endpoint_url": svc.proxy.url}
    popts = PublishOptions(cache_dir=os.path.join(tmp, "cache", uuid.uuid4().hex[:8]), use_cache=False,
                           **({} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}))
    pub = Publisher(root, direct, popts)
    pub.publish(old, 0, keyframe=True)
    state = os.path.join(tmp, f"state-{uuid.uuid4().hex[:8]}.safetensors")
    run_receive(root, "follower", state, 0, storage_options=direct)
    pub.storage_options = via
    open_root(root, via).exists("zarr.json")  # a trainer's client is open already
    follower = Follower(root, state, svc.proxy.url, stream, until=1)
    time.sleep(3.0)  # started, imported and polling: its start-up is not part of a refit
    if follower.proc.poll() is not None:
        follower.wait()
    t0 = time.perf_counter()
    pub.publish(new, 1)
    t1 = time.perf_counter()
    res = follower.wait()
    problem = mismatch(new, load_file(state))
    os.remove(state)
    svc.fs(svc.direct).rm(root.removeprefix("s3://"), recursive=True)  # moto keeps objects in memory
    return {"stream": stream, "upload_s": t1 - t0, "commit_s": follower.done_at - t0,
            "after_publish_s": follower.done_at - t1, "bytes_pulled": res["bytes_pulled"],
            "receive_timings": res.get("timings"), "prefetched": res.get("prefetched"),
            "exact": problem is None, "mismatch": problem}


def summarize(runs: list[dict]) -> dict:
    seq = [r for r in runs if not r["stream"]]
    st = [r for r in runs if r["stream"]]
    med = statistics.median
    seq_s, st_s = med(r["commit_s"] for r in seq), med(r["commit_s"] for r in st)
    upload = med(r["upload_s"] for r in runs)
    download = med(r["after_publish_s"] for r in seq)
    bound = max(upload, download)
    return {"sequential_s": seq_s, "streamed_s": st_s, "ratio": st_s / seq_s, "upload_s": upload,
            "download_s": download, "max_updown_s": bound, "over_bound": st_s / bound - 1.0,
            "bytes_pulled": st[0]["bytes_pulled"], "exact": all(r["exact"] for r in runs)}


def validation_records(results: dict, base: dict) -> list[dict]:
    """Each link rate's medians as ``dcr simulate --validate`` records: ``base`` (a scenario measured
    on this model) at that rate, the follower's discovery delay, every process on this machine's cores."""
    out = []
    for bw, s in results["links"].items():
        link = {"mb_per_s": float(bw) / MB}
        sc = {**base, "name": f"stream-bench-{float(bw) / MB:g}MBps",
              "links": {**base["links"], "uplink": {**base["links"]["uplink"], **link},
                        "receiver": {**base["links"]["receiver"], **link}},
              "io": {**base["io"], "discovery_s": FOLLOWER_POLL_S / 2, "shared_cores": os.cpu_count()},
              "run": {"modes": ["direct"], "streaming": [False, True]}}
        for stream, key in ((False, "sequential_s"), (True, "streamed_s")):
            out.append({"name": f"stream bench {results['params'] / 1e6:.0f}M {results['dtype']} @ {float(bw) / MB:g} MB/s, "
                                f"{'streamed' if stream else 'publish, then follower'}",
                        "scenario": sc, "mode": "direct", "streaming": stream, "measured_s": s[key]})
    return out


def markdown(results: dict) -> str:
    lines = [f"Model: {results['params'] / 1e6:.0f}M {results['dtype'].upper()} parameters, {results['rate'] * 100:g}% "
             f"changed (synthetic), {results['chunk_bytes'] / (1 << 20):g} MiB chunks; {results['repeats']} runs each, "
             "medians.", "",
             "| link MB/s | pulled MB | upload s | download s | sequential s | streamed s | streamed / sequential "
             "| streamed vs max(up, down) | bit-exact |", "|---|---|---|---|---|---|---|---|---|"]
    for bw, s in results["links"].items():
        lines.append(f"| {float(bw) / MB:g} | {s['bytes_pulled'] / MB:.1f} | {s['upload_s']:.2f} | {s['download_s']:.2f} "
                     f"| {s['sequential_s']:.2f} | {s['streamed_s']:.2f} | {s['ratio']:.2f} | {s['over_bound'] * 100:+.0f}% "
                     f"| {'yes' if s['exact'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(results["links"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(links))
    for i, (key, label) in enumerate((("sequential_s", "publish, then receive"), ("streamed_s", "streamed"),
                                      ("max_updown_s", "max(upload, download)"))):
        ax.bar([j + (i - 1) * 0.27 for j in x], [results["links"][b][key] for b in links], 0.27, label=label)
    ax.set_xticks(list(x), [f"{float(b) / MB:g} MB/s" for b in links])
    ax.set_ylabel("publish start to receiver commit, s")
    ax.set_title(f"{results['params'] / 1e6:.0f}M {results['dtype'].upper()}, {results['rate'] * 100:g}% changed, "
                 f"{results['chunk_bytes'] / (1 << 20):g} MiB chunks")
    ax.legend()
    path = os.path.join(out, "latency.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcr_bench.stream_bench", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/bench-stream")
    p.add_argument("--size", type=parse_size, default=100_000_000, help="parameters (default 100M)")
    p.add_argument("--rate", type=float, default=0.03, help="change rate (default 0.03)")
    p.add_argument("--bandwidth", default="10,50", help="link MB/s, comma-separated (default 10,50)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="bf16: ulp steps with special values (dcr bench's synthetic model); fp32: steps of ~1e-5")
    p.add_argument("--chunk-mib", type=float, default=None, help="raw MiB per chunk (default DCR's 4)")
    p.add_argument("--records-from", metavar="RECORDS",
                   help="also write validation records for dcr simulate (validation-records.json), with the "
                   "scenario of the first direct record in RECORDS (dcr simulate --measure-direct's, measured "
                   "on the same model) at each link rate")
    a = p.parse_args(argv)
    old, new = (bench_data.synthetic if a.dtype == "bf16" else fp32_pair)(a.size, a.rate, seed=0)
    chunk = None if a.chunk_mib is None else int(a.chunk_mib * (1 << 20))
    rates = [float(x) * MB for x in a.bandwidth.split(",")]
    results = {"params": a.size, "rate": a.rate, "dtype": a.dtype, "chunk_bytes": chunk or PublishOptions().chunk_bytes,
               "repeats": a.repeats, "machine": machine_info(), "links": {}, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp, S3Service(rates[0]) as svc:
        for bw in rates:
            svc.set_bandwidth(bw)
            runs = []
            for i in range(a.repeats):
                for stream in (False, True):
                    r = one_refit(svc, old, new, tmp, stream, chunk)
                    print(f"{bw / MB:g} MB/s run {i} {'streamed' if stream else 'sequential'}: {r['commit_s']:.2f} s "
                          f"(publish {r['upload_s']:.2f} s){'' if r['exact'] else ' NOT EXACT: ' + str(r['mismatch'])}",
                          flush=True)
                    runs.append(r)
            results["runs"][str(bw)] = runs
            results["links"][str(bw)] = summarize(runs)
    os.makedirs(a.out, exist_ok=True)
    if a.records_from:
        with open(a.records_from) as f:
            base = next(r["scenario"] for r in json.load(f) if r["mode"] == "direct")
        with open(os.path.join(a.out, "validation-records.json"), "w") as f:
            json.dump(validation_records(results, base), f, indent=1)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(markdown(results))
    plot(results, a.out)
    print(markdown(results))
    return 0 if all(s["exact"] for s in results["links"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
