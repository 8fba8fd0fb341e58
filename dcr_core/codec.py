"""Chunk compressors: ``dcr-sparse`` (the default for deltas) and standard Blosc.

- ``dcr-sparse`` (``dcr_core.sparse``): gap-coded positions and byte planes under zstd, close to
  the entropy bound of sparse XOR masks. Stock zarr reads it once this project is installed (the
  Zarr codec ``dcr.sparse`` is registered through the ``zarr.codecs`` entry point).
- ``blosc`` (zstd inside, byte or bit shuffle): a standard Zarr v3 codec that stock zarr reads with
  no project code at all; the default for keyframes, and the audit-friendly choice for deltas
  (about 1.6x the bytes of ``dcr-sparse`` on real AdamW deltas).

Blosc run with several internal threads emits blocks in a thread-dependent order, so the same
input can give different bytes; DCR needs deterministic payloads, so Blosc runs single-threaded
and parallelism comes from compressing many chunks at once.
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass

import numpy as np
from numcodecs import Blosc, blosc

from dcr_core.errors import IntegrityError
from dcr_core.sparse import decode_sparse, encode_sparse

blosc.set_nthreads(1)
blosc.use_threads = False

NAMES = ("blosc", "dcr-sparse")
_SHUFFLES = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """How chunk payloads are compressed. Recorded in every manifest.

    ``clevel`` is the zstd level for ``dcr-sparse``; ``cname``/``shuffle``/``blocksize`` apply to Blosc.
    """

    name: str = "blosc"
    cname: str = "zstd"
    clevel: int = 3
    shuffle: str = "shuffle"
    blocksize: int = 0  # Blosc block size in bytes; 0 lets Blosc choose

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"codec must be one of {NAMES}, got {self.name!r}")
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
            name=str(d.get("name", "blosc")),  # manifests written before sparse deltas existed
            cname=str(d["cname"]), clevel=int(d["clevel"]), shuffle=str(d["shuffle"]),
            blocksize=int(d.get("blocksize", 0)),
        )

    def _blosc(self) -> Blosc:
        return Blosc(cname=self.cname, clevel=self.clevel, shuffle=_SHUFFLES[self.shuffle], blocksize=self.blocksize)

    def encode(self, padded: np.ndarray) -> bytes:
        """Compress one full (padded) chunk of raw bits."""
        if self.name == "dcr-sparse":
            return encode_sparse(padded, self.clevel)
        return bytes(self._blosc().encode(np.ascontiguousarray(padded)))

    def decode(self, data: bytes, storage: np.dtype, n_padded: int) -> np.ndarray:
        """Decompress one chunk into exactly ``n_padded`` elements, refusing any other size."""
        if self.name == "dcr-sparse":
            return decode_sparse(data, storage, n_padded)
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
