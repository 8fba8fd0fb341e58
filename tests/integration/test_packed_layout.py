"""The packed step layout (manifest schema 3): stored chunks of many tensors share pack objects, so
a step's objects and a receive's GETs follow its bytes, not its tensor count; every chunk is still
checked against its digest, old (one object per chunk) steps still read, and a chain mixing both
refits exactly."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dcr_core.errors import IntegrityError
from storage import layout
from storage.manifest import Manifest
from storage.stats import io_stats
from tests.support.cli import dcr, one_line_error
from tests.support.helpers import (
    assert_bits_equal,
    file_bytes,
    nasty_checkpoint,
    next_step,
    read_state,
    write_safetensors,
)
from tests.support.kill import kill_at
from tests.support.publishing import publish_file

MIB = 1 << 20


def _manifest(root, step: int) -> tuple[Manifest, str]:
    marker = json.loads(open(os.path.join(root, layout.commit_key(step))).read())
    key = layout.manifest_key(step, marker["attempt"])
    return Manifest.from_json(open(os.path.join(root, key), "rb").read(), key), marker["attempt"]


def _objects(root, step: int) -> list[str]:
    d = os.path.join(root, layout.step_dir(step))
    return sorted(os.path.relpath(os.path.join(p, f), d) for p, _, fs in os.walk(d) for f in fs)


def _many_small(seed: int, n: int) -> dict[str, torch.Tensor]:
    """``n`` small BF16 expert-like matrices and a few norms: a MoE checkpoint in miniature."""
    g = torch.Generator().manual_seed(seed)
    out = {f"model.layers.{i // 24}.mlp.experts.{i % 24}.up_proj.weight":
           torch.randint(-32768, 32767, (4, 16), generator=g, dtype=torch.int16).view(torch.bfloat16) for i in range(n)}
    out["model.norm.weight"] = torch.ones(16, dtype=torch.bfloat16)
    return out


def test_a_packed_chain_refits_exactly_forward_backward_and_from_nothing(tmp_path):
    """Every dtype, special values, 0-d and empty tensors, sizes off the chunk grid: packs of 4 KiB
    (many packs, chunks of one tensor spread over several), receivers forward, backward and from
    nothing match the dense checkpoints bit for bit."""
    root = tmp_path / "bucket"
    cks = [nasty_checkpoint(seed=3, big=40)]
    for s in range(1, 4):
        cks.append(next_step(cks[-1], seed=s, fraction=0.2))
    for s, ck in enumerate(cks):
        publish_file(tmp_path, root, ck, s, "--pack-bytes", 4096)
    m, _ = _manifest(root, 2)
    assert m.schema_version == 3 and len(m.packs()) > 1
    assert not any(o.endswith("zarr.json") for o in _objects(root, 2))  # no per-array metadata in a packed store
    state = tmp_path / "state.safetensors"
    for target in (3, 1, 3, 0, 2):
        dcr("receive", root, "--receiver", "r", "--state", state, "--step", target, check=0)
        assert_bits_equal(read_state(state), cks[target])
    fresh = tmp_path / "fresh.safetensors"
    dcr("receive", root, "--receiver", "f", "--state", fresh, check=0)
    assert_bits_equal(read_state(fresh), cks[3])
    out = tmp_path / "m.safetensors"
    dcr("materialize", root, "--step", 2, "--out", out, check=0)
    assert file_bytes(out) == file_bytes(tmp_path / "c2.safetensors")  # byte for byte the published file
    dcr("verify", root, check=0)


def test_a_chain_mixing_steps_of_both_layouts_refits_exactly(tmp_path):
    """Steps 0-1 written one object per chunk (``--pack-bytes 0``, as before packs), 2-3 packed: a
    receiver crosses the boundary both ways, and the old steps keep their zarr.json per array."""
    root = tmp_path / "bucket"
    cks = [nasty_checkpoint(seed=5)]
    for s in range(1, 4):
        cks.append(next_step(cks[-1], seed=10 + s))
    for s, ck in enumerate(cks):
        publish_file(tmp_path, root, ck, s, *(("--pack-bytes", 0) if s < 2 else ()))
    assert _manifest(root, 1)[0].schema_version == 2 and _manifest(root, 3)[0].schema_version == 3
    assert any(o.endswith("/zarr.json") for o in _objects(root, 1))
    state = tmp_path / "state.safetensors"
    for target in (1, 3, 0, 3, 1):
        dcr("receive", root, "--receiver", "r", "--state", state, "--step", target, check=0)
        assert_bits_equal(read_state(state), cks[target])
    dcr("verify", root, check=0)


@pytest.mark.parametrize("n", [8, 2000])
def test_objects_per_delta_and_gets_per_receive_follow_the_bytes(tmp_path, n):
    """The bound the layout is built for: objects written for a delta step <= 16 + stored bytes / 8 MiB,
    GETs of one receive <= 16 + pulled bytes / 8 MiB, at 8 and at 2,000 tensors (the per-object layout
    wrote 2 objects and read 1-2 per changed tensor)."""
    root = tmp_path / "bucket"
    ck0 = _many_small(0, n) if n > 8 else {f"w.{i}": torch.randn(300, 64).to(torch.bfloat16) for i in range(n)}
    ck1 = next_step(ck0, seed=1, fraction=0.03, unchanged=0.0)
    publish_file(tmp_path, root, ck0, 0)
    state = tmp_path / "state.safetensors"
    dcr("receive", root, "--receiver", "r", "--state", state, check=0)
    publish_file(tmp_path, root, ck1, 1)
    m, _ = _manifest(root, 1)
    stored = m.summary()["bytes_stored"]
    assert len(_objects(root, 1)) <= 16 + stored / (8 * MIB), _objects(root, 1)
    before = io_stats(str(root))
    dcr("receive", root, "--receiver", "r", "--state", state, check=0)
    used = io_stats(str(root)).minus(before)
    assert_bits_equal(read_state(state), ck1)
    assert used.gets <= 16 + used.bytes_read / (8 * MIB), used


@pytest.mark.faults(component="bad input or damaged bucket", outcome="a one-line error naming the pack and the chunk's bytes in it; the state file unchanged")
def test_a_damaged_or_truncated_pack_is_refused_naming_it_and_the_state_is_unchanged(tmp_path):
    root = tmp_path / "bucket"
    ck0 = nasty_checkpoint(seed=7)
    ck1 = next_step(ck0, seed=8, fraction=0.3)
    publish_file(tmp_path, root, ck0, 0)
    state = tmp_path / "state.safetensors"
    dcr("receive", root, "--receiver", "r", "--state", state, check=0)
    publish_file(tmp_path, root, ck1, 1)
    m, attempt = _manifest(root, 1)
    (pack,) = m.packs()
    path = os.path.join(root, layout.store_key(1, attempt, layout.pack_key(pack)))
    good = open(path, "rb").read()
    held = file_bytes(state)
    for bad in (good[:5] + bytes([good[5] ^ 1]) + good[6:], good[: len(good) - 3]):
        with open(path, "wb") as f:
            f.write(bad)
        out = dcr("receive", root, "--receiver", "r", "--state", state)
        one_line_error(out, out.returncode, pack)
        assert out.returncode != 0 and file_bytes(state) == held
        assert dcr("verify", root, "--step", 1).returncode != 0
    with open(path, "wb") as f:
        f.write(good)
    dcr("receive", root, "--receiver", "r", "--state", state, check=0)
    assert_bits_equal(read_state(state), ck1)


@pytest.mark.faults(component="bad input or damaged bucket", outcome="the manifest is refused naming the field")
@pytest.mark.parametrize("edit, says", [
    (lambda d, t: d["packs"].append("zzzz"), "pack name"),
    (lambda d, t: t["chunks"]["offset"].__setitem__(0, t["chunks"]["offset"][0] + 1), "do not tile"),
    (lambda d, t: t["chunks"]["pack"].__setitem__(0, 99), "pack"),
    (lambda d, t: t["chunks"].pop("offset"), "pack/offset"),
    (lambda d, t: d.__setitem__("schema_version", 2), "packs belong to schema 3"),
])
def test_a_manifest_whose_packs_do_not_add_up_is_refused(tmp_path, edit, says):
    root = tmp_path / "bucket"
    publish_file(tmp_path, root, nasty_checkpoint(seed=9), 0)
    m, _ = _manifest(root, 0)
    d = json.loads(m.to_json())
    t = next(t for t in d["tensors"].values() if t["chunks"]["indices"])
    edit(d, t)
    with pytest.raises(IntegrityError, match=says):
        Manifest.from_dict(d, "m")


def test_coalesced_reads_take_one_get_per_run_of_wanted_chunks_in_a_pack():
    """A pack's chunks read by one ranged GET per run: gaps of unwanted bytes up to MAX_GAP_BYTES are
    read through, larger ones split the run, and so does the span limit."""
    from storage import chunk_io

    class E:
        def __init__(self, offsets, sizes):
            self.offsets, self.sizes = offsets, sizes
            self.stored_nbytes = sizes

        def offset_at(self, pos):
            return self.offsets[pos]

        def stored_at(self, pos):
            return layout.pack_key("0123abcd.000000"), pos, "", self.sizes[pos]

    class M:
        step, attempt = 1, "0" * 32

    class R:
        url = "memory://coalesce"

    gap = chunk_io.MAX_GAP_BYTES
    e = E([0, 100, 300 + gap, 400 + 3 * gap], [100, 200, 100, 100])
    reads = chunk_io._plan_ranges(R(), [(M, e, p) for p in range(4)])
    assert reads[0] is reads[1] is reads[2] and reads[3] is not reads[2]
    assert (reads[0].start, reads[0].end, reads[3].start, reads[3].end) == (0, 400 + gap, 400 + 3 * gap, 500 + 3 * gap)
    # 70,000 tiny chunks back to back in one pack (a MoE delta): one GET, however many jobs
    n = 70_000
    tiny = E([100 * i for i in range(n)], [100] * n)
    assert len({id(r) for r in chunk_io._plan_ranges(R(), [(M, tiny, p) for p in range(n)])}) == 1
    # chunks applied far apart (more than RANGE_SPREAD_BYTES of other chunks between): two reads
    far = E([0, 100], [100, 100])
    big = E([None], [chunk_io.RANGE_SPREAD_BYTES + 1])
    reads = chunk_io._plan_ranges(R(), [(M, far, 0), (M, big, 0), (M, far, 1)])
    assert reads[1] is None and reads[0] is not reads[2]


@pytest.mark.faults(component="publisher", outcome="nothing committed, receivers stay on the last step; a rerun commits the step bit-exact")
@pytest.mark.parametrize("point", ["pack.stored@1", "pack.stored@3"])
def test_kill_9_while_packs_are_written_commits_nothing_and_a_rerun_is_exact(tmp_path, point):
    root = tmp_path / "bucket"
    ck0 = nasty_checkpoint(seed=11)
    ck1 = next_step(ck0, seed=12, fraction=0.3)
    publish_file(tmp_path, root, ck0, 0)
    p = tmp_path / "c1.safetensors"
    write_safetensors(p, ck1)
    kill_at(point, "publish", root, p, "--step", 1, "--chunk-bytes", 256, "--pack-bytes", 2048, "--no-cache")
    assert not os.path.exists(os.path.join(root, layout.commit_key(1)))
    state = tmp_path / "state.safetensors"
    dcr("receive", root, "--receiver", "r", "--state", state, check=0)
    assert_bits_equal(read_state(state), ck0)  # the half-written step is invisible
    publish_file(tmp_path, root, ck1, 1, "--pack-bytes", 2048)
    dcr("receive", root, "--receiver", "r", "--state", state, check=0)
    assert_bits_equal(read_state(state), ck1)
