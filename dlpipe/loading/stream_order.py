"""One rank's order of a streaming split (wds: whole-shard streams), and its resumable state.

`StreamOrder` shuffles the shard order per epoch, reads each shard in blocks of
`BLOCK_SAMPLES` shuffled per (seed, epoch, shard, offset), and gives rank ``r`` the ``r``-th
equal run of that stream (a rank reads whole shards, and at most two in part). Within a rank
each DataLoader worker takes a contiguous stretch of whole batches of it. The state is the runs
of stream positions given to the caller, so it resumes with any worker count; the rank ranges
depend on the world size, so another world size is refused. A `Segment` is a stretch of one
shard's epoch order, read from a `ShardSource`.

It takes a pass through the contract the map-style sampler follows too
(`dlpipe.loading.order.PassOrder`); `_StreamPass` is its pass under way.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence, Set
from typing import Any, NamedTuple, Protocol

import numpy as np

from dlpipe.errors import ShardCountError
from dlpipe.loading.order import (
    _ELASTIC_FIX,
    MAX_EPOCH,
    PassProgress,
    Run,
    _batch_count,
    _cut,
    _length,
    _permutation,
    _without,
    merge_runs,
    worker_part,
)
from dlpipe.loading.state import (
    SAVED_BY_DLPIPE,
    StateMismatchError,
    is_int,
    mismatch,
    require_equal,
    require_fields,
    require_int,
    shown,
)
from dlpipe.sample import Sample

__all__ = ["Segment", "StreamOrder"]


class Segment(NamedTuple):
    """Positions ``begin`` (inclusive) to ``end`` of shard ``shard``'s epoch order, which are
    positions ``position`` onwards of the epoch's stream."""

    shard: int
    begin: int
    end: int
    position: int


class ShardSource(Protocol):
    """What `StreamOrder` reads from: shard ``i`` streamed from a sample index."""

    def iter_from(self, start: int, wanted: Set[int] | None = None) -> Iterator[Sample]: ...


class StreamOrder:
    """One rank's order of a streaming split: equal runs of a block-shuffled shard stream.

    The epoch's stream is the shards in a seeded order, each read in blocks of
    `BLOCK_SAMPLES` consecutive samples shuffled per (seed, epoch, shard, offset). For training
    (``equal_shares``) rank ``r`` takes samples ``r * q`` to ``r * q + take`` of it, where
    ``q = total // world_size`` and ``take`` is ``q`` rounded down to whole batches: every rank
    runs the same number of full batches, known from the manifest. For evaluation the ranks
    split the stream into near-equal runs and every sample is read once.

    A pass's readers (the DataLoader's workers, or the one process) split what it reads
    (``base``: the rank's run, or what a resumed state left) into contiguous stretches of whole
    batches, one per worker in the DataLoader's round-robin order (`worker_runs`), so each
    worker batches its own samples and batch ``k`` of the pass is worker ``k % workers``'s.
    The state is ``base``, the worker count, and the runs given to the caller (``consumed``).
    Resumed with the same worker count, each worker goes on with its stretch, the workers
    rotated by the batches given so that the DataLoader's first worker is the one whose batch
    was next: the rest of the pass is the uninterrupted one, batch for batch. With another
    count, what is left becomes the new ``base``.

    Args:
        shard_sizes: samples per shard, from the manifest.
        rank, world_size: this process's part.
        shuffle: shuffle shards and blocks per epoch, else stored order.
        seed: seeds every epoch's order.
        batch_size: this rank's batch size (``take`` is a multiple of it).
        equal_shares: training (equal whole batches per rank), else every sample once.
    """

    BLOCK_SAMPLES = 256

    def __init__(
        self,
        shard_sizes: Sequence[int],
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        batch_size: int = 1,
        equal_shares: bool = True,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        if batch_size < 1:
            raise ValueError(f"batch size {batch_size} must be a positive number of samples")
        self.shard_sizes = [int(n) for n in shard_sizes]
        self.rank, self.world_size, self.shuffle, self.seed = rank, world_size, shuffle, seed
        self.batch_size, self.equal_shares = batch_size, equal_shares
        self.restarts_workers = True  # persistent workers read a copy taken at their start
        self.epoch = 0
        self.base = [self.rank_range()]  # what this pass's readers split
        self.workers = 1  # how many split it
        self.consumed: list[Run] = []  # the runs given to the caller this pass
        self.armed = True

    def rank_range(self) -> Run:
        """This rank's run ``[lo, hi)`` of the epoch's stream (the same every epoch)."""
        total, world = sum(self.shard_sizes), self.world_size
        if not self.equal_shares:
            return self.rank * total // world, (self.rank + 1) * total // world
        share = total // world
        return self.rank * share, self.rank * share + share // self.batch_size * self.batch_size

    def __len__(self) -> int:
        """This rank's samples per epoch."""
        lo, hi = self.rank_range()
        return hi - lo

    def segments(self, epoch: int, runs: Sequence[Run] | None = None) -> list[Segment]:
        """`runs` of `epoch`'s stream (default: this rank's whole run) as shard segments, in
        order."""
        out = []
        shards = _permutation(self.shuffle, self.seed, epoch, len(self.shard_sizes))
        for lo, hi in [self.rank_range()] if runs is None else runs:
            at = 0
            for shard in shards:
                size = self.shard_sizes[int(shard)]
                begin, end = max(lo, at) - at, min(hi, at + size) - at
                if begin < end:
                    out.append(Segment(int(shard), begin, end, at + begin))
                at += size
        return out

    def begin(self) -> None:
        """Fix the next pass: a loaded state, else the next epoch after one begun."""
        if not self.armed:
            self.epoch, self.base, self.consumed = self.epoch + 1, [self.rank_range()], []
        self.armed = True

    def split_for(self, workers: int) -> None:
        """The pass fixed by `begin` is read by `workers` readers: with another count than
        its state's, what is left is the new base (the round-robin of the old count is gone)."""
        if workers != self.workers:
            self.base, self.consumed = _without(self.base, self.consumed), []
            self.workers = workers

    def take(self, workers: int) -> int:
        """Start the pass on `workers` readers (`begin` and `split_for` first): its epoch."""
        self.begin()
        self.split_for(workers)
        self.armed = False
        return self.epoch

    def abandon(self) -> None:
        """The pass begun is dropped unfinished: `begin` starts the next epoch."""
        self.armed = False

    def finish(self) -> None:
        """The pass is over: the next one is the next epoch (no-op if already so)."""
        if not self.armed:
            self.begin()

    def dataloader_options(self) -> dict[str, Any]:
        """The DataLoader batches nothing: each reader sends its own whole batches."""
        return {"batch_size": None}

    def batch_count(self) -> int:
        """This rank's batches per epoch (the last one short in evaluation)."""
        return _batch_count(len(self), self.batch_size, self.equal_shares)

    def start_pass(self, readers: int) -> PassProgress:
        """`begin` the next pass and `split_for` its `readers`."""
        self.begin()
        self.split_for(readers)
        return _StreamPass(self)

    def started(self, workers: int) -> None:
        """The workers took the pass with them (`take`); with none, this process takes it
        as it reads."""
        if workers > 0:
            self.take(workers)

    def load_pass_state(self, state: dict[str, Any]) -> None:
        """`load_state_dict`: the runs a loader gave are whole batches by construction."""
        self.load_state_dict(state)

    def read(
        self, sources: Sequence[ShardSource], segments: Sequence[Segment], epoch: int
    ) -> Iterator[tuple[int, Sample]]:
        """(stream position, sample) for each of `segments`, in the epoch's block-shuffled
        order."""
        for segment in segments:
            samples = self._read(sources[segment.shard], segment, epoch)
            yield from enumerate(samples, segment.position)

    def _read(self, source: ShardSource, segment: Segment, epoch: int) -> Iterator[Sample]:
        """The segment's samples, in epoch order: each block of `BLOCK_SAMPLES` in its
        shuffled order, from one pass over the shard that reads only the segment's samples
        (a segment that begins or ends inside a block leaves the block's others unread)."""
        shard, begin, end, _ = segment
        size, step = self.shard_sizes[shard], self.BLOCK_SAMPLES
        first = begin // step * step
        blocks = []  # each block's part of the segment: shard indices in epoch order
        for offset in range(first, end, step):
            count = min(step, size - offset)
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch, shard, offset]).permutation(count)
            else:
                order = np.arange(count)
            blocks.append((order + offset)[max(begin - offset, 0) : end - offset].tolist())
        wanted = {index for block in blocks for index in block}
        # one pass per segment, from its first block: blocks are cut from the same stream
        with contextlib.closing(source.iter_from(first, wanted)) as stream:  # type: ignore[type-var]
            for block in blocks:
                read = dict(zip(sorted(block), itertools.islice(stream, len(block)), strict=True))
                yield from (read[index] for index in block)

    def worker_runs(self, worker: int | None = None) -> list[Run]:
        """What this DataLoader worker (or worker `worker` of its loader) reads of the pass
        `take` started: its stretch of whole batches of the base less the runs given. The
        stretches follow the base in worker order, their batch counts within one of each
        other, the larger first; the base's partial last batch (evaluation) goes to the
        worker whose turn it is after the full ones. A worker reads whole shards but at most
        two (and the base's last one for that partial batch), and no batch mixes two workers'
        samples."""
        this, workers = worker_part()
        worker = this if worker is None else worker
        size = self.batch_size
        total = _length(self.base)
        batches, partial = divmod(total, size)
        share, extra = divmod(batches, workers)
        slot = (worker + _length(self.consumed) // size) % workers  # its turn, as uninterrupted
        first = (slot * share + min(slot, extra)) * size
        stretch = _cut(self.base, first, first + (share + (slot < extra)) * size)
        if partial and slot == extra:
            stretch += _cut(self.base, total - partial, total)
        return _without(stretch, self.consumed)

    @staticmethod
    def worker_segments(segments: list[Segment]) -> list[Segment]:
        """This DataLoader worker's whole shard segments of `segments`: every
        ``workers``-th one (a plain stream, iterated sample by sample)."""
        worker, workers = worker_part()
        return segments[worker::workers]

    def state_at(
        self, epoch: int, base: Sequence[Run], workers: int, consumed: Sequence[Run]
    ) -> dict[str, Any]:
        """The state of pass `epoch`, read from `base` by `workers` readers, in which the
        caller was given the `consumed` runs."""
        return {
            "epoch": epoch,
            "base": [[start, stop] for start, stop in base],
            "workers": workers,
            "consumed": [[start, stop] for start, stop in merge_runs(consumed)],
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shard_sizes": list(self.shard_sizes),
            "world_size": self.world_size,
            "batch_size": self.batch_size,
        }

    def state_dict(self) -> dict[str, Any]:
        return self.state_at(self.epoch, self.base, self.workers, self.consumed)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue with the samples the caller was not given; any worker count.

        Raises:
            StateMismatchError: a field that is not what this order saves (its type, its
                range, runs out of order, overlapping, outside this rank's run or not whole
                batches), another seed, shuffle, dataset, world size or batch size.
        """
        self.epoch, self.base, self.workers, self.consumed = self._checked(state)
        self.armed = True

    def _checked(self, state: Any) -> tuple[int, list[Run], int, list[Run]]:
        """(epoch, base, workers, consumed) of a saved state, every field checked."""
        what = "stream order"
        fields = ("epoch", "seed", "shuffle", "shard_sizes", "world_size", "batch_size")
        saved = require_fields(state, fields, what)
        require_equal(saved, "seed", self.seed, what, _ELASTIC_FIX)
        require_equal(saved, "shuffle", self.shuffle, what, _ELASTIC_FIX)
        require_equal(saved, "shard_sizes", self.shard_sizes, what, "load it into the same split")
        require_equal(
            saved,
            "world_size",
            self.world_size,
            what,
            "a wds stream gives each rank its own run of the epoch's shards, so the saved "
            "position fits only the saved world size: resume on that many ranks, or "
            "convert to lmdb or hdf5, which resume on any world size",
        )
        require_equal(
            saved,
            "batch_size",
            self.batch_size,
            what,
            "each rank's samples per epoch are whole batches of the saved size: resume with it",
        )
        epoch = require_int(saved, "epoch", what, high=MAX_EPOCH)
        if "cursors" in saved and "consumed" not in saved:  # dlpipe 0.1.0: per-shard prefixes
            consumed = merge_runs(self._cursor_runs(epoch, saved["cursors"]))
            self._check_inside("consumed", consumed, [self.rank_range()])
            return epoch, [self.rank_range()], 0, consumed  # 0: any count splits anew
        require_fields(saved, ("base", "workers", "consumed"), what)
        workers = self._checked_count(saved["workers"])
        base = self._checked_runs("base", saved["base"])
        if self.equal_shares and _length(base) % self.batch_size:
            rule = f"its {_length(base)} samples must be whole batches of {self.batch_size}"
            raise mismatch(what, "base", saved["base"], rule, SAVED_BY_DLPIPE)
        consumed = self._checked_runs("consumed", saved["consumed"])
        self._check_inside("consumed", consumed, base)
        if workers and self._off_grid(base, consumed):  # (0: a 0.1.0 state, saved again)
            rule = f"the runs given to the caller must be whole batches of {self.batch_size}"
            raise mismatch(what, "consumed", saved["consumed"], rule + " of base", SAVED_BY_DLPIPE)
        return epoch, base, workers, merge_runs(consumed)

    def _cursor_runs(self, epoch: int, cursors: Any) -> list[Run]:
        """A 0.1.0 state's per-shard cursors (the first n samples of this rank's segment of
        each shard were given) as the runs of the stream they are."""
        starts = {s.shard: s.position for s in self.segments(epoch)}
        try:
            pairs = [(shard, n) for shard, n in cursors]
            if not all(is_int(shard) and is_int(n) and n >= 0 for shard, n in pairs):
                raise TypeError("not integers")
            return [(starts[int(shard)], starts[int(shard)] + int(n)) for shard, n in pairs]
        except (KeyError, TypeError, ValueError) as exc:
            problem = (
                f"the saved stream order state has cursors={shown(cursors)}, which are not "
                "this rank's shards"
            )
            raise StateMismatchError(f"{problem}; {_ELASTIC_FIX}", problem=problem) from exc

    def _checked_runs(self, name: str, value: Any) -> list[Run]:
        """A state's runs: [start, stop] pairs of integers (start <= stop; empty ones
        dropped), in order, none overlapping another, inside this rank's run."""
        problem = f"the saved stream order state has {name}={shown(value)}, not a list of "
        problem += "[start, stop] pairs of integers"
        if not isinstance(value, list | tuple) or not all(
            isinstance(run, list | tuple) and len(run) == 2 and all(map(is_int, run))
            for run in value
        ):
            raise StateMismatchError(f"{problem}; {SAVED_BY_DLPIPE}", problem=problem)
        runs = [(int(start), int(stop)) for start, stop in value]
        reversed_ = [run for run in runs if run[0] > run[1]]
        if reversed_:
            problem = f"the saved stream order state has {name} runs {reversed_} ending first"
            raise StateMismatchError(f"{problem}; {SAVED_BY_DLPIPE}", problem=problem)
        runs = [run for run in runs if run[0] < run[1]]  # (an empty rank's run is empty)
        self._check_inside(name, runs, [self.rank_range()])
        overlapping = [(a, b) for a, b in itertools.pairwise(runs) if b[0] < a[1]]
        if overlapping:
            problem = (
                f"the saved stream order state has {name} runs {overlapping[0]} out of order "
                "or overlapping"
            )
            raise StateMismatchError(f"{problem}; {SAVED_BY_DLPIPE}", problem=problem)
        return runs

    def _check_inside(self, name: str, runs: list[Run], within: list[Run]) -> None:
        """Every run of `runs` is a run of positions in `within`."""
        lo, hi = self.rank_range()
        where = f"this rank's samples [{lo}, {hi})" if within == [(lo, hi)] else "base"
        outside = [run for run in runs if _without([run], within)]
        if outside:
            problem = f"the saved stream order state has {name} runs {outside} outside {where}"
            raise StateMismatchError(f"{problem}; {SAVED_BY_DLPIPE}", problem=problem)

    def _off_grid(self, base: list[Run], consumed: list[Run]) -> bool:
        """Whether `consumed` is not whole batches of `base` (each batch of a pass is
        ``batch_size`` consecutive samples along it, the last one short in evaluation)."""
        size, total, at = self.batch_size, _length(base), 0
        spans = []  # the consumed positions as offsets along the base
        for start, stop in base:
            for lo, hi in consumed:
                if max(lo, start) < min(hi, stop):
                    spans.append((at + max(lo, start) - start, at + min(hi, stop) - start))
            at += stop - start
        return any(a % size or (b % size and b != total) for a, b in merge_runs(spans))

    @staticmethod
    def _checked_count(value: Any) -> int:
        if not is_int(value) or not 0 <= value <= MAX_EPOCH:
            problem = f"the saved stream order state has workers={shown(value)}, not a worker count"
            raise StateMismatchError(f"{problem}; {SAVED_BY_DLPIPE}", problem=problem)
        return int(value)

    def check_ranks(self, path: str, split: str) -> None:
        """Every rank needs at least one sample per epoch (training)."""
        if self.equal_shares and len(self) == 0:
            raise ShardCountError(
                f"{path} split {split!r} has {sum(self.shard_sizes)} samples, fewer than one "
                f"batch of {self.batch_size} for each of {self.world_size} ranks; use a "
                "smaller batch size or fewer ranks"
            )


class _StreamPass:
    """A pass of a `StreamOrder` as the caller gets it: the runs of each batch given."""

    def __init__(self, order: StreamOrder) -> None:
        self.order, self.epoch, self.base = order, order.epoch, order.base
        self.workers, self.consumed = order.workers, order.consumed

    def given(self, runs: Sequence[Run]) -> None:
        if runs:
            self.consumed = merge_runs([*self.consumed, *runs])

    def state(self) -> dict[str, Any]:
        return self.order.state_at(self.epoch, self.base, self.workers, self.consumed)
