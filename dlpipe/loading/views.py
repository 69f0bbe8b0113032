"""The torch datasets a `PreparedLoader` iterates, and the one way a transform is applied.

- `MapView` (lmdb, hdf5): ``view[(epoch, index)]``, the indices drawn by `EpochSampler`.
- `StreamView` (wds): each worker reads its stretch of whole batches along `StreamOrder` and
  sends them collated, each with the runs of stream positions it holds, which the loader
  counts into its state when the caller gets the batch.
- `MixView` (a mixture of lmdb/hdf5 datasets, local or at URLs,
  `dlpipe.loading.mix_sources.MixedDataset`): ``view[(epoch, code)]``, the codes drawn by
  `MixSampler`; its transform is a `MixTransform` (`tag_sources`), which maps the label onto
  the mixture's classes and appends the source.

Each way, the DataLoader yields `Piece` s (a batch and its runs; a map-style batch has none),
and `plan_view` pairs a dataset with its view, its order (`PassOrder`) and the DataLoader
options that order needs: one function per kind of dataset, in `VIEW_PLANS`.

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

from dlpipe.loading.dataset import MapDataset, PreparedDataset, StreamDataset
from dlpipe.loading.mix_sources import MixedDataset
from dlpipe.loading.mixing import SOURCE_FIELD, MixSampler
from dlpipe.loading.order import (
    EpochSampler,
    PassOrder,
    Run,
    position_runs,
    worker_part,
)
from dlpipe.loading.stream_order import StreamOrder
from dlpipe.loading.torch_private import (
    collate_tensors,
    collate_with,
    default_collate_fns,
    shared_memory_like,
)
from dlpipe.sample import KEY_FIELD, Sample

__all__ = [
    "VIEW_PLANS",
    "MapView",
    "MixTransform",
    "MixView",
    "Opened",
    "Piece",
    "PieceCollate",
    "StreamView",
    "ViewPlan",
    "apply_transform",
    "collate",
    "memory_order",
    "plan_view",
    "stack_in_memory_order",
    "tag_sources",
]


class MapView(torch.utils.data.Dataset):
    """``ds[(epoch, index)]`` → the transformed sample; the epoch seeds augmentation."""

    def __init__(self, dataset: MapDataset, transform: Callable[..., Any] | None) -> None:
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]) -> Any:
        epoch, index = item
        self.dataset.readers.reading(epoch, index)  # a remote dataset's cache plans from it
        return apply_transform(self.transform, self.dataset[index], epoch, index)


Opened = PreparedDataset | MixedDataset
"""What a loader reads: one opened split, or a mixture of several."""


class MixView(torch.utils.data.Dataset):
    """``ds[(epoch, code)]`` → a mixture's transformed sample (`MixSampler`'s code names the
    source, the sample and the draw, which seeds augmentation)."""

    def __init__(self, dataset: MixedDataset, transform: Callable[..., Any] | None) -> None:
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]) -> Any:
        epoch, code = item
        sample = self.dataset.read(code, epoch)  # a remote source's cache plans from it
        return apply_transform(self.transform, sample, epoch, code)


class MixTransform:
    """A mixture's per-sample transform: its source's transform (`inners`, one per source:
    a detection or segmentation recipe checks each source's targets against its own
    classes) with the sample's source index appended (``(image, label)`` →
    ``(image, label, source)``, ``(image, target)`` → ``(image, target, source)``; any other
    output ``x`` → ``(x, source)``), its class labels mapped onto the mixture's classes by
    `labels`: a class label, a detection target's ``labels``, a segmentation label map's
    values (those past the source's classes, such as an ignore value, kept).

    Args:
        inners: each source's transform (seeded by position or not).
        labels: per source, its label index → the mixture's; None: unchanged.
    """

    seeded_by_position = True

    def __init__(self, inners: list[Callable[..., Any]], labels: list[Any] | None) -> None:
        self.inners = inners
        self.maps = None if labels is None else [_label_map(lut) for lut in labels]

    def __call__(self, sample: Sample, epoch: int = 0, index: int = 0) -> Any:
        source = int(sample[SOURCE_FIELD])
        out = apply_transform(self.inners[source], sample, epoch, index)
        if not isinstance(out, tuple):
            return out, source
        if self.maps is not None and len(out) == 2:
            out = (out[0], _relabelled(out[1], self.maps[source]))
        return (*out, source)


def _label_map(lut: Any) -> torch.Tensor:
    """A source's label lookup table, as int64, the identity past its classes (up to 255:
    a uint8 label map's ignore value stays what it was)."""
    table = torch.arange(max(256, len(lut)), dtype=torch.int64)
    table[: len(lut)] = torch.as_tensor(lut, dtype=torch.int64)
    return table


def _relabelled(target: Any, table: torch.Tensor) -> Any:
    """`target` (a class index, a detection target, a label map) with its classes looked up
    in `table`."""
    if isinstance(target, int):
        return int(table[target]) if 0 <= target < len(table) else target
    if isinstance(target, dict) and "labels" in target:
        return {**target, "labels": table[target["labels"]]}
    if isinstance(target, torch.Tensor) and not target.is_floating_point():
        plain = target.as_subclass(torch.Tensor)
        if plain.dtype != torch.uint8 and plain.max() >= len(table):
            return plain  # values past 255 are neither classes nor looked up
        return table[plain.long()].to(plain.dtype)
    return target


def tag_sources(
    dataset: Opened, make: Callable[[PreparedDataset], Callable[..., Any] | None]
) -> Callable[..., Any] | None:
    """The transform a loader over `dataset` runs: `make` of it, or over a mixture a
    `MixTransform` of `make` of each source (raw samples, `make` giving None: the samples
    keep their ``__source__`` field instead)."""
    if not isinstance(dataset, MixedDataset):
        return make(dataset)
    inners = [make(source) for source in dataset.sources]
    if any(inner is None for inner in inners):
        return None
    return MixTransform(inners, dataset.labels)  # type: ignore[arg-type]


class Piece(NamedTuple):
    """What a loader's DataLoader yields: a collated batch and the runs of stream positions
    its samples are (the loader's state counts them when the caller gets the batch; none
    for a map-style batch)."""

    batch: Any
    runs: list[Run]


class PieceCollate:
    """A map-style DataLoader's collate: `collate`'s batch as a `Piece` with no runs."""

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, samples: list[Any]) -> Piece:
        return Piece(self.collate(samples), [])


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
        self.dataset.readers.reading_segments(self.order, segments, epoch)  # remote: plans
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
    return collate_with(batch, _COLLATE_FNS)


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
        return collate_tensors(batch, collate_fn_map)  # it names the error
    order = memory_order(first)
    if order == tuple(range(first.dim())) or any(memory_order(t) != order for t in batch):
        return collate_tensors(batch, collate_fn_map)
    permuted = [tensor.permute(order) for tensor in batch]
    out = None
    if torch.utils.data.get_worker_info() is not None:  # as collate_tensor_fn does
        out = shared_memory_like(first, (len(batch), *permuted[0].shape))
    stacked = torch.stack(permuted, 0, out=out)
    return stacked.permute(0, *(d + 1 for d in _inverse(order)))


_COLLATE_FNS = {**default_collate_fns(), torch.Tensor: stack_in_memory_order}


class ViewPlan(NamedTuple):
    """What a loader iterates: the view its DataLoader runs (of `dataset`), the order that
    passes over it and the DataLoader options they need (sampler, batching, collate)."""

    dataset: Opened
    view: torch.utils.data.Dataset[Any]
    order: PassOrder
    options: dict[str, Any]

    @property
    def identity(self) -> dict[str, Any]:
        """What a loader's state names as its data (checked before its order's fields): the
        sha256 of the manifest of the dataset version read (`Manifest.at_version`), that
        version and the split; a mixture's order names its sources itself."""
        if isinstance(self.dataset, MixedDataset):
            return self.dataset.identity()
        manifest = self.dataset.manifest
        return {
            "dataset": manifest.version_sha256 or self.dataset.stamp.sha256,
            "dataset_version": manifest.version,
            "split": self.dataset.split,
        }


Transform = Callable[..., Any] | None
Collate = Callable[[list[Any]], Any]


def _map_plan(
    dataset: MapDataset, transform: Transform, collate_fn: Collate, **placement: Any
) -> ViewPlan:
    """lmdb, hdf5: the main process draws indices (`EpochSampler`), the DataLoader batches
    them, ``batch_size`` a block."""
    block = placement.pop("batch_size")
    sampler = EpochSampler(len(dataset), block=block, **placement)
    dataset.readers.follow(sampler)  # a remote dataset's cache plans each worker's reads
    options = sampler.dataloader_options() | {"collate_fn": PieceCollate(collate_fn)}
    return ViewPlan(dataset, MapView(dataset, transform), sampler, options)


def _stream_plan(
    dataset: StreamDataset, transform: Transform, collate_fn: Collate, **placement: Any
) -> ViewPlan:
    """wds: each reader follows the `StreamOrder` and sends its own collated batches."""
    view = StreamView.build(dataset, transform, collate_fn=collate_fn, **placement)
    options = view.order.dataloader_options() | {"collate_fn": sent_as_is}
    return ViewPlan(dataset, view, view.order, options)


def sent_as_is(piece: Piece) -> Piece:
    """A reader's `Piece`, as it sent it: without a batch size the DataLoader would apply
    torch's ``default_convert``, which turns every plain tuple in it into a list (the
    ``(images, labels)`` batch too)."""
    return piece


def _mix_plan(
    dataset: MixedDataset, transform: Transform, collate_fn: Collate, **placement: Any
) -> ViewPlan:
    """Several lmdb/hdf5 sources: the main process draws the mixture's codes (`MixSampler`),
    the DataLoader batches them, ``batch_size`` a block."""
    block = placement.pop("batch_size")
    sampler = MixSampler(dataset.mixture, block=block, **placement)
    dataset.follow(sampler)  # remote sources' caches plan each worker's reads
    options = sampler.dataloader_options() | {"collate_fn": PieceCollate(collate_fn)}
    return ViewPlan(dataset, MixView(dataset, transform), sampler, options)


VIEW_PLANS: dict[type, Callable[..., ViewPlan]] = {
    MapDataset: _map_plan,
    StreamDataset: _stream_plan,
    MixedDataset: _mix_plan,
}
"""Each kind of dataset `open_dataset` makes → the function that plans its view and order."""


def plan_view(
    dataset: Opened,
    transform: Transform,
    *,
    collate_fn: Collate,
    **placement: Any,
) -> ViewPlan:
    """The view, order and DataLoader options of a loader over `dataset` (`VIEW_PLANS`).

    Args:
        dataset: an opened split.
        transform: run on each sample by the view.
        collate_fn: makes a batch of transformed samples.
        **placement: the order's ``batch_size``, ``drop_last``, ``rank``, ``world_size``,
            ``shuffle`` and ``seed``.
    """
    return VIEW_PLANS[type(dataset)](dataset, transform, collate_fn, **placement)
