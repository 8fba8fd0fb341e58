"""Batches sized by bytes: the units a step is mapped over when it runs on several workers.

A batch is a run of consecutive items (tensors in name order, a step's objects). Consecutive runs
keep each batch's reads local (one tensor's chunks, one prefix) and make the split a function of
the items and the slots (or an explicit target) only.

How many batches, by default (``batch_count``), is set by what a mapped task costs: each is a
Prefect task run, about 0.1-0.15 s of API calls on its worker (0.3 s for a worker's first), where
plain Dask costs 3 ms (``make bench-workers``, docs/bench-workers). One batch per worker thread
pays that cost once per thread; splitting a thread's share further only pays off where each piece
is large enough that its task cost stays a small part of its work (``SPLIT_BYTES``: about 1.5 s of
encoding on one core at 0.7 GB/s, against 0.15 s per task), and then buys balance (a thread that
finishes early takes the next batch). The batches of the default split hold near-equal bytes
(``even_batches``: each item goes to the batch its middle byte falls in), so the last one is not a
small remainder that leaves the other threads idle at the end.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

K = TypeVar("K")

MIN_BATCH_BYTES = 64 << 20  # smaller batches cost more in task overhead than they gain in balance
SPLIT_BYTES = 1 << 30  # a thread's share is split into more batches only in pieces at least this large
BATCHES_PER_SLOT = 4  # at most this many batches per worker thread


def batch_count(total: int, slots: int) -> int:
    """How many batches ``total`` bytes are split into for ``slots`` worker threads: one per thread,
    more (up to ``BATCHES_PER_SLOT`` per thread) only where each still holds ``SPLIT_BYTES``, fewer
    where a batch would hold less than ``MIN_BATCH_BYTES``; 1 at least."""
    slots = max(1, slots)
    per_slot = min(BATCHES_PER_SLOT, max(1, total // slots // SPLIT_BYTES))
    return max(1, min(slots * per_slot, total // MIN_BATCH_BYTES))


def target_bytes(total: int, slots: int) -> int:
    """The bytes per batch of the default split of ``total`` bytes over ``slots`` worker threads."""
    return max(1, -(-total // batch_count(total, slots)))


def batches_for(sizes: Iterable[tuple[K, int]], slots: int, target: int | None = None) -> list[list[K]]:
    """``sizes`` cut into consecutive runs: ``batch_count`` runs of near-equal bytes for ``slots``
    worker threads (``even_batches``), or runs of ``target`` bytes each where one is given
    (``byte_batches``): what a step mapped on workers splits its items into."""
    sizes = list(sizes)
    if target:
        return byte_batches(sizes, target)
    return even_batches(sizes, batch_count(sum(n for _, n in sizes), slots))


def even_batches(sizes: Iterable[tuple[K, int]], count: int) -> list[list[K]]:
    """``(item, nbytes)`` pairs, in their order, cut into at most ``count`` runs of near-equal bytes:
    an item goes to the run its middle byte falls in (run i holds the bytes from i/count to
    (i+1)/count of the total), so a run is within half an item of its share at either end. Fewer
    runs where an item is larger than a share (no run is empty)."""
    sizes = list(sizes)
    total, count = sum(n for _, n in sizes), max(1, count)
    runs: list[list[K]] = []
    last, before = -1, 0
    for item, nbytes in sizes:
        # run of the item's middle byte: floor((before + nbytes / 2) * count / total), in integers
        at = min(count - 1, (2 * before + nbytes) * count // (2 * total)) if total else 0
        if at != last:
            runs.append([])
            last = at
        runs[-1].append(item)
        before += nbytes
    return runs


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
