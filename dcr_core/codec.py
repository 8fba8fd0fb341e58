"""Chunk compressors: ``dcr.sparse`` (the default for deltas), ``dcr.cond`` and standard Blosc.

- ``dcr.sparse`` (``dcr_core.sparse``): gap-coded positions and byte planes under zstd, close to
  the entropy bound of sparse XOR masks. Stock zarr reads it once this project is installed (the
  Zarr codec is registered through the ``zarr.codecs`` entry point of the ``dcr-zarr-codec``
  package, ``codec/``).
- ``dcr.cond`` (``dcr_zarr_codec.cond``): the changes coded against the bits the receiver
  already holds (positions per exponent class of the held value, values as signed ulp steps):
  0.63-0.71x the bytes of ``dcr.sparse`` on real AdamW steps, below the XOR entropy bound. Its
  chunks decode only against the held bits, so ``decode`` returns a ``HeldCoded`` payload
  (``dcr_core.delta``) that the apply resolves; stock zarr cannot read these arrays as masks (the
  registered ``dcr.cond`` codec says so): use ``dcr materialize``, or keep ``dcr.sparse``/``blosc``
  where stock readers matter.
- ``blosc`` (zstd inside, byte or bit shuffle): a standard Zarr v3 codec that stock zarr reads with
  no project code at all; the default for keyframes, and the audit-friendly choice for deltas
  (about 1.6x the bytes of ``dcr.sparse`` on real AdamW deltas).

Each codec has one name, defined in ``dcr_zarr_codec.metadata`` (the Zarr codec's name, which
manifests record too); manifests written before name ``dcr-sparse`` and ``dcr-cond``, which read
as the same codecs.

Blosc run with several internal threads emits blocks in a thread-dependent order, so the same
input can give different bytes; DCR needs deterministic payloads (a retry, or another worker,
must store the same bytes), so Blosc runs single-threaded and parallelism comes from compressing
many chunks at once. No process-wide setting is changed for that: numcodecs compresses
single-threaded off the main thread unless told otherwise (``numcodecs.blosc.use_threads`` None,
its default), DCR compresses on its I/O threads, and a call from the main thread (tests, the
benchmark) is handed to one helper thread. A host that forces ``use_threads = True`` gets an error
instead of non-deterministic payloads.
"""

from __future__ import annotations

import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import cache

import numpy as np
from dcr_zarr_codec.cond import check_frame, decode_cond, encode_cond
from dcr_zarr_codec.metadata import BLOSC_CODEC, CODECS, COND_CODEC, SPARSE_CODEC, codec_name
from dcr_zarr_codec.sparse import SparseFrameError
from numcodecs import Blosc, blosc

from dcr_core.errors import IntegrityError, UsageError
from dcr_core.sparse import decode_sparse, encode_sparse

_OWN = (SPARSE_CODEC, COND_CODEC)  # DCR's own frames: only a zstd level to record
_SHUFFLES = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """How chunk payloads are compressed. Recorded in every manifest.

    ``clevel`` is the zstd level for ``dcr.sparse`` and ``dcr.cond``; ``cname``/``shuffle``/``blocksize``
    apply to Blosc. A former name (``dcr-sparse``) is taken as the codec's name today.
    """

    name: str = BLOSC_CODEC
    cname: str = "zstd"
    clevel: int = 3
    shuffle: str = "shuffle"
    blocksize: int = 0  # Blosc block size in bytes; 0 lets Blosc choose

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", codec_name(self.name))
        if self.name not in CODECS:
            raise ValueError(f"codec must be one of {CODECS}, got {self.name!r}")
        if self.shuffle not in _SHUFFLES:
            raise ValueError(f"shuffle must be one of {sorted(_SHUFFLES)}, got {self.shuffle!r}")
        if not 0 <= self.clevel <= 9:
            raise ValueError(f"clevel must be 0..9, got {self.clevel}")
        if not 0 <= self.blocksize <= 1 << 30:
            raise ValueError(f"blocksize must be 0..2^30, got {self.blocksize}")

    def to_dict(self) -> dict:
        """The manifest's codec block: only the fields the codec uses."""
        if self.name in _OWN:
            return {"name": self.name, "clevel": self.clevel}
        return asdict(self)

    @property
    def conditional(self) -> bool:
        """Chunks decode only against the held bits (``dcr.cond``); their digest covers the stored bytes."""
        return self.name == COND_CODEC

    @property
    def sparse(self) -> bool:
        """Chunks are sparse frames (``dcr.sparse``): an XOR delta's may be applied from their stored
        form (``dcr_core.sparse.xor_frame``), without a dense mask."""
        return self.name == SPARSE_CODEC

    @classmethod
    def from_dict(cls, d: dict) -> CodecSpec:
        name = codec_name(str(d.get("name", BLOSC_CODEC)))  # no name: written before sparse deltas existed
        if name in _OWN:  # older manifests also listed (unused) Blosc fields
            return cls(name=name, clevel=int(d["clevel"]))
        return cls(
            name=name, cname=str(d["cname"]), clevel=int(d["clevel"]), shuffle=str(d["shuffle"]),
            blocksize=int(d.get("blocksize", 0)),
        )

    def _blosc(self) -> Blosc:
        return Blosc(cname=self.cname, clevel=self.clevel, shuffle=_SHUFFLES[self.shuffle], blocksize=self.blocksize)

    def encode(self, padded: np.ndarray, base: np.ndarray | None = None, dtype: str | None = None,
               changes: tuple[np.ndarray, np.ndarray] | None = None) -> bytes:
        """Compress one full (padded) chunk of raw bits (deterministic: same bits, same bytes).

        ``dcr.cond`` codes an XOR mask against ``base`` (the chunk's old bits, padded the same way)
        and needs the tensor's ``dtype`` name; without a base it stores ``padded`` plainly. The
        other codecs ignore both. ``changes``: the chunk's non-zero elements (positions, values) if
        the caller found them already; ``dcr.sparse`` then does not scan it again, the others ignore them."""
        if self.conditional:
            if dtype is None and base is not None:
                raise UsageError("dcr.cond needs the tensor's dtype to code a chunk against its old bits")
            return encode_cond(padded, base, dtype, self.clevel)
        if self.sparse:
            return encode_sparse(padded, self.clevel, changes)
        return _blosc_single_threaded(self._blosc(), np.ascontiguousarray(padded))

    def decode(self, data: bytes, storage: np.dtype, n_padded: int, base: np.ndarray | None = None,
               dtype: str | None = None, forward: bool = True, in_place: bool = False) -> np.ndarray:
        """Decompress one chunk into exactly ``n_padded`` elements, refusing any other size.

        ``dcr.cond``: against ``base`` (the held bits of the chunk's first ``base.size`` elements:
        the old bits if ``forward``, the new bits if not), the XOR mask of those elements; with
        ``in_place``, the other step's bits written over ``base`` (flat, writable) instead."""
        if self.conditional:
            try:
                return decode_cond(data, storage, n_padded, base, forward, dtype, in_place)
            except SparseFrameError as e:
                raise IntegrityError(str(e)) from None
        if self.sparse:
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
        except Exception as e:  # noqa: BLE001 - whatever Blosc raises, the stored bytes are bad
            raise IntegrityError(f"chunk fails to decompress ({e})") from None
        return out


@cache
def _main_thread_helper() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcr-blosc")


def _blosc_single_threaded(codec: Blosc, data: np.ndarray) -> bytes:
    """``codec.encode(data)`` with Blosc's single-threaded (deterministic) path; see the module doc."""
    if blosc.use_threads is True:
        raise UsageError(
            "numcodecs.blosc.use_threads is True in this process: Blosc would compress with several "
            "threads and store non-deterministic bytes; leave it None (the default) or set it False"
        )
    if blosc.use_threads is None and threading.current_thread() is threading.main_thread():
        return bytes(_main_thread_helper().submit(codec.encode, data).result())
    return bytes(codec.encode(data))


def check_conditional(data: bytes, storage: np.dtype, n_padded: int, dtype: str) -> None:
    """A ``dcr.cond`` frame's header fits the chunk (size, type, classes): what can be checked
    before the held bits are at hand (the stored bytes' digest is checked by the caller)."""
    try:
        check_frame(data, storage, n_padded, dtype)
    except SparseFrameError as e:
        raise IntegrityError(str(e)) from None
