"""The dtype table: safetensors names, torch dtypes, bit widths and the unsigned storage type."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dcr_core.errors import InvalidCheckpointError

_UINT_BY_BITS = {8: np.dtype("<u1"), 16: np.dtype("<u2"), 32: np.dtype("<u4"), 64: np.dtype("<u8")}


@dataclass(frozen=True, slots=True)
class DType:
    """One supported element type. ``storage`` is the unsigned type that carries its raw bits."""

    name: str  # safetensors name, e.g. "BF16"
    torch: torch.dtype
    bits: int

    @property
    def itemsize(self) -> int:
        return self.bits // 8

    @property
    def storage(self) -> np.dtype:
        return _UINT_BY_BITS[self.bits]


def _table() -> dict[str, DType]:
    rows = [
        ("BOOL", torch.bool, 8),
        ("U8", torch.uint8, 8),
        ("I8", torch.int8, 8),
        ("F8_E4M3", torch.float8_e4m3fn, 8),
        ("F8_E5M2", torch.float8_e5m2, 8),
        ("F8_E4M3FNUZ", torch.float8_e4m3fnuz, 8),
        ("F8_E5M2FNUZ", torch.float8_e5m2fnuz, 8),
        ("I16", torch.int16, 16),
        ("U16", torch.uint16, 16),
        ("F16", torch.float16, 16),
        ("BF16", torch.bfloat16, 16),
        ("I32", torch.int32, 32),
        ("U32", torch.uint32, 32),
        ("F32", torch.float32, 32),
        ("I64", torch.int64, 64),
        ("U64", torch.uint64, 64),
        ("F64", torch.float64, 64),
        ("C64", torch.complex64, 64),
    ]
    return {name: DType(name, td, bits) for name, td, bits in rows}


DTYPES: dict[str, DType] = _table()
_BY_TORCH: dict[torch.dtype, DType] = {d.torch: d for d in DTYPES.values()}


def dtype_named(name: str) -> DType:
    """The DType for a safetensors dtype name; a clear error for anything else."""
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidCheckpointError(
            f"unsupported dtype {name!r}; supported: {', '.join(DTYPES)}"
        ) from None


def dtype_of(t: torch.Tensor) -> DType:
    """The DType of a torch tensor; a clear error for dtypes safetensors cannot hold."""
    try:
        return _BY_TORCH[t.dtype]
    except KeyError:
        raise InvalidCheckpointError(
            f"unsupported torch dtype {t.dtype}; supported: {', '.join(DTYPES)}"
        ) from None
