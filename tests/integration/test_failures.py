"""Bad input, damaged storage, crashes and races: a one-line error, and nothing changes."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dcr_core.digest import policy_digest
from dcr_core.errors import (
    DCRError,
    IntegrityError,
    InvalidCheckpointError,
    RootNotFoundError,
    SchemaMismatchError,
    StateMismatchError,
    StepConflictError,
    StepNotFoundError,
    UnsafeKeyError,
)
from flows import run_materialize, run_publish, run_receive
from flows.options import PublishOptions
from flows.publish.pipeline import PublishSteps
from storage import layout, reader
from storage.catalog import Catalog, manifest_digest
from storage.root import Root, open_root
from tests.support.helpers import (
    assert_bits_equal,
    assert_one_line,
    chain_of_steps,
    chunk_at,
    chunk_named,
    file_bytes,
    nasty_checkpoint,
    next_step,
    raw_bits,
    stored_chunks,
    tree_snapshot,
)
from tests.support.steps import patch_step

CHUNK_BYTES = 256

pytestmark = pytest.mark.faults(component="bad input or damaged bucket", outcome="a one-line error naming the object; ROOT and the state file unchanged")


def opts(tmp_path, **kw) -> PublishOptions:
    kw.setdefault("overwrite_above", 1.0)
    return PublishOptions(chunk_bytes=CHUNK_BYTES, cache_dir=str(tmp_path / "cache"), **kw)


def small(seed=0):
    """Every dtype, special values, odd shapes and names (see tests.helpers)."""
    return nasty_checkpoint(seed)


@pytest.fixture(scope="module")
def _published_template(tmp_path_factory):
    """Steps 0 (keyframe), 1 and 2 published once per module; tests get a private copy."""
    base = tmp_path_factory.mktemp("published")
    root = str(base / "root")
    steps = [small(1)]
    steps.append(next_step(steps[0], 2))
    steps.append(next_step(steps[1], 3))
    for i, s in enumerate(steps):
        run_publish(root, s, i, options=opts(base))
    return root, steps


@pytest.fixture
def published(tmp_path, _published_template):
    """A local ROOT with steps 0 (keyframe), 1 and 2 (a private copy), and their checkpoints."""
    template, steps = _published_template
    root = str(tmp_path / "root")
    shutil.copytree(template, root)
    return SimpleNamespace(root=root, steps=steps, tmp=tmp_path)


def snapshot(p) -> dict:
    return {"root": tree_snapshot(p.root), "cache": tree_snapshot(p.tmp / "cache")}


def write_checkpoint(path, tensors) -> str:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return str(path)


def store_files(p, step) -> list[str]:
    m = Catalog(Root(p.root)).manifest(step)
    base = os.path.join(p.root, layout.store_dir(step, m.attempt))
    out = []
    for dirpath, _d, files in os.walk(base):
        for f in files:
            if f != "zarr.json":
                out.append(os.path.join(dirpath, f))
    return sorted(out)


def received(p, step, name="state.safetensors"):
    state = p.tmp / name
    run_receive(p.root, "rx", str(state), step)
    return state


# --------------------------------------------------------------------------------------------------
# bad publisher input


def test_a_truncated_checkpoint_is_refused_and_root_is_untouched(published):
    p = published
    path = write_checkpoint(p.tmp / "next.safetensors", next_step(p.steps[2], 4))
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    before = snapshot(p)
    for cut in (1, 100, len(data) - 8 - n, len(data) - 12, len(data) - 5):
        open(path, "wb").write(data[: len(data) - cut])
        with pytest.raises(InvalidCheckpointError) as ei:
            run_publish(p.root, path, 3, options=opts(p.tmp))
        assert_one_line(ei.value)
        assert path in str(ei.value)
    assert snapshot(p) == before
    assert Catalog(Root(p.root)).latest_committed() == 2


def _st(header: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + data


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x00" * 4,
        os.urandom(1000),
        struct.pack("<Q", 12) + b"not json!!!!",
        struct.pack("<Q", 2) + b"[]",
        struct.pack("<Q", 2 ** 60) + b"{}",
        _st(b'{"w": {"dtype": "F4", "shape": [1], "data_offsets": [0, 1]}}', b"\0"),
        _st(b'{"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 2]}}', b"\0" * 8),
        _st(b'{"w": {"dtype": "BF16", "shape": [-1], "data_offsets": [0, 0]}}', b""),
        _st(b'{"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}', b"\0" * 7),
        _st(b'{"w": {"dtype": "BF16", "shape": "x", "data_offsets": [0, 8]}}', b"\0" * 8),
    ],
    ids=[
        "empty", "short", "random", "bad-json", "not-object", "huge-header", "bad-dtype",
        "bad-offsets", "negative-dim", "data-truncated", "malformed-entry",
    ],
)
def test_a_garbage_checkpoint_is_refused_and_root_is_untouched(published, content):
    p = published
    path = p.tmp / "garbage.safetensors"
    path.write_bytes(content)
    before = snapshot(p)
    with pytest.raises(InvalidCheckpointError) as ei:
        run_publish(p.root, str(path), 3, options=opts(p.tmp))
    assert_one_line(ei.value)
    assert snapshot(p) == before


def test_a_missing_checkpoint_is_refused_and_root_is_untouched(published):
    p = published
    before = snapshot(p)
    for missing in (p.tmp / "nope.safetensors", p.tmp / "empty-dir"):
        if missing.name == "empty-dir":
            missing.mkdir()
        with pytest.raises(InvalidCheckpointError) as ei:
            run_publish(p.root, str(missing), 3, options=opts(p.tmp))
        assert_one_line(ei.value)
    assert snapshot(p) == before


def test_publishing_a_step_already_committed_is_a_conflict(published):
    p = published
    before = snapshot(p)
    for step in (0, 2):
        with pytest.raises(StepConflictError) as ei:
            run_publish(p.root, p.steps[2], step, options=opts(p.tmp))
        assert_one_line(ei.value)
        assert "already committed" in str(ei.value)
    assert snapshot(p) == before


def test_publishing_a_step_not_after_the_latest_is_a_conflict(tmp_path):
    root = str(tmp_path / "root")
    steps = chain_of_steps(2, seed=5)
    run_publish(root, steps[0], 10, options=opts(tmp_path))
    run_publish(root, steps[1], 20, options=opts(tmp_path))
    before = tree_snapshot(root)
    for step in (0, 11, 19):
        with pytest.raises(StepConflictError) as ei:
            run_publish(root, steps[1], step, options=opts(tmp_path))
        assert_one_line(ei.value)
        assert "20" in str(ei.value)
    assert tree_snapshot(root) == before


def _schema_variants(base: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    extra = dict(base)
    extra["brand.new"] = torch.zeros(3, dtype=torch.bfloat16)
    missing = dict(base)
    missing.pop("F32.vec")
    dtype = dict(base)
    dtype["F32.vec"] = base["F32.vec"].view(torch.int32).clone()  # same bits, other dtype
    shape = dict(base)
    shape["F32.mat"] = base["F32.mat"].reshape(11, 13).clone()  # same bits, other shape
    scalar = dict(base)
    scalar["I64.scalar"] = base["I64.scalar"].reshape(1).clone()  # 0-d -> (1,)
    return {"extra": extra, "missing": missing, "dtype": dtype, "shape": shape, "scalar": scalar}


@pytest.mark.parametrize("variant", ["extra", "missing", "dtype", "shape", "scalar"])
def test_a_schema_change_needs_a_keyframe(published, variant):
    p = published
    changed = _schema_variants(next_step(p.steps[2], 7))[variant]
    before = snapshot(p)
    with pytest.raises(SchemaMismatchError) as ei:
        run_publish(p.root, changed, 3, options=opts(p.tmp))
    assert_one_line(ei.value)
    assert "keyframe" in str(ei.value)
    assert snapshot(p) == before
    r = run_publish(p.root, changed, 3, keyframe=True, options=opts(p.tmp))
    assert r.kind == "keyframe" and r.base_step is None
    assert_bits_equal(load_file(str(received(p, 3))), changed)
    # And the next step is a delta on the new keyframe.
    after = next_step(changed, 8)
    assert run_publish(p.root, after, 4, options=opts(p.tmp)).base_step == 3
    assert_bits_equal(load_file(str(received(p, 4))), after)


# --------------------------------------------------------------------------------------------------
# bad receiver state


def test_a_state_file_with_altered_bits_is_refused_and_left_byte_for_byte(published):
    p = published
    state = received(p, 1)
    data = bytearray(state.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    body = 8 + n
    for offset in (body, body + (len(data) - body) // 2, len(data) - 1):
        altered = bytearray(data)
        altered[offset] ^= 0x01  # bool-safe: 0 <-> 1
        state.write_bytes(bytes(altered))
        for target in (2, 0, None):
            with pytest.raises(StateMismatchError) as ei:
                run_receive(p.root, "rx", str(state), target)
            assert_one_line(ei.value)
            assert str(state) in str(ei.value)
            assert state.read_bytes() == bytes(altered)


def test_a_state_file_whose_special_value_bits_changed_is_refused(published):
    """-0.0 for +0.0 and another NaN payload are different bits, hence a different state."""
    p = published
    state = received(p, 1)
    tensors = load_file(str(state))
    from safetensors import safe_open

    with safe_open(str(state), framework="pt") as f:
        meta = f.metadata()
    for flip in (0x8000, 0x0002):
        t = dict(tensors)
        bits = raw_bits(t["BF16.vec"])
        bits[3 if flip == 0x8000 else 0] ^= flip  # +0.0 -> -0.0; NaN 0x7FC1 payload
        t["BF16.vec"] = torch.from_numpy(bits.view(np.uint8)).view(torch.bfloat16).reshape(-1)
        save_file(t, str(state), metadata=meta)
        before = state.read_bytes()
        with pytest.raises(StateMismatchError) as ei:
            run_receive(p.root, "rx", str(state), 2)
        assert_one_line(ei.value)
        assert "BF16.vec" in str(ei.value)
        assert state.read_bytes() == before


@pytest.mark.parametrize("claim", ["99", "3", "abc", None])
def test_a_state_file_claiming_a_step_that_is_not_committed_is_refused(published, claim):
    p = published
    state = p.tmp / "claims.safetensors"
    meta = {} if claim is None else {"dcr.step": claim}
    save_file({k: v.contiguous() for k, v in p.steps[1].items()}, str(state), metadata=meta)
    before = state.read_bytes()
    with pytest.raises(StateMismatchError) as ei:
        run_receive(p.root, "rx", str(state), 2)
    assert_one_line(ei.value)
    assert state.read_bytes() == before


def test_a_state_file_holding_another_steps_bits_is_refused(published):
    p = published
    state = p.tmp / "liar.safetensors"
    save_file({k: v.contiguous() for k, v in p.steps[2].items()}, str(state), metadata={"dcr.step": "1"})
    before = state.read_bytes()
    with pytest.raises(StateMismatchError) as ei:
        run_receive(p.root, "rx", str(state), 0)
    assert_one_line(ei.value)
    assert state.read_bytes() == before


def test_a_truncated_state_file_is_refused_and_left_alone(published):
    p = published
    state = received(p, 1)
    data = state.read_bytes()
    state.write_bytes(data[:-3])
    with pytest.raises(InvalidCheckpointError) as ei:
        run_receive(p.root, "rx", str(state), 2)
    assert_one_line(ei.value)
    assert state.read_bytes() == data[:-3]


def test_receiving_a_step_that_is_not_committed_is_step_not_found(published, tmp_path):
    p = published
    state = received(p, 1)
    before = state.read_bytes()
    with pytest.raises(StepNotFoundError) as ei:
        run_receive(p.root, "rx", str(state), 7)
    assert_one_line(ei.value)
    assert state.read_bytes() == before
    with pytest.raises(RootNotFoundError) as ei:  # a ROOT that does not exist: said as such (exit 2), not a missing step
        run_receive(str(tmp_path / "empty-root"), "rx", str(tmp_path / "x.safetensors"))
    assert_one_line(ei.value)
    assert not (tmp_path / "x.safetensors").exists()


# --------------------------------------------------------------------------------------------------
# damaged ROOT


@pytest.mark.parametrize(
    "held,target,moves",
    [
        (None, 0, ["keyframe:0"]),
        (1, 2, ["forward:2"]),
        (2, 1, ["backward:2"]),
    ],
)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_corrupted_chunk_object_fails_the_refit_naming_it_and_the_state_is_unchanged(
    published, held, target, moves, where
):
    p = published
    state = p.tmp / "s.safetensors"
    if held is not None:
        run_materialize(p.root, held, str(state))
    plan = reader.plan_refit(open_root(p.root), held, target)
    assert [f"{m.direction.value}:{m.step}" for m in plan.moves] == moves
    files = store_files(p, plan.moves[0].step)  # chunks this refit must read
    victim = files[{"first": 0, "middle": len(files) // 2, "last": -1}[where]]
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2 if where != "last" else -1] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    before = file_bytes(state)
    with pytest.raises(IntegrityError) as ei:
        run_receive(p.root, "rx", str(state), target)
    assert_one_line(ei.value)
    rel = os.path.relpath(victim, p.root).replace(os.sep, "/")
    assert rel in str(ei.value)
    assert file_bytes(state) == before


def test_a_missing_chunk_object_fails_the_refit_naming_it(published):
    p = published
    state = received(p, 1)
    before = state.read_bytes()
    victim = store_files(p, 2)[0]
    os.remove(victim)
    with pytest.raises(IntegrityError) as ei:
        run_receive(p.root, "rx", str(state), 2)
    assert_one_line(ei.value)
    assert os.path.relpath(victim, p.root) in str(ei.value) and "missing" in str(ei.value)
    assert state.read_bytes() == before


def test_a_chunk_swapped_for_another_valid_chunk_is_caught_by_its_digest(published):
    p = published
    def stored(chunk):  # its bytes, where it lies (a pack's range, or its own object)
        path, offset, nbytes = chunk_at(p.root, 0, *chunk)
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(nbytes)

    sizes = {}
    for c in stored_chunks(p.root, 0):
        sizes.setdefault(chunk_at(p.root, 0, *c)[2], []).append(c)
    a, b = next(v[:2] for v in sizes.values() if len(v) >= 2 and stored(v[0]) != stored(v[1]))
    # Same stored size and a valid frame, but other bits: only the digest can tell.
    path, offset, _ = chunk_at(p.root, 0, *a)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(stored(b))
    with pytest.raises(IntegrityError) as ei:
        run_materialize(p.root, 0, str(p.tmp / "m.safetensors"))
    assert_one_line(ei.value)
    assert chunk_named(p.root, 0, *a) in str(ei.value) and "digest" in str(ei.value)
    assert not (p.tmp / "m.safetensors").exists()


def _marker_path(p, step) -> str:
    return os.path.join(p.root, layout.commit_key(step))


def _manifest_path(p, step) -> str:
    return os.path.join(p.root, Catalog(Root(p.root)).marker(step).manifest_key)


def test_an_edited_manifest_fails_its_digest_against_the_commit_marker(published):
    p = published
    path = _manifest_path(p, 2)
    d = json.loads(open(path, "rb").read())
    d["created_at"] = "1970-01-01T00:00:00Z"  # even a harmless edit
    open(path, "wb").write(json.dumps(d, indent=1).encode() + b"\n")
    state = received(p, 1)
    before = state.read_bytes()
    with pytest.raises(IntegrityError) as ei:
        run_receive(p.root, "rx", str(state), 2)
    assert_one_line(ei.value)
    assert "manifest digest" in str(ei.value)
    assert state.read_bytes() == before


def _rewrite_marker(p, marker_step, changes: dict) -> None:
    path = _marker_path(p, marker_step)
    d = json.loads(open(path, "rb").read())
    d.update(changes)
    os.chmod(path, 0o644)
    open(path, "wb").write(json.dumps(d, indent=1).encode() + b"\n")


@pytest.mark.parametrize(
    "changes,error",
    [
        ({"manifest": "../../../elsewhere/manifest.json"}, IntegrityError),
        ({"manifest": "attempts/0123456789abcdef0123456789abcdef/manifest.json"}, IntegrityError),
        ({"attempt": "../../000000000001/attempts/x"}, UnsafeKeyError),
        ({"attempt": "/etc/passwd"}, UnsafeKeyError),
        ({"step": 1}, IntegrityError),
        ({"format": "other"}, IntegrityError),
        ({"manifest_digest": "zz"}, IntegrityError),
    ],
    ids=["manifest-outside", "manifest-other-attempt", "attempt-traversal", "attempt-absolute", "wrong-step", "format", "digest"],
)
def test_a_forged_commit_marker_is_refused(published, changes, error):
    p = published
    _rewrite_marker(p, 2, changes)
    state = received(p, 1)
    before = state.read_bytes()
    with pytest.raises(error) as ei:
        run_receive(p.root, "rx", str(state), 2)
    assert_one_line(ei.value)
    assert isinstance(ei.value, IntegrityError)
    assert state.read_bytes() == before


def _forge_manifest(p, step, edit) -> None:
    """Edit a committed manifest and re-sign it: recompute its digest into the commit marker."""
    path = _manifest_path(p, step)
    d = json.loads(open(path, "rb").read())
    edit(d)
    data = json.dumps(d, indent=1).encode() + b"\n"
    open(path, "wb").write(data)
    _rewrite_marker(p, step, {"manifest_digest": manifest_digest(data)})


@pytest.mark.parametrize("array", ["../x", "..", "a/b", "", "/abs", "x\\y"])
def test_a_manifest_whose_array_name_leaves_the_store_is_refused(published, array):
    p = published

    def edit(d):
        d["tensors"]["BF16.mat"]["array"] = array

    _forge_manifest(p, 2, edit)
    state = received(p, 1)
    before = state.read_bytes()
    with pytest.raises(UnsafeKeyError) as ei:
        run_receive(p.root, "rx", str(state), 2)
    assert_one_line(ei.value)
    assert "BF16.mat" in str(ei.value)
    assert state.read_bytes() == before
    with pytest.raises(UnsafeKeyError):
        run_materialize(p.root, 2, str(p.tmp / "m.safetensors"))
    assert not (p.tmp / "m.safetensors").exists()


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["tensors"]["BF16.mat"].update(chunk_shape=[2, 2]),  # not contiguous
        lambda d: d["tensors"]["BF16.mat"].update(shape=[2 ** 50]),  # a hostile size
        lambda d: d["tensors"]["BF16.mat"]["chunks"].update(
            indices=d["tensors"]["BF16.mat"]["chunks"]["indices"][:-1] + [10 ** 9]
        ),
        lambda d: d["tensors"]["BF16.mat"].update(encoding="full"),
        lambda d: d["tensors"]["BF16.mat"].update(dtype="F4"),
        lambda d: d.update(step=5),
        lambda d: d.update(policy_digest="0" * 64),
        lambda d: d["tensors"]["BF16.mat"].update(digest="0" * 64),  # policy digest no longer matches
    ],
    ids=["chunk-shape", "huge-shape", "chunk-index", "encoding", "dtype", "step", "policy", "tensor-digest"],
)
def test_a_re_signed_but_inconsistent_manifest_is_refused(published, edit):
    p = published
    _forge_manifest(p, 2, edit)
    state = received(p, 1)
    before = state.read_bytes()
    with pytest.raises(IntegrityError) as ei:
        run_receive(p.root, "rx", str(state), 2)
    assert_one_line(ei.value)
    assert state.read_bytes() == before


def _forge_with_policy(p, step, edit) -> None:
    """Like ``_forge_manifest``, and recompute the policy digest (manifest and marker) too."""

    def edit_and_rebind(d):
        edit(d)
        d["policy_digest"] = policy_digest(
            (n, t["dtype"], tuple(t["shape"]), t["digest"]) for n, t in d["tensors"].items()
        )

    _forge_manifest(p, step, edit_and_rebind)
    policy = json.loads(open(_manifest_path(p, step), "rb").read())["policy_digest"]
    _rewrite_marker(p, step, {"policy_digest": policy})


def _huge_shape(d):
    t = d["tensors"]["F32.mat"]
    t.update(shape=[2 ** 48, 2 ** 48], chunk_shape=[2 ** 48, 2 ** 48])
    t["chunks"] = {"indices": [], "digests": [], "nbytes": []}


def _huge_chunk_shape(d):
    t = d["tensors"]["BF16.vec"]
    t["chunk_shape"] = [2 ** 48]  # one chunk, "padded" to 2^48 elements
    for col in ("indices", "digests", "nbytes"):
        t["chunks"][col] = t["chunks"][col][:1]


@pytest.mark.parametrize("edit", [_huge_shape, _huge_chunk_shape], ids=["shape", "chunk-shape"])
def test_a_re_signed_manifest_with_hostile_sizes_fails_cleanly_without_allocating(published, edit):
    p = published
    _forge_with_policy(p, 0, edit)
    with pytest.raises(IntegrityError) as ei:
        run_materialize(p.root, 0, str(p.tmp / "m.safetensors"))
    assert_one_line(ei.value)


def test_a_state_file_whose_step_is_a_non_ascii_digit_is_refused(published):
    p = published
    state = p.tmp / "claims.safetensors"
    save_file({k: v.contiguous() for k, v in p.steps[1].items()}, str(state), metadata={"dcr.step": "\u00b2"})
    before = state.read_bytes()
    with pytest.raises(StateMismatchError) as ei:
        run_receive(p.root, "rx", str(state), 2)
    assert_one_line(ei.value)
    assert state.read_bytes() == before


@pytest.mark.parametrize("kind", ["local", pytest.param("memory", marks=pytest.mark.backend)])
def test_a_long_non_ascii_tensor_name_is_refused_before_commit_or_round_trips(tmp_path, kind):
    root = str(tmp_path / "root") if kind == "local" else f"memory://t-{uuid.uuid4().hex}"
    name = "layer." + "\u00fc" * 60 + ".weight"  # 60 two-byte characters: 360 escaped characters
    twin = name[:-len("weight")] + "bias"  # same long escaped prefix, a different tensor
    tensors = {
        name: torch.arange(6, dtype=torch.float32),
        twin: torch.arange(4, dtype=torch.int16).view(torch.bfloat16),
        "b": torch.zeros(2, dtype=torch.bfloat16),
    }
    try:
        run_publish(root, tensors, 0, options=opts(tmp_path))
    except DCRError as e:
        assert_one_line(e)
        assert Catalog(Root(root)).latest_committed() is None
        return
    run_materialize(root, 0, str(tmp_path / "m.safetensors"))
    assert_bits_equal(load_file(str(tmp_path / "m.safetensors")), tensors)


def test_a_missing_manifest_is_an_integrity_error(published):
    p = published
    os.remove(_manifest_path(p, 2))
    with pytest.raises(IntegrityError) as ei:
        run_materialize(p.root, 2, str(p.tmp / "m.safetensors"))
    assert_one_line(ei.value)


# --------------------------------------------------------------------------------------------------
# crashes and races


@pytest.mark.faults(component="publisher", outcome="nothing visible; a retry commits the step bit-exact")
@pytest.mark.parametrize("kind", ["local", pytest.param("memory", marks=pytest.mark.backend)])
@pytest.mark.parametrize("crash_at", ["create_if_absent", "write_manifest", "encode_and_write"])
def test_a_publish_that_crashes_before_commit_is_invisible_and_a_retry_is_exact(tmp_path, monkeypatch, kind, crash_at):
    root = str(tmp_path / "root") if kind == "local" else f"memory://t-{uuid.uuid4().hex}"
    steps = chain_of_steps(3, seed=9)
    run_publish(root, steps[0], 0, options=opts(tmp_path))
    run_publish(root, steps[1], 1, options=opts(tmp_path))

    class Crash(RuntimeError):
        pass

    if crash_at == "create_if_absent":
        def boom(self, key, data):
            raise Crash("power cut")

        monkeypatch.setattr(Root, "create_if_absent", boom)
    else:
        def crash(real, *a, **kw):
            if crash_at == "encode_and_write":
                real(*a, **kw)  # every chunk uploaded, then the crash
            raise Crash("power cut")

        patch_step(monkeypatch, PublishSteps, crash_at, crash)
    with pytest.raises(Crash):
        run_publish(root, steps[2], 2, options=opts(tmp_path))
    monkeypatch.undo()

    cat = Catalog(Root(root))
    assert cat.latest_committed() == 1 and cat.committed_steps() == [0, 1]
    with pytest.raises(StepNotFoundError) as ei:
        run_receive(root, "rx", str(tmp_path / "s.safetensors"), 2)
    assert_one_line(ei.value)
    assert not (tmp_path / "s.safetensors").exists()
    r = run_receive(root, "rx", str(tmp_path / "s.safetensors"))
    assert r.step == 1

    result = run_publish(root, steps[2], 2, options=opts(tmp_path))
    assert result.kind == "delta" and result.base_step == 1
    r = run_receive(root, "rx", str(tmp_path / "s.safetensors"), 2)
    assert r.moves == ["forward:2"]
    assert_bits_equal(load_file(str(tmp_path / "s.safetensors")), steps[2])
    run_materialize(root, 2, str(tmp_path / "m.safetensors"))
    assert_bits_equal(load_file(str(tmp_path / "m.safetensors")), steps[2])


def test_two_publishers_racing_for_one_step_one_wins_and_the_other_conflicts(tmp_path):
    root = str(tmp_path / "root")
    base = small(3)
    run_publish(root, base, 0, options=opts(tmp_path))
    contenders = [next_step(base, 100), next_step(base, 200)]
    assert contenders[0]["BF16.vec"].view(torch.int16).tolist() != contenders[1]["BF16.vec"].view(torch.int16).tolist()

    barrier = threading.Barrier(2, timeout=30)

    def write_manifest_then_wait(real, *a, **kw):
        out = real(*a, **kw)
        barrier.wait()  # both have planned, uploaded and written a manifest: commit together
        return out

    mp = pytest.MonkeyPatch()
    patch_step(mp, PublishSteps, "write_manifest", write_manifest_then_wait)
    results: list = [None, None]

    def publish(i):
        try:
            results[i] = run_publish(root, contenders[i], 1, options=opts(tmp_path / f"p{i}"))
        except BaseException as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    mp.undo()
    winners = [i for i in range(2) if not isinstance(results[i], BaseException)]
    losers = [i for i in range(2) if isinstance(results[i], BaseException)]
    assert len(winners) == 1 and len(losers) == 1, results
    w, lo = winners[0], losers[0]
    err = results[lo]
    assert isinstance(err, StepConflictError), repr(err)
    assert_one_line(err)

    cat = Catalog(Root(root))
    marker = cat.marker(1)
    assert marker.attempt == results[w].attempt
    m = cat.manifest(1)
    assert m.attempt == results[w].attempt
    attempts = Root(root).listdir(f"{layout.step_dir(1)}/attempts")
    assert attempts == [results[w].attempt]  # the loser's attempt was discarded
    state = tmp_path / "s.safetensors"
    run_receive(root, "rx", str(state), 1)
    assert_bits_equal(load_file(str(state)), contenders[w])


def test_every_error_class_is_a_dcr_error_with_an_exit_code():
    for cls in (IntegrityError, InvalidCheckpointError, SchemaMismatchError, StateMismatchError,
                StepConflictError, StepNotFoundError, UnsafeKeyError):
        assert issubclass(cls, DCRError) and isinstance(cls.exit_code, int) and cls.exit_code > 0
