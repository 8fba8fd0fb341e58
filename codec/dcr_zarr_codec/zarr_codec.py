"""The ``dcr.sparse`` Zarr v3 codec, so stock zarr reads DCR's sparse delta arrays.

Registered through this package's ``zarr.codecs`` entry point (``pip install dcr-zarr-codec`` and
``zarr.open_group(...)`` just works); importing this module also registers it directly.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
from zarr.abc.codec import BytesBytesCodec
from zarr.core.common import parse_named_configuration
from zarr.registry import register_codec

from dcr_zarr_codec.metadata import COND_CODEC, SPARSE_CODEC
from dcr_zarr_codec.sparse import decode_sparse, encode_sparse


@dataclass(frozen=True)
class DcrSparseCodec(BytesBytesCodec):
    """Bytes of one chunk (little-endian raw bits) <-> a DCR sparse frame."""

    is_fixed_size = False
    level: int = 1

    def __init__(self, *, level: int = 1) -> None:
        object.__setattr__(self, "level", int(level))

    @classmethod
    def from_dict(cls, data):
        _, config = parse_named_configuration(data, SPARSE_CODEC)
        return cls(**(config or {}))

    def to_dict(self):
        return {"name": SPARSE_CODEC, "configuration": {"level": self.level}}

    @staticmethod
    def _storage(chunk_spec) -> np.dtype:
        itemsize = chunk_spec.dtype.to_native_dtype().itemsize
        return np.dtype(f"<u{itemsize}")

    def _decode_sync(self, chunk_bytes, chunk_spec):
        n = int(np.prod(chunk_spec.shape))
        out = decode_sparse(chunk_bytes.to_bytes(), self._storage(chunk_spec), n)
        return chunk_spec.prototype.buffer.from_bytes(out.tobytes())

    async def _decode_single(self, chunk_bytes, chunk_spec):
        return await asyncio.to_thread(self._decode_sync, chunk_bytes, chunk_spec)

    def _encode_sync(self, chunk_bytes, chunk_spec):
        bits = np.frombuffer(chunk_bytes.to_bytes(), dtype=self._storage(chunk_spec))
        return chunk_spec.prototype.buffer.from_bytes(encode_sparse(bits, self.level))

    async def _encode_single(self, chunk_bytes, chunk_spec):
        return await asyncio.to_thread(self._encode_sync, chunk_bytes, chunk_spec)

    def compute_encoded_size(self, _input_byte_length, _chunk_spec):
        raise NotImplementedError


register_codec(SPARSE_CODEC, DcrSparseCodec)


class HeldBitsNeeded(ValueError):
    """A ``dcr.cond`` chunk read without the bits it was coded against."""


@dataclass(frozen=True)
class DcrCondCodec(BytesBytesCodec):
    """``dcr.cond`` arrays: their chunks code changes against the previous step's bits, which a
    Zarr codec never sees, so reading one says what to do instead of returning wrong bits."""

    is_fixed_size = False
    level: int = 3

    def __init__(self, *, level: int = 3) -> None:
        object.__setattr__(self, "level", int(level))

    @classmethod
    def from_dict(cls, data):
        _, config = parse_named_configuration(data, COND_CODEC)
        return cls(**(config or {}))

    def to_dict(self):
        return {"name": COND_CODEC, "configuration": {"level": self.level}}

    async def _decode_single(self, chunk_bytes, chunk_spec):
        raise HeldBitsNeeded(
            "dcr.cond chunks decode only against the previous step's bits: read the step with "
            "`dcr materialize ROOT --step N --out PATH`, or publish with --codec sparse for stock readers"
        )

    async def _encode_single(self, chunk_bytes, chunk_spec):
        raise HeldBitsNeeded("dcr.cond chunks are written by DCR's publisher, which holds the old bits")

    def compute_encoded_size(self, _input_byte_length, _chunk_spec):
        raise NotImplementedError


register_codec(COND_CODEC, DcrCondCodec)
