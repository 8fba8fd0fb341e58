"""``Publisher``: a long-running publisher that holds the committed policy in memory as the next
delta's baseline. Checked on raw bits: every step received equals its dense checkpoint, every delta
stores exactly the chunks ``run_publish`` with the baseline file stores, the held baseline is really
used (no baseline file read, written or rebuilt), and it is dropped or kept correctly when another
publisher commits in between, a publish fails, or the source is a file.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch
from safetensors.torch import load_file, save_file

from dcr_core.errors import StepConflictError, UsageError
from dcr_core.retention import KeyframePolicy
from dcr_core.shard_spec import full
from flows import Publisher, local_refs, run_publish, run_receive
from flows.options import PublishOptions
from flows.publish import baseline as ps
from flows.publish import sources
from flows.publish.baseline import BaselineSlot, HeldBaseline
from flows.publish.pipeline import PublishSteps
from flows.publish.shards import Shard, ShardedSource
from flows.publish.sources import MemorySource
from storage.catalog import Catalog
from storage.root import Root
from tests.support.helpers import assert_bits_equal, assert_one_line, chain_of_steps, nasty_checkpoint, next_step
from tests.support.steps import patch_step

CHUNK_BYTES = 256


def opts(cache_dir, **kw) -> PublishOptions:
    kw.setdefault("overwrite_above", 1.0)  # xor for every changed tensor (0-d ones too)
    return PublishOptions(chunk_bytes=CHUNK_BYTES, cache_dir=str(cache_dir), **kw)


def make_root(kind: str, base) -> str:
    return str(base / f"root-{uuid.uuid4().hex[:8]}") if kind == "local" else f"memory://t-{uuid.uuid4().hex}"


def files_under(path) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def received(root, tmp_path, step=None) -> dict[str, torch.Tensor]:
    state = tmp_path / "state.safetensors"
    run_receive(root, "rx", str(state), step)
    return load_file(str(state))


@pytest.fixture
def baselines(monkeypatch):
    """What ``load_baseline`` returned per publish, and every baseline file read, written or rebuilt."""
    seen = {"loaded": [], "file_reads": [], "file_writes": [], "rebuilds": []}
    def load(real, plan, *a):
        out = real(plan, *a)
        seen["loaded"].append(local_refs.get(out) if isinstance(out, local_refs.LocalRef) else out)
        return out

    def spy(key, real):
        def wrapped(*a, **kw):
            seen[key].append(a[0] if a else None)
            return real(*a, **kw)
        return wrapped

    patch_step(monkeypatch, PublishSteps, "load_baseline", load)
    monkeypatch.setattr(ps, "SafetensorsCheckpoint", spy("file_reads", ps.SafetensorsCheckpoint))
    monkeypatch.setattr(ps, "StreamingSafetensorsWriter", spy("file_writes", ps.StreamingSafetensorsWriter))
    monkeypatch.setattr(ps, "rebuild", spy("rebuilds", ps.rebuild))
    real_open = sources.open_source  # a baseline file read while encoding counts as a file read too
    monkeypatch.setattr("flows.publish.sources.open_source",
                        lambda ref: (seen["file_reads"].append(ref) if isinstance(ref, str) and ps.BASELINE_FILE in ref else None)
                        or real_open(ref))
    return seen


# --------------------------------------------------------------------------------------------------
# the same deltas as with the baseline file, bit-exact, from memory


@pytest.mark.parametrize("kind", ["local", pytest.param("memory", marks=pytest.mark.backend)])
@pytest.mark.parametrize("policy", [None, KeyframePolicy(every=2)], ids=["deltas", "restart-points"])
def test_a_publisher_stores_the_same_deltas_as_the_file_cache_and_receivers_get_every_bit(tmp_path, kind, policy, baselines):
    steps = chain_of_steps(5, seed=4, big=8)
    extra = {"keyframe_policy": policy} if policy else {}
    held_root, file_root = make_root(kind, tmp_path), make_root(kind, tmp_path)
    held_opts, file_opts = opts(tmp_path / "held-cache", **extra), opts(tmp_path / "file-cache", **extra)
    pub = Publisher(held_root, options=held_opts)
    assert pub.step is None
    for i, ck in enumerate(steps):
        n_loaded = len(baselines["loaded"])
        a = pub.publish(ck, i)
        held_loaded = baselines["loaded"][n_loaded]
        b = run_publish(file_root, ck, i, options=file_opts)
        assert (a.kind, a.base_step, a.policy_digest) == (b.kind, b.base_step, b.policy_digest)
        assert a.summary["bytes_stored"] == b.summary["bytes_stored"]
        assert a.summary.get("snapshot_bytes") == b.summary.get("snapshot_bytes")
        ma, mb = Catalog(Root(held_root)).manifest(i), Catalog(Root(file_root)).manifest(i)
        for name, e in ma.tensors.items():  # the same stored chunks, digest for digest
            other = mb.tensors[name]
            assert (e.encoding, e.chunks.content(), e.digest) == (other.encoding, other.chunks.content(), other.digest)
        if i:
            assert isinstance(held_loaded, MemorySource) and isinstance(baselines["loaded"][-1], str)
        assert pub.step == i
        assert_bits_equal(received(held_root, tmp_path), ck)
    assert files_under(held_opts.cache_dir) == []  # no baseline file in this mode
    if policy:
        assert any(Catalog(Root(held_root)).manifest(i).snapshot for i in range(1, len(steps)))


def test_the_held_baseline_is_used_without_reading_writing_or_rebuilding_a_baseline_file(tmp_path, baselines):
    root = str(tmp_path / "root")
    steps = chain_of_steps(4, seed=6)
    pub = Publisher(root, options=opts(tmp_path / "cache"))
    pub.publish(steps[0], 0)
    for i in (1, 2, 3):
        held = pub._slot.baseline
        r = pub.publish(steps[i], i)
        assert r.kind == "delta" and r.base_step == i - 1
        assert baselines["loaded"][-1] is held.source  # the snapshot committed last, as it is
        assert_bits_equal(received(root, tmp_path), steps[i])
    assert baselines["file_reads"] == [] and baselines["file_writes"] == [] and baselines["rebuilds"] == []
    assert files_under(tmp_path / "cache") == []


def test_the_held_snapshot_is_a_private_copy_of_the_trainers_tensors(tmp_path):
    root = str(tmp_path / "root")
    weights = nasty_checkpoint(2)
    committed = {n: t.clone() for n, t in weights.items()}
    pub = Publisher(root, options=opts(tmp_path / "cache"))
    pub.publish(weights, 0)
    for t in weights.values():  # training goes on in place
        if t.numel():
            t.view(-1).view(torch.uint8)[0] ^= 1
    nxt = next_step(committed, 3)
    pub.publish(nxt, 1)
    assert_bits_equal(received(root, tmp_path, 0), committed)
    assert_bits_equal(received(root, tmp_path, 1), nxt)


# --------------------------------------------------------------------------------------------------
# falling back: the held baseline is used only when it is exactly the plan's base


def test_after_another_publisher_commits_the_publisher_rebuilds_and_publishes_on_the_right_base(tmp_path, baselines):
    root = str(tmp_path / "root")
    steps = chain_of_steps(6, seed=8)
    pub = Publisher(root, options=opts(tmp_path / "cache"))
    pub.publish(steps[0], 0)
    pub.publish(steps[1], 1)
    run_publish(root, steps[2], 2, options=opts(tmp_path / "other-cache"))  # another process
    assert pub.step == 1
    rebuilds = len(baselines["rebuilds"])
    r = pub.publish(steps[3], 3)
    assert (r.kind, r.base_step) == ("delta", 2)
    assert isinstance(baselines["loaded"][-1], str) and len(baselines["rebuilds"]) == rebuilds + 1  # from ROOT
    assert pub.step == 3
    assert_bits_equal(received(root, tmp_path), steps[3])
    r = pub.publish(steps[4], 4)  # held again
    assert isinstance(baselines["loaded"][-1], MemorySource) and len(baselines["rebuilds"]) == rebuilds + 1
    assert_bits_equal(received(root, tmp_path), steps[4])
    r = pub.publish(steps[5], 5, keyframe=True)  # a new lineage, then deltas on it from memory
    assert r.kind == "keyframe" and pub.step == 5
    nxt = next_step(steps[5], 99)
    r = pub.publish(nxt, 6)
    assert (r.kind, r.base_step) == ("delta", 5) and isinstance(baselines["loaded"][-1], MemorySource)
    assert_bits_equal(received(root, tmp_path), nxt)


@pytest.mark.parametrize("mismatch", ["root", "step", "policy_digest"])
def test_a_held_baseline_that_is_not_exactly_the_base_is_not_used(tmp_path, mismatch, baselines):
    """Two ROOTs with steps 0 and 1 of different bits; the held baseline of one is offered to the other."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    sa, sb = chain_of_steps(2, seed=10), chain_of_steps(3, seed=11)
    slot = BaselineSlot()
    for i in range(2):
        run_publish(a, sa[i], i, options=opts(tmp_path / "ca"), held=slot)
        run_publish(b, sb[i] if mismatch != "root" else sa[i], i, options=opts(tmp_path / "cb"))
    h = slot.baseline
    offered = {
        "root": h,  # the same bits and digest, but another ROOT's step
        "step": HeldBaseline(b, 0, Catalog(Root(b)).marker(1).policy_digest, h.source),
        "policy_digest": HeldBaseline(b, 1, h.policy_digest, h.source),
    }[mismatch]
    nxt = next_step(sb[1] if mismatch != "root" else sa[1], 12)
    r = run_publish(b, nxt, 2, options=opts(tmp_path / "cb"), held=BaselineSlot(offered))
    assert r.base_step == 1 and isinstance(baselines["loaded"][-1], str)
    assert_bits_equal(received(b, tmp_path), nxt)


# --------------------------------------------------------------------------------------------------
# failures keep the previous baseline; a retry is exact


class Crash(RuntimeError):
    pass


@pytest.mark.parametrize("crash_at", ["encode_and_write", "write_manifest", "create_if_absent", "commit_step"])
def test_a_publish_that_fails_keeps_the_held_baseline_and_a_retry_is_exact(tmp_path, crash_at, baselines):
    root = str(tmp_path / "root")
    steps = chain_of_steps(4, seed=13)
    pub = Publisher(root, options=opts(tmp_path / "cache"))
    pub.publish(steps[0], 0)
    pub.publish(steps[1], 1)
    held = pub._slot.baseline
    with pytest.MonkeyPatch.context() as mp:
        if crash_at == "create_if_absent":
            def boom(self, key, data):
                raise Crash("power cut")

            mp.setattr(Root, "create_if_absent", boom)
        else:
            def boom(real, *a, **kw):
                real(*a, **kw)  # the step's work done, then the crash
                raise Crash("power cut")

            patch_step(mp, PublishSteps, crash_at, boom)
        with pytest.raises(Crash):
            pub.publish(steps[2], 2)
    assert pub._slot.baseline is held and pub.step == 1
    cat = Catalog(Root(root))
    if crash_at == "commit_step":  # the marker was created before the crash: the step is committed
        assert cat.latest_committed() == 2
        with pytest.raises(StepConflictError):
            pub.publish(steps[2], 2)
        assert pub.step == 1
        loaded = len(baselines["loaded"])
        r = pub.publish(steps[3], 3)  # the held step 1 is not the base: rebuilt from ROOT
        assert r.base_step == 2 and isinstance(baselines["loaded"][loaded], str)
        assert_bits_equal(received(root, tmp_path, 2), steps[2])
    else:
        assert cat.latest_committed() == 1
        r = pub.publish(steps[2], 2)  # the retry uses the held step 1
        assert r.base_step == 1 and baselines["loaded"][-1] is held.source
        assert_bits_equal(received(root, tmp_path), steps[2])
        pub.publish(steps[3], 3)
    # the only baseline file written is the rebuild of step 2 (held step 1 was not its base)
    assert pub.step == 3 and len(baselines["file_writes"]) == len(baselines["rebuilds"])
    assert_bits_equal(received(root, tmp_path), steps[3])


def test_a_failure_after_the_commit_keeps_the_previous_baseline_and_the_next_publish_is_exact(tmp_path):
    root = str(tmp_path / "root")
    steps = chain_of_steps(3, seed=14)
    pub = Publisher(root, options=opts(tmp_path / "cache"))
    pub.publish(steps[0], 0)

    def boom(real, *a, **kw):
        raise Crash("interrupted")

    with pytest.MonkeyPatch.context() as mp:
        patch_step(mp, PublishSteps, "remember_baseline", boom)
        with pytest.raises(Crash):
            pub.publish(steps[1], 1)
    assert pub.step == 0 and Catalog(Root(root)).latest_committed() == 1
    r = pub.publish(steps[2], 2)
    assert r.base_step == 1 and pub.step == 2
    assert_bits_equal(received(root, tmp_path), steps[2])


# --------------------------------------------------------------------------------------------------
# sources that are not held


def test_a_file_source_is_not_held_and_the_baseline_file_takes_over(tmp_path, baselines):
    root = str(tmp_path / "root")
    steps = chain_of_steps(5, seed=15)
    path = tmp_path / "ckpt.safetensors"
    pub = Publisher(root, options=opts(tmp_path / "cache"))

    def publish_file(i):
        save_file({k: v.contiguous() for k, v in steps[i].items()}, str(path))
        return pub.publish(str(path), i)

    publish_file(0)
    assert pub.step is None and len(files_under(tmp_path / "cache")) == 1  # the baseline file, as today
    pub.publish(steps[1], 1)
    assert isinstance(baselines["loaded"][-1], str) and pub.step == 1  # from the file, then held
    publish_file(2)
    assert isinstance(baselines["loaded"][-1], MemorySource)  # the held step 1 is the base
    assert pub.step is None  # the file may be overwritten: not held, its baseline file written
    path.write_bytes(b"overwritten")
    pub.publish(steps[3], 3)
    assert isinstance(baselines["loaded"][-1], str) and pub.step == 3
    src = MemorySource(steps[4])  # a source object passed in stays its owner's: not held either
    pub.publish(src, 4)
    assert pub.step is None
    for i in range(5):
        assert_bits_equal(received(root, tmp_path, i), steps[i])


def test_sharded_sources_pass_through_without_a_held_baseline(tmp_path):
    root = str(tmp_path / "root")
    steps = chain_of_steps(3, seed=16, dtypes=["BF16", "F32", "I8"], odd_names=False)

    def sharded(ck):
        return ShardedSource([Shard(n, t.clone(), full(n, t.shape)) for n, t in ck.items()], rank=0, world=1)

    pub = Publisher(root, options=opts(tmp_path / "cache"))
    pub.publish(steps[0], 0)
    assert pub.step == 0
    for i in (1, 2):
        r = pub.publish(sharded(steps[i]), i)
        assert r.step == i and pub.step is None
        assert_bits_equal(received(root, tmp_path), steps[i])
    with pytest.raises(UsageError) as ei:
        run_publish(root, sharded(next_step(steps[2], 3)), 3, held=BaselineSlot())
    assert_one_line(ei.value)


# --------------------------------------------------------------------------------------------------
# bad arguments


@pytest.mark.parametrize(
    "make",
    [
        lambda tmp: Publisher(123),
        lambda tmp: Publisher(""),
        lambda tmp: Publisher(str(tmp / "r"), storage_options=["anon"]),
        lambda tmp: Publisher(str(tmp / "r"), options={"chunk_bytes": 256}),
        lambda tmp: Publisher(str(tmp / "r")).publish(nasty_checkpoint(0), -1),
        lambda tmp: Publisher(str(tmp / "r")).publish(nasty_checkpoint(0), "1"),
        lambda tmp: Publisher(str(tmp / "r")).publish(nasty_checkpoint(0), 0, keyframe="yes"),
    ],
    ids=["root-type", "root-empty", "storage-options", "options", "step-negative", "step-str", "keyframe"],
)
def test_bad_arguments_are_a_one_line_usage_error(tmp_path, make):
    with pytest.raises(UsageError) as ei:
        make(tmp_path)
    assert_one_line(ei.value)
    assert not (tmp_path / "r").exists()


def test_a_step_conflict_keeps_the_held_baseline(tmp_path):
    root = str(tmp_path / "root")
    steps = chain_of_steps(3, seed=17)
    pub = Publisher(root, options=opts(tmp_path / "cache"))
    pub.publish(steps[0], 0)
    pub.publish(steps[1], 1)
    held = pub._slot.baseline
    for step in (1, 0):
        with pytest.raises(StepConflictError) as ei:
            pub.publish(steps[2], step)
        assert_one_line(ei.value)
        assert pub._slot.baseline is held
    pub.publish(steps[2], 2)
    assert_bits_equal(received(root, tmp_path), steps[2])
