"""Receivers that patch their state file in place (``ReceiveOptions(in_place=True)``).

Reference: the same refits through the default rewrite, and the published checkpoints
themselves, compared on raw bits. Crashes are real: a forked child dies with ``os._exit`` at each
point of the patch (no cleanup runs), and the parent checks what the next receive finds.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import shutil
import struct

import numpy as np
import pytest
from safetensors.torch import load_file

from dcr_core import events, sparse
from dcr_core.bits import bits_of
from dcr_core.dtypes import DTYPES
from dcr_core.errors import IntegrityError, StateMismatchError
from flows import run_publish, run_receive
from flows.options import DELTA_CODECS, PublishOptions, ReceiveOptions
from flows.receive import in_place, patch_changes, state_file
from storage import reader
from storage.catalog import Catalog
from storage.local import journal as state_journal
from storage.local import sidecar
from storage.local.safetensors import Header, SafetensorsCheckpoint
from storage.local.state import consistent_state
from storage.local.state import peek_step as peek_state_step
from storage.root import open_root
from tests.support.helpers import (
    assert_bits_equal,
    chain_of_steps,
    chunk_at,
    chunk_named,
    damage_chunk,
    file_bytes,
    next_step,
    stored_chunks,
)
from tests.support.kill import sweep

IN_PLACE = ReceiveOptions(in_place=True, io_workers=2)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A keyframe and 6 XOR deltas of a nasty checkpoint with a large frozen embedding."""
    base = tmp_path_factory.mktemp("inplace")
    root = str(base / "root")
    steps = chain_of_steps(7, seed=3, big=40)
    opts = PublishOptions(chunk_bytes=256, cache_dir=str(base / "cache"))
    for i, s in enumerate(steps):
        run_publish(root, s, i, keyframe=(i == 0), options=opts)
    return root, steps


def _receive(root, state, step, in_place=True, **kw):
    return run_receive(root, "rx", str(state), step, options=IN_PLACE if in_place else None, **kw)


def _walk(root, steps, targets, tmp_path):
    """Receive ``targets`` in turn in place (state a) and by rewrite (state b); after each, a holds the
    step's bits, equals b and is still the same file. Yields (target, a)."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    _receive(root, a, 0)
    _receive(root, b, 0, in_place=False)
    inode = os.stat(a).st_ino
    for target in targets:
        res = _receive(root, a, target)
        _receive(root, b, target, in_place=False)
        assert res.step == target
        assert_bits_equal(load_file(a), steps[target])
        assert_bits_equal(load_file(a), load_file(b))
        assert os.stat(a).st_ino == inode, "patched in place, never replaced"
        yield target, a


def test_in_place_refits_equal_the_rewrite_and_the_checkpoints_on_every_path(published, tmp_path):
    root, steps = published
    # one step, several combined, backward (several, then one), back to the keyframe by deltas
    for target, a in _walk(root, steps, (1, 4, 2, 6, 0, 5, 4), tmp_path):
        assert peek_state_step(str(a)) == target
        assert not os.path.exists(state_journal.journal_path(str(a))), "no patch cut off"
        # committed, its pages left to the kernel's writeback; the next receive settles it first
        assert state_journal.pending_step(str(a)) == target
    assert state_journal.settle(str(a)) == 4 and state_journal.pending_step(str(a)) is None
    assert_bits_equal(load_file(a), steps[4])


def test_a_large_delta_falls_back_to_the_rewrite(tmp_path):
    root = str(tmp_path / "root")
    s0 = chain_of_steps(1, seed=5)[0]
    s1 = next_step(s0, 9, fraction=0.6, unchanged=0.0)
    opts = PublishOptions(chunk_bytes=256, cache_dir=str(tmp_path / "cache"))
    run_publish(root, s0, 0, options=opts)
    run_publish(root, s1, 1, options=opts)
    state = tmp_path / "s.safetensors"
    _receive(root, state, 0)
    inode = os.stat(state).st_ino
    _receive(root, state, 1)
    assert os.stat(state).st_ino != inode, "a journal over half the state: rewritten instead"
    assert_bits_equal(load_file(state), s1)


def test_a_header_without_room_falls_back_to_the_rewrite(published, tmp_path):
    root, steps = published
    old = b"\x05\0\0\0\0\0\0\0" + b'{"a":1}'[:5]
    assert Header(old, {"a": 1}).with_metadata({"dcr.step": "10"}) is None
    fits = Header(b"\x30" + b"\0" * 7 + b" " * 48, {"a": 1}).with_metadata({"dcr.step": "10"})
    assert len(fits) == 56 and fits[:8] == (48).to_bytes(8, "little")
    assert json.loads(fits[8:]) == {"a": 1, "__metadata__": {"dcr.step": "10"}}
    state = tmp_path / "s.safetensors"
    _receive(root, state, 0)
    inode = os.stat(state).st_ino
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Header, "with_metadata", lambda *a: None)
        _receive(root, state, 3)
    assert os.stat(state).st_ino != inode
    assert_bits_equal(load_file(state), steps[3])


@pytest.mark.faults(component="receiver", outcome="refused with a one-line error; the state file byte-identical, no journal")
@pytest.mark.parametrize("which", ["embed.frozen", "BF16.mat"])
def test_a_damaged_state_is_refused_and_left_untouched(published, tmp_path, which, monkeypatch):
    root, steps = published
    calls = []
    real = in_place.stage_patch
    monkeypatch.setattr(in_place, "stage_patch", lambda *a, **k: calls.append(1) or real(*a, **k))
    state = tmp_path / "s.safetensors"
    _receive(root, state, 0)
    from storage.local.safetensors import SafetensorsCheckpoint

    offset = SafetensorsCheckpoint(str(state)).data_offset(which)
    with open(state, "r+b") as f:  # one bit of the held state flipped behind DCR's back
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))
    before = file_bytes(state)
    with pytest.raises(StateMismatchError, match=f"tensor '{which}' is not the bits of step 0"):
        _receive(root, state, 2)
    assert calls, "refused by the in-place path"
    assert file_bytes(state) == before
    assert not os.path.exists(state_journal.journal_path(str(state)))


@pytest.mark.faults(component="receiver", outcome="a manifest entry that understates its changes: refused with a one-line error naming the tensor and step, in the compute step (nothing written yet)")
def test_chunks_that_change_more_than_their_entry_says_are_refused():
    from dcr_core.delta import Encoding
    from dcr_core.digest import tensor_digest
    from storage.manifest import ChunkTable, TensorEntry

    held = np.arange(1000, dtype=np.uint16)
    mask = np.zeros(1000, np.uint16)
    mask[[3, 500, 999]] = 1
    entry = TensorEntry("w", "BF16", (1000,), tensor_digest(held ^ mask), Encoding.XOR, "w", (1000,),
                        ChunkTable((0,), ("0" * 64,), (10,)), changed=2)
    with pytest.raises(IntegrityError, match="tensor 'w' .*change more than the 2 elements its manifest entry lists") as e:
        patch_changes.xor_streamed(held, entry, entry, iter([(None, entry, 0, mask)]), True, 7)
    assert "\n" not in str(e.value) and "step 7" in str(e.value)
    exact = patch_changes.xor_streamed(held, dataclasses.replace(entry, changed=3), entry, iter([(None, entry, 0, mask)]))
    assert [a.tolist() for a in exact[:3]] == [[3, 500, 999], [3, 500, 999], [2, 501, 998]]
    assert exact[3] is None  # flat digests: no block digests


def _crash_child(root, state, step, point):
    """Run an in-place receive that dies (``os._exit(9)``, no cleanup) when it reports reaching
    ``point`` of the install (``dcr_core.events``): the journal in force, record N of the patch
    written (-1: the last), the patch and its header written (the journal not yet committed), or
    the patch committed (the redo journal in force)."""
    def die_at(p, fields):
        if point == "journal written" and p == "receive.journal-written":
            os._exit(9)
        if point.startswith("record ") and p == "receive.patch-record":
            at = int(point.split()[1])
            if fields["index"] == (at if at >= 0 else fields["of"] + at):
                os._exit(9)
        if point == "header written" and p == "receive.patch-written":
            os._exit(9)
        if point == "blocks written" and p == "receive.blocks-written":
            os._exit(9)
        if point == "committed" and p == "receive.patched":
            os._exit(9)

    with events.listening(die_at):
        run_receive(root, "rx", state, step, options=IN_PLACE)
    os._exit(0)


def _cut_off_rolls_back(root, state: str, point: str, held: int, target: int, before: bytes) -> None:
    """After a receive cut off at ``point`` of its patch from ``held`` to ``target``: the journal says
    so, the file reads as ``held``, whatever the patch wrote is there, and a roll back gives the
    file's bytes ``before`` back."""
    journal = state_journal.read(state)
    assert journal is not None and (journal.from_step, journal.to_step) == (held, target)
    assert peek_state_step(state) == held, "a cut-off patch reads as its old step"
    if point in ("header written", "blocks written"):  # everything written, only the journal left
        assert SafetensorsCheckpoint(state).metadata["dcr.step"] == str(target) and file_bytes(state) != before
    if point == "blocks written":  # the new step's block digests, stamped with the patched file
        assert sidecar.read(state).step == target
    assert state_journal.roll_back(state) == held
    assert file_bytes(state) == before, "rolled back byte for byte"


@pytest.mark.faults(component="receiver", outcome="crash mid-patch: the next receive rolls back to the old step, then ends bit-exact")
@pytest.mark.parametrize("point", ["journal written", "record 0", "record 3", "record -1", "header written",
                                   "blocks written"])
@pytest.mark.parametrize("held,target", sweep([(1, 4), (1, 2), (3, 2)], {(1, 2)}, key=tuple),
                         ids=["3-steps-copied", "1-step-streamed", "back-1-streamed"])
def test_a_patch_cut_off_anywhere_is_rolled_back_and_the_retry_is_exact(published, tmp_path, point, held, target):
    root, steps = published
    state = str(tmp_path / "s.safetensors")
    _receive(root, state, held)
    before = file_bytes(state)
    _crash(root, state, target, point)
    _cut_off_rolls_back(root, state, point, held, target, before)
    assert not _blocks_trusted(root, state, target), "the roll back wrote the file: its block digests no longer match"
    assert state_journal.roll_back(state) is None
    # The crash once more, then a plain retry: the receive rolls back first, then refits.
    _crash(root, state, target, point)
    res = _receive(root, state, target)
    assert (res.from_step, res.step) == (held, target)
    assert_bits_equal(load_file(state), steps[target])
    assert not os.path.exists(state_journal.journal_path(state))
    assert _blocks_trusted(root, state, target)


def _blocks_trusted(root, state, step):
    from storage.catalog import Catalog

    kept = sidecar.read(state)
    policy = Catalog(open_root(root)).manifest(step).policy_digest
    return kept is not None and sidecar.load(state, step, policy, kept.block_bytes) is not None


def _crash(root, state, target, point):
    child = multiprocessing.get_context("fork").Process(target=_crash_child, args=(root, state, target, point))
    child.start()
    child.join(120)
    assert child.exitcode == 9, f"the child should have died at {point!r}"


@pytest.mark.faults(component="receiver", outcome="crash mid-patch: readers under consistent_state, a fresh rewrite and a roll back interrupted midway all see one whole step")
def test_after_a_cut_off_patch_readers_fresh_rewrites_and_interrupted_roll_backs_see_one_step(published, tmp_path):
    root, steps = published
    state = str(tmp_path / "s.safetensors")
    _receive(root, state, 1)
    _crash(root, state, 2, "record -1")
    with consistent_state(state):  # what a reader outside DCR does
        assert_bits_equal(load_file(state), steps[1])
    _crash(root, state, 2, "header written")
    journal = state_journal.read(state)
    with events.failpoints("receive.rollback-record=raise"), pytest.raises(events.FailpointError):
        state_journal.put(state, journal, "old")  # a roll back cut off after its first record...
    assert state_journal.roll_back(state) == 1  # ...is repaired by the next one
    assert_bits_equal(load_file(state), steps[1])
    _crash(root, state, 2, "record 3")
    from flows import run_materialize

    run_materialize(root, 5, state)  # fresh: undoes the cut-off patch first, then rewrites whole
    assert_bits_equal(load_file(state), steps[5])
    assert not os.path.exists(state_journal.journal_path(state))


@pytest.mark.faults(component="receiver", outcome="crash after the commit, then pages lost: the next receive rolls forward to the new step, bit-exact, and refits nothing")
@pytest.mark.parametrize("held,target", [(1, 4), (1, 2), (3, 2)], ids=["3-steps-copied", "1-step-streamed", "back-1-streamed"])
def test_a_committed_patch_is_rolled_forward_even_when_its_pages_were_lost(published, tmp_path, held, target,
                                                                          monkeypatch):
    root, steps = published
    state = str(tmp_path / "s.safetensors")
    _receive(root, state, held)
    before = file_bytes(state)
    _crash(root, state, target, "committed")
    assert not os.path.exists(state_journal.journal_path(state))
    assert peek_state_step(state) == target, "a committed patch reads as its new step"
    assert_bits_equal(load_file(state), steps[target])
    # What a power loss before the writeback can leave: the old bytes (every page), or a mix; and
    # the machine boots again (a journal of another boot is rolled forward from its records).
    monkeypatch.setattr(state_journal, "boot_id", lambda: "the boot after the power loss")
    patched = file_bytes(state)
    header_end = 8 + int.from_bytes(patched[:8], "little")
    assert before[:header_end] != patched[:header_end]
    for torn in (before, bytes(b if i % 8192 < 4096 else a for i, (a, b) in enumerate(zip(before, patched))),
                 bytes(b if (i % 2 if i < header_end else i % 8192 >= 4096) else a  # the header torn too
                       for i, (a, b) in enumerate(zip(before, patched)))):
        with open(state, "r+b") as f:
            f.write(torn)
        redo = state_journal.journal_path(state, "redo")
        kept = open(redo, "rb").read()
        with events.failpoints("receive.patch-record=raise"), pytest.raises(events.FailpointError):
            state_journal.settle(state)  # a roll forward cut off after its first record...
        assert os.path.exists(redo)
        res = _receive(root, state, target)  # ...is finished by the next receive, which refits nothing
        assert (res.from_step, res.step, res.moves) == (target, target, [])
        assert_bits_equal(load_file(state), steps[target])
        assert file_bytes(state) == patched, "byte for byte the patched file"
        assert not os.path.exists(redo)
        open(redo, "wb").write(kept)  # the journal back, for the next torn case
    with consistent_state(state):  # a reader outside DCR: rolled forward and fsynced first
        assert_bits_equal(load_file(state), steps[target])
    assert state_journal.pending_step(state) is None


@pytest.mark.parametrize("same_boot", [True, False], ids=["same-boot", "after-a-reboot"])
def test_a_commit_of_this_boot_settles_with_an_fsync_and_reads_no_record(published, tmp_path, monkeypatch, same_boot):
    """Back-to-back receives: the previous commit's pages are still in the page cache (no reboot
    since), so settling it is an fsync; after a reboot the journal's records are applied."""
    root, steps = published
    state = str(tmp_path / "s.safetensors")
    _receive(root, state, 1)
    _crash(root, state, 2, "committed")
    if not same_boot:
        monkeypatch.setattr(state_journal, "boot_id", lambda: "another boot")
    puts, settled = [], []
    real_put, real_fsync = state_journal.put, state_journal._fsync
    monkeypatch.setattr(state_journal, "put", lambda *a, **k: puts.append(k.get("differing")) or real_put(*a, **k))
    fsynced = []
    monkeypatch.setattr(state_journal, "_fsync", lambda p: fsynced.append(p) or real_fsync(p))
    with events.listening(lambda p, f: settled.append(f["records_read"]) if p == "receive.settled" else None):
        assert state_journal.settle(state) == 2
    assert settled == [not same_boot]
    assert (puts, fsynced) == (([], [state]) if same_boot else ([True], []))
    assert not os.path.exists(state_journal.journal_path(state, "redo"))
    assert_bits_equal(load_file(state), steps[2])


def test_a_commit_of_this_boot_whose_file_header_changed_is_rolled_forward_from_its_records(published, tmp_path):
    """The shortcut trusts the page cache only for the file the patch wrote: a header that is not
    the patch's new one (the file replaced or reverted behind DCR's back) takes the records' path."""
    root, steps = published
    state = str(tmp_path / "s.safetensors")
    _receive(root, state, 1)
    before = file_bytes(state)
    _crash(root, state, 2, "committed")
    with open(state, "r+b") as f:
        f.write(before)  # every page back to the old step, in this boot
    settled = []
    with events.listening(lambda p, f: settled.append(f["records_read"]) if p == "receive.settled" else None):
        assert state_journal.settle(state) == 2
    assert settled == [True]
    assert_bits_equal(load_file(state), steps[2])


@pytest.mark.faults(component="receiver", outcome="the fsync of a roll forward fails: the redo journal stays, and the next settle writes every value again before it trusts an fsync")
def test_a_failed_fsync_of_a_roll_forward_rewrites_every_value_next_time(published, tmp_path, monkeypatch):
    root, steps = published
    state = str(tmp_path / "s.safetensors")
    _receive(root, state, 1)
    _crash(root, state, 2, "committed")
    redo = state_journal.journal_path(state, "redo")
    assert not state_journal.roll_back(state) and os.path.exists(redo), "a roll back leaves a committed patch alone"
    real_fsync, calls = os.fsync, []

    def failing_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(state_journal.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="Input/output error"):
        state_journal.settle(state)
    monkeypatch.setattr(state_journal.os, "fsync", real_fsync)
    assert os.path.exists(redo) and os.path.exists(redo + state_journal.FAILED_SUFFIX)
    real_put = state_journal.put
    monkeypatch.setattr(state_journal, "put", lambda *a, **k: calls.append(k.get("differing")) or real_put(*a, **k))
    assert state_journal.settle(state) == 2
    assert calls == [False], "every value written again, not only those that differ"
    assert not os.path.exists(redo) and not os.path.exists(redo + state_journal.FAILED_SUFFIX)
    assert_bits_equal(load_file(state), steps[2])


def test_each_receive_settles_the_previous_commit_first(published, tmp_path, monkeypatch):
    root, steps = published
    state = str(tmp_path / "s.safetensors")
    _receive(root, state, 1)
    _receive(root, state, 3)
    settled = []
    real = state_journal.roll_forward
    monkeypatch.setattr(state_journal, "roll_forward", lambda p: settled.append(real(p)) or settled[-1])
    _receive(root, state, 5)
    assert settled[0] == 3, "the commit of step 3 settled (fsynced) before the refit to 5"
    assert state_journal.pending_step(state) == 5
    assert_bits_equal(load_file(state), steps[5])


@pytest.mark.faults(component="receiver", outcome="a journal beside another file is refused with a one-line error; the file untouched")
def test_a_journal_left_beside_another_file_is_refused(published, tmp_path):
    root, steps = published
    state, other = str(tmp_path / "s.safetensors"), str(tmp_path / "o.safetensors")
    _receive(root, state, 1)
    _crash(root, state, 4, "record 3")
    run_receive(root, "other", other, 6)
    shutil.copyfile(other, state)  # the user restores another file under the crashed one's name
    before = file_bytes(state)
    with pytest.raises(StateMismatchError, match="journal of another file") as e:
        _receive(root, state, 4)
    assert "\n" not in str(e.value)
    assert file_bytes(state) == before


@pytest.mark.faults(component="receiver", outcome="refused with a one-line error naming the journal; nothing changed")
@pytest.mark.parametrize("where", ["head", "record", "trailer"])
def test_a_damaged_journal_is_refused(published, tmp_path, where):
    root, _ = published
    state = str(tmp_path / "s.safetensors")
    _receive(root, state, 1)
    _crash(root, state, 4, "record 3")
    path = state_journal.journal_path(state)
    data = bytearray(open(path, "rb").read())
    at = {"head": bytes(data).index(b'"records": [[') + 13, "record": -40, "trailer": -3}[where]
    data[at] ^= 0x01  # head: one digit of the first record's file offset
    open(path, "wb").write(bytes(data))
    before = file_bytes(state)
    with pytest.raises(StateMismatchError, match="damaged journal") as e:
        _receive(root, state, 4)
    assert "\n" not in str(e.value)
    assert file_bytes(state) == before


def test_the_journal_holds_only_the_changed_elements(published, tmp_path):
    root, steps = published
    state = str(tmp_path / "s.safetensors")
    _receive(root, state, 2)
    plan = reader.plan_refit(open_root(root), 2, 3)
    staged = state_file.stage_refit(plan, state, IN_PLACE)
    assert staged.in_place
    journal = state_journal.read(state, staged.path)
    changed = sum(
        int(np.count_nonzero(bits_of(steps[2][n]).reshape(-1) != bits_of(steps[3][n]).reshape(-1))) for n in steps[2]
    )
    assert sum(r.positions.size for r in journal.records) == changed
    os.unlink(staged.path)  # staged, never installed: the state is untouched
    assert peek_state_step(state) == 2


def test_overwrite_encoded_tensors_are_patched_through_the_copy_path(tmp_path):
    root = str(tmp_path / "root")
    s0 = chain_of_steps(1, seed=8, big=40)[0]
    s1 = next_step(s0, 4, fraction=0.02)
    opts = PublishOptions(chunk_bytes=256, cache_dir=str(tmp_path / "cache"), overwrite_above=0.01)
    run_publish(root, s0, 0, options=opts)
    res = run_publish(root, s1, 1, options=opts)
    from storage.catalog import Catalog
    from storage.root import Root

    encodings = {e.encoding.value for e in Catalog(Root(root)).manifest(1).tensors.values()}
    assert "overwrite" in encodings, encodings
    state = tmp_path / "s.safetensors"
    _receive(root, state, 0)
    inode = os.stat(state).st_ino
    _receive(root, state, 1)
    assert os.stat(state).st_ino == inode
    assert_bits_equal(load_file(state), s1)
    assert res.step == 1


def test_cond_coded_deltas_patch_in_place_forward_and_backward_exactly(tmp_path):
    """``dcr.cond`` chunks decode against the state file's own bits: one step streamed (forward and
    back), several combined on the copy path, each equal to the rewrite and the checkpoints."""
    root = str(tmp_path / "root")
    steps = chain_of_steps(5, seed=8, big=40, ulps=0.5)
    opts = PublishOptions(chunk_bytes=256, cache_dir=str(tmp_path / "cache"), delta_codec=DELTA_CODECS["cond"])
    for i, s in enumerate(steps):
        run_publish(root, s, i, keyframe=(i == 0), options=opts)
    walked = [t for t, _ in _walk(root, steps, (1, 2, 1, 4, 3, 0, 2), tmp_path)]
    assert walked == [1, 2, 1, 4, 3, 0, 2]


@pytest.fixture
def applied_in_parallel(monkeypatch):
    """Chunks of XOR deltas applied on the worker threads whatever their size (this file's chunks are
    small); the names of the tensors that took that path."""
    monkeypatch.setattr(in_place, "LANE_MIN_BYTES", 0)
    names = []
    real = in_place.xor_parallel
    monkeypatch.setattr(in_place, "xor_parallel", lambda *a, **k: names.append(a[1].name) or real(*a, **k))
    return names


def test_in_place_refits_with_chunks_applied_in_parallel_equal_the_rewrite(published, tmp_path, applied_in_parallel):
    """With the held block digests trusted, an XOR delta's frames are applied and hashed chunk by
    chunk on several threads, each into its own place in the journal's arrays."""
    root, steps = published
    for _ in _walk(root, steps, (1, 2, 3, 2, 6, 5, 0), tmp_path):
        pass
    assert len(set(applied_in_parallel)) > 3, "the parallel path ran for the changed tensors"


def _reencoded_one_change_off(root, step) -> str:
    """Rewrite one stored XOR chunk of ``step`` as a valid sparse frame of the same size whose mask
    differs in one bit of one change (the chunk's size and format pass; its bits do not), in its
    pack or its own object. How errors name it."""
    m = Catalog(open_root(root)).manifest(step)
    for e in sorted(m.tensors.values(), key=lambda e: -e.nbytes):
        if not e.n_stored or e.encoding_at(0).value != "xor":
            continue
        path, offset, nbytes = chunk_at(root, step, e.name, 0)
        storage = np.dtype(DTYPES[e.dtype].storage)
        with open(path, "rb") as f:
            f.seek(offset)
            mask = sparse.decode_sparse(f.read(nbytes), storage, e.grid.chunk_numel)
        for i in np.flatnonzero(mask)[:64]:
            for bit in range(8 * storage.itemsize):
                other = mask.copy()
                other[i] ^= storage.type(1 << bit)
                if other[i] == 0:
                    continue
                frame = sparse.encode_sparse(other, m.codec.clevel)
                if len(frame) == nbytes:
                    with open(path, "r+b") as f:
                        f.seek(offset)
                        f.write(frame)
                    return chunk_named(root, step, e.name, 0)
    raise AssertionError("no XOR chunk could be re-encoded to its own size")  # pragma: no cover


def _section_cut(root, step) -> str:
    """Make the first section of one stored sparse XOR frame of ``step`` claim more bytes than the
    frame holds: its header still passes (``frame_changes``), its body does not. How errors name it."""
    m = Catalog(open_root(root)).manifest(step)
    for e in sorted(m.tensors.values(), key=lambda e: -e.nbytes):
        for pos in range(e.n_stored):
            path, offset, nbytes = chunk_at(root, step, e.name, pos)
            with open(path, "r+b") as f:
                f.seek(offset)
                head = f.read(sparse._HEAD.size)
                if e.encoding_at(pos).value != "xor" or head[5] != sparse.SPARSE:
                    continue
                f.write(struct.pack("<Q", 1 << 40))
            return chunk_named(root, step, e.name, pos)
    raise AssertionError("no sparse XOR frame at this step")  # pragma: no cover


@pytest.mark.faults(component="receiver", outcome="a chunk of an in-place refit damaged in ROOT (its frame applied before its digest is checked): refused naming the object; the state byte-identical, no journal")
@pytest.mark.parametrize("trusted", [True, False], ids=["block-digests-kept", "no-block-digests"])
@pytest.mark.parametrize("damage", ["flipped", "one-change-off", "section-cut"])
def test_a_damaged_chunk_of_an_in_place_refit_is_named_and_nothing_changes(published, tmp_path, monkeypatch,
                                                                           trusted, damage):
    src, _ = published
    root = str(tmp_path / "root")
    shutil.copytree(src, root)
    monkeypatch.setattr(in_place, "LANE_MIN_BYTES", 0)
    state = tmp_path / "s.safetensors"
    _receive(root, state, 0)
    _receive(root, state, 1)  # from here on, the state's block digests are kept beside it
    if not trusted:
        sidecar.remove(str(state))
    if damage == "flipped":
        chunks = stored_chunks(root, 2)
        victim = chunk_named(root, 2, *chunks[len(chunks) // 2])
        damage_chunk(root, 2, *chunks[len(chunks) // 2])
    elif damage == "one-change-off":  # a valid frame of this chunk, of the same size: only a digest can tell
        victim = _reencoded_one_change_off(root, 2)
    else:  # a frame whose header passes and whose body is cut short
        victim = _section_cut(root, 2)
    before = file_bytes(state)
    with pytest.raises(IntegrityError) as ei:
        _receive(root, state, 2)
    assert "\n" not in str(ei.value)
    assert victim in str(ei.value)
    assert file_bytes(state) == before
    assert not os.path.exists(state_journal.journal_path(str(state)))
    assert peek_state_step(str(state)) == 1
