"""``dcr publish`` of a checkpoint file: no torch, no pass over the baseline of its own, and still
never a wrong delta.

- A safetensors file (or HF directory) is published without importing torch (a fresh process, as
  users run it); only DCP directories and layout files, whose readers need torch, import it.
- The baseline cache is taken without hashing it first when its stamp still describes it, and is
  checked as the encode uses it: a cache damaged behind a stamp that still matches (a rewrite the
  file's timestamps do not show) fails that check, the attempt is discarded and the step is
  published again from a baseline rebuilt from ROOT, exactly.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from flows import run_materialize, run_publish
from flows.options import DELTA_CODECS, PublishOptions
from flows.publish import baseline as ps
from flows.publish import encode
from flows.publish.pipeline import PublishSteps
from storage import layout
from storage.catalog import Catalog
from storage.local.safetensors import SafetensorsCheckpoint
from storage.root import Root
from tests.integration.test_read_only_imports import _loaded
from tests.support.cli import evolve, small_checkpoint
from tests.support.helpers import chain_of_steps, write_safetensors
from tests.support.publishing import baseline_cache_file
from tests.support.steps import patch_step


def test_publishing_a_safetensors_file_does_not_import_torch(tmp_path):
    root, cache = tmp_path / "root", tmp_path / "cache"
    ck = small_checkpoint(0)
    os.environ["DCR_CACHE_DIR"] = str(cache)
    try:
        for step in range(3):  # a keyframe, a delta from the cache, a delta from a rebuilt baseline
            path = tmp_path / f"c{step}.safetensors"
            write_safetensors(path, ck)
            if step == 2:
                for f in glob.glob(str(cache / "*" / "*")):
                    os.remove(f)
            assert "torch" not in _loaded("publish", root, path, "--step", step), step
            ck = evolve(ck, step + 1)
    finally:
        del os.environ["DCR_CACHE_DIR"]
    assert Catalog(Root(str(root))).committed_steps() == [0, 1, 2]


@pytest.mark.parametrize("codec,lanes", [("sparse", False), ("cond", False), ("sparse", True), ("cond", True)])
def test_a_cache_damaged_behind_a_matching_stamp_is_caught_while_encoding_and_rebuilt(tmp_path, monkeypatch, codec, lanes):
    if lanes:  # every chunk hashed on the hash lanes, beside the encoding (as large chunks are)
        monkeypatch.setattr(encode, "LANE_MIN_BYTES", 0)
    root = str(tmp_path / "root")
    cache = tmp_path / "cache"
    opts = PublishOptions(chunk_bytes=256, cache_dir=str(cache), overwrite_above=1.0, delta_codec=DELTA_CODECS[codec])
    steps = chain_of_steps(3, seed=7)
    files = []
    for i, s in enumerate(steps):
        files.append(str(tmp_path / f"c{i}.safetensors"))
        write_safetensors(files[-1], s)
    run_publish(root, files[0], 0, options=opts)
    run_publish(root, files[1], 1, options=opts)

    # Flip one bit of the cached baseline in place, then stamp the damaged file as if its
    # timestamps had not moved: only the check made while encoding can tell now.
    path = baseline_cache_file(cache)
    with SafetensorsCheckpoint(path) as ck:
        name = max(ck.infos, key=lambda n: ck.infos[n].nbytes)
        offset = ck.data_offset(name)
        meta = ck.metadata
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    ps.write_stamp(path, int(meta["dcr.step"]), meta["dcr.policy_digest"])

    calls = []
    patch_step(monkeypatch, PublishSteps, "load_baseline", lambda real, *a: calls.append(a[2:]) or real(*a))
    rebuilds = []
    real_rebuild = ps.rebuild
    monkeypatch.setattr(ps, "rebuild", lambda *a: rebuilds.append(1) or real_rebuild(*a))
    res = run_publish(root, files[2], 2, options=opts)
    assert calls == [(), (True,)]  # trusted by its stamp, then checked in full after the mismatch
    assert rebuilds == [1]
    cat = Catalog(Root(root))
    assert cat.manifest(2).attempt == res.attempt
    assert os.listdir(os.path.join(root, layout.attempts_dir(2))) == [res.attempt]  # the bad one removed
    for n, e in cat.manifest(2).tensors.items():
        assert e.base_digest == cat.manifest(1).tensors[n].digest
    out = tmp_path / "m.safetensors"
    run_materialize(root, 2, str(out))
    with SafetensorsCheckpoint(out) as got:
        back = {n: got.bits(n) for n in got.infos}
    with SafetensorsCheckpoint(files[2]) as want:
        assert set(back) == set(want.infos)
        assert all(np.array_equal(back[n], want.bits(n)) for n in want.infos)
