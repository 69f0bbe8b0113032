"""``lmdb``: one LMDB environment per shard, random access by index, no pickle.

Layout: ``{split}-{n:06d}.lmdb`` is a single-file environment (``subdir=False``, no lock file).

- Sample ``i`` of the shard is stored under the 8-byte big-endian key ``struct.pack(">Q", i)``.
- Its value is a MessagePack map: ``"__key__"`` → the sample key (str), and each field name (str)
  → the field's bytes (bin).
- The key ``b"dlpipe.meta"`` holds a MessagePack map ``{"format": "lmdb", "format_version": 1,
  "samples": n, "fields": [...]}``.

Read it with plain ``lmdb`` and ``msgpack``::

    env = lmdb.open("train-000000.lmdb", subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        sample = msgpack.unpackb(txn.get(struct.pack(">Q", 0)), raw=False)

LMDB maps files into memory, so it needs a local filesystem: a URL is refused with a message.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from typing import Any

import lmdb
import msgpack

from dlpipe import storage
from dlpipe.formats.base import ShardFileWriter, ShardFormat, ShardReader
from dlpipe.sample import KEY_FIELD, Sample

__all__ = ["LMDB", "META_KEY", "index_key"]

META_KEY = b"dlpipe.meta"
_INDEX = struct.Struct(">Q")
_COMMIT_EVERY_BYTES = 64 << 20
_INITIAL_MAP_BYTES = 1 << 30


def index_key(index: int) -> bytes:
    return _INDEX.pack(index)


class LmdbWriter(ShardFileWriter):
    def __init__(self, path: str, fields: list[str]) -> None:
        super().__init__(path, fields)
        self._env = lmdb.open(
            path,
            subdir=False,
            map_size=_INITIAL_MAP_BYTES,
            lock=False,
            sync=False,
            meminit=True,
            readahead=False,
            max_dbs=0,
        )
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0
        self._count = 0

    def add(self, key: str, fields: dict[str, bytes]) -> None:
        value = msgpack.packb({KEY_FIELD: key, **fields}, use_bin_type=True)
        self._pending.append((index_key(self._count), value))
        self._pending_bytes += len(value)
        self._count += 1
        if self._pending_bytes >= _COMMIT_EVERY_BYTES:
            self._commit()

    def _commit(self) -> None:
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    for k, v in self._pending:
                        txn.put(k, v, append=True)
                break
            except lmdb.MapFullError:  # grow deterministically and retry the whole batch
                self._env.set_mapsize(self._env.info()["map_size"] * 2)
        self._pending.clear()
        self._pending_bytes = 0

    def close(self) -> None:
        self._commit()
        meta = {
            "format": "lmdb",
            "format_version": 1,
            "samples": self._count,
            "fields": list(self.fields),
        }
        with self._env.begin(write=True) as txn:
            txn.put(META_KEY, msgpack.packb(meta, use_bin_type=True))
        self._env.sync(True)
        self._env.close()


# LMDB refuses a second open of one environment in a process: readers of the same shard (two
# loaders, or a trainer's and a benchmark's) share it, counted, per process and path (an
# environment inherited through fork is never used).
_OPEN_ENVS: dict[tuple[int, str], list[Any]] = {}


class LmdbReader(ShardReader):
    random_access = True

    def _open(self) -> Any:
        pid = os.getpid()
        for inherited in [k for k in _OPEN_ENVS if k[0] != pid]:
            del _OPEN_ENVS[inherited]  # dropped, as the readers drop theirs: LMDB then reopens
        path = (pid, os.path.realpath(storage.local_path(self.path)))
        entry = _OPEN_ENVS.get(path)
        if entry is None:
            entry = _OPEN_ENVS[path] = [self._open_env(), 0]
        entry[1] += 1
        return entry[0]

    def _close_handle(self, handle: Any) -> None:
        path = (os.getpid(), os.path.realpath(storage.local_path(self.path)))
        entry = _OPEN_ENVS.get(path)
        if entry is None or entry[0] is not handle:
            handle.close()
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _OPEN_ENVS[path]
            handle.close()

    def _open_env(self) -> Any:
        env = lmdb.open(
            storage.local_path(self.path),
            subdir=False,
            readonly=True,
            lock=False,
            readahead=False,
            max_readers=1,
            max_dbs=0,
        )
        # Pages past the end of a truncated file would fault (SIGBUS) when touched: refuse first.
        needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        if needed > self.info.bytes:
            env.close()
            raise ValueError(f"truncated: its pages need {needed} bytes, the file has fewer")
        return env

    def get(self, index: int) -> Sample:
        with self.handle(index).begin(buffers=False) as txn:
            try:
                value = txn.get(index_key(index))
            except lmdb.Error as exc:
                raise self.corrupt(f"LMDB read failed ({exc})", index) from exc
        if value is None:
            raise self.corrupt("has no such sample", index)
        return self._decode(index, value)

    def __iter__(self) -> Iterator[Sample]:
        env = self.handle()
        index = 0
        try:
            with env.begin(buffers=False) as txn:
                for k, value in txn.cursor():
                    if k == META_KEY:
                        continue
                    if k != index_key(index):
                        raise self.corrupt(f"key {k!r} is out of order", index)
                    yield self._decode(index, value)
                    index += 1
        except lmdb.Error as exc:
            raise self.corrupt(f"LMDB read failed ({exc})", index) from exc
        if index != self.info.samples:
            raise self.corrupt(f"holds {index} samples but the manifest says {self.info.samples}")

    def _decode(self, index: int, value: bytes) -> Sample:
        try:
            record = msgpack.unpackb(value, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises many types; none is pickle
            raise self.corrupt(f"value is not a MessagePack field map ({exc})", index) from exc
        if not isinstance(record, dict) or KEY_FIELD not in record:
            raise self.corrupt("value is not a MessagePack field map with '__key__'", index)
        key = record.pop(KEY_FIELD)
        return self.make_sample(index, key, record)


LMDB = ShardFormat(
    name="lmdb",
    version=1,
    suffix=".lmdb",
    writer=LmdbWriter,
    reader=LmdbReader,
    random_access=True,
    supports_urls=False,
)
