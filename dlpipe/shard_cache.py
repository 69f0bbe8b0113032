"""The order-aware shard cache: remote shards read through a size-limited local folder.

A reader (one DataLoader worker, or a rank's main process) tells the cache the shards its
rank's readers will read next, in the order they read them in time, and which of those reads
are its own (`ShardCache.plan`), then takes each one (`get`: a local path, blocking until the
shard is there and verified) and gives it back (`release`). Knowing the order, the cache does
what LitData's ``max_cache_size`` and Mosaic streaming's ``cache_limit`` cannot:

- **prefetch in read order**: a bounded pool of download threads fetches this reader's next
  shards of the plan, as far ahead as the prefetch-depth rule (`ShardCache.prefetch_depth`)
  asks and never further than fits under `cache_limit_bytes` without evicting a shard needed
  sooner;
- **evict by next use** (Belady's rule): the cached shard whose next use by any of the rank's
  readers is furthest away, or never comes, goes first, so the workers keep shards for each
  other; never a shard that any process on the node is reading (`LRU`, the least recently
  used first, exists for comparison only).

Every download is checked against the manifest's size and sha256 before anything reads it
(`dlpipe.shard_fetch`); processes of one node share one folder, one download per shard, and a
cache survives restarts (`dlpipe.shard_store`). Other processes' downloads in flight are not
counted against the limit, so the folder can pass it by at most their in-flight shards.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from dlpipe.errors import DlpipeError
from dlpipe.manifest import ShardInfo
from dlpipe.shard_fetch import (
    CacheDiskFullError,
    RetryPolicy,
    ShardFetchError,
    download_verified,
)
from dlpipe.shard_plan import BELADY, LRU, ShardPlan, pick_victim
from dlpipe.shard_store import CacheFolderError, ShardStore

__all__ = [
    "BELADY",
    "LRU",
    "CacheDiskFullError",
    "CacheFolderError",
    "CacheStats",
    "RetryPolicy",
    "ShardCache",
    "ShardCacheLimitError",
    "ShardFetchError",
]

_SMOOTHING = 0.3  # weight of the newest measurement in the moving averages
_LOCK_RETRY_S = 0.02  # a download waits this long between tries of a shard's busy lock


class ShardCacheLimitError(DlpipeError, ValueError):
    """The cache limit cannot hold the shards that must be on disk at once."""


@dataclass(frozen=True)
class CacheStats:
    """What one `ShardCache` did: `gets` calls, `hits` (the shard was on disk, verified,
    when `get` asked for it: the read waited for no download, whoever made it, a prefetch
    that landed in time included), downloads, their bytes, and evictions. Downloads per
    read (``downloads / gets``) measures eviction alone: a prefetched shard is a hit but
    a download."""

    gets: int = 0
    hits: int = 0
    downloads: int = 0
    downloaded_bytes: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.gets if self.gets else 0.0


class ShardCache:
    """Remote shards of one dataset read through a local folder of at most
    `cache_limit_bytes` (see the module docstring).

    Args:
        url_root: the dataset folder (an fsspec URL such as ``s3://bucket/data``, or a path).
        cache_dir: the local folder of the cache; give each dataset its own.
        cache_limit_bytes: the most bytes of shards the folder holds.
        manifest_shards: the dataset's shards (name, bytes, sha256) as the manifest lists them.
        policy: ``"belady"`` (evict the shard needed furthest ahead) or ``"lru"``.
        threads: download threads (the most downloads in flight).
        prefetch: None: prefetch as deep as `prefetch_depth`'s rule says; a number: that many
            shards ahead (0: download only what `get` asks for).
        retry: how failed downloads are retried.
        storage_options: fsspec options for the storage (timeouts, endpoint, retries).
        readers: how many processes of the node read through this folder at once (the
            DataLoader workers of every local rank): each keeps its prefetch window to
            ``1 / readers`` of half the limit.

    Raises:
        ShardCacheLimitError: the limit is smaller than the largest shard.
        CacheFolderError: `cache_dir` holds a foreign file under a shard's name.
    """

    def __init__(
        self,
        url_root: str,
        cache_dir: str,
        cache_limit_bytes: int,
        manifest_shards: Sequence[ShardInfo],
        *,
        policy: Literal["belady", "lru"] = BELADY,
        threads: int = 4,
        prefetch: int | None = None,
        retry: RetryPolicy | None = None,
        storage_options: Mapping[str, Any] | None = None,
        readers: int = 1,
    ) -> None:
        shards = _checked_shards(manifest_shards, cache_limit_bytes, policy, threads)
        self._readers = max(1, readers)
        if prefetch is not None and prefetch < 0:
            raise ValueError(f"prefetch={prefetch}: give None (measured) or a count >= 0")
        self._prefetch = prefetch
        self.url_root, self.cache_limit_bytes, self.policy = url_root, cache_limit_bytes, policy
        self._retry, self._options = retry or RetryPolicy(), dict(storage_options or {})
        self._store = ShardStore(cache_dir, shards)
        self._store.recover()
        self._threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dlpipe-shard-fetch")
        self._changed = threading.Condition()
        self._plan = ShardPlan()
        self._inflight: dict[str, Future[bool]] = {}
        self._users: Counter[str] = Counter()
        self._getting: Counter[str] = Counter()
        self._use_fds: dict[str, int] = {}
        self._failed: set[str] = set()  # prefetches that failed: only a `get` tries again
        self._stats = CacheStats()
        self._fetch_s: float | None = None
        self._use_s: float | None = None
        self._got_at: float | None = None
        self._closed = False

    # --- the public calls --------------------------------------------------------------------

    def plan(self, order: Sequence[str], mine: Sequence[int] | None = None) -> None:
        """Set the shards read next, in order (repeats allowed: plan two epochs at once, so
        the end of one is not evicted for lack of a future). `mine`: the positions of `order`
        this process reads, when `order` is every reader's of the node merged in time (the
        others' uses rank eviction; this process prefetches and moves through its own);
        None: all of them.

        Raises:
            ValueError: a name that is not one of the manifest's shards, or a position of
                `mine` outside `order`.
        """
        for name in order:
            self._require_known(name)
        outside = [p for p in mine or () if not 0 <= p < len(order)]
        if outside:
            raise ValueError(
                f"mine has position {outside[0]}, outside the order's {len(order)} uses; "
                "give positions of order (0 to its length - 1)"
            )
        with self._changed:
            self._plan = ShardPlan(order, mine)
            self._schedule()

    def get(self, name: str) -> str:
        """The local path of shard `name`, downloaded and verified if needed; the shard stays
        on disk (for every process of the node) until `release`.

        Raises:
            ShardFetchError: the shard could not be downloaded intact.
            ShardCacheLimitError: the shards in use leave no room for this one.
            CacheDiskFullError: the disk filled up and nothing could be evicted.
        """
        self._require_known(name)
        self._note_consumer()
        with self._changed:
            hit = name not in self._inflight and self._store.is_cached(name)
            self._plan.take(name)
            self._getting[name] += 1  # no eviction takes it from here on
        try:
            fd = self._hold(name)
        finally:
            with self._changed:
                self._getting[name] -= 1
                self._getting += Counter()  # drop zero counts
        with self._changed:
            self._users[name] += 1
            if name in self._use_fds:
                os.close(fd)
            else:
                self._use_fds[name] = fd
            self._count(gets=1, hits=int(hit))
            self._schedule()
        self._got_at = time.monotonic()
        return self._store.path(name)

    def release(self, name: str) -> None:
        """Give back one `get` of `name`: once no caller holds it, it may be evicted."""
        with self._changed:
            if self._users[name] <= 0:
                raise ValueError(f"shard {name!r} is released more often than it was taken")
            self._users[name] -= 1
            if self._users[name] == 0:
                del self._users[name]
                os.close(self._use_fds.pop(name))
                self._trim()
            self._schedule()

    def used(self, name: str) -> None:
        """The reader read `name` again while holding it: the plan moves past this use (so
        next-use ranks and the prefetch window follow a reader that keeps shards open)."""
        with self._changed:
            self._plan.take(name)

    def stats(self) -> CacheStats:
        """What this cache has done so far."""
        with self._changed:
            return self._stats

    def prefetch_depth(self) -> int:
        """How many distinct shards of the plan, from the next one on, the cache wants on disk
        or in flight: ``max(threads, ceil(2 * fetch_s / use_s))``, where ``fetch_s`` is the
        measured seconds one download takes and ``use_s`` the measured seconds the reader
        spends on a shard between two `get` calls (moving averages). A shard asked for
        ``fetch_s`` ahead arrives in time; twice that absorbs a slow download. Before both are
        measured, ``threads``. Half the cache limit caps it (see `_window`); a fixed `prefetch`
        given to the cache replaces the rule."""
        if self._prefetch is not None:
            return self._prefetch
        if not self._fetch_s or not self._use_s:
            return self._threads
        return max(self._threads, math.ceil(2 * self._fetch_s / self._use_s))

    def close(self) -> None:
        """Stop prefetching (downloads in flight finish) and drop this process's holds."""
        with self._changed:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._changed:
            for fd in self._use_fds.values():
                os.close(fd)
            self._use_fds.clear()
            self._users.clear()
        self._store.close()

    def __enter__(self) -> ShardCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- getting one shard -------------------------------------------------------------------

    def _hold(self, name: str) -> int:
        """Download `name` if needed, then a descriptor holding its shared lock, with the
        verified file in place (a shard evicted between the two is fetched again)."""
        while True:
            with self._changed:
                future = self._inflight.get(name)
                while future is None and not self._store.is_cached(name):
                    future = self._start_needed(name)
                    if future is None:
                        self._changed.wait()  # for a prefetch of this process to land
                    future = future or self._inflight.get(name)
            if future is not None:
                future.result()
            fd = self._store.open_shared(name)
            if self._store.is_cached(name):
                return fd
            os.close(fd)

    def _start_needed(self, name: str) -> Future[bool] | None:
        """Start downloading `name`, needed now (called holding `_changed`), making room by
        evicting any shard not in use; None when only this process's prefetches in flight
        stand in the way (they become evictable when they land).

        Raises:
            ShardCacheLimitError: the shards in use leave no room for it.
        """
        self._failed.discard(name)
        size = self._store.shards[name].bytes
        if not self._make_room(size, self._plan.cursor - 1, needed_now=True):
            if self._inflight:
                return None
            raise ShardCacheLimitError(
                f"shard {name!r} ({size} bytes) does not fit in the cache limit of "
                f"{self.cache_limit_bytes} bytes beside the shards being read now; raise "
                "cache_limit or read fewer shards at once"
            )
        return self._submit(name)

    def _submit(self, name: str) -> Future[bool]:
        future = self._pool.submit(self._download, name)
        self._inflight[name] = future
        future.add_done_callback(lambda done: self._finished(name, done))
        return future

    def _download(self, name: str) -> bool:
        """Fetch `name` unless another process did; True when this call downloaded it.

        The shard's lock is tried, not waited for: a process that downloads it holds it a
        while, and one that reads it (shared) may hold it for as long as it keeps the shard
        open, so the lock is tried again until this process has it or the shard is there."""
        shard, started = self._store.shards[name], time.monotonic()
        while True:
            with self._store.exclusive(name, blocking=False) as held:
                if held:
                    if self._store.is_cached(name):
                        return False
                    self._fetch_published(shard)
                    break
            if self._store.is_cached(name):
                return False
            time.sleep(_LOCK_RETRY_S)
        elapsed = time.monotonic() - started
        with self._changed:
            self._fetch_s = _smoothed(self._fetch_s, elapsed)
            self._count(downloads=1, downloaded_bytes=shard.bytes)
        return True

    def _fetch_published(self, shard: ShardInfo) -> None:
        """Download `shard` (holding its lock), evicting once for a full disk, and publish it."""
        try:
            self._fetch_to_part(shard)
        except CacheDiskFullError:
            if not self._evict_for_disk(shard.name):
                raise
            self._fetch_to_part(shard)
        self._store.publish(shard.name)

    def _fetch_to_part(self, shard: ShardInfo) -> None:
        url = self.url_root.rstrip("/") + "/" + shard.name
        part = self._store.part_path(shard.name)
        download_verified(url, part, shard, retry=self._retry, storage_options=self._options)

    def _finished(self, name: str, future: Future[bool]) -> None:
        with self._changed:
            if self._inflight.get(name) is future:
                del self._inflight[name]
            if future.cancelled() or future.exception() is not None:
                self._failed.add(name)
            self._changed.notify_all()
            if not self._closed:
                self._trim()
                self._schedule()

    def _evict_for_disk(self, name: str) -> bool:
        """After a full disk: evict one shard needed later than `name`; True when one went."""
        with self._changed:
            position = self._plan.next_use(name)
            victim = self._victim(self._plan.cursor if position is None else position)
            return victim is not None and self._evict(victim)

    # --- prefetch and eviction (called holding `_changed`) -----------------------------------

    def _schedule(self) -> None:
        """Start downloads of this process's next shards of the plan, nearest first, up to
        the prefetch depth and `threads` in flight, stopping at the first that does not fit."""
        if self._closed:
            return
        cached = self._store.listed()
        for position, name in self._window():
            if len(self._inflight) >= self._threads:
                return
            if name in self._inflight or name in self._users or name in cached:
                continue
            if name in self._failed:
                continue  # its reader meets the error at `get`, which tries once more
            if not self._make_room(self._store.shards[name].bytes, position, needed_now=False):
                return
            try:
                self._submit(name)
            except RuntimeError:  # the pool is shut down: interpreter exit in a worker
                self._closed = True
                return

    def _trim(self) -> None:
        """Evict, by the policy, shards no process uses and the prefetch window does not
        hold, while the folder holds more than the limit: each process counts only its own
        downloads in flight, so those of several processes may land past it together."""
        self._make_room(0, self._plan.cursor - 1, needed_now=False)

    def _window(self) -> Iterator[tuple[int, str]]:
        """This process's next `prefetch_depth` distinct shards of the plan, at most its share
        (``1 / readers``) of half the cache limit's bytes of them (at least one): the other
        half keeps shards for their next use. Given the whole limit, a cache smaller than the
        dataset would fill it with the window and keep nothing for the next epoch."""
        sizes = {n: s.bytes for n, s in self._store.shards.items()}
        room = self.cache_limit_bytes // 2 // self._readers
        return self._plan.window(self.prefetch_depth(), room, sizes)

    def _make_room(self, size: int, position: int | None, needed_now: bool) -> bool:
        """Evict until `size` more bytes fit; only shards used after `position` (any, when
        `needed_now`). False when that is not enough."""
        listed = self._store.listed()  # a landed download is listed before its future is done
        inflight = sum(self._store.shards[n].bytes for n in self._inflight if n not in listed)
        refused: set[str] = set()
        while self._store.cached_bytes() + inflight + size > self.cache_limit_bytes:
            victim = self._victim(position, needed_now=needed_now, refused=refused)
            if victim is None:
                return False
            if not self._evict(victim):
                refused.add(victim)  # another process holds it
        return True

    def _victim(
        self, position: int | None, *, needed_now: bool = False, refused: set[str] | None = None
    ) -> str | None:
        """The cached shard to evict for one used at `position`, by the policy; None when
        every candidate is in use, in flight or (Belady) needed no later than `position`."""
        window = set() if needed_now else {n for _, n in self._window()}
        busy = {*self._users, *self._getting, *self._inflight, *(refused or ())}
        candidates = [n for n in self._store.listed() if n not in busy]
        recorded = self._store.recorded()
        born = {n: int(recorded.get(n, {}).get("mtime_ns") or 0) for n in candidates}
        return pick_victim(
            self._plan, self.policy, candidates, position, protected=window, born=born
        )

    def _evict(self, name: str) -> bool:
        if not self._store.try_evict(name):
            return False
        self._count(evictions=1)
        return True

    # --- bookkeeping -------------------------------------------------------------------------

    def _note_consumer(self) -> None:
        if self._got_at is not None:
            self._use_s = _smoothed(self._use_s, time.monotonic() - self._got_at)

    def _count(self, **more: int) -> None:
        fields = {k: getattr(self._stats, k) + v for k, v in more.items()}
        self._stats = CacheStats(**{**self._stats.__dict__, **fields})

    def _require_known(self, name: str) -> None:
        if name not in self._store.shards:
            raise ValueError(
                f"shard {name!r} is not in this dataset's manifest ({len(self._store.shards)} "
                "shards); plan and get only the manifest's shard names"
            )


def _smoothed(average: float | None, sample: float) -> float:
    return sample if average is None else (1 - _SMOOTHING) * average + _SMOOTHING * sample


def _checked_shards(
    shards: Sequence[ShardInfo], limit: int, policy: str, threads: int
) -> dict[str, ShardInfo]:
    by_name = {s.name: s for s in shards}
    if len(by_name) != len(shards):
        raise ValueError("manifest_shards names a shard twice; pass the manifest's shard list")
    if policy not in (BELADY, LRU) or threads < 1:
        raise ValueError(
            f"policy={policy!r}, threads={threads}: policy is 'belady' or 'lru' and threads at "
            "least 1"
        )
    largest = max((s.bytes for s in shards), default=0)
    if limit < largest:
        raise ShardCacheLimitError(
            f"cache_limit of {limit} bytes is smaller than the largest shard ({largest} bytes); "
            "raise cache_limit to at least a few shards"
        )
    return by_name
