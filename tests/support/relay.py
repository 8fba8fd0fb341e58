"""A relay tree's test data and byte accounting (the servers and the driven receiver and mirror
processes are the benchmark's: ``dcr_bench.relay_tree``)."""

from __future__ import annotations

import torch

from storage import layout
from storage.catalog import Catalog
from storage.root import Root
from tests.support.helpers import nasty_checkpoint, nasty_tensor, next_step

# Odd shapes: no size is a multiple of the chunk, and several chunks per tensor at 64 KiB.
BIG = {"BF16": (509, 521), "F32": (151, 997), "F16": (257, 509), "I32": (97, 503)}
SMALL_DTYPES = ["BF16", "F16", "F32", "F64", "I32", "I8", "U8", "BOOL"]


def relay_chain(n: int, seed: int = 7, fraction: float = 0.03) -> list[dict[str, torch.Tensor]]:
    """A keyframe and ``n - 1`` steps: every small nasty tensor (NaN payloads, +-0.0, infinities,
    subnormals, 0-d and empty tensors, odd names) and a few large ones of several dtypes whose
    sizes are no multiple of a chunk; each step flips ``fraction`` of each changing tensor's elements."""
    ck = nasty_checkpoint(seed, dtypes=SMALL_DTYPES)
    for dtype, shape in BIG.items():
        ck[f"layers.{dtype.lower()}.weight"] = nasty_tensor(dtype, shape, seed, "big")
    out = [ck]
    for s in range(1, n):
        out.append(next_step(out[-1], seed * 100 + s, fraction=fraction, unchanged=0.1))
    return out


def step_bytes(root: Root, step: int) -> dict:
    """What committed step ``step`` holds in ``root``, in bytes: its marker, its manifest, its chunks
    (packs, or chunk objects) and its whole attempt; ``objects``: key -> size."""
    marker = Catalog(root).require_marker(step)
    objs = {o.key: o.size for o in root.objects(layout.attempt_dir(step, marker.attempt))}
    return {"marker": len(root.read(layout.commit_key(step))), "manifest": objs.get(layout.manifest_key(step, marker.attempt), 0),
            "chunks": sum(v for k, v in objs.items() if _stored(k)), "attempt": sum(objs.values()), "objects": objs,
            "attempt_id": marker.attempt}


def _stored(key: str) -> bool:
    """Whether ``key`` holds stored chunks: a pack (packed steps) or a chunk object of its own."""
    return f"/{layout.PACKS}/" in key or "/c/" in key


def flags(options: dict, flag: str = "--storage-option") -> list[str]:
    """``options`` as ``dcr`` arguments."""
    return [x for k, v in options.items() for x in (flag, f"{k}={v}")]
