"""Zarr v3 metadata for a step's store: written by DCR, readable by stock ``zarr``.

DCR writes chunk objects itself (it needs their digests, sizes and its own concurrency), so it
also writes the ``zarr.json`` documents. Arrays hold raw bits as unsigned ints of the element's
width (Zarr v3 has no bfloat16/float8), fill value 0, the ``bytes`` codec (little-endian) then
``blosc``, ``dcr.sparse`` or ``dcr.cond``. A chunk that is not stored reads as zeros: for an XOR mask, "no change".
"""

from __future__ import annotations

import json

from dcr_core.codec import CodecSpec
from dcr_core.dtypes import DTYPES

SPARSE_CODEC = "dcr.sparse"  # registered with zarr by the dcr-zarr-codec package (entry point zarr.codecs)
COND_CODEC = "dcr.cond"  # registered too; its chunks decode only against the held bits (it says so)
_ZARR_DTYPE = {8: "uint8", 16: "uint16", 32: "uint32", 64: "uint64"}


def _compressor(codec: CodecSpec, itemsize: int) -> dict:
    if codec.name == "dcr-sparse":
        return {"name": SPARSE_CODEC, "configuration": {"level": codec.clevel}}
    if codec.name == "dcr-cond":
        return {"name": COND_CODEC, "configuration": {"level": codec.clevel}}
    return {
        "name": "blosc",
        "configuration": {
            "typesize": itemsize,
            "cname": codec.cname,
            "clevel": codec.clevel,
            "shuffle": codec.shuffle,
            "blocksize": codec.blocksize,
        },
    }


def group_json(attributes: dict) -> bytes:
    return json.dumps(
        {"zarr_format": 3, "node_type": "group", "attributes": attributes}, indent=1
    ).encode()


def array_json(
    shape: tuple[int, ...],
    chunk_shape: tuple[int, ...],
    dtype_name: str,
    codec: CodecSpec,
    attributes: dict,
) -> bytes:
    dt = DTYPES[dtype_name]
    doc = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": _ZARR_DTYPE[dt.bits],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, _compressor(codec, dt.itemsize)],
        "attributes": attributes,
        "storage_transformers": [],
    }
    return json.dumps(doc, indent=1).encode()
