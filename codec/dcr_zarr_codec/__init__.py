"""DCR's ``dcr.sparse`` Zarr v3 codec, on its own: numpy, numcodecs and zarr, nothing else (plus
the ``dcr.cond`` frame's small C extension, built by pip).

Installed, it lets stock zarr read every array DCR stores with its default codecs (keyframes use
the standard ``blosc`` codec; deltas ``dcr.sparse`` by default) without torch, Prefect or DCR
itself. ``dcr.cond`` deltas (``--codec cond``) code changes against the previous step's bits, which
a Zarr codec never sees: reading one raises an error that says so.

    pip install ./codec
    python -c "import zarr; print(zarr.open_group('ROOT/steps/000000000007/attempts/<id>/data.zarr', mode='r')['w'][:])"

zarr finds the codec through the ``zarr.codecs`` entry point; nothing needs importing.
"""

__version__ = "0.1.0"
