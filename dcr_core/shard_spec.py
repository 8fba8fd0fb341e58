"""Shard specs: where each element of a training shard lives in the canonical checkpoint.

A ``Piece`` is an affine map of one box: the box ``[start, start + extent)`` of canonical tensor
``name`` (shape ``shape``, C order) corresponds element by element to local flat positions
``offset + sum(i[j] * strides[j])`` of a rank's shard, for box index ``i``. A shard's placement is a
list of pieces; every placement below (contiguous splits, replication, Megatron column/row
parallel, fused QKV with GQA, gated fc1, distributed-optimizer flat buffers, pipeline and expert
renaming) is a short function producing pieces, and layouts compose (a split of a shard whose
pieces are aligned with its shape; a flat-buffer range over any pieces).

``runs()`` turns a piece into vectorized ``(canonical flat start, local flat start, length)`` runs,
merging whole trailing rows, which is what projection and validation work on.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from dcr_core.errors import UsageError


def c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


@dataclass(frozen=True, slots=True)
class Piece:
    """Box ``[start, start+extent)`` of canonical ``name`` <-> local ``offset + i . strides``."""

    name: str
    shape: tuple[int, ...]
    start: tuple[int, ...]
    extent: tuple[int, ...]
    offset: int
    strides: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.shape)
        if not (len(self.start) == len(self.extent) == len(self.strides) == n):
            raise UsageError(f"piece of {self.name!r}: start/extent/strides must have {n} dims")
        for s, e, d in zip(self.start, self.extent, self.shape):
            if s < 0 or e < 0 or s + e > d:
                raise UsageError(
                    f"piece of {self.name!r}: box {list(self.start)}+{list(self.extent)} lies outside {list(self.shape)}"
                )
        if self.offset < 0:
            raise UsageError(f"piece of {self.name!r}: negative local offset {self.offset}")

    @property
    def numel(self) -> int:
        return math.prod(self.extent)

    def local_span(self) -> tuple[int, int]:
        """Smallest and largest local flat position the piece touches (``(0, -1)`` when empty)."""
        if self.numel == 0:
            return 0, -1
        lo = self.offset + sum(min(0, (e - 1) * s) for e, s in zip(self.extent, self.strides))
        hi = self.offset + sum(max(0, (e - 1) * s) for e, s in zip(self.extent, self.strides))
        return lo, hi

    def runs(self) -> tuple[np.ndarray, np.ndarray, int]:
        """``(canonical starts, local starts, run length)``: the piece as equal-length contiguous runs.

        Trailing dims are merged into one run while both sides stay contiguous (whole canonical rows
        and local strides that are C strides of the box), so a row block of a matrix is one run."""
        if self.numel == 0:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, 0
        k, run = self._merged()
        cs = c_strides(self.shape)
        c0 = sum(s * c for s, c in zip(self.start, cs))
        if k == 0:
            return np.array([c0], dtype=np.int64), np.array([self.offset], dtype=np.int64), run
        grids = np.indices(self.extent[:k], dtype=np.int64).reshape(k, -1)
        cstarts = c0 + (np.asarray(cs[:k], dtype=np.int64)[:, None] * grids).sum(axis=0)
        lstarts = self.offset + (np.asarray(self.strides[:k], dtype=np.int64)[:, None] * grids).sum(axis=0)
        return cstarts, lstarts, run

    def _merged(self) -> tuple[int, int]:
        """``(k, run)``: dims ``k..`` merge into one contiguous run of ``run`` elements on both sides."""
        cs = c_strides(self.shape)
        k, run = len(self.shape), 1
        while k > 0:
            j = k - 1
            if self.extent[j] != 1 and (self.strides[j] != run or cs[j] != run):
                break
            run *= self.extent[j]
            k = j
        return k, run

    def n_runs(self) -> int:
        return 0 if self.numel == 0 else math.prod(self.extent[: self._merged()[0]])

    def subbox(self, start: Sequence[int], extent: Sequence[int]) -> Piece:
        """The part of this piece at box coordinates ``[start, start+extent)`` (same local storage)."""
        return replace(
            self,
            start=tuple(a + b for a, b in zip(self.start, start)),
            extent=tuple(extent),
            offset=self.offset + sum(a * s for a, s in zip(start, self.strides)),
        )


@dataclass(frozen=True)
class ShardSpec:
    """One local tensor of a rank (training name, local shape) and the pieces it holds."""

    local_name: str
    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    def __post_init__(self) -> None:
        numel = math.prod(self.local_shape)
        for p in self.pieces:
            lo, hi = p.local_span()
            if p.numel and (lo < 0 or hi >= numel):
                raise UsageError(
                    f"shard {self.local_name!r}: piece of {p.name!r} reaches local element {hi}, "
                    f"but the shard has {numel}"
                )


# ---- contiguous splits ---------------------------------------------------------------------------


def split_bounds(size: int, world: int, rank: int, sizes: Sequence[int] | None = None) -> tuple[int, int]:
    """``[lo, hi)`` of ``rank`` when ``size`` is split ``world`` ways.

    Default: ``torch.chunk`` / DTensor ``Shard(d)`` / FSDP2 semantics: ceil(size / world) per rank,
    the last ranks short or empty. ``sizes``: an explicit uneven split (must sum to ``size``)."""
    if not 0 <= rank < world:
        raise UsageError(f"rank {rank} is not in 0..{world - 1}")
    if sizes is not None:
        if len(sizes) != world or sum(sizes) != size or any(s < 0 for s in sizes):
            raise UsageError(f"split sizes {list(sizes)} do not split {size} over {world} ranks")
        lo = sum(sizes[:rank])
        return lo, lo + sizes[rank]
    step = -(-size // world) if size else 0
    lo = min(size, rank * step)
    return lo, min(size, lo + step)


def full(name: str, shape: Sequence[int]) -> list[Piece]:
    """The whole canonical tensor, held contiguously (an unsharded or replicated tensor)."""
    shape = tuple(shape)
    return [Piece(name, shape, (0,) * len(shape), shape, 0, c_strides(shape))]


def split(name: str, shape: Sequence[int], splits: dict[int, tuple[int, int]], sizes: dict | None = None) -> list[Piece]:
    """The box of a rank splitting ``shape`` along several dims: ``splits[dim] = (rank, world)``.

    The local shard is that box, contiguous (C order). Megatron column parallel is ``{0: (t, tp)}``
    (weights are ``[out, in]``), row parallel ``{1: (t, tp)}``; DTensor ``Shard(d)`` is ``{d: ...}``."""
    shape = tuple(shape)
    start, extent = list((0,) * len(shape)), list(shape)
    for dim, (rank, world) in splits.items():
        if not 0 <= dim < len(shape):
            raise UsageError(f"{name!r}: split dim {dim} is not a dim of {list(shape)}")
        lo, hi = split_bounds(shape[dim], world, rank, (sizes or {}).get(dim))
        start[dim], extent[dim] = lo, hi - lo
    return [Piece(name, shape, tuple(start), tuple(extent), 0, c_strides(extent))]


def replicate(name: str, shape: Sequence[int], rank: int, owner: int = 0) -> list[Piece]:
    """A replicated tensor: only the ``owner`` replica contributes; the others hold no piece."""
    return full(name, shape) if rank == owner else []


def reshard(pieces: Iterable[Piece], local_shape: Sequence[int], splits: dict[int, tuple[int, int]]) -> list[Piece]:
    """Compose: the rank's part of a further split (e.g. FSDP ``Shard(0)`` of a TP shard).

    ``pieces`` describe a local tensor of ``local_shape``; every piece must be aligned with it (box
    dim j runs along local dim j with the local C strides). The result describes the contiguous
    sub-box of the local tensor that ``splits`` gives this rank (held as its own C-order tensor)."""
    local_shape = tuple(local_shape)
    lo, hi = [0] * len(local_shape), list(local_shape)
    for dim, (rank, world) in splits.items():
        if not 0 <= dim < len(local_shape):
            raise UsageError(f"split dim {dim} is not a dim of the local shape {list(local_shape)}")
        lo[dim], hi[dim] = split_bounds(local_shape[dim], world, rank)
    ss = c_strides([h - l for l, h in zip(lo, hi)])
    out = []
    for sub in reshard_box(pieces, local_shape, lo, [h - l for l, h in zip(lo, hi)]):
        pos = _unravel(sub.offset, local_shape)
        out.append(replace(sub, offset=sum((x - l) * s for x, l, s in zip(pos, lo, ss)), strides=ss))
    return out


def _unravel(offset: int, shape: Sequence[int]) -> list[int]:
    out, rem = [], offset
    for s in c_strides(shape):
        q, rem = divmod(rem, s) if s else (0, rem)
        out.append(q)
    return out


# ---- Megatron fused layouts ----------------------------------------------------------------------


def fused_qkv(
    q_name: str, k_name: str, v_name: str, num_heads: int, num_groups: int, head_dim: int,
    rest: Sequence[int], tp_rank: int = 0, tp: int = 1,
) -> list[Piece]:
    """Megatron's fused ``linear_qkv`` (rows grouped per query group: ``[q(hpg*hd); k(hd); v(hd)]``
    per group) on TP rank ``tp_rank``, which holds a contiguous run of groups, onto separate
    ``q_proj [num_heads*hd, *rest]``, ``k_proj``/``v_proj [num_groups*hd, *rest]`` (GQA)."""
    if num_heads % num_groups or num_groups % tp:
        raise UsageError(
            f"fused QKV: {num_heads} heads / {num_groups} groups / tp {tp} must divide evenly"
        )
    hpg = num_heads // num_groups
    rest = tuple(rest)
    row = math.prod(rest)
    qshape, kvshape = (num_heads * head_dim, *rest), (num_groups * head_dim, *rest)
    per_rank = num_groups // tp
    group_rows = (hpg + 2) * head_dim
    out = []
    for gi in range(per_rank):
        g = tp_rank * per_rank + gi
        base = gi * group_rows * row
        for name, shape, r0, nrows, lo in (
            (q_name, qshape, g * hpg * head_dim, hpg * head_dim, 0),
            (k_name, kvshape, g * head_dim, head_dim, hpg * head_dim),
            (v_name, kvshape, g * head_dim, head_dim, (hpg + 1) * head_dim),
        ):
            extent = (nrows, *rest)
            out.append(Piece(name, shape, (r0,) + (0,) * len(rest), extent, base + lo * row, c_strides(extent)))
    return out


def gated_fc1(gate_name: str, up_name: str, ffn: int, rest: Sequence[int], tp_rank: int = 0, tp: int = 1) -> list[Piece]:
    """Megatron's gated ``linear_fc1``: TP rank t stores ``[gate_t; up_t]`` (so the TP-gathered
    tensor is ``[G0;U0;G1;U1;...]``), onto ``gate_proj``/``up_proj [ffn, *rest]``."""
    if ffn % tp:
        raise UsageError(f"gated fc1: ffn size {ffn} is not divisible by tp {tp}")
    rest = tuple(rest)
    n = ffn // tp
    shape, extent = (ffn, *rest), (n, *rest)
    st = c_strides(extent)
    zeros = (0,) * len(rest)
    return [
        Piece(gate_name, shape, (tp_rank * n, *zeros), extent, 0, st),
        Piece(up_name, shape, (tp_rank * n, *zeros), extent, n * math.prod(rest), st),
    ]


# ---- distributed-optimizer flat buffers ----------------------------------------------------------


def _flat_boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes covering flat elements ``[a, b)`` of a C-order ``shape``, in order (at most 2n-1)."""
    if a >= b:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((a,), (b - a,))]
    inner = math.prod(shape[1:])
    r0, o0 = divmod(a, inner)
    r1, o1 = divmod(b, inner)
    sub = shape[1:]
    boxes = []
    if r0 == r1:
        return [((r0, *s), (1, *e)) for s, e in _flat_boxes(sub, o0, o1)]
    if o0:
        boxes += [((r0, *s), (1, *e)) for s, e in _flat_boxes(sub, o0, inner)]
        r0 += 1
    if r1 > r0:
        boxes.append(((r0,) + (0,) * len(sub), (r1 - r0, *sub)))
    if o1:
        boxes += [((r1, *s), (1, *e)) for s, e in _flat_boxes(sub, 0, o1)]
    return boxes


@dataclass(frozen=True)
class BufferParam:
    """One parameter of a flat buffer: its (possibly TP-sharded) local shape and pieces."""

    local_name: str
    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)


def flat_buffer_layout(params: Sequence[BufferParam], align: int = 64, reverse: bool = True) -> list[tuple[BufferParam, int]]:
    """Megatron distributed-optimizer layout: params in reverse order, each start padded to
    ``align`` elements. Returns ``(param, buffer start)`` pairs."""
    order = list(reversed(params)) if reverse else list(params)
    out, pos = [], 0
    for p in order:
        pos = -(-pos // align) * align
        out.append((p, pos))
        pos += p.numel
    return out


def flat_buffer_size(params: Sequence[BufferParam], dp: int, align: int = 64, reverse: bool = True) -> int:
    """Buffer size: the end of the last param, padded to a multiple of ``align * dp``."""
    lay = flat_buffer_layout(params, align, reverse)
    end = max((s + p.numel for p, s in lay), default=0)
    unit = align * dp
    return -(-end // unit) * unit


def flat_buffer(
    params: Sequence[BufferParam], dp_rank: int, dp: int, align: int = 64, reverse: bool = True
) -> list[Piece]:
    """The pieces of DP rank ``dp_rank``'s contiguous range of the flat buffer (its local shard is
    that 1-d range; padding maps to nothing). Each param's own pieces must be aligned with its
    local shape (C strides), as those of ``split``, ``fused_qkv`` and ``gated_fc1`` are."""
    size = flat_buffer_size(params, dp, align, reverse)
    per = size // dp
    lo, hi = dp_rank * per, (dp_rank + 1) * per
    out = []
    for p, s in flat_buffer_layout(params, align, reverse):
        a, b = max(lo, s), min(hi, s + p.numel)
        if a >= b:
            continue
        for bstart, bext in _flat_boxes(p.local_shape, a - s, b - s):
            for sub in reshard_box(p.pieces, p.local_shape, bstart, bext):
                # a position in the param -> the same element's position in this rank's range
                out.append(replace(sub, offset=sub.offset + s - lo))
    return out


def reshard_box(pieces: Iterable[Piece], local_shape: Sequence[int], bstart: Sequence[int], bext: Sequence[int]) -> list[Piece]:
    """The parts of aligned ``pieces`` that fall in the local box ``[bstart, bstart+bext)``; local
    offsets stay those of the original local tensor."""
    local_shape = tuple(local_shape)
    ls = c_strides(local_shape)
    out = []
    for p in pieces:
        if p.numel == 0:
            continue
        if len(p.shape) != len(local_shape) or any(s != l for s, l, e in zip(p.strides, ls, p.extent) if e > 1):
            raise UsageError(f"piece of {p.name!r} is not aligned with the local shape {list(local_shape)}")
        lstart = _unravel(p.offset, local_shape)
        a = [max(x, s) for x, s in zip(bstart, lstart)]
        b = [min(x + e, s + pe) for x, e, s, pe in zip(bstart, bext, lstart, p.extent)]
        if any(x >= y for x, y in zip(a, b)):
            continue
        out.append(p.subbox([x - s for x, s in zip(a, lstart)], [y - x for x, y in zip(a, b)]))
    return out


# ---- names: pipeline stages, expert parallel, training -> canonical --------------------------------


def shift_index(name: str, key: str, offset: int) -> str:
    """Add ``offset`` to the index after ``key`` (e.g. ``layers``): ``layers.3.`` -> ``layers.(3+o).``.

    Pipeline stage s holding layers ``[s*L, (s+1)*L)`` as local 0..L-1: ``shift_index(n, "layers", s*L)``;
    expert-parallel rank e holding experts ``[e*E, (e+1)*E)``: ``shift_index(n, "experts", e*E)``."""
    pat = re.compile(rf"(^|\.){re.escape(key)}\.(\d+)(\.|$)")
    m = pat.search(name)
    if m is None:
        raise UsageError(f"name {name!r} has no '{key}.<index>' part")
    return f"{name[: m.start(2)]}{int(m.group(2)) + offset}{name[m.end(2):]}"


@dataclass(frozen=True)
class NamingMap:
    """Training names -> canonical names: ordered ``(regex, replacement)`` rules, first match wins;
    a name no rule matches is an error (so a forgotten tensor fails loudly)."""

    rules: tuple[tuple[str, str], ...]

    def __call__(self, name: str) -> str:
        for pat, rep in self.rules:
            out, n = re.subn(rf"^(?:{pat})$", rep, name)
            if n:
                return out
        raise UsageError(f"training name {name!r} matches no naming rule")


def rename(pieces: Iterable[Piece], fn: Callable[[str], str]) -> list[Piece]:
    return [replace(p, name=fn(p.name)) for p in pieces]


# ---- validation ----------------------------------------------------------------------------------


def check_partition(pieces: Iterable[Piece], shapes: dict[str, tuple[int, ...]]) -> None:
    """Pieces of all ranks together cover every canonical tensor exactly once (no gap, no overlap)."""
    runs: dict[str, list[tuple[np.ndarray, int]]] = {n: [] for n in shapes}
    for p in pieces:
        if p.name not in shapes:
            raise UsageError(f"a piece names {p.name!r}, which is not a canonical tensor")
        if tuple(p.shape) != tuple(shapes[p.name]):
            raise UsageError(f"a piece of {p.name!r} has shape {list(p.shape)}, the tensor is {list(shapes[p.name])}")
        c, _, n = p.runs()
        if n:
            runs[p.name].append((c, n))
    for name, shape in shapes.items():
        check_cover(name, math.prod(shape), runs[name])


def check_cover(name: str, numel: int, runs: list[tuple[np.ndarray, int]]) -> None:
    """Runs ``(starts, length)`` cover ``[0, numel)`` exactly once."""
    if not runs:
        if numel:
            raise UsageError(f"tensor {name!r}: no piece covers it")
        return
    starts = np.concatenate([c for c, _ in runs])
    ends = np.concatenate([c + n for c, n in runs])
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    if starts[0] != 0:
        raise UsageError(f"tensor {name!r}: elements [0, {int(starts[0])}) are covered by no piece")
    gaps = np.nonzero(starts[1:] != ends[:-1])[0]
    if gaps.size:
        i = int(gaps[0])
        what = "covered twice" if starts[i + 1] < ends[i] else "covered by no piece"
        raise UsageError(f"tensor {name!r}: elements near {int(min(starts[i + 1], ends[i]))} are {what}")
    if ends[-1] != numel:
        raise UsageError(f"tensor {name!r}: elements [{int(ends[-1])}, {numel}) are covered by no piece")
