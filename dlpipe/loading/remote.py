"""Remote datasets read through the shard cache: where it lives, how large it is, and the
shard readers that read its local, verified copies.

``open_dataset(url, split)`` (and so ``make_loader`` and ``dlpipe train``) reads every format,
lmdb included, through `dlpipe.shard_cache.ShardCache`: a shard reader is handed the local path
of a shard the cache downloaded and checked against the manifest's size and sha256.

- **Where**: ``cache_dir`` holds one folder per dataset, named by the sha256 of its URL, so
  datasets never share shard names. Default: ``$DLPIPE_DATA_DIR/cache`` when the variable is
  set (the data disk), else the user cache (``$XDG_CACHE_HOME/dlpipe/shards``, else
  ``~/.cache/dlpipe/shards``). The folder survives the run: a resumed run starts on warm shards.
- **How large**: ``cache_limit`` in bytes or as ``"50GB"`` / ``"64MiB"`` (`parse_size`, the
  rule of ``convert --shard-size``). Default: the bytes this dataset's cache holds already plus
  half the free space of its disk when the dataset is opened
  (`dlpipe.shard_store.DEFAULT_FREE_SHARE`).
- **One cache per process**: each process that reads (the loader's process, or each DataLoader
  worker) makes its own `ShardCache` at its first read, after any fork, so no thread, lock or
  descriptor crosses a fork; the processes of a node share the folder (the store locks it).
- **In read order**: the loading room tells the cache the shards the rank's DataLoader
  workers read next, this epoch and the next, merged in the order they read them, and which
  of those reads are this process's (`RemoteShards.plan_map`, `plan_stream`,
  `dlpipe.loading.read_plan`): each process prefetches its own, and evicts by every worker's
  next use, so the workers keep shards for each other. It releases each shard when done. A
  process keeps shards open (held: never evicted) as local readers do, all of them when the
  dataset fits in the limit, else at most `HELD_SHARE` of the limit per reader of the node.
"""

from __future__ import annotations

import copy
import os
from collections import OrderedDict
from collections.abc import Generator, Iterator, Sequence, Set
from typing import Any, Literal

import numpy as np

from dlpipe import storage
from dlpipe.errors import ShardCorruptError
from dlpipe.formats import ShardFormat, ShardReader
from dlpipe.loading.order import EpochSampler, worker_part
from dlpipe.loading.read_plan import Uses, merged, runs_of
from dlpipe.loading.stream_order import Segment, StreamOrder
from dlpipe.manifest import ShardInfo
from dlpipe.sample import Sample
from dlpipe.shard_cache import BELADY, CacheStats, ShardCache, ShardCacheLimitError
from dlpipe.shard_store import cache_folder, cache_limit_bytes

__all__ = ["HELD_SHARE", "CachedShardReader", "RemoteShards", "share_limit"]

HELD_SHARE = 0.25
"""With a dataset larger than the limit, the share of the limit one reader of the node keeps
open (the rest is for prefetch and for shards kept for their next use)."""
MAX_PLAN = 1 << 18
"""The most shard uses one plan lists (two epochs of a huge split are cut there)."""
_NO_USES: Uses = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
SKEW_BATCHES = 2
"""How many batches one DataLoader worker may read ahead of another (torch's default prefetch
factor): a plan counts the other workers' reads that far behind this one's as still to come."""
POLICY: Literal["belady", "lru"] = BELADY
"""The eviction rule of the caches made here (LRU only for comparison, in benchmarks)."""


class RemoteShards:
    """One split's shards of a remote dataset as this process reads them through its cache.

    Picklable: a DataLoader worker gets the settings and makes its own `ShardCache` at its
    first read (never one made before a fork).

    Args:
        url: the dataset folder's URL.
        shards: every shard the manifest lists (all splits: they share the folder).
        split_shards: this split's shards, in order.
        cache_dir, cache_limit: as `open_dataset` takes them (see the module docstring).

    Raises:
        CacheSettingError: a bad `cache_dir` or `cache_limit`.
        ShardCacheLimitError: a limit smaller than the largest shard.
    """

    def __init__(
        self,
        url: str,
        shards: Sequence[ShardInfo],
        split_shards: Sequence[ShardInfo],
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
    ) -> None:
        self.url, self.shards = url.rstrip("/"), list(shards)
        self.split_shards = list(split_shards)
        self.folder = cache_folder(url, cache_dir)
        counts = np.asarray([s.samples for s in self.split_shards], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        self.limit(cache_limit_bytes(cache_limit, self.folder))
        self._sampler: EpochSampler | None = None
        self._part = (0, int(self._starts[-1]))  # the sampler's indices: (offset, modulus)
        self._reset()

    @property
    def bytes(self) -> int:
        """The dataset's shard bytes (every split)."""
        return sum(s.bytes for s in self.shards)

    def limit(self, limit_bytes: int) -> None:
        """Keep at most `limit_bytes` of this dataset's shards (a mixture shares its limit out).

        Raises:
            ShardCacheLimitError: a limit smaller than the largest shard.
        """
        largest = max((s.bytes for s in self.shards), default=0)
        if limit_bytes < largest:
            raise ShardCacheLimitError(
                f"cache_limit of {limit_bytes} bytes is smaller than the largest shard of "
                f"{self.url} ({largest} bytes); raise cache_limit to at least a few shards"
            )
        self.limit_bytes, self._fits = limit_bytes, self.bytes <= limit_bytes

    def _reset(self) -> None:
        self._cache: ShardCache | None = None
        self._pid: int | None = None
        self._open: OrderedDict[str, CachedShardReader] = OrderedDict()
        self._planned: int | None = None  # the epoch the map plan was made for

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_cache=None, _pid=None, _open=OrderedDict(), _planned=None)
        return state

    def cache(self) -> ShardCache:
        """This process's cache, made at its first use here."""
        if self._cache is None or self._pid != os.getpid():
            self._reset()
            self._cache = ShardCache(
                self.url,
                self.folder,
                self.limit_bytes,
                self.shards,
                policy=POLICY,
                readers=_node_readers(),
            )
            self._pid = os.getpid()
        return self._cache

    def stats(self) -> CacheStats:
        """What this process's cache did so far."""
        return self.cache().stats()

    # --- holding shards -------------------------------------------------------------------

    def hold(self, reader: CachedShardReader) -> str:
        """Take `reader`'s shard from the cache (downloaded and verified if needed) and keep
        it open; the local path. First closes the least recently used open readers that would
        pass this process's share of the limit with it."""
        name = reader.info.name
        budget = float("inf") if self._fits else self._held_budget() - reader.info.bytes
        while self._open and sum(r.info.bytes for r in self._open.values()) > budget:
            next(iter(self._open.values())).close()
        path = self.cache().get(name)
        self._open[name] = reader
        return path

    def touch(self, reader: CachedShardReader) -> None:
        """`reader`'s open shard was read again: the most recently used, and the plan moves."""
        self._open.move_to_end(reader.info.name)
        if self._cache is not None:
            self._cache.used(reader.info.name)

    def let_go(self, reader: CachedShardReader) -> None:
        """`reader` closed its shard: give it back to the cache."""
        name = reader.info.name
        if self._open.get(name) is reader and self._pid == os.getpid():
            del self._open[name]
            if self._cache is not None:
                self._cache.release(name)

    def _held_budget(self) -> float:
        return self.limit_bytes * HELD_SHARE / _node_readers()

    def close(self) -> None:
        """Close the open shards and this process's cache (downloads in flight finish)."""
        if self._pid != os.getpid():
            self._reset()
            return
        for reader in list(self._open.values()):
            reader.close()
        if self._cache is not None:
            self._cache.close()
        self._reset()

    # --- the plan ---------------------------------------------------------------------------

    def plan(self, shards: Sequence[int]) -> None:
        """The split's shards (indices) this process reads next, in order."""
        names = [self.split_shards[i].name for i in _collapsed(shards)[:MAX_PLAN]]
        self.cache().plan(names)

    def follow(self, sampler: EpochSampler, part: tuple[int, int] | None = None) -> None:
        """Plan a map-style loader's reads from `sampler` (see `plan_map`). `part`: where
        this split's samples are among the sampler's indices, ``(offset, modulus)``: index
        ``i`` is sample ``i % modulus - offset`` when that is in range, else another
        source's (a mixture's codes); default: the indices are the samples."""
        self._sampler = sampler
        if part is not None:
            self._part = part

    def plan_map(self, epoch: int, index: int) -> None:
        """A map-style loader reads sample `index` of `epoch`: at the first of an epoch in this
        process, plan the rank's batches of the rest of the epoch and of the next one, as its
        workers read them (the DataLoader deals batch ``k`` of a pass to worker
        ``k % workers``; `dlpipe.loading.read_plan`)."""
        if self._sampler is None or (self._planned == epoch and self._pid == os.getpid()):
            return
        sampler, (worker, workers) = self._sampler, worker_part()
        now, at = self._pass_order(sampler, epoch, index)
        block = sampler.block
        if at is None:  # plan this read, then the next pass
            ahead = [
                self._uses(np.asarray([index])) if w == worker else _NO_USES for w in range(workers)
            ]
        else:  # worker w reads batch first + w of this worker's round, then every workers-th
            first = at // block - worker
            ahead = [
                self._uses(_batches(now, block, max(first + w, 0), workers)) for w in range(workers)
            ]
        following = sampler.indices(epoch + 1, 0)
        after = [self._uses(_batches(following, block, w, workers)) for w in range(workers)]
        self._plan_merged([ahead, after], worker, block)
        self._planned = epoch

    def _uses(self, indices: np.ndarray) -> Uses:
        """One worker's sampler `indices`, in order, as uses of this split's shards: the
        samples of this split among them (see `follow`) timed by their place in `indices`."""
        offset, modulus = self._part
        local = np.asarray(indices, dtype=np.int64) % modulus - offset
        kept = np.flatnonzero((local >= 0) & (local < self._starts[-1]))
        shards = np.searchsorted(self._starts, local[kept], side="right") - 1
        return runs_of(kept, shards)

    def _plan_merged(self, passes: Sequence[Sequence[Uses]], worker: int, batch: int) -> None:
        order, mine = merged(passes, worker, MAX_PLAN, lag=SKEW_BATCHES * batch)
        self.cache().plan([self.split_shards[i].name for i in order], mine)

    @staticmethod
    def _pass_order(sampler: EpochSampler, epoch: int, index: int) -> tuple[np.ndarray, int | None]:
        """This rank's indices of `epoch`'s pass and where `index` is in them (None: not
        found, a sampler copy older than a loaded state)."""
        starts = [sampler.start, 0] if sampler.epoch == epoch and sampler.start else [0]
        for start in starts:
            order = sampler.indices(epoch, start)
            found = np.flatnonzero(order == index)
            if found.size:
                return order, int(found[0])
        return order, None

    def plan_stream(self, order: StreamOrder, segments: Sequence[Segment], epoch: int) -> None:
        """A stream reader reads `segments` of `epoch`: plan the shards of every worker's
        segments of this pass, then of the next epoch, as the workers read them (each its own
        stretch, all at once; `dlpipe.loading.read_plan`)."""
        worker, workers = worker_part()
        fresh = copy.copy(order)
        fresh.base, fresh.consumed = [order.rank_range()], []
        ahead = [
            _segment_uses(segments if w == worker else order.segments(epoch, order.worker_runs(w)))
            for w in range(workers)
        ]
        after = [
            _segment_uses(fresh.segments(epoch + 1, fresh.worker_runs(w))) for w in range(workers)
        ]
        self._plan_merged([ahead, after], worker, order.batch_size)


def share_limit(remotes: Sequence[RemoteShards], cache_limit: int | str | None) -> None:
    """Share one cache limit out among a mixture's remote sources, each its part in
    proportion to its shard bytes: `cache_limit` as given, or (None) the default of the first
    source's cache folder (what it holds plus half its disk's free space), so a mixture keeps
    no more than one dataset would.

    Raises:
        CacheSettingError: a bad `cache_limit`.
        ShardCacheLimitError: a source's part smaller than its largest shard (named).
    """
    if len(remotes) < 2:
        return
    total = cache_limit_bytes(cache_limit, remotes[0].folder)
    size = sum(r.bytes for r in remotes) or 1
    for remote in remotes:
        part = total * remote.bytes // size
        try:
            remote.limit(part)
        except ShardCacheLimitError as exc:
            raise ShardCacheLimitError(
                f"the mixture's cache_limit of {total} bytes, shared out by dataset size, "
                f"leaves {remote.url} {part} bytes: {exc}"
            ) from None


def _node_readers() -> int:
    """The processes of this node reading at once: this loader's workers (or this process)
    times the local ranks (``LOCAL_WORLD_SIZE``, as torchrun sets it)."""
    local_ranks = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return worker_part()[1] * (int(local_ranks) if local_ranks.isdigit() else 1) or 1


def _segment_uses(segments: Sequence[Segment]) -> Uses:
    """A stream worker's `segments` as uses, timed by the samples read before each."""
    lengths = [s.end - s.begin for s in segments]
    times = np.concatenate([[0], np.cumsum(lengths)])[:-1]
    return runs_of(times, np.asarray([s.shard for s in segments], dtype=np.int64))


def _batches(indices: np.ndarray, block: int, first: int, step: int) -> np.ndarray:
    """Batches ``first``, ``first + step``, ... of `block` of `indices`, end to end."""
    parts = [indices[b : b + block] for b in range(first * block, len(indices), step * block)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _collapsed(shards: Sequence[int]) -> list[int]:
    """`shards` with each run of one shard read as one use."""
    out: list[int] = []
    for shard in shards:
        if not out or out[-1] != shard:
            out.append(int(shard))
    return out


class CachedShardReader:
    """A remote shard read from the cache's local copy by the format's own reader, made on
    the verified file when the shard is first read in a process and kept (what it learnt of
    the shard stays valid: every copy has the manifest's sha256); its file is closed and the
    shard given back when `RemoteShards` lets it go, and after each pass of a streaming one."""

    def __init__(
        self, remote: RemoteShards, fmt: ShardFormat, info: ShardInfo, fields: Sequence[str]
    ) -> None:
        self.remote, self.format, self.info, self.fields = remote, fmt, info, list(fields)
        self.path = storage.join(remote.url, info.name)
        self._reader: ShardReader | None = None
        self._pid: int | None = None
        self._held = False  # this process holds the shard in the cache

    def __len__(self) -> int:
        return self.info.samples

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_reader": None, "_pid": None, "_held": False}

    def _local(self) -> ShardReader:
        if self._pid != os.getpid():  # a copy made before a fork holds nothing here
            self._reader, self._pid, self._held = None, os.getpid(), False
        if self._held and self._reader is not None:
            self.remote.touch(self)
            return self._reader
        local = self.remote.hold(self)
        self._held = True
        if self._reader is None:
            self._reader = self.format.reader(local, self.info, self.fields)
        return self._reader

    def get(self, index: int) -> Sample:
        """Sample `index` of the shard (random-access formats)."""
        return self._local().get(index)

    def __iter__(self) -> Iterator[Sample]:
        return self.iter_from(0)

    def iter_from(
        self, start: int, wanted: Set[int] | None = None
    ) -> Generator[Sample, None, None]:
        """Samples from `start` on (only `wanted` ones, if given), read from the cached copy."""
        try:
            yield from self._local().iter_from(start, wanted)
        finally:
            if not self.format.random_access:
                self.close()

    def corrupt(self, message: str, index: int | None = None) -> ShardCorruptError:
        """A `ShardCorruptError` naming this shard's URL (and the sample index, when known)."""
        where = f"shard {self.path}" + (f", sample {index}" if index is not None else "")
        return ShardCorruptError(
            f"{where}: {message}; run `dlpipe verify` on the dataset and re-convert it"
        )

    def close(self) -> None:
        """Close the local file and give the shard back to the cache."""
        if self._held and self._pid == os.getpid():
            if self._reader is not None:
                self._reader.close()
            self._held = False
            self.remote.let_go(self)
