"""A relay tree against direct receivers: bytes per link and seconds to the last receiver's commit.

``python -m dcr_bench.relay_tree [--out DIR]`` (``make bench-tree``). Three S3 servers (moto, each
its own process and store) on 127.0.0.1: the origin and two regions. Each region reaches the origin
through its own inter-region link, a ``netproxy.Proxy`` capped at ``--link-mbytes`` MB/s each way;
each region server sits behind an uncapped, counting proxy (the in-region network). An fp32 model
(``--params``) is published at the origin as a keyframe, then as deltas with ``--change`` of its
elements changed. Each step is received twice, each time by ``--receivers`` state-file receivers
per region, each in its own process (as on its own machine):

- tree: region A's mirror and region B's mirror pull the step from the origin over their link
  (``run_mirror``), a second mirror in region A (A2) pulls it from A; half of region A's receivers
  read A, the other half A2, region B's read B; each starts when its mirror has committed;
- direct: every receiver reads the origin through its region's link.

Written to ``--out``: ``results.json`` (every step and mode: bytes per link, seconds from the
commit to the last receiver's commit), ``results.md`` (the table) and ``validation-records.json``
(the same runs as records a network simulator can be checked against; fields in ``_record``).

``python -m dcr_bench.relay_tree --worker`` is one receiver or mirror process: it reads one JSON
request per line on stdin and answers one JSON line on stdout (``Worker`` drives it; the tests of
the relay tree use it too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dcr_bench.netproxy import Proxy

MB = 1_000_000


# -- servers and driven processes (also used by tests/backends/test_relay_tree.py) ----------------


@dataclass
class Server:
    """An S3 server of its own: ``url``, its bucket, and the storage options that reach it."""

    name: str
    url: str
    bucket: str
    options: dict


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_servers(names, log_dir, timeout: float = 60.0):
    """One moto S3 server process per name on 127.0.0.1 (separate stores, separate credentials),
    each with a bucket ``region-<name>``; stopped when the block ends."""
    import boto3

    procs = []
    try:
        out = {}
        for name in names:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log = open(os.path.join(log_dir, f"moto-{name}.log"), "wb")
            proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                    stdout=log, stderr=subprocess.STDOUT)
            procs.append((proc, log))
            deadline = time.monotonic() + timeout
            while True:
                try:
                    urllib.request.urlopen(url + "/", timeout=2)
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"moto server {name} did not start; see {log.name}") from None
                    time.sleep(0.2)
            key, secret = f"region-{name}", f"{name}-secret"
            boto3.client("s3", endpoint_url=url, aws_access_key_id=key, aws_secret_access_key=secret,
                         region_name="us-east-1").create_bucket(Bucket=f"region-{name}")
            out[name] = Server(name, url, f"region-{name}", {"endpoint_url": url, "key": key, "secret": secret})
        yield out
    finally:
        for proc, log in procs:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


class Worker:
    """A receiver or mirror in its own process, driven over a pipe (``--worker``). ``send`` a
    request (``op``: ``receive`` or ``mirror``, with the arguments of ``run_receive`` /
    ``run_mirror``), then ``reply`` waits for its answer: ``{"ok", "t" (time.time() at the end),
    "result" | "error"}``. The process keeps its client and caches between requests, as a
    long-running receiver or ``dcr mirror --follow`` does."""

    def __init__(self, name: str, env: dict | None = None):
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-m", "dcr_bench.relay_tree", "--worker"], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, "DCR_ORCHESTRATOR": "none", **(env or {})})

    def send(self, **request) -> None:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} exited ({self.proc.wait()})")
        return json.loads(line)

    def call(self, **request) -> dict:
        """``send`` then ``reply``; an error answer raises, naming the worker."""
        self.send(**request)
        r = self.reply()
        if not r["ok"]:
            raise RuntimeError(f"{self.name}: {r['error']}")
        return r

    def close(self) -> None:
        close_all([self])


def close_all(workers: list[Worker], timeout: float = 30.0) -> None:
    """End every worker (its input closed: it exits after its current request), all at once."""
    for w in workers:
        if w.proc.poll() is None:
            w.proc.stdin.close()
    deadline = time.monotonic() + timeout
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


def run_all(calls: list[tuple[Worker, dict]]) -> list[dict]:
    """Each worker's request, all at once; the answers in order (an error answer raises)."""
    for w, req in calls:
        w.send(**req)
    answers = [(w, w.reply()) for w, _ in calls]
    bad = [f"{w.name}: {r['error']}" for w, r in answers if not r["ok"]]
    if bad:
        raise RuntimeError("; ".join(bad))
    return [r for _, r in answers]


def worker_main() -> int:
    from dataclasses import asdict as as_plain

    from flows.maintenance.mirror import run_mirror
    from flows.options import ReceiveOptions
    from flows.receive.pipeline import run_receive

    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "ping":
                r = {}
            elif req["op"] == "receive":
                options = ReceiveOptions(**req["options"]) if req.get("options") else None
                r = run_receive(req["root"], req["receiver"], req["state"], req.get("step"), req.get("storage_options"),
                                options)
            elif req["op"] == "mirror":
                r = run_mirror(req["src"], req["dst"], req.get("step"), req.get("src_options"), req.get("dst_options"),
                               as_id=req.get("as_id"), io_workers=req.get("io_workers", 8))
            else:
                raise ValueError(f"unknown op {req['op']!r}")
            out = {"ok": True, "t": time.time(), "result": r if isinstance(r, dict) else as_plain(r)}
        except Exception as e:  # noqa: BLE001 - answered to the driver, which decides
            first = str(e).splitlines()[0] if str(e) else ""
            out = {"ok": False, "t": time.time(), "error": f"{type(e).__name__}: {first}"}
        print(json.dumps(out, default=str), flush=True)
    return 0


# -- the benchmark ---------------------------------------------------------------------------------


# torch and numpy are imported where the benchmark uses them: a --worker process (a receiver or a
# mirror) never needs them, and 19 of them start at once.


def model(n_params: int, seed: int = 0) -> dict:
    """An fp32 model of about ``n_params`` elements: a few Llama-like matrices whose sizes are no
    multiple of a chunk, and a small bias."""
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = max(64, int((n_params / 12) ** 0.5) // 64 * 64)
    out, left, i = {}, n_params, 0
    while left > hidden * 4:
        rows = min(3 * hidden + 7, left // hidden)
        out[f"layers.{i}.weight"] = torch.randn(rows, hidden, generator=g) * 0.02
        left -= rows * hidden
        i += 1
    out["final.bias"] = torch.randn(max(1, left), generator=g)
    return out


def evolve(prev: dict, change: float, seed: int) -> tuple[dict, int]:
    """The next step: ``change`` of each tensor's elements moved by a small update (an optimizer
    step on a sparse subset); returns it and the number of elements whose bits changed."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    out, changed = {}, 0
    for name, t in prev.items():
        a = t.numpy().copy().reshape(-1)
        idx = rng.choice(a.size, size=max(1, round(change * a.size)), replace=False)
        a[idx] += (rng.standard_normal(idx.size).astype(np.float32) * 1e-3)
        changed += int(np.count_nonzero(a.view(np.uint32) != t.numpy().reshape(-1).view(np.uint32)))
        out[name] = torch.from_numpy(a.reshape(t.shape))
    return out, changed


def _stored(root_url: str, options: dict, step: int) -> dict:
    from storage import layout
    from storage.catalog import Catalog
    from storage.root import Root

    root = Root(root_url, options)
    marker = Catalog(root).require_marker(step)
    objs = root.objects(layout.attempt_dir(step, marker.attempt))
    return {"objects": len(objs), "attempt_bytes": sum(o.size for o in objs),
            "chunk_bytes": sum(o.size for o in objs if "/c/" in o.key),
            "marker_bytes": len(root.read(layout.commit_key(step)))}


def _delta(after: dict, before: dict) -> dict:
    return {link: {k: after[link][k] - before[link][k] for k in after[link]} for link in after}


def run(args) -> dict:
    from flows import run_publish
    from flows.options import PublishOptions

    regions = ("a", "b")
    per = args.receivers
    rate = args.link_mbytes * MB
    tag = uuid.uuid4().hex[:8]
    tmp = tempfile.mkdtemp(prefix="dcr-bench-tree-")
    steps_out = []
    with contextlib.ExitStack() as stack:
        servers = stack.enter_context(s3_servers(("origin", *regions), tmp))
        origin = f"s3://{servers['origin'].bucket}/run-{tag}"
        oopts = servers["origin"].options
        wan = {r: stack.enter_context(Proxy(servers["origin"].url, rate)) for r in regions}
        lan = {r: stack.enter_context(Proxy(servers[r].url, None)) for r in regions}
        links = {f"origin->{r}": wan[r] for r in regions} | {f"{r}-region": lan[r] for r in regions}

        def via_wan(r: str) -> dict:
            return {**oopts, "endpoint_url": wan[r].url}

        def lan_opts(r: str) -> dict:
            return {**servers[r].options, "endpoint_url": lan[r].url}

        mirror_root = {"a": f"s3://region-a/mirror-{tag}", "a2": f"s3://region-a/mirror-a2-{tag}",
                       "b": f"s3://region-b/mirror-{tag}"}
        workers: list[Worker] = []

        def worker(name: str) -> Worker:
            w = Worker(name)
            workers.append(w)
            return w

        stack.callback(close_all, workers)
        mirrors = {m: worker(f"mirror-{m}") for m in mirror_root}
        tree_rx = {f"{r}{i}": worker(f"tree-{r}{i}") for r in regions for i in range(per)}
        direct_rx = {f"{r}{i}": worker(f"direct-{r}{i}") for r in regions for i in range(per)}
        run_all([(w, {"op": "ping"}) for w in workers])  # every process started and its imports done
        ck = model(args.params)
        n_params = sum(t.numel() for t in ck.values())
        popts = PublishOptions(cache_dir=os.path.join(tmp, "pub"), **({"chunk_bytes": args.chunk_bytes} if args.chunk_bytes else {}))
        for s in range(args.steps):
            changed = n_params
            if s:
                ck, changed = evolve(ck, args.change, s)
            t = time.time()
            pub = run_publish(origin, ck, s, storage_options=oopts, options=popts)
            publish_s = time.time() - t
            stored = _stored(origin, oopts, s)
            print(f"step {s}: published in {publish_s:.1f} s, {stored['attempt_bytes']} bytes stored "
                  f"({changed} elements changed)", flush=True)

            # tree: each region's chain starts at the commit; receivers start when their mirror commits
            def chain(r: str, t0: float) -> list[float]:
                ends = []
                m = mirrors[r].call(op="mirror", src=origin, dst=mirror_root[r], src_options=via_wan(r),
                                    dst_options=lan_opts(r), as_id=f"mirror-{r}")
                ends.append(m["t"])
                print(f"    mirror {r}: {m['t'] - t0:.1f} s", flush=True)
                rx = [(tree_rx[f"{r}{i}"], {"op": "receive", "root": mirror_root[r], "receiver": f"rx-{r}{i}",
                                            "state": os.path.join(tmp, f"tree-{r}{i}.safetensors"),
                                            "storage_options": lan_opts(r)}) for i in range(per)]
                if r == "a":  # half of region A's receivers read A2, a mirror of mirror A
                    near, far = rx[: per // 2], rx[per // 2:]
                    for w, req in near:
                        w.send(**req)
                    m2 = mirrors["a2"].call(op="mirror", src=mirror_root["a"], dst=mirror_root["a2"],
                                            src_options=lan_opts("a"), dst_options=lan_opts("a"), as_id="mirror-a2")
                    ends.append(m2["t"])
                    print(f"    mirror a2: {m2['t'] - t0:.1f} s", flush=True)
                    for _, req in far:
                        req.update(root=mirror_root["a2"])
                    ends += [r_["t"] for r_ in run_all(far)]
                    for w, _ in near:
                        a = w.reply()
                        if not a["ok"]:
                            raise RuntimeError(f"{w.name}: {a['error']}")
                        ends.append(a["t"])
                else:
                    ends += [r_["t"] for r_ in run_all(rx)]
                return ends

            before = {k: p.counts() for k, p in links.items()}
            t0 = time.time()
            with ThreadPoolExecutor(len(regions)) as pool:
                ends = [e for f in [pool.submit(chain, r, t0) for r in regions] for e in f.result()]
            tree = {"seconds": max(ends) - t0, "bytes_per_link": _delta({k: p.counts() for k, p in links.items()}, before)}
            # direct: every receiver reads the origin through its region's link
            before = {k: p.counts() for k, p in links.items()}
            t0 = time.time()
            answers = run_all([(direct_rx[f"{r}{i}"], {"op": "receive", "root": origin, "receiver": f"direct-{r}{i}",
                                                       "state": os.path.join(tmp, f"direct-{r}{i}.safetensors"),
                                                       "storage_options": via_wan(r)})
                               for r in regions for i in range(per)])
            direct = {"seconds": max(a["t"] for a in answers) - t0,
                      "bytes_per_link": _delta({k: p.counts() for k, p in links.items()}, before)}
            _check_bits(ck, [os.path.join(tmp, f"{m}-{r}{i}.safetensors") for m in ("tree", "direct")
                             for r in regions for i in range(per)])
            steps_out.append({"step": s, "kind": "keyframe" if s == 0 else "delta", "changed_elements": changed,
                              "publish_summary": pub.summary, "publish_s": round(publish_s, 3),
                              "stored": stored, "tree": tree, "direct": direct})
            print(f"  tree {tree['seconds']:.1f} s, direct {direct['seconds']:.1f} s; origin->a "
                  f"{tree['bytes_per_link']['origin->a']['bytes_down']} vs "
                  f"{direct['bytes_per_link']['origin->a']['bytes_down']} bytes", flush=True)
    return {"params": n_params, "bytes_per_param": 4, "change_rate": args.change, "regions": len(regions),
            "receivers_per_region": per, "link_bytes_per_s": rate, "chunk_bytes": popts.chunk_bytes, "cpus": os.cpu_count(),
            "steps": steps_out}


def _check_bits(ck: dict, states: list[str]) -> None:
    """Every receiver holds the published step, raw bytes of every tensor."""
    import torch
    from safetensors.torch import load_file

    want = {n: t.contiguous().view(torch.uint8) for n, t in ck.items()}
    for path in states:
        got = load_file(path)
        bad = [n for n in want if not torch.equal(got[n].contiguous().view(torch.uint8), want[n])]
        if set(got) != set(want) or bad:
            raise AssertionError(f"{path}: differs from the published step ({bad[:3]})")


def _record(res: dict, st: dict, mode: str) -> dict:
    """One validation record: what a network simulator needs to predict this run, and what it measured."""
    links = st[mode]["bytes_per_link"]
    delta = st["kind"] == "delta"
    return {
        "name": f"relay-{mode}-step{st['step']}-{st['kind']}",
        "mode": mode,
        "streaming": False,
        "measured_s": round(st[mode]["seconds"], 3),
        "bytes_per_link": {k: v["bytes_down"] + v["bytes_up"] for k, v in links.items()},
        "bytes_per_link_detail": links,
        "scenario": {
            "params": res["params"],
            "bytes_per_param": res["bytes_per_param"],
            "step_kind": st["kind"],
            "change_rate": res["change_rate"] if delta else 1.0,
            "changed_elements": st["changed_elements"],
            "bytes_per_changed_element": st["stored"]["chunk_bytes"] / max(1, st["changed_elements"]),
            "stored_chunk_bytes": st["stored"]["chunk_bytes"],
            "stored_step_bytes": st["stored"]["attempt_bytes"] + st["stored"]["marker_bytes"],
            "stored_objects": st["stored"]["objects"] + 1,
            "chunk_bytes": res["chunk_bytes"],
            "regions": res["regions"],
            "receivers_per_region": res["receivers_per_region"],
            "inter_region_mbps": res["link_bytes_per_s"] / MB,  # megabytes per second, each direction
            "inter_region_bytes_per_s": res["link_bytes_per_s"],
            "in_region_bytes_per_s": None,  # not capped
            "tree": {"a": {"upstream": "origin", "receivers": res["receivers_per_region"] // 2},
                     "a2": {"upstream": "a", "receivers": res["receivers_per_region"] - res["receivers_per_region"] // 2},
                     "b": {"upstream": "origin", "receivers": res["receivers_per_region"]}} if mode == "tree" else None,
            "receivers_start": "when their ROOT has committed the step (tree) / at the commit (direct)",
        },
    }


def _table(res: dict) -> str:
    lines = [
        "# Relay tree against direct receivers\n",
        f"{res['params']:,} fp32 parameters, {res['regions']} regions x {res['receivers_per_region']} receivers, "
        f"inter-region links {res['link_bytes_per_s'] / MB:g} MB/s each way, in-region links uncapped, "
        f"deltas at {res['change_rate']:.0%} changed, chunks of {res['chunk_bytes']} bytes. Seconds: from the "
        "commit at the origin to the last receiver's commit. Bytes: bodies that crossed each link (down + up).\n",
        "| step | mode | seconds | origin->a | origin->b | a-region | b-region | stored (one copy) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for st in res["steps"]:
        for mode in ("tree", "direct"):
            b = {k: v["bytes_down"] + v["bytes_up"] for k, v in st[mode]["bytes_per_link"].items()}
            lines.append(f"| {st['step']} ({st['kind']}) | {mode} | {st[mode]['seconds']:.1f} | {b['origin->a']:,} | "
                         f"{b['origin->b']:,} | {b['a-region']:,} | {b['b-region']:,} | "
                         f"{st['stored']['attempt_bytes'] + st['stored']['marker_bytes']:,} |")
    lines += ["", f"Every process runs on one machine ({res.get('cpus', '?')} cores): the three S3 servers, the proxies, "
              "the mirrors and the receivers (each receiver rewrites its whole state file per step). A link's time "
              "is its bytes over its rate; the rest of the seconds is that local work."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcr_bench.relay_tree", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/bench-tree", help="where results.json, results.md and validation-records.json go")
    p.add_argument("--params", type=int, default=50_000_000, help="fp32 parameters of the model (default 50M)")
    p.add_argument("--change", type=float, default=0.03, help="share of elements changed per delta step")
    p.add_argument("--steps", type=int, default=3, help="steps: a keyframe, then deltas (default 3)")
    p.add_argument("--receivers", type=int, default=4, help="receivers per region (default 4)")
    p.add_argument("--link-mbytes", type=float, default=10.0, help="inter-region link, MB/s each way (default 10)")
    p.add_argument("--chunk-bytes", type=int, default=None, help="publisher chunk size (default: DCR's)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker_main()
    res = run(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(_table(res))
    with open(os.path.join(args.out, "validation-records.json"), "w") as f:
        json.dump([_record(res, st, m) for st in res["steps"] for m in ("direct", "tree")], f, indent=1)
    print(_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

