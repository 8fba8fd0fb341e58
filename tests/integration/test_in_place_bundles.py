"""In-place receives of bundled steps (``--in-place`` on a lineage published with bundles).

A state file DCR writes lays each bundle's members out back to back in bundle order, so a bundle is
one byte range of it: the in-place receiver patches it as one tensor at its first member's offset
(journal records, block digests and checks per stored tensor), and checks every member's digest
after. Reference: the dense checkpoints and the same refits through the default rewrite, on raw
bits; crashes are real (a forked child dies with ``os._exit`` at each reported point of the patch).
A state whose members lie otherwise is rewritten.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct

import numpy as np
import pytest
from safetensors.torch import load_file

from dcr_core import bundles, events
from dcr_core.bits import bits_of
from dcr_core.errors import StateMismatchError
from flows import run_publish
from flows.options import PublishOptions
from flows.receive import in_place, state_file
from flows.receive.verify_state import verify_state
from storage import reader
from storage.catalog import Catalog
from storage.local import journal as state_journal
from storage.local import sidecar
from storage.local.bundled import BundledView
from storage.local.safetensors import SafetensorsCheckpoint
from storage.local.state import consistent_state
from storage.local.state import peek_step as peek_state_step
from storage.root import open_root
from tests.integration.test_in_place import IN_PLACE, _blocks_trusted, _crash, _cut_off_rolls_back, _receive, _walk
from tests.support.helpers import assert_bits_equal, chain_of_steps, file_bytes
from tests.support.kill import sweep


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    """A keyframe and 6 XOR deltas of a nasty checkpoint, its tensors under 1100 bytes in bundles (one
    or more per dtype; the large frozen embedding and the 8-byte dtypes' matrices stored alone),
    chunks of 256 bytes: a bundle spans many chunks, a chunk many members."""
    base = tmp_path_factory.mktemp("inplace-bundles")
    root = str(base / "root")
    steps = chain_of_steps(7, seed=3, big=40)
    opts = PublishOptions(chunk_bytes=256, bundle_min_tensors=2, bundle_below=1100, cache_dir=str(base / "cache"))
    for i, s in enumerate(steps):
        run_publish(root, s, i, keyframe=(i == 0), options=opts)
    m = _manifest(root, 1)
    assert len(m.bundles()) >= 10 and any(m.tensors[b].n_stored for b in m.bundles())
    assert any(e.members is None for e in m.tensors.values()), "tensors stored alone too"
    return root, steps


def _manifest(root, step):
    return Catalog(open_root(root)).manifest(step)


def _patched(fn):
    """Run ``fn`` and return what it returned and whether it patched the state in place (reached
    ``receive.patched``) rather than rewriting it."""
    seen = []
    with events.listening(lambda p, f: seen.append(p)):
        out = fn()
    return out, "receive.patched" in seen


def _first_member_offsets(state, m) -> dict[int, str]:
    """Bundle by the file offset of its first member in the state file."""
    with SafetensorsCheckpoint(state) as ck:
        return {ck.data_offset(members.names[0]): b for b, members in m.bundles().items()}


def test_a_bundled_chain_is_patched_in_place_forward_backward_and_forward_again(bundled, tmp_path):
    """Forward one step, several, backward, back to the keyframe by deltas and forward again: every
    receive patches the file in place (never replaces it), equals the rewrite and the dense
    checkpoints, and keeps block digests the next receive trusts (one per stored tensor: bundles by
    their names)."""
    root, steps = bundled
    patched = []
    real = in_place.stage_patch
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(in_place, "stage_patch", lambda *a, **k: patched.append(a[0].target_step) or real(*a, **k))
        targets = (1, 4, 2, 6, 0, 5, 4)
        for target, a in _walk(root, steps, targets, tmp_path):
            assert peek_state_step(str(a)) == target
            kept = sidecar.read(str(a))
            assert kept is not None and set(kept.leaves) == set(_manifest(root, target).tensors)
            assert _blocks_trusted(root, str(a), target)
    assert patched == list(targets)
    assert state_journal.settle(str(a)) == 4
    assert_bits_equal(load_file(a), steps[4])


def test_the_journal_addresses_each_bundle_as_one_range_of_the_file(bundled, tmp_path):
    """The staged refit is a patch (``in_place``), with one record per changed stored tensor: a
    bundle's at its first member's offset, its positions element positions in the bundle, and only
    the elements that change."""
    root, steps = bundled
    state = str(tmp_path / "s.safetensors")
    _receive(root, state, 2)
    plan = reader.plan_refit(open_root(root), 2, 3)
    assert in_place.eligible(plan, state)
    staged = state_file.stage_refit(plan, state, IN_PLACE)
    assert staged.in_place
    journal = state_journal.read(state, staged.path)
    m = _manifest(root, 3)
    firsts = _first_member_offsets(state, m)
    at_bundles = [r for r in journal.records if r.offset in firsts]
    assert {firsts[r.offset] for r in at_bundles} == {b for b in m.bundles() if m.tensors[b].n_stored}
    for r in at_bundles:
        assert int(r.positions[-1]) < m.tensors[firsts[r.offset]].members.numel
    changed = sum(
        int(np.count_nonzero(bits_of(steps[2][n]).reshape(-1) != bits_of(steps[3][n]).reshape(-1))) for n in steps[2]
    )
    assert sum(r.positions.size for r in journal.records) == changed
    os.unlink(staged.path)  # staged, never installed: the state is untouched
    assert peek_state_step(state) == 2


def test_a_bundled_chain_with_chunks_applied_in_parallel_equals_the_rewrite(bundled, tmp_path, monkeypatch):
    """With the held block digests trusted (a bundle's included), a bundle's XOR frames are applied
    and hashed chunk by chunk on the worker threads, like any tensor's."""
    root, steps = bundled
    monkeypatch.setattr(in_place, "LANE_MIN_BYTES", 0)
    names = []
    real = in_place.xor_parallel
    monkeypatch.setattr(in_place, "xor_parallel", lambda *a, **k: names.append(a[1].name) or real(*a, **k))
    for _ in _walk(root, steps, (1, 2, 3, 2, 6, 5), tmp_path):
        pass
    assert any(n.startswith(bundles.PREFIX) for n in names), "the parallel path ran for bundles"


@pytest.mark.faults(component="receiver", outcome="dcr verify-state of a bundled state with one member's bit flipped: refused naming the member; its block digests removed")
def test_verify_state_checks_a_bundled_state_and_names_a_bad_member(bundled, tmp_path):
    """``dcr verify-state`` reads each bundle as the step stores it: it agrees with the block digests
    an in-place receive kept (one per stored tensor), counts the tensors the file holds, and names a
    member whose bits changed behind DCR's back."""
    root, steps = bundled
    state = str(tmp_path / "s.safetensors")
    _receive(root, state, 1)
    _receive(root, state, 3)
    checked = verify_state(state)
    assert (checked.step, checked.sidecar, checked.tensors) == (3, "agreed", len(steps[3]))
    m = _manifest(root, 3)
    member = m.bundles()[next(iter(m.bundles()))].names[-1]
    with SafetensorsCheckpoint(state) as ck:
        offset = ck.data_offset(member)
        assert ck.infos[member].nbytes
    with open(state, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))
    with pytest.raises(StateMismatchError, match=f"1 of {len(steps[3])} tensors is not the bits of step 3 .*'{re.escape(member)}'") as e:
        verify_state(state)
    assert "\n" not in str(e.value) and sidecar.read(state) is None


def _write_reversed(src: str, dst: str) -> None:
    """The tensors and metadata of state ``src`` written by hand to ``dst`` in reverse name order (a
    bundle's members then lie back to back in the reverse of bundle order): the same bits, claiming
    the same step."""
    with SafetensorsCheckpoint(src) as ck:
        names = sorted(ck.infos, reverse=True)
        head, data, at = {"__metadata__": ck.metadata}, [], 0
        for n in names:
            raw = ck.bits(n).tobytes()
            head[n] = {"dtype": ck.infos[n].dtype, "shape": list(ck.infos[n].shape), "data_offsets": [at, at + len(raw)]}
            data.append(raw)
            at += len(raw)
    header = json.dumps(head).encode()
    header += b" " * (-len(header) % 8 + 256)  # room for the next step's metadata
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + b"".join(data))


def test_a_state_whose_members_are_not_back_to_back_is_rewritten_and_ends_exact(bundled, tmp_path):
    """A state file holding the step's bits with each bundle's members in another order (written by
    another tool, claiming the step): not eligible for a patch, so the refit rewrites it, exactly."""
    root, steps = bundled
    held = str(tmp_path / "held.safetensors")
    _receive(root, held, 2)
    state = str(tmp_path / "s.safetensors")
    _write_reversed(held, state)
    assert_bits_equal(load_file(state), steps[2])
    m = _manifest(root, 2)
    with SafetensorsCheckpoint(state) as ck:
        view = BundledView(ck, m.bundles())
        assert not any(view.one_run(b) for b in m.bundles())
        b = next(iter(m.bundles()))
        assert in_place.members_hold(m.tensors[b], view.mapped_bits(b))  # read run by run: a copy
    assert not in_place.eligible(reader.plan_refit(open_root(root), 2, 4), state)
    inode = os.stat(state).st_ino
    res, patched = _patched(lambda: _receive(root, state, 4))
    assert (res.from_step, res.step) == (2, 4) and not patched
    assert os.stat(state).st_ino != inode, "rewritten, not patched"
    assert_bits_equal(load_file(state), steps[4])
    res, patched = _patched(lambda: _receive(root, state, 1))  # the rewrite laid it out back to back: patched
    assert patched and res.step == 1
    assert_bits_equal(load_file(state), steps[1])


@pytest.mark.faults(component="receiver", outcome="a bundled step's member whose digest the manifest misstates (the bundle's own digest right): refused naming the member and step; nothing written")
def test_a_member_digest_that_the_result_misses_is_refused_naming_the_member(bundled, tmp_path, monkeypatch):
    """The patch proves the bundle's digest; each member's is proved after it (what the policy digest
    covers). A target whose member digest is wrong is refused before anything is written."""
    root, steps = bundled
    state = str(tmp_path / "s.safetensors")
    _receive(root, state, 1)
    before = file_bytes(state)
    m = _manifest(root, 2)
    b = next(b for b in m.bundles() if m.tensors[b].n_stored)
    members = m.tensors[b].members
    wrong = members.with_digests(members.digests[:-1] + ("0" * 64,))
    real = reader.manifests

    def misstated(plan, *a, **k):  # a copy: the process's cache of manifests keeps the true one
        ms = real(plan, *a, **k)
        if 2 in ms:
            tensors = {**ms[2].tensors, b: dataclasses.replace(ms[2].tensors[b], members=wrong)}
            ms = {**ms, 2: dataclasses.replace(ms[2], tensors=tensors)}
        return ms

    monkeypatch.setattr(reader, "manifests", misstated)
    with pytest.raises(StateMismatchError, match=f"step 2: tensor '{re.escape(members.names[-1])}' does not match its digest") as e:
        _receive(root, state, 2)
    assert "\n" not in str(e.value)
    assert file_bytes(state) == before
    assert not os.path.exists(state_journal.journal_path(state))


@pytest.mark.faults(component="receiver", outcome="crash mid-patch of a bundled step: the next receive rolls back to the old step, then ends bit-exact")
@pytest.mark.parametrize("point", ["journal written", "record 0", "record 3", "record -1", "header written",
                                   "blocks written"])
@pytest.mark.parametrize("held,target", sweep([(1, 4), (1, 2), (3, 2)], {(1, 2)}, key=tuple),
                         ids=["3-steps-copied", "1-step-streamed", "back-1-streamed"])
def test_a_bundled_patch_cut_off_anywhere_is_rolled_back_and_the_retry_is_exact(bundled, tmp_path, point, held, target):
    root, steps = bundled
    state = str(tmp_path / "s.safetensors")
    _receive(root, state, held)
    before = file_bytes(state)
    _crash(root, state, target, point)
    firsts = _first_member_offsets(state, _manifest(root, target))
    assert any(r.offset in firsts for r in state_journal.read(state).records), "bundles patched as one range each"
    _cut_off_rolls_back(root, state, point, held, target, before)
    assert_bits_equal(load_file(state), steps[held])
    assert not _blocks_trusted(root, state, target)
    # The crash once more, then a plain retry: the receive rolls back first, then patches.
    _crash(root, state, target, point)
    res, patched = _patched(lambda: _receive(root, state, target))
    assert (res.from_step, res.step) == (held, target) and patched
    assert_bits_equal(load_file(state), steps[target])
    assert not os.path.exists(state_journal.journal_path(state))
    assert _blocks_trusted(root, state, target)


@pytest.mark.faults(component="receiver", outcome="crash after the commit of a bundled patch, then pages lost: the next receive rolls forward to the new step, bit-exact, and refits nothing")
@pytest.mark.parametrize("held,target", [(1, 4), (3, 2)], ids=["3-steps-copied", "back-1-streamed"])
def test_a_committed_bundled_patch_is_rolled_forward_even_when_its_pages_were_lost(bundled, tmp_path, held, target,
                                                                                  monkeypatch):
    root, steps = bundled
    state = str(tmp_path / "s.safetensors")
    _receive(root, state, held)
    before = file_bytes(state)
    _crash(root, state, target, "committed")
    assert peek_state_step(state) == target, "a committed patch reads as its new step"
    assert_bits_equal(load_file(state), steps[target])
    patched = file_bytes(state)
    monkeypatch.setattr(state_journal, "boot_id", lambda: "the boot after the power loss")
    torn = bytes(b if i % 8192 < 4096 else a for i, (a, b) in enumerate(zip(before, patched)))
    for lost in (before, torn):  # every page of the patch lost, or every other one
        redo = state_journal.journal_path(state, "redo")
        kept = open(redo, "rb").read()
        with open(state, "r+b") as f:
            f.write(lost)
        res = _receive(root, state, target)
        assert (res.from_step, res.step, res.moves) == (target, target, [])
        assert file_bytes(state) == patched, "byte for byte the patched file"
        assert not os.path.exists(redo)
        open(redo, "wb").write(kept)  # the journal back, for the next case
    with consistent_state(state):
        assert_bits_equal(load_file(state), steps[target])
