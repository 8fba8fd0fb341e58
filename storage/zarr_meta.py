"""Zarr v3 metadata for a step's store: written by DCR, readable by stock ``zarr``.

DCR writes chunk objects itself (it needs their digests, sizes and its own concurrency), so it
also writes the ``zarr.json`` documents. What they hold is defined once, in the codec package
(``dcr_zarr_codec.metadata``), which also builds them in memory for an auditor's reader
(``dcr_zarr_codec.open_step``); this module serializes them from DCR's own types.
"""

from __future__ import annotations

import json

from dcr_zarr_codec import metadata

from dcr_core.codec import CodecSpec
from dcr_core.dtypes import DTYPES


def group_json(attributes: dict) -> bytes:
    return json.dumps(metadata.group_metadata(attributes), indent=1).encode()


def array_json(
    shape: tuple[int, ...],
    chunk_shape: tuple[int, ...],
    dtype_name: str,
    codec: CodecSpec,
    attributes: dict,
) -> bytes:
    doc = metadata.array_metadata(shape, chunk_shape, DTYPES[dtype_name].bits, codec.to_dict(), attributes)
    return json.dumps(doc, indent=1).encode()
