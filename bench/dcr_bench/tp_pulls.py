"""Bytes each tensor-parallel receiver rank pulls for one delta, with and without column blocks.

A vLLM-style Llama (``dcr_bench.models.llama_vllm``: fused qkv / gate-up, vocab-parallel embedding
and head, row-parallel o / down projections) is published as a keyframe and one delta (a share of
BF16 elements moved by one unit) to two local ROOTs: contiguous chunks (``column_blocks=1``, the
default) and 4 column blocks. Every rank of TP 1, 2 and 4 loads step 0 densely and then refits to
step 1 through ``receive_into_module``; its demand comes from its own loader's probe. Reported per
rank: bytes pulled, and that over the step's stored bytes / TP (1.0: exactly its share). Each rank's
bits are compared with a dense load of step 1 into a fresh rank.

Chunks are small here (64 KiB; ``--quick``: 2 KiB) so that tensors span several chunks, as a 7B
model's 32 MiB projections do with the default 4 MiB chunks.
"""

from __future__ import annotations

import os
import time

import torch

from dcr_bench.models.llama_vllm import LlamaConfig, VllmLlama, canonical_checkpoint, tp_group
from flows import PublishOptions, receive_into_module, run_publish

TPS = (1, 2, 4)
BLOCKS = (1, 4)


def _config(quick: bool) -> tuple[LlamaConfig, int]:
    if quick:
        return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_heads=8, num_kv_heads=4), 2048
    return LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8,
                       num_kv_heads=4), 64 << 10


def _next(ck: dict[str, torch.Tensor], rate: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: t.clone() for n, t in ck.items()}
    for t in out.values():
        if t.dtype == torch.bfloat16:
            bits = t.view(-1).view(torch.int16)
            bits[torch.rand(bits.numel(), generator=g) < rate] ^= 1
    return out


def _bits(module: torch.nn.Module) -> list[bytes]:
    return [t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            for t in [*module.parameters(), *module.buffers()]]


def measure(work: str, quick: bool = False, rate: float = 0.03, seed: int = 0) -> dict:
    cfg, chunk_bytes = _config(quick)
    ck0 = canonical_checkpoint(cfg, seed=seed)
    ck1 = _next(ck0, rate, seed + 1)
    rows = []
    for blocks in BLOCKS:
        root = os.path.join(work, f"tp-root-{blocks}")
        opts = PublishOptions(chunk_bytes=chunk_bytes, column_blocks=blocks, cache_dir=os.path.join(work, f"tp-cache-{blocks}"))
        run_publish(root, ck0, 0, options=opts)
        stored = run_publish(root, ck1, 1, options=opts).summary["bytes_stored"]
        for tp in TPS:
            pulled, fetch_s, exact = [], [], True
            for r, mod in enumerate(tp_group(cfg, tp)):
                state = os.path.join(work, f"tp-mirror-{blocks}-{tp}-{r}.safetensors")
                receive_into_module(root, f"rank{r}", mod, 0, state_path=state)
                t0 = time.perf_counter()
                res = receive_into_module(root, f"rank{r}", mod, 1, state_path=state)
                fetch_s.append(round(time.perf_counter() - t0, 4))
                ref = VllmLlama(cfg, r, tp)
                ref.load_weights(list(ck1.items()))
                exact &= res["mode"] == "delta" and _bits(mod) == _bits(ref)
                pulled.append(res["bytes_pulled"])
            rows.append({"column_blocks": blocks, "tp": tp, "stored_bytes": stored, "pulled_bytes": pulled,
                         "share_ratio": [round(p * tp / stored, 3) for p in pulled], "refit_s": fetch_s,
                         "exact": bool(exact)})
    params = sum(t.numel() for t in ck0.values())
    return {"parameters": params, "change_rate": rate, "chunk_bytes": chunk_bytes,
            "config": {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                                       "num_heads", "num_kv_heads")},
            "rows": rows}


def markdown(res: dict) -> list[str]:
    lines = [
        "\n## Per-rank pulls (tensor-parallel live-module receivers)\n",
        (f"vLLM-style Llama, {res['parameters'] / 1e6:.1f}M BF16 parameters, {100 * res['change_rate']:g}% of elements "
         f"changed, {res['chunk_bytes'] // 1024} KiB chunks. Share ratio: a rank's bytes pulled over the step's stored "
         "bytes / TP (1.0 is exactly its share).\n"),
        "| column blocks | TP | step stored bytes | bytes pulled per rank | share ratio per rank | exact |",
        "|---:|---:|---:|---|---|:--:|",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['column_blocks']} | {r['tp']} | {r['stored_bytes']:,} | "
                     f"{', '.join(f'{p:,}' for p in r['pulled_bytes'])} | "
                     f"{', '.join(f'{x:.3f}' for x in r['share_ratio'])} | {'yes' if r['exact'] else 'NO'} |")
    return lines
