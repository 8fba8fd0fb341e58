"""Digests: per chunk, per tensor, and one policy digest per step.

BLAKE3 (256-bit): it is a cryptographic hash, so a signed manifest binds the exact bits of every
chunk and tensor (a fast non-cryptographic hash such as xxHash or Adler-32 would not), and it is
fast enough not to matter next to I/O (about 8 GB/s on one core here, versus about 1.5 GB/s for
BLAKE2b). Digests cover raw little-endian bits, so they are float-agnostic.
"""

from __future__ import annotations

from collections.abc import Iterable

import blake3
import numpy as np

DIGEST_ALGORITHM = "blake3"


def _hex(data) -> str:
    return blake3.blake3(data).hexdigest()


def tensor_digest(bits: np.ndarray) -> str:
    """Digest of a tensor's raw bits (flat, little-endian)."""
    return _hex(memoryview(np.ascontiguousarray(bits)).cast("B"))


def chunk_digest(payload: np.ndarray) -> str:
    """Digest of one chunk payload's raw bits (unpadded)."""
    return tensor_digest(payload)


def policy_digest(entries: Iterable[tuple[str, str, tuple[int, ...], str]]) -> str:
    """One digest over (name, dtype, shape, tensor digest) of every tensor, in name order."""
    h = blake3.blake3()
    for name, dtype, shape, digest in sorted(entries):
        h.update(f"{name}\0{dtype}\0{','.join(map(str, shape))}\0{digest}\n".encode())
    return h.hexdigest()
