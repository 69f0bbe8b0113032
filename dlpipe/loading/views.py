"""The torch datasets a `PreparedLoader` iterates, and the one way a transform is applied.

- `MapView` (lmdb, hdf5): ``view[(epoch, index)]``, the indices drawn by `EpochSampler`.
- `StreamView` (wds): each worker reads its stretch of whole batches along `StreamOrder` and
  sends them collated (`Piece`), each with the runs of stream positions it holds, which the
  loader counts into its state when the caller gets the batch.

`apply_transform` gives an `ImageTransform` (and the thread engine's `Deferred`) the epoch and
index that seed its augmentation, so a resumed loader crops a sample as the uninterrupted one
did.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.utils.data
from torch.utils.data._utils.collate import (  # the registry default_collate documents
    collate as collate_with,
)
from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map

from dlpipe.loading.dataset import MapDataset, StreamDataset
from dlpipe.loading.order import Run, StreamOrder, position_runs, worker_part
from dlpipe.sample import KEY_FIELD, Sample

__all__ = [
    "MapView",
    "Piece",
    "StreamView",
    "apply_transform",
    "collate",
    "memory_order",
    "stack_in_memory_order",
]


class MapView(torch.utils.data.Dataset):
    """``ds[(epoch, index)]`` → the transformed sample; the epoch seeds augmentation."""

    def __init__(self, dataset: MapDataset, transform: Callable[..., Any] | None) -> None:
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]) -> Any:
        epoch, index = item
        return apply_transform(self.transform, self.dataset[index], epoch, index)


class Piece(NamedTuple):
    """What a stream worker sends: a collated batch and the runs of stream positions its
    samples are (the loader's state counts them when the caller gets the batch)."""

    batch: Any
    runs: list[Run]


class StreamView(torch.utils.data.IterableDataset):
    """A streaming split read per worker along `StreamOrder`, batched in the worker."""

    def __init__(
        self,
        dataset: StreamDataset,
        transform: Callable[..., Any] | None,
        order: StreamOrder,
        collate: Callable[[list[Any]], Any],
    ) -> None:
        self.dataset, self.transform, self.order, self.collate = dataset, transform, order, collate

    @classmethod
    def build(
        cls,
        dataset: StreamDataset,
        transform: Callable[..., Any] | None,
        *,
        batch_size: int,
        drop_last: bool,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        **placement: Any,
    ) -> StreamView:
        """The view of `dataset` for this rank (``drop_last``: equal whole batches per rank);
        `placement` is the order's rank, world size, shuffle and seed; `collate_fn` (default
        `collate`) makes a worker's full batches."""
        sizes = [s.samples for s in dataset.manifest.split(dataset.split).shards]
        order = StreamOrder(sizes, batch_size=batch_size, equal_shares=drop_last, **placement)
        order.check_ranks(dataset.path, dataset.split)
        return cls(dataset, transform, order, collate_fn or collate)

    def __iter__(self) -> Iterator[Piece]:
        epoch = self.order.take(worker_part()[1])
        segments = self.order.segments(epoch, self.order.worker_runs())
        size = self.order.batch_size
        batch: list[Any] = []
        positions: list[int] = []
        for position, sample in self.order.read(self.dataset.readers, segments, epoch):
            index = zlib.crc32(str(sample[KEY_FIELD]).encode())
            batch.append(apply_transform(self.transform, sample, epoch, index))
            positions.append(position)
            if len(batch) == size:
                yield Piece(self.collate(batch), position_runs(positions))
                batch, positions = [], []
        if batch:  # the last worker's end of an evaluation pass
            yield Piece(self.collate(batch), position_runs(positions))
        self.order.finish()


def apply_transform(
    transform: Callable[..., Any] | None, sample: Sample, epoch: int, index: int
) -> Any:
    """`transform` on `sample`; one ``seeded_by_position`` (an `ImageTransform`, or one
    deferred to the thread engine) also gets the (epoch, index) that seed its augmentation."""
    if transform is None:
        return sample
    if getattr(transform, "seeded_by_position", False):
        return transform(sample, epoch, index)
    return transform(sample)


def collate(batch: list[Any]) -> Any:
    """Raw samples as a list of dicts; anything else as torch's default_collate collates it,
    except that tensors stored in the same memory order are stacked in that order
    (`stack_in_memory_order`): channels-last train crops make a channels-last batch."""
    if batch and isinstance(batch[0], dict):
        return batch  # raw samples: a list of dicts
    return collate_with(batch, collate_fn_map=_COLLATE_FNS)


def memory_order(tensor: torch.Tensor) -> tuple[int, ...]:
    """The permutation of `tensor`'s dimensions that lists them as its memory holds them
    (outermost first): ``tensor.permute(order)`` is contiguous when `tensor` is dense. A
    channels-last (3, H, W) image gives (1, 2, 0); a contiguous tensor, the identity."""
    strides = tensor.stride()
    return tuple(sorted(range(tensor.dim()), key=lambda d: (-strides[d], d)))


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(order.index(d) for d in range(len(order)))


def stack_in_memory_order(
    batch: list[torch.Tensor], *, collate_fn_map: dict[Any, Any] | None = None
) -> torch.Tensor:
    """Tensors stacked along a new first dimension, as torch's default_collate stacks them
    (into a shared-memory segment inside a DataLoader worker), but keeping the samples'
    memory order when they all share one: the stack then copies rows as they lie, where
    stacking into the standard order would transpose every sample."""
    first = batch[0]
    if first.layout != torch.strided or first.is_nested or first.device.type != "cpu":
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)  # it names the error
    order = memory_order(first)
    if order == tuple(range(first.dim())) or any(memory_order(t) != order for t in batch):
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    permuted = [tensor.permute(order) for tensor in batch]
    out = None
    if torch.utils.data.get_worker_info() is not None:  # as collate_tensor_fn does
        storage = first._typed_storage()._new_shared(len(batch) * first.numel())
        out = first.new(storage).resize_(len(batch), *permuted[0].shape)
    stacked = torch.stack(permuted, 0, out=out)
    return stacked.permute(0, *(d + 1 for d in _inverse(order)))


_COLLATE_FNS = {**default_collate_fn_map, torch.Tensor: stack_in_memory_order}
