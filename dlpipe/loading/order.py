"""The sample order of an epoch, per rank and worker: the map-style sampler and what both
orders share.

- `EpochSampler` (lmdb, hdf5: random access) draws a permutation from (seed, epoch) and deals
  it to the ranks in blocks of ``block`` samples (rank ``r`` takes blocks ``r``,
  ``r + world_size``, ...). With the block equal to the per-rank batch size, global step ``s``
  holds the permutation's ``s``-th run of ``world_size x batch`` samples whatever the world size.
  Its state is a position in the permutation counted in samples consumed *globally*, so it
  resumes on another world size, batch size or worker count: the rest of the epoch is the same
  run of samples, dealt in the new global batches.
- The streaming order (wds: whole-shard streams) is `dlpipe.loading.stream_order.StreamOrder`.

Both take a pass the same way, through one contract a loader drives (`PassOrder`, shaped
like torchdata.nodes' ``reset(state)`` / ``next()`` / ``get_state()``): each pass over an order
is one epoch; a pass begun and not finished is abandoned by the next one (the next epoch
starts, as with a DataLoader), and a loaded state is the next pass. The pass under way is a
`PassProgress`: told of each batch the caller gets, it gives the state at that batch.
`worker_part` and `reader_part` name this process's place. A `Run` is a stretch of an epoch's
stream positions; `merge_runs`, `position_runs` and the private run helpers do their
arithmetic (for the stream order and the views that send its batches).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch.utils.data

from dlpipe.loading.state import (
    SAVED_BY_DLPIPE,
    mismatch,
    require_equal,
    require_fields,
    require_int,
)

__all__ = [
    "EpochSampler",
    "PassOrder",
    "PassProgress",
    "Run",
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
