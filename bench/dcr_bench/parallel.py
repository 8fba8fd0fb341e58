"""Codec throughput on 1 and 2 threads, and the conditional codec (``dcr.cond``) beside the default.

Each thread encodes or decodes whole chunks (a ``ThreadPoolExecutor`` over the chunks of every
tensor, results kept in chunk order): the stored bytes are the same whatever the thread count, and
the run checks it. Encode = XOR one chunk of both versions, count its changes (an unchanged chunk
is not stored), pad and compress; decode+apply = decompress one chunk and XOR it into the old bits.

The speed-up of 2 threads over 1 depends on the codec (how much of its work holds the GIL or
serializes on memory allocation) and on the machine (whether 2 cores are really there): the same
pool also runs a reference job that holds no GIL and allocates nothing per task (zstd level 1 of
fixed 1 MiB buffers), so that a low codec ratio can be told apart from a machine that has no
second core to give.
"""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dcr_core.chunking import ChunkGrid, choose_chunk_shape
from dcr_core.codec import CodecSpec
from dcr_core.delta import pad

THREADS = (1, 2)


def _jobs(pairs, chunk_bytes: int) -> list[tuple]:
    jobs = []
    for p in pairs:
        grid = ChunkGrid(p.shape, choose_chunk_shape(p.shape, p.new.dtype.itemsize, chunk_bytes))
        jobs += [(p, grid, i) for i in range(grid.n_chunks)]
    return jobs


def _encoder(codec: CodecSpec, conditional: bool):
    def encode(job):
        p, grid, i = job
        start, stop = grid.chunk_range(i)
        mask = np.bitwise_xor(p.new[start:stop], p.old[start:stop])
        if not np.count_nonzero(mask):
            return None
        n = grid.chunk_numel
        if conditional:
            return codec.encode(pad(mask, n), base=pad(p.old[start:stop], n), dtype=p.dtype)
        return codec.encode(pad(mask, n))

    return encode


def _decoder(codec: CodecSpec, conditional: bool, targets: dict[str, np.ndarray]):
    def decode_apply(item):
        (p, grid, i), data = item
        start, stop = grid.chunk_range(i)
        target = targets[p.name][start:stop]
        n = grid.chunk_numel
        if conditional:
            mask = codec.decode(data, p.new.dtype, n, base=pad(target, n), dtype=p.dtype, forward=True)
        else:
            mask = codec.decode(data, p.new.dtype, n)
        np.bitwise_xor(target, mask[: stop - start], out=target)

    return decode_apply


def _repeats(nbytes: int) -> int:
    return max(3, min(5, (64 << 20) // max(1, nbytes)))


def measure_threads(pairs, codec: CodecSpec, chunk_bytes: int, conditional: bool = False,
                    threads: tuple[int, ...] = THREADS) -> dict:
    """Stored bytes, encode and decode+apply GB/s (best of N) per thread count, bit-exactness,
    and whether every thread count stored the same bytes. The thread counts take turns within
    each repetition, so that a neighbour's load on a shared machine hits them alike."""
    nbytes = sum(p.new.nbytes for p in pairs)
    jobs = _jobs(pairs, chunk_bytes)
    encode = _encoder(codec, conditional)
    enc_s = dict.fromkeys(threads, math.inf)
    dec_s = dict.fromkeys(threads, math.inf)
    reference: list | None = None
    same = exact = True
    with contextlib.ExitStack() as stack:
        pools = {w: stack.enter_context(ThreadPoolExecutor(max_workers=w, thread_name_prefix="dcr-bench"))
                 for w in threads}
        for _ in range(_repeats(nbytes)):
            for w, ex in pools.items():
                t0 = time.perf_counter()
                frames = list(ex.map(encode, jobs))
                enc_s[w] = min(enc_s[w], time.perf_counter() - t0)
                if reference is None:
                    reference = frames
                else:
                    same = same and frames == reference
                stored = [(j, f) for j, f in zip(jobs, frames) if f is not None]
                targets = {p.name: p.old.copy() for p in pairs}
                t0 = time.perf_counter()
                for _ in ex.map(_decoder(codec, conditional, targets), stored):
                    pass
                dec_s[w] = min(dec_s[w], time.perf_counter() - t0)
                exact = exact and all(np.array_equal(targets[p.name], p.new) for p in pairs)
                del targets, frames, stored
    t = {str(w): {"encode_s": enc_s[w], "decode_apply_s": dec_s[w], "encode_gbps": nbytes / enc_s[w] / 1e9,
                  "decode_apply_gbps": nbytes / dec_s[w] / 1e9} for w in threads}
    lo, hi = threads[0], threads[-1]
    return {
        "codec": codec.to_dict(), "threads": t,
        "bytes": sum(len(f) for f in reference or [] if f is not None),
        "chunks": sum(f is not None for f in reference or []), "exact": exact, "same_bytes": same,
        "encode_ratio": enc_s[lo] / enc_s[hi], "decode_apply_ratio": dec_s[lo] / dec_s[hi],
    }


def machine_reference(threads: tuple[int, ...] = THREADS, tasks: int = 16, repeats: int = 5) -> dict:
    """What this machine gives a second thread right now: zstd-1 of fixed 1 MiB buffers (no GIL
    held, no allocation per task) on the same kind of pool; the ratio bounds any codec's."""
    from numcodecs import Zstd

    rng = np.random.default_rng(0)
    bufs = [rng.integers(0, 4, size=1 << 20, dtype=np.uint8) for _ in range(tasks)]
    z = Zstd(level=1)
    secs = {}
    for w in threads:
        best = math.inf
        with ThreadPoolExecutor(max_workers=w) as ex:
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in ex.map(z.encode, bufs):
                    pass
                best = min(best, time.perf_counter() - t0)
        secs[str(w)] = best
    lo, hi = str(threads[0]), str(threads[-1])
    return {"seconds": secs, "ratio": secs[lo] / secs[hi]}
