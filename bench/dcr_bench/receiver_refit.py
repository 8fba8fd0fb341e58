"""Measure a live-module refit on a model of ~100M+ parameters: probe, fetch, pause window, apply rate.

    python -m dcr_bench.receiver_refit [--hidden 1024 --layers 8 --vocab 32000 --change 0.02 --tp 1]

Publishes a keyframe and one delta of a vLLM-style Llama (``dcr_bench.models.llama_vllm``) to a local
ROOT, brings a fresh receiver module to step 0 (dense) and then to step 1 (delta), checks the
module's bits against a dense load, and prints JSON with the timings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from dcr_bench.models.llama_vllm import LlamaConfig, VllmLlama, canonical_checkpoint
from flows import PublishOptions, receive_into_module, run_publish


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--change", type=float, default=0.02)
    p.add_argument("--tp", type=int, default=1)
    a = p.parse_args()
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_layers=a.layers, num_heads=16, num_kv_heads=4)
    work = tempfile.mkdtemp(prefix="dcr-bench-")
    os.environ.setdefault("DCR_CACHE_DIR", os.path.join(work, "cache"))
    root = os.path.join(work, "bucket")
    ck0 = canonical_checkpoint(cfg, seed=0)
    params = sum(t.numel() for t in ck0.values())
    ck1 = {n: t.clone() for n, t in ck0.items()}
    g = torch.Generator().manual_seed(1)
    for t in ck1.values():
        if t.dtype == torch.bfloat16:
            bits = t.view(-1).view(torch.int16)
            bits[torch.rand(bits.numel(), generator=g) < a.change] ^= 1
    opts = PublishOptions()
    t0 = time.perf_counter()
    run_publish(root, ck0, 0, options=opts)
    t1 = time.perf_counter()
    r1 = run_publish(root, ck1, 1, options=opts)
    t2 = time.perf_counter()
    mod = VllmLlama(cfg, 0, a.tp)
    d0 = time.perf_counter()
    dense = receive_into_module(root, "bench", mod, 0)
    d1 = time.perf_counter()
    delta = receive_into_module(root, "bench", mod, 1)
    d2 = time.perf_counter()
    ref = VllmLlama(cfg, 0, a.tp)
    ref.load_weights(list(ck1.items()))
    exact = all(torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
                for x, y in zip(mod.state_dict().values(), ref.state_dict().values()))
    changed_bytes = sum(t.numel() * t.element_size() for t in ck1.values())  # every tensor changed here
    out = {
        "parameters": params, "tp": a.tp, "change_rate": r1.summary["change_rate"],
        "publish_keyframe_s": t1 - t0, "publish_delta_s": t2 - t1,
        "delta_bytes_stored": r1.summary["bytes_stored"], "full_bytes": r1.summary["bytes_full"],
        "first_refit_dense_s": d1 - d0, "dense_pause_s": dense["pause_seconds"],
        "delta_refit_s": d2 - d1, "delta_fetch_s": delta["fetch_seconds"],
        "delta_pause_s": delta["pause_seconds"],
        "delta_modify_wall_s": delta["modify_wall_seconds"],
        "apply_GBps": changed_bytes / delta["pause_seconds"] / 1e9 if delta["pause_seconds"] else None,
        "bit_exact": exact,
    }
    print(json.dumps(out, indent=1))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
