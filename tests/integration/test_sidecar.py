"""In-place refits that re-hash only the blocks they change (block digests, ``storage.local.sidecar``),
state files edited behind DCR's back, and ``dcr verify-state``.

Reference: the published checkpoints and the same refits through the default rewrite, compared on
raw bits. Edits are real writes to the state file (``pwrite``), with and without its modification
time put back; a bit flip below the file system (which no time stamp shows) is simulated by
re-stamping the sidecar after the edit.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.torch import load_file

from dcr_core import events
from dcr_core.digest import block_leaves
from dcr_core.errors import StateMismatchError
from flows import run_receive
from flows.cli import main
from flows.options import ReceiveOptions
from flows.receive.verify_state import verify_state
from storage import layout
from storage.local import journal, sidecar
from storage.local.safetensors import SafetensorsCheckpoint
from storage.manifest import Manifest
from storage.root import open_root
from tests.support.helpers import assert_bits_equal, chain_of_steps, file_bytes, from_bits, raw_bytes
from tests.support.publishing import publish_steps

IN_PLACE = ReceiveOptions(in_place=True, io_workers=2)
BLOCK = 4096


def _steps(n, seed):
    """A nasty chain plus a large tensor whose changes stay in a few rows (as with frozen layers)."""
    steps = chain_of_steps(n, seed=seed, big=64)
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 1 << 16, 300 * 128, dtype=np.uint16)
    for s in steps:
        rows = rng.choice(300, 3, replace=False)
        bits = bits.copy()
        for r in rows:
            bits[r * 128 : r * 128 + 5] ^= np.uint16(1 + r)
        s["clustered"] = from_bits(bits, "BF16", (300, 128))
    return steps


def _receive_counted(root, state, step, in_place=True):
    seen = []

    def listen(point, fields):
        if point == "receive.blocks-hashed":
            seen.append(fields)

    with events.listening(listen):
        res = run_receive(root, "rx", str(state), step, options=IN_PLACE if in_place else None)
    return res, (seen[0] if seen else None)


def _changed_blocks(a, b):
    """Blocks whose bytes differ between two checkpoints (what a trusted refit hashes)."""
    n = 0
    for name in a:
        x, y = raw_bytes(a[name]), raw_bytes(b[name])
        n += sum(x[i : i + BLOCK] != y[i : i + BLOCK] for i in range(0, len(x), BLOCK))
    return n


def _total_blocks(root, step):
    m = _manifest(root, step)
    return sum(-(-e.nbytes // BLOCK) for e in m.tensors.values())


def _manifest(root, step):
    from storage.catalog import Catalog

    return Catalog(open_root(root)).manifest(step)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    base = tmp_path_factory.mktemp("sidecar")
    root = str(base / "root")
    steps = _steps(5, 11)
    publish_steps(root, steps, chunk_bytes=1024, digest_block_bytes=BLOCK)
    return root, steps


@pytest.mark.parametrize("chunk", [1024, 16384, 6000], ids=["chunks-in-blocks", "blocks-in-chunks", "unaligned"])
def test_in_place_refits_hash_only_changed_blocks_and_stay_exact(tmp_path, chunk):
    root = str(tmp_path / "root")
    steps = _steps(5, 3)
    publish_steps(root, steps, chunk_bytes=chunk, digest_block_bytes=BLOCK)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    run_receive(root, "rx", str(a), 0, options=IN_PLACE)  # fresh: written whole, no block digests kept
    assert sidecar.read(str(a)) is None
    res, seen = _receive_counted(root, a, 1)
    total = _total_blocks(root, 1)
    assert seen == {"blocks": total, "trusted": False}, "no block digests kept yet: every block hashed"
    held = 1
    for target in (3, 2, 4, 0, 1):
        res, seen = _receive_counted(root, a, target)
        run_receive(root, "rx", str(b), target)
        assert res.step == target and seen["trusted"]
        changed = _changed_blocks(steps[held], steps[target])
        if abs(target - held) == 1:  # one XOR delta: exactly the blocks with a change are hashed
            assert seen["blocks"] == changed, (held, target)
        else:  # several moves, applied on a copy: the blocks their chunks landed in
            assert changed <= seen["blocks"] <= total - 17, (held, target)
        assert seen["blocks"] <= total - 17 - 10, "the frozen embedding and the clustered tensor's unchanged rows "\
            "are not hashed"
        held = target
        assert_bits_equal(load_file(a), steps[target])
        assert_bits_equal(load_file(a), load_file(b))
        kept = sidecar.read(str(a))
        assert kept.step == target
        m = _manifest(root, target)
        with SafetensorsCheckpoint(str(a)) as ck:  # the kept digests are the file's, block for block
            for name in m.tensors:
                assert np.array_equal(kept.leaves[name], block_leaves(ck.mapped_bits(name), BLOCK)), name
    assert verify_state(str(a)).sidecar == "agreed"


def test_flat_and_block_manifests_mix_in_one_chain(tmp_path):
    """A ROOT written before block digests (schema 1), continued with them: every refit across the
    two schemes is exact, and the sidecar is used only where both sides have block digests."""
    root = str(tmp_path / "root")
    steps = _steps(6, 5)
    publish_steps(root, steps[:3], chunk_bytes=1024, digest_block_bytes=None, pack_bytes=0)  # as written before block digests (and packs)
    publish_steps(root, steps[3:], 3, chunk_bytes=1024, digest_block_bytes=BLOCK)
    r = open_root(root)
    for s, version in [(0, 1), (2, 1), (3, 3), (5, 3)]:
        m = _manifest(root, s)
        raw = r.read(layout.manifest_key(s, m.attempt))
        assert Manifest.from_json(raw, "m").schema_version == version
        assert m.digest_scheme.blocked == (b'"digest_scheme"' in raw) == (version > 1)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    run_receive(root, "rx", str(a), 0, options=IN_PLACE)
    trusted = []
    for target in (2, 4, 5, 1, 5, 3, 5):
        _, seen = _receive_counted(root, a, target)
        run_receive(root, "rx", str(b), target)
        assert_bits_equal(load_file(a), steps[target])
        assert_bits_equal(load_file(a), load_file(b))
        trusted.append(seen["trusted"])
    # a chain through a flat manifest keeps no block digests; 5 -> 3 writes them, 3 -> 5 trusts them
    assert trusted == [False] * 6 + [True]
    for s in range(6):
        out = tmp_path / f"m{s}.safetensors"
        from flows import run_materialize

        run_materialize(root, s, out)
        assert_bits_equal(load_file(out), steps[s])
    assert main(["verify", root, "-q"]) == 0


def _held(root, tmp_path, step=1):
    """A state at ``step`` received in place, its block digests kept and trusted."""
    state = tmp_path / "s.safetensors"
    run_receive(root, "rx", str(state), 0, options=IN_PLACE)
    run_receive(root, "rx", str(state), step, options=IN_PLACE)
    assert sidecar.read(str(state)).step == step
    return str(state)


def _flip(state, name, at=0):
    offset = SafetensorsCheckpoint(state).data_offset(name) + at
    fd = os.open(state, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)[0]
        os.pwrite(fd, bytes([byte ^ 0x08]), offset)
    finally:
        os.close(fd)


@pytest.mark.faults(component="receiver", outcome="a state file edited behind DCR's back (mtime put back or not): the in-place refit that trusts block digests notices (change time), hashes everything and refuses, naming the tensor; the file untouched")
@pytest.mark.parametrize("restore_mtime", [False, True], ids=["edited", "edited-mtime-restored"])
def test_a_state_edited_behind_dcrs_back_is_refused(chain, tmp_path, restore_mtime):
    root, steps = chain
    state = _held(root, tmp_path)
    st = os.stat(state)
    _flip(state, "embed.frozen", 4 * 257 * 40)  # a block no refit changes
    if restore_mtime:
        os.utime(state, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(state).st_mtime_ns == st.st_mtime_ns
    before = file_bytes(state)
    with pytest.raises(StateMismatchError, match="tensor 'embed.frozen' is not the bits of step 1"):
        run_receive(root, "rx", state, 2, options=IN_PLACE)
    assert file_bytes(state) == before
    assert not os.path.exists(journal.journal_path(state))


@pytest.mark.faults(component="receiver", outcome="a bit flipped below the file system (no time stamp moves): found by the sampled blocks when they cover it, and always by dcr verify-state, which removes the block digests so the next refit hashes everything and refuses")
def test_a_flip_no_time_stamp_shows_is_found_by_samples_and_by_verify_state(chain, tmp_path, monkeypatch, capsys):
    root, steps = chain
    state = _held(root, tmp_path)
    kept = sidecar.read(state)
    _flip(state, "embed.frozen", 4 * 257 * 40)
    sidecar.write(state, kept)  # re-stamped: as if the flip came from the disk, not through the file system
    before = file_bytes(state)
    monkeypatch.setattr(sidecar, "SAMPLE_BLOCKS", 10**6)  # every block sampled: found for sure
    with pytest.raises(StateMismatchError, match="tensor 'embed.frozen' is not the bits of step 1"):
        run_receive(root, "rx", state, 2, options=IN_PLACE)
    assert file_bytes(state) == before
    monkeypatch.setattr(sidecar, "SAMPLE_BLOCKS", 0)  # no sample: the stated limit of the policy
    run_receive(root, "rx", state, 2, options=IN_PLACE)
    with pytest.raises(AssertionError, match="embed.frozen"):
        assert_bits_equal(load_file(state), steps[2])
    rc = main(["verify-state", state])
    err = capsys.readouterr().err
    assert rc != 0 and "tensors is not the bits of step 2" in err and "'embed.frozen'" in err and "\n" not in err.strip()
    assert sidecar.read(state) is None, "the block digests of a bad state are removed"
    with pytest.raises(StateMismatchError, match="tensor 'embed.frozen' is not the bits of step 2"):
        run_receive(root, "rx", state, 3, options=IN_PLACE)


def test_verify_state_refreshes_the_block_digests(chain, tmp_path, capsys):
    root, steps = chain
    state = str(tmp_path / "s.safetensors")
    run_receive(root, "rx", state, 2)  # rewritten: no block digests kept
    assert main(["verify-state", state]) == 0
    out = capsys.readouterr().out
    assert "step 2" in out and "no usable block digests were kept" in out
    assert main(["verify-state", state, "--root", root, "--json"]) == 0
    import json

    res = json.loads(capsys.readouterr().out)
    assert (res["step"], res["sidecar"], res["stale_blocks"]) == (2, "agreed", 0)
    _, seen = _receive_counted(root, state, 3)
    assert seen == {"blocks": _changed_blocks(steps[2], steps[3]), "trusted": True}
    assert_bits_equal(load_file(state), steps[3])
    assert main(["verify-state", str(tmp_path / "missing.safetensors")]) != 0
    assert "no such state file" in capsys.readouterr().err


@pytest.mark.faults(component="receiver", outcome="a receiver polling an idle ROOT checks its state by the kept block digests (stamp and samples), hashes everything when they are missing or the file was touched, and refuses a state edited behind DCR's back")
def test_receives_with_nothing_to_apply_trust_the_kept_digests_only_as_the_policy_allows(chain, tmp_path):
    root, steps = chain
    state = str(tmp_path / "s.safetensors")
    run_receive(root, "rx", state, 2)  # rewritten: no block digests kept
    total = _total_blocks(root, 2)
    assert _receive_counted(root, state, 2, in_place=False)[1] == {"blocks": total, "trusted": False}
    assert _receive_counted(root, state, 2, in_place=False)[1] == {"blocks": 0, "trusted": True}
    st = os.stat(state)
    _flip(state, "clustered", 9000)
    os.utime(state, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(StateMismatchError, match="tensor 'clustered' is not the bits of step 2"):
        run_receive(root, "rx", state, 2)
