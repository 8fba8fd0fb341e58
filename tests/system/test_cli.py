"""The ``dcr`` command line as users call it: exit codes, one-line errors, ls/verify output, kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from storage.local import journal as state_journal
from tests.support.helpers import write_safetensors
from tests.support.helpers import assert_bits_equal

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def spawn_dcr(*args) -> subprocess.Popen:
    """A ``dcr`` process in the background (output discarded), for kill -9 tests."""
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", *map(str, args)],
        cwd=REPO, env={**os.environ, "DCR_ORCHESTRATOR": "none"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def dcr(*args, env=None, check=None):
    e = {**os.environ, "DCR_ORCHESTRATOR": "none", **(env or {})}
    out = subprocess.run([sys.executable, "-m", "flows.cli", *map(str, args)], capture_output=True, text=True, cwd=REPO, env=e)
    if check is not None:
        assert out.returncode == check, (out.returncode, out.stdout, out.stderr)
    return out


def _ck(seed: int, rows: int = 300) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(rows, 64, generator=g).bfloat16(),
        "b": torch.randn(7, generator=g),
        "step": torch.tensor(seed, dtype=torch.int64),
    }


def _evolve(ck, seed):
    out = {n: t.clone() for n, t in ck.items()}
    out["w"].view(-1).view(torch.int16)[seed::97] ^= 1
    out["step"] += 1
    return out


@pytest.fixture
def published(tmp_path):
    root = tmp_path / "bucket"
    cks = [_ck(0)]
    for s in range(1, 4):
        cks.append(_evolve(cks[-1], s))
    for s, ck in enumerate(cks):
        p = tmp_path / f"c{s}.safetensors"
        write_safetensors(p, ck)
        dcr("publish", root, p, "--step", s, "--chunk-bytes", 4096, check=0)
    return root, cks


def test_publish_receive_materialize_ls_and_verify_from_the_command_line(published, tmp_path):
    root, cks = published
    state = tmp_path / "state.safetensors"
    out = dcr("receive", root, "--receiver", "rollout-a", "--state", state, check=0)
    assert "step 3" in out.stdout
    assert_bits_equal(load_file(state), cks[3])
    dcr("receive", root, "--receiver", "rollout-a", "--state", state, "--step", 1, check=0)
    assert_bits_equal(load_file(state), cks[1])
    m = tmp_path / "m.safetensors"
    dcr("materialize", root, "--step", 2, "--out", m, check=0)
    assert_bits_equal(load_file(m), cks[2])

    ls = dcr("ls", root, check=0).stdout.splitlines()
    assert ls[0].split()[:4] == ["STEP", "KIND", "BASE", "COMMITTED"]
    rows = [line.split() for line in ls[1:]]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert rows[0][1] == "keyframe" and all(r[1] == "delta" for r in rows[1:])
    assert rows[1][2] == "0" and rows[3][2] == "2"
    assert "rollout-a" in ls[2] and "rollout-a" in ls[4]  # committed steps 1 and 3
    out = dcr("verify", root, check=0)
    assert out.stdout.startswith("verify ok: 4 steps")
    dcr("verify", root, "--deep", "--step", 3, check=0)


def test_errors_are_one_line_with_distinct_exit_codes(published, tmp_path):
    root, cks = published
    p = tmp_path / "c3.safetensors"
    out = dcr("publish", root, p, "--step", 3)
    assert out.returncode == 3 and len(out.stderr.strip().splitlines()) == 1
    assert "already committed" in out.stderr
    (root / "steps" / "000000000002" / "commit.json").unlink()  # a gap below the latest step
    out = dcr("publish", root, p, "--step", 2)
    assert out.returncode == 3 and "not after the latest committed step 3" in out.stderr
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 3)
    out = dcr("publish", root, tmp_path / "junk.safetensors", "--step", 9)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    out = dcr("receive", root, "--receiver", "../evil", "--state", tmp_path / "s.safetensors")
    assert out.returncode == 2 and "receiver id" in out.stderr
    out = dcr("receive", root, "--receiver", "r", "--state", tmp_path / "s.safetensors", "--step", 99)
    assert out.returncode == 4 and "not committed" in out.stderr
    assert not (tmp_path / "s.safetensors").exists()


def test_a_verify_of_a_corrupted_chunk_names_the_object_and_fails(published):
    root, _ = published
    chunk = next(p for p in (root / "steps").rglob("c/*/*") if "000000000002" in str(p))
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 0xFF
    chunk.write_bytes(bytes(data))
    out = dcr("verify", root)
    assert out.returncode == 1
    assert str(chunk.relative_to(root)) in out.stderr


@pytest.mark.faults(component="process", outcome="kill -9: nothing visible, or the step committed whole; a rerun ends bit-exact")
def test_a_publish_killed_at_random_points_is_invisible_and_a_retry_commits(tmp_path):
    root = tmp_path / "bucket"
    base = _ck(0, rows=4000)
    p0 = tmp_path / "c0.safetensors"
    write_safetensors(p0, base)
    dcr("publish", root, p0, "--step", 0, check=0)
    new = _evolve(base, 1)
    p1 = tmp_path / "c1.safetensors"
    write_safetensors(p1, new)
    for delay in (0.3, 0.6, 0.9, 1.2):
        proc = spawn_dcr("publish", root, p1, "--step", 1, "--chunk-bytes", 512, "--io-workers", 1)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        committed = (root / "steps" / "000000000001" / "commit.json").exists()
        out = dcr("receive", root, "--receiver", "r", "--state", tmp_path / "s.safetensors", check=0)
        expect = new if committed else base
        assert_bits_equal(load_file(tmp_path / "s.safetensors"), expect)
        if committed:
            break
    if not (root / "steps" / "000000000001" / "commit.json").exists():
        dcr("publish", root, p1, "--step", 1, check=0)
    dcr("receive", root, "--receiver", "r", "--state", tmp_path / "s.safetensors", check=0)
    assert_bits_equal(load_file(tmp_path / "s.safetensors"), new)
    assert out.returncode == 0


def _kill_receive_sweep(tmp_path, delays, in_place=False):
    """``dcr receive`` killed (SIGKILL) after each delay: the state file is always exactly one step
    (in place: once the next receive's first act, rolling back a cut-off patch, has run). The delays
    span process start-up, planning, fetching and writing; the in-place commit window itself lasts
    milliseconds and is crashed at each of its points deterministically in tests/integration/test_in_place.py."""
    extra = ["--in-place"] if in_place else []
    root = tmp_path / "bucket"
    cks = [_ck(0, rows=6000)]
    cks.append(_evolve(cks[0], 1))
    for s, ck in enumerate(cks):
        p = tmp_path / f"c{s}.safetensors"
        write_safetensors(p, ck)
        dcr("publish", root, p, "--step", s, "--chunk-bytes", 512, check=0)
    state = tmp_path / "rx" / "s.safetensors"
    dcr("receive", root, "--receiver", "r", "--state", state, "--step", 0, check=0)
    outcomes = []
    for delay in delays:
        proc = spawn_dcr("receive", root, "--receiver", "r", "--state", state, "--step", 1, "--io-workers", 1, *extra)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if in_place:
            state_journal.roll_back(str(state))  # what the next receive does first
        held = load_file(state)  # never torn: a complete safetensors file of one step
        at_new = bool(torch.equal(held["step"], cks[1]["step"]))
        assert_bits_equal(held, cks[1] if at_new else cks[0])
        outcomes.append(at_new)
        if at_new:  # back to step 0 for the next kill (an XOR delta undone)
            dcr("receive", root, "--receiver", "r", "--state", state, "--step", 0, *extra, check=0)
    dcr("receive", root, "--receiver", "r", "--state", state, *extra, check=0)
    assert_bits_equal(load_file(state), cks[1])
    assert not [p for p in os.listdir(state.parent) if ".tmp-" in p], "a killed receiver's temp file was removed"
    return outcomes


@pytest.mark.faults(component="process", outcome="kill -9: the state file holds the old or the new step exactly; a rerun ends bit-exact")
def test_a_receive_killed_at_several_points_leaves_one_whole_step_and_a_rerun_is_exact(tmp_path):
    _kill_receive_sweep(tmp_path, [0.5, 1.0, 1.5, 2.0, 3.0])


@pytest.mark.faults(component="process", outcome="kill -9 of an in-place receive: after its roll back the state file holds one step exactly; a rerun ends bit-exact")
def test_an_in_place_receive_killed_at_several_points_rolls_back_to_one_whole_step(tmp_path):
    _kill_receive_sweep(tmp_path, [0.5, 1.0, 1.5, 2.0, 3.0], in_place=True)


@pytest.mark.slow
@pytest.mark.faults(component="process", outcome="kill -9: the state file holds the old or the new step exactly; a rerun ends bit-exact")
def test_a_receive_killed_at_random_points_full_sweep(tmp_path):
    import random

    rng = random.Random(7)
    _kill_receive_sweep(tmp_path, sorted(rng.uniform(0.2, 3.5) for _ in range(24)))


@pytest.mark.slow
@pytest.mark.faults(component="process", outcome="kill -9: nothing visible, or the step committed whole; a rerun ends bit-exact")
def test_a_publish_killed_at_random_points_full_sweep(tmp_path):
    import random

    rng = random.Random(11)
    root = tmp_path / "bucket"
    base = _ck(0, rows=4000)
    p0 = tmp_path / "c0.safetensors"
    write_safetensors(p0, base)
    dcr("publish", root, p0, "--step", 0, check=0)
    for i, delay in enumerate(sorted(rng.uniform(0.2, 3.0) for _ in range(16)), start=1):
        new = _evolve(base, i)
        p = tmp_path / f"c{i}.safetensors"
        write_safetensors(p, new)
        proc = spawn_dcr("publish", root, p, "--step", i, "--chunk-bytes", 512, "--io-workers", 1)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if not (root / "steps" / f"{i:012d}" / "commit.json").exists():
            dcr("publish", root, p, "--step", i, check=0)  # the restart
        state = tmp_path / "s.safetensors"
        dcr("receive", root, "--receiver", "r", "--state", state, check=0)
        assert_bits_equal(load_file(state), new)
        base = new


def test_publishers_racing_for_one_step_from_separate_processes_commit_exactly_once(tmp_path):
    root = tmp_path / "bucket"
    p0 = tmp_path / "c0.safetensors"
    write_safetensors(p0, _ck(0))
    dcr("publish", root, p0, "--step", 0, check=0)
    paths = []
    for i in range(4):  # four different candidate policies for step 1
        p = tmp_path / f"cand{i}.safetensors"
        write_safetensors(p, _evolve(_ck(0), i + 1))
        paths.append(p)
    env = {**os.environ, "DCR_ORCHESTRATOR": "none"}
    procs = [
        subprocess.Popen([sys.executable, "-m", "flows.cli", "publish", str(root), str(p), "--step", "1"],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for p in paths
    ]
    results = [(proc.wait(), proc.stderr.read()) for proc in procs]
    winners = [i for i, (rc, _) in enumerate(results) if rc == 0]
    assert len(winners) == 1, results
    for i, (rc, err) in enumerate(results):
        if i != winners[0]:
            assert rc == 3 and len(err.strip().splitlines()) == 1, (rc, err)
    state = tmp_path / "s.safetensors"
    dcr("receive", root, "--receiver", "r", "--state", state, check=0)
    assert_bits_equal(load_file(state), load_file(paths[winners[0]]))
    attempts = list((root / "steps" / "000000000001" / "attempts").iterdir())
    commit = (root / "steps" / "000000000001" / "commit.json").read_text()
    assert any(a.name in commit for a in attempts)


def test_receive_follow_applies_each_newly_committed_step_and_never_an_uncommitted_one(tmp_path):
    root = tmp_path / "bucket"
    cks = [_ck(0)]
    for s in range(1, 4):
        cks.append(_evolve(cks[-1], s))
    paths = []
    for s, ck in enumerate(cks):
        p = tmp_path / f"c{s}.safetensors"
        write_safetensors(p, ck)
        paths.append(p)
    dcr("publish", root, paths[0], "--step", 0, check=0)
    state = tmp_path / "follower.safetensors"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "receive", str(root), "--receiver", "f", "--state", str(state),
         "--follow", "--interval", "0.2", "--until-step", "3"],
        cwd=REPO, env={**os.environ, "DCR_ORCHESTRATOR": "none"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    # an attempt that never commits: written, but no marker
    (root / "steps" / "000000000002" / "attempts" / ("ab" * 16)).mkdir(parents=True)
    held_wanted = 0
    for s in (1, 3):  # wait until the follower holds the last published step, then publish the next
        deadline = time.time() + 60
        while time.time() < deadline:
            if state.exists():
                meta = __import__("safetensors").safe_open(str(state), "pt").metadata()
                if int(meta["dcr.step"]) == held_wanted:
                    break
            time.sleep(0.1)
        dcr("publish", root, paths[s], "--step", s, check=0)
        held_wanted = s
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    steps_applied = [int(line.split("at step ")[1].split()[0]) for line in out.splitlines() if "at step" in line]
    assert steps_applied[-1] == 3 and 2 not in steps_applied, out
    assert_bits_equal(load_file(state), cks[3])
