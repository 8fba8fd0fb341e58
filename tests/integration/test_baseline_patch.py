"""The publisher's baseline cache is patched in place after a delta, never left wrong.

A delta encoded against the cache file logs the positions and new bits of every changed element;
after the commit only those are written into the cache (same inode), with the new step in its
header. The patched cache must equal, byte for byte, the checkpoint just published (the dense
reference: what a whole copy would have written), for every dtype, special value and odd shape,
and with the encodings that read tensors whole (``overwrite_above`` below 1, column blocks). A log
that is damaged, or a cache whose header has no room, falls back to a whole copy; a publisher
killed halfway through the patch leaves a cache the next delta does not trust (it is hashed and
rebuilt), and that delta is exact.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import torch

from dcr_core import digest as digest_mod
from dcr_core import events
from dcr_core.dtypes import TensorInfo
from dcr_core.errors import IntegrityError
from flows import run_materialize, run_publish
from flows.options import PublishOptions
from flows.publish import baseline as ps
from flows.publish import encode
from storage.catalog import Catalog
from storage.local import patch_log
from storage.local.safetensors import SafetensorsCheckpoint, StreamingSafetensorsWriter
from storage.root import Root
from tests.support.cli import dcr
from tests.support.helpers import chain_of_steps, write_safetensors
from tests.support.kill import kill_at
from tests.support.publishing import baseline_cache_file


def _file_bits(path) -> dict[str, bytes]:
    with SafetensorsCheckpoint(path) as ck:
        return {n: ck.bits(n).tobytes() for n in ck.infos}


def _publish_chain(tmp_path, opts: PublishOptions, n: int = 4, seed: int = 3):
    root = str(tmp_path / "root")
    files, kept = [], []
    for i, s in enumerate(chain_of_steps(n, seed=seed, wide=True, ulps=0.5)):
        files.append(str(tmp_path / f"c{i}.safetensors"))
        write_safetensors(files[-1], s)
        with events.listening(lambda p, f: kept.append(f) if p == "publish.baseline-kept" else None):
            run_publish(root, files[-1], i, options=opts)
    return root, files, kept


@pytest.mark.parametrize("overwrite_above,column_blocks,lanes", [(1.0, 1, False), (1.0, 1, True), (0.3, 1, False),
                                                                 (1.0, 4, False)],
                         ids=["streamed", "streamed-hash-lanes", "whole-tensors", "column-blocks"])
def test_every_delta_patches_the_cache_in_place_to_the_bits_of_the_step(tmp_path, monkeypatch, overwrite_above,
                                                                        column_blocks, lanes):
    if lanes:
        monkeypatch.setattr(encode, "LANE_MIN_BYTES", 0)
    cache = tmp_path / "cache"
    opts = PublishOptions(chunk_bytes=128, cache_dir=str(cache), overwrite_above=overwrite_above,
                          column_blocks=column_blocks)
    root = str(tmp_path / "root")
    files = []
    inodes, patched = [], []
    for i, s in enumerate(chain_of_steps(4, seed=3, wide=True, ulps=0.5)):
        files.append(str(tmp_path / f"c{i}.safetensors"))
        write_safetensors(files[-1], s)
        kept: list[dict] = []
        with events.listening(lambda p, f, kept=kept: kept.append(f) if p == "publish.baseline-kept" else None):
            res = run_publish(root, files[-1], i, options=opts)
        path = baseline_cache_file(cache)
        inodes.append(os.stat(path).st_ino)
        patched.append(kept[-1].get("patched"))
        assert _file_bits(path) == _file_bits(files[-1]), f"step {i}: the cache is not the published bits"
        with SafetensorsCheckpoint(path) as ck:
            assert ck.metadata["dcr.step"] == str(i) and ck.metadata["dcr.policy_digest"] == res.policy_digest
        assert not glob.glob(os.path.join(os.path.dirname(path), "*.patch*")), "the log is removed once applied"
    assert patched[0] is None  # a keyframe copies the checkpoint whole
    assert all(p and p > 0 for p in patched[1:]), patched  # every delta patched the changed elements only
    assert inodes[1] == inodes[2] == inodes[3], "patched in place, not replaced"
    # And the deltas computed from the patched caches are exact: the last step rebuilt from ROOT.
    out = tmp_path / "m.safetensors"
    run_materialize(root, 3, str(out))
    assert _file_bits(out) == _file_bits(files[3])


def test_a_damaged_log_is_never_applied_and_the_cache_is_copied_whole(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    opts = PublishOptions(chunk_bytes=128, cache_dir=str(cache))
    real_apply = patch_log.apply
    seen = []

    def damage_then_apply(path, target, meta, progress=None):
        with open(path, "r+b") as f:  # one bit of a value flipped after the log was finished
            f.seek(os.path.getsize(path) - 40)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 1]))
        before = _file_bits(target)
        with pytest.raises(IntegrityError, match="trailer"):
            real_apply(path, target, meta, progress)
        assert _file_bits(target) == before, "nothing applied from a damaged log"
        seen.append(path)
        return real_apply(path, target, meta, progress)  # raises again: the publisher copies instead

    monkeypatch.setattr(patch_log, "apply", damage_then_apply)
    root, files, kept = _publish_chain(tmp_path, opts, n=3)
    assert len(seen) == 2
    assert all("patched" not in k for k in kept), "copied whole after the damaged log"
    assert _file_bits(baseline_cache_file(cache)) == _file_bits(files[-1])


def test_a_cache_header_without_room_is_copied_whole(tmp_path):
    cache = tmp_path / "cache"
    opts = PublishOptions(chunk_bytes=128, cache_dir=str(cache))
    root = str(tmp_path / "root")
    files = [str(tmp_path / f"c{i}.safetensors") for i in range(3)]
    for f, s in zip(files, chain_of_steps(3, seed=5)):
        write_safetensors(f, s)
    for i in range(2):
        run_publish(root, files[i], i, options=opts)
    # Fill the cache header's spare room (as a cache written by an older DCR): step 1 -> 10 does not fit.
    path = baseline_cache_file(cache)
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        body = f.read(n).rstrip(b" ")
        spare = n - len(body)
        assert spare >= 9
        full = body.replace(b'"__metadata__":{', b'"__metadata__":{"pad":"' + b"y" * (spare - 9) + b'",', 1)
        assert len(full) == n
        f.seek(8)
        f.write(full)
    with SafetensorsCheckpoint(path) as ck:
        ps.write_stamp(path, 1, ck.metadata["dcr.policy_digest"])
    kept = []
    with events.listening(lambda p, f: kept.append(f) if p == "publish.baseline-kept" else None):
        run_publish(root, files[2], 10, options=opts)
    assert "patched" not in kept[-1], "no room for the new step: copied whole"
    assert _file_bits(baseline_cache_file(cache)) == _file_bits(files[2])
    with SafetensorsCheckpoint(baseline_cache_file(cache)) as ck:
        assert ck.metadata["dcr.step"] == "10"


@pytest.mark.faults(component="publisher", outcome="killed while patching its baseline cache: the next delta hashes the cache, rebuilds it from ROOT and is exact")
def test_a_publisher_killed_while_patching_its_cache_leaves_no_trusted_wrong_baseline(tmp_path):
    cache = tmp_path / "cache"
    env = {"DCR_CACHE_DIR": str(cache)}
    root = tmp_path / "root"
    steps = chain_of_steps(3, seed=9)
    files = [tmp_path / f"c{i}.safetensors" for i in range(3)]
    for f, s in zip(files, steps):
        write_safetensors(f, s)
    dcr("publish", root, files[0], "--step", 0, "--chunk-bytes", 128, check=0, env=env)
    kill_at("publish.baseline-patched-record@3", "publish", root, files[1], "--step", 1, "--chunk-bytes", 128,
            env=env)
    path = baseline_cache_file(cache)
    mixed = _file_bits(path)
    assert mixed != _file_bits(files[0]) and mixed != _file_bits(files[1]), "killed halfway through the patch"
    with pytest.raises(OSError):
        os.getxattr(path, ps.STAMP_XATTR)  # unstamped from the first patched byte on
    dcr("publish", root, files[2], "--step", 2, "--chunk-bytes", 128, check=0, env=env)
    out = tmp_path / "m.safetensors"
    run_materialize(str(root), 2, str(out))
    assert _file_bits(out) == _file_bits(files[2])
    assert _file_bits(baseline_cache_file(cache)) == _file_bits(files[2])


# -- the log itself ---------------------------------------------------------------------------------


def _target(tmp_path, n=1000):
    rng = np.random.default_rng(0)
    bits = {"a": rng.integers(0, 2**16, n, dtype=np.uint16), "b": rng.integers(0, 2**32, 7, dtype=np.uint32)}
    infos = [TensorInfo("a", "BF16", (n,)), TensorInfo("b", "F32", (7,))]
    path = str(tmp_path / "t.safetensors")
    w = StreamingSafetensorsWriter(path, infos, {"dcr.step": "1"}, header_room=64)
    w.write("a", bits["a"])
    w.write("b", bits["b"])
    w.commit()
    return path, bits


def test_a_log_applies_exactly_the_values_it_holds_and_the_metadata(tmp_path):
    path, bits = _target(tmp_path)
    w = patch_log.PatchLogWriter(str(tmp_path / "p.patch"), {"to": 2})
    w.add("a", 1000, np.array([0, 5, 999]), np.array([1, 2, 3], np.uint16))
    w.add("b", 7, np.array([6]), np.array([0xFFFFFFFF], np.uint32))
    assert w.finish() == str(tmp_path / "p.patch")
    assert patch_log.read_head(str(tmp_path / "p.patch")) == {"to": 2}
    assert patch_log.apply(str(tmp_path / "p.patch"), path, {"dcr.step": "10"}) == 4
    want_a, want_b = bits["a"].copy(), bits["b"].copy()
    want_a[[0, 5, 999]] = [1, 2, 3]
    want_b[6] = 0xFFFFFFFF
    with SafetensorsCheckpoint(path) as ck:
        assert ck.bits("a").tobytes() == want_a.tobytes() and ck.bits("b").tobytes() == want_b.tobytes()
        assert ck.metadata["dcr.step"] == "10"


@pytest.mark.parametrize("bad", ["unknown tensor", "outside", "itemsize", "cut off"])
def test_a_log_that_does_not_fit_its_target_is_refused(tmp_path, bad):
    path, bits = _target(tmp_path)
    log = str(tmp_path / "p.patch")
    w = patch_log.PatchLogWriter(log, {})
    if bad == "unknown tensor":
        w.add("c", 1000, np.array([1]), np.array([1], np.uint16))
    elif bad == "outside":
        w.add("a", 2000, np.array([1500]), np.array([1], np.uint16))
    elif bad == "itemsize":
        w.add("a", 1000, np.array([1]), np.array([1], np.uint64))
    if bad == "cut off":
        w.add("a", 1000, np.array([1]), np.array([1], np.uint16))
        w._f.flush()
        os.replace(w.tmp, log)  # never finished: no end record, no trailer
    else:
        w.finish()
    with pytest.raises(IntegrityError, match="p.patch"):
        patch_log.apply(log, path, {"dcr.step": "2"})
    with SafetensorsCheckpoint(path) as ck:
        assert ck.bits("a").tobytes() == bits["a"].tobytes() and ck.metadata["dcr.step"] == "1"


def test_a_log_that_cannot_be_written_costs_a_whole_copy_never_the_publish(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    opts = PublishOptions(chunk_bytes=128, cache_dir=str(cache))
    real_put = patch_log.PatchLogWriter._put
    calls = []

    def put(self, data):
        calls.append(1)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return real_put(self, data)

    monkeypatch.setattr(patch_log.PatchLogWriter, "_put", put)
    root, files, kept = _publish_chain(tmp_path, opts, n=2)
    assert len(calls) >= 5, "the fault landed while logging"
    assert "patched" not in kept[-1]
    assert _file_bits(baseline_cache_file(cache)) == _file_bits(files[-1])
    assert not glob.glob(os.path.join(os.path.dirname(baseline_cache_file(cache)), "*patch*")), "the dropped log is removed"


def test_stale_logs_are_removed_and_a_live_publishers_log_is_left_alone(tmp_path):
    cache = tmp_path / "cache"
    opts = PublishOptions(chunk_bytes=128, cache_dir=str(cache))
    root, files, _ = _publish_chain(tmp_path, opts, n=2)
    directory = os.path.dirname(baseline_cache_file(cache))
    stale = os.path.join(directory, f"{ps.BASELINE_FILE}.dead{ps.PATCH_LOG_SUFFIX}")
    live = os.path.join(directory, f".{ps.BASELINE_FILE}.other{ps.PATCH_LOG_SUFFIX}.tmp-1")
    for p in (stale, live):
        with open(p, "wb") as f:
            f.write(b"x")
    old = os.stat(stale).st_mtime - ps.STALE_LOG_SECONDS - 60
    os.utime(stale, (old, old))
    write_safetensors(tmp_path / "c2.safetensors", chain_of_steps(3, seed=3, wide=True, ulps=0.5)[2])
    run_publish(root, str(tmp_path / "c2.safetensors"), 2, options=opts)
    assert not os.path.exists(stale) and os.path.exists(live)


def _two_steps(tmp_path, new_of=None):
    steps = chain_of_steps(2, seed=4)
    if new_of is not None:
        steps[1] = new_of(steps[0])
    files = [str(tmp_path / f"c{i}.safetensors") for i in range(2)]
    for f, s in zip(files, steps):
        write_safetensors(f, s)
    return files


def _publish_kept(root, path, step, opts) -> dict:
    kept: list[dict] = []
    with events.listening(lambda p, f: kept.append(f) if p == "publish.baseline-kept" else None):
        run_publish(root, path, step, options=opts)
    return kept[-1]


def test_a_step_that_changes_most_elements_copies_the_cache_instead_of_logging_it(tmp_path, monkeypatch):
    monkeypatch.setattr(ps, "PATCH_LOG_FLOOR", 0)
    opts = PublishOptions(chunk_bytes=128, cache_dir=str(tmp_path / "cache"))
    files = _two_steps(tmp_path, lambda s: {  # every element's lowest bit flipped (bools stay bools)
        n: (t.reshape(-1).view(torch.uint8) ^ 1).view(t.dtype).reshape(t.shape) for n, t in s.items()})
    root = str(tmp_path / "root")
    run_publish(root, files[0], 0, options=opts)
    assert "patched" not in _publish_kept(root, files[1], 1, opts), "past the log's limit: a whole copy"
    assert _file_bits(baseline_cache_file(tmp_path / "cache")) == _file_bits(files[1])


def test_a_cache_another_publisher_is_reading_is_replaced_not_patched_under_it(tmp_path):
    opts = PublishOptions(chunk_bytes=128, cache_dir=str(tmp_path / "cache"))
    files = _two_steps(tmp_path)
    root = str(tmp_path / "root")
    run_publish(root, files[0], 0, options=opts)
    with SafetensorsCheckpoint(baseline_cache_file(tmp_path / "cache")) as reading:  # a publisher encoding against it
        ps.share_cache(reading)
        assert "patched" not in _publish_kept(root, files[1], 1, opts)
        assert {n: reading.bits(n).tobytes() for n in reading.infos} == _file_bits(files[0]), "its bits never moved"
    assert _file_bits(baseline_cache_file(tmp_path / "cache")) == _file_bits(files[1])


def test_a_cache_changed_after_the_encode_is_not_patched(tmp_path, monkeypatch):
    opts = PublishOptions(chunk_bytes=128, cache_dir=str(tmp_path / "cache"))
    files = _two_steps(tmp_path)
    root = str(tmp_path / "root")
    run_publish(root, files[0], 0, options=opts)
    path = baseline_cache_file(tmp_path / "cache")

    def touch(point, fields):
        if point == "publish.committed":  # another writer between the encode and the patch
            os.utime(path, ns=(1, 1))

    with events.listening(touch):
        kept = _publish_kept(root, files[1], 1, opts)
    assert "patched" not in kept
    assert _file_bits(baseline_cache_file(tmp_path / "cache")) == _file_bits(files[1])


def test_a_hash_that_fails_on_a_lane_fails_the_publish_and_commits_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(encode, "LANE_MIN_BYTES", 0)
    opts = PublishOptions(chunk_bytes=128, cache_dir=str(tmp_path / "cache"))
    files = _two_steps(tmp_path)
    root = str(tmp_path / "root")
    run_publish(root, files[0], 0, options=opts)
    real = digest_mod.BlockHasher.update
    calls = []

    def update(self, bits):
        calls.append(1)
        if len(calls) == 7:
            raise MemoryError("injected")
        return real(self, bits)

    monkeypatch.setattr(digest_mod.BlockHasher, "update", update)
    with pytest.raises(MemoryError, match="injected"):
        run_publish(root, files[1], 1, options=opts)
    monkeypatch.undo()
    assert Catalog(Root(root)).committed_steps() == [0]
