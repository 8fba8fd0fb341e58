"""Projection: a rank's shard changes, written straight into canonical chunks.

Given a rank's local shards (new bits and the baseline bits of the same shards, both already in
the canonical dtype) and their pieces, ``project`` walks the canonical chunks the rank touches, one
chunk buffer at a time, and yields each chunk's mask restricted to the rank's region (zeros
elsewhere): ``new ^ base`` for deltas, the new bits for keyframes. Nothing else is assembled: peak
extra memory is one chunk buffer plus the run tables.

Why the result is exact: the pieces of all ranks partition every canonical tensor, so the masks of
the ranks touching a chunk cover disjoint regions, and XOR of zero-padded disjoint masks is their
union. A chunk that one rank covers entirely is that chunk's whole mask (``owner``); others are
*parts* that receivers XOR together (see ``storage.manifest.PartTable``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from dcr_core.chunking import ChunkGrid
from dcr_core.errors import UsageError
from dcr_core.shard_spec import Piece


@dataclass(frozen=True, slots=True)
class ShardBits:
    """One local tensor of a rank: its pieces, its new bits and (deltas) its baseline bits, flat."""

    pieces: tuple[Piece, ...]
    new: np.ndarray
    base: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.base is not None and (self.base.shape != self.new.shape or self.base.dtype != self.new.dtype):
            raise UsageError("a shard's baseline must have the shape and dtype of its new bits")


@dataclass(frozen=True, slots=True)
class Contribution:
    """A rank's share of one canonical chunk: ``owner`` when the rank covers all of it."""

    name: str
    index: int
    payload: np.ndarray
    owner: bool
    changed: int


@dataclass
class _Runs:
    cstart: np.ndarray
    lstart: np.ndarray
    length: np.ndarray
    shard: np.ndarray


def _runs_by_name(shards: Sequence[ShardBits | _Extent]) -> dict[str, _Runs]:
    acc: dict[str, list] = {}
    for si, sh in enumerate(shards):
        for p in sh.pieces:
            c, l, n = p.runs()
            if not n:
                continue
            lo, hi = p.local_span()
            if hi >= sh.new.size:  # (sh.new may be an _Extent: only .size is used)
                raise UsageError(f"a piece of {p.name!r} reaches local element {hi}; the shard has {sh.new.size}")
            acc.setdefault(p.name, []).append((c, l, np.full(c.size, n, np.int64), np.full(c.size, si, np.int64)))
    out = {}
    for name, parts in acc.items():
        cstart, lstart, length, shard = (np.concatenate(x) for x in zip(*parts))
        order = np.argsort(cstart, kind="stable")
        cstart, lstart, length, shard = cstart[order], lstart[order], length[order], shard[order]
        if np.any(cstart[1:] < cstart[:-1] + length[:-1]):
            raise UsageError(f"tensor {name!r}: this rank's pieces overlap")
        out[name] = _Runs(cstart, lstart, length, shard)
    return out


def chunk_starts(grid: ChunkGrid) -> np.ndarray:
    """Flat start of every chunk, in chunk order (increasing: chunks are contiguous runs)."""
    if grid.n_chunks == 0:
        return np.zeros(0, dtype=np.int64)
    if not grid.shape:
        return np.zeros(1, dtype=np.int64)
    idx = np.indices(grid.grid_shape, dtype=np.int64).reshape(len(grid.shape), -1)
    strides = np.array([c * s for c, s in zip(grid.chunk_shape, _c_strides(grid.shape))], dtype=np.int64)
    return (strides[:, None] * idx).sum(axis=0)


def _c_strides(shape):
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def project(
    shards: Sequence[ShardBits], grids: dict[str, ChunkGrid], dtypes: dict[str, np.dtype]
) -> Iterator[Contribution]:
    """Yield this rank's contribution to every canonical chunk it touches that is not all zero,
    tensor by tensor (sorted names), chunk by chunk. ``dtypes``: storage dtype per canonical name."""
    if len({s.base is None for s in shards}) > 1:
        raise UsageError("either every shard has a baseline (delta) or none has (keyframe)")
    runs = _runs_by_name(shards)
    for name in sorted(runs):
        if name not in grids:
            raise UsageError(f"a piece names {name!r}, which is not a canonical tensor")
        r, grid = runs[name], grids[name]
        ends = r.cstart + r.length
        if ends[-1] > grid.numel:
            raise UsageError(f"tensor {name!r}: a piece reaches element {int(ends[-1])} of {grid.numel}")
        starts = chunk_starts(grid)
        # chunks touched: from the chunk holding the first run's start to the one holding the last end
        first = np.searchsorted(starts, r.cstart, side="right") - 1
        last = np.searchsorted(starts, ends - 1, side="right") - 1
        touched = np.unique(np.concatenate([np.arange(a, b + 1) for a, b in _merge(first, last)])) if first.size else np.empty(0, np.int64)
        for chunk in touched:
            ci = int(chunk)
            cs, ce = grid.chunk_range(ci)
            lo = int(np.searchsorted(ends, cs, side="right"))
            hi = int(np.searchsorted(r.cstart, ce, side="left"))
            buf = np.zeros(ce - cs, dtype=dtypes[name])
            covered = 0
            k = lo
            while k < hi:
                j = _regular_block(r, k, hi, cs, ce)
                if j > k + 1:  # runs k..j-1: equal length, evenly spaced on both sides, one shard
                    covered += _copy_block(buf, shards[int(r.shard[k])], r, k, j, cs, name)
                    k = j
                    continue
                a, b = max(cs, int(r.cstart[k])), min(ce, int(ends[k]))
                if a < b:
                    sh = shards[int(r.shard[k])]
                    la = int(r.lstart[k]) + a - int(r.cstart[k])
                    src = sh.new[la : la + b - a]
                    _check_dtype(src, buf, name)
                    if sh.base is None:  # a keyframe: no shard has a baseline
                        buf[a - cs : b - cs] = src
                    else:
                        np.bitwise_xor(src, sh.base[la : la + b - a], out=buf[a - cs : b - cs])
                    covered += b - a
                k += 1
            changed = int(np.count_nonzero(buf))
            if changed:
                yield Contribution(name, ci, buf, covered == ce - cs, changed)


def _check_dtype(src: np.ndarray, buf: np.ndarray, name: str) -> None:
    if src.dtype != buf.dtype:
        raise UsageError(f"tensor {name!r}: shard bits are {src.dtype}, the canonical dtype stores {buf.dtype}")


def _regular_block(r: _Runs, k: int, hi: int, cs: int, ce: int) -> int:
    """End of the longest block of runs from ``k`` that lie inside ``[cs, ce)``, come from one shard,
    have one length and are evenly spaced in both canonical and local positions (e.g. the rows of a
    column split). Returns ``k`` or ``k + 1`` when there is no such block of two or more."""
    if k + 1 >= hi or r.cstart[k] < cs:
        return k
    # Checked on a bounded window so a long irregular stretch costs no more than the plain loop.
    end = min(hi, k + 4096)
    c, l, n, s = r.cstart[k:end], r.lstart[k:end], r.length[k:end], r.shard[k:end]
    dc, dl = c[1] - c[0], l[1] - l[0]
    ok = (n == n[0]) & (s == s[0]) & (c - c[0] == dc * np.arange(c.size)) & (l - l[0] == dl * np.arange(c.size))
    ok &= c + n <= ce
    bad = np.nonzero(~ok)[0]
    return k + (int(bad[0]) if bad.size else c.size)


def _copy_block(buf, sh: ShardBits, r: _Runs, k: int, j: int, cs: int, name: str) -> int:
    """Copy or XOR runs ``k..j-1`` (a regular block) with strided 2-d views: no index arrays."""
    n, rows = int(r.length[k]), j - k
    dc, dl = int(r.cstart[k + 1] - r.cstart[k]), int(r.lstart[k + 1] - r.lstart[k])
    c0, l0 = int(r.cstart[k]) - cs, int(r.lstart[k])
    _check_dtype(sh.new, buf, name)
    it = buf.itemsize
    out = as_strided(buf[c0:], shape=(rows, n), strides=(dc * it, it))
    src = as_strided(sh.new[l0:], shape=(rows, n), strides=(dl * it, it))
    if sh.base is None:  # a keyframe: no shard has a baseline
        out[...] = src
    else:
        np.bitwise_xor(src, as_strided(sh.base[l0:], shape=(rows, n), strides=(dl * it, it)), out=out)
    return rows * n


def _merge(first: np.ndarray, last: np.ndarray) -> list[tuple[int, int]]:
    """Merge the sorted chunk intervals [first, last] of consecutive runs."""
    out: list[list[int]] = []
    for a, b in zip(first.tolist(), last.tolist()):
        if out and a <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def shard_runs(pieces_of_shards: Sequence[Sequence[Piece]], sizes: Sequence[int]) -> dict[str, _Runs]:
    """The sorted run tables of a rank's shards, by canonical name (for ``chunks_touched`` and
    ``scatter_chunk``); ``sizes``: each shard's element count."""
    return _runs_by_name([_Extent(tuple(p), n) for p, n in zip(pieces_of_shards, sizes)])


@dataclass(frozen=True)
class _Extent:
    pieces: tuple[Piece, ...]
    size: int

    @property
    def new(self) -> _Extent:  # what _runs_by_name reads: only the size
        return self


def chunks_touched(runs: _Runs, grid: ChunkGrid) -> list[int]:
    """Indices of the chunks of ``grid`` that the runs touch, ascending."""
    if not runs.cstart.size:
        return []
    starts = chunk_starts(grid)
    ends = runs.cstart + runs.length
    first = np.searchsorted(starts, runs.cstart, side="right") - 1
    last = np.searchsorted(starts, ends - 1, side="right") - 1
    return [int(i) for a, b in _merge(first, last) for i in range(a, b + 1)]


def scatter_chunk(buf: np.ndarray, cs: int, runs: _Runs, locals_: Sequence[np.ndarray]) -> None:
    """The inverse of projection: copy the rank's elements of canonical chunk ``buf`` (which starts
    at flat element ``cs``) into the rank's local shard arrays ``locals_``."""
    ce = cs + buf.size
    ends = runs.cstart + runs.length
    lo = int(np.searchsorted(ends, cs, side="right"))
    hi = int(np.searchsorted(runs.cstart, ce, side="left"))
    for k in range(lo, hi):
        a, b = max(cs, int(runs.cstart[k])), min(ce, int(ends[k]))
        if a < b:
            la = int(runs.lstart[k]) + a - int(runs.cstart[k])
            locals_[int(runs.shard[k])][la : la + b - a] = buf[a - cs : b - cs]
