"""`make_loader`: a prepared dataset as a resumable ``StatefulDataLoader`` of uint8 batches.

    loader = dlpipe.make_loader("data/pets-lmdb", "train", batch_size=256)
    for images, labels in loader:          # uint8 (N, 3, 224, 224), int64 (N,)
        x = dlpipe.normalize(images, "cuda")
    state = loader.state_dict()            # mid-epoch; a new loader's load_state_dict resumes

Random-access formats (lmdb, hdf5) go through `EpochSampler`: seeded per epoch, exact per rank,
resumable without re-reading skipped samples. The streaming format (wds) gives each rank and
worker whole shards (`dlpipe.dataset.StreamDataset`).

Worker settings: explicit ``num_workers=``, ``prefetch_factor=``, ``pin_memory=`` win; otherwise
a sensible default (all cores but one, prefetch 2, pinned memory when CUDA is there). Tuned
profiles from ``dlpipe bench-loader`` are the next step.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.data
from torchdata.stateful_dataloader import StatefulDataLoader

from dlpipe.dataset import MapDataset, PreparedDataset, StreamDataset, open_dataset
from dlpipe.sample import KEY_FIELD, Sample
from dlpipe.sampler import EpochSampler
from dlpipe.transforms import ImageTransform, image_field

__all__ = ["make_loader"]

SampleFn = Callable[[Sample], Any]


class _MapView(torch.utils.data.Dataset):
    """``ds[(epoch, index)]`` → the transformed sample; the epoch seeds augmentation."""

    def __init__(self, dataset: MapDataset, transform: Callable[..., Any] | None) -> None:
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]) -> Any:
        epoch, index = item
        return _apply(self.transform, self.dataset[index], epoch, index)


class _StreamView(torch.utils.data.IterableDataset):
    """Each pass is an epoch; samples are seeded by their key."""

    def __init__(self, dataset: StreamDataset, transform: Callable[..., Any] | None) -> None:
        self.dataset, self.transform = dataset, transform
        self.epoch = 0

    def __iter__(self) -> Iterator[Any]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        for sample in self.dataset:
            index = zlib.crc32(str(sample[KEY_FIELD]).encode())
            yield _apply(self.transform, sample, epoch, index)


def _apply(transform: Callable[..., Any] | None, sample: Sample, epoch: int, index: int) -> Any:
    if transform is None:
        return sample
    if isinstance(transform, ImageTransform):
        return transform(sample, epoch, index)
    return transform(sample)


def _collate(batch: list[Any]) -> Any:
    if batch and isinstance(batch[0], dict):
        return batch  # raw samples: a list of dicts
    return torch.utils.data.default_collate(batch)


def _resolve_transform(
    transform: str | SampleFn | None, dataset: PreparedDataset, image_size: int, seed: int
) -> Callable[..., Any] | None:
    if transform is None or callable(transform):
        return transform
    return ImageTransform(transform, image_size, image_field(list(dataset.manifest.fields)), seed)


def make_loader(
    path: str | os.PathLike[str],
    split: str = "train",
    batch_size: int = 64,
    *,
    transform: str | SampleFn | None = "auto",
    image_size: int = 224,
    shuffle: bool | None = None,
    seed: int = 0,
    drop_last: bool | None = None,
    num_workers: int | None = None,
    prefetch_factor: int | None = None,
    pin_memory: bool | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> StatefulDataLoader:
    """A ``StatefulDataLoader`` over one split of a prepared dataset (any format).

    Args:
        path, split: the dataset and split.
        batch_size: samples per batch on this rank.
        transform: ``"train"`` (RandomResizedCrop + flip), ``"eval"`` (resize + centre crop),
            None (raw sample dicts, batched as lists), or a callable on a sample dict. The
            default, ``"auto"``, is ``"train"`` for the train split and ``"eval"`` otherwise.
        image_size: the crop side of the image transforms.
        shuffle, drop_last: default True for the train split, False otherwise.
        seed: seeds the epoch permutations and augmentation.
        num_workers, prefetch_factor, pin_memory: DataLoader worker settings.
        rank, world_size: this process's part (default: torch.distributed or RANK/WORLD_SIZE).
    """
    train = split == "train"
    shuffle = train if shuffle is None else shuffle
    drop_last = train if drop_last is None else drop_last
    dataset = open_dataset(path, split, rank=rank, world_size=world_size)
    if transform == "auto":
        transform = "train" if train else "eval"
    fn = _resolve_transform(transform, dataset, image_size, seed)
    workers = max(1, (os.cpu_count() or 1) - 1) if num_workers is None else num_workers
    options: dict[str, Any] = {
        "batch_size": batch_size,
        "num_workers": workers,
        "pin_memory": torch.cuda.is_available() if pin_memory is None else pin_memory,
        "collate_fn": _collate,
        "drop_last": drop_last,
        "persistent_workers": workers > 0,
    }
    if workers > 0:
        options["prefetch_factor"] = prefetch_factor or 2
    if isinstance(dataset, MapDataset):
        sampler = EpochSampler(
            len(dataset),
            rank=dataset.rank,
            world_size=dataset.world_size,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        return StatefulDataLoader(_MapView(dataset, fn), sampler=sampler, **options)
    assert isinstance(dataset, StreamDataset)
    return StatefulDataLoader(_StreamView(dataset, fn), **options)
