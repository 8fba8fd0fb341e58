"""Projection throughput and per-rank memory of sharded publishing (``python -m dcr_bench.shards``).

Throughput: GB of shard scanned per second on one core by ``dcr_core.projection.project`` (XOR of
the shard against its baseline, written into canonical chunk buffers; no compression, no I/O), for
a row-block split (column parallel: one run per chunk) and a column split (row parallel: one run
per row, every chunk shared by all ranks), at a realistic 2% change rate.

Memory: tracemalloc peak of one rank's ``encode_rank`` (projection, compression, upload window)
beyond the shard and its baseline, which it holds anyway.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import tracemalloc

import numpy as np
import torch

from dcr_core.chunking import ChunkGrid, choose_chunk_shape
from dcr_core.projection import ShardBits, project
from dcr_core.shard_spec import split
from flows import PublishOptions, Shard, ShardedSource, local_refs, run_publish
from flows.publish import ranks
from flows.publish.shard_baseline import load_shard_baseline
from storage.root import RootRef


def _shard(rng, rows: int, cols: int, world: int, dim: int, rank: int = 0):
    pieces = split("w", (rows, cols), {dim: (rank, world)})
    n = pieces[0].numel
    base = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    new = base.copy()
    pos = rng.choice(n, size=n // 50, replace=False)
    new[pos] ^= rng.integers(1, 1 << 16, size=pos.size, dtype=np.uint16)
    return pieces, new, base


def projection_throughput(rows: int = 8192, cols: int = 4096, world: int = 4, chunk_bytes: int = 4 << 20, repeat: int = 3) -> dict:
    rng = np.random.default_rng(0)
    grid = {"w": ChunkGrid((rows, cols), choose_chunk_shape((rows, cols), 2, chunk_bytes))}
    out = {}
    for label, dim in (("column_parallel_rows", 0), ("row_parallel_cols", 1)):
        pieces, new, base = _shard(rng, rows, cols, world, dim)
        sb = [ShardBits(tuple(pieces), new, base)]
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            n = sum(1 for _ in project(sb, grid, {"w": np.dtype(np.uint16)}))
            best = min(best, time.perf_counter() - t0)
        out[label] = {"shard_bytes": new.nbytes, "chunks": n, "seconds": best, "GBps": new.nbytes / best / 1e9}
    return out


def encode_memory(rows: int = 4096, cols: int = 2048, world: int = 4, chunk_bytes: int = 256 << 10, io_workers: int = 2,
                  pack_bytes: int = PublishOptions.model_fields["pack_bytes"].default) -> dict:
    """Peak extra (tracemalloc) memory of one rank's encode of a delta, every chunk shared."""
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as d:
        opts = PublishOptions(chunk_bytes=chunk_bytes, cache_dir=f"{d}/cache", io_workers=io_workers, pack_bytes=pack_bytes)
        full0 = torch.from_numpy(rng.integers(0, 1 << 16, size=(rows, cols), dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
        full1 = full0.clone()
        flat = full1.view(torch.int16).reshape(-1)
        pos = torch.from_numpy(rng.choice(flat.numel(), size=flat.numel() // 50, replace=False))
        flat[pos] ^= 0x0101

        def sources(full):
            out = []
            for r in range(world):
                p = split("w", (rows, cols), {1: (r, world)})
                a, e = p[0].start[1], p[0].extent[1]
                out.append(ShardedSource([Shard("w", full[:, a:a + e], p)], rank=r, world=world))
            return out

        run_publish(f"{d}/b", sources(full0), 0, options=opts)
        snap = local_refs.put(sources(full1)[0].snapshot(), "shard snapshot")
        plan = ranks.plan_rank(RootRef(f"{d}/b"), snap, 1, False, opts, "ef" * 16)
        baseline = load_shard_baseline(plan, snap)
        tracemalloc.start()
        tracemalloc.reset_peak()
        t0 = time.perf_counter()
        ranks.encode_rank(plan, snap, baseline)
        secs = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        shard = local_refs.get(snap).bits[0].nbytes
        local_refs.release(snap)
        local_refs.release(baseline)
    return {"tensor_bytes": rows * cols * 2, "shard_bytes": shard, "chunk_bytes": chunk_bytes, "io_workers": io_workers,
            "pack_bytes": pack_bytes,
            "encode_peak_extra_bytes": peak, "encode_seconds": secs,
            "rank_peak_bytes_estimate": 2 * shard + peak}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=4096)
    args = ap.parse_args(argv)
    print(json.dumps({"throughput": projection_throughput(args.rows, args.cols), "memory": encode_memory()}, indent=1))


if __name__ == "__main__":
    main()
