"""Retries of S3 requests, measured: DCR's retry owner (``storage.retry``) against botocore's
standard retry mode, under the same injected faults.

``python -m dcr_bench.retry_modes --out docs/bench-retry`` (``make bench-retry``). A moto S3 server
(its own process) behind a fault-injecting proxy (in this process), both on 127.0.0.1. Each run is
one workload through DCR's ``Root`` API, 8 operations at a time: ``--small`` PUTs and as many GETs
of 4 KiB objects, ``--large`` PUTs and as many GETs of 4 MiB objects (GETs read objects written
straight to the server beforehand; every GET's bytes are compared with what was written). Policies:

- ``dcr``: DCR as it ships: s3fs (``retries=1``) and botocore (``total_max_attempts=1``) do not
  retry; ``storage.retry`` retries through ``Root`` (5 attempts, 0.05-0.8 s backoff).
- ``standard``: botocore's standard mode (``{"mode": "standard", "total_max_attempts": 5}``),
  s3fs still at ``retries=1``, and ``Root(..., retry=NO_RETRY)``: nothing above botocore retries.
- ``defaults`` (reference): what s3fs and botocore do unconfigured: botocore's legacy mode (5
  attempts) under s3fs's own loop (``retries=5``), ``Root(..., retry=NO_RETRY)``.

Faults are chosen per object, not per request, so every policy meets the same ones: for a fault
kind, the first ``tries`` requests for each chosen object (by method and path) get the fault, later
ones go through. Kinds: ``503`` (SlowDown), ``500`` (InternalError), ``reset`` (the connection
dropped with RST after the request, before any response), ``truncate`` (a GET's body cut after
half its bytes, then the connection closed: the status line and headers arrive, the body is cut
short while the caller reads it), ``stall`` (the answer held past the client's read timeout). The
``burst`` scenario answers SlowDown to the first two requests for every object: many concurrent
requests fail at once, which is what botocore's retry quota (a token bucket per client: 500 tokens,
5 per retry, 10 per retry after a timeout, refunded only by successes) is for.

Counted: operations that succeeded and failed (by the error the caller saw), requests that reached
the proxy (with the faults injected), and the run's wall time. Writes ``results.json`` and
``results.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from dcr_bench.netproxy import Proxy
from dcr_bench.relay_tree import s3_servers
from storage import stats
from storage.retry import NO_RETRY, chain
from storage.root import Root

KiB, MiB = 1 << 10, 1 << 20
SMALL, LARGE = 4 * KiB, 4 * MiB
ATTEMPTS = 5  # DCR's RetryPolicy default; the same total for botocore's modes
CONCURRENCY = 8  # DCR's chunk transfer pools (storage.chunk_io)
READ_TIMEOUT = 3.0  # the client's read timeout in every run (s3fs's default is 15 s)
STALL = 4.0  # a stalled answer comes this long after the request: past READ_TIMEOUT
GET_PREFIX = "get"  # the objects GETs read, written straight to the server once

# name -> (fault, fraction of objects, tries faulted per object)
SCENARIOS = {
    "none": (None, 0.0, 0),
    "503 SlowDown": ("503", 0.25, 1),
    "500 InternalError": ("500", 0.25, 1),
    "connection reset": ("reset", 0.25, 1),
    "GET body truncated": ("truncate", 0.25, 1),
    "stall > read timeout": ("stall", 0.1, 1),
    "burst: 503 x2 on every object": ("503", 1.0, 2),
}
POLICIES = ("dcr", "standard", "defaults")
POLICY_LABELS = {
    "dcr": "(a) DCR's owner (botocore and s3fs off)",
    "standard": "(b) botocore standard mode, DCR off",
    "defaults": "(c) s3fs retries=5 + botocore legacy (defaults), DCR off",
}
# -- the workload --------------------------------------------------------------------------------

def _content(name: str, size: int, base: bytes) -> bytes:
    head = name.encode().ljust(64, b".")
    return head + base[: size - len(head)]


def _names(small: int, large: int) -> list[tuple[str, int]]:
    return [(f"small-{i:03d}", SMALL) for i in range(small)] + [(f"large-{i:03d}", LARGE) for i in range(large)]


def _faulted(names: list[str], fraction: float, seed: int) -> set[str]:
    k = round(len(names) * fraction)
    return set(random.Random(seed).sample(names, k)) if k else set()


def _policy_options(policy: str, server_options: dict) -> tuple[dict, bool, int | None]:
    """(storage options, whether DCR's owner retries, s3fs's ``retries`` to set) for ``policy``."""
    cfg: dict = {"read_timeout": READ_TIMEOUT}
    if policy == "standard":
        cfg["retries"] = {"mode": "standard", "total_max_attempts": ATTEMPTS}
    elif policy == "defaults":
        cfg["retries"] = {"mode": "legacy"}  # botocore's own default: 5 attempts
    # "dcr": DCR's default (total_max_attempts=1) applies
    # A filesystem of its own per run: botocore's retry quota lives in its client, and a fresh
    # one starts each run full.
    opts = {**server_options, "config_kwargs": cfg, "skip_instance_cache": True}
    return opts, policy == "dcr", (5 if policy == "defaults" else None)


def _error_name(e: BaseException) -> str:
    names = [type(x).__name__ for x in chain(e)]
    meta = {}
    for x in chain(e):
        response = getattr(x, "response", None)
        if isinstance(response, dict):
            meta = response.get("ResponseMetadata") or {}
            break
    out = " <- ".join(dict.fromkeys(names))
    if meta.get("RetryQuotaReached"):
        out += " [retry quota reached]"
    return out


def one_run(policy: str, scenario: str, server, proxy: Proxy, names: list[tuple[str, int]],
            base: bytes, seed: int) -> dict:
    fault, fraction, tries = SCENARIOS[scenario]
    faulted = _faulted([n for n, _ in names], fraction, seed)
    opts, dcr_retries, s3fs_retries = _policy_options(policy, server.options)
    run = uuid.uuid4().hex[:8]
    url = f"s3://{server.bucket}"
    put_prefix = f"put-{run}"
    root = Root(url, opts, retry=None if dcr_retries else NO_RETRY)
    if s3fs_retries is not None:
        root.fs.retries = s3fs_retries

    seen: Counter = Counter()  # (method, path without the query) -> requests

    def plan(method: str, path: str) -> str | None:
        key = (method, urlsplit(path).path)
        seen[key] += 1
        if fault is None or seen[key] > tries:
            return None
        return fault if key[1].rsplit("/", 1)[-1] in faulted else None

    ops = [("PUT", n, s) for n, s in names] + [("GET", n, s) for n, s in names]
    random.Random(seed + 1).shuffle(ops)
    expected = {n: _content(n, s, base) for n, s in names}

    def do(op: tuple[str, str, int]) -> tuple[str, str, int, str | None]:
        method, name, size = op
        try:
            if method == "PUT":
                root.write(f"{put_prefix}/{name}", expected[name])
            else:
                data = root.read(f"{GET_PREFIX}/{name}")
                if data != expected[name]:
                    return method, name, size, f"wrong bytes ({len(data)} of {len(expected[name])})"
            return method, name, size, None
        except Exception as e:  # noqa: BLE001 - what the caller sees is the measurement
            return method, name, size, _error_name(e)

    before = stats.io_stats(url)
    proxy.reset_counts()
    proxy.fault = plan
    t0 = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(do, ops))
    wall = time.perf_counter() - t0
    with proxy.lock:
        proxy.fault = None
        outcomes = dict(proxy.outcomes)
    dcr = stats.io_stats(url).minus(before)
    failed = Counter(err for *_, err in results if err)
    by_kind: dict[str, dict] = {}
    for method, _name, size, err in results:
        k = f"{method} {'4 KiB' if size == SMALL else '4 MiB'}"
        d = by_kind.setdefault(k, {"ok": 0, "failed": 0})
        d["failed" if err else "ok"] += 1
    with contextlib.suppress(Exception):
        root.fs.rm(root.full(put_prefix), recursive=True)  # moto keeps objects in memory
    return {
        "policy": policy, "scenario": scenario, "fault": fault, "faulted_objects": len(faulted),
        "tries_faulted": tries, "ops": len(ops), "ok": sum(1 for *_, e in results if not e),
        "failed": sum(failed.values()), "errors": dict(failed.most_common()), "by_kind": by_kind,
        "requests": sum(outcomes.values()), "faults_injected": sum(v for k, v in outcomes.items() if k != "ok"),
        "outcomes": outcomes, "dcr_retries": dcr.retries, "wall_s": round(wall, 3),
    }



def _seed_objects(server, names: list[tuple[str, int]], base: bytes) -> None:
    import boto3

    o = server.options
    s3 = boto3.client("s3", endpoint_url=server.url, aws_access_key_id=o["key"], aws_secret_access_key=o["secret"],
                      region_name="us-east-1")
    for name, size in names:
        s3.put_object(Bucket=server.bucket, Key=f"{GET_PREFIX}/{name}", Body=_content(name, size, base))


def _versions() -> dict:
    out = {"python": platform.python_version(), "platform": platform.platform(), "cores": os.cpu_count()}
    for mod in ("botocore", "aiobotocore", "s3fs", "aiohttp", "moto"):
        with contextlib.suppress(Exception):
            out[mod] = __import__(mod).__version__
    with contextlib.suppress(Exception):
        from botocore.configprovider import NEW_RETRIES_ENABLED

        out["botocore_new_retries"] = NEW_RETRIES_ENABLED
    return out


def markdown(res: dict) -> str:
    w, m = res["workload"], res["machine"]
    policies = list(dict.fromkeys(r["policy"] for r in res["runs"]))
    lines = [
        "# Retries: DCR's owner against botocore's standard mode (measured)",
        "",
        f"`python -m dcr_bench.retry_modes` on {m['cores']} cores: {w['small']} PUTs and {w['small']} GETs of "
        f"4 KiB, {w['large']} PUTs and {w['large']} GETs of 4 MiB through `Root` "
        f"({2 * (w['small'] + w['large'])} operations), {w['concurrency']} at a time, against moto behind a "
        f"fault-injecting proxy on 127.0.0.1. {w['attempts']} attempts in every policy; read timeout "
        f"{w['read_timeout_s']:g} s; a stalled answer comes after {w['stall_s']:g} s. A fault hits the first "
        "N PUTs and the first N GETs of each chosen object (the same objects for every policy; a truncated "
        "body only GETs). botocore "
        f"{m.get('botocore')} (new retries: {m.get('botocore_new_retries')}), aiobotocore {m.get('aiobotocore')}, "
        f"s3fs {m.get('s3fs')}, aiohttp {m.get('aiohttp')}, moto {m.get('moto')}.",
        "",
        "Each cell: operations ok / failed, requests that reached the proxy (faults injected among them), wall time.",
        "",
    ]
    for pol in policies:
        lines.append(f"- {POLICY_LABELS[pol]}")
    lines += ["", "| scenario | faulted | " + " | ".join(POLICY_LABELS[pol].split(" ", 1)[0] for pol in policies) + " |",
              "|---|---|" + "---|" * len(policies)]
    by = {(r["scenario"], r["policy"]): r for r in res["runs"]}
    for scenario in dict.fromkeys(r["scenario"] for r in res["runs"]):
        first = by[(scenario, policies[0])]
        faulted = "-" if not first["fault"] else (f"{first['faulted_objects']} of {w['small'] + w['large']} objects, "
                                                  f"first {first['tries_faulted']}")
        cells = []
        for pol in policies:
            r = by.get((scenario, pol))
            cells.append("" if r is None else f"{r['ok']} / {r['failed']}, {r['requests']} ({r['faults_injected']}), "
                         f"{r['wall_s']:.1f} s")
        lines.append(f"| {scenario} | {faulted} | " + " | ".join(cells) + " |")
    lines += ["", "Errors the caller saw (operations that failed; the exception, then its causes):", ""]
    errs = [f"- {r['scenario']}, {POLICY_LABELS[r['policy']].split(' ', 1)[0]}: {n} x `{err}`"
            for r in res["runs"] for err, n in r["errors"].items()]
    lines += errs or ["- none"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcr_bench.retry_modes", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/bench-retry")
    p.add_argument("--small", type=int, default=48, help="4 KiB objects (PUTs, and as many GETs)")
    p.add_argument("--large", type=int, default=12, help="4 MiB objects (PUTs, and as many GETs)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--scenarios", default=None, help="comma-separated names (default: all)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    policies = [x for x in a.policies.split(",") if x]
    scenarios = list(SCENARIOS) if not a.scenarios else [s.strip() for s in a.scenarios.split(",")]
    for s in scenarios:
        if s not in SCENARIOS:
            p.error(f"unknown scenario {s!r}; known: {', '.join(SCENARIOS)}")
    names = _names(a.small, a.large)
    base = random.Random(a.seed).randbytes(LARGE)
    res = {"machine": _versions(), "runs": [],
           "workload": {"small": a.small, "large": a.large, "concurrency": CONCURRENCY, "attempts": ATTEMPTS,
                        "read_timeout_s": READ_TIMEOUT, "stall_s": STALL, "seed": a.seed}}
    saved = {k: os.environ.pop(k, None) for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                                                 "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
    try:
        with tempfile.TemporaryDirectory() as tmp, s3_servers(["retry"], tmp) as servers:
            server = servers["retry"]
            _seed_objects(server, names, base)
            proxy = Proxy(server.url)
            proxy.stall_seconds = STALL
            server = type(server)(server.name, proxy.url, server.bucket, {**server.options, "endpoint_url": proxy.url})
            try:
                for scenario in scenarios:
                    for policy in policies:
                        r = one_run(policy, scenario, server, proxy, names, base, a.seed)
                        print(f"{scenario:32s} {policy:9s} ok {r['ok']:4d} failed {r['failed']:4d} requests "
                              f"{r['requests']:4d} (faults {r['faults_injected']:3d}) {r['wall_s']:6.2f} s"
                              + (f"  {r['errors']}" if r["errors"] else ""), flush=True)
                        res["runs"].append(r)
            finally:
                proxy.close()
    finally:
        for k, v in saved.items():
            if v is not None:
                os.environ[k] = v
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
