"""The C kernels of dcr_zarr_codec._b3runs: members' digests (BLAKE3 of many runs of one buffer,
byte for byte the ``blake3`` package's, in both digest schemes; bad offsets refused, nothing read)
and the policy digest's text hashed in one pass."""

import blake3
import numpy as np
import pytest
from dcr_zarr_codec._b3runs import rows_hex, runs_hex

from dcr_core.bundles import member_digests
from dcr_core.digest import BLOCKS_SCHEME, DigestScheme, policy_digest

# around BLAKE3's block (64) and chunk (1024) sizes, and its SIMD degrees' multiples of chunks
SIZES = [0, 1, 63, 64, 65, 1023, 1024, 1025, 2048, 3000, 4096, 8191, 16384, 16385, 65536 + 7, 0, 5]


def _runs(seed: int = 0):
    rng = np.random.default_rng(seed)
    starts = np.concatenate([[0], np.cumsum(SIZES)]).astype(np.int64)
    return rng.integers(0, 256, int(starts[-1]) + 11, dtype=np.uint8), starts


def test_runs_hex_is_blake3_of_each_run_with_and_without_a_prefix():
    raw, st = _runs()
    runs = [raw[a:b].tobytes() for a, b in zip(st[:-1], st[1:])]
    assert runs_hex(raw, st) == tuple(blake3.blake3(r).hexdigest() for r in runs)
    head = b"a prefix\n"
    assert runs_hex(raw, st, head) == tuple(blake3.blake3(head + blake3.blake3(r).digest()).hexdigest() for r in runs)
    assert runs_hex(raw, st[:1]) == ()  # no run
    assert runs_hex(raw, st[3:6]) == runs_hex(raw[st[3]:], st[3:6] - st[3])  # runs anywhere in the buffer


def test_runs_of_equal_length_hashed_side_by_side_are_blake3_of_each():
    """Runs of whole 64-byte blocks go through BLAKE3's tree across their group (one SIMD call per
    level): every chunk count up to past 64 chunks (trees of every shape), groups of 1 to 19, mixed
    with runs hashed alone, in any order."""
    rng = np.random.default_rng(3)
    lens = [n for c in [*range(1, 34), 63, 64, 65, 70] for n in (c * 1024, c * 1024 - 64, 64 * c)
            for _ in range(int(rng.integers(1, 20)))] + [0, 1, 5, 100, 1000, 64, 64, 128]
    rng.shuffle(lens)
    st = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    raw = rng.integers(0, 256, int(st[-1]), dtype=np.uint8)
    assert runs_hex(raw, st) == tuple(blake3.blake3(raw[a:b]).hexdigest() for a, b in zip(st[:-1], st[1:]))


@pytest.mark.parametrize("bad", [[0, -1], [5, 4], [0, 10**9], [-3, 0], []])
def test_runs_hex_refuses_offsets_outside_the_buffer(bad):
    raw, _ = _runs()
    with pytest.raises(ValueError):
        runs_hex(raw, np.array(bad, np.int64))


@pytest.mark.parametrize("scheme", [DigestScheme(), DigestScheme(1024), DigestScheme(4096)])
def test_member_digests_are_each_members_digest_in_its_scheme(scheme):
    raw, st = _runs(1)
    want = tuple(scheme.digest(raw[a:b]) for a, b in zip(st[:-1], st[1:]))  # members of several blocks included
    assert member_digests(raw, st, scheme) == want
    if scheme.blocked:  # an empty member: the digest of no block (the scheme's head alone)
        assert want[0] == blake3.blake3(f"{BLOCKS_SCHEME}\n{scheme.block_bytes}\n".encode()).hexdigest()


def _policy_text_digest(rows) -> str:
    """The policy digest's definition, written out: the text of the sorted rows, hashed."""
    return blake3.blake3("".join(f"{n}\0{d}\0{','.join(map(str, s))}\0{g}\n" for n, d, s, g in sorted(rows)).encode()
                         ).hexdigest()


def test_policy_digest_in_c_is_the_digest_of_its_text_and_odd_rows_go_the_python_way():
    """``rows_hex`` (the policy digest's C path) hashes the text ``policy_digest`` defines; rows it
    does not take as they are (a bool or an int beyond 64 bits in a shape, a list for a row) give
    None, and ``policy_digest`` builds the text in Python; text that is not UTF-8 fails the same way."""
    rng = np.random.default_rng(5)
    rows = [(f"model.layers.{i}.experts.{rng.integers(1000)}.w\u00e9", str(rng.choice(["BF16", "F32", "I8"])),
             tuple(int(x) for x in rng.integers(0, 10**12, int(rng.integers(0, 5)))), f"{i:064x}") for i in range(3000)]
    rows += [("\u4e2d\U0001f600", "F32", (), "0" * 64), ("neg", "I64", [-1, -(2**63), 2**63 - 1], "")]
    assert rows_hex(sorted(rows)) == _policy_text_digest(rows) == policy_digest(rows)
    assert rows_hex([]) == blake3.blake3(b"").hexdigest() == policy_digest([])
    for odd in ([("a", "F32", (True,), "d")], [("a", "F32", (2**64,), "d")], [["a", "F32", (1,), "d"]],
                [("a", "F32", (1,), b"d")], [("a", "F32", (1, 2.0), "d")]):
        assert rows_hex(odd) is None
    assert policy_digest([("a", "F32", (True, 2**64), "d")]) == _policy_text_digest([("a", "F32", (True, 2**64), "d")])
    with pytest.raises(UnicodeEncodeError):
        policy_digest([("\ud800", "F32", (), "d")])
