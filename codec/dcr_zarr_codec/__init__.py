"""DCR's Zarr codecs and its step reader, on their own: numpy, numcodecs, zarr and fsspec, nothing
else (plus the ``dcr.cond`` frame's small C extension, built by pip).

Installed, it lets stock zarr read every array DCR stores with its default codecs (keyframes use
the standard ``blosc`` codec; deltas ``dcr.sparse`` by default) without torch, Prefect or DCR
itself. ``dcr.cond`` deltas (``--codec cond``) code changes against the previous step's bits, which
a Zarr codec never sees: reading one raises an error that says so.

The one call that opens a tensor of a committed step by its name, whatever the step's layout
(one object per chunk, or packs)::

    pip install ./codec
    python -c "import dcr_zarr_codec as d; print(d.open_tensor('ROOT', 7, 'lm_head.weight')[...])"

``open_step(ROOT, 7)`` gives the whole step as a read-only Zarr group. zarr finds the codecs through
the ``zarr.codecs`` entry point; nothing needs importing to read a store with ``zarr.open_group``.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
__all__ = ["StepDocumentError", "StepGroup", "StepNotCommittedError", "open_step", "open_tensor"]


def __getattr__(name: str):
    # The reader loads zarr and fsspec's reference filesystem (0.1-0.3 s) on first use: DCR imports
    # this package for its frames on every command, and most never open a step this way.
    if name in __all__:
        return getattr(importlib.import_module("dcr_zarr_codec.step"), name)
    raise AttributeError(f"module 'dcr_zarr_codec' has no attribute {name!r}")
