"""Pure codec and planning logic of DCR: tensors and bytes in, tensors and bytes out (no I/O)."""

from dcr_core.bits import bits_of, tensor_from_bits
from dcr_core.chunking import ChunkGrid, choose_chunk_shape
from dcr_core.codec import CodecSpec
from dcr_core.delta import Encoding, apply_chunk, encode_chunks
from dcr_core.digest import chunk_digest, policy_digest, tensor_digest
from dcr_core.dtypes import DTYPES, DType, dtype_of, dtype_named

__all__ = [
    "DTYPES",
    "ChunkGrid",
    "CodecSpec",
    "DType",
    "Encoding",
    "apply_chunk",
    "bits_of",
    "choose_chunk_shape",
    "chunk_digest",
    "dtype_named",
    "dtype_of",
    "encode_chunks",
    "policy_digest",
    "tensor_digest",
    "tensor_from_bits",
]
