"""How the commands' cost grows with the tensor count: the same bytes in 8 to 70,000 tensors.

For each count, a BF16 checkpoint of the same bytes (``dcr_bench.moe``: up to 16 tensors plain
matrices, more a mixture-of-experts model of small expert matrices, attention matrices, norms and
routers) and a step with ``rate`` of its elements one unit away. On each backend (a local ROOT, the
moto S3 server of ``dcr bench``) the code behind the commands runs, each phase in a fresh process
of its own (so its peak resident memory, ``ru_maxrss``, is its own and its storage counters start
at zero, as a command's do):

- *setup* (untimed): ``dcr publish --keyframe`` of step 0, then ``dcr receive --state`` to step 0;
- *publish*: ``dcr publish`` of step 1, a delta against the warm baseline cache;
- *receive*: ``dcr receive --state`` from step 0 to step 1 (the default rewrite of the state file).

Recorded: seconds, requests by kind (``storage.stats``: every PUT, GET, LIST, HEAD and DELETE the
process made under the ROOT), the objects under the delta step's directory once published, the
stored bytes, the bytes the receive pulled, peak memory. The goal the rows are checked against:
a delta step is at most ``16 + stored bytes / 8 MiB`` objects, and one receive at most
``16 + pulled bytes / 8 MiB`` GETs (stated for S3; the local rows are counted the same way).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import shutil
import time
import uuid
from concurrent.futures import ProcessPoolExecutor

from dcr_bench import moe
from dcr_bench.scaling import same_tensors
from flows import PublishOptions, ReceiveOptions, run_publish, run_receive
from storage import stats
from storage.layout import step_dir
from storage.root import check_root_url, open_root

DEFAULT_COUNTS = (8, 1000)
QUICK_COUNTS = (8, 200)
DEFAULT_BYTES, QUICK_BYTES = 75_000_000, 10_000_000
BOUND_BASE, BOUND_BYTES = 16, 8 << 20  # the goal: 16 requests plus one per 8 MiB moved
RECEIVER = "bench"
KINDS = {"PUT": "puts", "GET": "gets", "LIST": "lists", "HEAD": "heads", "DELETE": "deletes"}


def _in_child(fn, *args) -> dict:
    """``fn(*args)`` in a new process forked from the forkserver (an interpreter that imported only
    the main module: the ``dcr`` command's, pytest's): a child forked or spawned from this process
    would start with its ``ru_maxrss`` at this process's peak (Linux keeps it across fork and exec),
    and ``dcr bench`` has imported torch."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver")) as pool:
        return pool.submit(fn, *args).result()


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _requests(used: stats.IOStats) -> dict:
    kinds = {k: getattr(used, field) for k, field in KINDS.items()}
    return {**kinds, "total": sum(kinds.values()), "retries": used.retries}


def _phase(phase: str, root: str, so: dict, checkpoint: str, state: str, cache_dir: str, env: dict,
           bundle_below: int | None = None) -> dict:
    """One phase (setup, publish or receive) in this process, with the caller's environment ``env``
    (the forkserver's is the one it started with); what it cost."""
    os.environ.clear()
    os.environ.update(env)
    start_rss = _peak_rss()
    url = check_root_url(root)
    popts = PublishOptions(cache_dir=cache_dir, **({} if bundle_below is None else {"bundle_below": bundle_below}))
    before = stats.io_stats(url)
    t0 = time.perf_counter()
    out: dict = {}
    if phase == "setup":
        out["bytes_stored"] = run_publish(root, checkpoint, 0, True, so, popts).summary["bytes_stored"]
        run_receive(root, RECEIVER, state, 0, so, ReceiveOptions())
    elif phase == "publish":
        out["bytes_stored"] = run_publish(root, checkpoint, 1, False, so, popts).summary["bytes_stored"]
    else:
        out["bytes_pulled"] = run_receive(root, RECEIVER, state, 1, so, ReceiveOptions()).bytes_pulled
    out["s"] = time.perf_counter() - t0
    used = stats.io_stats(url).minus(before)
    out.update(requests=_requests(used), bytes_written=used.bytes_written, bytes_read=used.bytes_read,
               start_rss_bytes=start_rss, peak_rss_bytes=_peak_rss())
    if phase == "publish":  # after the counters: what the step holds, and in which layout
        r = open_root(root, so)
        objects = r.objects(step_dir(1))
        out["objects_written"] = len(objects)
        out["objects_bytes"] = sum(o.size for o in objects)
        manifest = next(o.key for o in objects if o.key.endswith("/manifest.json"))
        out["schema_version"] = json.loads(r.read(manifest))["schema_version"]
    return out


def _one(work: str, n: int, backend: str, s3, old: str, new: str, bundle_below: int | None = None) -> dict:
    run = uuid.uuid4().hex[:8]
    d = os.path.join(work, f"run-{run}")  # the state file, what a receiver keeps beside it, the cache
    os.makedirs(d)
    if backend == "local":
        root, so = os.path.join(d, "root"), {}
    else:
        root, so = f"s3://{s3.bucket}/tensor-counts-{run}", {"endpoint_url": s3.direct}
    state = os.path.join(d, "state.safetensors")
    try:
        phases = {p: _in_child(_phase, p, root, so, old if p == "setup" else new, state, os.path.join(d, "cache"),
                               dict(os.environ), bundle_below) for p in ("setup", "publish", "receive")}
        exact = same_tensors(state, new)
    finally:
        if backend == "s3":
            s3.fs(s3.direct).rm(root[len("s3://"):], recursive=True)  # moto keeps objects in memory
        shutil.rmtree(d, ignore_errors=True)
    pub, rec = phases["publish"], phases["receive"]
    refit = {k: pub["requests"][k] + rec["requests"][k] for k in (*KINDS, "total", "retries")}
    objects_bound = BOUND_BASE + pub["bytes_stored"] / BOUND_BYTES
    gets_bound = BOUND_BASE + rec["bytes_pulled"] / BOUND_BYTES
    return {
        "backend": backend, "tensors": n, "schema_version": pub["schema_version"],
        "keyframe_s": phases["setup"]["s"], "publish_s": pub["s"], "receive_s": rec["s"],
        "requests": {"publish": pub["requests"], "receive": rec["requests"], "refit": refit},
        "objects_written": pub["objects_written"], "bytes_stored": pub["bytes_stored"],
        "objects_bytes": pub["objects_bytes"], "bytes_pulled": rec["bytes_pulled"],
        "peak_rss_bytes": {p: phases[p]["peak_rss_bytes"] for p in phases},
        "start_rss_bytes": {p: phases[p]["start_rss_bytes"] for p in phases},
        "bound": {"objects": objects_bound, "objects_ok": pub["objects_written"] <= objects_bound,
                  "receive_gets": gets_bound, "receive_gets_ok": rec["requests"]["GET"] <= gets_bound},
        "exact": exact,
    }


def measure(work: str, counts=DEFAULT_COUNTS, backends=("local",), s3=None, total_bytes: int = DEFAULT_BYTES,
            rate: float = 0.03, seed: int = 0, log=None, bundle_below: int | None = None) -> dict:
    """Every count on every backend (S3 only with ``s3``, a running ``e2e.S3Service``). ``bundle_below``:
    ``PublishOptions.bundle_below`` of the keyframes (None: the default; 0: no bundles, every tensor
    stored alone, as tensors too large to bundle are)."""
    work = os.path.join(work, "tensor-counts")
    os.makedirs(work, exist_ok=True)
    backends = [b for b in backends if b == "local" or s3 is not None]
    rows, checkpoints = [], []
    for n in counts:
        old, new = os.path.join(work, f"{n}-old.safetensors"), os.path.join(work, f"{n}-new.safetensors")
        info = moe.write_pair(old, new, total_bytes, n, rate, seed)
        checkpoints.append(info)
        for backend in backends:
            t0 = time.perf_counter()
            row = {**_one(work, n, backend, s3, old, new, bundle_below), "bytes": info["bytes"], "changed": info["changed"]}
            rows.append(row)
            if log:
                log(line(row) + f" ({time.perf_counter() - t0:.1f}s)")
        os.remove(old)
        os.remove(new)
    shutil.rmtree(work, ignore_errors=True)
    for row in rows:  # against the fewest tensors (8 by default) on the same backend
        base = min((r for r in rows if r["backend"] == row["backend"]), key=lambda r: r["tensors"])
        row["publish_ratio"] = row["publish_s"] / base["publish_s"]
        row["receive_ratio"] = row["receive_s"] / base["receive_s"]
    return {"total_bytes": total_bytes, "rate": rate, "seed": seed, "counts": list(counts), "backends": backends,
            "bundle_below": bundle_below, "per_tensor_s": per_tensor(rows),
            "ratio_base_tensors": min(counts),
            "bound": {"base": BOUND_BASE, "bytes_per_request": BOUND_BYTES}, "checkpoints": checkpoints, "rows": rows}


def per_tensor(rows: list[dict]) -> dict:
    """Seconds per tensor beyond the bytes, on each backend: (most tensors - fewest) / their difference
    in count, for publish and receive (what ``dcr simulate``'s calibration takes as per-tensor costs)."""
    out = {}
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = [r for r in rows if r["backend"] == backend]
        lo, hi = min(mine, key=lambda r: r["tensors"]), max(mine, key=lambda r: r["tensors"])
        if hi["tensors"] > lo["tensors"]:
            out[backend] = {k: (hi[f"{k}_s"] - lo[f"{k}_s"]) / (hi["tensors"] - lo["tensors"]) for k in ("publish", "receive")}
    return out


def line(r: dict) -> str:
    """The progress line of one row."""
    q = r["requests"]
    return (f"  {r['tensors']:,} tensors on {r['backend']}: publish {r['publish_s']:.2f}s, receive {r['receive_s']:.2f}s; "
            f"{r['objects_written']:,} objects (bound {r['bound']['objects']:.1f}), receive GETs {q['receive']['GET']:,} "
            f"(bound {r['bound']['receive_gets']:.1f}), refit requests {q['refit']['total']:,}; "
            f"exact {'yes' if r['exact'] else 'NO'}")


def markdown(res: dict) -> list[str]:
    base = res["ratio_base_tensors"]
    lines = [
        "\n## Cost against tensor count (the code behind the commands, each phase its own process)\n",
        (f"{res['total_bytes'] / 1e6:g} MB of BF16 in each count of tensors (up to 16: plain matrices; more: a "
         f"mixture-of-experts layout), {100 * res['rate']:g}% of elements one unit away from step 0 (keyframe) to "
         "step 1 (delta). `publish s`: `dcr publish` of the delta (warm baseline cache); `receive s`: `dcr receive "
         f"--state` from step 0 to step 1; `x{base}`: against {base} tensors on the same backend. Requests: what "
         "each process made under the ROOT, publish + receive (PUT/GET/LIST/HEAD/DELETE). `objects`: under the "
         f"delta step once published; bound {res['bound']['base']} + stored bytes / 8 MiB. `receive GETs`: bound "
         f"{res['bound']['base']} + pulled bytes / 8 MiB. Peak RSS of the publish and receive processes.\n"),
        (f"| backend | tensors | schema | publish s | x{base} | receive s | x{base} | PUT | GET | LIST | HEAD | DELETE | objects "
         "(bound) | receive GETs (bound) | stored bytes | pulled bytes | peak RSS MB (publish / receive) | exact |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---|:--:|",
    ]
    if res.get("bundle_below") is not None:
        lines.insert(2, f"Published with `--bundle-below {res['bundle_below']}`"
                     + (" (no bundles: every tensor stored alone, as tensors too large to bundle are).\n"
                        if res["bundle_below"] == 0 else ".\n"))
    for r in res["rows"]:
        q, b, m = r["requests"], r["bound"], r["peak_rss_bytes"]
        lines.append(
            f"| {r['backend']} | {r['tensors']:,} | {r['schema_version']} | {r['publish_s']:.2f} | "
            f"{r['publish_ratio']:.1f} | {r['receive_s']:.2f} | {r['receive_ratio']:.1f} | "
            + " | ".join(f"{q['refit'][k]:,}" for k in KINDS)
            + f" | {r['objects_written']:,} ({b['objects']:.1f}{'' if b['objects_ok'] else ', over'}) | "
            f"{q['receive']['GET']:,} ({b['receive_gets']:.1f}{'' if b['receive_gets_ok'] else ', over'}) | "
            f"{r['bytes_stored']:,} | {r['bytes_pulled']:,} | {m['publish'] / 1e6:.0f} / {m['receive'] / 1e6:.0f} | "
            f"{'yes' if r['exact'] else 'NO'} |")
    if res.get("per_tensor_s"):
        lines.append("\nPer tensor beyond the bytes ((most tensors - fewest) / their difference in count): "
                     + "; ".join(f"{b}: publish {1e3 * v['publish']:.3f} ms, receive {1e3 * v['receive']:.3f} ms"
                                 for b, v in res["per_tensor_s"].items()) + ".")
    return lines


def plot(res: dict, out: str, plt) -> str:
    """Seconds, requests against their bounds and peak memory, against the tensor count; the PNG's path."""
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), squeeze=False)
    t, q, m = axes[0]
    for backend in res["backends"]:
        rows = sorted((r for r in res["rows"] if r["backend"] == backend), key=lambda r: r["tensors"])
        n = [r["tensors"] for r in rows]
        t.plot(n, [r["publish_s"] for r in rows], "o-", label=f"publish ({backend})")
        t.plot(n, [r["receive_s"] for r in rows], "s--", label=f"receive ({backend})")
        q.plot(n, [r["objects_written"] for r in rows], "o-", label=f"objects of the delta step ({backend})")
        q.plot(n, [r["requests"]["receive"]["GET"] for r in rows], "s--", label=f"receive GETs ({backend})")
        m.plot(n, [r["peak_rss_bytes"]["publish"] / 1e6 for r in rows], "o-", label=f"publish ({backend})")
        m.plot(n, [r["peak_rss_bytes"]["receive"] / 1e6 for r in rows], "s--", label=f"receive ({backend})")
    rows = sorted(res["rows"], key=lambda r: r["tensors"])
    q.plot([r["tensors"] for r in rows], [r["bound"]["objects"] for r in rows], "k:", label="bound: 16 + bytes / 8 MiB")
    for ax, ylabel, title in ((t, "seconds", "time"), (q, "objects / requests", "requests against the bound"),
                              (m, "peak RSS (MB)", "peak memory")):
        ax.set_xscale("log")
        ax.set_xlabel("tensors")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}: {res['total_bytes'] / 1e6:g} MB, {100 * res['rate']:g}%")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    q.set_yscale("log")
    fig.tight_layout()
    path = os.path.join(out, "tensor_counts.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
