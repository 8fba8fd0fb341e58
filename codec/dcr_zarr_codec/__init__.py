"""DCR's ``dcr.sparse`` Zarr v3 codec, on its own: numpy, numcodecs and zarr, nothing else.

Installed, it lets stock zarr read every array DCR stores (keyframes use the standard ``blosc``
codec; deltas ``dcr.sparse`` by default) without torch, Prefect or DCR itself:

    pip install ./codec
    python -c "import zarr; print(zarr.open_group('ROOT/steps/000000000007/attempts/<id>/data.zarr', mode='r')['w'][:])"

zarr finds the codec through the ``zarr.codecs`` entry point; nothing needs importing.
"""

__version__ = "0.1.0"
