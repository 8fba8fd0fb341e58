"""Refit of a live ``torch.nn.Module`` through its own vLLM-style ``load_weights``.

The receiver keeps a host-side canonical mirror (a state file) and places changes with the
module's own loader: after the mirror reaches the target step, the tensors that changed on the
way are reloaded, with their full new values, through ``target.load_weights``. That is the
overwrite path: it is exact for any loader whose result for a tensor depends only on that tensor
(fused QKV, gate/up, TP narrowing, quantizing loaders), because it is a dense refit restricted to
the tensors that differ. A module never refit before (or whose refit was interrupted) gets a full
dense load. Cost: host memory for one canonical copy; XOR-through-the-loader placement, which
avoids the mirror, is not implemented yet.
"""

from __future__ import annotations

import os
import time

import blake3

from dcr_core.chain import Direction
from dcr_core.errors import UsageError
from flows import pipeline
from flows.options import default_cache_dir
from storage import layout
from storage.catalog import Catalog
from storage.checkpoint import SafetensorsCheckpoint
from storage.root import Root

_ATTR = "_dcr_refit"


def default_mirror_path(root: str, receiver_id: str) -> str:
    key = blake3.blake3(os.fspath(root).encode()).hexdigest()[:16]
    return os.path.join(default_cache_dir(), "receivers", key, f"{receiver_id}.safetensors")


def receive_into_module(
    root, receiver_id, target, step=None, storage_options=None, options=None, state_path=None,
    tasks=pipeline.LOCAL,
) -> dict:
    load = getattr(target, "load_weights", None)
    if not callable(load):
        raise UsageError(f"{type(target).__name__} has no load_weights(weights) method to place tensors with")
    layout.check_receiver(receiver_id)
    root = os.fspath(root)
    mirror = os.fspath(state_path or default_mirror_path(root, receiver_id))
    res = pipeline.run_receive(root, receiver_id, mirror, step, storage_options, options, tasks=tasks, record=False)
    held = getattr(target, _ATTR, None)
    cat = Catalog(Root(root, storage_options))
    names: set[str] | None = None
    if held and held.get("root") == root and held.get("step") == res.from_step and res.from_step is not None:
        names = set()
        for move in res.moves:
            direction, s = move.split(":")
            m = cat.manifest(int(s))
            if direction == Direction.KEYFRAME.value:
                names = None
                break
            names |= {n for n, e in m.tensors.items() if len(e.chunks)}
    ck = SafetensorsCheckpoint(mirror)
    todo = sorted(ck.infos) if names is None else sorted(names)
    if held is not None:
        delattr(target, _ATTR)  # unknown state until the load below completes
    t0 = time.perf_counter()
    load((n, ck.tensor(n)) for n in todo)
    pause = time.perf_counter() - t0
    setattr(target, _ATTR, {"root": root, "step": res.step, "policy_digest": res.policy_digest})
    record = {
        "from_step": res.from_step if names is not None else None,
        "moves": res.moves,
        "bytes_pulled": res.bytes_pulled,
        "policy_digest": res.policy_digest,
        "tensors_loaded": len(todo),
        "pause_seconds": pause,
    }
    cat.record_receiver(res.step, receiver_id, record)
    return {"step": res.step, **record, "timings": res.timings}
