"""Batches sized by bytes: the units a step is mapped over when it runs on several workers.

A batch is a run of consecutive items (tensors in name order, a step's objects) whose sizes add up
to about a target; an item larger than the target is a batch of its own. Consecutive runs keep
each batch's reads local (one tensor's chunks, one prefix) and make the split a function of the
items and the target only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

K = TypeVar("K")

MIN_BATCH_BYTES = 64 << 20  # smaller batches cost more in task overhead than they gain in balance
BATCHES_PER_SLOT = 4  # a few batches per worker thread: items differ in size, so one each balances badly


def target_bytes(total: int, slots: int, minimum: int = MIN_BATCH_BYTES) -> int:
    """The target bytes per batch for ``total`` bytes over ``slots`` worker threads."""
    return max(minimum, -(-total // max(1, slots * BATCHES_PER_SLOT)))


def batches_for(sizes: Iterable[tuple[K, int]], slots: int, target: int | None = None) -> list[list[K]]:
    """``sizes`` cut into runs of ``target`` bytes (default: ``target_bytes`` of their total for
    ``slots`` worker threads): what a step mapped on workers splits its items into."""
    sizes = list(sizes)
    return byte_batches(sizes, target or target_bytes(sum(n for _, n in sizes), slots))


def byte_batches(sizes: Iterable[tuple[K, int]], target: int) -> list[list[K]]:
    """``(item, nbytes)`` pairs, in their order, cut into runs of about ``target`` bytes: a new run
    starts once the current one holds ``target`` bytes or more."""
    runs: list[list[K]] = []
    size = 0
    for item, nbytes in sizes:
        if not runs or size >= target:
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += nbytes
    return runs
