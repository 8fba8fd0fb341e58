"""The ``dcr`` command line as users call it: exit codes, one-line errors, ls/verify output, kill -9."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from dcr_core import events
from flows.cli import COMMANDS, build_parser
from flows.cli.values import Number
from storage.catalog import Catalog
from storage.local import journal as state_journal
from storage.root import Root
from tests.support.cli import REPO, copy_tree, dcr, evolve, one_line_error, publish_chain, small_checkpoint
from tests.support.helpers import (
    assert_bits_equal,
    chunk_at,
    chunk_named,
    damage_chunk,
    stored_chunks,
    tree_snapshot,
    write_safetensors,
)
from tests.support.kill import kill_at, signal_at, sweep


@pytest.fixture(scope="module")
def _published_once(tmp_path_factory):
    d = tmp_path_factory.mktemp("published")
    return d, publish_chain(d)


@pytest.fixture
def published(_published_once, tmp_path):
    made, cks = _published_once
    return copy_tree(made, tmp_path) / "bucket", cks


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
    deep = dcr("verify", root, "--deep", "--step", 3, check=0).stdout
    assert "1 delta replayed from their restart points" in deep, deep


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
    chunk = stored_chunks(root, 2)[0]
    damage_chunk(root, 2, *chunk, at=chunk_at(root, 2, *chunk)[2] - 1)  # its last byte, in its pack
    out = dcr("verify", root)
    assert out.returncode == 5  # integrity, as every other command reports it
    assert chunk_named(root, 2, *chunk) in out.stderr, out.stderr


# kill -9 of real processes, at points they report reaching (tests/support/kill.py) -----------------

PUBLISH_POINTS = [  # (point, committed afterwards?)
    ("publish.planned", False),  # validated, nothing written
    ("chunk.stored@1", False),  # mid upload
    ("chunk.stored@7", False),
    ("publish.tensors-stored", False),  # every chunk, no manifest
    ("publish.manifest-written", False),  # the manifest, no marker
    ("publish.committed", True),  # the marker created, the baseline cache not yet written
    ("publish.baseline-patched-record@2", True),  # the baseline cache half patched in place
]


@pytest.fixture(scope="module")
def _keyframe_once(tmp_path_factory):
    d = tmp_path_factory.mktemp("keyframe")
    base = small_checkpoint(0, rows=4000)
    write_safetensors(d / "c0.safetensors", base)
    dcr("publish", d / "bucket", d / "c0.safetensors", "--step", 0, check=0, env={"DCR_CACHE_DIR": str(d / "cache")})
    new = evolve(base, 1)
    write_safetensors(d / "c1.safetensors", new)
    return d, base, new


@pytest.mark.faults(component="process", outcome="kill -9 at a reported point: nothing visible before the marker, the step whole after; a rerun ends bit-exact")
@pytest.mark.parametrize("point,committed", sweep(PUBLISH_POINTS, {"chunk.stored@7", "publish.committed"}),
                         ids=[p for p, _ in PUBLISH_POINTS])
def test_a_publish_killed_at_each_point_is_invisible_or_whole_and_a_rerun_is_exact(_keyframe_once, tmp_path, point, committed):
    made, base, new = _keyframe_once
    d = copy_tree(made, tmp_path)
    root, env = d / "bucket", {"DCR_CACHE_DIR": str(d / "cache")}
    kill_at(point, "publish", root, d / "c1.safetensors", "--step", 1, "--chunk-bytes", 512, "--io-workers", 1, env=env)
    assert (root / "steps" / "000000000001" / "commit.json").exists() == committed
    state = d / "s.safetensors"
    dcr("receive", root, "--receiver", "r", "--state", state, check=0)
    assert_bits_equal(load_file(state), new if committed else base)
    dcr("publish", root, d / "c1.safetensors", "--step", 1, check=3 if committed else 0, env=env)  # the rerun
    if committed:  # killed before its baseline cache was written (or whole): the next delta rebuilds it from ROOT
        newer = evolve(new, 2)
        write_safetensors(d / "c2.safetensors", newer)
        dcr("publish", root, d / "c2.safetensors", "--step", 2, check=0, env=env)
        new = newer
    dcr("receive", root, "--receiver", "r", "--state", state, check=0)
    assert_bits_equal(load_file(state), new)


RECEIVE_POINTS = {  # point -> the state holds the new step afterwards (in place: once settled)
    "rewrite": [("receive.planned", False), ("chunk.fetched@1", False), ("chunk.fetched@9", False),
                ("receive.tensor-staged@1", False), ("receive.staged", False), ("receive.replaced", True),
                ("receive.recorded", True)],
    "in-place": [("receive.planned", False), ("chunk.fetched@5", False), ("receive.staged", False),
                 ("receive.journal-written", False), ("receive.patch-record@1", False),
                 ("receive.patch-written", False), ("receive.blocks-written", False), ("receive.patched", True)],
}
RECEIVE_CASES = [(m, p, n) for m, pts in RECEIVE_POINTS.items() for p, n in pts]


@pytest.fixture(scope="module")
def _receiver_once(tmp_path_factory):
    d = tmp_path_factory.mktemp("receiver")
    cks = [small_checkpoint(0, rows=6000)]
    cks.append(evolve(cks[0], 1))
    for s, ck in enumerate(cks):
        p = d / f"c{s}.safetensors"
        write_safetensors(p, ck)
        dcr("publish", d / "bucket", p, "--step", s, "--chunk-bytes", 512, check=0)
    (d / "rx").mkdir()
    dcr("receive", d / "bucket", "--receiver", "r", "--state", d / "rx" / "s.safetensors", "--step", 0, check=0)
    return d, cks


def _receiver_setup(made, tmp_path):
    d, cks = made
    d = copy_tree(d, tmp_path)
    return d / "bucket", cks, d / "rx" / "s.safetensors"


@pytest.mark.faults(component="process", outcome="kill -9 at a reported point: the state file holds one whole step (in place: once settled, back before the commit, forward after it); a rerun ends bit-exact")
@pytest.mark.parametrize("mode,point,at_new", sweep(RECEIVE_CASES, {("rewrite", "receive.staged"),
                                                                    ("in-place", "receive.patch-record@1")}, key=lambda c: c[:2]),
                         ids=[f"{m}-{p}" for m, p, _ in RECEIVE_CASES])
def test_a_receive_killed_at_each_point_leaves_one_whole_step_and_a_rerun_is_exact(_receiver_once, tmp_path, mode, point, at_new):
    root, cks, state = _receiver_setup(_receiver_once, tmp_path)
    extra = ["--in-place"] if mode == "in-place" else []
    kill_at(point, "receive", root, "--receiver", "r", "--state", state, "--step", 1, "--io-workers", 1, *extra)
    if mode == "in-place":
        state_journal.settle(str(state))  # what the next receive does first
    held = load_file(state)  # never torn: a complete safetensors file of one step
    assert_bits_equal(held, cks[1] if at_new else cks[0])
    dcr("receive", root, "--receiver", "r", "--state", state, *extra, check=0)
    assert_bits_equal(load_file(state), cks[1])
    assert not [p for p in os.listdir(state.parent) if ".tmp-" in p], "a killed receiver's temp file was removed"


@pytest.mark.slow
@pytest.mark.faults(component="process", outcome="kill -9 after every chunk upload in turn: nothing visible; a rerun ends bit-exact")
def test_a_publish_killed_after_each_chunk_in_turn_full_sweep(_keyframe_once, tmp_path):
    made, base, new = _keyframe_once
    d = copy_tree(made, tmp_path)
    root, p1, state = d / "bucket", d / "c1.safetensors", d / "s.safetensors"
    for n in range(1, 25, 2):
        kill_at(f"chunk.stored@{n}", "publish", root, p1, "--step", 1, "--chunk-bytes", 512, "--io-workers", 1)
        assert not (root / "steps" / "000000000001" / "commit.json").exists()
        dcr("receive", root, "--receiver", "r", "--state", state, check=0)
        assert_bits_equal(load_file(state), base)
    dcr("publish", root, p1, "--step", 1, check=0)
    dcr("receive", root, "--receiver", "r", "--state", state, check=0)
    assert_bits_equal(load_file(state), new)


@pytest.mark.slow
@pytest.mark.faults(component="process", outcome="kill -9 after every chunk fetched and every patch record in turn: one whole step; a rerun ends bit-exact")
@pytest.mark.parametrize("mode", ["rewrite", "in-place"])
def test_a_receive_killed_after_each_chunk_and_record_in_turn_full_sweep(_receiver_once, tmp_path, mode):
    root, cks, state = _receiver_setup(_receiver_once, tmp_path)
    extra = ["--in-place"] if mode == "in-place" else []
    points = [f"chunk.fetched@{n}" for n in range(1, 40, 3)]
    points += [f"receive.patch-record@{n}" for n in (1, 2)] if mode == "in-place" else [f"receive.tensor-staged@{n}" for n in (1, 2)]
    for point in points:
        kill_at(point, "receive", root, "--receiver", "r", "--state", state, "--step", 1, "--io-workers", 1, *extra)
        if mode == "in-place":
            state_journal.settle(str(state))
        assert_bits_equal(load_file(state), cks[0])
    dcr("receive", root, "--receiver", "r", "--state", state, *extra, check=0)
    assert_bits_equal(load_file(state), cks[1])


def test_publishers_racing_for_one_step_from_separate_processes_commit_exactly_once(tmp_path):
    root = tmp_path / "bucket"
    p0 = tmp_path / "c0.safetensors"
    write_safetensors(p0, small_checkpoint(0))
    dcr("publish", root, p0, "--step", 0, check=0)
    paths = []
    for i in range(4):  # four different candidate policies for step 1
        p = tmp_path / f"cand{i}.safetensors"
        write_safetensors(p, evolve(small_checkpoint(0), i + 1))
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


@pytest.mark.faults(component="publisher", outcome="the loser exits 3 with the conflict line alone; the winner's step stands")
def test_a_publisher_whose_cache_is_patched_by_the_winner_of_its_step_prints_only_the_conflict(tmp_path, monkeypatch):
    """The race behind a loser's second stderr line, made deterministic: publisher A commits step 1
    and patches the shared baseline cache in place just as B, publishing step 1 too, starts reading
    that cache. B finds its base changed, encodes again from a checked baseline, then loses the step:
    exit 3 and the conflict line alone (the re-encoding is said only when the step commits)."""
    from flows import run_publish
    from flows.publish import baseline

    root = tmp_path / "bucket"
    write_safetensors(tmp_path / "c0.safetensors", small_checkpoint(0))
    dcr("publish", root, tmp_path / "c0.safetensors", "--step", 0, check=0)
    write_safetensors(tmp_path / "b.safetensors", evolve(small_checkpoint(0), 2))
    real, kept = baseline.share_cache, []

    def the_winner_first(src):
        monkeypatch.setattr(baseline, "share_cache", real)
        run_publish(str(root), evolve(small_checkpoint(0), 1), 1)
        real(src)

    monkeypatch.setattr(baseline, "share_cache", the_winner_first)
    with events.listening(lambda point, fields: point == "publish.baseline-kept" and kept.append(fields)):
        out = dcr("publish", root, tmp_path / "b.safetensors", "--step", 1)
    assert len(kept) == 1 and kept[0].get("patched"), "the winner patched the cache in place under the loser"
    assert out.returncode == 3 and out.stderr.count("\n") == 1, out.stderr
    assert "committed by another publisher" in out.stderr


def test_receive_follow_applies_each_newly_committed_step_and_never_an_uncommitted_one(tmp_path):
    root = tmp_path / "bucket"
    cks = [small_checkpoint(0)]
    for s in range(1, 4):
        cks.append(evolve(cks[-1], s))
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


def test_column_blocks_from_the_command_line_refit_exactly_and_bad_counts_are_refused(tmp_path):
    """``--column-blocks 4``: the 64-wide weight is stored in 4 column blocks (so tensor-parallel
    ranks pull only their slices); verify (deep), in-place receive and materialize stay exact."""
    cks = [small_checkpoint(0, rows=600)]
    cks.append(evolve(cks[0], 1))
    root = tmp_path / "bucket"
    for s, ck in enumerate(cks):
        p = tmp_path / f"c{s}.safetensors"
        write_safetensors(p, ck)
        dcr("publish", root, p, "--step", s, "--chunk-bytes", 4096, "--column-blocks", 4, check=0)
    manifest = Catalog(Root(str(root))).manifest(1)
    assert manifest.tensors["w"].chunk_shape == (75, 16) and manifest.tensors["w"].grid.is_blocked  # 150 rows a quarter
    dcr("verify", root, "--deep", check=0)
    state = tmp_path / "rx.safetensors"
    dcr("receive", root, "--receiver", "r", "--state", state, "--step", 0, check=0)
    dcr("receive", root, "--receiver", "r", "--state", state, "--in-place", check=0)
    assert_bits_equal(load_file(state), cks[1])
    dcr("materialize", root, "--step", 0, "--out", tmp_path / "m0.safetensors", check=0)
    assert_bits_equal(load_file(tmp_path / "m0.safetensors"), cks[0])
    out = dcr("publish", root, tmp_path / "c1.safetensors", "--step", 2, "--column-blocks", 0)
    assert out.returncode == 2 and "argument --column-blocks" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert Catalog(Root(str(root))).marker(2) is None


# -- usage errors, Ctrl-C and exit codes: the same for every command -------------------------------


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser: the built-in ones and those of the dcr-bench plugins."""
    from dcr_bench import bench, demo, simulate

    out = {}
    for name in COMMANDS:
        top = build_parser(name)
        out[name] = next(a for a in top._actions if a.dest == "command").choices[name]
    out.update(bench=bench.build_parser(), demo=demo.build_parser(), simulate=simulate.build_parser())
    return out


def _required(parser: argparse.ArgumentParser, but: str) -> list[str]:
    """Valid values for what ``parser`` requires (positionals, required options) other than ``but``."""
    args = []
    for a in parser._actions:
        if but in a.option_strings or not (a.required or not a.option_strings) or a.nargs in ("*", "?"):
            continue
        value = a.choices[0] if a.choices else _inside(a.type) if isinstance(a.type, Number) else "x"
        args += [*a.option_strings[:1], str(value)]
    return args


def _inside(n: Number) -> int | float:
    return n.kind(n.lo + 1) if n.lo_open else n.kind(n.lo)


def _outside(n: Number) -> list[str]:
    """Values just outside ``n``'s range (and 0 and -1 where it excludes them)."""
    below = str(n.lo) if n.lo_open else str(n.lo - 1) if n.kind is int else f"{n.lo - 0.01:g}"
    out = [below] + [x for x in ("0", "-1") if not n.admits(float(x))]
    if n.hi is not None:
        out.append(str(n.hi + 1) if n.kind is int else f"{n.hi * 2:g}")
    return out


# numeric options read by a type of their own (sizes, lists of numbers): none of these is one either
OTHER_NUMERIC = {("cache", "--max-bytes"), ("bench", "--sizes"), ("bench", "--rates"), ("bench", "--bandwidth"),
                 ("bench", "--e2e-size"), ("bench", "--e2e-rates"), ("bench", "--scaling-sizes"),
                 ("bench", "--tensor-counts"), ("bench", "--tensor-count-bytes"), ("simulate", "--bandwidth")}


def _numeric_cases() -> list[tuple[str, str, str]]:
    cases = []
    for name, parser in _parsers().items():
        for a in parser._actions:
            if isinstance(a.type, Number):
                bad = ["nan", "inf", "-inf", "x", *_outside(a.type)]
            elif (name, a.option_strings[0] if a.option_strings else "") in OTHER_NUMERIC:
                bad = ["nan", "inf", "x", "-1"]
            else:
                assert a.type in (None, str) or a.option_strings[0] in {"--sources", "--backends"}, \
                    f"dcr {name} {a.option_strings}: a numeric option must be read by a Number"
                continue
            cases += [(name, a.option_strings[0], v) for v in dict.fromkeys(bad)]
    return cases


@pytest.mark.faults(component="command line", outcome="a usage error: one line naming the command and the option, exit 2")
@pytest.mark.parametrize(("command", "option", "value"), _numeric_cases())
def test_every_numeric_option_refuses_a_bad_value_in_one_line_and_exit_2(command, option, value):
    """NaN, infinities, words and values outside an option's range (a zero or negative interval,
    count, timeout or size) are usage errors before anything runs: never a traceback (exit 1), a
    busy loop or a value accepted."""
    parser = _parsers()[command]
    out = dcr(command, *_required(parser, option), f"{option}={value}")
    line = one_line_error(out, 2, f"dcr {command}: error: argument {option}", f"(dcr {command} --help)")
    assert "usage:" not in line and out.stdout == ""


@pytest.mark.faults(component="command line", outcome="a usage error: one line naming the command, exit 2")
@pytest.mark.parametrize("argv", [["frobnicate"], [], ["ls"], ["receive", "r", "--receiver", "a", "--state", "s", "--frob"],
                                  ["cache", "dust"], ["publish", "r", "c", "--step", "1", "--codec", "zip"]])
def test_a_usage_error_is_one_line_naming_the_command_and_its_help(argv):
    """The parser's own errors (an unknown command, a missing argument, an unknown option, a bad
    choice) are one line, as the README promises, not argparse's usage block."""
    command = "dcr" if not argv or argv[0] not in COMMANDS else f"dcr {argv[0]}"
    one_line_error(dcr(*argv), 2, f"{command}: error: ", f"({command} --help)")


@pytest.mark.faults(component="command line", outcome="Ctrl-C: one line, exit 130")
def test_ctrl_c_while_a_command_still_imports_its_modules_is_one_line_and_exit_130(tmp_path):
    """SIGINT when ``dcr receive`` reports it is about to import its modules (torch among them, the
    first second of a start): ``dcr: interrupted`` and exit 130, no traceback."""
    rc, _, after = signal_at("cli.importing", signal.SIGINT, "receive", tmp_path / "bucket", "--receiver", "r",
                             "--state", tmp_path / "s.safetensors")
    assert rc == 130 and after == "dcr: interrupted\n", (rc, after)


def _exit_cases() -> list[tuple[str, list[str], int, str]]:
    """(condition, a command line with {root} and {tmp}, its exit code, a part of its line)."""
    missing = [["ls", "{root}"], ["show", "{root}", "--step", "0"], ["status", "{root}"], ["verify", "{root}"],
               ["verify", "{root}", "--step", "0"], ["receive", "{root}", "--receiver", "r", "--state", "{tmp}/s"],
               ["materialize", "{root}", "--step", "0", "--out", "{tmp}/m"], ["mirror", "{root}", "{tmp}/d"],
               ["gc", "{root}", "--keep-last", "1"], ["heartbeat", "{root}"], ["retract", "{root}", "--step", "0"],
               ["report", "{root}", "--out", "{tmp}/rep"], ["fleet", "{root}", "--engine", "state:{tmp}/f"]]
    absent = [["show", "{root}", "--step", "9"], ["verify", "{root}", "--step", "9"],
              ["receive", "{root}", "--receiver", "r", "--state", "{tmp}/s", "--step", "9"],
              ["materialize", "{root}", "--step", "9", "--out", "{tmp}/m"], ["mirror", "{root}", "{tmp}/d", "--step", "9"],
              ["retract", "{root}", "--step", "9"], ["fleet", "{root}", "--engine", "state:{tmp}/f", "--step", "9"]]
    return ([("a missing ROOT", argv, 2, "no such directory") for argv in missing]
            + [("a step that is not committed", argv, 4, "step 9 is not committed") for argv in absent])


@pytest.mark.faults(component="command line", outcome="the same exit code for the same condition in every command")
@pytest.mark.parametrize(("condition", "argv", "code", "says"), _exit_cases(),
                         ids=[f"{c[0]}: {' '.join(c[1][:1] + c[1][2:3])}" for c in _exit_cases()])
def test_every_command_exits_with_the_same_code_for_the_same_condition(published, tmp_path, condition, argv, code, says):
    """One error class per condition, one exit code each (docs/reference/commands.md): a missing
    ROOT is 2 (RootNotFoundError) and a step that is not committed is 4 (StepNotFoundError) whichever
    command meets it; nothing is written."""
    root, _ = published
    root = tmp_path / "no-such-root" if code == 2 else root
    before = tree_snapshot(tmp_path)
    one_line_error(dcr(*(a.format(root=root, tmp=tmp_path) for a in argv)), code, says)
    assert tree_snapshot(tmp_path) == before


def test_the_exit_code_table_of_the_docs_is_the_code_of_each_error_class():
    """docs/reference/commands.md lists each exit code with its error classes: each is that class's code."""
    from dcr_core import errors
    from flows.receive.fleet import FleetSwitchError

    classes = {c.__name__: c for c in vars(errors).values() if isinstance(c, type)} | {"FleetSwitchError": FleetSwitchError}
    with open(os.path.join(REPO, "docs", "reference", "commands.md")) as f:
        rows = [line.split("|") for line in f if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    named = {name.strip("` "): int(row[1]) for row in rows for name in row[3].split(",") if name.strip()}
    assert {n for n, c in classes.items() if issubclass(c, errors.DCRError)} <= set(named) | {
        "StepVanishedError", "StateMismatchError", "UntrustedError", "UnsafeKeyError"}  # subclasses: their parent's code
    assert all(classes[name].exit_code == code for name, code in named.items()), named
