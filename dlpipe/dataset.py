"""`open_dataset`: one format-agnostic view of a prepared dataset's split.

    ds = dlpipe.open_dataset("data/pets-lmdb", "train")
    len(ds); ds[17]                      # random access (lmdb, hdf5)
    for sample in ds: ...                # this rank's and this worker's part, in order

Iteration is split between (rank, world size) and DataLoader workers so that every sample is
read exactly once per pass across all of them: random-access formats give each consumer a
contiguous range of indices; the streaming format (wds) gives each consumer whole shards.
Readers open lazily in the process that reads, so the object is safe to hand to fork or spawn
DataLoader workers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch.utils.data

from dlpipe import storage
from dlpipe.errors import ShardCountError
from dlpipe.formats import ShardReader, get_format, require_storage
from dlpipe.manifest import Manifest, read_manifest
from dlpipe.sample import Sample

__all__ = ["MapDataset", "PreparedDataset", "StreamDataset", "open_dataset", "resolve_rank"]

Transform = Callable[[Sample], Any]


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world size): as given, else from torch.distributed, else RANK/WORLD_SIZE, else 0/1."""
    if rank is not None and world_size is not None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1} (world size {world_size})")
        return rank, world_size
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _worker() -> tuple[int, int]:
    info = torch.utils.data.get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class PreparedDataset:
    """What every format's dataset shares: the manifest, the shard readers, the splitting."""

    def __init__(
        self,
        path: str,
        manifest: Manifest,
        split: str,
        *,
        rank: int,
        world_size: int,
        transform: Transform | None,
    ) -> None:
        self.path = path
        self.manifest = manifest
        self.split = split
        self.rank, self.world_size = rank, world_size
        self.transform = transform
        fmt = get_format(manifest.format, manifest.format_version)
        info = manifest.split(split)
        fields = list(manifest.fields)
        self.readers: list[ShardReader] = [
            fmt.reader(storage.join(path, s.name), s, fields) for s in info.shards
        ]
        counts = np.asarray([s.samples for s in info.shards], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.path!r}, split={self.split!r}, "
            f"format={self.manifest.format!r}, samples={len(self)}, shards={len(self.readers)})"
        )

    def consumer(self) -> tuple[int, int]:
        """(index, count) of the reader this process is among all ranks x workers."""
        worker, workers = _worker()
        return self.rank * workers + worker, self.world_size * workers

    def _emit(self, sample: Sample) -> Any:
        return self.transform(sample) if self.transform is not None else sample

    def close(self) -> None:
        for reader in self.readers:
            reader.close()

    def __enter__(self) -> PreparedDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MapDataset(PreparedDataset, torch.utils.data.Dataset):
    """A split of a random-access format (lmdb, hdf5): ``ds[i]`` for any global index."""

    def __getitem__(self, index: int) -> Any:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"sample {index} is out of range for {n} samples")
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        return self._emit(self.readers[shard].get(index - int(self._starts[shard])))

    def __iter__(self) -> Iterator[Any]:
        consumer, consumers = self.consumer()
        n = len(self)
        start, stop = consumer * n // consumers, (consumer + 1) * n // consumers
        for shard, reader in enumerate(self.readers):
            lo, hi = int(self._starts[shard]), int(self._starts[shard + 1])
            if hi <= start or lo >= stop:
                continue
            if start <= lo and hi <= stop:
                yield from (self._emit(s) for s in reader)
            else:
                for i in range(max(lo, start), min(hi, stop)):
                    yield self._emit(reader.get(i - lo))


class StreamDataset(PreparedDataset, torch.utils.data.IterableDataset):
    """A split of a streaming format (wds): iteration only, whole shards per consumer."""

    def __getitem__(self, index: int) -> Any:
        raise TypeError(
            f"{self.manifest.format} datasets are streaming: iterate them, or convert to "
            "lmdb or hdf5 for random access"
        )

    def __iter__(self) -> Iterator[Any]:
        consumer, consumers = self.consumer()
        self.check_shard_count(consumers)
        for reader in self.readers[consumer::consumers]:
            yield from (self._emit(s) for s in reader)

    def check_shard_count(self, consumers: int) -> None:
        """Each of `consumers` readers needs a shard of its own."""
        if len(self.readers) < consumers:
            raise ShardCountError(
                f"{self.path} split {self.split!r} has {len(self.readers)} shards but "
                f"{consumers} readers share it ({self.world_size} ranks x "
                f"{consumers // self.world_size} workers); each reader needs a shard of its "
                "own. Use fewer DataLoader workers, or re-convert with a smaller --shard-size"
            )


def open_dataset(
    path: str | os.PathLike[str],
    split: str = "train",
    *,
    rank: int | None = None,
    world_size: int | None = None,
    transform: Transform | None = None,
) -> MapDataset | StreamDataset:
    """Open one split of a prepared dataset (local folder or fsspec URL).

    Args:
        path: the dataset folder, holding ``dlpipe.json``.
        split: which split to read.
        rank, world_size: this process's place among the readers of a distributed job; by
            default from ``torch.distributed`` or the ``RANK``/``WORLD_SIZE`` variables.
        transform: applied to each sample (a dict of field bytes) as it is read, e.g.
            `dlpipe.decode_sample`.

    Raises:
        ManifestNotFoundError, ManifestError: not a (finished) dataset.
        UnsupportedStorageError: an lmdb dataset given as a URL.
        KeyError: no such split (the message lists the splits).
    """
    path = os.fspath(path)
    manifest = read_manifest(path)
    fmt = get_format(manifest.format, manifest.format_version)
    require_storage(fmt, path)
    rank, world_size = resolve_rank(rank, world_size)
    cls = MapDataset if fmt.random_access else StreamDataset
    return cls(path, manifest, split, rank=rank, world_size=world_size, transform=transform)
