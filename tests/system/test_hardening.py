"""Hostile and damaged buckets, as an attacker or a busy operator would make them, against ``dcr``.

Nothing outside ROOT is ever read or written through a link; special files and oversized objects
are refused without hanging or exhausting memory; malformed documents and unreadable schemas fail
with one line and the right exit code; a step copied from another run is refused. Each case runs
the real command line (``main(argv)``, in this process as a fresh process runs it: tests/support/cli.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dcr_core.errors import InvalidCheckpointError
from flows import run_publish
from flows.options import PublishOptions
from storage import layout
from storage.marker import CommitMarker
from storage.signing import HMAC_SHA256, Key
from tests.support.cli import copy_tree, dcr, dcr_peak_rss, publish_chain
from tests.support.helpers import assert_bits_equal, chunk_at, stored_chunks, tree_snapshot, write_safetensors

pytestmark = pytest.mark.faults(component="bad input or damaged bucket",
                                outcome="refused with one line naming the object, right exit code; nothing outside ROOT touched")

KEY = "hardening-test-key"
MiB = 1 << 20


@pytest.fixture(scope="module")
def _made(tmp_path_factory):
    d = tmp_path_factory.mktemp("made")
    return d, publish_chain(d)


@pytest.fixture
def bucket(_made, tmp_path):
    made, cks = _made
    return copy_tree(made, tmp_path) / "bucket", cks


@pytest.fixture(scope="module")
def _made_unpacked(_made, tmp_path_factory):
    """The same steps published one object per chunk (``--pack-bytes 0``), as steps were before packs."""
    made, cks = _made
    d = tmp_path_factory.mktemp("unpacked")
    for s in range(len(cks)):
        dcr("publish", d / "bucket", made / f"c{s}.safetensors", "--step", s, "--chunk-bytes", 4096,
            "--pack-bytes", 0, check=0, env={"DCR_CACHE_DIR": str(d / "cache")})
    return d, cks


@pytest.fixture(params=["pack", "chunk-object"])
def chunk_bucket(request, tmp_path):
    """A bucket, and the object holding a stored chunk of step 3: a pack, or (``--pack-bytes 0``)
    the chunk's own object."""
    made, cks = request.getfixturevalue("_made" if request.param == "pack" else "_made_unpacked")
    root = copy_tree(made, tmp_path) / "bucket"
    target = Path(chunk_at(root, 3, *stored_chunks(root, 3)[0])[0])
    assert (f"/{layout.PACKS}/" in str(target)) == (request.param == "pack")
    return root, cks, target


def _attempt_dir(root: Path, step: int) -> Path:
    (attempt,) = [p for p in (root / layout.attempts_dir(step)).iterdir()]
    return attempt


def _victim(path: Path) -> dict[str, bytes]:
    (path / "proj").mkdir(parents=True)
    (path / "proj" / "weights.bin").write_bytes(b"precious")
    (path / "rx.json").write_bytes(b"precious too")
    return tree_snapshot(path)


# -- 1. nothing outside ROOT, nothing but regular files ---------------------------------------------


@pytest.mark.faults(component="security", outcome="gc reports each and deletes nothing through it; the rest is collected")
def test_gc_never_deletes_through_a_link_nor_names_it_did_not_write(bucket, tmp_path):
    """A linked ``attempts/`` of an uncommitted step and of a committed one, a linked attempt, and a
    folder whose name is not an attempt id: gc reports each and leaves it (and what it points
    to, outside ROOT) alone, while still collecting the rest."""
    root, _ = bucket
    victim = tmp_path / "victim"
    before = _victim(victim)
    (root / layout.step_dir(99)).mkdir()
    os.symlink(victim, root / layout.attempts_dir(99))
    moved = tmp_path / "moved-attempts"  # a committed step's attempts/ moved out and linked back
    shutil.move(root / layout.attempts_dir(1), moved)
    (moved / uuid.uuid4().hex).mkdir()  # a "losing attempt" gc would delete at once
    moved_before = tree_snapshot(moved)
    os.symlink(moved, root / layout.attempts_dir(1))
    os.symlink(victim, root / layout.attempts_dir(2) / uuid.uuid4().hex)
    foreign = root / layout.attempts_dir(2) / "not-an-attempt"
    foreign.mkdir()
    (foreign / "keep.me").write_bytes(b"x")
    stale = root / layout.attempts_dir(3) / uuid.uuid4().hex  # a real stale attempt: still collected
    stale.mkdir()
    (stale / "manifest.json").write_bytes(b"{}")

    out = dcr("gc", root, "--keep-last", 5, "--grace-seconds", 0, check=0)
    assert tree_snapshot(victim) == before and tree_snapshot(moved) == moved_before
    assert (foreign / "keep.me").exists() and not stale.exists()
    left_alone = [line for line in out.stdout.splitlines() if line.startswith("left alone:")]
    assert len(left_alone) == 4, out.stdout
    assert sum("symbolic link" in line for line in left_alone) == 3
    assert any("not-an-attempt" in line and "not an attempt" in line for line in left_alone)


@pytest.mark.faults(component="security", outcome="the linked target outside ROOT is untouched")
def test_gc_with_signing_on_leaves_a_linked_attempts_dir_of_an_unsigned_step_alone(tmp_path):
    """With signing on, an uncommitted step needs no marker to be collected: a link there must still
    never be followed."""
    env = {"DCR_SIGNING_KEY": KEY}
    publish_chain(tmp_path, steps=2, env=env)
    root = tmp_path / "bucket"
    victim = tmp_path / "victim"
    before = _victim(victim)
    (root / layout.step_dir(99)).mkdir()
    os.symlink(victim, root / layout.attempts_dir(99))
    out = dcr("gc", root, "--keep-last", 1, "--grace-seconds", 0, env=env, check=0)
    assert tree_snapshot(victim) == before
    assert "symbolic link" in out.stdout


@pytest.mark.faults(component="security", outcome="the step is kept and reported; the rest collected; the target untouched")
def test_gc_keeps_a_step_whose_receiver_records_sit_behind_a_link(bucket, tmp_path):
    root, cks = bucket
    run_publish(root, cks[3], 4, keyframe=True, options=PublishOptions(cache_dir=str(tmp_path / "cache")))
    victim = tmp_path / "victim"
    before = _victim(victim)
    os.symlink(victim, root / layout.receivers_dir(1))
    out = dcr("gc", root, "--keep-last", 1, "--grace-seconds", 0, check=0)
    assert tree_snapshot(victim) == before
    assert "deleted step 0" in out.stdout and "deleted step 2" in out.stdout and "step 1 kept" in out.stdout, out.stdout
    assert (root / layout.commit_key(1)).exists() and os.path.islink(root / layout.receivers_dir(1))


@pytest.mark.faults(component="security", outcome="exit 5 before the state is written; the target outside ROOT untouched")
def test_a_linked_receivers_dir_is_refused_before_the_state_is_touched(bucket, tmp_path):
    root, _ = bucket
    victim = tmp_path / "victim"
    before = _victim(victim)
    os.symlink(victim, root / layout.receivers_dir(3))
    state = tmp_path / "rx.safetensors"
    out = dcr("receive", root, "--receiver", "rx", "--state", state, check=5)
    assert "symbolic link" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert tree_snapshot(victim) == before and not state.exists()
    assert not (root / layout.leases_dir(3)).exists() or not any((root / layout.leases_dir(3)).iterdir())


def test_a_fifo_in_place_of_a_commit_marker_fails_fast_and_gc_leaves_it(bucket, tmp_path):
    """A FIFO blocks an ``open`` for reading forever: every command must refuse it instead."""
    root, cks = bucket
    (root / layout.step_dir(4)).mkdir()
    os.mkfifo(root / layout.commit_key(4))
    state = tmp_path / "s.safetensors"
    for args in (("receive", root, "--receiver", "r", "--state", state), ("ls", root), ("verify", root)):
        out = dcr(*args, timeout=60, check=5)
        assert "not a regular file" in out.stderr and layout.commit_key(4) in out.stderr, out.stderr
    out = dcr("gc", root, "--keep-last", 1, "--grace-seconds", 0, timeout=60, check=0)
    assert "left alone" in out.stdout and (root / layout.commit_key(4)).exists()


@pytest.mark.faults(component="security", outcome="exit 5 at once, peak RSS under 300 MiB")
def test_a_chunk_linked_to_dev_zero_is_refused_in_bounded_memory(chunk_bucket, tmp_path):
    """The object holding a chunk (its pack, or its own) replaced by a link to ``/dev/zero``."""
    root, _, target = chunk_bucket
    target.unlink()
    os.symlink("/dev/zero", target)
    code, err, peak = dcr_peak_rss("receive", root, "--receiver", "r", "--state", tmp_path / "s.safetensors", timeout=60)
    assert code == 5 and "symbolic link" in err and str(target.relative_to(root)) in err, err
    assert peak < 300 * MiB, peak


# -- 4. oversized objects are refused having read at most the limit ---------------------------------


@pytest.mark.faults(component="bad input or damaged bucket", outcome="exit 5 having read at most the limit; peak RSS under 300 MiB")
@pytest.mark.parametrize("what", ["marker", "chunk"])
def test_a_3_gb_object_is_refused_without_reading_it(_made, _made_unpacked, tmp_path, what):
    """A marker, or a chunk's own object (``--pack-bytes 0``), of 3 GB: refused from its size."""
    made, _ = _made if what == "marker" else _made_unpacked
    root = copy_tree(made, tmp_path) / "bucket"
    if what == "marker":
        target = root / layout.commit_key(3)
    else:
        target = Path(chunk_at(root, 3, *stored_chunks(root, 3)[0])[0])
    os.truncate(target, 3 << 30)  # sparse: costs no disk
    code, err, peak = dcr_peak_rss("receive", root, "--receiver", "r", "--state", tmp_path / "s.safetensors", timeout=60)
    assert code == 5 and "3221225472 bytes, more than" in err and str(target.relative_to(root)) in err, err
    assert peak < 300 * MiB, peak
    if what == "marker":
        code, err, peak = dcr_peak_rss("ls", root, timeout=60)
        assert code == 5 and peak < 300 * MiB, (err, peak)


@pytest.mark.faults(component="bad input or damaged bucket", outcome="receivers read only their chunks' ranges: exit 5 naming the pack's range (its bytes replaced) or exact (only grown); peak RSS under 300 MiB")
@pytest.mark.parametrize("how", ["replaced", "grown"])
def test_a_3_gb_pack_costs_a_receiver_only_the_ranges_it_reads(bucket, tmp_path, how):
    """A pack of 3 GB: its chunks' ranges replaced by zeros (the pack truncated, then grown), or only
    grown past its chunks. A receiver reads its chunks' ranges and nothing else: the first is
    refused naming the pack and the chunk's range; the second is exact, its chunks being intact."""
    root, cks = bucket
    chunk = stored_chunks(root, 3)[0]
    target = Path(chunk_at(root, 3, *chunk)[0])
    if how == "replaced":
        os.truncate(target, 0)
    os.truncate(target, 3 << 30)  # sparse: costs no disk
    state = tmp_path / "s.safetensors"
    code, err, peak = dcr_peak_rss("receive", root, "--receiver", "r", "--state", state, timeout=60)
    if how == "replaced":
        assert code == 5 and not state.exists(), err
        assert str(target.relative_to(root)) in err and " bytes " in err and len(err.strip().splitlines()) == 1, err
    else:
        assert code == 0, err
        assert_bits_equal(load_file(state), cks[3])
    assert peak < 300 * MiB, peak


@pytest.mark.faults(component="mirror", outcome="exit 5 naming the object, having read at most the size the manifest gives; nothing of the step committed downstream; peak RSS under 300 MiB")
def test_a_mirror_refuses_a_3_gb_object_where_a_chunk_belongs_without_reading_it(chunk_bucket, tmp_path):
    """The object holding a chunk of step 3 (its pack, or its own) grown to 3 GB, its chunks intact:
    a mirror copies whole objects, so it reads each no further than the size the manifest gives."""
    root, _, target = chunk_bucket
    os.truncate(target, 3 << 30)  # sparse: costs no disk
    region = tmp_path / "region"
    code, err, peak = dcr_peak_rss("mirror", root, region, timeout=60)
    assert code == 5 and "3221225472 bytes, more than" in err and str(target.relative_to(root)) in err, err
    assert len(err.strip().splitlines()) == 1 and not (region / layout.commit_key(3)).exists(), err
    assert peak < 300 * MiB, peak


# -- 3. signing keys --------------------------------------------------------------------------------


@pytest.mark.faults(component="security", outcome="exit 2; nothing applied")
@pytest.mark.parametrize("content", [b"", b" \n\t \n"], ids=["empty", "whitespace"])
def test_an_empty_signing_key_file_is_an_error_even_beside_a_valid_key(bucket, tmp_path, content):
    root, _ = bucket
    keyfile = tmp_path / "key"
    keyfile.write_bytes(content)
    state = tmp_path / "s.safetensors"
    env = {"DCR_SIGNING_KEY": KEY, "DCR_SIGNING_KEY_FILE": str(keyfile)}
    out = dcr("receive", root, "--receiver", "r", "--state", state, env=env, check=2)
    assert "signing key file is empty" in out.stderr and not state.exists()
    out = dcr("receive", root, "--receiver", "r", "--state", state, env={"DCR_SIGNING_KEY": content.decode()}, check=2)
    assert "DCR_SIGNING_KEY is set but empty" in out.stderr and not state.exists()


# -- 5. the publisher refuses what no receiver could read -------------------------------------------


@pytest.mark.faults(component="publisher", outcome="exit 2 before anything is written; ROOT unchanged")
@pytest.mark.parametrize("shape, dtype, says", [
    ((0, 2**30), torch.bfloat16, "exceed"),
    ((1,) * 17, torch.float32, "17 dimensions"),
    ((0, 2**50), torch.bfloat16, "a dimension larger than"),
], ids=["bf16-0x2^30", "17-dims", "0x2^50"])
def test_a_checkpoint_no_receiver_could_read_is_refused_before_anything_is_written(bucket, tmp_path, shape, dtype, says):
    root, cks = bucket
    ck = {**cks[3], "odd": torch.empty(shape, dtype=dtype)}
    path = tmp_path / "odd.safetensors"
    write_safetensors(path, ck)
    before = tree_snapshot(root)
    out = dcr("publish", root, path, "--step", 4, check=2)
    assert says in out.stderr and "'odd'" in out.stderr and "receivers could not read it" in out.stderr, out.stderr
    assert tree_snapshot(root) == before
    fresh = tmp_path / "fresh"
    with pytest.raises(InvalidCheckpointError, match="receivers could not read it"):
        run_publish(fresh, ck, 0, options=PublishOptions(cache_dir=str(tmp_path / "cache")))
    assert not fresh.exists()


# -- 8, 9. state files: aliasing tensors, links, special files --------------------------------------


@pytest.fixture(scope="module")
def _alias_made(tmp_path_factory):
    d = tmp_path_factory.mktemp("alias")
    return d, _alias_state(d)


def _alias_state(tmp_path: Path) -> tuple[Path, Path]:
    """A bucket of two equal tensors, and a state at step 0 whose header points both at one range
    (its digests still match: the bytes are equal)."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    y = x.clone()
    y.view(-1).view(torch.int16)[::7] ^= 1
    root = tmp_path / "alias-bucket"
    for s, ck in enumerate([{"a": x, "c": x.clone()}, {"a": y, "c": x.clone()}]):
        write_safetensors(tmp_path / f"a{s}.safetensors", ck)
        dcr("publish", root, tmp_path / f"a{s}.safetensors", "--step", s, check=0)
    state = tmp_path / "alias.safetensors"
    dcr("receive", root, "--receiver", "q", "--state", state, "--step", 0, check=0)
    raw = state.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["c"]["data_offsets"] = header["a"]["data_offsets"]
    text = json.dumps(header).encode()
    state.write_bytes(raw[:8] + text.ljust(n) + raw[8 + n:])
    return root, state


@pytest.mark.parametrize("mode", [[], ["--in-place"]], ids=["rewrite", "in-place"])
def test_a_state_whose_tensors_alias_the_same_bytes_is_refused_by_both_paths(_alias_made, tmp_path, mode):
    made, (root, state) = _alias_made
    copy_tree(made, tmp_path)
    root, state = tmp_path / root.relative_to(made), tmp_path / state.relative_to(made)
    before = state.read_bytes()
    out = dcr("receive", root, "--receiver", "q", "--state", state, *mode, check=2)
    assert "overlap" in out.stderr and str(state) in out.stderr
    assert state.read_bytes() == before
    assert not (root / layout.receiver_key(1, "q")).exists()


@pytest.mark.faults(component="receiver", outcome="the target refitted bit-exact, the link kept, both modes alike")
@pytest.mark.parametrize("mode", [[], ["--in-place"]], ids=["rewrite", "in-place"])
def test_a_state_that_is_a_link_refits_its_target_and_stays_a_link(bucket, tmp_path, mode):
    root, cks = bucket
    real = tmp_path / "real.safetensors"
    dcr("receive", root, "--receiver", "r", "--state", real, "--step", 1, check=0)
    link = tmp_path / "link.safetensors"
    os.symlink(real.name, link)
    out = dcr("receive", root, "--receiver", "r", "--state", link, *mode, check=0)
    assert "at step 3" in out.stdout
    assert link.is_symlink() and os.readlink(link) == real.name
    assert_bits_equal(load_file(real), cks[3])
    out = dcr("receive", root, "--receiver", "r", "--state", real, check=0)
    assert "already there" in out.stdout


def test_special_files_are_refused_as_states_and_materialize_outputs(bucket, tmp_path):
    root, _ = bucket
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    for args in (("materialize", root, "--out", fifo), ("receive", root, "--receiver", "r", "--state", fifo)):
        out = dcr(*args, timeout=60, check=2)
        assert "not a regular file" in out.stderr
        assert fifo.exists() and not fifo.is_file()  # still the FIFO


# -- 10. run identity -------------------------------------------------------------------------------


@pytest.mark.faults(component="security", outcome="exit 5 naming the run; the state not written")
def test_a_step_copied_from_another_run_with_the_same_key_is_refused(tmp_path):
    env = {"DCR_SIGNING_KEY": KEY}
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    publish_chain(a, steps=2, env=env)
    publish_chain(b, steps=1, env=env)
    shutil.copytree(a / "bucket" / layout.step_dir(1), b / "bucket" / layout.step_dir(1))
    state = tmp_path / "s.safetensors"
    out = dcr("receive", b / "bucket", "--receiver", "r", "--state", state, env=env, check=5)
    assert "copied from another run" in out.stderr and layout.commit_key(1) in out.stderr
    assert not state.exists()


@pytest.mark.faults(component="security", outcome="old markers readable; a run starts at the next publish; bit-exact")
def test_a_root_written_before_runs_existed_stays_readable_and_gains_a_run(bucket, tmp_path):
    """Markers without a run and no ``run.json`` (as older versions wrote them, signed): receivers
    read them; the next publish starts a run from its step on; older markers stay valid."""
    root, cks = bucket
    env = {"DCR_SIGNING_KEY": KEY}
    (root / layout.RUN).unlink()
    for s in range(4):  # strip the run and sign again, as an older publisher would have
        path = root / layout.commit_key(s)
        m = dataclasses.replace(CommitMarker.from_json(path.read_bytes(), str(path), s), run=None)
        path.write_bytes(dataclasses.replace(m, signature=Key(HMAC_SHA256, "test", secret=KEY.encode()).sign(m.body())).to_json())
        assert b'"run"' not in path.read_bytes()
    state = tmp_path / "s.safetensors"
    dcr("receive", root, "--receiver", "r", "--state", state, "--step", 2, env=env, check=0)
    assert_bits_equal(load_file(state), cks[2])
    nxt = {n: t.clone() for n, t in cks[3].items()}
    nxt["b"] += 1
    write_safetensors(tmp_path / "c4.safetensors", nxt)
    dcr("publish", root, tmp_path / "c4.safetensors", "--step", 4, env=env, check=0)
    run = json.loads((root / layout.RUN).read_bytes())
    assert run["since_step"] == 4 and json.loads((root / layout.commit_key(4)).read_bytes())["run"] == run["run_id"]
    dcr("receive", root, "--receiver", "r", "--state", state, env=env, check=0)
    assert_bits_equal(load_file(state), nxt)
    dcr("verify", root, env=env, check=0)


# -- 11. malformed documents: one line, the right exit code -----------------------------------------


@pytest.mark.parametrize("value", ["NaN", '"x"', "[1]", "1e999", "-5"])
def test_a_malformed_marker_summary_fails_with_one_line_and_exit_5(bucket, tmp_path, value):
    root, _ = bucket
    path = root / layout.commit_key(3)
    text = path.read_text()
    stored = json.loads(text)["summary"]["bytes_stored"]
    path.write_text(text.replace(f'"bytes_stored": {stored}', f'"bytes_stored": {value}'))
    assert value in path.read_text()
    for args in (("receive", root, "--receiver", "r", "--state", tmp_path / "s.safetensors"), ("ls", root)):
        out = dcr(*args, check=5)
        assert "summary.bytes_stored" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_deeply_nested_json_fails_with_one_line_naming_the_object(bucket, tmp_path):
    root, cks = bucket
    (root / layout.commit_key(3)).write_text("[" * 200_000)
    out = dcr("ls", root, check=5)
    assert layout.commit_key(3) in out.stderr and "not valid JSON" in out.stderr
    nested = tmp_path / "nested.safetensors"
    header = b"[" * 200_000
    nested.write_bytes(struct.pack("<Q", len(header)) + header)
    out = dcr("publish", tmp_path / "other", nested, "--step", 0, check=2)
    assert "nested.safetensors" in out.stderr and "not a safetensors file (its header is not JSON)" in out.stderr
    state = tmp_path / "state.safetensors"
    shutil.copy(nested, state)
    out = dcr("receive", root, "--receiver", "r", "--state", state, "--step", 2, check=2)
    assert str(state) in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.faults(component="bad input or damaged bucket", outcome="a one-line error saying what the file is; nothing written")
def test_a_file_of_another_format_is_named_for_what_it_is(tmp_path):
    """A torch ``.pt`` (a zip archive), an older pickle and a file too short to be anything are each
    refused in one line saying what they are, not as a malformed safetensors header."""
    import pickle

    torch.save({"w": torch.ones(3)}, tmp_path / "model.pt")
    (tmp_path / "old.bin").write_bytes(pickle.dumps({"w": [1.0]}, protocol=2) + b"\0" * 16)
    (tmp_path / "short.safetensors").write_bytes(b"abc")
    for name, what in (("model.pt", "a zip archive"), ("old.bin", "a Python pickle"), ("short.safetensors", "shorter than 8 bytes")):
        out = dcr("publish", tmp_path / "bucket", tmp_path / name, "--step", 0, check=2)
        assert out.stderr.strip() == out.stderr.strip().splitlines()[0] and f"{name}: not a safetensors file ({what}" in out.stderr
    assert not (tmp_path / "bucket").exists() or not any((tmp_path / "bucket").rglob("commit.json"))


@pytest.mark.faults(component="receiver", outcome="a one-line error naming the file; the state file unchanged, no temp file left")
def test_a_receive_that_runs_out_of_disk_names_the_file_and_leaves_the_state_unchanged(tmp_path):
    """A file-size limit (RLIMIT_FSIZE, as a full disk looks to a writer: EFBIG) under ``dcr receive``:
    the error names the state file being written; the held state is byte-identical; no temp file."""
    import resource
    import subprocess
    import sys

    from tests.support.cli import REPO

    ck = {"w": torch.randn(100_000)}
    write_safetensors(tmp_path / "c0.safetensors", ck)
    write_safetensors(tmp_path / "c1.safetensors", {"w": ck["w"] + 1})
    root, state = tmp_path / "bucket", tmp_path / "s.safetensors"
    dcr("publish", root, tmp_path / "c0.safetensors", "--step", 0, check=0)
    dcr("receive", root, "--receiver", "r", "--state", state, check=0)
    dcr("publish", root, tmp_path / "c1.safetensors", "--step", 1, check=0)
    before = state.read_bytes()

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    out = subprocess.run([sys.executable, "-m", "flows.cli", "receive", str(root), "--receiver", "r", "--state", str(state)],
                         cwd=REPO, preexec_fn=small_files, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert f"File too large while writing: '{state}'" in out.stderr, out.stderr
    assert state.read_bytes() == before
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


@pytest.mark.faults(component="bad input or damaged bucket", outcome="printed escaped: the terminal is never driven")
def test_names_and_times_from_the_bucket_cannot_drive_the_terminal(tmp_path):
    """A tensor name with an ESC sequence and a newline (a forged row), and a ``committed_at`` edited
    into an escape sequence: ``dcr show``, ``ls``, ``status --receiver`` and the errors that quote them
    print every control character escaped, one table row per tensor."""
    name = "w\x1b]0;owned\x07\x1b[2J\nFORGED ROW"
    ck = {name: torch.ones(4), "b": torch.zeros(2)}
    write_safetensors(tmp_path / "c.safetensors", ck)
    root = tmp_path / "bucket"
    dcr("publish", root, tmp_path / "c.safetensors", "--step", 0, check=0)
    marker = root / layout.commit_key(0)
    doc = json.loads(marker.read_text())
    doc["committed_at"] = "\x1b[31mnow\x1b[0m"
    marker.write_text(json.dumps(doc))
    dcr("receive", root, "--receiver", "r", "--state", tmp_path / "s.safetensors", check=0)
    outs = [dcr("show", root, "--step", 0, check=0).stdout, dcr("ls", root, check=0).stdout,
            dcr("status", root, "--receiver", "r", check=0).stdout]
    for out in outs:
        assert "\x1b" not in out and "\x07" not in out, out
    show = outs[0]
    assert "\\x1b]0;owned\\x07\\x1b[2J\\nFORGED ROW" in show and "committed \\x1b[31mnow\\x1b[0m" in show
    assert not any(line.startswith("FORGED ROW") for line in show.splitlines())
    err = dcr("ls", tmp_path / "no\x1b[2Jsuch\nroot", check=2).stderr
    assert "\x1b" not in err and "no\\x1b[2Jsuch\\nroot: no such directory" in err and len(err.strip().splitlines()) == 1


def _hostile_records(root: Path) -> None:
    """Receiver ``a`` lags two steps behind with a newline in its moves that forges a current row;
    ``b`` has a record whose fields are of the wrong types; ``c`` a record that is no JSON object;
    ``d`` stays as its refit wrote it."""
    pos = root / layout.POSITIONS_DIR
    a = json.loads((pos / "a.json").read_text())
    a["moves"] = ["forward:1\nd              3      0         -           -       now  forward:3"]
    a["committed_at"] = "2024-01-01T00:00:00Z\n\x1b[2J"
    (pos / "a.json").write_text(json.dumps(a))
    b = json.loads((pos / "b.json").read_text())
    b.update(bytes_pulled="lots", from_step={"x": 1}, moves=[1, None])
    (pos / "b.json").write_text(json.dumps(b))
    (pos / "c.json").write_text("[1, 2]")


@pytest.mark.faults(component="bad input or damaged bucket",
                    outcome="dcr status: every field escaped; a damaged record is its own row naming the object")
def test_hostile_receiver_records_forge_no_status_row_and_break_no_one_elses(bucket, tmp_path):
    """Records are what receivers say of themselves, written by anyone who can write ``receivers/``.
    A newline in a field would forge a row (a lagging receiver shown as current), a field of the
    wrong type made ``dcr status`` fail for everyone: each field is escaped, each record validated
    as a document, and a damaged one is one row that names its object, the others printed as usual."""
    root, _ = bucket
    for rid, step in (("a", 1), ("b", 2), ("c", 2), ("d", 3)):
        dcr("receive", root, "--receiver", rid, "--state", tmp_path / f"{rid}.safetensors", "--step", step, check=0)
    _hostile_records(root)
    out = dcr("status", root, check=0)
    lines = out.stdout.splitlines()
    rows = {line.split()[0]: line for line in lines[2:] if line.strip() and line.split()[0] in "abcd"}
    assert len(lines) == 6 and set(rows) == set("abcd"), out.stdout  # the header, four rows: nothing forged
    assert rows["a"].split()[1:3] == ["1", "2"] and "forward:1\\nd" in rows["a"], rows["a"]
    assert "\x1b" not in out.stdout and "\x1b" not in out.stderr
    b_key = f"{layout.POSITIONS_DIR}/b.json"
    assert "damaged" in rows["b"] and b_key in rows["b"] and "from_step" in rows["b"], rows["b"]
    assert "damaged" in rows["c"] and f"{layout.POSITIONS_DIR}/c.json" in rows["c"], rows["c"]
    assert rows["d"].split()[1:3] == ["3", "0"], rows["d"]
    data = json.loads(dcr("status", root, "--json", check=0).stdout)
    by_id = {r["receiver"]: r for r in data["receivers"]}
    assert by_id["b"]["step"] is None and b_key in by_id["b"]["damaged"] and by_id["d"]["damaged"] is None
    record = root / layout.receiver_key(1, "a")
    doc = json.loads(record.read_text())
    record.write_text(json.dumps({**doc, "moves": ["forward:1\nFORGED ROW"], "earlier": [{"step": 1, "moves": [7]}]}))
    history = dcr("status", root, "--receiver", "a", check=0).stdout.splitlines()
    assert not any(line.startswith("FORGED") for line in history), history
    assert "damaged record" in history[-1] and "earlier[0]: moves" in history[-1], history
