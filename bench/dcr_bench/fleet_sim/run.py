"""Many simulated schedules, their figures, and the command: ``python -m dcr_bench.fleet_sim``.

``--schedules N`` runs seeds ``seed``, ``seed + 1``, ... (``--seed S``, default 1); ``--seed S``
alone replays that one schedule (what a failure prints). The first violation stops the run with the
seed, the invariant and the last events (exit 1). ``--out DIR`` writes ``fleet-sim.json`` (the
figures) and ``fleet-sim.png`` (schedules, events and invariant checks as the run went).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from dcr_bench.fleet_sim import world
from dcr_bench.fleet_sim.invariants import Violation
from dcr_bench.fleet_sim.schedule import Config, Outcome, run_schedule
from dcr_bench.fleet_sim.vllm_server import transfer_module

PUBLISHED_STEPS = 4  # steps 0 (a keyframe) to 3 (deltas), published once per run


def published(steps: int = PUBLISHED_STEPS) -> dict[str, bytes]:
    """A ROOT with ``steps`` committed steps of a tiny model, by the real publisher (in memory), as
    the objects every schedule's ROOT starts from."""
    import torch

    from flows import run_publish
    from flows.options import PublishOptions
    from storage.root import open_root

    url = f"memory://fleet-sim-published-{os.getpid()}"
    g = torch.Generator().manual_seed(0)
    weights = {"layer.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16), "layer.bias": torch.zeros(8)}
    with tempfile.TemporaryDirectory() as cache:
        for step in range(steps):
            run_publish(url, weights, step, options=PublishOptions(chunk_bytes=64, cache_dir=cache, use_cache=False),
                        attempt=f"{step + 1:032x}")  # the same keys in every run: a seed's trace is too
            weights = {k: v + torch.randn(v.shape, generator=g).to(v.dtype) for k, v in weights.items()}
    root = open_root(url)
    objects = world.snapshot(root)
    root.backend.remove(root.path, recursive=True)
    return objects


@dataclass
class Totals:
    schedules: int = 0
    events: int = 0
    checks: int = 0
    converged: int = 0
    simulated_seconds: float = 0.0
    coordinators: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)
    progress: list[tuple[int, int, int, float]] = field(default_factory=list)  # schedules, events, checks, seconds

    def add(self, o: Outcome, elapsed: float) -> None:
        self.schedules += 1
        self.events += o.events
        self.checks += o.checks
        self.converged += o.converged
        self.simulated_seconds += o.simulated_seconds
        self.coordinators.update(o.coordinators)
        self.faults.update(o.faults)
        self.progress.append((self.schedules, self.events, self.checks, elapsed))


def run(schedules: int, first_seed: int = 1, config: Config | None = None,
        on_schedule: Callable[[Totals], None] | None = None) -> Totals:
    """Run ``schedules`` schedules from seed ``first_seed`` on; ``Violation`` on the first failure."""
    config = config or Config()
    backend_cls = transfer_module().DCRWeightTransferEngine
    objects = published()
    totals = Totals()
    t0 = time.perf_counter()
    for seed in range(first_seed, first_seed + schedules):
        totals.add(run_schedule(seed, config, objects, backend_cls), time.perf_counter() - t0)
        if on_schedule is not None:
            on_schedule(totals)
    return totals


def summary(t: Totals, seconds: float, config: Config) -> dict:
    return {"schedules": t.schedules, "events": t.events, "invariant_checks": t.checks, "converged": t.converged,
            "seconds": round(seconds, 1),
            "simulated_seconds": round(t.simulated_seconds), "coordinators": dict(t.coordinators.most_common()),
            "faults": dict(t.faults.most_common()), "config": {"coordinators": config.coordinators or "2-3",
                                                               "members": config.members or "2-3"}}


def figure(t: Totals, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [p[0] for p in t.progress]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.plot(n, [p[1] for p in t.progress], label=f"events ({t.events:,})")
    ax.plot(n, [p[2] for p in t.progress], label=f"invariant checks ({t.checks:,})")
    ax.set_xlabel(f"schedules ({t.schedules:,}), no invariant broken")
    ax.set_ylabel("cumulative count")
    ax.set_title("Fleet switch simulation: 2-3 coordinators, 2-3 members, faults at every event")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dcr_bench.fleet_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedules", type=int, default=None, help="schedules to run (default: 1 with --seed, else 10000)")
    ap.add_argument("--seed", type=int, default=None, help="the first seed (alone: replay that schedule)")
    ap.add_argument("--coordinators", type=int, choices=(2, 3), default=0, help="default: 2 or 3, drawn per schedule")
    ap.add_argument("--members", type=int, choices=(2, 3), default=0, help="default: 2 or 3, drawn per schedule")
    ap.add_argument("--out", help="write fleet-sim.json and fleet-sim.png here")
    ap.add_argument("--trace", action="store_true", help="print every event of the schedule(s)")
    args = ap.parse_args(argv)
    schedules = args.schedules if args.schedules is not None else (1 if args.seed is not None else 10_000)
    if schedules < 1:
        ap.error("--schedules: at least 1")
    logging.getLogger("dcr").setLevel(logging.CRITICAL)  # what the code under test logs about the faults
    echo = (lambda line: print(line, file=sys.stderr)) if args.trace else None
    config = Config(coordinators=args.coordinators, members=args.members, echo=echo)
    t0 = time.perf_counter()

    def progress(t: Totals) -> None:
        if t.schedules % 500 == 0 or t.schedules == schedules:
            print(f"{t.schedules} schedules, {t.events:,} events, {t.checks:,} checks, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    try:
        totals = run(schedules, args.seed if args.seed is not None else 1, config, progress)
    except Violation as e:
        print(f"fleet-sim: {e}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - t0
    out = summary(totals, seconds, config)
    print(json.dumps(out, indent=1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fleet-sim.json"), "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        figure(totals, os.path.join(args.out, "fleet-sim.png"))
    return 0
