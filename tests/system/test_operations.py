"""``dcr`` as an operator meets it: cloud stores that are down or misconfigured, a state file from
another ROOT, what ``verify``, ``gc --dry-run`` and ``ls`` say, a publish that changes nothing.
Each case runs the real command line (``main(argv)`` as a fresh process runs it: tests/support/cli.py)
and checks the one line it prints."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

import pytest

from flows import run_publish
from flows.results import PublishResult
from storage import layout
from tests.support.cli import copy_tree, dcr, one_line_error, publish_chain
from tests.support.helpers import chunk_at, chunk_named, damage_chunk, stored_chunks, write_safetensors
from tests.support.servers import free_port


@pytest.fixture(scope="module")
def _made(tmp_path_factory):
    d = tmp_path_factory.mktemp("ops")
    publish_chain(d, steps=3)
    return d


@pytest.fixture
def made(_made, tmp_path):
    return copy_tree(_made, tmp_path)


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_an_endpoint_that_is_down_fails_within_seconds_naming_it_and_the_setting(scheme, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    var = "AWS_ENDPOINT_URL" if scheme == "s3" else "STORAGE_EMULATOR_HOST"
    env = {var: url, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    for args in (("ls", f"{scheme}://bucket/run"),
                 ("receive", f"{scheme}://bucket/run", "--receiver", "r", "--state", tmp_path / "s.safetensors")):
        t0 = time.monotonic()
        out = dcr(*args, env=env)
        took = time.monotonic() - t0
        one_line_error(out, 1, f"{scheme}://bucket/run: cannot reach {url} ({var})", "is the server running?")
        assert took < 10, f"{args[0]} took {took:.1f} s to fail"  # the clients' own retry loops: 30-50 s
    assert not (tmp_path / "s.safetensors").exists()


@pytest.mark.backend
def test_s3_without_credentials_or_bucket_says_what_to_set(s3_server, tmp_path):
    ck = tmp_path / "c.safetensors"
    write_safetensors(ck, {"w": __import__("torch").ones(3)})
    missing = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    for args in (("ls", missing), ("publish", missing, ck, "--step", 0)):
        one_line_error(dcr(*args), 2, f"{missing}: bucket '{missing[5:].split('/')[0]}' does not exist at {s3_server} "
                  "(AWS_ENDPOINT_URL)")
    env = {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
           "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_EC2_METADATA_DISABLED": "true"}
    out = dcr("ls", "s3://dcr-test/run", env=env)
    one_line_error(out, 2, "s3://dcr-test/run: no AWS credentials found; set AWS_ACCESS_KEY_ID")


@pytest.mark.backend
def test_gcs_bucket_that_does_not_exist_is_named(gcs_server, made):
    missing = f"gs://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    one_line_error(dcr("ls", missing), 2, f"bucket '{missing[5:].split('/')[0]}' does not exist at {gcs_server}")
    # a path that reads like an error is only a path: a new ROOT there is empty, then published to
    odd = f"gs://dcr-test/forbidden-{uuid.uuid4().hex[:6]}/the bucket does not exist"
    assert dcr("ls", odd, "--allow-empty", check=0).stdout.startswith("    STEP")
    one_line_error(dcr("ls", odd), 2, f"{odd}: nothing was ever published here")
    dcr("publish", odd, made / "c0.safetensors", "--step", 0, check=0)
    assert dcr("ls", odd, check=0).stdout.splitlines()[1].split()[0] == "0"


def test_a_state_file_of_another_root_is_refused_naming_both(made, tmp_path):
    state = tmp_path / "s.safetensors"
    dcr("receive", made / "bucket", "--receiver", "r", "--state", state, check=0)
    before = state.read_bytes()
    other = tmp_path / "other"
    dcr("publish", other, made / "c1.safetensors", "--step", 0, check=0)  # other weights at step 0 only
    out = dcr("receive", other, "--receiver", "r", "--state", state)
    one_line_error(out, 5, f"{state}: holds step 2 of {made / 'bucket'}, not of {other}, which has no committed step 2")
    assert state.read_bytes() == before
    dcr("publish", other, made / "c2.safetensors", "--step", 2, "--keyframe", check=0)  # the same weights: a mirror
    assert "already there" in dcr("receive", other, "--receiver", "r", "--state", state, check=0).stdout
    third = tmp_path / "third"
    dcr("publish", third, made / "c0.safetensors", "--step", 2, check=0)  # step 2, other weights
    one_line_error(dcr("receive", third, "--receiver", "r", "--state", state), 5,
              f"not of {third}, whose step 2 holds other weights")


def test_verify_deep_says_what_it_replayed_and_integrity_errors_exit_5(made):
    root = made / "bucket"
    plain = dcr("verify", root, check=0).stdout
    deep = dcr("verify", root, "--deep", check=0).stdout
    assert "replayed" not in plain and "2 deltas replayed from their restart points" in deep, (plain, deep)
    chunk = stored_chunks(root, 1)[0]
    damage_chunk(root, 1, *chunk, at=chunk_at(root, 1, *chunk)[2] - 1)  # its last byte, in its pack
    out = dcr("verify", root)
    assert out.returncode == 5 and chunk_named(root, 1, *chunk) in out.stderr, out.stderr


def test_gc_dry_run_needs_no_keep_last_and_a_real_gc_does(made):
    root = made / "bucket"
    out = dcr("gc", root, "--dry-run", check=0).stdout
    assert out.startswith("gc (dry run): would delete 0 steps") and "kept 3 steps" in out, out
    one_line_error(dcr("gc", root), 2, "needs --keep-last K")


def test_ls_keeps_its_columns_with_uncommitted_steps(made):
    root = made / "bucket"
    for step, attempts in ((5, 1), (6, 12)):
        for i in range(attempts):
            (root / layout.attempts_dir(step) / f"{i:032x}").mkdir(parents=True)
    lines = dcr("ls", root, check=0).stdout.splitlines()
    end = lines[0].index("CHANGED") + len("CHANGED")  # right-aligned columns end where their header does
    for line in lines[1:]:
        assert line[end - 1] != " " and line[end] == " ", (lines[0], line)
    assert "no (12 attempts)" in lines[-1] and "no (1 attempt)" in lines[-2]


def test_publishing_an_identical_checkpoint_says_so(made):
    root = made / "bucket"
    out = dcr("publish", root, made / "c2.safetensors", "--step", 3, check=0)
    assert "0/3 tensors changed" in out.stdout
    assert out.stderr.strip() == ("dcr: publish: note: the checkpoint is bit-identical to step 2; step 3 changes "
                                  "nothing (receivers move to it without pulling a chunk)")
    assert dcr("publish", root, made / "c2.safetensors", "--step", 4, "-q", check=0).stderr == ""


def test_publish_results_read_the_same_from_the_flow_and_from_python(made):
    res = run_publish(str(made / "bucket"), str(made / "c0.safetensors"), 9)
    assert isinstance(res, PublishResult)
    assert res["step"] == res.step == 9 and res.get("kind") == "delta" and "summary" in dict(res)


def test_every_argument_has_help():
    from flows.cli import COMMANDS, build_parser

    for command in COMMANDS:
        parser = build_parser(command)
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]
        for action in sub._actions:
            assert action.help, f"dcr {command}: {action.dest} has no help text"


def test_receiver_positions_history_and_idle_polls_that_write_nothing(made, tmp_path):
    from tests.support.helpers import tree_snapshot

    root = made / "bucket"
    r0, r1 = tmp_path / "r0.safetensors", tmp_path / "r1.safetensors"
    dcr("receive", root, "--receiver", "r0", "--state", r0, "--step", 0, check=0)
    dcr("receive", root, "--receiver", "r0", "--state", r0, "--step", 2, check=0)
    dcr("receive", root, "--receiver", "r1", "--state", r1, "--step", 1, check=0)
    before = tree_snapshot(root)
    for _ in range(2):  # idle polls: nothing to do, nothing written (no record, no lease)
        assert "already there" in dcr("receive", root, "--receiver", "r0", "--state", r0, check=0).stdout
    assert tree_snapshot(root) == before

    rows = {line.split()[0]: line for line in dcr("ls", root, check=0).stdout.splitlines()[1:]}
    assert rows["0"].endswith("(moved on: r0)") and rows["1"].endswith("  r1") and rows["2"].endswith("  r0"), rows
    status = dcr("status", root, check=0).stdout.splitlines()
    assert status[0] == "latest committed step: 2"
    lines = {line.split()[0]: line for line in status[2:]}
    assert lines["r0"].split()[1:4] == ["2", "0", "0"] and lines["r0"].endswith("forward:1, forward:2"), lines
    assert lines["r1"].split()[1:3] == ["1", "1"], lines  # one committed step behind
    recs = json.loads(dcr("status", root, "--receiver", "r0", "--json", check=0).stdout)
    assert [(r["from_step"], r["step"]) for r in recs] == [(None, 0), (0, 2)]
    assert recs[1]["moves"] == ["forward:1", "forward:2"] and recs[1]["bytes_pulled"] > 0

    dcr("publish", root, made / "c0.safetensors", "--step", 3, check=0)  # a rollback publish: lag 1 now
    lag = {line.split()[0]: line.split()[2] for line in dcr("status", root, check=0).stdout.splitlines()[2:]}
    assert lag == {"r0": "1", "r1": "2"}


def test_show_lists_every_tensor_of_a_step(made):
    root = made / "bucket"
    out = dcr("show", root, "--step", 1, "--digests", check=0).stdout
    assert out.startswith("step 1: delta against step 0")
    table = out.split("\n\n")[1].splitlines()
    assert table[0].split()[:4] == ["TENSOR", "DTYPE", "SHAPE", "ENCODING"] and table[0].endswith("DIGEST")
    names = {line.split()[0] for line in table[1:]}
    assert names == {"w", "b", "step"}
    view = json.loads(dcr("show", root, "--step", 1, "--json", check=0).stdout)
    manifest = json.loads(next((root / layout.attempts_dir(1)).rglob("manifest.json")).read_text())
    for t in view["tensors"]:
        m = manifest["tensors"][t["name"]]
        assert (t["digest"], t["encoding"], t["changed"]) == (m["digest"], m["encoding"], m["changed_elements"])
    one_line_error(dcr("show", root, "--step", 9), 4, "not committed")


def _on_a_terminal(*args) -> tuple[int, str, str]:
    """``dcr ARGS`` with stderr on a pseudo-terminal (stdout piped): (exit code, stdout, terminal output)."""
    import fcntl
    import pty
    import struct
    import subprocess
    import sys
    import termios

    from tests.support.cli import REPO

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a terminal 120 columns wide
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=slave, cwd=REPO, env={**os.environ, "DCR_ORCHESTRATOR": "none", "COLUMNS": "120"})
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    out = proc.stdout.read().decode()
    proc.wait(60)
    os.close(master)
    return proc.returncode, out, b"".join(chunks).decode(errors="replace")


def test_long_commands_show_progress_on_a_terminal_and_stay_quiet_otherwise(made, tmp_path):
    root = made / "bucket"
    rc, out, term = _on_a_terminal("publish", root, made / "c0.safetensors", "--step", 3)
    assert rc == 0 and out.startswith("committed step 3"), (out, term)
    assert "publish step 3" in term and "/" in term and "B/s" in term, term  # bytes of the total, rate, ETA
    rc, out, term = _on_a_terminal("receive", root, "--receiver", "r", "--state", tmp_path / "s.safetensors")
    assert rc == 0 and "receive r" in term and "B/s" in term, term
    rc, out, term = _on_a_terminal("verify", root, "--deep")
    assert rc == 0 and "verify" in term and "B/s" in term, term
    rc, out, term = _on_a_terminal("publish", root, made / "c1.safetensors", "--step", 4, "-q")
    assert (rc, out, term) == (0, "", ""), term  # -q: nothing at all
    rc, out, term = _on_a_terminal("verify", root, "--json")
    assert rc == 0 and term == "" and json.loads(out)["errors"] == []
    piped = dcr("publish", root, made / "c2.safetensors", "--step", 5)  # not a terminal: no bar
    assert piped.returncode == 0 and piped.stderr == ""


def test_serve_selects_deployments_by_their_file_names(tmp_path, monkeypatch):
    from dcr_core.errors import UsageError
    from flows.deployments import deployments

    for k, v in {"DCR_ROOT": str(tmp_path / "b"), "DCR_RECEIVER_ID": "r0",
                 "DCR_RECEIVER_STATE": str(tmp_path / "r0.safetensors")}.items():
        monkeypatch.setenv(k, v)
    assert [d.name for d in deployments(names=["receiver"])] == ["serve-receiver"]
    assert [d.name for d in deployments(names=["serve-gc", "publisher"])] == ["serve-publisher", "serve-gc"]
    with pytest.raises(UsageError, match="no deployment named 'nope'"):
        deployments(names=["nope"])
    served = {d.name: d for d in deployments()}  # every deployment of the file, the mirror's too
    assert set(served) == {"serve-receiver", "serve-publisher", "serve-gc", "serve-mirror"}
    mirror = served["serve-mirror"]
    assert mirror.parameters == {"dst": str(tmp_path / "b"), "workers": None} and not mirror.schedules  # a run names its upstream
    assert "src" in mirror._parameter_openapi_schema.required
    monkeypatch.setenv("DCR_RECEIVER_STATE", "relative.safetensors")
    with pytest.raises(UsageError, match="must be an absolute path"):
        deployments(names=["receiver"])


def test_an_unreadable_position_only_costs_a_write(made, tmp_path, monkeypatch):
    from flows.receive import state_file
    from flows.receive.records import ReceiverCommit
    from storage.access import StoreUnreachableError
    from storage.catalog import Catalog
    from storage.root import RootRef

    root = made / "bucket"
    dcr("receive", root, "--receiver", "r", "--state", tmp_path / "s.safetensors", check=0)

    def denied(self, receiver_id):
        raise StoreUnreachableError("AccessDenied")

    monkeypatch.setattr(Catalog, "position", denied)  # a role that may write its position, not read it
    key = root / layout.position_key("r")
    key.unlink()
    record = ReceiverCommit(from_step=2, moves=[], policy_digest="x")
    assert state_file.record_receiver_commit(RootRef(str(root)), "r", 2, record)
    assert json.loads(key.read_text())["step"] == 2


def test_a_follower_started_while_the_endpoint_is_down_keeps_trying(tmp_path, monkeypatch):
    from flows.receive.follow import follow
    from storage.root import RootRef

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    warned = []

    class Enough(BaseException):
        pass

    def warn(message):
        warned.append(message)
        if len(warned) == 2:
            raise Enough

    with pytest.raises(Enough):
        for _ in follow(RootRef("s3://bucket/run"), str(tmp_path / "s.safetensors"), lambda step: {}, interval=0.01,
                        warn=warn):
            pass
    assert all(m.startswith("StoreUnreachableError: s3://bucket/run: cannot reach") for m in warned), warned


def test_error_hints_never_read_object_paths(tmp_path):
    from storage.access import Endpoint, StoreConfigError
    from storage.backends.gcs import GcsBackend
    from storage.backends.s3 import S3Backend
    from storage.root import same_root

    ep = Endpoint("http://127.0.0.1:1", "STORAGE_EMULATOR_HOST")
    missing = FileNotFoundError("b/dcr/o/forbidden-zone%2Fthe bucket does not exist%2Frun.json")
    assert GcsBackend("gs", None, "dcr/forbidden-zone", endpoint=ep).explain("gs://dcr/forbidden-zone", missing) is None
    no_bucket = FileNotFoundError("The specified bucket does not exist")
    assert isinstance(S3Backend("s3", None, "x/run", endpoint=ep).explain("s3://x/run", no_bucket), StoreConfigError)
    assert same_root("bucket", f"file://{os.path.abspath('bucket')}/") and same_root("s3a://b/run/", "s3://b/run")
    assert same_root("abfs://c/run/", "az://c/run") and not same_root("s3://b/run", "s3://b/run2")


def test_a_bad_orchestrator_setting_is_refused(made, tmp_path):
    out = dcr("publish", made / "bucket", made / "c0.safetensors", "--step", 7, env={"DCR_ORCHESTRATOR": "Prefect"})
    one_line_error(out, 2, "DCR_ORCHESTRATOR='Prefect' must be none, prefect or auto")


def test_read_only_commands_take_no_orchestrator_and_prefect_state_is_not_tracked(made):
    for command, *more in (("ls",), ("verify",), ("show", "--step", "1"), ("status",)):
        out = dcr(command, made / "bucket", *more, "--orchestrator", "prefect")
        assert out.returncode == 2 and "unrecognized arguments: --orchestrator" in out.stderr, (command, out.stderr)
    from tests.support.cli import REPO

    ignored = subprocess.run(["git", "check-ignore", "-q", ".prefect/prefect.db"], cwd=REPO)
    assert ignored.returncode == 0, ".prefect/ (infra/start-prefect.sh's state) must be ignored by git"


def test_gc_keeps_the_step_a_receiver_moved_back_to(made, tmp_path):
    root, state = made / "bucket", tmp_path / "r.safetensors"
    dcr("receive", root, "--receiver", "r", "--state", state, check=0)  # step 2: its highest record
    dcr("receive", root, "--receiver", "r", "--state", state, "--step", 1, check=0)  # back to 1: its position
    dcr("publish", root, made / "c0.safetensors", "--step", 3, "--keyframe", check=0)  # a new lineage
    report = json.loads(dcr("gc", root, "--keep-last", 1, "--grace-seconds", 0, "--json", check=0).stdout)
    assert report["deleted_steps"] == [0] and report["plan"]["keep"] == [1, 2, 3], report
    assert "already there" in dcr("receive", root, "--receiver", "r", "--state", state, "--step", 1, check=0).stdout


def test_a_missing_empty_or_misspelt_root_is_an_error_for_every_read_command(made, tmp_path):
    """``ls``, ``show``, ``status``, ``verify`` and ``report`` on a ROOT where nothing was published:
    exit 2 and one line naming the path and what was expected (``--allow-empty`` asks for the empty
    case); a ROOT that is a file says so; ``s3//b/run`` (a missing colon) is named as the typo it is."""
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = made / "c0.safetensors"
    for command, *more in (("ls",), ("show", "--step", "0"), ("status",), ("verify",), ("report", "--out", tmp_path / "r")):
        one_line_error(dcr(command, tmp_path / "nonexistent", *more), 2, "nonexistent: no such directory")
        one_line_error(dcr(command, empty, *more), 2, f"{empty}: nothing was ever published here")
        one_line_error(dcr(command, a_file, *more), 2, "is a file, not a directory")
    one_line_error(dcr("ls", "s3//dcr/run-1"), 2, "s3//dcr/run-1: no such directory (did you mean s3://dcr/run-1?)")
    assert not (tmp_path / "r").exists()
    for command in ("ls", "status", "verify"):
        assert dcr(command, empty, "--allow-empty").returncode == 0
        one_line_error(dcr(command, tmp_path / "nonexistent", "--allow-empty"), 2, "no such directory")
    assert dcr("verify", empty, "--allow-empty", check=0).stdout.startswith("verify ok: 0 steps")
    one_line_error(dcr("publish", a_file, a_file, "--step", 0), 2, "is a file, not a directory")


def test_version_names_the_command_and_the_codec_package():
    from importlib.metadata import version

    out = dcr("--version", check=0)
    assert out.stdout.startswith(f"dcr {version('dcr')} (dcr-zarr-codec {version('dcr-zarr-codec')}, Python ")
    assert out.stderr == ""


@pytest.mark.faults(component="bad input or damaged bucket", outcome="refused in one line; the trainer's file byte-identical")
def test_materialize_keeps_a_file_dcr_did_not_write_unless_forced(made, tmp_path):
    """``--out`` naming the trainer's own checkpoint (no DCR header) is refused and the file kept
    byte for byte; DCR's own output is replaced; ``--force`` replaces anything."""
    from safetensors.torch import load_file

    from dcr_core.errors import UsageError
    from flows import run_materialize
    from tests.support.helpers import assert_bits_equal

    root, trainer = made / "bucket", made / "c1.safetensors"
    before = trainer.read_bytes()
    one_line_error(dcr("materialize", root, "--step", 2, "--out", trainer), 2,
              f"{trainer}: exists and was not written by dcr materialize or dcr receive", "--force")
    assert trainer.read_bytes() == before
    with pytest.raises(UsageError, match="--force"):
        run_materialize(str(root), 2, str(trainer))
    assert trainer.read_bytes() == before
    junk = tmp_path / "notes.txt"
    junk.write_text("not a checkpoint")
    one_line_error(dcr("materialize", root, "--out", junk), 2, "was not written by dcr")
    assert junk.read_text() == "not a checkpoint"
    out = tmp_path / "m.safetensors"
    dcr("materialize", root, "--step", 0, "--out", out, check=0)
    dcr("materialize", root, "--step", 2, "--out", out, check=0)  # its own output: replaced
    assert_bits_equal(load_file(out), load_file(made / "c2.safetensors"))
    dcr("materialize", root, "--step", 2, "--out", trainer, "--force", check=0)
    assert_bits_equal(load_file(trainer), load_file(made / "c2.safetensors"))


def test_a_relative_root_is_recorded_absolute_and_verifies_from_anywhere(made, tmp_path):
    """A receiver run with ``./bucket`` records the ROOT as an absolute path in its state's header:
    ``verify-state`` from another directory finds it; a relative ROOT that names nothing says "no
    such directory"."""
    from safetensors import safe_open

    dcr("receive", "./bucket", "--receiver", "r", "--state", "s.safetensors", cwd=made, check=0)
    with safe_open(str(made / "s.safetensors"), "pt") as f:
        assert f.metadata()["dcr.root"] == str(made / "bucket")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = dcr("verify-state", made / "s.safetensors", cwd=elsewhere, check=0)
    assert f"step 2 of {made / 'bucket'}" in out.stdout
    dcr("materialize", "./bucket", "--step", "1", "--out", "m.safetensors", "--as-state", cwd=made, check=0)
    with safe_open(str(made / "m.safetensors"), "pt") as f:
        assert f.metadata()["dcr.root"] == str(made / "bucket")
    dcr("materialize", "./bucket", "--step", "1", "--out", "e.safetensors", cwd=made, check=0)  # the published bytes
    assert json.loads((made / ".e.safetensors.dcr").read_text())["root"] == str(made / "bucket")  # their record
    one_line_error(dcr("receive", "./bucket", "--receiver", "r", "--state", "s2.safetensors", cwd=elsewhere), 2,
              "./bucket: no such directory")


def test_receives_leave_no_lock_files_and_refuse_a_missing_directory(made, tmp_path):
    """A state path's lock lives beside it only while a writer holds it: nothing is left after a
    receive, a failed receive, a materialize or a verify-state. A ``--state`` or ``--out`` whose
    directory does not exist is refused in one line, and nothing is created."""
    root = made / "bucket"
    dcr("receive", root, "--receiver", "r", "--state", tmp_path / "s.safetensors", check=0)
    dcr("verify-state", tmp_path / "s.safetensors", check=0)
    dcr("receive", root, "--receiver", "r", "--state", tmp_path / "t.safetensors", "--step", 9, check=4)
    dcr("materialize", root, "--out", tmp_path / "m.safetensors", check=0)
    # (the hidden files kept: verify-state's block digests of s.safetensors, a sidecar in-place refits use, and
    # the record that DCR wrote m.safetensors, the published file's bytes with nothing of DCR's in them)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [".m.safetensors.dcr",
                                                                                     ".s.safetensors.blocks"]
    assert not [p for p in made.iterdir() if p.name.endswith(".lock")]  # beside the checkpoints either
    for command, flag in (("receive", "--state"), ("materialize", "--out")):
        args = ("--receiver", "r") if command == "receive" else ()
        one_line_error(dcr(command, root, *args, flag, tmp_path / "no" / "such" / "x.safetensors"), 2,
                  f"directory {tmp_path / 'no' / 'such'} does not exist; create it first")
    assert not (tmp_path / "no").exists()


def test_one_writer_at_a_time_holds_a_state_files_lock_and_none_is_left():
    """``storage.local.state.exclusive`` under contention: never two holders at once, every waiter
    gets its turn, and the lock file is gone once the last one lets go."""
    import tempfile
    import threading

    from storage.local import state

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "s.safetensors")
        inside, most, turns, lock = [0], [0], [], threading.Lock()

        def writer(i: int) -> None:
            for _ in range(20):
                with state.exclusive(path):
                    with lock:
                        inside[0] += 1
                        most[0] = max(most[0], inside[0])
                    time.sleep(0.0005)
                    with lock:
                        inside[0] -= 1
                        turns.append(i)

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert most[0] == 1 and sorted(set(turns)) == list(range(6)) and len(turns) == 120
        assert os.listdir(d) == []
