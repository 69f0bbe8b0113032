"""`EpochSampler`: a seeded, rank-aware, resumable sampler for random-access datasets.

Each pass over it is one epoch: a permutation drawn from (seed, epoch), dealt to the ranks in
blocks of ``block`` samples (rank ``r`` takes blocks ``r``, ``r + world_size``, ...). With the
block equal to the per-rank batch size, the samples of global step ``s`` are the permutation's
``s``-th run of ``world_size x batch`` samples whatever the world size: a job on 8 GPUs sees the
same batches as one process with the same global batch. With ``drop_last`` every rank gets
exactly ``n // world_size`` samples, so every rank runs the same number of steps (uneven ranks
hang DDP); without it, every sample is read exactly once, none padded or repeated (exact
evaluation). The next pass is the next epoch, with no ``set_epoch`` to forget.

It is `Stateful`: ``state_dict()`` records the epoch and how many indices were drawn, and a
loader restored from it continues with exactly the next index, without drawing the skipped
ones; a new pass without a restored state starts the next epoch, as a DataLoader does.
torchdata's ``StatefulDataLoader`` snapshots it when each batch's indices are drawn, so
prefetching does not skew the resume point.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch.utils.data

__all__ = ["EpochSampler"]


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
        self.drawn = 0
        self._restored = False

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's sample indices for `epoch`, in order."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        n, world, block = self.num_samples, self.world_size, self.block
        rounds = n // (block * world)  # whole rounds: every rank one full block
        dealt = order[: rounds * block * world].reshape(rounds, world, block)[:, self.rank]
        rest = order[rounds * block * world :]  # < one round: equal parts (drop_last) or all
        if self.drop_last:
            share = len(rest) // world
            tail = rest[self.rank * share : (self.rank + 1) * share]
        else:
            tail = rest[self.rank * block : (self.rank + 1) * block]
        return np.concatenate([dealt.reshape(-1), tail])

    def __len__(self) -> int:
        """This rank's samples per epoch, without drawing a permutation."""
        n, world, block = self.num_samples, self.world_size, self.block
        if self.drop_last:
            return n // world
        rest = n % (block * world)
        return n // (block * world) * block + min(block, max(0, rest - self.rank * block))

    def __iter__(self) -> Iterator[tuple[int, int]]:
        if self.drawn and not self._restored:  # a new pass abandons an unfinished epoch
            self.epoch, self.drawn = self.epoch + 1, 0
        self._restored = False
        epoch, indices = self.epoch, self.indices(self.epoch)
        while self.drawn < len(indices):
            index = int(indices[self.drawn])
            self.drawn += 1
            yield epoch, index
        self.epoch, self.drawn = epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "drawn": self.drawn, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(
                f"the saved loader state used seed {state['seed']}, this loader seed {self.seed}"
            )
        self.epoch, self.drawn = int(state["epoch"]), int(state["drawn"])
        self._restored = True
