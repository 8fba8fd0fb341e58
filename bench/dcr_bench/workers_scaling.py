"""Publishing on Dask workers, measured: the delta encode with 1 and 2 worker processes against one
process, Prefect's cost per mapped task against Dask's, and a projection to 1T parameters on N
machines from those numbers.

``python -m dcr_bench.workers_scaling --out docs/bench-workers`` (``make bench-workers``):

- *Publish.* A ``size``-byte BF16 checkpoint (4096-wide tensors as in a Llama layer, weights
  ~N(0, 0.02)) and a copy with ``rate`` of its elements one unit away. The keyframe is published
  once, then the two files alternately as deltas, each ``dcr publish --json`` its own process
  against one Prefect API server this command starts on 127.0.0.1 (so no run pays for starting
  one), pinned with the CPU affinity each configuration names (inherited by a LocalCluster's
  workers): one process on 1 core and on 2 cores, ``--workers 1`` on 1 core, ``--workers 2`` on 2
  cores. Configurations take turns within each repeat, so a slow period of the machine hits all of
  them. Reported: the encode step's seconds as the flow timed it (the mapped ``encode-group`` tasks
  with workers), ``remember-baseline`` and the command's wall time. Every publish of the same file
  must record the same policy digest whichever configuration ran it (``exact``).
- *Task overhead.* ``tasks`` no-op tasks submitted at once to a LocalCluster of 2 worker processes
  (the ``--workers 2`` cluster: one thread each, DCR's preload), through plain Dask and through
  Prefect's ``DaskTaskRunner`` in a flow: the first round (each worker's first Prefect task inside
  it) and the second.
- *Projection.* T(N) = t_fixed + max(S / (N c r), S / (N b)) + (G / (N c)) t_task for S bytes on N
  machines of c cores reading b GB/s each, with r (one worker's encode rate on one core), t_task and
  t_fixed taken from the runs above. A model, not a measurement: it assumes r holds per core where
  workers have cores of their own.

Writes ``results.json``, ``results.md`` and ``workers.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from dcr_bench.commands import _dcr_argv
from dcr_bench.relay_tree import free_port
from dcr_bench.scaling import _shapes, _write
from dcr_core.batches import batch_count, batches_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROJECTION_MACHINES = (1, 8, 32, 128)


def _configs(cores: list[int]) -> list[dict]:
    """The runs compared: (label, CPUs, workers)."""
    one, two = cores[:1], cores[:2]
    out = [{"label": "one process, 1 core", "cpus": one, "workers": None}]
    if len(two) == 2:
        out.append({"label": "one process, 2 cores", "cpus": two, "workers": None})
    out.append({"label": "--workers 1, 1 core", "cpus": one, "workers": 1})
    if len(two) == 2:
        out.append({"label": "--workers 2, 2 cores", "cpus": two, "workers": 2})
    return out


def start_prefect(home: str) -> tuple[int, str]:
    """A Prefect API server on 127.0.0.1 through ``infra/start-prefect.sh``: (its pid, the API URL)."""
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": home, "DCR_PYTHON": sys.executable}
    out = subprocess.run(["bash", os.path.join(REPO, "infra", "start-prefect.sh"), str(port)], env=env,
                         capture_output=True, text=True, timeout=180)
    if out.returncode:
        raise RuntimeError(f"the Prefect API server did not start: {out.stderr.strip()[-600:]}")
    with open(os.path.join(home, "server.pid")) as f:
        return int(f.read()), f"http://127.0.0.1:{port}/api"


def _publish(dcr: list[str], root: str, ckpt: str, step: int, cpus: list[int], workers: int | None, env: dict) -> dict:
    argv = [*dcr, "publish", root, ckpt, "--step", str(step), "--json", "--orchestrator", "prefect"]
    if workers:
        argv += ["--workers", str(workers)]
    t0 = time.perf_counter()
    out = subprocess.run(argv, env=env, capture_output=True, text=True, preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    wall = time.perf_counter() - t0
    if out.returncode:
        raise RuntimeError(f"dcr {' '.join(argv[len(dcr):])} failed: {out.stderr.strip()[-800:]}")
    doc = json.loads(out.stdout)
    t = doc["timings"]
    encode = t["encode-group"] if workers else t["encode-and-write"]  # mapped on workers: one step, timed whole
    return {"step": step, "file": os.path.basename(ckpt), "wall_s": wall, "encode_s": encode,
            "remember_baseline_s": t["remember-baseline"], "kind": doc["kind"], "policy_digest": doc["policy_digest"],
            "bytes_full": doc["summary"]["bytes_full"], "change_rate": doc["summary"]["change_rate"]}


def measure_publish(work: str, size: float, rate: float, repeats: int, seed: int, env: dict) -> dict:
    shapes = _shapes(size)
    old, new = os.path.join(work, "old.safetensors"), os.path.join(work, "new.safetensors")
    _write(old, shapes, seed, None)
    _write(new, shapes, seed, round(rate * sum(r * c for r, c in shapes)))
    root, dcr = os.path.join(work, "root"), _dcr_argv()
    env = {**env, "DCR_CACHE_DIR": os.path.join(work, "cache")}
    cores = sorted(os.sched_getaffinity(0))
    configs = _configs(cores)
    tensors = [(i, 2 * r * c) for i, (r, c) in enumerate(shapes)]  # BF16: 2 bytes an element
    groups = {c["label"]: len(batches_for(tensors, c["workers"])) for c in configs if c["workers"]}
    _publish(dcr, root, old, 0, cores, None, env)  # the keyframe
    step, runs = 0, []
    for rep in range(repeats):
        for c in configs:
            step += 1
            r = _publish(dcr, root, new if step % 2 else old, step, c["cpus"], c["workers"], env)
            if r["kind"] != "delta":
                raise RuntimeError(f"step {step} was published as a {r['kind']}, not a delta")
            runs.append({"config": c["label"], "repeat": rep, **r})
            print(f"  {c['label']:<22} step {step}: encode {r['encode_s']:.2f} s, wall {r['wall_s']:.2f} s", flush=True)
    digests = {f: {r["policy_digest"] for r in runs if r["file"] == f} for f in ("old.safetensors", "new.safetensors")}
    return {"bytes": os.path.getsize(new), "tensors": len(shapes), "rate": rate, "cores": cores,
            "configs": [c["label"] for c in configs], "groups": groups, "runs": runs,
            "exact": all(len(d) == 1 for d in digests.values())}


def _noop(i: int) -> int:
    return i


def overhead_main(tasks: int) -> int:
    """In its own process (PREFECT_API_URL set before Prefect is imported): ``tasks`` no-op tasks
    on a LocalCluster of 2 workers through Dask alone and through Prefect; prints JSON."""
    from distributed import Client, LocalCluster
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect_dask import DaskTaskRunner

    from flows.workers import PRELOAD, QUIET_WORKERS

    noop = task(_noop, name="noop", persist_result=False, cache_policy=NO_CACHE)
    out: dict = {"tasks": tasks, "workers": 2}

    @flow(name="bench-task-overhead")
    def rounds(address: str) -> list[float]:
        times = []
        with DaskTaskRunner(address=address) as runner:
            for _ in range(2):
                t0 = time.perf_counter()
                for f in [runner.submit(noop, {"i": i}) for i in range(tasks)]:
                    f.result()
                times.append(time.perf_counter() - t0)
        return times

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None,
                      preload=[PRELOAD], env=QUIET_WORKERS) as cluster, Client(cluster) as client:
        client.gather(client.map(_noop, range(tasks), pure=False))  # warm
        t0 = time.perf_counter()
        client.gather(client.map(_noop, range(tasks), pure=False))
        out["dask_s"] = time.perf_counter() - t0
        out["prefect_first_round_s"], out["prefect_s"] = rounds(cluster.scheduler_address)
    print(json.dumps(out), flush=True)
    return 0


def measure_overhead(tasks: int, cpus: list[int], env: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "dcr_bench.workers_scaling", "--overhead", str(tasks)], env=env,
                         capture_output=True, text=True, preexec_fn=lambda: os.sched_setaffinity(0, cpus), timeout=600)
    if out.returncode:
        raise RuntimeError(f"the task-overhead run failed: {out.stderr.strip()[-800:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(pub: dict, ovh: dict, size_t: float, cores_per_machine: int, read_gbps: float) -> dict:
    by = {c: [r for r in pub["runs"] if r["config"] == c] for c in pub["configs"]}
    best = {c: min(r["encode_s"] for r in rs) for c, rs in by.items()}
    s: dict = {"encode_best_s": best,
               "encode_all_s": {c: [round(r["encode_s"], 3) for r in rs] for c, rs in by.items()},
               "wall_all_s": {c: [round(r["wall_s"], 3) for r in rs] for c, rs in by.items()}}
    w1, w2 = "--workers 1, 1 core", "--workers 2, 2 cores"
    if w2 in best:
        s["speedup_2_over_1_workers"] = best[w1] / best[w2]
    if "one process, 2 cores" in best:
        s["speedup_2_over_1_core_one_process"] = best["one process, 1 core"] / best["one process, 2 cores"]
    r = pub["bytes"] / best[w1] / 1e9  # GB/s of one worker on one core
    t_task = ovh["prefect_s"] / ovh["tasks"]
    fixed = [x["wall_s"] - x["encode_s"] for x in by[w2 if w2 in by else w1]]
    t_fixed = statistics.median(fixed)
    s.update({"worker_core_gbps": r, "prefect_s_per_task": t_task, "dask_s_per_task": ovh["dask_s"] / ovh["tasks"],
              "fixed_s": t_fixed})
    if w2 in best and "one process, 2 cores" in best:  # the same 2 cores: workers against one process
        wall = {c: min(x["wall_s"] for x in by[c]) for c in (w2, "one process, 2 cores")}
        s["workers_2_over_one_process_2_cores"] = {"encode": best["one process, 2 cores"] / best[w2],
                                                   "wall": wall["one process, 2 cores"] / wall[w2]}
    proj = []
    for n in PROJECTION_MACHINES:
        slots = n * cores_per_machine
        groups = batch_count(int(size_t), slots)  # flows.publish.groups' default split
        enc, read = size_t / (slots * r * 1e9), size_t / (n * read_gbps * 1e9)
        proj.append({"machines": n, "groups": groups, "encode_s": enc, "read_s": read, "tasks_s": groups / slots * t_task,
                     "total_s": t_fixed + max(enc, read) + groups / slots * t_task})
    s["projection"] = {"bytes": size_t, "cores_per_machine": cores_per_machine, "read_gbps_per_machine": read_gbps,
                       "rows": proj}
    return s


def markdown(res: dict) -> str:
    pub, ovh, s = res["publish"], res["overhead"], res["summary"]
    lines = [
        "# Publishing on Dask workers\n",
        f"`python -m dcr_bench.workers_scaling` ({res['when']}); {pub['bytes'] / 1e9:.2f} GB BF16 in {pub['tensors']} "
        f"tensors, {100 * pub['rate']:g}% of elements changed per delta, local ROOT, one Prefect API server running "
        f"for all runs, CPUs {pub['cores']}. Seconds; every run its own `dcr publish --json` process.\n",
        "| configuration | groups | encode s (each run) | best | wall s (each run) |",
        "|---|---:|---|---:|---|",
    ]
    for c in pub["configs"]:
        lines.append(f"| {c} | {pub.get('groups', {}).get(c, '-')} | {', '.join(f'{x:.2f}' for x in s['encode_all_s'][c])} | "
                     f"{s['encode_best_s'][c]:.2f} | {', '.join(f'{x:.2f}' for x in s['wall_all_s'][c])} |")
    lines.append("")
    if "speedup_2_over_1_workers" in s:
        lines.append(f"- 2 workers against 1 (best encode): **{s['speedup_2_over_1_workers']:.2f}x**"
                     + (f"; one process on 2 cores against 1 core: {s['speedup_2_over_1_core_one_process']:.2f}x" if
                        "speedup_2_over_1_core_one_process" in s else ""))
    if "workers_2_over_one_process_2_cores" in s:
        v = s["workers_2_over_one_process_2_cores"]
        lines.append(f"- `--workers 2` against one process on the same 2 cores (best each): encode step {v['encode']:.2f}x "
                     f"({'not slower' if v['encode'] >= 1 else 'slower'}); wall time {v['wall']:.2f}x (a `--workers` "
                     "publish also starts a LocalCluster: the fixed cost below)")
    lines += [
        f"- Same policy digest for each file whichever configuration published it: **{'yes' if pub['exact'] else 'NO'}**",
        f"- One worker on one core encodes {s['worker_core_gbps']:.3f} GB/s (r).",
        f"- {ovh['tasks']} no-op tasks on 2 workers: Dask {ovh['dask_s']:.2f} s ({1e3 * s['dask_s_per_task']:.1f} ms each); "
        f"Prefect's `DaskTaskRunner` {ovh['prefect_s']:.2f} s ({1e3 * s['prefect_s_per_task']:.0f} ms each), "
        f"{ovh['prefect_first_round_s']:.2f} s for the first round (each worker's first Prefect task in it).",
        f"- Fixed cost of a `--workers` publish (wall minus the encode step, median): {s['fixed_s']:.1f} s.",
        "",
        "## Projection (a model, not a measurement)\n",
        (f"T(N) = t_fixed + max(S / (N c r), S / (N b)) + (G / (N c)) t_task with S = {s['projection']['bytes'] / 1e12:g} TB, "
         f"c = {s['projection']['cores_per_machine']} worker processes per machine, b = {s['projection']['read_gbps_per_machine']:g} "
         "GB/s read per machine (assumed), G = the default split's groups (`dcr_core.batches.batch_count`: one per "
         "worker, up to 4 where each still holds 1 GiB), r, t_task and t_fixed as measured above.\n"),
        "| machines | groups | encode s | read s | task overhead s | total s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for p in s["projection"]["rows"]:
        lines.append(f"| {p['machines']} | {p['groups']} | {p['encode_s']:.1f} | {p['read_s']:.1f} | {p['tasks_s']:.2f} | "
                     f"{p['total_s']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, out: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    s = res["summary"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = res["publish"]["configs"]
    a.bar(range(len(labels)), [s["encode_best_s"][c] for c in labels], color="tab:blue")
    a.set_xticks(range(len(labels)), labels, rotation=15, fontsize=8)
    a.set_ylabel("encode step s (best)")
    a.set_title(f"delta publish, {res['publish']['bytes'] / 1e9:.1f} GB at {100 * res['publish']['rate']:g}%")
    rows = s["projection"]["rows"]
    b.loglog([p["machines"] for p in rows], [p["total_s"] for p in rows], marker="o")
    b.set_xlabel("machines")
    b.set_ylabel("projected publish s")
    b.set_title(f"projection: {s['projection']['bytes'] / 1e12:g} TB, {s['projection']['cores_per_machine']} cores each")
    b.grid(True, alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out, "workers.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcr_bench.workers_scaling", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/bench-workers", help="where results.json, results.md and workers.png go")
    p.add_argument("--size", type=float, default=2e9, help="checkpoint bytes (default 2e9: 1B BF16 parameters)")
    p.add_argument("--rate", type=float, default=0.03, help="share of elements changed per delta (default 0.03)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each configuration (default 3: the best of each is compared)")
    p.add_argument("--tasks", type=int, default=50, help="no-op tasks per round of the overhead run (default 50)")
    p.add_argument("--project-bytes", type=float, default=2e12, help="bytes of the projected checkpoint (default 2e12)")
    p.add_argument("--cores-per-machine", type=int, default=32, help="worker processes per projected machine (default 32)")
    p.add_argument("--read-gbps", type=float, default=10.0, help="checkpoint read GB/s per projected machine (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overhead", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.overhead is not None:
        return overhead_main(args.overhead)
    if args.size <= 0 or not 0 < args.rate < 1 or args.repeats < 1 or args.tasks < 1:
        p.error("--size, --repeats and --tasks must be positive and --rate in (0, 1)")
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="dcr-bench-workers-")
    home = os.path.join(work, "prefect")
    os.makedirs(home)
    pid = None
    try:
        pid, api = start_prefect(home)
        env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        print(f"publishing {args.size / 1e9:g} GB at {100 * args.rate:g}% ({args.repeats} runs of each configuration)", flush=True)
        pub = measure_publish(work, args.size, args.rate, args.repeats, args.seed, env)
        print(f"task overhead ({args.tasks} no-op tasks, 2 workers)", flush=True)
        ovh = measure_overhead(args.tasks, sorted(os.sched_getaffinity(0))[:2], env)
    finally:
        if pid:
            subprocess.run(["kill", str(pid)], check=False)
        shutil.rmtree(work, ignore_errors=True)
    res = {"when": time.strftime("%Y-%m-%d"), "publish": pub, "overhead": ovh,
           "summary": summarize(pub, ovh, args.project_bytes, args.cores_per_machine, args.read_gbps)}
    res["plot"] = plot(res, args.out)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    print(md)
    return 0 if pub["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
