"""Chunk grids over a tensor's flat (C-order) elements: contiguous runs, or column blocks.

*Runs* (the default): a chunk shape is ``(1, ..., 1, k, d[j+1], ..., d[n-1])``: whole trailing
dims, a run of ``k`` along one dim, single indices before it. That keeps the Zarr array in the
tensor's own shape (readable by stock zarr) while every chunk maps to a flat range ``[start, stop)``
of raw bits, which is what the codec and the in-place apply work on.

*Column blocks* (``choose_chunk_shape(..., column_blocks=N)``): ``(1, ..., 1, k, d[n-1] / N)``: ``k``
rows of one of ``N`` equal column blocks of the last dim. A tensor-parallel rank that reads a
column slice (row-parallel weights) or a row slice (column-parallel ones) then needs only its own
chunks. A block is ``k`` runs of ``d[n-1] / N`` elements, ``d[n-1]`` apart; its payload holds them
in order (Zarr's C order inside the chunk), so ``take``/``put`` gather and scatter them.

Either way only the chunking dim ``j`` (runs) or the row dim (blocks) can be cut short at the edge,
so a chunk's valid elements are a prefix of the padded chunk Zarr stores (padded with the fill value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np
from numpy.lib.stride_tricks import as_strided

from dcr_core.errors import IntegrityError


def choose_chunk_shape(
    shape: tuple[int, ...], itemsize: int, target_bytes: int, column_blocks: int = 1
) -> tuple[int, ...]:
    """The largest contiguous chunk shape for ``shape`` holding at most ``target_bytes`` (min 1 element).

    ``column_blocks`` N > 1: tensors of two or more dims larger than one chunk whose last dim N
    divides get column blocks of ``d[n-1] / N`` columns and ``k`` rows, ``k`` as large as the target
    allows but at most ``ceil(d[n-2] / N)`` (and dividing it evenly): the rows are cut into N blocks or
    more too, so a rank of TP dividing N finds its row slice (column-parallel weights) as whole chunks
    as well as its column slice (row-parallel ones). Chunks can then hold less than the target (at
    least the tensor / N^2).
    Others keep runs; small tensors stay one chunk (splitting them only adds requests)."""
    if not shape:
        return ()
    if math.prod(shape) == 0:
        return tuple(max(1, d) for d in shape)
    target = max(1, target_bytes // max(1, itemsize))
    if column_blocks > 1 and len(shape) >= 2 and shape[-1] % column_blocks == 0 and math.prod(shape) > target:
        width = shape[-1] // column_blocks
        # Each N-th of the rows in equal pieces of at most the target: the row blocks' edges then fall
        # on every N-th (a rank's row slice for TP dividing N), and inside it evenly.
        nth = -(-shape[-2] // column_blocks)
        rows = -(-nth // -(-nth // max(1, target // width)))
        return (1,) * (len(shape) - 2) + (rows, width)
    chunk = [1] * len(shape)
    inner = 1
    for j in range(len(shape) - 1, -1, -1):
        if inner * shape[j] <= target:
            chunk[j] = shape[j]
            inner *= shape[j]
        else:
            chunk[j] = max(1, target // inner)
            break
    return tuple(chunk)


@dataclass(frozen=True)
class ChunkGrid:
    """A regular chunk grid over ``shape`` with contiguous chunks (see module docstring)."""

    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.chunk_shape):
            raise IntegrityError(f"chunk shape {self.chunk_shape} does not match shape {self.shape}")
        if any(d < 0 for d in self.shape) or any(c < 1 for c in self.chunk_shape):
            raise IntegrityError(f"invalid shape {self.shape} / chunk shape {self.chunk_shape}")
        if self.numel and not self._is_contiguous() and not self.is_blocked:
            raise IntegrityError(
                f"chunk shape {self.chunk_shape} of {self.shape} is neither a contiguous run of elements "
                "nor a column block"
            )

    def _is_contiguous(self) -> bool:
        # Find the split dim j: everything after it whole, everything before it 1.
        n = len(self.shape)
        j = 0
        for i in range(n - 1, -1, -1):
            if self.chunk_shape[i] < self.shape[i]:
                j = i
                break
        return all(self.chunk_shape[i] == 1 for i in range(j)) and all(
            self.chunk_shape[i] >= self.shape[i] for i in range(j + 1, n)
        )

    @cached_property
    def is_blocked(self) -> bool:
        """Column blocks (see module docstring): several rows of a column block of the last dim."""
        n = len(self.shape)
        return (
            n >= 2 and self.numel > 0 and 1 <= self.chunk_shape[-1] < self.shape[-1]
            and self.shape[-1] % self.chunk_shape[-1] == 0 and min(self.chunk_shape[-2], self.shape[-2]) > 1
            and all(c == 1 for c in self.chunk_shape[:-2])
        )

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def grid_shape(self) -> tuple[int, ...]:
        return tuple(-(-d // c) for d, c in zip(self.shape, self.chunk_shape))

    @cached_property
    def n_chunks(self) -> int:
        return math.prod(self.grid_shape) if self.numel else 0

    @cached_property
    def chunk_numel(self) -> int:
        """Elements in a full (padded) chunk, as Zarr stores it."""
        return math.prod(self.chunk_shape)

    @cached_property
    def _strides(self) -> tuple[int, ...]:
        strides, acc = [], 1
        for d in reversed(self.shape):
            strides.append(acc)
            acc *= d
        return tuple(reversed(strides))

    def grid_index(self, flat_chunk: int) -> tuple[int, ...]:
        if not 0 <= flat_chunk < self.n_chunks:
            raise IntegrityError(f"chunk {flat_chunk} outside grid {self.grid_shape}")
        idx = []
        for g in reversed(self.grid_shape):
            idx.append(flat_chunk % g)
            flat_chunk //= g
        return tuple(reversed(idx))

    def chunk_range(self, flat_chunk: int) -> tuple[int, int]:
        """The flat element range ``[start, stop)`` that chunk ``flat_chunk`` covers (runs only:
        a column block is not one range; use ``take``/``put``/``chunk_span``)."""
        if self.is_blocked:
            raise IntegrityError(f"chunk {flat_chunk} of {self.shape} / {self.chunk_shape} is a column block, not a range")
        g = self.grid_index(flat_chunk)
        start = sum(gi * ci * si for gi, ci, si in zip(g, self.chunk_shape, self._strides))
        size = math.prod(
            min(c, d - gi * c) for gi, c, d in zip(g, self.chunk_shape, self.shape)
        )
        return start, start + size

    def _block(self, flat_chunk: int) -> tuple[int, int, int]:
        """A column block's first flat element, its number of rows and its row width."""
        g = self.grid_index(flat_chunk)
        k, width = self.chunk_shape[-2], self.chunk_shape[-1]
        r0 = g[-2] * k
        start = sum(gi * si for gi, si in zip(g[:-2], self._strides[:-2])) + r0 * self.shape[-1] + g[-1] * width
        return start, min(k, self.shape[-2] - r0), width

    def chunk_size(self, flat_chunk: int) -> int:
        """Valid (unpadded) elements of chunk ``flat_chunk``: a prefix of its padded payload."""
        if self.is_blocked:
            _, rows, width = self._block(flat_chunk)
            return rows * width
        start, stop = self.chunk_range(flat_chunk)
        return stop - start

    def chunk_span(self, flat_chunk: int) -> tuple[int, int]:
        """The smallest flat range ``[start, stop)`` holding every element of the chunk."""
        if self.is_blocked:
            start, rows, width = self._block(flat_chunk)
            return start, start + (rows - 1) * self.shape[-1] + width
        return self.chunk_range(flat_chunk)

    def chunk_runs(self, flat_chunk: int) -> list[tuple[int, int]]:
        """The chunk's elements as flat ranges, in payload order."""
        if self.is_blocked:
            start, rows, width = self._block(flat_chunk)
            w = self.shape[-1]
            return [(start + r * w, start + r * w + width) for r in range(rows)]
        return [self.chunk_range(flat_chunk)]

    def view(self, flat: np.ndarray, flat_chunk: int) -> np.ndarray:
        """The chunk's elements of the flat array ``flat``: a 1-d view (runs) or a 2-d strided
        ``rows x width`` view (blocks; its C order is the payload order). Writable if ``flat`` is."""
        if self.is_blocked:
            start, rows, width = self._block(flat_chunk)
            tail = flat[start:]
            return as_strided(tail, (rows, width), (self.shape[-1] * tail.strides[0], tail.strides[0]),
                              writeable=tail.flags.writeable)
        start, stop = self.chunk_range(flat_chunk)
        return flat[start:stop]

    def take(self, flat: np.ndarray, flat_chunk: int) -> np.ndarray:
        """The chunk's elements of ``flat`` in payload order, 1-d and contiguous (a view for runs,
        a copy for blocks)."""
        v = self.view(flat, flat_chunk)
        return v if v.ndim == 1 else v.reshape(-1)

    def put(self, flat: np.ndarray, flat_chunk: int, values: np.ndarray) -> None:
        """Write ``values`` (payload order) into the chunk's elements of ``flat``."""
        v = self.view(flat, flat_chunk)
        v[...] = values.reshape(v.shape)


@lru_cache(maxsize=4096)
def _grid(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> ChunkGrid:
    return ChunkGrid(shape, chunk_shape)


def grid_of(shape, chunk_shape) -> ChunkGrid:
    """``ChunkGrid(shape, chunk_shape)``, one instance per distinct pair (grids are immutable): a
    model of tens of thousands of tensors has a few dozen shapes, and every tensor's grid is asked
    for several times per step (planning, encoding, manifest parsing)."""
    return _grid(tuple(shape), tuple(chunk_shape))
