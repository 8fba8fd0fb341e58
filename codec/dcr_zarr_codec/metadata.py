"""The Zarr v3 documents of a DCR step's arrays, built from what a manifest says of a tensor.

One definition for both sides: DCR writes these documents as ``zarr.json`` objects (per-object
steps), and ``dcr_zarr_codec.step`` builds the same ones in memory for steps that store none
(packed steps). An array holds raw bits as unsigned ints of the element's width (Zarr v3 has no
bfloat16/float8), fill value 0, the ``bytes`` codec (little-endian) then ``blosc``, ``dcr.sparse``
or ``dcr.cond``. A chunk that is not stored reads as zeros: for an XOR mask, "no change".
"""

from __future__ import annotations

# The codecs' names, one each: what a manifest's codec block, a stream index and a zarr.json name.
# The Zarr name is the one that cannot change (stock zarr finds the codec by it, through this
# package's zarr.codecs entry point, in every zarr.json written so far), so manifests use it too.
BLOSC_CODEC = "blosc"  # the standard Zarr codec (numcodecs): any zarr reads it
SPARSE_CODEC = "dcr.sparse"  # registered with zarr by this package (entry point zarr.codecs)
COND_CODEC = "dcr.cond"  # registered too; its chunks decode only against the held bits (it says so)
CODECS = (BLOSC_CODEC, SPARSE_CODEC, COND_CODEC)
# What manifests (and stream indexes, and the simulator's calibrations) named DCR's own codecs before
# they had one name each: still read, never written.
FORMER_NAMES = {"dcr-sparse": SPARSE_CODEC, "dcr-cond": COND_CODEC}


def codec_name(name: str) -> str:
    """A codec's name as written today, for any name a manifest was ever written with."""
    return FORMER_NAMES.get(name, name)

ZARR_DTYPE = {8: "uint8", 16: "uint16", 32: "uint32", 64: "uint64"}

# The element width of each dtype a manifest may name (safetensors names; DCR's dcr_core.dtypes
# holds the same table with torch names, and a test keeps the two equal).
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}


def compressor(codec: dict, itemsize: int) -> dict:
    """The Zarr codec after ``bytes`` for a manifest's ``codec`` block (``{"name": "dcr.sparse",
    "clevel": 3}``, or Blosc's fields; manifests written before sparse deltas have no name: Blosc)."""
    name = codec_name(codec.get("name", BLOSC_CODEC))
    if name in (SPARSE_CODEC, COND_CODEC):
        return {"name": name, "configuration": {"level": int(codec["clevel"])}}
    if name != BLOSC_CODEC:
        raise ValueError(f"unknown codec {name!r}")
    return {
        "name": BLOSC_CODEC,
        "configuration": {
            "typesize": itemsize,
            "cname": str(codec["cname"]),
            "clevel": int(codec["clevel"]),
            "shuffle": str(codec["shuffle"]),
            "blocksize": int(codec.get("blocksize", 0)),
        },
    }


def group_metadata(attributes: dict) -> dict:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes}


def array_metadata(shape, chunk_shape, bits: int, codec: dict, attributes: dict) -> dict:
    """An array of ``shape`` chunked by ``chunk_shape``, elements ``bits`` wide, whose chunks the
    manifest's ``codec`` compressed."""
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": ZARR_DTYPE[bits],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, compressor(codec, bits // 8)],
        "attributes": attributes,
        "storage_transformers": [],
    }
