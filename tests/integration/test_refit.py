"""End to end: publish a keyframe and a chain of deltas, refit receivers every way, read with stock zarr.

Every comparison is on raw bits. Each test runs against a local directory ROOT and a ``memory://``
ROOT (memory roots live in this process; every test uses its own name).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import uuid

import numpy as np
import pytest
import torch
import zarr
from safetensors.torch import load_file, save_file

from dcr_core.delta import Encoding
from flows import run_materialize, run_publish, run_receive
from flows.options import DELTA_CODECS, PublishOptions
from storage import layout
from storage.catalog import Catalog
from storage.root import Root
from tests.support.helpers import (
    assert_bits_equal,
    chain_of_steps,
    differs,
    nasty_checkpoint,
    next_step,
    raw_bits,
    raw_bytes,
)

N_STEPS = 7  # a keyframe and 6 deltas
BIG = 32  # rows of a frozen embedding: keyframes cost more than every delta together
CHUNK_BYTES = 256


def make_root(kind: str, base) -> str:
    if kind == "local":
        return str(base / "root")
    return f"memory://t-{uuid.uuid4().hex}"


def drop_root(root: str) -> None:
    """Free a memory root (the process-wide store; fs.rm is quadratic in the number of objects)."""
    if root.startswith("memory://"):
        r = Root(root)
        prefix = r.path.rstrip("/") + "/"
        for key in [k for k in r.fs.store if k.startswith(prefix)]:
            del r.fs.store[key]
        r.fs.pseudo_dirs[:] = [d for d in r.fs.pseudo_dirs if d != r.path and not d.startswith(prefix)]


def options(cache_dir, **kw) -> PublishOptions:
    kw.setdefault("overwrite_above", 1.0)  # xor for every changed tensor (0-d ones too)
    return PublishOptions(chunk_bytes=kw.pop("chunk_bytes", CHUNK_BYTES), cache_dir=str(cache_dir), **kw)


def publish_all(root, steps, opts, first: int = 0, keyframes=()) -> list:
    return [
        run_publish(root, s, first + i, keyframe=(first + i) in keyframes, options=opts)
        for i, s in enumerate(steps)
    ]


def read_state(path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def materialized(root, step, path) -> dict[str, torch.Tensor]:
    run_materialize(root, step, str(path))
    return read_state(path)


# The column-block chain is the slowest (about 60 s of refits): it runs with the slow suite (make
# test-slow); tests/unit/test_core.py, test_cond.py and test_module_refit.py cover blocks by default.
@pytest.fixture(scope="module", params=["local", pytest.param("memory", marks=pytest.mark.backend), "local-cond", pytest.param("local-blocks", marks=pytest.mark.slow)])
def chain(request, tmp_path_factory):
    """A ROOT with a keyframe and 6 deltas of nasty data, and each step's state file. ``-cond``:
    deltas coded against the old bits (``dcr.cond``), half of the changes ulp steps. ``-blocks``:
    wide tensors too, stored in 4 column blocks (``column_blocks=4``: chunks that are not flat ranges)."""
    kind, _, flavour = request.param.partition("-")
    codec = flavour if flavour in DELTA_CODECS else ""
    base = tmp_path_factory.mktemp(f"chain-{request.param}")
    root = make_root(kind, base)
    blocks = flavour == "blocks"
    steps = chain_of_steps(N_STEPS, seed=11, big=BIG, ulps=0.5 if codec else 0.0, wide=blocks)
    extra = {"delta_codec": DELTA_CODECS[codec]} if codec else {}
    if blocks:
        extra["column_blocks"] = 4
    results = publish_all(root, steps, options(base / "cache", **extra))
    states = {}
    for n in range(N_STEPS):
        states[n] = base / f"state-{n}.safetensors"
        run_materialize(root, n, str(states[n]))
    yield {"root": root, "steps": steps, "results": results, "states": states, "base": base, "codec": codec,
           "flavour": flavour, "reference": request.param == "local"}
    drop_root(root)


def copy_state(chain, step, tmp_path, name="rx.safetensors"):
    dst = tmp_path / name
    shutil.copyfile(chain["states"][step], dst)
    return dst


# --------------------------------------------------------------------------------------------------
# the chain


def test_the_chain_is_a_keyframe_then_invertible_deltas_that_each_change_something(chain):
    results, steps = chain["results"], chain["steps"]
    assert [r.kind for r in results] == ["keyframe"] + ["delta"] * (N_STEPS - 1)
    assert [r.base_step for r in results] == [None] + list(range(N_STEPS - 1))
    for i, r in enumerate(results[1:], start=1):
        assert r.summary["invertible"] is True
        changed = differs(steps[i - 1], steps[i])
        assert 0 < len(changed) < len(steps[i])
        assert r.summary["tensors_changed"] == len(changed)
        assert r.summary["bytes_stored"] < results[0].summary["bytes_stored"]
    cat = Catalog(Root(chain["root"]))
    assert cat.committed_steps() == list(range(N_STEPS))
    assert cat.latest_committed() == N_STEPS - 1


def test_the_test_data_covers_every_hazard():
    steps = chain_of_steps(3, seed=11)
    a, b = steps[0], steps[1]
    changed = differs(a, b)
    assert {n for n in a if a[n].dim() == 0 and n in changed} == {n for n in a if a[n].dim() == 0}
    assert any(a[n].numel() == 0 for n in a) and any(a[n].dim() == 3 and a[n].numel() == 0 for n in a)
    # +0.0 <-> -0.0 flips and NaN payload changes happen, and compare equal/NaN as floats.
    za, zb = raw_bits(a["BF16.vec"])[3:5], raw_bits(b["BF16.vec"])[3:5]
    assert za.tolist() == [0x0000, 0x8000] and zb.tolist() == [0x8000, 0x0000]
    assert raw_bits(a["BF16.vec"])[0] == 0x7FC1 and raw_bits(b["BF16.vec"])[0] != 0x7FC1
    assert torch.isnan(b["BF16.vec"][0].float())


@pytest.mark.parametrize("step", range(N_STEPS))
def test_materialize_of_every_step_equals_the_published_tensors(chain, step, tmp_path):
    assert_bits_equal(materialized(chain["root"], step, tmp_path / "m.safetensors"), chain["steps"][step])
    assert_bits_equal(read_state(chain["states"][step]), chain["steps"][step])


def test_materialize_without_a_step_gives_the_latest(chain, tmp_path):
    r = run_materialize(chain["root"], None, str(tmp_path / "m.safetensors"))
    assert r.step == N_STEPS - 1
    assert_bits_equal(read_state(tmp_path / "m.safetensors"), chain["steps"][-1])


@pytest.mark.parametrize("target", range(N_STEPS))
def test_receiving_with_no_state_loads_the_keyframe_then_every_delta(chain, target, tmp_path):
    state = tmp_path / "fresh.safetensors"
    r = run_receive(chain["root"], "rx-fresh", str(state), target)
    assert r.from_step is None and r.step == target
    assert r.moves == ["keyframe:0"] + [f"forward:{s}" for s in range(1, target + 1)]
    assert_bits_equal(read_state(state), chain["steps"][target])
    assert "rx-fresh" in Catalog(Root(chain["root"])).receivers(target)


def test_receiving_the_latest_is_the_default_target(chain, tmp_path):
    state = copy_state(chain, 2, tmp_path)
    r = run_receive(chain["root"], "rx", str(state))
    assert r.step == N_STEPS - 1 and r.from_step == 2
    assert_bits_equal(read_state(state), chain["steps"][-1])


def walks(chain, forward: bool) -> list[tuple[int, int]]:
    """The (from, to) refits a chain's tests make. The plain local chain walks every pair: planning
    and applying do not depend on the codec, the chunk grid or the backend. The others (another
    codec, column blocks, a memory ROOT) walk what reaches each of their deltas in both directions:
    every step to the latest, one step back from each, and the whole chain back."""
    if chain["reference"]:
        return [(m, n) for m in range(N_STEPS) for n in (range(m + 1, N_STEPS) if forward else range(m))]
    if forward:
        return [(m, N_STEPS - 1) for m in range(N_STEPS - 1)]
    return [(m, m - 1) for m in range(1, N_STEPS)] + [(N_STEPS - 1, 0)]


def test_forward_refit_from_every_earlier_step_reaches_every_later_step_exactly(chain, tmp_path):
    for m, n in walks(chain, forward=True):
        state = copy_state(chain, m, tmp_path)
        r = run_receive(chain["root"], "rx-fwd", str(state), n)
        assert r.from_step == m
        assert r.moves == [f"forward:{s}" for s in range(m + 1, n + 1)], (m, n)
        assert r.bytes_pulled == sum(chain["results"][s].summary["bytes_stored"] for s in range(m + 1, n + 1))
        assert_bits_equal(read_state(state), chain["steps"][n])


def test_backward_refit_restores_every_bit_of_every_earlier_step(chain, tmp_path):
    backward = 0
    for m, n in walks(chain, forward=False):
        state = copy_state(chain, m, tmp_path)
        r = run_receive(chain["root"], "rx-back", str(state), n)
        if chain["flavour"] == "":
            assert r.moves == [f"backward:{s}" for s in range(m, n, -1)], (m, n)
        # dcr.cond frames carry more fixed overhead on these tiny chunks, and the wide tensors of the
        # column-block chain change a lot per step: the planner may find the keyframe cheaper for
        # long walks back, but the short ones go backward
        backward += r.moves == [f"backward:{s}" for s in range(m, n, -1)]
        assert_bits_equal(read_state(state), chain["steps"][n])
    assert backward >= N_STEPS - 1


def test_one_state_file_walks_back_and_forth_through_the_chain(chain, tmp_path):
    state = tmp_path / "walker.safetensors"
    for n in [3, 0, 6, 2, 5, 5, 1, 4, 0, 6]:
        run_receive(chain["root"], "walker", str(state), n)
        assert_bits_equal(read_state(state), chain["steps"][n])


def test_receiving_the_step_already_held_changes_no_byte(chain, tmp_path):
    state = copy_state(chain, 4, tmp_path)
    before = state.read_bytes()
    r = run_receive(chain["root"], "rx", str(state), 4)
    assert r.moves == [] and r.bytes_pulled == 0
    assert state.read_bytes() == before


# --------------------------------------------------------------------------------------------------
# overwrite encoding, second keyframe


@pytest.mark.parametrize("kind", ["local", pytest.param("memory", marks=pytest.mark.backend)])
def test_overwrite_step_round_trips_forward_and_backward_across_it_uses_the_keyframe(kind, tmp_path):
    root = make_root(kind, tmp_path)
    try:
        steps = chain_of_steps(N_STEPS, seed=21, big=BIG)
        for i, s in enumerate(steps):
            opts = options(tmp_path / "cache", overwrite_above=0.0 if i == 3 else 1.0)
            run_publish(root, s, i, options=opts)
        cat = Catalog(Root(root))
        m3 = cat.manifest(3)
        encodings = {e.encoding for e in m3.tensors.values()}
        assert encodings == {Encoding.OVERWRITE, Encoding.UNCHANGED}
        assert m3.summary()["invertible"] is False and cat.step_info(3).invertible is False
        for name in differs(steps[2], steps[3]):
            assert m3.tensors[name].encoding is Encoding.OVERWRITE

        # Forward across the overwrite step.
        state = tmp_path / "s.safetensors"
        run_receive(root, "rx", str(state), 2)
        r = run_receive(root, "rx", str(state), 6)
        assert r.moves == ["forward:3", "forward:4", "forward:5", "forward:6"]
        assert_bits_equal(read_state(state), steps[6])
        # Backward, not crossing it: plain backward moves.
        r = run_receive(root, "rx", str(state), 3)
        assert r.moves == ["backward:6", "backward:5", "backward:4"]
        assert_bits_equal(read_state(state), steps[3])
        # Backward across it: the keyframe path.
        r = run_receive(root, "rx", str(state), 2)
        assert r.moves == ["keyframe:0", "forward:1", "forward:2"]
        assert_bits_equal(read_state(state), steps[2])
        run_receive(root, "rx", str(state), 5)
        r = run_receive(root, "rx", str(state), 1)
        assert r.moves == ["keyframe:0", "forward:1"]
        assert_bits_equal(read_state(state), steps[1])
    finally:
        drop_root(root)


@pytest.mark.parametrize("kind", ["local", pytest.param("memory", marks=pytest.mark.backend)])
def test_a_second_keyframe_mid_chain_starts_a_new_lineage(kind, tmp_path):
    root = make_root(kind, tmp_path)
    try:
        steps = chain_of_steps(3, seed=31, big=BIG)
        # Step 3 is a keyframe with a changed schema (a tensor dropped, one added, one reshaped).
        s3 = next_step(steps[-1], 99)
        s3.pop("I16.mat")
        s3["new.tensor"] = nasty_checkpoint(5, dtypes=["BF16"], odd_names=False)["BF16.cube"]
        s3["F32.vec"] = s3["F32.vec"][:36].reshape(6, 6).clone()
        steps.append(s3)
        steps.append(next_step(s3, 100))
        steps.append(next_step(steps[-1], 101))
        opts = options(tmp_path / "cache")
        results = publish_all(root, steps, opts, keyframes={3})
        assert [r.kind for r in results] == ["keyframe", "delta", "delta", "keyframe", "delta", "delta"]
        assert [r.base_step for r in results] == [None, 0, 1, None, 3, 4]

        state = tmp_path / "s.safetensors"
        run_receive(root, "rx", str(state), 1)
        r = run_receive(root, "rx", str(state), 5)
        assert r.moves == ["keyframe:3", "forward:4", "forward:5"]
        assert_bits_equal(read_state(state), steps[5])
        r = run_receive(root, "rx", str(state), 3)
        assert r.moves == ["backward:5", "backward:4"]
        assert_bits_equal(read_state(state), steps[3])
        r = run_receive(root, "rx", str(state), 2)
        assert r.moves == ["keyframe:0", "forward:1", "forward:2"]
        assert_bits_equal(read_state(state), steps[2])
        for n, expected in enumerate(steps):
            assert_bits_equal(materialized(root, n, tmp_path / "m.safetensors"), expected)
    finally:
        drop_root(root)


# --------------------------------------------------------------------------------------------------
# the publisher's baseline cache


def _cache_file(cache_dir) -> str:
    files = glob.glob(os.path.join(str(cache_dir), "*", "baseline.safetensors"))
    assert len(files) == 1, files
    return files[0]


def _break_by_deleting(path, saved):
    os.remove(path)


def _break_by_truncating(path, saved):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])


def _break_with_garbage(path, saved):
    open(path, "wb").write(os.urandom(4096))


def _break_by_flipping_a_bit_keeping_metadata(path, saved):
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    t = tensors["BF16.mat"]
    bits = raw_bits(t)
    bits[5] ^= 0x0001
    tensors["BF16.mat"] = torch.from_numpy(bits.view(np.uint8)).view(torch.bfloat16).reshape(t.shape)
    save_file(tensors, path, metadata=meta)


def _break_with_a_stale_step(path, saved):
    shutil.copyfile(saved[0], path)  # the baseline of an older step, intact and self-consistent


@pytest.mark.parametrize(
    "damage",
    [
        _break_by_deleting,
        _break_by_truncating,
        _break_with_garbage,
        _break_by_flipping_a_bit_keeping_metadata,
        _break_with_a_stale_step,
    ],
    ids=lambda f: f.__name__[1:],
)
@pytest.mark.parametrize("kind", ["local", pytest.param("memory", marks=pytest.mark.backend)])
def test_a_damaged_baseline_cache_is_rebuilt_from_root_and_deltas_stay_exact(kind, damage, tmp_path):
    root = make_root(kind, tmp_path)
    try:
        cache = tmp_path / "cache"
        steps = chain_of_steps(3, seed=41)
        opts = options(cache)
        saved = []
        for i, s in enumerate(steps):
            if i >= 2:
                damage(_cache_file(cache), saved)
            run_publish(root, s, i, options=opts)
            keep = tmp_path / f"cache-copy-{i}"
            shutil.copyfile(_cache_file(cache), keep)
            saved.append(keep)
        cat = Catalog(Root(root))
        for i in range(1, len(steps)):
            m = cat.manifest(i)
            for name, e in m.tensors.items():
                assert e.base_digest == cat.manifest(i - 1).tensors[name].digest, (i, name)
        state = tmp_path / "s.safetensors"
        run_receive(root, "rx", str(state), 1)
        r = run_receive(root, "rx", str(state), 2)
        assert r.moves == ["forward:2"]
        assert_bits_equal(read_state(state), steps[2])
        assert_bits_equal(materialized(root, 2, tmp_path / "m.safetensors"), steps[2])
    finally:
        drop_root(root)


def test_publishing_without_a_cache_rebuilds_every_baseline_from_root(tmp_path):
    root = make_root("local", tmp_path)
    steps = chain_of_steps(3, seed=43)
    publish_all(root, steps, options(tmp_path / "cache", use_cache=False))
    assert not os.path.exists(tmp_path / "cache")
    for n in range(3):
        assert_bits_equal(materialized(root, n, tmp_path / "m.safetensors"), steps[n])


def test_publishing_from_safetensors_files_and_sharded_directories_is_exact(tmp_path):
    root = make_root("local", tmp_path)
    steps = chain_of_steps(3, seed=45)
    opts = options(tmp_path / "cache")
    save_file({k: v.contiguous() for k, v in steps[0].items()}, str(tmp_path / "s0.safetensors"))
    run_publish(root, str(tmp_path / "s0.safetensors"), 0, options=opts)
    shard_dir = tmp_path / "s1"
    shard_dir.mkdir()
    names = sorted(steps[1])
    half = len(names) // 2
    save_file({k: steps[1][k].contiguous() for k in names[:half]}, str(shard_dir / "model-00001-of-00002.safetensors"))
    save_file({k: steps[1][k].contiguous() for k in names[half:]}, str(shard_dir / "model-00002-of-00002.safetensors"))
    run_publish(root, str(shard_dir), 1, options=opts)
    run_publish(root, steps[2], 2, options=opts)
    for n in range(3):
        assert_bits_equal(materialized(root, n, tmp_path / "m.safetensors"), steps[n])


# --------------------------------------------------------------------------------------------------
# stock zarr


def _store_path(root: str, step: int) -> str:
    m = Catalog(Root(root)).manifest(step)
    return os.path.join(root, layout.store_dir(step, m.attempt))


@pytest.mark.parametrize("blocks", [1, 4], ids=["runs", "column-blocks"])
def test_stock_zarr_reads_every_keyframe_array_as_the_exact_raw_bits(tmp_path, blocks):
    root = make_root("local", tmp_path)
    steps = chain_of_steps(2, seed=51, wide=True)
    # One object per chunk and a zarr.json per array (--pack-bytes 0): what zarr opens with no project
    # code at all; a packed step opens through dcr_zarr_codec.open_tensor (tests/integration/test_open_step.py).
    publish_all(root, steps, options(tmp_path / "cache", column_blocks=blocks, pack_bytes=0))
    m = Catalog(Root(root)).manifest(0)
    assert any(e.grid.is_blocked for e in m.tensors.values()) == (blocks > 1)
    group = zarr.open_group(_store_path(root, 0), mode="r")
    assert set(group.array_keys()) == {e.array for e in m.tensors.values()}
    for name, t in steps[0].items():
        e = m.tensors[name]
        arr = group[e.array]
        assert arr.shape == tuple(t.shape), name
        assert arr.attrs["dcr"]["tensor"] == name
        data = np.asarray(arr[...])
        assert data.dtype == raw_bits(t).dtype, name
        assert data.shape == tuple(t.shape), name
        assert data.tobytes() == raw_bytes(t), name


@pytest.mark.parametrize("blocks", [1, 4], ids=["runs", "column-blocks"])
@pytest.mark.parametrize("overwrite_above", [1.0, 0.0])
def test_stock_zarr_reads_a_delta_store_as_the_stored_masks(tmp_path, overwrite_above, blocks):
    root = make_root("local", tmp_path)
    steps = chain_of_steps(2, seed=53, wide=True)
    run_publish(root, steps[0], 0, options=options(tmp_path / "cache", column_blocks=blocks, pack_bytes=0))
    run_publish(root, steps[1], 1, options=options(tmp_path / "cache", overwrite_above=overwrite_above,
                                                   column_blocks=blocks, pack_bytes=0))  # stock zarr: see above
    m = Catalog(Root(root)).manifest(1)
    group = zarr.open_group(_store_path(root, 1), mode="r")
    for name, new in steps[1].items():
        e = m.tensors[name]
        old_bits, new_bits = raw_bits(steps[0][name]), raw_bits(new)
        data = np.asarray(group[e.array][...]).reshape(-1)
        assert data.dtype == new_bits.dtype
        if e.encoding is Encoding.XOR:
            expected = old_bits ^ new_bits
        elif e.encoding is Encoding.UNCHANGED:
            expected = np.zeros_like(new_bits)
        else:
            assert e.encoding is Encoding.OVERWRITE
            # The new values in every chunk that changed; zeros (the fill value) elsewhere.
            expected = np.zeros_like(new_bits)
            grid = e.grid
            for i in e.chunks.indices:
                grid.put(expected, i, grid.take(new_bits, i))
        assert data.tobytes() == expected.tobytes(), (name, e.encoding)
    if overwrite_above == 0.0:
        assert any(e.encoding is Encoding.OVERWRITE for e in m.tensors.values())


# --------------------------------------------------------------------------------------------------
# determinism


def _store_objects(root: str, step: int) -> dict[str, bytes]:
    """The step's store as objects, a packed chunk as if it were its own (its bytes cut from its
    pack: which pack holds it depends on which upload finished first)."""
    r = Root(root)
    m = Catalog(r).manifest(step)
    prefix = layout.store_dir(step, m.attempt)
    base = r.full(prefix)
    out = {}
    for p in r.fs.find(base):
        rel = p[len(base):].lstrip("/")
        if not rel.startswith(layout.PACKS + "/"):
            out[rel] = r.fs.cat_file(p)
    for entries in (m.tensors, m.snapshot):
        for e in entries.values():
            for pos in range(e.n_stored):
                offset = e.offset_at(pos)
                if offset is not None:
                    rel, index, _, nbytes = e.stored_at(pos)
                    data = r.read_range(f"{prefix}/{rel}", offset, nbytes)
                    out[layout.chunk_key(e.array, e.grid.grid_index(index))] = data
    return out


def test_publishing_the_same_checkpoints_to_fresh_roots_gives_identical_objects(tmp_path):
    steps = chain_of_steps(4, seed=61)
    roots = [str(tmp_path / "a"), str(tmp_path / "b"), f"memory://t-{uuid.uuid4().hex}"]
    try:
        for k, root in enumerate(roots):
            publish_all(root, steps, options(tmp_path / f"cache-{k}", io_workers=[8, 1, 3][k]))
        for step in range(len(steps)):
            objects = [_store_objects(root, step) for root in roots]
            assert len(objects[0]) > 10
            assert any("/c/" in name or name.endswith("/c") for name in objects[0])
            assert objects[1] == objects[0] and objects[2] == objects[0], step
            tensors = []
            for root in roots:
                r = Root(root)
                marker = Catalog(r).marker(step)
                listed = json.loads(r.read(marker.manifest_key))["tensors"]
                for t in listed.values():  # where a chunk lies in the packs: see _store_objects
                    t["chunks"].pop("pack", None), t["chunks"].pop("offset", None)
                tensors.append(listed)
            assert tensors[1] == tensors[0] and tensors[2] == tensors[0], step
            assert len({Catalog(Root(root)).marker(step).policy_digest for root in roots}) == 1
    finally:
        drop_root(roots[2])
