"""The publisher side of the gc race (``tests/system/test_gc_race.py``), as a real process:

``python -m tests.support.race ROOT STEPS REPORT_JSON [KEYFRAME_EVERY]`` publishes steps 0..STEPS-1 of
``checkpoint(step)``, a requested keyframe every KEYFRAME_EVERY steps and deltas between, and after
every publish runs ``dcr gc ROOT --keep-last 1 --grace-seconds 0`` as its own process. It writes
its counts (publishes, gcs, steps deleted, gc failures with their stderr) to REPORT_JSON.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import torch

from tests.support.cli import REPO, evolve, small_checkpoint


def checkpoint(step: int) -> dict[str, torch.Tensor]:
    """The checkpoint of ``step`` (deterministic: the test rebuilds it to compare bits)."""
    ck = small_checkpoint(0, rows=256)
    for s in range(1, step + 1):
        ck = evolve(ck, s)
    return ck


def main() -> int:
    from flows import run_publish
    from flows.options import PublishOptions

    root, steps, report_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    every = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    opts = PublishOptions(chunk_bytes=2048, cache_dir=os.path.join(os.path.dirname(report_path), "publisher-cache"))
    env = {**os.environ, "DCR_ORCHESTRATOR": "none"}
    rng = random.Random(steps)
    report = {"publishes": 0, "keyframes": 0, "gcs": 0, "steps_deleted": 0, "gc_failures": []}
    ck = small_checkpoint(0, rows=256)
    for s in range(steps):
        if s:
            ck = evolve(ck, s)
        keyframe = s > 0 and s % every == 0
        run_publish(root, ck, s, keyframe=keyframe, options=opts)
        report["publishes"] += 1
        report["keyframes"] += keyframe
        gc = subprocess.run([sys.executable, "-m", "flows.cli", "gc", root, "--keep-last", "1", "--grace-seconds", "0",
                             "--json"], cwd=REPO, env=env, capture_output=True, text=True)
        report["gcs"] += 1
        if gc.returncode != 0:
            report["gc_failures"].append(gc.stderr.strip())
        else:
            report["steps_deleted"] += len(json.loads(gc.stdout)["deleted_steps"])
        time.sleep(rng.uniform(0.0, 0.3))
    with open(report_path, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
