"""Memory: a rank's encode holds its shard (and baseline) plus a bounded chunk window, never more.

The tensor is split by columns over 4 ranks (row parallel), the worst case: every canonical chunk
is shared, so every chunk the rank writes is a part. tracemalloc sees every numpy buffer and every
compressed payload of the encode (projection, compression, upload window, and the open pack: a pack
holds what was stored until it is sealed at ``pack_bytes``, small here so that its bound shows).
"""

from __future__ import annotations

from dcr_bench.shards import encode_memory


def test_encode_peak_is_a_chunk_window_not_a_tensor():
    small = encode_memory(rows=2048, cols=2048, world=4, chunk_bytes=128 << 10, io_workers=2, pack_bytes=64 << 10)
    large = encode_memory(rows=8192, cols=2048, world=4, chunk_bytes=128 << 10, io_workers=2, pack_bytes=64 << 10)
    for m in (small, large):
        window = (2 * m["io_workers"] + 2) * 2 * m["chunk_bytes"]  # in-flight chunks: raw + compressed
        window += 2 * (m["pack_bytes"] + m["chunk_bytes"])  # the open pack, and its bytes joined for the PUT
        runs = 64 * 8192  # the run tables (a few int64 per row of the shard)
        assert m["encode_peak_extra_bytes"] < window + runs, m
    # 4x the tensor (and shard) size, about the same peak: bounded by the window, not the data
    assert large["encode_peak_extra_bytes"] < 0.5 * large["shard_bytes"]
    assert large["encode_peak_extra_bytes"] < 2 * small["encode_peak_extra_bytes"] + (256 << 10)
