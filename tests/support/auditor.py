"""A small published chain and what an auditor must read of it through ``dcr_zarr_codec``."""

from __future__ import annotations

import numpy as np
from dcr_zarr_codec import open_step, open_tensor

from dcr_core.retention import KeyframePolicy
from flows import run_publish
from flows.options import PublishOptions
from tests.support.helpers import nasty_checkpoint, next_step, raw_bits

CHUNK_BYTES = 64
PACK_BYTES = 256  # several packs per step, most holding chunks of several tensors


def publish_two(root: str, tmp_path, pack_bytes: tuple[int, int] = (PACK_BYTES, PACK_BYTES)) -> tuple[dict, dict]:
    """A keyframe (step 0) and a delta that is also a restart point (step 1: XOR masks and a
    snapshot), each packed at its ``pack_bytes`` (0: one object per chunk, the layout before packs)."""
    a = nasty_checkpoint(seed=5, dtypes=["BF16", "F32", "F8_E4M3", "I64", "BOOL"])
    b = next_step(a, 6)
    for step, (ckpt, pb) in enumerate(zip((a, b), pack_bytes)):
        opts = PublishOptions(chunk_bytes=CHUNK_BYTES, pack_bytes=pb, cache_dir=str(tmp_path / "cache"),
                              keyframe_policy=KeyframePolicy(every=1))
        run_publish(root, ckpt, step, options=opts)
    return a, b


def check_step_reads(root: str, a: dict, b: dict, storage_options: dict | None = None):
    """Every tensor of both steps through the one call, compared as raw bytes: the keyframe's values,
    the delta's XOR masks (zeros where nothing changed), also by tensor name in step 1's whole
    group, which it returns."""
    for name, t in a.items():
        arr = open_tensor(root, 0, name, storage_options)
        assert arr.shape == tuple(t.shape) and arr.dtype == raw_bits(t).dtype, name
        assert arr.attrs["dcr"]["tensor"] == name
        assert np.asarray(arr[...]).tobytes() == raw_bits(a[name]).tobytes(), name
    group = open_step(root, 1, storage_options)
    for name, t in b.items():
        mask = raw_bits(a[name]) ^ raw_bits(t)
        assert np.asarray(open_tensor(root, 1, name, storage_options)[...]).tobytes() == mask.tobytes(), name
        assert np.asarray(group[name][...]).tobytes() == mask.tobytes(), name  # by tensor name
        assert name in group
    return group
