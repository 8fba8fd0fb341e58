"""``dcr simulate --measure-direct``: real refits on this machine, as validation records.

Through the benchmark's S3 test server behind its bandwidth-capped proxy (``dcr_bench.e2e.S3Service``),
for each link rate: a DCR direct refit, sequential (``dcr_bench.e2e.dcr_in_process``: a ``Publisher``
publishing the in-memory FP32 model, then ``run_receive`` patching one receiver's state file in
place) and the full-checkpoint reference (one PUT of the safetensors file, one download). Every input
of the model is measured separately from the refit it predicts:

- CPU costs: ``dcr_bench.sim.calibrate`` on a 16M-element FP32 update (not the refit's model);
- bytes per changed element: the refit's stored bytes over its changed elements (what it sent);
- per-request latency and effective concurrency: small objects through the capped proxy, one at a
  time (latency) and on ``io_workers`` threads (how many requests really overlap on this machine);
  where they do not overlap at all (concurrency 1: the client's requests cost it CPU), its CPU work
  and its requests do not overlap either (``io.overlap_cpu_and_io = false``);
- fixed overheads (``publish_s``, ``receive_s``): a refit of a tiny model (1M parameters) through
  the uncapped proxy, less what the model predicts for it without them;
- ``store_mb_per_s``: the test server's own processing rate, from the full checkpoint's upload and
  download straight to it (no proxy, no cap): 2 x its bytes over that time.

The machine is shared and small (2 cores here), so each DCR refit is timed ``REPEATS`` times and the
median is the record's ``measured_s`` (every time is kept in its details).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from safetensors.torch import save_file

from dcr_bench.e2e import BUCKET, S3Service, dcr_in_process
from dcr_bench.sim.calibrate import calibrate, changed_elements, fp32_pair
from dcr_bench.sim.model import Model
from dcr_bench.sim.scenario import COSTS, parse
from dcr_bench.stream_bench import FOLLOWER_POLL_S, one_refit
from flows import PublishOptions
from storage.root import open_root

TINY_PARAMS = 1_000_000
REPEATS = 3
PROBE_REQUESTS = 24  # write + read pairs


def probe_requests(svc: S3Service, workers: int) -> tuple[float, float]:
    """(seconds per request one at a time, seconds per request with ``workers`` threads): 1 KiB PUTs
    and GETs through the proxy, with the client the refits use."""
    prefix = f"{BUCKET}/probe-{uuid.uuid4().hex[:8]}"
    root = open_root(f"s3://{prefix}", {"endpoint_url": svc.proxy.url})
    data = os.urandom(1024)

    def one(i: int) -> None:
        root.write(f"k{i}", data)
        root.read(f"k{i}")

    one(-1)  # warm: the client's connection and credentials
    t0 = time.perf_counter()
    for i in range(PROBE_REQUESTS):
        one(i)
    seq = (time.perf_counter() - t0) / (2 * PROBE_REQUESTS)
    with ThreadPoolExecutor(workers) as pool:
        t0 = time.perf_counter()
        list(pool.map(one, range(PROBE_REQUESTS, 3 * PROBE_REQUESTS)))
        conc = (time.perf_counter() - t0) / (4 * PROBE_REQUESTS)
    svc.fs(svc.direct).rm(prefix, recursive=True)
    return seq, conc


def full_transfer(svc: S3Service, new_file: str, tmp: str, endpoint: str) -> dict:
    """One PUT of the checkpoint file (no multipart, as ``dcr_bench.e2e``) and one download."""
    fs = svc.fs(endpoint)
    key = f"{BUCKET}/full-{uuid.uuid4().hex[:10]}/full.safetensors"
    back = os.path.join(tmp, "full-back.safetensors")
    size = os.path.getsize(new_file)
    before = svc.proxy.counts()
    t0 = time.perf_counter()
    fs.put_file(new_file, key, chunksize=max(50 << 20, size))
    t1 = time.perf_counter()
    fs.get_file(key, back)
    t2 = time.perf_counter()
    after = svc.proxy.counts()
    os.remove(back)
    svc.fs(svc.direct).rm(key)
    return {"upload_s": t1 - t0, "download_s": t2 - t1, "total_s": t2 - t0, "bytes": size,
            "bytes_up": after["bytes_up"] - before["bytes_up"], "bytes_down": after["bytes_down"] - before["bytes_down"]}


def refit(svc: S3Service, old, new, tmp: str) -> dict:
    prefix = f"{BUCKET}/sim-{uuid.uuid4().hex[:10]}"
    before = svc.proxy.counts()
    r = dcr_in_process(f"s3://{prefix}", old, new, tmp, {"endpoint_url": svc.direct},
                       {"endpoint_url": svc.proxy.url}, svc.proxy.counts)
    after = r.pop("counts")
    r["bytes_up"] = after["bytes_up"] - before["bytes_up"]
    r["bytes_down"] = after["bytes_down"] - before["bytes_down"]
    r["requests"] = after["requests"] - before["requests"]
    r["server_cpu_s"] = after["cpu_s"] - before["cpu_s"]
    svc.fs(svc.direct).rm(prefix, recursive=True)  # moto keeps objects in memory
    if not r["exact"]:
        raise RuntimeError(f"the measured refit was not bit-exact: {r['mismatch']}")
    return r


def median_refit(svc: S3Service, old, new, tmp: str, repeats: int = REPEATS) -> dict:
    """The refit of median total time among ``repeats``, with every total under ``all_total_s``."""
    runs = sorted((refit(svc, old, new, tmp) for _ in range(repeats)), key=lambda r: r["total_s"])
    mid = runs[len(runs) // 2]
    mid["all_total_s"] = [r["total_s"] for r in runs]
    return mid


def scenario_dict(*, params: int, changed: int, stored: int, tensors: int, file_bytes: int, bandwidth: float | None,
                  latency_s: float, workers: int, store_mb_per_s: float, costs: dict, overhead: dict) -> dict:
    mbps = math.inf if bandwidth is None else bandwidth / 1e6
    link = {"mb_per_s": mbps, "latency_ms": 1e3 * latency_s, "scope": "global"}
    opts = PublishOptions()  # what the measured publish stored: its chunks and their layout
    layout = {"layout": "packed", "pack_bytes": opts.pack_bytes} if opts.pack_bytes else {"layout": "per-object"}
    return {
        "name": f"measured-direct-{'uncapped' if bandwidth is None else f'{mbps:g}MBps'}",
        "description": "one proxy in front of the S3 test server: uplink = its upload cap, receiver = its download cap",
        "model": {"parameters": params, "bytes_per_param": 4, "change_rate": changed / params,
                  "bytes_per_change": stored / changed, "chunk_bytes": opts.chunk_bytes,
                  "tensors": tensors, "full_part_bytes": max(50 << 20, file_bytes), **layout},
        "topology": {"regions": 1, "receivers_per_region": 1},
        "links": {"uplink": link, "inter_region": {"mb_per_s": math.inf, "latency_ms": 0.0}, "receiver": link},
        "cpu": {k: costs[k] for k in COSTS},
        "io": {"workers": workers, "discovery_s": 0.0, "store_mb_per_s": store_mb_per_s,
               "overlap_cpu_and_io": workers > 1},
        "overhead": {**overhead, "install_copies": 0.0},  # the measured receive patches its state file in place
        "run": {"modes": ["full", "direct"], "streaming": [False]},
    }


def follower_records(svc: S3Service, old, new, tmp: str, sc: dict, n: int, changed: int, bw: float, say) -> list[dict]:
    """The same refit to a ``dcr receive --follow`` process (``dcr_bench.stream_bench``), publish then
    receive and streamed: the time from the start of the publish to the follower's commit. The
    follower polls every 0.05 s (``discovery_s`` 0.025, half of it); it is its own process on the
    same cores, so its prefetching competes with the publisher's encoding for CPU."""
    out = []
    for stream in (False, True):
        runs = sorted((one_refit(svc, old, new, tmp, stream) for _ in range(REPEATS)), key=lambda r: r["commit_s"])
        mid = runs[len(runs) // 2]
        if not all(r["exact"] for r in runs):
            raise RuntimeError(f"a follower refit was not bit-exact: {[r['mismatch'] for r in runs if not r['exact']]}")
        fsc = {**sc, "name": sc["name"] + ("-streamed" if stream else "-follower"),
               "io": {**sc["io"], "discovery_s": FOLLOWER_POLL_S / 2, "shared_cores": os.cpu_count()},
               "run": {"modes": ["direct"], "streaming": [False, True]}}
        kind = "streamed" if stream else "publish, then follower"
        out.append({"name": f"direct {n / 1e6:.0f}M fp32 {100 * changed / n:.1f}% @ {bw / 1e6:g} MB/s, {kind}",
                    "scenario": _json_safe(fsc), "mode": "direct", "streaming": stream, "measured_s": mid["commit_s"],
                    "details": _json_safe({"all_total_s": [r["commit_s"] for r in runs], "publish_s": mid["upload_s"],
                                           "after_publish_s": mid["after_publish_s"],
                                           "receive_timings": mid["receive_timings"],
                                           "prefetched": mid["prefetched"]})})
        times = ", ".join(f"{r['commit_s']:.2f}" for r in runs)
        say(f"  follower, {kind}: median {mid['commit_s']:.2f} s of {times}")
    return out


def _json_safe(x):
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return "inf" if isinstance(x, float) and math.isinf(x) else x


def fixed_overheads(svc: S3Service, tmp: str, costs: dict, latency_s: float, workers: int, store: float) -> dict:
    """``publish_s`` and ``receive_s``: a tiny refit through the uncapped proxy, less the model's other terms."""
    old, new = fp32_pair(TINY_PARAMS, 0.03, seed=7)
    svc.set_bandwidth(None)
    r = median_refit(svc, old, new, tmp)
    sc = parse(scenario_dict(params=sum(t.numel() for t in new.values()), changed=changed_elements(old, new),
                             stored=r["bytes_stored"], tensors=len(new), file_bytes=1 << 20, bandwidth=None,
                             latency_s=latency_s, workers=workers, store_mb_per_s=store, costs=costs, overhead={}),
               "tiny refit")
    t = Model(sc).run("direct", False)
    commit = next(s.end for s in t.segments if s.actor == "publisher" and s.phase == "commit")
    return {"publish_s": max(0.0, r["publish_s"] - commit),
            "receive_s": max(0.0, r["receive_s"] - (t.total_s - commit)),
            "tiny_refit": {"publish_s": r["publish_s"], "receive_s": r["receive_s"], "requests": r["requests"],
                           "all_total_s": r["all_total_s"]}}


def measure_direct(out: str, params: int = 100_000_000, rate: float = 0.03, bandwidths=(10e6, 50e6),
                   seed: int = 0, say=print) -> list[dict]:
    """Run the measurements; returns the validation records (also written to ``out/records.json``)."""
    say(f"calibrating CPU costs (FP32, {PublishOptions().delta_codec.name})")
    cal = calibrate(dtypes=("float32",), say=lambda m: say("  " + m))
    costs = cal["costs"][PublishOptions().delta_codec.name]["float32"]
    say(f"generating a {params / 1e6:g}M-parameter FP32 model and its {100 * rate:g}% update")
    old, new = fp32_pair(params, rate, seed)
    n = sum(t.numel() for t in new.values())
    changed = changed_elements(old, new)
    workers = PublishOptions().io_workers
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="dcr-sim-") as tmp, S3Service(bandwidths[0]) as svc:
        new_file = os.path.join(tmp, "new.safetensors")
        save_file(new, new_file)
        size = os.path.getsize(new_file)
        t0 = time.perf_counter()
        unc = full_transfer(svc, new_file, tmp, svc.direct)
        store = 2 * size / unc["total_s"] / 1e6
        say(f"full checkpoint straight to the test server (no cap): {unc['total_s']:.2f} s -> store {store:.0f} MB/s")
        svc.set_bandwidth(bandwidths[0])
        seq, conc = probe_requests(svc, workers)
        eff_workers = max(1, min(workers, round(seq / conc)))
        say(f"requests: {1e3 * seq:.1f} ms one at a time, {1e3 * conc:.1f} ms each with {workers} threads "
            f"-> {eff_workers} effectively in flight")
        overhead = fixed_overheads(svc, tmp, costs, seq, eff_workers, store)
        say(f"fixed overheads from a {TINY_PARAMS / 1e6:g}M refit: publish {overhead['publish_s']:.3f} s, "
            f"receive {overhead['receive_s']:.3f} s")
        for bw in bandwidths:
            svc.set_bandwidth(bw)
            say(f"{bw / 1e6:g} MB/s: DCR direct refit (sequential)")
            r = median_refit(svc, old, new, tmp)
            sc = scenario_dict(params=n, changed=changed, stored=r["bytes_stored"], tensors=len(new), file_bytes=size,
                               bandwidth=bw, latency_s=seq, workers=eff_workers, store_mb_per_s=store, costs=costs,
                               overhead={k: v for k, v in overhead.items() if k != "tiny_refit"})
            details = {k: r[k] for k in ("all_total_s", "publish_s", "receive_s", "bytes_stored", "bytes_pulled", "requests",
                                         "server_cpu_s", "publish_timings", "receive_timings")}
            details.update(calibration=cal, probe={"sequential_s": seq, "concurrent_s": conc, "threads": workers},
                           tiny_refit=overhead["tiny_refit"], full_unthrottled=unc)
            records.append({"name": f"direct {n / 1e6:.0f}M fp32 {100 * changed / n:.1f}% @ {bw / 1e6:g} MB/s",
                            "scenario": _json_safe(sc), "mode": "direct", "streaming": False, "measured_s": r["total_s"],
                            "bytes_per_link": {"uplink": r["bytes_up"], "receiver": r["bytes_down"]},
                            "details": _json_safe(details)})
            say(f"  median {r['total_s']:.2f} s of {', '.join(f'{x:.2f}' for x in r['all_total_s'])} (publish {r['publish_s']:.2f} + receive {r['receive_s']:.2f}), "
                f"{r['bytes_stored'] / changed:.3f} B per changed element, {r['requests']} requests")
            say(f"{bw / 1e6:g} MB/s: full checkpoint ({size / 1e6:.0f} MB up, then down)")
            f = full_transfer(svc, new_file, tmp, svc.proxy.url)
            records.append({"name": f"full {n / 1e6:.0f}M fp32 @ {bw / 1e6:g} MB/s", "scenario": _json_safe(sc),
                            "mode": "full", "streaming": False, "measured_s": f["total_s"],
                            "bytes_per_link": {"uplink": f["bytes_up"], "receiver": f["bytes_down"]},
                            "details": {"upload_s": f["upload_s"], "download_s": f["download_s"]}})
            say(f"  {f['total_s']:.2f} s (upload {f['upload_s']:.2f} + download {f['download_s']:.2f})")
            records += follower_records(svc, old, new, tmp, sc, n, changed, bw, say)
        say(f"measured in {time.perf_counter() - t0:.0f} s")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "records.json"), "w") as fh:
        json.dump(records, fh, indent=2)
        fh.write("\n")
    return records
