"""`open_dataset`: one format-agnostic view of a prepared dataset's split.

    ds = dlpipe.open_dataset("data/pets-lmdb", "train")
    len(ds); ds[17]                      # random access (lmdb, hdf5)
    for sample in ds: ...                # this rank's and this worker's part, in order

Iteration is split between (rank, world size) and DataLoader workers so that every sample is
read exactly once per pass across all of them: random-access formats give each consumer a
contiguous range of indices; the streaming format (wds) gives each rank an equal run of the
shard stream and each worker every ``workers``-th of that run's shard segments
(`dlpipe.loading.order` and `dlpipe.loading.stream_order` hold the two splits; `make_loader`
deals a stream to its workers in whole batches instead, so that no batch mixes them).
Readers open lazily in the process that reads, so the object is safe to hand to fork or spawn
DataLoader workers. A dataset at a URL is read, in every format, from the local copies of its
shard cache (`dlpipe.loading.remote`), which each reading process makes for itself; the
loader's views tell `ShardReaders` the order of the reads to come, so the cache prefetches
and evicts by it.

A prepared dataset is untrusted input and may be replaced while it is read
(``dlpipe convert --overwrite`` under a live loader). The view records which ``dlpipe.json``
it parsed; whenever a shard is opened in a process (each pass, for streaming shards) it checks,
with one stat, that this manifest is still in place, and raises `DatasetChangedError` if not
(an overwrite removes the manifest before it touches a shard, so a shard opened while the
manifest is unchanged holds what it lists). A cached remote shard was checked against the
parsed manifest's sha256 instead, and the manifest is looked at again only when a shard
cannot be had. Every sample's key is checked against the key rule
and, when the dataset has class names, its ``cls`` label against ``0..len(classes) - 1``.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Callable, Generator, Iterator, Sequence, Set
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import torch.utils.data

from dlpipe import storage
from dlpipe.errors import DlpipeError
from dlpipe.formats import ShardFormat, ShardReader, get_format
from dlpipe.loading.order import EpochSampler, reader_part
from dlpipe.loading.remote import CachedShardReader, RemoteShards
from dlpipe.loading.stream_order import Segment, StreamOrder
from dlpipe.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    is_later_version,
    parse_manifest,
    read_manifest_bytes,
)
from dlpipe.sample import Sample
from dlpipe.verify import label_problem

__all__ = [
    "CheckedReader",
    "DatasetChangedError",
    "ManifestStamp",
    "MapDataset",
    "PreparedDataset",
    "ShardReaders",
    "StreamDataset",
    "open_dataset",
    "read_manifest_stamped",
    "resolve_rank",
]

_URL_STAMP_KEYS = ("size", "ETag", "etag", "mtime", "LastModified", "created", "generation")


class DatasetChangedError(DlpipeError, RuntimeError):
    """The dataset's manifest was replaced or removed after this reader opened it."""


@dataclass(frozen=True)
class ManifestStamp:
    """Which ``dlpipe.json`` a view parsed: its file identity and the sha256 of its bytes.

    Picklable, so DataLoader workers carry it and check it in their own process.
    """

    folder: str
    identity: tuple[str, ...]
    sha256: str

    def changed(self) -> bool:
        """True when the manifest no longer holds the bytes that were parsed.

        One stat when nothing changed; the file is read again only when its identity did, so
        a touched, or byte-identical rewritten, manifest is no change, and neither is a later
        version of the dataset (``dlpipe convert --append`` rewrites no shard this view lists).
        """
        if _manifest_identity(self.folder) == self.identity:
            return False
        try:
            raw = read_manifest_bytes(self.folder)
        except DlpipeError:
            return True
        digest = hashlib.sha256(raw).hexdigest()
        return digest != self.sha256 and not is_later_version(raw, self.sha256)

    def check(self, shard: str) -> None:
        """Raise `DatasetChangedError` (naming `shard`) when the manifest changed."""
        if self.changed():
            raise DatasetChangedError(
                f"{self.folder} was replaced or removed while it was being read (its "
                f"{MANIFEST_NAME} is not the one this reader opened), so shard {shard} may "
                "hold other data; stop the readers of a dataset before converting into it "
                "again, then open it anew"
            )


def read_manifest_stamped(folder: str) -> tuple[Manifest, ManifestStamp]:
    """The manifest of `folder` (as `dlpipe.read_manifest`), plus the stamp of the file parsed."""
    for _ in range(3):  # a manifest replaced while it is read is read again
        before = _manifest_identity(folder)
        raw = read_manifest_bytes(folder)
        if _manifest_identity(folder) == before:
            stamp = ManifestStamp(folder, before, hashlib.sha256(raw).hexdigest())
            return parse_manifest(raw, storage.join(folder, MANIFEST_NAME)), stamp
    raise DatasetChangedError(
        f"{folder}: {MANIFEST_NAME} changed each time it was read; wait for the conversion "
        "writing it to finish"
    )


def _manifest_identity(folder: str) -> tuple[str, ...]:
    """What changes when the manifest is replaced: inode, size, mtime (or URL metadata)."""
    path = storage.join(folder, MANIFEST_NAME)
    if storage.is_url(path):
        import fsspec

        fs, p = fsspec.core.url_to_fs(path)
        try:
            info = fs.info(p)
        except FileNotFoundError:
            return ("missing",)
        return tuple(f"{k}={info[k]}" for k in _URL_STAMP_KEYS if k in info)
    try:
        st = os.stat(storage.local_path(path))
    except FileNotFoundError:
        return ("missing",)
    return (str(st.st_dev), str(st.st_ino), str(st.st_size), str(st.st_mtime_ns))


class CheckedReader:
    """A shard reader as the dataset view hands it out: the manifest is checked when the shard
    is opened in a process, and every sample's key and label when it is read."""

    def __init__(
        self, reader: ShardReader | CachedShardReader, stamp: ManifestStamp, num_classes: int
    ) -> None:
        self.reader, self.stamp, self.num_classes = reader, stamp, num_classes
        self._opened_in: int | None = None

    @property
    def path(self) -> str:
        return self.reader.path

    @property
    def info(self) -> ShardInfo:
        return self.reader.info

    def __len__(self) -> int:
        return len(self.reader)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_opened_in": None}

    def get(self, index: int) -> Sample:
        """Sample `index` of the shard (random-access formats)."""
        if self._opened_in != os.getpid():
            return self._open_with(lambda: self.reader.get(index), index)
        return self._checked(self.reader.get(index), index)

    def __iter__(self) -> Iterator[Sample]:
        return self._pass(iter(self.reader), itertools.count())

    def iter_from(
        self, start: int, wanted: Set[int] | None = None
    ) -> Generator[Sample, None, None]:
        """Samples from index `start` on (each call is one pass, opened anew); with `wanted`,
        only those whose index it holds (the others are not read)."""
        stream = self.reader.iter_from(start, wanted)
        if wanted is None:
            return self._pass(stream, itertools.count(start))
        return self._pass(stream, iter(sorted(i for i in wanted if i >= start)))

    def _pass(
        self, stream: Iterator[Sample], indices: Iterator[int]
    ) -> Generator[Sample, None, None]:
        """`stream`'s samples, checked, the first around the shard's opening; `indices`
        gives each one's index in the shard."""
        try:
            try:
                index = next(indices, -1)
                first = self._open_with(lambda: next(stream), index)
            except StopIteration:
                return
            yield first
            for index, sample in zip(indices, stream, strict=False):
                yield self._checked(sample, index)
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()

    def _open_with(self, read: Callable[[], Sample], index: int) -> Sample:
        """The first sample read in this process or pass, with the manifest checked around
        the shard's opening (a missing or resized shard is named a replacement if it is one).
        A cached remote shard was checked against the parsed manifest's sha256 instead, so
        its manifest is looked at only when it could not be had (no request per pass)."""
        cached = isinstance(self.reader, CachedShardReader)
        if not cached:
            self.stamp.check(self.info.name)
        try:
            sample = read()
        except DlpipeError:
            self.stamp.check(self.info.name)
            raise
        if not cached:
            self.stamp.check(self.info.name)
        self._opened_in = os.getpid()
        return self._checked(sample, index)

    def _checked(self, sample: Sample, index: int) -> Sample:
        problem = label_problem(sample, self.num_classes)
        if problem is not None:
            raise self.reader.corrupt(problem, index)
        return sample

    def close(self) -> None:
        self.reader.close()
        self._opened_in = None  # a reopened shard is checked again


class ShardReaders(Sequence[CheckedReader]):
    """A split's shard readers, each made when it is first asked for: opening a split of
    10,000 shards makes none, and reading sample ``i`` makes (and opens) only its shard's.
    A remote dataset's readers read through this process's shard cache (`remote`), told the
    order of the reads to come (`follow`, `reading`, `reading_segments`: no-ops on local
    datasets).

    Pickles without the readers made so far (a DataLoader worker makes its own).
    """

    def __init__(
        self,
        folder: str,
        manifest: Manifest,
        split: str,
        stamp: ManifestStamp,
        fmt: ShardFormat,
        remote: RemoteShards | None = None,
    ) -> None:
        self.folder, self.stamp, self.format, self.remote = folder, stamp, fmt, remote
        self.shards = manifest.split(split).shards
        self.fields, self.num_classes = list(manifest.fields_of(split)), len(manifest.classes)
        self._made: dict[int, CheckedReader] = {}

    def __len__(self) -> int:
        return len(self.shards)

    @overload
    def __getitem__(self, index: int) -> CheckedReader: ...

    @overload
    def __getitem__(self, index: slice) -> list[CheckedReader]: ...

    def __getitem__(self, index: int | slice) -> CheckedReader | list[CheckedReader]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"shard {index} is out of range for {len(self)} shards")
        reader = self._made.get(index)
        if reader is None:
            reader = self._made[index] = CheckedReader(
                self._reader(self.shards[index]), self.stamp, self.num_classes
            )
        return reader

    def _reader(self, info: ShardInfo) -> ShardReader | CachedShardReader:
        if self.remote is not None:
            return CachedShardReader(self.remote, self.format, info, self.fields)
        return self.format.reader(storage.join(self.folder, info.name), info, self.fields)

    def follow(self, sampler: EpochSampler, part: tuple[int, int] | None = None) -> None:
        """A map-style loader draws its indices from `sampler` (a remote dataset plans from
        it); `part`: where this split is among them (`RemoteShards.follow`)."""
        if self.remote is not None:
            self.remote.follow(sampler, part)

    def reading(self, epoch: int, index: int) -> None:
        """A map-style loader reads sample `index` of `epoch` next (a remote dataset plans
        the reads of this worker at the first of each epoch)."""
        if self.remote is not None:
            self.remote.plan_map(epoch, index)

    def reading_segments(self, order: StreamOrder, segments: list[Segment], epoch: int) -> None:
        """A stream reader reads `segments` of `epoch` next (a remote dataset plans them)."""
        if self.remote is not None:
            self.remote.plan_stream(order, segments, epoch)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_made": {}}

    def made(self) -> int:
        """How many readers were made in this process so far."""
        return len(self._made)

    def close(self) -> None:
        """Close every reader made (the others hold nothing), and this process's cache."""
        for reader in self._made.values():
            reader.close()
        if self.remote is not None:
            self.remote.close()


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


class PreparedDataset:
    """What every format's dataset shares: the manifest, the shard readers, the splitting."""

    def __init__(
        self,
        path: str,
        manifest: Manifest,
        split: str,
        *,
        fmt: ShardFormat,
        stamp: ManifestStamp,
        rank: int,
        world_size: int,
        transform: Transform | None,
        remote: RemoteShards | None = None,
    ) -> None:
        self.path = path
        self.manifest = manifest
        self.split = split
        self.rank, self.world_size = rank, world_size
        self.transform = transform
        self.stamp = stamp
        self.readers = ShardReaders(path, manifest, split, stamp, fmt, remote)
        self.shard_samples = [s.samples for s in manifest.split(split).shards]
        counts = np.asarray(self.shard_samples, dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.path!r}, split={self.split!r}, "
            f"format={self.manifest.format!r}, samples={len(self)}, shards={len(self.readers)})"
        )

    def _emit(self, sample: Sample) -> Any:
        return self.transform(sample) if self.transform is not None else sample

    def close(self) -> None:
        self.readers.close()

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
        consumer, consumers = reader_part(self.rank, self.world_size)
        n = len(self)
        start, stop = consumer * n // consumers, (consumer + 1) * n // consumers
        ends = self._starts[1:]
        first, last = np.searchsorted(ends, start, "right"), np.searchsorted(ends, stop, "left")
        if start < stop and self.readers.remote is not None:
            self.readers.remote.plan(range(int(first), int(last) + 1))
        for shard in range(len(self.readers)):
            lo, hi = int(self._starts[shard]), int(self._starts[shard + 1])
            if hi <= start or lo >= stop:
                continue
            reader = self.readers[shard]  # made here: shards outside the range cost nothing
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
        """This rank's run of the split in stored order, its shard segments dealt to the
        DataLoader workers in turn (`StreamOrder`); a worker without one yields nothing."""
        order = StreamOrder(
            self.shard_samples,
            rank=self.rank,
            world_size=self.world_size,
            shuffle=False,
            equal_shares=False,
        )
        segments = order.worker_segments(order.segments(0))
        if self.readers.remote is not None:
            self.readers.remote.plan([s.shard for s in segments])
        yield from (self._emit(s) for _, s in order.read(self.readers, segments, 0))


def open_dataset(
    path: str | os.PathLike[str],
    split: str = "train",
    *,
    rank: int | None = None,
    world_size: int | None = None,
    transform: Transform | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit: int | str | None = None,
    version: int | None = None,
    by_index: bool = False,
) -> MapDataset | StreamDataset:
    """Open one split of a prepared dataset (local folder or fsspec URL).

    A URL's shards, in every format, are read through a local shard cache
    (`dlpipe.loading.remote`): each is downloaded once, checked against the manifest's size
    and sha256, prefetched in the order the readers take them and evicted by next use.

    Args:
        path: the dataset folder, holding ``dlpipe.json``.
        split: which split to read.
        rank, world_size: this process's place among the readers of a distributed job; by
            default from ``torch.distributed`` or the ``RANK``/``WORLD_SIZE`` variables.
        transform: applied to each sample (a dict of field bytes) as it is read, e.g.
            `dlpipe.decode_sample`.
        cache_dir: a URL's cache: the folder holding one cache folder per dataset (default:
            ``$DLPIPE_DATA_DIR/cache``, else ``~/.cache/dlpipe/shards``). Unused for a path.
        cache_limit: the most bytes of shards the cache keeps, as bytes or ``"50GB"``
            (default: what it holds plus half the free space of its disk).
        version: read the dataset as it was at this version (each split's shards of versions
            1..`version`, `dlpipe.Manifest.at_version`); None: the latest.
        by_index: read a wds split by index too (``ds[i]``, a `MapDataset`: its shard
            readers walk each shard's member headers once, `dlpipe.formats.wds`), as a
            mixture reads its sources; lmdb and hdf5 are read by index anyway.

    Raises:
        ManifestNotFoundError, ManifestError: not a (finished) dataset.
        DatasetVersionError: the dataset has no such `version`.
        DatasetChangedError: later, when a shard is opened after the manifest was replaced.
        CacheSettingError, ShardCacheLimitError: a URL with a bad cache setting.
        ShardFetchError, CacheDiskFullError: later, when a remote shard cannot be had intact.
        KeyError: no such split (the message lists the splits).
    """
    path = os.fspath(path)
    manifest, stamp = read_manifest_stamped(path)
    if version is not None:
        manifest = manifest.at_version(version)
    fmt = get_format(manifest.format, manifest.format_version)
    rank, world_size = resolve_rank(rank, world_size)
    indexed = fmt.random_access or (by_index and fmt.reader.indexable)  # (all three are)
    cls = MapDataset if indexed else StreamDataset
    remote = None
    if storage.is_url(path):
        shards = [s for info in manifest.splits.values() for s in info.shards]
        split_shards = manifest.split(split).shards
        remote = RemoteShards(
            path, shards, split_shards, cache_dir=cache_dir, cache_limit=cache_limit
        )
    return cls(
        path,
        manifest,
        split,
        fmt=fmt,
        stamp=stamp,
        transform=transform,
        rank=rank,
        world_size=world_size,
        remote=remote,
    )
