"""What every shard format shares: the registry entry, the one-shard writer and reader bases,
and `write_shard`, which stages, checksums and publishes a finished shard.

A shard on disk is untrusted input (someone else may have made it). Every reader therefore
opens only a regular file that is not a symbolic link (`lstat` first, ``O_NOFOLLOW`` where the
format opens the file itself), of exactly the manifest's byte count, and every sample it returns
passes `dlpipe.sample.sample_fields` (the key rule, the field rule, bytes values, a canonical
``cls`` that fits in int64) and carries exactly the manifest's fields. A hard link is read as the
file it is (it cannot be told from one). Format modules add their own structural checks at open.

A format module implements `ShardFileWriter` (add samples to one local file, close it) and
`ShardReader` (open lazily, iterate, and where `indexable`, `get`), then registers a
`ShardFormat`. Temp names, fsync, sha256 and shard entries live here, rotation in
`dlpipe.formats.writer`, the manifest with its owner `dlpipe.formats.output`: never in a format
module.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import stat
import sys
from abc import ABC, abstractmethod
from collections.abc import Generator, Iterable, Iterator, Sequence, Set
from dataclasses import dataclass
from typing import IO, Any, ClassVar

from dlpipe import storage
from dlpipe.dataset_names import FORMAT_VERSIONS, SHARD_SUFFIXES
from dlpipe.errors import DlpipeError, InvalidFieldError, ShardCorruptError
from dlpipe.manifest import ShardInfo
from dlpipe.sample import KEY_FIELD, Sample, check_field_name, sample_fields

__all__ = [
    "SampleCountError",
    "ShardBuilder",
    "ShardDiskFullError",
    "ShardFileWriter",
    "ShardFormat",
    "ShardReader",
    "UnsafeShardError",
    "check_schema",
    "open_regular_file",
    "start_writeback",
    "write_shard",
]

_INT64_MAX = (1 << 63) - 1


class ShardDiskFullError(DlpipeError, OSError):
    """A shard could not be written because its filesystem is full (``errno.ENOSPC``)."""


class UnsafeShardError(ShardCorruptError):
    """A shard holds or is something dlpipe never writes that could read outside the dataset
    folder or without bound (a symbolic link, a FIFO, an HDF5 external link, a sparse member)."""


class SampleCountError(ShardCorruptError):
    """A shard holds another number of samples than its manifest entry says (`found` and
    `expected`; `found` None when the count was cut short). A loader would otherwise read the
    manifest's count and silently drop or never reach the rest."""

    def __init__(
        self, message: str, *, found: int | None = None, expected: int | None = None
    ) -> None:
        super().__init__(message)  # one argument, as a DataLoader worker's error is rebuilt
        self.found, self.expected = found, expected


def open_regular_file(path: str) -> IO[bytes]:
    """Open a local shard `path` for reading only if it is a regular file and not a symbolic
    link (`storage.open_regular`).

    Raises:
        UnsafeShardError: `path` is a symbolic link or not a regular file.
    """
    try:
        return storage.open_regular(path, follow_links=False)
    except storage.NotRegularFileError as exc:
        raise _not_regular(path, exc.kind) from None


def _not_regular(path: str, kind: str) -> UnsafeShardError:
    return UnsafeShardError(
        f"shard {path} is {kind}, not a regular file; dlpipe never writes one and refuses it "
        "(a dataset must not point outside its folder). Put the shard file itself in the "
        "dataset folder, or re-convert the dataset"
    )


@dataclass(frozen=True)
class ShardFormat:
    """One registry entry: how a format names, writes and reads its shards."""

    name: str
    version: int
    suffix: str
    writer: type[ShardFileWriter]
    reader: type[ShardReader]
    random_access: bool
    supports_urls: bool

    def __post_init__(self) -> None:
        named = (SHARD_SUFFIXES.get(self.name), FORMAT_VERSIONS.get(self.name))
        if named != (self.suffix, self.version):
            raise TypeError(
                f"format {self.name!r} has suffix {self.suffix!r} and version {self.version}, "
                f"but dlpipe.dataset_names says {named}: name it there too"
            )

    def shard_name(self, split: str, index: int) -> str:
        return f"{split}-{index:06d}{self.suffix}"


class ShardFileWriter(ABC):
    """Writes one shard to a local file; `write_shard` owns naming, checksum and publishing."""

    def __init__(self, path: str, fields: Sequence[str]) -> None:
        self.path = path
        self.fields = tuple(fields)

    @abstractmethod
    def add(self, key: str, fields: dict[str, bytes]) -> None:
        """Append one sample (fields already checked against the schema, in schema order)."""

    @abstractmethod
    def close(self) -> None:
        """Finish the file; after this it is complete on disk."""

    def sha256(self) -> str | None:
        """The closed file's hex sha256 when the writer hashed it while writing; None (the
        default) has the builder read the file back for it."""
        return None

    def abandon(self) -> None:
        """Release the file after a failure without finishing it (the caller deletes it)."""
        with contextlib.suppress(Exception):  # the error that made us abandon is the one to report
            self.close()


class ShardReader(ABC):
    """Reads one shard. Opens lazily in the process that uses it, so it is safe to create in a
    parent and use in fork or spawn DataLoader workers; never pickles an open handle."""

    # `get` reads any sample by index; a format's `random_access` says whether its datasets
    # are read by index (map-style) or streamed
    indexable: ClassVar[bool] = False

    def __init__(self, path: str, info: ShardInfo, fields: Sequence[str]) -> None:
        self.path = path
        self.info = info
        self.fields = tuple(fields)
        self._handle: Any = None
        self._pid: int | None = None
        self.file_id: tuple[int, int] | None = None  # (st_dev, st_ino) checked at open, local
        for name in self.fields:
            check_field_name(name)

    def __len__(self) -> int:
        return self.info.samples

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handle"] = None
        state["_pid"] = None
        return state

    def handle(self, index: int = 0) -> Any:
        """The open file or environment, (re)opened in this process on first use.

        `index` is the sample being read, named in the error when the shard cannot be opened.
        """
        if self._handle is None or self._pid != os.getpid():
            self._handle = None  # a handle inherited through fork is never used
            self._check_file()
            try:
                self._handle = self._open()
            except ShardCorruptError:
                raise
            except Exception as exc:  # lmdb/h5py/tarfile errors, and _open's own ValueErrors
                raise self.corrupt(f"cannot be opened ({exc})", index) from exc
            self._pid = os.getpid()
        return self._handle

    def check(self) -> None:
        """Open the shard once, running every check done at open, and close it again.

        Raises:
            ShardCorruptError: the shard is missing, of the wrong size, or structurally not
                what dlpipe writes (`UnsafeShardError` when it could read outside the folder).
        """
        try:
            self.handle()
        finally:
            self.close()

    def count_samples(self) -> int:
        """The samples the shard really holds, by the cheapest read its format allows (a
        manifest can carry a shard's right sha256 and a wrong count); every open-time check runs.

        Raises:
            ShardCorruptError: as `check`, or a structure that cannot be counted.
        """
        return sum(1 for _ in self)

    def _check_file(self) -> None:
        """The shard is a regular file (not a link) of the manifest's size."""
        try:
            if storage.is_url(self.path):
                size = storage.size(self.path)
            else:
                st = os.lstat(storage.local_path(self.path))
                if not stat.S_ISREG(st.st_mode):
                    raise _not_regular(self.path, storage.file_kind(st.st_mode))
                size = st.st_size
                self.file_id = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            raise ShardCorruptError(
                f"shard {self.path} is missing; the manifest lists it "
                "(restore it, or re-run the conversion)"
            ) from None
        if size != self.info.bytes:
            raise self.corrupt(
                f"is {size} bytes but the manifest says {self.info.bytes} (truncated or replaced)"
            )

    def corrupt(self, message: str, index: int | None = None) -> ShardCorruptError:
        """A `ShardCorruptError` naming this shard (and the sample index, when known)."""
        where = f"shard {self.path}" + (f", sample {index}" if index is not None else "")
        return ShardCorruptError(
            f"{where}: {message}; run `dlpipe verify` on the dataset and re-convert it"
        )

    def count_mismatch(self, found: int, *, at_least: bool = False) -> SampleCountError:
        """A `SampleCountError`: this shard holds `found` samples (or, `at_least`, more than
        `found`), not the manifest's count."""
        held = f"more than {found}" if at_least else str(found)
        return SampleCountError(
            f"shard {self.path} holds {held} samples but the manifest says "
            f"{self.info.samples}; the manifest does not match its shards: run `dlpipe verify` "
            "on the dataset (it lists every shard that disagrees) and re-convert it",
            found=None if at_least else found,
            expected=self.info.samples,
        )

    def unsafe(self, found: str, index: int | None = None) -> UnsafeShardError:
        """An `UnsafeShardError`: this shard holds `found`, which dlpipe never writes."""
        where = f"shard {self.path}" + (f", sample {index}" if index is not None else "")
        return UnsafeShardError(
            f"{where}: holds {found}, which dlpipe never writes, so it is refused (a dataset "
            "must not read outside its folder or without bound); re-convert the dataset"
        )

    def check_same_file(self, st: os.stat_result) -> None:
        """The file opened is the one checked at open (not swapped for a link or a new file)."""
        if not stat.S_ISREG(st.st_mode) or st.st_size != self.info.bytes:
            raise self.corrupt("changed while it was opened (replaced under the reader)")
        if self.file_id is not None and (st.st_dev, st.st_ino) != self.file_id:
            raise self.corrupt("changed while it was opened (replaced under the reader)")

    @abstractmethod
    def _open(self) -> Any:
        """Open the shard and return the handle; raise ValueError when it is broken."""

    def _close_handle(self, handle: Any) -> None:
        handle.close()

    def close(self) -> None:
        if self._handle is not None and self._pid == os.getpid():
            self._close_handle(self._handle)
        self._handle = None
        self._pid = None

    @abstractmethod
    def __iter__(self) -> Iterator[Sample]:
        """Every sample of the shard, in order."""

    def iter_from(
        self, start: int, wanted: Set[int] | None = None
    ) -> Generator[Sample, None, None]:
        """Samples from index `start` on, without reading the earlier ones; with `wanted`,
        only those whose index it holds (the others are not read)."""
        for index in range(start, self.info.samples):
            if wanted is None or index in wanted:
                yield self.get(index)

    def get(self, index: int) -> Sample:
        """Sample `index` (0-based within the shard); indexable readers only."""
        raise TypeError(f"{type(self).__name__} is streaming-only; it has no random access")

    def make_sample(self, index: int, key: Any, fields: dict[str, Any]) -> Sample:
        """Check what was read against the schema and the sample model; return it as a sample.

        The key follows the key rule, every value is bytes, ``cls`` is a canonical ASCII integer
        that fits in int64, and the fields are exactly the manifest's.
        """
        if set(fields) != set(self.fields):
            raise self.corrupt(
                f"holds key {key!r} with fields {sorted(fields)}; expected {sorted(self.fields)}",
                index,
            )
        if not all(type(v) is bytes for v in fields.values()):
            raise self.corrupt(f"sample {key!r} holds a field value that is not bytes", index)
        sample: Sample = {KEY_FIELD: key}
        sample.update(fields)
        try:
            sample_fields(sample)
        except (InvalidFieldError, ValueError) as exc:  # InvalidKeyError is a ValueError
            raise self.corrupt(str(exc), index) from None
        for name, value in fields.items():
            long_cls = len(value) > 18 and name.rsplit(".", 1)[-1] == "cls"
            if long_cls and not -_INT64_MAX - 1 <= int(value) <= _INT64_MAX:
                raise self.corrupt(f"sample {key!r} cls {value[:40]!r} is beyond int64", index)
        return sample


def check_schema(key: str, fields: dict[str, bytes], schema: Sequence[str]) -> dict[str, bytes]:
    """`fields` in schema order; every sample of a dataset has the same fields."""
    if set(fields) != set(schema):
        raise InvalidFieldError(
            f"sample {key!r} has fields {sorted(fields)} but this dataset's samples have "
            f"{sorted(schema)}; every sample must carry the same fields"
        )
    return {name: fields[name] for name in schema}


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start write-back of dirty pages, do not wait


@functools.cache
def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing bytes `offset` .. `offset + length` of `fd` to disk
    (`length` 0: to the end of the file).

    It returns at once (``SYNC_FILE_RANGE_WRITE``) and promises nothing: durability still
    comes from the fsync before the shard is published. Elsewhere than Linux it does nothing.
    """
    function = _sync_file_range()
    if function is not None:
        function(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # an error only loses the head start


def _written_sha256(path: str) -> str:
    """The sha256 of a shard file that its writer did not hash while writing (LMDB and HDF5
    write most of a shard at its close). The disk is asked to start writing the file first,
    so it writes while the file is read back from the page cache and hashed, and the fsync
    that publishes the shard waits for less."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        start_writeback(f.fileno(), 0, 0)
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class ShardBuilder:
    """One shard being written to a temp file in `staging`; `finish` checksums and publishes it.

    Nothing appears under the final name until the file is complete and fsynced.
    """

    def __init__(
        self,
        fmt: ShardFormat,
        folder: str,
        name: str,
        staging: str,
        fields: Sequence[str] | None = None,
    ) -> None:
        self.fmt = fmt
        self.dest = storage.join(folder, name)
        self.name = name
        self.tmp_path = os.path.join(staging, name)
        self.fields = tuple(fields) if fields else None
        self.samples = 0
        self.payload_bytes = 0
        self._writer: ShardFileWriter | None = None

    def add(self, key: str, values: dict[str, bytes]) -> None:
        with self._naming_full_disk():
            if self._writer is None:
                self._writer = self.fmt.writer(self.tmp_path, self.fields or list(values))
            self._writer.add(key, check_schema(key, values, self._writer.fields))
        self.samples += 1
        self.payload_bytes += len(key) + sum(len(v) for v in values.values())

    def finish(self) -> ShardInfo:
        if self._writer is None:
            raise InvalidFieldError(f"shard {self.name} would hold no samples")
        with self._naming_full_disk():
            self._writer.close()
            digest = self._writer.sha256()
            self._writer = None
            info = ShardInfo(
                name=self.name,
                samples=self.samples,
                bytes=os.path.getsize(self.tmp_path),
                sha256=digest or _written_sha256(self.tmp_path),
            )
            storage.publish_file(self.tmp_path, self.dest, sync_folder=False)
        return info

    @contextlib.contextmanager
    def _naming_full_disk(self) -> Iterator[None]:
        """A full disk, however the format's library says it, is one `ShardDiskFullError`."""
        try:
            yield
        except OSError as exc:
            if exc.errno != errno.ENOSPC or isinstance(exc, ShardDiskFullError):
                raise
            folder = os.path.dirname(self.dest) if not storage.is_url(self.dest) else self.dest
            raise ShardDiskFullError(
                errno.ENOSPC,
                f"No space left on device: writing shard {self.name} into {folder} failed; "
                "free space on that disk or write the dataset to another folder",
            ) from None

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abandon()
            self._writer = None
        if os.path.exists(self.tmp_path):
            os.remove(self.tmp_path)


def write_shard(
    fmt: ShardFormat,
    folder: str,
    name: str,
    samples: Iterable[Sample],
    fields: Sequence[str] | None = None,
) -> ShardInfo:
    """Write `samples` as one shard `name` in `folder` (path or URL) and return its entry.

    This is the unit of parallel work: a conversion worker writes whole shards with it.
    """
    near = None if storage.is_url(folder) else folder
    with storage.staging_dir(near) as staging:
        builder = ShardBuilder(fmt, folder, name, staging, fields)
        try:
            for sample in samples:
                builder.add(*sample_fields(sample))
            return builder.finish()
        except BaseException:
            builder.abort()
            raise
