"""``wds``: WebDataset-compatible POSIX tar shards.

Layout: ``{split}-{n:06d}.tar``; each sample is consecutive regular-file members
``{key}.{field}`` (POSIX ustar headers, pax for names over 100 bytes; mtime 0, owner 0:0,
mode 0444, so shards are reproducible). Any
tar reader and ``webdataset.WebDataset`` read them with no dlpipe code. Streaming only; reads
from local paths and any fsspec URL.

On read, a member that is not a plain file, or whose name holds a slash, ``..`` or starts at
the root, is refused: a shard from an untrusted source cannot write outside its folder.
"""

from __future__ import annotations

import tarfile
from collections.abc import Generator, Iterator
from typing import IO, Any

from dlpipe import storage
from dlpipe.errors import ShardCorruptError, UnsafeMemberError
from dlpipe.formats.base import ShardFileWriter, ShardFormat, ShardReader
from dlpipe.sample import Sample, check_field_name, check_key

__all__ = ["WDS"]


class WdsWriter(ShardFileWriter):
    """Writes members straight to the file: tarfile's addfile copies every member through
    file objects, which cost a quarter of a conversion's time (benchmarks/convert.py)."""

    def __init__(self, path: str, fields: list[str]) -> None:
        super().__init__(path, fields)
        self._file = open(path, "wb")  # noqa: SIM115 (closed in close())
        self._written = 0

    def add(self, key: str, fields: dict[str, bytes]) -> None:
        for name, data in fields.items():
            self._write(_header(f"{key}.{name}", len(data)))
            self._write(data)
            if len(data) % tarfile.BLOCKSIZE:
                self._write(tarfile.NUL * (tarfile.BLOCKSIZE - len(data) % tarfile.BLOCKSIZE))

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._written += len(data)

    def close(self) -> None:
        # two zero blocks end the archive; pad to a whole record, as tar(1) and tarfile do
        end = self._written + 2 * tarfile.BLOCKSIZE
        self._write(tarfile.NUL * (2 * tarfile.BLOCKSIZE + (-end) % tarfile.RECORDSIZE))
        self._file.close()


def _header(name: str, size: int) -> bytes:
    """A POSIX header for a regular file: ustar when the name fits in 100 bytes, else pax."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o444
    info.uname = info.gname = ""
    if len(name) <= tarfile.LENGTH_NAME:
        return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict")


class WdsReader(ShardReader):
    def _open(self) -> Any:
        return None  # tar shards are opened per pass: a stream has no random access

    def __iter__(self) -> Iterator[Sample]:
        return self.iter_from(0)

    def iter_from(self, start: int) -> Generator[Sample, None, None]:
        """Samples from index `start` on; earlier members are seeked over, not read."""
        self.handle()  # checks the size against the manifest
        index = start
        try:
            with storage.open_read(self.path) as f, _open_tar(f) as tar:
                for key, fields in _group(tar, self, start):
                    yield self.make_sample(index, key, fields)
                    index += 1
        except ShardCorruptError:
            raise
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise self.corrupt(f"is not a readable tar ({exc})", index) from exc
        if index != self.info.samples:
            raise self.corrupt(f"holds {index} samples but the manifest says {self.info.samples}")


def _open_tar(f: IO[bytes]) -> tarfile.TarFile:
    """Seekable files open in random-access mode, so skipped members are seeked over."""
    if f.seekable():
        return tarfile.open(fileobj=f, mode="r:")
    return tarfile.open(fileobj=f, mode="r|")


def _group(
    tar: tarfile.TarFile, reader: WdsReader, skip: int = 0
) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, fields) of consecutive members; the first `skip` samples' data is never read."""
    key: str | None = None
    fields: dict[str, bytes] = {}
    index = -1
    for member in tar:
        name_key, field = _split_member(member, reader)
        if name_key != key:
            if key is not None and index >= skip:
                yield key, fields
            key, fields, index = name_key, {}, index + 1
        if field in fields:
            raise reader.corrupt(f"member {member.name!r} appears twice")
        if index < skip:
            fields[field] = b""
            continue
        data = tar.extractfile(member)
        assert data is not None  # regular files always have data
        fields[field] = data.read()
    if key is not None and index >= skip:
        yield key, fields


def _split_member(member: tarfile.TarInfo, reader: WdsReader) -> tuple[str, str]:
    name = member.name
    if not member.isreg():
        raise UnsafeMemberError(
            f"shard {reader.path}: member {name!r} is a link, folder or device, not a plain "
            "file; dlpipe refuses it (a dataset must not point outside its folder)"
        )
    if name.startswith("/") or "/" in name or "\\" in name or ".." in name:
        raise UnsafeMemberError(
            f"shard {reader.path}: member name {name!r} has a path in it (absolute, '/' or "
            "'..'); dlpipe shards hold flat {key}.{field} names only"
        )
    key, _, field = name.partition(".")
    try:
        check_key(key)
        check_field_name(field)
    except ValueError:
        raise reader.corrupt(f"member {name!r} is not named {{key}}.{{field}}") from None
    return key, field


WDS = ShardFormat(
    name="wds",
    version=1,
    suffix=".tar",
    writer=WdsWriter,
    reader=WdsReader,
    random_access=False,
    supports_urls=True,
)
