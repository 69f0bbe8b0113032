"""What every shard format shares: the registry entry, the one-shard writer and reader bases,
and `write_shard`, which stages, checksums and publishes a finished shard.

A format module implements `ShardFileWriter` (add samples to one local file, close it) and
`ShardReader` (open lazily, iterate, and for random-access formats `get`), then registers a
`ShardFormat`. Rotation, temp names, fsync, sha256 and manifest entries live here and in
`dlpipe.formats.writer`, never in a format module.
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from dlpipe import storage
from dlpipe.errors import InvalidFieldError, ShardCorruptError
from dlpipe.manifest import ShardInfo
from dlpipe.sample import KEY_FIELD, Sample, sample_fields

__all__ = [
    "ShardBuilder",
    "ShardFileWriter",
    "ShardFormat",
    "ShardReader",
    "check_schema",
    "file_sha256",
    "write_shard",
]


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


class ShardReader(ABC):
    """Reads one shard. Opens lazily in the process that uses it, so it is safe to create in a
    parent and use in fork or spawn DataLoader workers; never pickles an open handle."""

    random_access: ClassVar[bool] = False

    def __init__(self, path: str, info: ShardInfo, fields: Sequence[str]) -> None:
        self.path = path
        self.info = info
        self.fields = tuple(fields)
        self._handle: Any = None
        self._pid: int | None = None

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
            self._check_size()
            try:
                self._handle = self._open()
            except Exception as exc:  # lmdb/h5py/tarfile errors, and _open's own ValueErrors
                raise self.corrupt(f"cannot be opened ({exc})", index) from exc
            self._pid = os.getpid()
        return self._handle

    def _check_size(self) -> None:
        try:
            size = storage.size(self.path)
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

    def iter_from(self, start: int) -> Generator[Sample, None, None]:
        """Samples from index `start` on, without reading the earlier ones."""
        for index in range(start, self.info.samples):
            yield self.get(index)

    def get(self, index: int) -> Sample:
        """Sample `index` (0-based within the shard); random-access formats only."""
        raise TypeError(f"{type(self).__name__} is streaming-only; it has no random access")

    def make_sample(self, index: int, key: Any, fields: dict[str, Any]) -> Sample:
        """Check what was read against the schema and return it as a sample."""
        if not isinstance(key, str) or set(fields) != set(self.fields):
            raise self.corrupt(
                f"holds key {key!r} with fields {sorted(fields)}; expected {sorted(self.fields)}",
                index,
            )
        if not all(isinstance(v, bytes) for v in fields.values()):
            raise self.corrupt("holds a field value that is not bytes", index)
        sample: Sample = {KEY_FIELD: key}
        sample.update(fields)
        return sample


def check_schema(key: str, fields: dict[str, bytes], schema: Sequence[str]) -> dict[str, bytes]:
    """`fields` in schema order; every sample of a dataset has the same fields."""
    if set(fields) != set(schema):
        raise InvalidFieldError(
            f"sample {key!r} has fields {sorted(fields)} but this dataset's samples have "
            f"{sorted(schema)}; every sample must carry the same fields"
        )
    return {name: fields[name] for name in schema}


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
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
        if self._writer is None:
            self._writer = self.fmt.writer(self.tmp_path, self.fields or list(values))
        self._writer.add(key, check_schema(key, values, self._writer.fields))
        self.samples += 1
        self.payload_bytes += len(key) + sum(len(v) for v in values.values())

    def finish(self) -> ShardInfo:
        if self._writer is None:
            raise InvalidFieldError(f"shard {self.name} would hold no samples")
        self._writer.close()
        self._writer = None
        info = ShardInfo(
            name=self.name,
            samples=self.samples,
            bytes=os.path.getsize(self.tmp_path),
            sha256=file_sha256(self.tmp_path),
        )
        storage.publish_file(self.tmp_path, self.dest, sync_folder=False)
        return info

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
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
