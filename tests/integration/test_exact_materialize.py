"""A step published from a safetensors file or a sharded Hugging Face directory materializes byte
for byte: the SHA-256 of every file ``dcr materialize`` writes is the published file's (every
dtype, NaN payloads, -0.0, inf, subnormals, 0-d and empty tensors; keyframes and deltas; in one
process and as mapped groups), and ``dcr verify --file`` says whether a local file is exactly a
step, naming the first difference. Steps published from tensors keep DCR's state format."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct

import numpy as np
import pytest
from safetensors import safe_open

from dcr_core import events
from dcr_core.dtypes import DTYPES
from dcr_core.errors import IntegrityError, StateMismatchError, UsageError
from flows import run_materialize, run_publish, run_receive
from flows.maintenance.mirror import run_mirror
from flows.options import PublishOptions, ReceiveOptions
from storage import layout
from storage.catalog import Catalog
from storage.local import dir_swap, materialized
from storage.local.safetensors import INDEX_NAME
from storage.root import Root
from tests.integration.test_publish_groups import Groups
from tests.support.cli import dcr, one_line_error
from tests.support.helpers import (
    assert_bits_equal,
    chain_of_steps,
    next_step,
    raw_bytes,
    read_state,
    write_safetensors,
)
from tests.support.kill import kill_at, sweep

N = 3  # keyframe, delta, delta; a fourth step is a keyframe again (--keyframe)


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def opts(tmp_path) -> PublishOptions:
    return PublishOptions(cache_dir=str(tmp_path / "cache"), chunk_bytes=256)


def write_hf_dir(d, tensors, shards: int = 3) -> None:
    """A Hugging Face sharded checkpoint: ``model-0000k-of-0000n.safetensors`` and its index."""
    os.makedirs(d, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        write_safetensors(os.path.join(d, fname), {n: tensors[n] for n in part}, {"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(d, INDEX_NAME), "w") as f:
        f.write(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")


def write_odd_file(path, tensors, extra: bytes = b"", gap: int = 0) -> None:
    """A safetensors file as another writer might lay it out: an indented header with the metadata
    last, tensors in reverse name order, padding that is not a multiple of 8; ``gap`` bytes between
    the first two tensors and ``extra`` after the last (bytes no tensor owns)."""
    order = sorted(tensors, reverse=True)
    header, at, blobs = {}, 0, []
    for i, n in enumerate(order):
        data = raw_bytes(tensors[n])
        if i == 1 and gap:
            blobs.append(b"\xee" * gap)
            at += gap
        dtype = next(k for k, v in DTYPES.items() if v.torch_name == str(tensors[n].dtype).removeprefix("torch."))
        header[n] = {"dtype": dtype, "shape": list(tensors[n].shape), "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    header["__metadata__"] = {"writer": "other", "note": "ünïcødé"}
    text = json.dumps(header, indent=3, ensure_ascii=False).encode() + b"\n   "
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs) + extra)


def publish_files(tmp_path, paths, root=None, keyframe_at=()):
    root = root or str(tmp_path / "root")
    for step, p in enumerate(paths):
        run_publish(root, str(p), step, keyframe=step in keyframe_at, options=opts(tmp_path))
    return root


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Four steps published from safetensors files (every dtype): keyframe, two deltas, a keyframe."""
    d = tmp_path_factory.mktemp("files")
    steps = chain_of_steps(N, seed=7)
    steps.append(next_step(steps[-1], 99))
    paths = []
    for i, ck in enumerate(steps):
        paths.append(d / f"c{i}.safetensors")
        write_safetensors(paths[-1], ck, {"format": "pt", "step": str(i)})
    root = publish_files(d, paths, keyframe_at=(3,))
    return {"root": root, "paths": paths, "steps": steps, "dir": d}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Three steps published from Hugging Face sharded directories (every dtype, an index)."""
    d = tmp_path_factory.mktemp("sharded")
    steps = chain_of_steps(N, seed=8)
    dirs = []
    for i, ck in enumerate(steps):
        dirs.append(d / f"hf{i}")
        write_hf_dir(dirs[-1], ck)
    root = publish_files(d, dirs)
    return {"root": root, "dirs": dirs, "steps": steps, "dir": d}


def tree(d) -> dict[str, str]:
    return {n: sha(os.path.join(d, n)) for n in sorted(os.listdir(d)) if not n.startswith(".")}


@pytest.mark.parametrize("step", range(N + 1))
def test_a_step_published_from_a_file_materializes_with_its_sha256(files, step, tmp_path):
    out = tmp_path / "m.safetensors"
    r = run_materialize(files["root"], step, str(out))
    assert r.step == step
    assert sha(out) == sha(files["paths"][step])
    assert_bits_equal(read_state(out), files["steps"][step])
    m = Catalog(Root(files["root"])).manifest(step)
    assert m.source is not None and m.source.kind == "file"


def test_materializing_over_its_own_output_and_on_mapped_groups_gives_the_same_bytes(files, tmp_path):
    out = tmp_path / "m.safetensors"
    for step in (0, 2, 1):  # its own output, replaced each time (in one process, then as mapped groups)
        run_materialize(files["root"], step, str(out))
        assert sha(out) == sha(files["paths"][step])
        run_materialize(files["root"], step, str(out), runner=Groups(True), options=ReceiveOptions(group_bytes=512))
        assert sha(out) == sha(files["paths"][step])
    hidden = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert hidden == [".m.safetensors.dcr"]  # the record that DCR wrote it; no temp or lock file left


def test_a_sharded_directory_materializes_as_its_files_and_index(sharded, tmp_path):
    out = tmp_path / "out"
    (tmp_path / "out").mkdir()
    (out / "config.json").write_text("{}")  # a model directory: what is not the checkpoint's is left alone
    for step in (0, 2, 1):
        run_materialize(sharded["root"], step, str(out))
        assert tree(out) == {**tree(sharded["dirs"][step]), "config.json": sha(out / "config.json")}
    fresh = tmp_path / "fresh"  # a directory that does not exist yet, as mapped groups
    run_materialize(sharded["root"], 2, str(fresh), runner=Groups(True), options=ReceiveOptions(group_bytes=512))
    assert tree(fresh) == tree(sharded["dirs"][2])
    one = tmp_path / "one.safetensors"  # a .safetensors path: one file, in DCR's state format, as before
    run_materialize(sharded["root"], 1, str(one))
    assert_bits_equal(read_state(one), sharded["steps"][1])
    with safe_open(str(one), "np") as f:
        assert f.metadata()["dcr.step"] == "1"
    m = Catalog(Root(sharded["root"])).manifest(1)
    assert m.source is not None and m.source.kind == "directory"


def test_a_directory_whose_step_has_other_shards_loses_only_the_ones_dcr_wrote(tmp_path):
    steps = chain_of_steps(2, seed=9, dtypes=["BF16", "F32", "I64"])
    write_hf_dir(tmp_path / "a", steps[0], shards=3)
    write_hf_dir(tmp_path / "b", steps[1], shards=2)
    root = publish_files(tmp_path, [tmp_path / "a", tmp_path / "b"])
    out = tmp_path / "out"
    run_materialize(root, 0, str(out))
    run_materialize(root, 1, str(out))
    assert tree(out) == tree(tmp_path / "b")


def test_headers_from_another_writer_and_deltas_of_them_are_kept_exactly(tmp_path):
    steps = chain_of_steps(3, seed=10)
    paths = []
    for i, ck in enumerate(steps):
        paths.append(tmp_path / f"odd{i}.safetensors")
        write_odd_file(paths[-1], ck)
    root = publish_files(tmp_path, paths)
    for step in range(3):
        run_materialize(root, step, str(tmp_path / "m.safetensors"))
        assert sha(tmp_path / "m.safetensors") == sha(paths[step])
        assert dcr("verify", root, "--file", paths[step], "--step", step, check=0).stdout.strip() == \
            f"{paths[step]} is exactly step {step}"


@pytest.mark.parametrize("odd", ["trailing", "gap"])
def test_a_file_with_bytes_no_tensor_owns_is_published_without_its_layout(tmp_path, odd, caplog):
    ck = chain_of_steps(1, seed=11, dtypes=["F16", "U8"])[0]
    path = tmp_path / "c.safetensors"
    write_odd_file(path, ck, extra=b"junk" if odd == "trailing" else b"", gap=8 if odd == "gap" else 0)
    root = publish_files(tmp_path, [path])
    m = Catalog(Root(root)).manifest(0)
    assert m.source is None and m.producer["source_layout"].startswith("not kept: ")
    assert "belong to no tensor" in m.producer["source_layout"]
    assert "without its files' own bytes" in caplog.text
    out = tmp_path / "m.safetensors"
    run_materialize(root, 0, str(out))  # as before: DCR's own format, the same tensors
    assert_bits_equal(read_state(out), ck)
    with safe_open(str(out), "np") as f:
        assert f.metadata()["dcr.step"] == "0"


def test_steps_published_from_tensors_and_as_state_keep_dcrs_format(files, tmp_path):
    root = str(tmp_path / "root")
    run_publish(root, files["steps"][0], 0, options=opts(tmp_path))
    assert Catalog(Root(root)).manifest(0).source is None
    for r, step, options in ((root, 0, None), (files["root"], 1, ReceiveOptions(as_state=True))):
        out = tmp_path / f"m{step}.safetensors"
        run_materialize(r, step, str(out), options=options)
        with safe_open(str(out), "np") as f:
            assert f.metadata()["dcr.step"] == str(step)
        assert_bits_equal(read_state(out), files["steps"][step])
    out = tmp_path / "m2.safetensors"
    dcr("materialize", files["root"], "--step", 2, "--out", out, "--as-state", check=0)
    with safe_open(str(out), "np") as f:
        assert f.metadata()["dcr.step"] == "2"


def _flip(path, offset: int) -> None:
    data = bytearray(open(path, "rb").read())
    data[offset] ^= 0x01
    open(path, "wb").write(bytes(data))


def test_verify_file_says_whether_a_file_is_exactly_a_step_and_names_the_first_difference(files, tmp_path):
    root, paths = files["root"], files["paths"]
    ok = dcr("verify", root, "--file", paths[1], "--step", 1, check=0)
    assert ok.stdout.strip() == f"{paths[1]} is exactly step 1"
    report = json.loads(dcr("verify", root, "--file", paths[1], "--step", 1, "--json", check=0).stdout)
    assert report["exact"] and report["tensors"] == len(files["steps"][1])
    # another step (its file's metadata differs too): the header, then the first tensor whose bits differ
    one_line_error(dcr("verify", root, "--file", paths[1], "--step", 2), 5, "is not step 2: its header differs",
              "; tensor ", "bits differ from step 2's", "more differences")
    # one bit flipped in one tensor's data
    flipped = tmp_path / "flipped.safetensors"
    shutil.copyfile(paths[1], flipped)
    with safe_open(str(flipped), "np") as f:
        name = sorted(f.keys())[5]
    from storage.local.safetensors import SafetensorsCheckpoint

    with SafetensorsCheckpoint(flipped) as ck:
        at = ck.data_offset(name)
    _flip(flipped, at)
    line = one_line_error(dcr("verify", root, "--file", flipped, "--step", 1), 5, f"tensor {name!r}", "bits differ")
    assert "header" not in line
    # the header changed (a metadata value, same length): named, and the tensors said to be the step's
    changed = tmp_path / "header.safetensors"
    data = open(paths[1], "rb").read()
    assert data.count(b'"format":"pt"') == 1
    changed.write_bytes(data.replace(b'"format":"pt"', b'"format":"np"'))
    one_line_error(dcr("verify", root, "--file", changed, "--step", 1), 5, "its header differs from the published one",
              "every tensor's bits are the step's")
    # a receiver's state file: DCR's own header over the step's bits
    state = tmp_path / "s.safetensors"
    run_receive(root, "rx", str(state), 1)
    one_line_error(dcr("verify", root, "--file", state, "--step", 1), 5, "header differs", "every tensor's bits are the step's")
    # a step published from tensors: no header to compare, the tensors are
    mem = str(tmp_path / "mem")
    run_publish(mem, files["steps"][0], 0, options=opts(tmp_path))
    out = dcr("verify", mem, "--file", paths[0], "--step", 0, check=0).stdout
    assert "holds exactly step 0's tensors" in out
    one_line_error(dcr("verify", mem, "--file", paths[1], "--step", 0), 5, "bits differ")
    one_line_error(dcr("verify", root, "--file", paths[1]), 2, "--step")


def test_verify_file_of_a_sharded_directory(sharded, tmp_path):
    root, dirs = sharded["root"], sharded["dirs"]
    assert dcr("verify", root, "--file", dirs[2], "--step", 2, check=0).stdout.strip() == f"{dirs[2]} is exactly step 2"
    copy = tmp_path / "copy"
    shutil.copytree(dirs[2], copy)
    (copy / INDEX_NAME).write_text((copy / INDEX_NAME).read_text().replace("  ", "    "))
    one_line_error(dcr("verify", root, "--file", copy, "--step", 2), 5, f"{INDEX_NAME} differs",
              "every tensor's bits are the step's")
    shutil.copyfile(dirs[2] / INDEX_NAME, copy / INDEX_NAME)
    shard = sorted(p for p in os.listdir(copy) if p.endswith(".safetensors"))[1]
    os.remove(copy / shard)
    one_line_error(dcr("verify", root, "--file", copy, "--step", 2), 5, f"{shard} is missing")
    one_line_error(dcr("verify", root, "--file", dirs[2] / shard, "--step", 2), 5, "not a directory")


def test_materialize_replaces_its_own_output_but_not_a_trainers_file(files, sharded, tmp_path):
    root, paths = files["root"], files["paths"]
    trainer = tmp_path / "trainer.safetensors"
    shutil.copyfile(paths[0], trainer)  # byte for byte step 0, but not DCR's output
    before = trainer.read_bytes()
    with pytest.raises(UsageError, match="was not written by dcr materialize"):
        run_materialize(root, 1, str(trainer))
    assert trainer.read_bytes() == before
    out = tmp_path / "m.safetensors"
    run_materialize(root, 0, str(out))
    run_materialize(root, 1, str(out))  # its own output
    write_safetensors(out, files["steps"][2])  # a trainer wrote over it since: no longer DCR's
    with pytest.raises(UsageError, match="was not written by dcr materialize"):
        run_materialize(root, 1, str(out))
    run_materialize(root, 1, str(trainer), force=True)
    assert sha(trainer) == sha(paths[1])
    hf = tmp_path / "hf"  # a trainer's sharded directory
    shutil.copytree(sharded["dirs"][0], hf)
    before = tree(hf)
    with pytest.raises(UsageError, match="model-00001-of-00003.safetensors: exists and was not written by dcr"):
        run_materialize(sharded["root"], 1, str(hf))
    assert tree(hf) == before
    run_materialize(sharded["root"], 1, str(hf), force=True)
    assert tree(hf) == tree(sharded["dirs"][1])
    run_materialize(sharded["root"], 2, str(hf))  # its own output now
    assert tree(hf) == tree(sharded["dirs"][2])


SWAP_POINTS = [  # point -> the directory holds the new step afterwards
    ("receive.tensor-staged@2", False), ("receive.staged", False), ("receive.swap-journaled", False),
    ("receive.swapped", True), ("receive.replaced", True),
]


def _materialized_dir(sharded, tmp_path, step: int):
    """A model directory (with a file that is not the checkpoint's) holding ``step``, materialized."""
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    run_materialize(sharded["root"], step, str(out))
    return out, lambda s: {**tree(sharded["dirs"][s]), "config.json": sha(out / "config.json")}


def _leftovers(out) -> list[str]:
    return sorted(n for n in os.listdir(out.parent) if n.startswith(f".{out.name}") and n != f".{out.name}.dcr")


@pytest.mark.faults(component="process", outcome="kill -9 at a reported point of a directory materialize: the directory "
                    "holds the old step or the new one whole, never shards of both; a rerun finishes without --force")
@pytest.mark.parametrize("point,at_new", sweep(SWAP_POINTS, {"receive.swapped"}), ids=[p for p, _ in SWAP_POINTS])
def test_a_directory_materialize_killed_at_each_point_leaves_one_whole_step(sharded, tmp_path, point, at_new):
    out, expect = _materialized_dir(sharded, tmp_path, 1)
    kill_at(point, "materialize", sharded["root"], "--step", 2, "--out", out, "--io-workers", 1)
    assert tree(out) == expect(2 if at_new else 1)  # what a server started now loads: one whole step
    assert not materialized.foreign(str(out), True)  # still DCR's output, whichever step it holds
    dcr("materialize", sharded["root"], "--step", 2, "--out", out, check=0)  # no --force
    assert tree(out) == expect(2)
    assert _leftovers(out) == []
    run_materialize(sharded["root"], 0, str(out))  # its record vouches for what it holds
    assert tree(out) == expect(0)


@pytest.mark.faults(component="process", outcome="without a directory exchange, dying between the two renames leaves "
                    "no directory (never a mix); the next materialize puts the new step in place")
def test_without_an_exchange_a_materialize_cut_between_its_renames_is_finished_by_the_next(sharded, tmp_path, monkeypatch):
    out, expect = _materialized_dir(sharded, tmp_path, 1)
    monkeypatch.setattr(dir_swap, "exchange", lambda a, b: False)  # a platform or filesystem without renameat2's
    with events.failpoints("receive.moved-aside=raise"), pytest.raises(events.FailpointError):
        run_materialize(sharded["root"], 2, str(out))
    assert not out.exists()  # the old step aside, the new one beside it: a reader finds no directory
    run_materialize(sharded["root"], 0, str(out))  # the cut-off swap finished first, then step 0 in its place
    assert tree(out) == expect(0)
    assert _leftovers(out) == []
    run_materialize(sharded["root"], 2, str(out))
    assert tree(out) == expect(2)


@pytest.mark.faults(component="process", outcome="dying between the renames of two shards leaves the old step whole; "
                    "the rerun needs no --force")
def test_a_directory_materialize_dying_between_two_renames_leaves_the_old_step(sharded, tmp_path, monkeypatch):
    out, expect = _materialized_dir(sharded, tmp_path, 1)
    replace, renamed = os.replace, []

    def dies_at_the_second(src, dst, *args, **kwargs):
        renamed.append(dst)
        if len(renamed) == 2:
            raise events.FailpointError("killed between two renames")
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", dies_at_the_second)
    with pytest.raises(events.FailpointError):
        run_materialize(sharded["root"], 2, str(out))
    monkeypatch.undo()
    assert tree(out) == expect(1)
    run_materialize(sharded["root"], 2, str(out))
    assert tree(out) == expect(2)


def test_a_directory_materialize_that_fails_leaves_the_directory_as_it_was(sharded, tmp_path):
    out, expect = _materialized_dir(sharded, tmp_path, 1)
    with events.failpoints("receive.tensor-staged@2=fail"), pytest.raises(events.FailpointFault):
        run_materialize(sharded["root"], 2, str(out))
    assert tree(out) == expect(1)
    assert _leftovers(out) == []


def test_a_damaged_source_layout_is_refused_and_a_mirror_copies_it_checked(files, tmp_path):
    mirror = str(tmp_path / "mirror")
    run_mirror(files["root"], mirror)
    run_materialize(mirror, 2, str(tmp_path / "m.safetensors"))
    assert sha(tmp_path / "m.safetensors") == sha(files["paths"][2])
    m = Catalog(Root(mirror)).manifest(2)
    key = os.path.join(mirror, layout.source_key(2, m.attempt))
    data = open(key, "rb").read()
    assert b'\\"pt\\"' in data
    open(key, "wb").write(data.replace(b'\\"pt\\"', b'\\"PT\\"', 1))  # the same size, another digest
    one_line_error(dcr("verify", mirror, "--step", 2), 5, layout.SOURCE, "digest")
    with pytest.raises(IntegrityError, match="source layout does not match"):
        run_materialize(mirror, 2, str(tmp_path / "n.safetensors"))
    assert not (tmp_path / "n.safetensors").exists()
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
    with pytest.raises(IntegrityError, match="source layout does not match"):
        run_mirror(mirror, str(tmp_path / "mirror2"), step=2)


def test_the_layout_names_every_byte(files):
    """What a person reads in the bucket: each file's header text, its size and its tensors."""
    root = files["root"]
    m = Catalog(Root(root)).manifest(0)
    doc = json.loads(open(os.path.join(root, layout.source_key(0, m.attempt)), "rb").read())
    assert doc["format"] == "dcr-source-layout" and doc["kind"] == "file"
    (f,) = doc["files"]
    raw = open(files["paths"][0], "rb").read()
    assert f["bytes"] == len(raw) and f["header"].encode() == raw[8 : 8 + f["header_bytes"]]
    assert np.frombuffer(raw[:8], "<u8")[0] == f["header_bytes"]


def test_a_file_whose_header_changes_while_it_is_published_keeps_no_layout(tmp_path, monkeypatch):
    from flows.publish.pipeline import PublishSteps
    from tests.support.steps import patch_step

    ck = chain_of_steps(1, seed=12, dtypes=["BF16", "I32"])[0]
    path = tmp_path / "c.safetensors"
    write_safetensors(path, ck, {"format": "pt"})

    def rewritten(real, plan, *args, **kwargs):  # the trainer saves again (another header) before the manifest
        data = path.read_bytes()
        path.write_bytes(data.replace(b'"format":"pt"', b'"format":"np"'))
        return real(plan, *args, **kwargs)

    patch_step(monkeypatch, PublishSteps, "write_manifest", rewritten)
    root = publish_files(tmp_path, [path])
    m = Catalog(Root(root)).manifest(0)
    assert m.source is None and "changed while it was published" in m.producer["source_layout"]
    out = tmp_path / "m.safetensors"
    run_materialize(root, 0, str(out))
    assert_bits_equal(read_state(out), ck)


@pytest.mark.parametrize("in_place", [False, True], ids=["rewrite", "in-place"])
def test_a_receive_starts_from_a_materialized_file_its_record_vouches_for(files, tmp_path, in_place):
    """``dcr materialize`` then ``dcr receive --state`` on that file: its header names no step, its
    record beside it does, so the receive goes on from there (step 0 -> 2: a keyframe then a delta)
    and the state equals a dense load of step 2; ``verify_state`` reads the same record. Once the
    file is rewritten by anything else the record no longer vouches and the file is refused."""
    from flows.receive.verify_state import verify_state
    from storage.local import state

    out = str(tmp_path / "m.safetensors")
    run_materialize(files["root"], 0, out)
    assert state.peek_origin(out)[:2] == (0, Catalog(Root(files["root"])).manifest(0).policy_digest)
    checked = verify_state(out)  # raises on any difference
    assert (checked.step, checked.tensors) == (0, len(files["steps"][0]))
    r = run_receive(files["root"], "from-materialized", out, 2, options=ReceiveOptions(in_place=in_place))
    assert r.step == 2
    assert_bits_equal(read_state(out), files["steps"][2])
    assert state.peek_step(out) == 2

    other = str(tmp_path / "o.safetensors")
    run_materialize(files["root"], 0, other)
    shutil.copyfile(files["paths"][1], other)  # rewritten by something else: the record vouches no more
    before = open(other, "rb").read()
    with pytest.raises(StateMismatchError, match="not a DCR receiver state"):
        run_receive(files["root"], "from-materialized", other, 2)
    assert open(other, "rb").read() == before
