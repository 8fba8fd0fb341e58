"""The commands' own times against the tensor count: ``dcr publish`` and ``dcr receive``, whole.

The same bytes (``dcr_bench.moe``: a BF16 checkpoint pair, ``rate`` of the elements one unit away)
in each count of tensors. For each count, once: ``dcr publish --step 0`` and ``dcr receive`` of it
(untimed), and a copy of what they left (the ROOT, the publisher's baseline cache, the state file).
Then ``runs`` rounds, each count in turn within a round (so a busy spell of the machine lands on
every count alike): the copy put back, then the timed commands, each a fresh process as a user runs
it (interpreter start-up included): ``dcr publish --step 1`` (a delta against the warm cache) and
``dcr receive`` (step 0 to step 1, rewriting the state file). Every received state is checked bit
for bit against the step-1 checkpoint. Reported: each command's seconds (every run, the median,
the fastest) and its median against the fewest tensors'.

    python -m dcr_bench.command_times --tensors 8,15000 --runs 8 --out command-times
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

from dcr_bench import moe
from dcr_bench.scaling import same_tensors

COMMANDS = ("publish", "receive")


def dcr_seconds(args: list[str], env: dict) -> float:
    """Run ``dcr ARGS`` as a command (this interpreter's, a process of its own), its seconds; raises
    with the end of its stderr if it fails."""
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, capture_output=True, text=True)
    took = time.perf_counter() - t
    if done.returncode:
        raise RuntimeError(f"dcr {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-800:]}")
    return took


def _dcr(*args: str, env: dict) -> float:
    return dcr_seconds(list(args), env)


def _restore(saved: str, work: str) -> None:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(saved, work, symlinks=True)


def measure(work: str, counts=(8, 15000), runs: int = 8, total_bytes: int = 75_000_000, rate: float = 0.03,
            seed: int = 0, bundle_below: int | None = None, log=print) -> dict:
    """Every count, ``runs`` rounds (see the module doc); the results as a dict."""
    counts = sorted(set(counts))
    extra = [] if bundle_below is None else ["--bundle-below", str(bundle_below)]
    env = {**os.environ, "DCR_ORCHESTRATOR": "none"}
    cases = {}
    for n in counts:
        d = os.path.join(work, f"t{n}")
        os.makedirs(d)
        old, new = os.path.join(d, "old.safetensors"), os.path.join(d, "new.safetensors")
        info = moe.write_pair(old, new, total_bytes, n, rate, seed)
        live, saved = os.path.join(d, "live"), os.path.join(d, "saved")
        os.makedirs(live)
        e = {**env, "DCR_CACHE_DIR": os.path.join(live, "cache")}
        _dcr("publish", os.path.join(live, "root"), old, "--step", "0", *extra, env=e)
        _dcr("receive", os.path.join(live, "root"), "--receiver", "bench", "--state", os.path.join(live, "state.safetensors"),
             env=e)
        shutil.copytree(live, saved, symlinks=True)
        cases[n] = {"dir": d, "new": new, "live": live, "saved": saved, "env": e, "info": info,
                    "s": {c: [] for c in COMMANDS}}
    for k in range(runs):
        for n in counts:
            c = cases[n]
            _restore(c["saved"], c["live"])
            root, state = os.path.join(c["live"], "root"), os.path.join(c["live"], "state.safetensors")
            c["s"]["publish"].append(_dcr("publish", root, c["new"], "--step", "1", env=c["env"]))
            c["s"]["receive"].append(_dcr("receive", root, "--receiver", "bench", "--state", state, env=c["env"]))
            if not same_tensors(state, c["new"]):
                raise AssertionError(f"{n} tensors, run {k}: the received state is not the step-1 checkpoint")
        log(f"  round {k + 1}/{runs}: " + "; ".join(
            f"{n:,} tensors publish {cases[n]['s']['publish'][-1]:.2f}s receive {cases[n]['s']['receive'][-1]:.2f}s"
            for n in counts))
    base = min(counts)
    rows = []
    for n in counts:
        s = cases[n]["s"]
        row = {"tensors": n, "bytes": cases[n]["info"]["bytes"], "exact": True}
        for c in COMMANDS:
            row[c] = {"runs_s": s[c], "median_s": statistics.median(s[c]), "fastest_s": min(s[c])}
        rows.append(row)
    first = rows[0]
    for row in rows:
        for c in COMMANDS:
            row[c]["ratio"] = row[c]["median_s"] / first[c]["median_s"]
    return {"counts": counts, "runs": runs, "total_bytes": total_bytes, "rate": rate, "seed": seed,
            "bundle_below": bundle_below, "ratio_base_tensors": base, "rows": rows}


def markdown(res: dict) -> str:
    base = res["ratio_base_tensors"]
    lines = [
        f"# The commands against the tensor count ({res['total_bytes'] / 1e6:g} MB BF16, {100 * res['rate']:g}% changed, "
        f"{res['runs']} rounds)\n",
        "Whole commands, a fresh process each (interpreter start-up included); the delta publish against a warm "
        "baseline cache, the receive of that delta into a state file (bit-exact every run)"
        + ("" if res["bundle_below"] is None else f"; published with `--bundle-below {res['bundle_below']}`") + ".\n",
        f"| tensors | publish s: median (fastest) | x{base} | receive s: median (fastest) | x{base} |",
        "|---:|---|---:|---|---:|",
    ]
    for r in res["rows"]:
        p, q = r["publish"], r["receive"]
        lines.append(f"| {r['tensors']:,} | {p['median_s']:.2f} ({p['fastest_s']:.2f}) | {p['ratio']:.2f} | "
                     f"{q['median_s']:.2f} ({q['fastest_s']:.2f}) | {q['ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dcr_bench.command_times", description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", default="8,15000", help="tensor counts, comma-separated (default 8,15000)")
    p.add_argument("--runs", type=int, default=8, help="rounds (default 8)")
    p.add_argument("--bytes", type=int, default=75_000_000, help="checkpoint bytes (default 75000000)")
    p.add_argument("--bundle-below", type=int, default=None, help="dcr publish --bundle-below (default: its own)")
    p.add_argument("--out", default=None, help="directory for results.json and results.md (default: print only)")
    a = p.parse_args(argv)
    counts = [int(x) for x in a.tensors.split(",") if x.strip()]
    if len(counts) < 2 or min(counts) < 1 or a.runs < 1:
        p.error("--tensors needs at least two counts of at least 1, --runs at least 1")
    with tempfile.TemporaryDirectory(prefix="dcr-command-times-") as work:
        res = measure(work, counts, a.runs, a.bytes, bundle_below=a.bundle_below)
    md = markdown(res)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(a.out, "results.md"), "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
