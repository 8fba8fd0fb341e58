"""Raw-bit views: any tensor as a flat array of unsigned ints holding exactly its stored bits.

All bit work (XOR, compare, digest) happens on these views, never on float values, so NaN
payloads, -0.0 and subnormals survive untouched. Byte order is little-endian throughout.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from dcr_core.dtypes import DType, dtype_of

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("dcr_core assumes a little-endian host")


def bits_of(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned view of ``t``'s raw bits (shares memory when ``t`` is contiguous on CPU)."""
    dt = dtype_of(t)
    flat = t.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().view(dt.storage)


def tensor_from_bits(bits: np.ndarray, dtype: DType, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` whose raw bits are ``bits`` (copied if read-only)."""
    if bits.dtype != dtype.storage:
        raise ValueError(f"bits are {bits.dtype}, {dtype.name} needs {dtype.storage}")
    if not bits.flags.writeable or not bits.flags.c_contiguous:
        bits = np.array(bits, copy=True)
    u8 = torch.from_numpy(bits.reshape(-1).view(np.uint8))
    return u8.view(dtype.torch).reshape(shape)
