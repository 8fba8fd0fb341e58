"""The sparse XOR-mask codec, with DCR's errors.

The format has one implementation, in the ``dcr-zarr-codec`` package (``codec/``), so stock zarr
and DCR read the same frames; it raises ``SparseFrameError``, which DCR reports as the
``IntegrityError`` it is (a stored chunk that does not decode).
"""

from __future__ import annotations

import numpy as np
from dcr_zarr_codec import sparse as _frame
from dcr_zarr_codec.sparse import (
    _HEAD,
    DENSE,
    DENSE_ABOVE,
    MAGIC,
    SPARSE,
    VERSION,
    OutsideHeld,
    SparseFrameError,
    TooManyChanges,
    encode_sparse,
    frame_changes,
    nonzero,
    xor_changes,
    xor_diff,
    xor_frame,
)

from dcr_core.errors import IntegrityError

__all__ = ["_HEAD", "DENSE", "DENSE_ABOVE", "MAGIC", "SPARSE", "VERSION", "OutsideHeld", "SparseFrameError", "TooManyChanges",
           "decode_sparse", "encode_sparse", "frame_changes", "nonzero", "xor_changes", "xor_diff",
           "xor_frame"]


def decode_sparse(data: bytes, storage: np.dtype, n: int) -> np.ndarray:
    """Exactly ``n`` elements of ``storage`` from one frame; ``IntegrityError`` if it is not one."""
    try:
        return _frame.decode_sparse(data, storage, n)
    except SparseFrameError as e:
        raise IntegrityError(str(e)) from None
