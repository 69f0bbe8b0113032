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

Both take a pass the same way, through one contract a loader drives (`PassOrder`, shaped
like torchdata.nodes' ``reset(state)`` / ``next()`` / ``get_state()``): each pass over an order
is one epoch; a pass begun and not finished is abandoned by the next one (the next epoch
starts, as with a DataLoader), and a loaded state is the next pass. The pass under way is a
`PassProgress`: told of each batch the caller gets, it gives the state at that batch.
`worker_part` and `reader_part` name this process's place.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence, Set
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch.utils.data

from dlpipe.errors import ShardCountError
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

__all__ = [
    "EpochSampler",
    "PassOrder",
    "PassProgress",
    "Run",
    "Segment",
    "StreamOrder",
    "merge_runs",
    "position_runs",
    "reader_part",
    "worker_part",
]

_ELASTIC_FIX = "make the loader with the seed and shuffle of the run that saved it"
MAX_EPOCH = 2**31 - 1  # no run reaches it: a larger epoch is damage, not a position


def worker_part() -> tuple[int, int]:
    """(worker id, worker count) of this process in its DataLoader; (0, 1) outside workers."""
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def reader_part(rank: int, world_size: int) -> tuple[int, int]:
    """(index, count) of this reader among all ranks x workers."""
    worker, workers = worker_part()
    return rank * workers + worker, world_size * workers


Run = tuple[int, int]
"""Positions ``[start, stop)`` of an epoch's stream."""


class PassProgress(Protocol):
    """A pass under way, as its caller sees it (the torchdata ``get_state()`` side)."""

    def given(self, runs: Sequence[Run]) -> None:
        """One more batch reached the caller; `runs`: the stream positions it holds (none
        for a map-style order, which counts whole batches)."""

    def state(self) -> dict[str, Any]:
        """The order's state after the batches given (what `PassOrder.load_pass_state`
        takes)."""


@runtime_checkable
class PassOrder(Protocol):
    """One pass contract for both sample orders (`EpochSampler`, `StreamOrder`), as a loader
    drives them: `start_pass` is torchdata.nodes' ``reset(state)`` (to the loaded state, else
    the next epoch), the DataLoader's batches are its ``next()``, and the returned
    `PassProgress` gives ``get_state()`` at each batch the caller got.

    Attributes:
        epoch: the epoch of the pass begun, or of the next one.
        restarts_workers: whether persistent workers must restart for a loaded state to take
            effect (they read a copy of the order taken when they started).
    """

    epoch: int
    restarts_workers: bool

    def dataloader_options(self) -> dict[str, Any]:
        """The DataLoader options that pass over this order (its sampler and batching)."""

    def batch_count(self) -> int:
        """The batches this rank yields in a whole epoch (a loader's ``len``)."""

    def start_pass(self, readers: int) -> PassProgress:
        """Fix the next pass (a loaded state, else the next epoch after one begun), to be
        read by `readers` readers (the DataLoader's workers, or this process)."""

    def started(self, workers: int) -> None:
        """The DataLoader made its iterator; `workers` worker processes (0: none) took a copy
        of the pass `start_pass` fixed."""

    def abandon(self) -> None:
        """The pass begun is dropped unfinished: `start_pass` starts the next epoch."""

    def finish(self) -> None:
        """The pass is over: the next one is the next epoch (no-op if already so)."""

    def state_dict(self) -> dict[str, Any]:
        """The state between passes."""

    def load_pass_state(self, state: dict[str, Any]) -> None:
        """Make a loader's saved state (whole batches given) the next pass, every field
        checked before anything changes.

        Raises:
            StateMismatchError: a field that is not a position of this order (named).
        """


def _batch_count(samples: int, batch_size: int, drop_last: bool) -> int:
    """Batches of `batch_size` in `samples`: whole ones only with `drop_last`."""
    return samples // batch_size if drop_last else -(-samples // batch_size)


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
        self.restarts_workers = False  # it draws in this process: workers hold no position
        self.epoch = 0
        self.start = 0  # samples of this epoch's permutation consumed (globally) before the pass
        self.drawn = 0  # this rank's indices drawn in this pass
        self.armed = True  # the next pass is (epoch, start, drawn) as they are

    def indices(self, epoch: int, start: int = 0) -> np.ndarray:
        """This rank's sample indices for `epoch`, in order, after `start` global samples."""
        order = self.epoch_order(epoch, start)
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

    def epoch_order(self, epoch: int, start: int) -> np.ndarray:
        """Positions `start` onwards of `epoch`'s global sequence of indices (a subclass
        deals another sequence: `dlpipe.loading.mixing.MixSampler`)."""
        return _permutation(self.shuffle, self.seed, epoch, self.num_samples)[start:]

    def next_epoch(self) -> None:
        """Move to the start of the next epoch."""
        self.epoch, self.start, self.drawn = self.epoch + 1, 0, 0

    def __len__(self) -> int:
        """This rank's samples per (whole) epoch, without drawing a permutation."""
        return self._count(self.num_samples)

    def _count(self, left: int) -> int:
        """This rank's indices of a pass over the permutation's last `left` samples."""
        world, block = self.world_size, self.block
        rounds, rest = divmod(left, block * world)
        if self.drop_last:
            return rounds * block + rest // world
        return rounds * block + min(block, max(0, rest - self.rank * block))

    def begin(self) -> None:
        """Fix the next pass: a loaded state, else the next epoch after one begun."""
        if not self.armed:
            self.next_epoch()
        self.armed = True

    def abandon(self) -> None:
        """The pass begun is dropped unfinished: `begin` starts the next epoch."""
        self.armed = False

    def finish(self) -> None:
        """The pass is over: the next one is the next epoch (no-op if already so)."""
        if not self.armed:
            self.next_epoch()
            self.armed = True

    def remaining(self) -> int:
        """This rank's indices left in the pass `begin` fixed."""
        return len(self.indices(self.epoch, self.start)) - self.drawn

    def dataloader_options(self) -> dict[str, Any]:
        """The DataLoader draws from this sampler, ``block`` samples to a batch."""
        return {"sampler": self, "batch_size": self.block, "drop_last": self.drop_last}

    def batch_count(self) -> int:
        """This rank's batches of ``block`` per (whole) epoch."""
        return _batch_count(len(self), self.block, self.drop_last)

    def start_pass(self, readers: int) -> PassProgress:
        """`begin` the next pass (any number of `readers`: the indices are drawn here)."""
        self.begin()
        return _SamplerPass(self)

    def started(self, workers: int) -> None:
        """Nothing to note: the sampler stays in this process and draws the pass itself."""

    def load_pass_state(self, state: dict[str, Any]) -> None:
        """`load_state_dict` of a loader's state: at a batch boundary or the pass's end."""
        self.load_state_dict(state, batches=True)

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

    def load_state_dict(self, state: dict[str, Any], *, batches: bool = False) -> None:
        """Continue at the saved position: with any world size, block or worker count at a
        batch boundary (``partial`` 0), else with the saved ones.

        Args:
            state: a `state_dict`.
            batches: the state is a loader's, which counts whole batches of ``block``: it is
                at a batch boundary or at the end of the pass.

        Raises:
            StateMismatchError: a field that is not what this sampler saves (its type, its
                range, the batch grid), another seed, shuffle or dataset length, or a
                mid-batch state loaded with another world size or block.
        """
        self.epoch, self.start, self.drawn = self._checked(state, batches)
        self.armed = True

    def _checked(self, state: Any, batches: bool) -> tuple[int, int, int]:
        """(epoch, samples, partial) of a saved state, every field checked."""
        what = "sampler"
        fields = ("epoch", "samples", "partial", "seed", "shuffle", "num_samples")
        saved = require_fields(state, (*fields, "world_size", "block"), what)
        require_equal(saved, "seed", self.seed, what, _ELASTIC_FIX)
        require_equal(saved, "shuffle", self.shuffle, what, _ELASTIC_FIX)
        require_equal(saved, "num_samples", self.num_samples, what, "load it into the same split")
        world = require_int(saved, "world_size", what, low=1)
        block = require_int(saved, "block", what, low=1)
        epoch = require_int(saved, "epoch", what, high=MAX_EPOCH)
        samples = require_int(saved, "samples", what, high=self.num_samples)
        partial = require_int(saved, "partial", what, high=block - 1)
        if partial and (world, block) != (self.world_size, self.block):
            rule = (
                f"a state {partial} samples into a batch resumes only with the saved "
                f"world_size={world} and block={block}"
            )
            raise mismatch(what, "partial", partial, rule, "save at a batch boundary")
        left = self._count(self.num_samples - samples)
        if partial > left:
            rule = f"this rank has {left} samples left after samples={samples}"
            raise mismatch(what, "partial", partial, rule, SAVED_BY_DLPIPE)
        if batches and partial not in (0, left):
            rule = (
                f"a loader's position is whole batches of {block} or the end of the pass "
                f"({left} samples)"
            )
            raise mismatch("loader", "partial", partial, rule, SAVED_BY_DLPIPE)
        return epoch, samples, partial


class _SamplerPass:
    """A pass of an `EpochSampler` as the caller gets it: batches of ``block`` indices."""

    def __init__(self, sampler: EpochSampler) -> None:
        self.sampler, self.epoch = sampler, sampler.epoch
        self.start, self.drawn, self.left = sampler.start, sampler.drawn, sampler.remaining()
        self.batches = 0

    def given(self, runs: Sequence[Run]) -> None:
        self.batches += 1

    def state(self) -> dict[str, Any]:
        drawn = self.drawn + min(self.batches * self.sampler.block, self.left)
        return self.sampler.state_at(self.epoch, self.start, drawn)


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
