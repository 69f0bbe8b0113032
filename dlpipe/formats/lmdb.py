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

**Untrusted shards.** LMDB trusts its file: a crafted page can make the C library touch memory
past the end of the file (SIGBUS) or outside the map (SIGSEGV), which kills the process before
Python sees an error. So before the environment is opened, the reader checks with plain reads
what can be checked cheaply: the file is a regular file (not a link) of the manifest's size,
and both meta pages have LMDB's magic and data version, their own page number, one page size
(a power of two, 512 B to 64 KiB), a last page that lies inside the file, B-tree roots that lie
inside it, sane depths and page counts, and the transaction id parity LMDB writes. A value is
never larger than the file, so MessagePack's limits (tied to the value's length) bound it.

What this cannot catch: a corrupt branch, leaf or overflow page inside a valid tree (a node
size or page number changed by one byte) can still crash the C library when that sample is
read. ``dlpipe verify`` runs each shard in a child process, so such a shard is reported as
corrupt rather than ending the run; the loader's worker processes contain it the same way.

**Full disk while writing.** LMDB says so in many ways (``lmdb.DiskError``, ``mdb_txn_commit:
Input/output error`` when the disk is nearly full, "No space left on device"); each becomes
``OSError(errno.ENOSPC)``, which `dlpipe.formats.base.ShardBuilder` names with the shard. A
full map (``MapFullError``) is grown and the batch retried.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterator
from typing import IO, Any

import lmdb
import msgpack

from dlpipe import storage
from dlpipe.formats.base import ShardFileWriter, ShardFormat, ShardReader, open_regular_file
from dlpipe.sample import KEY_FIELD, Sample

__all__ = ["LMDB", "META_KEY", "index_key"]

META_KEY = b"dlpipe.meta"
_INDEX = struct.Struct(">Q")
_COMMIT_EVERY_BYTES = 64 << 20
_INITIAL_MAP_BYTES = 1 << 30
# The first bytes of an LMDB data file (lmdb.h, 64-bit builds; native byte order): a page
# header (page number, pad, flags) then MDB_meta: magic, version, address, map size, two MDB_db
# (page size or pad, flags, depth, branch/leaf/overflow pages, entries, root), last page, txnid.
_PAGE_HEADER = struct.Struct("=QHH")
_PAGE_HEADER_BYTES = 16
_META = struct.Struct("=IIQQ" + "IHHQQQQQ" * 2 + "QQ")
_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_P_META = 0x08
_P_INVALID = (1 << 64) - 1
_MIN_PAGE, _MAX_PAGE = 512, 1 << 16
_MAX_DEPTH = 32  # LMDB's cursor stack


def index_key(index: int) -> bytes:
    return _INDEX.pack(index)


def _disk_error(exc: lmdb.Error, path: str) -> OSError:
    """What LMDB raised while writing `path`, as the `OSError` the filesystem meant.

    LMDB reports a full disk as ENOSPC, or as EIO when the write of a commit fails: an EIO with
    less than two commit batches free on the disk is taken as full.
    """
    text = str(exc)
    full = isinstance(exc, lmdb.DiskError) or "No space left" in text
    if not full and "Input/output error" in text:
        disk = os.statvfs(os.path.dirname(os.path.abspath(path)))
        full = disk.f_bavail * disk.f_frsize < 2 * _COMMIT_EVERY_BYTES
    code = errno.ENOSPC if full else errno.EIO
    return OSError(code, f"{os.strerror(code)} (LMDB: {text})")


class LmdbWriter(ShardFileWriter):
    def __init__(self, path: str, fields: list[str]) -> None:
        super().__init__(path, fields)
        try:
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
        except lmdb.Error as exc:
            raise _disk_error(exc, self.path) from exc
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
        try:
            while True:
                try:
                    with self._env.begin(write=True) as txn:
                        for k, v in self._pending:
                            txn.put(k, v, append=k != META_KEY)
                    break
                except lmdb.MapFullError:  # grow deterministically and retry the whole batch
                    self._env.set_mapsize(self._env.info()["map_size"] * 2)
        except lmdb.Error as exc:
            raise _disk_error(exc, self.path) from exc
        self._pending.clear()
        self._pending_bytes = 0

    def close(self) -> None:
        meta = {
            "format": "lmdb",
            "format_version": 1,
            "samples": self._count,
            "fields": list(self.fields),
        }
        self._pending.append((META_KEY, msgpack.packb(meta, use_bin_type=True)))
        self._commit()
        try:
            self._env.sync(True)
        except lmdb.Error as exc:
            raise _disk_error(exc, self.path) from exc
        finally:
            self._env.close()

    def abandon(self) -> None:
        self._pending.clear()
        self._env.close()  # aborts any open transaction; nothing more is written


def check_meta_pages(f: IO[bytes], file_bytes: int) -> None:
    """Check both LMDB meta pages of the open file `f` with plain reads, before any mmap.

    Raises:
        ValueError: saying which field of which meta page is impossible for this file.
    """
    psize = _META.unpack_from(_read_at(f, _PAGE_HEADER_BYTES, _META.size))[4]
    if not _MIN_PAGE <= psize <= _MAX_PAGE or psize & (psize - 1):
        raise ValueError(f"meta page 0 gives page size {psize}, not a power of two 512..65536")
    if file_bytes < 2 * psize:
        raise ValueError(f"{file_bytes} bytes cannot hold two {psize}-byte meta pages")
    txnids = [_check_meta(f, page, psize, file_bytes) for page in (0, 1)]
    newer = int(txnids[1] > txnids[0])  # the meta LMDB will use, as mdb_env_pick_meta picks it
    if txnids[newer] % 2 != newer:
        raise ValueError(f"meta page {newer} holds transaction {txnids[newer]} of the wrong parity")


def _read_at(f: IO[bytes], offset: int, size: int) -> bytes:
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise ValueError(f"ends before byte {offset + size}")
    return data


def _check_meta(f: IO[bytes], page: int, psize: int, file_bytes: int) -> int:
    """One meta page's fields against the file; returns its transaction id."""
    pgno, _, flags = _PAGE_HEADER.unpack(_read_at(f, page * psize, _PAGE_HEADER.size))
    fields = _META.unpack_from(_read_at(f, page * psize + _PAGE_HEADER_BYTES, _META.size))
    magic, version, *_, last_page, txnid = fields
    problem = None
    if pgno != page or not flags & _P_META:
        problem = f"is not a meta page (number {pgno}, flags {flags:#x})"
    elif magic != _MAGIC or version != _DATA_VERSION:
        problem = f"has magic {magic:#x} version {version}, not LMDB's {_MAGIC:#x} version 1"
    elif fields[4] != psize:
        problem = f"gives page size {fields[4]}, meta page 0 gives {psize}"
    elif not 1 <= last_page < file_bytes // psize:
        problem = f"ends the data at page {last_page}, past the file's {file_bytes // psize}"
    for name, db in (("free-list", fields[4:12]), ("main", fields[12:20])):
        problem = problem or _db_problem(name, db, last_page)
    if problem:
        raise ValueError(f"meta page {page} {problem}")
    return int(txnid)


def _db_problem(name: str, db: tuple[int, ...], last_page: int) -> str | None:
    """What is impossible about one B-tree record (MDB_db) of a meta page, if anything."""
    _, _, depth, branch, leaf, overflow, entries, root = db
    if root == _P_INVALID:
        if depth == 0 and entries == 0:
            return None
        return f"has an empty {name} tree of depth {depth} with {entries} entries"
    if not 2 <= root <= last_page or not 1 <= depth <= _MAX_DEPTH:
        return f"has its {name} tree root at page {root}, depth {depth} (last page {last_page})"
    if branch + leaf + overflow > last_page:
        return f"counts {branch + leaf + overflow} {name} tree pages in {last_page + 1}"
    return None


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
        with open_regular_file(storage.local_path(self.path)) as f:
            self.check_same_file(os.fstat(f.fileno()))
            check_meta_pages(f, self.info.bytes)
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
