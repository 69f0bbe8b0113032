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

**Untrusted shards.** LMDB trusts its file: a crafted page makes the C library touch memory past
the end of the file (SIGBUS) or outside the map (SIGSEGV), which kills the process before Python
sees an error (one flipped byte in a leaf page's node pointers does it). So before the
environment is opened the reader checks the file with plain reads (`check_pages`): it is a
regular file, not a link, of the manifest's size; both meta pages have LMDB's magic and data
version, their own page number, one page size (a power of two, 512 B to 64 KiB), a last page
inside the file, B-tree roots inside it, sane depths and page counts, and the transaction id
parity LMDB writes; then every branch and leaf page of the main tree is read once (no cycles,
leaves at the tree's depth), every node lies inside its page, only plain and overflow values
occur (no sub-databases or duplicates, which dlpipe never writes), and every overflow value lies
inside the file. That costs one read of the tree pages per open, about 0.2 s for 78 MB of 1 KB
values and almost nothing for image-sized values, which live on overflow pages whose heads alone
are read. A value is never larger than the file, so MessagePack's limits (tied to the value's
length) bound it.

What this cannot catch: a file changed after the check (a dataset replaced under a live
reader), and any bug in LMDB itself on a file that passes these checks. ``dlpipe verify`` runs
each shard in a child process, so such a shard is reported as corrupt rather than ending the run.

**Full disk while writing.** LMDB says so in many ways (``lmdb.DiskError``, ``mdb_txn_commit:
Input/output error`` when the disk is nearly full, "No space left on device"); each becomes
``OSError(errno.ENOSPC)``, which `dlpipe.formats.base.ShardBuilder` names with the shard. A
full map (``MapFullError``) is grown and the batch retried.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import lmdb
import msgpack

from dlpipe import storage
from dlpipe.formats.base import (
    SampleCountError,
    ShardFileWriter,
    ShardFormat,
    ShardReader,
    open_regular_file,
)
from dlpipe.sample import KEY_FIELD, Sample

__all__ = ["LMDB", "META_KEY", "index_key"]

META_KEY = b"dlpipe.meta"
_INDEX = struct.Struct(">Q")
_COMMIT_EVERY_BYTES = 2 << 20  # see LmdbWriter's docstring
_INITIAL_MAP_BYTES = 1 << 30
# The first bytes of an LMDB data file (lmdb.h, 64-bit builds; native byte order): a page
# header (page number, pad, flags) then MDB_meta: magic, version, address, map size, two MDB_db
# (page size or pad, flags, depth, branch/leaf/overflow pages, entries, root), last page, txnid.
_PAGE_HEADER = struct.Struct("=QHH")
_PAGE_HEADER_BYTES = 16
_META = struct.Struct("=IIQQ" + "IHHQQQQQ" * 2 + "QQ")
_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META, _P_DIRTY = 0x01, 0x02, 0x04, 0x08, 0x10
_F_BIGDATA = 0x01
_TREE_PAGE = struct.Struct("=QHHHH")  # page number, pad, flags, lower, upper
_OVERFLOW_PAGE = struct.Struct("=QHHI")  # page number, pad, flags, pages
_NODE = struct.Struct("=HHHH")  # data size low, high (or child page), flags, key size
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
    """Puts each sample into an open write transaction as it is added; the transaction commits
    every 2 MiB of values, and at close. A commit writes its dirty pages in one ``writev``: a
    whole shard's (30 MB, one commit per shard before) took three times the system time of the
    same bytes in 2 MiB commits (the kernel's copy into the page cache; 4.5 against 1.5 CPU
    seconds for 20,000 images, benchmarks/convert.py); each commit adds one meta page and the
    copied path to the last leaf (0.3 % more file).

    A value is packed into one reused MessagePack buffer, from which LMDB copies it into its
    page, so no packed value outlives its `add` (a fresh packed copy of every value, held until
    the commit, cost a quarter of the writer's CPU time). The batch's samples are kept, as
    references, so that when the map is full it is doubled and the whole batch put again into
    a new transaction, as often as it takes.
    """

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
        self._packer = msgpack.Packer(use_bin_type=True, autoreset=False)
        self._txn: Any = None
        self._batch: list[tuple[bytes, dict[str, Any]]] = []  # put since the last commit
        self._batch_bytes = 0
        self._count = 0

    def add(self, key: str, fields: dict[str, bytes]) -> None:
        self._append(index_key(self._count), {KEY_FIELD: key, **fields})
        self._count += 1
        if self._batch_bytes >= _COMMIT_EVERY_BYTES:
            self._commit()

    def _append(self, key: bytes, record: dict[str, Any]) -> None:
        """Put `record` under `key` into the open transaction and keep it in the batch."""
        self._batch.append((key, record))
        with self._as_disk_errors():
            try:
                self._batch_bytes += self._put(key, record)
            except lmdb.MapFullError:
                self._put_batch_again()

    def _commit(self) -> None:
        with self._as_disk_errors():
            while True:
                try:
                    self._transaction().commit()
                    break
                except lmdb.MapFullError:
                    self._put_batch_again()
        self._txn = None
        self._batch.clear()
        self._batch_bytes = 0

    def _put_batch_again(self) -> None:
        """The map is full: drop the open transaction, double the map and put the whole batch
        into a new one, doubling again until it fits (the map size is deterministic)."""
        while True:
            self._txn.abort()  # a no-op after a failed commit, which aborted it already
            self._txn = None
            self._env.set_mapsize(self._env.info()["map_size"] * 2)
            try:
                self._batch_bytes = sum(self._put(key, record) for key, record in self._batch)
                return
            except lmdb.MapFullError:
                continue

    def _put(self, key: bytes, record: dict[str, Any]) -> int:
        """Pack `record` into the reused buffer and put it under `key`; returns its length."""
        self._packer.pack(record)
        try:
            with self._packer.getbuffer() as value:
                self._transaction().put(key, value, append=key != META_KEY)
                return len(value)
        finally:
            self._packer.reset()

    def _transaction(self) -> Any:
        if self._txn is None:
            self._txn = self._env.begin(write=True)
        return self._txn

    @contextlib.contextmanager
    def _as_disk_errors(self) -> Iterator[None]:
        try:
            yield
        except lmdb.Error as exc:
            raise _disk_error(exc, self.path) from exc

    def close(self) -> None:
        meta = {
            "format": "lmdb",
            "format_version": 1,
            "samples": self._count,
            "fields": list(self.fields),
        }
        try:
            self._append(META_KEY, meta)
            self._commit()
        finally:
            self._env.close()  # no sync here: the fsync that publishes the shard makes it durable

    def abandon(self) -> None:
        self._batch.clear()
        self._txn = None
        self._env.close()  # aborts the open transaction; nothing more is written


def check_pages(f: IO[bytes], file_bytes: int) -> None:
    """Check an LMDB file with plain reads, before LMDB maps it: both meta pages, then every
    branch and leaf page of the main tree and the head of every overflow page it names.

    Raises:
        ValueError: saying which page is impossible for this file, and why.
    """
    psize = _META.unpack_from(_read_at(f, _PAGE_HEADER_BYTES, _META.size))[4]
    if not _MIN_PAGE <= psize <= _MAX_PAGE or psize & (psize - 1):
        raise ValueError(f"meta page 0 gives page size {psize}, not a power of two 512..65536")
    if file_bytes < 2 * psize:
        raise ValueError(f"{file_bytes} bytes cannot hold two {psize}-byte meta pages")
    metas = [_check_meta(f, page, psize, file_bytes) for page in (0, 1)]
    newer = int(metas[1][-1] > metas[0][-1])  # the meta LMDB uses, as mdb_env_pick_meta does
    last_page, root, depth, txnid = metas[newer]
    if txnid % 2 != newer:
        raise ValueError(f"meta page {newer} holds transaction {txnid} of the wrong parity")
    if root != _P_INVALID:
        _check_tree(f, _Geometry(psize, last_page), root, depth)


def _read_at(f: IO[bytes], offset: int, size: int) -> bytes:
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise ValueError(f"ends before byte {offset + size}")
    return data


def _check_meta(f: IO[bytes], page: int, psize: int, file_bytes: int) -> tuple[int, int, int, int]:
    """One meta page's fields against the file: (last page, main root, main depth, txnid)."""
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
    return last_page, fields[19], fields[14], txnid


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


@dataclass(frozen=True)
class _Geometry:
    page_bytes: int
    last_page: int


def _check_tree(f: IO[bytes], geo: _Geometry, root: int, depth: int) -> None:
    """Walk the main B-tree from `root`: every page once, inside the file, leaves at `depth`."""
    seen: set[int] = set()
    stack = [(root, 1)]
    while stack:
        pgno, level = stack.pop()
        if pgno in seen or not 2 <= pgno <= geo.last_page or level > depth:
            raise ValueError(f"tree page {pgno} is outside the file, repeated or too deep")
        seen.add(pgno)
        page = _read_at(f, pgno * geo.page_bytes, geo.page_bytes)
        children = _check_page(f, geo, page, pgno, leaf=level == depth)
        stack.extend((child, level + 1) for child in children)


def _check_page(f: IO[bytes], geo: _Geometry, page: bytes, pgno: int, *, leaf: bool) -> list[int]:
    """One branch or leaf page: its nodes lie inside it; returns a branch page's children."""
    own, _, flags, lower, upper = _TREE_PAGE.unpack_from(page)
    kind = _P_LEAF if leaf else _P_BRANCH
    if own != pgno or flags & ~_P_DIRTY != kind or not 16 <= lower <= upper <= geo.page_bytes:
        found = f"number {own}, flags {flags:#x}, bounds {lower}-{upper}"
        raise ValueError(f"tree page {pgno} is not a {'leaf' if leaf else 'branch'} ({found})")
    children = []
    for ptr in struct.unpack_from(f"={(lower - 16) // 2}H", page, 16):
        if not upper <= ptr <= geo.page_bytes - _NODE.size:
            raise ValueError(f"tree page {pgno} points to a node at byte {ptr}")
        lo, hi, node_flags, key_bytes = _NODE.unpack_from(page, ptr)
        end = ptr + _NODE.size + key_bytes  # where the key ends and the data starts
        if not leaf:  # a branch node: the child's page number, then the key
            children.append(lo | hi << 16 | node_flags << 32)
        elif node_flags == _F_BIGDATA:  # the data is the number of its first overflow page
            if end + 8 <= geo.page_bytes:
                _check_overflow(f, geo, struct.unpack_from("=Q", page, end)[0], lo | hi << 16)
            end += 8
        elif node_flags == 0:  # the data follows the key in this page
            end += lo | hi << 16
        else:  # sub-databases and duplicates: dlpipe never writes them
            raise ValueError(f"tree page {pgno} has a node with flags {node_flags:#x}")
        if end > geo.page_bytes:
            raise ValueError(f"tree page {pgno} has a node at byte {ptr} that overruns it")
    return children


def _check_overflow(f: IO[bytes], geo: _Geometry, first: int, data_bytes: int) -> None:
    """A value stored on overflow pages lies inside the file."""
    if not 2 <= first <= geo.last_page:
        raise ValueError(f"a value starts at page {first}, outside the file")
    own, _, flags, pages = _OVERFLOW_PAGE.unpack(_read_at(f, first * geo.page_bytes, 16))
    if own != first or flags & ~_P_DIRTY != _P_OVERFLOW or first + pages - 1 > geo.last_page:
        raise ValueError(f"overflow page {first} is not one, or runs past the file")
    if data_bytes > pages * geo.page_bytes - 16:
        raise ValueError(f"a value of {data_bytes} bytes overruns its {pages} pages at {first}")


# LMDB refuses a second open of one environment in a process: readers of the same shard (two
# loaders, or a trainer's and a benchmark's) share it, counted, per process and path (an
# environment inherited through fork is never used).
_OPEN_ENVS: dict[tuple[int, str], list[Any]] = {}


class LmdbReader(ShardReader):
    indexable = True

    def _open(self) -> Any:
        pid = os.getpid()
        for inherited in [k for k in _OPEN_ENVS if k[0] != pid]:
            # inherited through fork: closed here (this process's mapping and descriptors
            # only), else lmdb refuses to open the path again ("already open in this process")
            # while another loader of the parent still holds the environment
            with contextlib.suppress(lmdb.Error):
                _OPEN_ENVS.pop(inherited)[0].close()
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
            check_pages(f, self.info.bytes)
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
        try:  # the count is in the meta page: a manifest that disagrees is named at open
            found = self._entries(env)
        except lmdb.Error:
            env.close()
            raise
        if found != self.info.samples:
            env.close()
            raise self.count_mismatch(found)
        return env

    @staticmethod
    def _entries(env: Any) -> int:
        """The environment's entries, less the metadata record."""
        with env.begin() as txn:
            has_meta = txn.get(META_KEY) is not None
        return int(env.stat()["entries"]) - int(has_meta)

    def count_samples(self) -> int:
        """The environment's entries, less the metadata record."""
        try:
            env = self.handle()
        except SampleCountError as exc:
            assert exc.found is not None  # lmdb knows its count
            return exc.found
        try:
            return self._entries(env)
        except lmdb.Error as exc:
            raise self.corrupt(f"cannot be counted ({exc})") from exc

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
