"""The dtype table: safetensors names, bit widths, the unsigned storage type, and tensor schemas.

Torch dtypes are named here (``torch_name``) but torch is not imported: ``dcr_core.bits`` resolves
them, so code that only moves bits (receivers of state files, ``dcr ls``/``verify``/``gc``) never
imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dcr_core.errors import InvalidCheckpointError

_UINT_BY_BITS: dict[int, np.dtype] = {8: np.dtype("<u1"), 16: np.dtype("<u2"), 32: np.dtype("<u4"), 64: np.dtype("<u8")}
UINT_BY_SIZE: dict[int, np.dtype] = {bits // 8: dt for bits, dt in _UINT_BY_BITS.items()}  # bytes -> unsigned dtype


@dataclass(frozen=True, slots=True)
class DType:
    """One supported element type. ``storage`` is the unsigned type that carries its raw bits."""

    name: str  # safetensors name, e.g. "BF16"
    torch_name: str  # the attribute of the ``torch`` module, e.g. "bfloat16"
    bits: int

    @property
    def itemsize(self) -> int:
        return self.bits // 8

    @property
    def storage(self) -> np.dtype:
        return _UINT_BY_BITS[self.bits]


_ROWS = (
    ("BOOL", "bool", 8),
    ("U8", "uint8", 8),
    ("I8", "int8", 8),
    ("F8_E4M3", "float8_e4m3fn", 8),
    ("F8_E5M2", "float8_e5m2", 8),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz", 8),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz", 8),
    ("I16", "int16", 16),
    ("U16", "uint16", 16),
    ("F16", "float16", 16),
    ("BF16", "bfloat16", 16),
    ("I32", "int32", 32),
    ("U32", "uint32", 32),
    ("F32", "float32", 32),
    ("I64", "int64", 64),
    ("U64", "uint64", 64),
    ("F64", "float64", 64),
    ("C64", "complex64", 64),
)
DTYPES: dict[str, DType] = {name: DType(name, torch_name, bits) for name, torch_name, bits in _ROWS}


def dtype_named(name: str) -> DType:
    """The DType for a safetensors dtype name; a clear error for anything else."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise InvalidCheckpointError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPES)}") from None


@dataclass(slots=True, unsafe_hash=True)
class TensorInfo:
    """A canonical tensor's schema: name, safetensors dtype name and shape. Immutable by
    convention (compared and hashed by value; tables of them are shared by caches): not a frozen
    dataclass, whose construction costs twice as much, and a safetensors header of 70,000 tensors
    builds 70,000 of them."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize
