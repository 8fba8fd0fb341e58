"""The chunk compressor: Blosc (zstd inside) with byte- or bit-shuffle, one thread per call.

Blosc run with several internal threads emits blocks in a thread-dependent order, so the same
input can give different bytes; DCR needs deterministic payloads, so Blosc runs single-threaded
and parallelism comes from compressing many chunks at once. The stored form is the standard Zarr
v3 ``blosc`` codec, so stock zarr reads the arrays without project code.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass

import numpy as np
from numcodecs import Blosc, blosc

from dcr_core.errors import IntegrityError

blosc.set_nthreads(1)
blosc.use_threads = False

_SHUFFLES = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """How chunk payloads are compressed. Recorded in every manifest."""

    cname: str = "zstd"
    clevel: int = 3
    shuffle: str = "shuffle"
    blocksize: int = 0  # Blosc block size in bytes; 0 lets Blosc choose

    def __post_init__(self) -> None:
        if self.shuffle not in _SHUFFLES:
            raise ValueError(f"shuffle must be one of {sorted(_SHUFFLES)}, got {self.shuffle!r}")
        if not 0 <= self.clevel <= 9:
            raise ValueError(f"clevel must be 0..9, got {self.clevel}")
        if not 0 <= self.blocksize <= 1 << 30:
            raise ValueError(f"blocksize must be 0..2^30, got {self.blocksize}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CodecSpec:
        return cls(
            cname=str(d["cname"]), clevel=int(d["clevel"]), shuffle=str(d["shuffle"]),
            blocksize=int(d.get("blocksize", 0)),
        )

    def _blosc(self) -> Blosc:
        return Blosc(cname=self.cname, clevel=self.clevel, shuffle=_SHUFFLES[self.shuffle], blocksize=self.blocksize)

    def encode(self, padded: np.ndarray) -> bytes:
        """Compress one full (padded) chunk of raw bits."""
        return bytes(self._blosc().encode(np.ascontiguousarray(padded)))

    def decode(self, data: bytes, storage: np.dtype, n_padded: int) -> np.ndarray:
        """Decompress one chunk into exactly ``n_padded`` elements, refusing any other size."""
        out = np.empty(n_padded, dtype=storage)
        # Blosc 1 header: version, versionlz, flags, typesize, nbytes, blocksize, cbytes (LE u32).
        if len(data) < 16:
            raise IntegrityError("chunk is too short to be a blosc frame")
        declared, _, cbytes = struct.unpack_from("<III", data, 4)
        if cbytes != len(data):
            raise IntegrityError(f"blosc frame claims {cbytes} bytes but is {len(data)} (truncated?)")
        if declared != out.nbytes:
            raise IntegrityError(f"chunk decodes to {declared} bytes, expected {out.nbytes}")
        try:
            self._blosc().decode(data, out=out)
        except Exception as e:
            raise IntegrityError(f"chunk fails to decompress ({e})") from None
        return out
