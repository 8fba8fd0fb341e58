"""The default split of a mapped step (``dcr_core.batches``): how many batches for how many worker
threads, and batches of near-equal bytes, so a publish on workers pays Prefect's per-task cost
about once per thread and ends without a small last batch running alone."""

from __future__ import annotations

import pytest

from dcr_core.batches import BATCHES_PER_SLOT, MIN_BATCH_BYTES, SPLIT_BYTES, batch_count, batches_for, even_batches, target_bytes

GB = 10**9
# The 2 GB BF16 checkpoint of ``make bench-workers``: 33 tensors of 34, 90 and (last) 20 MB
LLAMA_2GB = [(f"layers.{i:03d}.weight", 2 * 4096 * r)
             for i, r in enumerate([4096, 11008, 4096, 4096, 11008, 11008, 4096, 11008] * 4 + [2476])]


@pytest.mark.parametrize(("total", "slots", "count"), [
    (2 * GB, 1, 1),  # one thread: one task, nothing to balance
    (2 * GB, 2, 2),  # a thread's share (1 GB) is below SPLIT_BYTES: one batch each
    (2 * SPLIT_BYTES, 1, 2),  # two pieces of SPLIT_BYTES each
    (5 * SPLIT_BYTES, 2, 4),  # 2.5 per thread, split in 2
    (100 * SPLIT_BYTES, 2, 2 * BATCHES_PER_SLOT),  # capped
    (2 * 10**12, 32 * 32, 32 * 32),  # 1T parameters on 32 machines of 32 cores: one per thread
    (2 * 10**12, 32, 32 * BATCHES_PER_SLOT),  # on one machine
    (10 * MIN_BATCH_BYTES, 64, 10),  # small: no batch below MIN_BATCH_BYTES, threads left idle
    (MIN_BATCH_BYTES - 1, 4, 1), (0, 4, 1), (2 * GB, 0, 1),
])
def test_batch_count_is_one_per_thread_unless_pieces_stay_large(total, slots, count):
    assert batch_count(total, slots) == count
    assert target_bytes(total, slots) * count >= total


def test_even_batches_hold_near_equal_bytes_in_order():
    sizes = [("a", 5), ("b", 5), ("c", 20), ("d", 1), ("e", 1), ("f", 9)]
    assert even_batches(sizes, 3) == [["a", "b"], ["c"], ["d", "e", "f"]]
    assert even_batches(sizes, 1) == [[k for k, _ in sizes]]
    assert even_batches(sizes, 100) == [[k] for k, _ in sizes]  # never an empty batch
    assert even_batches([], 3) == [] and even_batches([("z", 0), ("y", 0)], 2) == [["z", "y"]]
    for count in range(1, 8):  # order kept, nothing lost, no more than asked
        runs = even_batches(sizes, count)
        assert [k for run in runs for k in run] == [k for k, _ in sizes] and len(runs) <= count


def test_the_bench_checkpoint_splits_evenly_over_two_threads():
    """2 threads: 2 batches within one tensor of each other (the greedy split by a quarter per
    thread made 7: 4 rounds on one worker, 3 on the other)."""
    runs = batches_for(LLAMA_2GB, 2)
    sizes = dict(LLAMA_2GB)
    held = [sum(sizes[n] for n in run) for run in runs]
    assert len(runs) == 2 and abs(held[0] - held[1]) <= max(sizes.values())
    assert [n for run in runs for n in run] == [n for n, _ in LLAMA_2GB]
    assert len(batches_for(LLAMA_2GB, 1)) == 1
    for slots in (3, 4, 8):  # as many batches as threads, none more than a tensor off its share
        runs = batches_for(LLAMA_2GB, slots)
        share = sum(sizes.values()) / slots
        assert len(runs) == slots
        assert all(abs(sum(sizes[n] for n in run) - share) <= max(sizes.values()) for run in runs)


def test_an_explicit_target_keeps_runs_of_that_many_bytes():
    sizes = [("a", 5), ("b", 5), ("c", 20), ("d", 1), ("e", 1), ("f", 9)]
    assert batches_for(sizes, 2, 10) == [["a", "b"], ["c"], ["d", "e", "f"]]
    assert batches_for(sizes, 2, 1) == [[k] for k, _ in sizes]
