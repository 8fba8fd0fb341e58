"""The torch bridge: any tensor as a flat array of unsigned ints holding exactly its stored bits.

All bit work (XOR, compare, digest) happens on these views, never on float values, so NaN
payloads, -0.0 and subnormals survive untouched. Byte order is little-endian throughout. This is
one of the two modules of ``dcr_core`` that import torch (with ``conversion``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import numpy as np
import torch

from dcr_core.dtypes import DTYPES, DType, TensorInfo
from dcr_core.errors import InvalidCheckpointError

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("dcr_core assumes a little-endian host")

_BY_TORCH: dict[torch.dtype, DType] = {getattr(torch, d.torch_name): d for d in DTYPES.values()}


def torch_dtype(dtype: DType | str) -> torch.dtype:
    """The torch dtype of a DType (or of a safetensors dtype name)."""
    return getattr(torch, (DTYPES[dtype] if isinstance(dtype, str) else dtype).torch_name)


def dtype_of(t: torch.Tensor) -> DType:
    """The DType of a torch tensor; a clear error for dtypes safetensors cannot hold."""
    try:
        return _BY_TORCH[t.dtype]
    except KeyError:
        raise InvalidCheckpointError(f"unsupported torch dtype {t.dtype}; supported: {', '.join(DTYPES)}") from None


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
    return u8.view(torch_dtype(dtype)).reshape(shape)


def info_of(name: str, t: torch.Tensor) -> TensorInfo:
    return TensorInfo(name, dtype_of(t).name, tuple(t.shape))


def infos_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorInfo]:
    return {n: info_of(n, t) for n, t in tensors.items()}
