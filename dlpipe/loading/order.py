"""The sample order of an epoch, per rank and worker, and its resumable state.

One module decides which samples a reader takes and in what order, for both kinds of format:

- `EpochSampler` (lmdb, hdf5: random access) draws a permutation from (seed, epoch) and deals
  it to the ranks in blocks of ``block`` samples (rank ``r`` takes blocks ``r``,
  ``r + world_size``, ...). With the block equal to the per-rank batch size, global step ``s``
  holds the permutation's ``s``-th run of ``world_size x batch`` samples whatever the world size.
  Its state is a position in the permutation counted in samples consumed *globally*, so it
  resumes on another world size, batch size or worker count: the rest of the epoch is the same
  run of samples, dealt in the new global batches.
- `StreamOrder` (wds: whole-shard streams) shuffles the shard order per epoch, reads each shard
  in blocks of `BLOCK_SAMPLES` shuffled per (seed, epoch, shard, offset), and gives rank ``r``
  the ``r``-th equal run of that stream (a rank reads whole shards, and at most two in part).
  Within a rank each DataLoader worker takes a contiguous stretch of whole batches of it. The
  state is the runs of stream positions given to the caller, so it resumes with any worker
  count; the rank ranges depend on the world size, so another world size is refused.

Both take a pass the same way: each pass over an order is one epoch; a pass begun and not
finished is abandoned by the next one (the next epoch starts, as with a DataLoader), and a
loaded state is the next pass. `worker_part` and `reader_part` name this process's place.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence, Set
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch.utils.data

from dlpipe.errors import ShardCountError
from dlpipe.loading.state import StateMismatchError, require_equal, require_fields
from dlpipe.sample import Sample

__all__ = [
    "EpochSampler",
    "Run",
    "Segment",
    "StreamOrder",
    "merge_runs",
    "position_runs",
    "reader_part",
    "worker_part",
]

_ELASTIC_FIX = "make the loader with the seed and shuffle of the run that saved it"


def worker_part() -> tuple[int, int]:
    """(worker id, worker count) of this process in its DataLoader; (0, 1) outside workers."""
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def reader_part(rank: int, world_size: int) -> tuple[int, int]:
    """(index, count) of this reader among all ranks x workers."""
    worker, workers = worker_part()
    return rank * workers + worker, world_size * workers


def _permutation(shuffle: bool, seed: int, epoch: int, count: int) -> np.ndarray:
    if shuffle:
        return np.random.default_rng([seed, epoch]).permutation(count)
    return np.arange(count)


class EpochSampler(torch.utils.data.Sampler[tuple[int, int]]):
    """Yields ``(epoch, index)`` pairs: the epoch lets the dataset seed per-sample augmentation.

    Args:
        num_samples: the dataset's length.
        rank, world_size: this process's part.
        shuffle: a new seeded permutation each epoch, else index order.
        seed: seeds every epoch's permutation.
        drop_last: equal parts per rank (drop the remainder), else every sample once.
        block: consecutive samples dealt to a rank at a time (its batch size keeps global
            batches independent of the world size).
    """

    def __init__(
        self,
        num_samples: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        block: int = 1,
    ) -> None:
        if block < 1:
            raise ValueError(f"block {block} must be a positive number of samples")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        if drop_last and num_samples < world_size:
            raise ValueError(
                f"{num_samples} samples cannot give each of {world_size} ranks one; "
                "use a larger split or fewer ranks"
            )
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.block = block
        self.epoch = 0
        self.start = 0  # samples of this epoch's permutation consumed (globally) before the pass
        self.drawn = 0  # this rank's indices drawn in this pass
        self.armed = True  # the next pass is (epoch, start, drawn) as they are

    def indices(self, epoch: int, start: int = 0) -> np.ndarray:
        """This rank's sample indices for `epoch`, in order, after `start` global samples."""
        order = _permutation(self.shuffle, self.seed, epoch, self.num_samples)[start:]
        world, block = self.world_size, self.block
        rounds = len(order) // (block * world)  # whole rounds: every rank one full block
        dealt = order[: rounds * block * world].reshape(rounds, world, block)[:, self.rank]
        rest = order[rounds * block * world :]  # < one round: equal parts (drop_last) or all
        if self.drop_last:
            share = len(rest) // world
            tail = rest[self.rank * share : (self.rank + 1) * share]
        else:
            tail = rest[self.rank * block : (self.rank + 1) * block]
        return np.concatenate([dealt.reshape(-1), tail])

    def __len__(self) -> int:
        """This rank's samples per (whole) epoch, without drawing a permutation."""
        n, world, block = self.num_samples, self.world_size, self.block
        if self.drop_last:
            return n // world
        rest = n % (block * world)
        return n // (block * world) * block + min(block, max(0, rest - self.rank * block))

    def begin(self) -> None:
        """Fix the next pass: a loaded state, else the next epoch after one begun."""
        if not self.armed:
            self.epoch, self.start, self.drawn = self.epoch + 1, 0, 0
        self.armed = True

    def abandon(self) -> None:
        """The pass begun is dropped unfinished: `begin` starts the next epoch."""
        self.armed = False

    def finish(self) -> None:
        """The pass is over: the next one is the next epoch (no-op if already so)."""
        if not self.armed:
            self.epoch, self.start, self.drawn, self.armed = self.epoch + 1, 0, 0, True

    def remaining(self) -> int:
        """This rank's indices left in the pass `begin` fixed."""
        return len(self.indices(self.epoch, self.start)) - self.drawn

    def __iter__(self) -> Iterator[tuple[int, int]]:
        self.begin()
        self.armed = False
        epoch, indices = self.epoch, self.indices(self.epoch, self.start)
        while self.drawn < len(indices):
            index = int(indices[self.drawn])
            self.drawn += 1
            yield epoch, index
        self.finish()

    def state_at(self, epoch: int, start: int, drawn: int) -> dict[str, Any]:
        """The state after this rank drew `drawn` indices of the pass (`epoch`, `start`).

        ``samples`` counts whole rounds (every rank one block) consumed globally; ``partial``
        the indices of this rank's next block already drawn (0 at every batch boundary).
        """
        whole, partial = divmod(drawn, self.block)
        return {
            "epoch": epoch,
            "samples": start + whole * self.block * self.world_size,
            "partial": partial,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
            "block": self.block,
        }

    def state_dict(self) -> dict[str, Any]:
        return self.state_at(self.epoch, self.start, self.drawn)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved position: with any world size, block or worker count at a
        batch boundary (``partial`` 0), else with the saved ones.

        Raises:
            StateMismatchError: another seed, shuffle or dataset length, or a mid-batch state
                loaded with another world size or block.
        """
        fields = ("epoch", "samples", "partial", "seed", "shuffle", "num_samples")
        state = dict(require_fields(state, (*fields, "world_size", "block"), "sampler"))
        require_equal(state, "seed", self.seed, "sampler", _ELASTIC_FIX)
        require_equal(state, "shuffle", self.shuffle, "sampler", _ELASTIC_FIX)
        require_equal(
            state, "num_samples", self.num_samples, "sampler", "load it into the same split"
        )
        if state["partial"] and (state["world_size"], state["block"]) != (
            self.world_size,
            self.block,
        ):
            raise StateMismatchError(
                f"the saved sampler state stopped {state['partial']} samples into a batch "
                f"(partial={state['partial']}); it resumes only with the saved world_size="
                f"{state['world_size']} and block={state['block']}: save at a batch boundary"
            )
        self.epoch, self.start = int(state["epoch"]), int(state["samples"])
        self.drawn, self.armed = int(state["partial"]), True


Run = tuple[int, int]
"""Positions ``[start, stop)`` of an epoch's stream."""


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


def merge_runs(runs: Iterator[Run] | Sequence[Run]) -> list[Run]:
    """`runs` (pairs, as tuples or lists) sorted, with touching and overlapping ones joined."""
    merged: list[Run] = []
    for start, stop in sorted((int(start), int(stop)) for start, stop in runs):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def position_runs(positions: Sequence[int]) -> list[Run]:
    """Stream positions (in the order read) as runs of consecutive ones."""
    runs: list[Run] = []
    for position in positions:
        if runs and runs[-1][1] == position:
            runs[-1] = (runs[-1][0], position + 1)
        else:
            runs.append((position, position + 1))
    return runs


def _cut(runs: Sequence[Run], first: int, last: int) -> list[Run]:
    """The samples `first` to `last` (counted along `runs`) of `runs`, as runs."""
    out, at = [], 0
    for start, stop in runs:
        lo, hi = max(first - at, 0), min(last - at, stop - start)
        if lo < hi:
            out.append((start + lo, start + hi))
        at += stop - start
    return out


def _without(runs: Sequence[Run], taken: Sequence[Run]) -> list[Run]:
    """`runs` (in their order) less the positions in `taken`."""
    out = []
    holes = merge_runs(taken)
    for start, stop in runs:
        at = start
        for hole_start, hole_stop in holes:
            if hole_stop <= at or hole_start >= stop:
                continue
            if hole_start > at:
                out.append((at, hole_start))
            at = max(at, hole_stop)
        if at < stop:
            out.append((at, stop))
    return out


def _length(runs: Sequence[Run]) -> int:
    return sum(stop - start for start, stop in runs)


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

    def worker_runs(self) -> list[Run]:
        """What this DataLoader worker reads of the pass `take` started: its stretch of whole
        batches of the base less the runs given. The stretches follow the base in worker
        order, their batch counts within one of each other, the larger first; the base's
        partial last batch (evaluation) goes to the worker whose turn it is after the full
        ones. A worker reads whole shards but at most two (and the base's last one for that
        partial batch), and no batch mixes two workers' samples."""
        worker, workers = worker_part()
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
            StateMismatchError: another seed, shuffle, dataset, world size or batch size, or
                consumed runs outside this rank's run.
        """
        fields = ("epoch", "seed", "shuffle", "shard_sizes", "world_size", "batch_size")
        state = dict(require_fields(state, fields, "stream order"))
        require_equal(state, "seed", self.seed, "stream order", _ELASTIC_FIX)
        require_equal(state, "shuffle", self.shuffle, "stream order", _ELASTIC_FIX)
        state["shard_sizes"] = list(state["shard_sizes"])
        require_equal(
            state, "shard_sizes", self.shard_sizes, "stream order", "load it into the same split"
        )
        require_equal(
            state,
            "world_size",
            self.world_size,
            "stream order",
            "a wds stream gives each rank its own run of the epoch's shards, so the saved "
            "position fits only the saved world size: resume on that many ranks, or "
            "convert to lmdb or hdf5, which resume on any world size",
        )
        require_equal(
            state,
            "batch_size",
            self.batch_size,
            "stream order",
            "each rank's samples per epoch are whole batches of the saved size: resume with it",
        )
        epoch = int(state["epoch"])
        if "cursors" in state and "consumed" not in state:  # dlpipe 0.1.0: per-shard prefixes
            state |= {"base": [self.rank_range()], "workers": 0}
            state["consumed"] = self._cursor_runs(epoch, state["cursors"])
        state = dict(require_fields(state, ("base", "workers", "consumed"), "stream order"))
        self.epoch, self.workers = epoch, self._checked_count(state["workers"])
        self.base = self._checked_runs("base", state["base"])
        pairs = zip(self.base, self.base[1:], strict=False)  # each run and the next
        overlapping = [(a, b) for a, b in pairs if b[0] < a[1]]
        if overlapping:
            raise StateMismatchError(
                f"the saved stream order state has base runs {overlapping[0]} out of order or "
                "overlapping; load a state saved by this loader"
            )
        self.consumed = merge_runs(self._checked_runs("consumed", state["consumed"]))
        self.armed = True

    def _cursor_runs(self, epoch: int, cursors: Any) -> list[Run]:
        """A 0.1.0 state's per-shard cursors (the first n samples of this rank's segment of
        each shard were given) as the runs of the stream they are."""
        starts = {s.shard: s.position for s in self.segments(epoch)}
        try:
            return [(starts[int(shard)], starts[int(shard)] + int(n)) for shard, n in cursors]
        except (KeyError, TypeError, ValueError) as exc:
            raise StateMismatchError(
                f"the saved stream order state has cursors={cursors!r}, which are not this "
                f"rank's shards; {_ELASTIC_FIX}"
            ) from exc

    def _checked_runs(self, name: str, value: Any) -> list[Run]:
        """A state's runs: [start, stop] pairs inside this rank's run."""
        lo, hi = self.rank_range()
        try:
            runs = [(int(start), int(stop)) for start, stop in value]
        except (TypeError, ValueError) as exc:
            raise StateMismatchError(
                f"the saved stream order state has {name}={value!r}, not a list of "
                "[start, stop] pairs; load a state saved by this loader"
            ) from exc
        outside = [run for run in runs if not lo <= run[0] < run[1] <= hi]
        if outside:
            raise StateMismatchError(
                f"the saved stream order state has {name} runs {outside} outside this rank's "
                f"samples [{lo}, {hi}); load a state saved by this rank of this loader"
            )
        return runs

    @staticmethod
    def _checked_count(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise StateMismatchError(
                f"the saved stream order state has workers={value!r}, not a worker count; "
                "load a state saved by this loader"
            )
        return value

    def check_ranks(self, path: str, split: str) -> None:
        """Every rank needs at least one sample per epoch (training)."""
        if self.equal_shares and len(self) == 0:
            raise ShardCountError(
                f"{path} split {split!r} has {sum(self.shard_sizes)} samples, fewer than one "
                f"batch of {self.batch_size} for each of {self.world_size} ranks; use a "
                "smaller batch size or fewer ranks"
            )
