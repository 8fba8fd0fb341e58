"""Test helpers for sharded publishing: cut canonical tensors into shards by their pieces, and
combine projected contributions back, both on raw bits (independent of the projection code)."""

from __future__ import annotations

import math

import numpy as np

from dcr_core.chunking import ChunkGrid
from dcr_core.shard_spec import Piece


def box_view(canonical: np.ndarray, p: Piece) -> np.ndarray:
    """The piece's box of a flat canonical array, as an n-d view (plain numpy slicing)."""
    nd = canonical.reshape(p.shape) if p.shape else canonical.reshape(())
    return nd[tuple(slice(s, s + e) for s, e in zip(p.start, p.extent))]


def cut(canonical: dict[str, np.ndarray], pieces: list[Piece], local_numel: int, dtype) -> np.ndarray:
    """A local shard holding the pieces' elements of ``canonical`` (elsewhere: a poison pattern)."""
    local = np.frombuffer(bytes([0xA5]) * (local_numel * np.dtype(dtype).itemsize), dtype=dtype).copy()
    for p in pieces:
        if p.numel == 0:
            continue
        src = box_view(canonical[p.name], p)
        dst = np.lib.stride_tricks.as_strided(
            local[p.offset :], shape=p.extent, strides=tuple(s * local.itemsize for s in p.strides)
        )
        dst[...] = src
    return local


def combine(contributions, grids: dict[str, ChunkGrid], dtypes: dict) -> dict[str, np.ndarray]:
    """XOR every contribution into zeroed canonical tensors."""
    out = {n: np.zeros(math.prod(g.shape), dtype=dtypes[n]) for n, g in grids.items()}
    for c in contributions:
        a, b = grids[c.name].chunk_range(c.index)
        np.bitwise_xor(out[c.name][a:b], c.payload, out=out[c.name][a:b])
    return out


def random_bits(rng: np.random.Generator, numel: int, dtype) -> np.ndarray:
    dt = np.dtype(dtype)
    return np.frombuffer(rng.bytes(numel * dt.itemsize), dtype=dt).copy()
