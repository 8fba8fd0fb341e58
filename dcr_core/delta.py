"""Deltas chunk by chunk: XOR masks, overwrites and full values, and their in-place apply.

Encodings of one tensor in one step:
- ``full``: the tensor's bits (keyframes). Chunks that are all zero bits are not stored.
- ``xor``: ``new ^ base``. Unchanged chunks are all zero and not stored. Self-inverse: applying
  the same mask again restores the base, which is how receivers step backward.
- ``overwrite``: the new bits of every chunk that changed. Not invertible; used only when the caller
  asks for it (``PublishOptions.overwrite_above``), e.g. for values a loader does not preserve.
- ``unchanged``: nothing stored.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

import numpy as np
from dcr_zarr_codec.cond import needs_held

from dcr_core.chunking import ChunkGrid
from dcr_core.codec import CodecSpec


class Encoding(str, Enum):
    FULL = "full"
    XOR = "xor"
    OVERWRITE = "overwrite"
    UNCHANGED = "unchanged"

    @property
    def invertible(self) -> bool:
        return self in (Encoding.XOR, Encoding.UNCHANGED)


@dataclass(frozen=True, slots=True)
class ChunkPayload:
    """One stored chunk: its flat index, its (unpadded) payload bits and how many elements changed."""

    index: int
    payload: np.ndarray
    changed: int


@dataclass(frozen=True, slots=True)
class HeldCoded:
    """A stored chunk that decodes only against the bits it is applied to (codec ``dcr.cond``).

    Fetching checks its stored bytes (size, frame header, digest); ``apply_chunk`` decodes it
    against the target's bits of the chunk, forward (target holds the old bits) or backward (the
    new bits), and checks every change as it decodes; the tensor digest checks the result."""

    data: bytes
    codec: CodecSpec
    dtype: str
    n_padded: int
    size: int  # elements of the (unpadded) chunk

    def mask(self, held: np.ndarray, forward: bool = True) -> np.ndarray:
        """The chunk's XOR mask (``size`` elements) given the ``held`` bits of the chunk."""
        return self.codec.decode(self.data, held.dtype, self.n_padded, base=held, dtype=self.dtype, forward=forward)

    def apply(self, held: np.ndarray, forward: bool = True) -> None:
        """Write the other step's bits over ``held`` (the chunk's bits: flat, writable). On an error
        ``held`` may be half-written: DCR applies to private copies that it verifies before use."""
        if not needs_held(self.data):  # a plain frame: the stored XOR mask itself
            np.bitwise_xor(held, self.mask(held, forward), out=held)
        else:
            self.codec.decode(self.data, held.dtype, self.n_padded, base=held, dtype=self.dtype, forward=forward,
                              in_place=True)


def resolve(payload: np.ndarray | HeldCoded, held: np.ndarray, forward: bool = True) -> np.ndarray:
    """A chunk's payload as bits: ``HeldCoded`` chunks decoded against ``held`` (the target's chunk)."""
    return payload.mask(held, forward) if isinstance(payload, HeldCoded) else payload


def count_changed(new: np.ndarray, base: np.ndarray) -> int:
    return int(np.count_nonzero(new != base))


def choose_encoding(changed: int, numel: int, overwrite_above: float) -> Encoding:
    """``xor`` unless the changed fraction exceeds ``overwrite_above`` (then ``overwrite``)."""
    if changed == 0:
        return Encoding.UNCHANGED
    if numel and changed / numel > overwrite_above:
        return Encoding.OVERWRITE
    return Encoding.XOR


def encode_chunks(
    new: np.ndarray, base: np.ndarray | None, grid: ChunkGrid, encoding: Encoding
) -> Iterator[ChunkPayload]:
    """Yield the chunks ``encoding`` stores, in chunk order. ``new``/``base`` are flat raw bits."""
    if encoding is Encoding.UNCHANGED:
        return
    if encoding is Encoding.FULL:
        for i in range(grid.n_chunks):
            n = grid.take(new, i)
            nz = int(np.count_nonzero(n))
            if nz:
                yield ChunkPayload(i, n, nz)
        return
    if base is None or base.shape != new.shape:
        raise ValueError(f"{encoding.value} needs a base of the same size")
    for i in range(grid.n_chunks):
        n = grid.take(new, i)
        mask = np.bitwise_xor(n, grid.take(base, i))
        changed = int(np.count_nonzero(mask))
        if not changed:
            continue
        yield ChunkPayload(i, mask if encoding is Encoding.XOR else n, changed)


def apply_chunk(
    target: np.ndarray, grid: ChunkGrid, index: int, payload: np.ndarray | HeldCoded, encoding: Encoding,
    forward: bool = True,
) -> None:
    """Apply one chunk in place to ``target`` (flat raw bits, writable). ``forward`` is False when
    the move undoes its step (only ``HeldCoded`` payloads decode differently then)."""
    if grid.is_blocked:  # a column block: applied to a gathered copy, scattered back
        work = grid.take(target, index).copy()
        apply_chunk(work, ChunkGrid((work.shape[0],), (max(1, work.shape[0]),)), 0, payload, encoding, forward)
        grid.put(target, index, work)
        return
    start, stop = grid.chunk_range(index)
    if isinstance(payload, HeldCoded) and encoding is Encoding.XOR and payload.size == stop - start:
        payload.apply(target[start:stop], forward)  # decoded straight into the target: no mask, no XOR pass
        return
    payload = resolve(payload, target[start:stop], forward)
    if payload.shape != (stop - start,):
        raise ValueError(f"chunk {index} payload has {payload.shape[0]} elements, needs {stop - start}")
    if encoding is Encoding.XOR:
        np.bitwise_xor(target[start:stop], payload, out=target[start:stop])
    elif encoding in (Encoding.FULL, Encoding.OVERWRITE):
        target[start:stop] = payload
    else:
        raise ValueError(f"nothing to apply for encoding {encoding.value}")


def pad(payload: np.ndarray, n_padded: int) -> np.ndarray:
    """The chunk as Zarr stores it: padded with zeros (the fill value) to the full chunk size."""
    if payload.shape[0] == n_padded:
        return payload
    out = np.zeros(n_padded, dtype=payload.dtype)
    out[: payload.shape[0]] = payload
    return out
