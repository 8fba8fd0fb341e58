"""Chunk grids whose every chunk is one contiguous run of the tensor's flat (C-order) elements.

A chunk shape is ``(1, ..., 1, k, d[j+1], ..., d[n-1])``: whole trailing dims, a run of ``k`` along
one dim, single indices before it. That keeps the Zarr array in the tensor's own shape (readable by
stock zarr) while every chunk maps to a flat range ``[start, stop)`` of raw bits, which is what the
codec and the in-place apply work on. Edge chunks are shorter; Zarr pads them with the fill value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from dcr_core.errors import IntegrityError


def choose_chunk_shape(shape: tuple[int, ...], itemsize: int, target_bytes: int) -> tuple[int, ...]:
    """The largest contiguous chunk shape for ``shape`` holding at most ``target_bytes`` (min 1 element)."""
    if not shape:
        return ()
    if math.prod(shape) == 0:
        return tuple(max(1, d) for d in shape)
    target = max(1, target_bytes // max(1, itemsize))
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
        if self.numel and not self._is_contiguous():
            raise IntegrityError(
                f"chunk shape {self.chunk_shape} of {self.shape} is not a contiguous run of elements"
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
        """The flat element range ``[start, stop)`` that chunk ``flat_chunk`` covers."""
        g = self.grid_index(flat_chunk)
        start = sum(gi * ci * si for gi, ci, si in zip(g, self.chunk_shape, self._strides))
        size = math.prod(
            min(c, d - gi * c) for gi, c, d in zip(g, self.chunk_shape, self.shape)
        )
        return start, start + size
