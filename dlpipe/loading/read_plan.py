"""The shard reads of all of a rank's DataLoader workers, merged in the order they happen:
the plan a remote dataset's cache ranks eviction by (`RemoteShards.plan_map`, `plan_stream`).

The workers read in parallel: map-style, worker ``w`` reads batches ``w``, ``w + workers``, ...
of the rank's order, one batch a round; streaming, each worker reads its own stretch of the
rank's stream. Either way a worker's ``i``-th sample is read at about the time every other
worker reads its ``i``-th, so the rank's order is the workers' uses merged by that count, ties
in worker order. Workers drift apart by up to a few batches (each keeps its prefetch factor
of batches ready), so each reader's plan places the other workers' uses `lag` samples later
than its own: a worker behind this one still has its next shards ahead in this one's plan,
not behind its cursor as done with. A pass ends before the next begins: each pass is merged
on its own, and the passes follow each other. Every worker computes the merged order from the
deterministic sampler or stream order, so each process's cache keeps the shards the others
read next instead of evicting them as never used again.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["Uses", "merged", "runs_of"]

Uses = tuple[np.ndarray, np.ndarray]
"""One worker's shard uses in a pass: (the count of samples it read before each use, the shard
of each use)."""


def runs_of(times: np.ndarray, shards: np.ndarray) -> Uses:
    """A worker's reads (the sample count at each read, its shard) as uses: each run of reads
    of one shard is one use, at the run's first read."""
    shards = np.asarray(shards, dtype=np.int64)
    starts = np.ones(len(shards), dtype=bool)
    starts[1:] = shards[1:] != shards[:-1]
    return np.asarray(times, dtype=np.int64)[starts], shards[starts]


def merged(
    passes: Sequence[Sequence[Uses]], reader: int, limit: int, lag: int = 0
) -> tuple[list[int], list[int]]:
    """The shards of `passes` (each pass: every worker's uses, in worker order) in the order
    the workers read them as worker `reader` plans (the others' `lag` samples later), at most
    `limit` uses, and the positions that are `reader`'s."""
    order: list[int] = []
    mine: list[int] = []
    for uses in passes:
        times = np.concatenate([t for t, _ in uses] or [np.zeros(0, np.int64)])
        shards = np.concatenate([s for _, s in uses] or [np.zeros(0, np.int64)])
        owners = np.repeat(np.arange(len(uses)), [len(t) for t, _ in uses])
        by_time = np.lexsort((owners, times + lag * (owners != reader)))[: limit - len(order)]
        mine += (len(order) + np.flatnonzero(owners[by_time] == reader)).tolist()
        order += shards[by_time].tolist()
    return order, mine
