"""``dcr gc`` after every publish, racing ``dcr receive --follow`` processes that are killed and
restarted at random points: no receiver is ever stranded.

Real processes throughout: a publisher (``tests.support.race``) committing deltas and keyframes and
running ``dcr gc --keep-last 1`` after every step; followers (rewrite and ``--in-place``) that die
by ``kill -9`` semantics (the ``exit`` failpoint: ``os._exit(137)`` at a point the process reports
reaching, chosen at random) and are restarted at once. A stranding is a follower that exits for
any other reason, or does not reach the last step. The default run is short; ``make race`` runs
the long one (``DCR_RACE_STEPS``, ``DCR_RACE_FOLLOWERS``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from tests.support.cli import REPO
from tests.support.helpers import assert_bits_equal
from tests.support.race import checkpoint

COMMON_POINTS = ("receive.planned", "receive.leased", "chunk.fetched", "receive.staged", "receive.recorded")
KILL_POINTS = {  # the points each kind of follower reaches on every refit
    False: COMMON_POINTS + ("receive.tensor-staged", "receive.replaced"),
    True: COMMON_POINTS + ("receive.journal-written", "receive.patch-record", "receive.patch-written", "receive.patched"),
}


class Follower:
    """One ``dcr receive --follow`` process, restarted after every kill until it reaches ``last``."""

    def __init__(self, root: str, state: str, rid: str, last: int, in_place: bool, rng: random.Random, log_dir: str):
        self.root, self.state, self.rid, self.last, self.in_place, self.rng = root, state, rid, last, in_place, rng
        self.log_dir = log_dir
        self.kills = self.refits = self.retries = self.runs = self.replans = self.restarts = 0
        self.strandings: list[str] = []
        self.proc: subprocess.Popen | None = None
        self.failpoint = ""
        self.start()

    def start(self) -> None:
        self.runs += 1
        # most runs die at a random point the process reports reaching; some run to the end. Every
        # refit dawdles a random while between staging and installing: the window in which gc,
        # started right after a newer publish, may delete the step being installed
        point = self.rng.choice(KILL_POINTS[self.in_place])
        self.failpoint = "" if self.rng.random() < 0.05 else f"{point}@{self.rng.randint(1, 6)}"
        spec = f"receive.staged@*=sleep({self.rng.uniform(0.0, 0.8):.2f})" + (f",{self.failpoint}=exit" if self.failpoint else "")
        env = {**os.environ, "DCR_ORCHESTRATOR": "none", "DCR_FAILPOINTS": spec}
        self.out = open(os.path.join(self.log_dir, f"{self.rid}.{self.runs}.out"), "w+")
        self.err = open(os.path.join(self.log_dir, f"{self.rid}.{self.runs}.err"), "w+")
        args = ["receive", self.root, "--receiver", self.rid, "--state", self.state, "--follow", "--interval", "0.05",
                "--until-step", str(self.last), "--json", "--io-workers", "2"] + (["--in-place"] if self.in_place else [])
        self.proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=REPO, env=env,
                                     stdout=self.out, stderr=self.err, text=True)

    def poll(self) -> bool:
        """Handle an exit (restart after a kill); True once done for good."""
        if self.proc is None:
            return True
        code = self.proc.poll()
        if code is None:
            return False
        self.out.seek(0)
        self.err.seek(0)
        out, err = self.out.read(), self.err.read()
        self.out.close()
        self.err.close()
        self.refits += out.count('"step"')
        self.retries += err.count("retrying in")
        self.replans += err.count("planning again")
        self.restarts += err.count("restarting from a restart point")
        if code == 137 and self.failpoint and f"failpoint {self.failpoint} reached" in err:
            self.kills += 1
            self.start()
            return False
        self.proc = None
        if code != 0:
            self.strandings.append(f"{self.rid} run {self.runs} (failpoint {self.failpoint or '-'}) exited {code}: "
                                   f"{err.strip().splitlines()[-1] if err.strip() else ''}")
        return True

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def race(tmp_path, steps: int, followers: int, timeout: float) -> dict:
    root = str(tmp_path / "bucket")
    logs = tmp_path / "logs"
    logs.mkdir()
    report_path = str(tmp_path / "publisher.json")
    publisher = subprocess.Popen([sys.executable, "-m", "tests.support.race", root, str(steps), report_path, "3"],
                                 cwd=REPO, env={**os.environ, "DCR_ORCHESTRATOR": "none"},
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not os.path.exists(os.path.join(root, "steps")) and time.time() < deadline and publisher.poll() is None:
        time.sleep(0.05)
    rng = random.Random(steps * 1000 + followers)
    fs = [Follower(root, str(tmp_path / f"f{i}.safetensors"), f"f{i}", steps - 1, in_place=i % 2 == 1,
                   rng=random.Random(rng.random()), log_dir=str(logs)) for i in range(followers)]
    try:
        deadline = time.time() + timeout
        while time.time() < deadline and not all([f.poll() for f in fs]):
            time.sleep(0.02)
        _, perr = publisher.communicate(timeout=max(1.0, deadline - time.time()))
    finally:
        for f in fs:
            f.stop()
        if publisher.poll() is None:
            publisher.kill()
    assert publisher.returncode == 0, perr
    pub = json.loads(open(report_path).read())
    last = checkpoint(steps - 1)
    strandings = [s for f in fs for s in f.strandings]
    for f in fs:
        if f.proc is None and not f.strandings:
            assert_bits_equal(load_file(f.state), last)
        elif f.proc is not None:
            strandings.append(f"{f.rid} did not reach step {steps - 1} in {timeout:.0f} s")
    report = {
        "publishes": pub["publishes"], "keyframes": pub["keyframes"], "gcs": pub["gcs"],
        "steps_deleted_by_gc": pub["steps_deleted"], "gc_failures": len(pub["gc_failures"]),
        "followers": followers, "refits": sum(f.refits for f in fs), "kills": sum(f.kills for f in fs),
        "replans": sum(f.replans for f in fs), "restarts_after_gc": sum(f.restarts for f in fs),
        "follower_retries": sum(f.retries for f in fs), "strandings": len(strandings),
    }
    print("race report:", json.dumps(report))
    (tmp_path / "race-report.json").write_text(json.dumps(report, indent=1))
    assert not pub["gc_failures"], pub["gc_failures"]
    assert not strandings, strandings
    # leases, planning again and restarts absorb every race: no error ever reaches the follow loop
    assert report["follower_retries"] == 0, report
    return report


@pytest.mark.slow  # about 16 s: the slow suite (make test-slow)
@pytest.mark.faults(component="gc + receivers", outcome="no receiver stranded; all end bit-exact at the last step")
def test_gc_after_every_publish_never_strands_killed_and_restarted_followers(tmp_path):
    steps = int(os.environ.get("DCR_RACE_STEPS", "20"))
    followers = int(os.environ.get("DCR_RACE_FOLLOWERS", "3"))
    report = race(tmp_path, steps, followers, timeout=120 + 3 * steps)
    assert report["steps_deleted_by_gc"] > 0 and report["kills"] > 0
