"""The shard cache's folder on disk, shared by every process of a node.

What lives in it, all written by the cache (anything else there is never touched):

- ``<shard name>``: a verified shard, published by `os.replace` from its temp name;
- ``.dlpipe-part.<shard name>``: a download in progress (written only under the shard's lock,
  so one left by a killed process is found and removed by the next `ShardStore.recover`);
- ``.dlpipe-lock.<shard name>``: the shard's ``flock`` file: exclusive while it is downloaded
  or evicted, shared while a process reads it. The kernel drops a dead holder's lock, so a
  kill -9 leaves no stale lock; the empty file stays (unlinking it would let two processes
  lock two different files of one name);
- ``.dlpipe-cache-index.json``: the verified shards (bytes, sha256 and the file's ``mtime_ns``,
  so a shard is hashed once, not at every start), replaced atomically under
  ``.dlpipe-cache-index.lock``.

Where a dataset's folder is and how large its cache may grow are also decided here
(`cache_folder`, `cache_limit_bytes`: see `dlpipe.loading.remote`, which reads through it).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import threading
from collections.abc import Iterator, Mapping
from typing import IO, Any

from dlpipe import storage
from dlpipe.errors import DlpipeError
from dlpipe.manifest import ShardInfo
from dlpipe.option_values import parse_size
from dlpipe.shard_fetch import file_sha256

__all__ = [
    "DEFAULT_FREE_SHARE",
    "INDEX_NAME",
    "LOCK_PREFIX",
    "PART_PREFIX",
    "CacheFolderError",
    "CacheSettingError",
    "ShardStore",
    "cache_folder",
    "cache_limit_bytes",
]

PART_PREFIX = ".dlpipe-part."
LOCK_PREFIX = ".dlpipe-lock."
INDEX_NAME = ".dlpipe-cache-index.json"
_INDEX_LOCK = ".dlpipe-cache-index.lock"
_INDEX_PART = ".dlpipe-part-index."


class CacheFolderError(DlpipeError, ValueError):
    """The cache folder holds, under a shard's name, a file the cache did not write."""


class ShardStore:
    """The verified shards of one dataset in a local folder, with their locks and index.

    Args:
        folder: the cache folder (created if needed).
        shards: the dataset's shards by name (their manifest entries).
    """

    def __init__(self, folder: str, shards: Mapping[str, ShardInfo]) -> None:
        os.makedirs(folder, exist_ok=True)
        self.folder, self.shards = folder, dict(shards)
        self._index: IO[str] | None = None
        self._recorded: dict[str, dict[str, Any]] = {}
        self._listed: set[str] = set()
        self._read_lock = threading.RLock()

    def path(self, name: str) -> str:
        """Where the verified shard `name` lives."""
        return os.path.join(self.folder, name)

    def part_path(self, name: str) -> str:
        """The temp name a download of `name` is written to."""
        return os.path.join(self.folder, PART_PREFIX + name)

    # --- locks -------------------------------------------------------------------------------

    def _lock_fd(self, name: str) -> int:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        return os.open(os.path.join(self.folder, LOCK_PREFIX + name), flags, 0o644)

    @contextlib.contextmanager
    def exclusive(self, name: str, *, blocking: bool = True) -> Iterator[bool]:
        """Hold `name`'s lock alone (to download or evict it); yields False, holding nothing,
        when not `blocking` and another holder has it."""
        fd = self._lock_fd(name)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # closing the descriptor drops the lock

    def open_shared(self, name: str) -> int:
        """A descriptor holding `name`'s lock shared (the shard is being read: no process
        evicts it); blocks while it is downloaded or evicted. Close it to release."""
        fd = self._lock_fd(name)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    # --- the index ---------------------------------------------------------------------------

    def recorded(self) -> dict[str, dict[str, Any]]:
        """The index: verified shard name -> ``{"bytes", "sha256", "mtime_ns"}``, parsed again
        only when the file was replaced (the parsed file is kept open, so its inode number
        cannot be reused by a newer index while it is compared)."""
        index = os.path.join(self.folder, INDEX_NAME)
        with self._read_lock:
            try:
                now = os.stat(index).st_ino
            except FileNotFoundError:
                self._drop_index()
                return {}
            if self._index is None or os.fstat(self._index.fileno()).st_ino != now:
                self._drop_index()
                with contextlib.suppress(FileNotFoundError):
                    self._index = open(index, encoding="utf-8")  # noqa: SIM115 (kept open)
                    self._recorded = _parse_index(self._index)
                    self._listed = {n for n in self._recorded if self._matches(n)}
            return self._recorded

    def listed(self) -> set[str]:
        """Names the index records as their manifest entry (files not looked at: cheap; a
        reader checks its shard with `is_cached`)."""
        with self._read_lock:
            self.recorded()
            return self._listed

    def _matches(self, name: str) -> bool:
        entry, shard = self._recorded.get(name), self.shards.get(name)
        return bool(
            entry
            and shard
            and (entry.get("bytes"), entry.get("sha256"))
            == (
                shard.bytes,
                shard.sha256,
            )
        )

    def _drop_index(self) -> None:
        if self._index is not None:
            self._index.close()
        self._index, self._recorded, self._listed = None, {}, set()

    def close(self) -> None:
        """Close the index file this process holds open."""
        with self._read_lock:
            self._drop_index()

    def is_cached(self, name: str) -> bool:
        """True when `name` is recorded as its manifest entry and its file is still that one."""
        if name not in self.listed():
            return False
        entry, shard = self.recorded()[name], self.shards[name]
        try:
            info = os.lstat(self.path(name))
        except FileNotFoundError:
            return False
        return stat.S_ISREG(info.st_mode) and (info.st_size, info.st_mtime_ns) == (
            shard.bytes,
            entry.get("mtime_ns"),
        )

    def cached_bytes(self) -> int:
        """Bytes of this dataset's shards recorded in the folder (every process's)."""
        return sum(self.shards[n].bytes for n in self.listed())

    def _update_index(self, name: str, entry: dict[str, Any] | None) -> None:
        lock = os.open(os.path.join(self.folder, _INDEX_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            shards = dict(_read_index(os.path.join(self.folder, INDEX_NAME)))
            if entry is None:
                shards.pop(name, None)
            else:
                shards[name] = entry
            part = os.path.join(self.folder, f"{_INDEX_PART}{os.getpid()}")
            with open(part, "w", encoding="utf-8") as f:
                json.dump({"version": 1, "shards": shards}, f, sort_keys=True)
            os.replace(part, os.path.join(self.folder, INDEX_NAME))
        finally:
            os.close(lock)

    def _record(self, name: str) -> None:
        shard = self.shards[name]
        mtime_ns = os.stat(self.path(name)).st_mtime_ns
        entry = {"bytes": shard.bytes, "sha256": shard.sha256, "mtime_ns": mtime_ns}
        self._update_index(name, entry)

    # --- publishing and evicting (the caller holds the shard's exclusive lock) ---------------

    def publish(self, name: str) -> None:
        """Move the verified download of `name` into place and record it."""
        os.replace(self.part_path(name), self.path(name))
        self._record(name)

    def try_evict(self, name: str) -> bool:
        """Remove cached shard `name` unless a process holds its lock; True when removed."""
        with self.exclusive(name, blocking=False) as held:
            if not held or name not in self.recorded():
                return False
            self._update_index(name, None)
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path(name))
            return True

    # --- recovery at start -------------------------------------------------------------------

    def recover(self) -> None:
        """Make the folder what the index says, after any crash: remove downloads left by a
        dead process, forget shards whose file is gone, and hash (once) shard files that
        are not recorded or changed since, keeping them when they match.

        Raises:
            CacheFolderError: a file under a shard's name that the cache did not write (not
                recorded, and not the shard).
        """
        present = set(os.listdir(self.folder))
        for part in present:
            if part.startswith(_INDEX_PART):
                with contextlib.suppress(FileNotFoundError):
                    self._remove_dead_index_part(part)
        traces = {n.removeprefix(PART_PREFIX) for n in present} | set(self.recorded())
        for name in sorted(traces & set(self.shards)):
            with self.exclusive(name, blocking=False) as held:
                if held:  # else another process downloads or reads it right now
                    self._recover_one(name)

    def _remove_dead_index_part(self, part: str) -> None:
        pid = part[len(_INDEX_PART) :]
        if pid.isdigit() and not _alive(int(pid)):
            os.remove(os.path.join(self.folder, part))

    def _recover_one(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.part_path(name))
        recorded = name in self.recorded()
        try:
            info = os.lstat(self.path(name))
        except FileNotFoundError:
            if recorded:
                self._update_index(name, None)
            return
        if self.is_cached(name):
            return
        shard = self.shards[name]
        regular = stat.S_ISREG(info.st_mode)
        if regular and info.st_size == shard.bytes and file_sha256(self.path(name)) == shard.sha256:
            self._record(name)
            return
        if not recorded or not regular:
            raise CacheFolderError(
                f"{self.path(name)}: the shard cache's folder holds a file under the name of "
                f"shard {name!r} that it did not write and that is not that shard; move it "
                "away, or give the cache a folder of its own (cache_dir)"
            )
        self._update_index(name, None)
        os.remove(self.path(name))


class CacheSettingError(DlpipeError, ValueError):
    """``cache_dir`` or ``cache_limit`` is not a usable setting."""


DEFAULT_FREE_SHARE = 0.5
"""Without ``cache_limit``: what the cache holds already plus this share of its disk's free
space."""


def cache_folder(url: str, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """The cache folder of the dataset at `url`: a folder named by the URL's sha256 under
    `cache_dir` (default: ``$DLPIPE_DATA_DIR/cache``, else the user cache's ``shards``)."""
    if cache_dir is None:
        data_dir = os.environ.get("DLPIPE_DATA_DIR")
        root = os.path.join(data_dir, "cache") if data_dir else storage.user_cache("shards")
    else:
        root = os.fspath(cache_dir)
        if storage.is_url(root):
            raise CacheSettingError(
                f"cache_dir={root!r} is a URL; the shard cache is a local folder: give a path "
                "on a local disk"
            )
    digest = hashlib.sha256(url.rstrip("/").encode("utf-8")).hexdigest()[:16]
    return os.path.join(os.path.abspath(storage.local_path(root)), digest)


def cache_limit_bytes(limit: int | str | None, folder: str) -> int:
    """`limit` in bytes (an int, or a size such as ``"50GB"``); None: what `folder` holds of
    the cache already plus `DEFAULT_FREE_SHARE` of its disk's free space.

    Raises:
        CacheSettingError: a limit that is not a positive size.
    """
    if limit is None:
        free = shutil.disk_usage(storage.existing_ancestor(folder)).free
        return _held_bytes(folder) + int(free * DEFAULT_FREE_SHARE)
    if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1:
        return limit
    try:
        return parse_size(limit) if isinstance(limit, str) else parse_size(repr(limit))
    except argparse.ArgumentTypeError as exc:
        raise CacheSettingError(
            f"cache_limit: {exc} (bytes, at least 1); a size such as '50GB' works too"
        ) from None


def _held_bytes(folder: str) -> int:
    """Bytes of regular files directly in `folder` (0 when it is not there)."""
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return 0
    return sum(e.stat(follow_symlinks=False).st_size for e in entries if e.is_file())


def _parse_index(f: IO[str]) -> dict[str, dict[str, Any]]:
    try:
        data = json.load(f)
    except ValueError:
        return {}  # unreadable: every shard is hashed again, nothing is trusted
    shards = data.get("shards") if isinstance(data, dict) else None
    return shards if isinstance(shards, dict) else {}


def _read_index(index: str) -> dict[str, dict[str, Any]]:
    try:
        with open(index, encoding="utf-8") as f:
            return _parse_index(f)
    except FileNotFoundError:
        return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
