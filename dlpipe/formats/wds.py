"""``wds``: WebDataset-compatible POSIX tar shards.

Layout: ``{split}-{n:06d}.tar``; each sample is consecutive regular-file members
``{key}.{field}`` (POSIX ustar headers, pax for names over 100 bytes; mtime 0, owner 0:0,
mode 0444, so shards are reproducible). Any
tar reader and ``webdataset.WebDataset`` read them with no dlpipe code. A dataset of them
streams (the format is not random-access), from local paths and any fsspec URL; a local
shard's reader also answers `WdsReader.get` (a mixture draws its samples by index) from the
member offsets it walks once from the headers, with every check a pass makes.

On read a shard is untrusted input. Refused, each with a named error, before any data is read:
a member that is not a plain file (link, folder, device), a name holding a slash, ``..`` or a
leading ``/``; a GNU or pax *sparse* member (its holes would expand to any size), a pax global
header, chained or oversized (over 64 KiB) pax and GNU long-name headers, and a member whose
data runs past the end of the shard file. So a shard cannot point outside its folder, and a
pass over it holds at most one member in memory, never more than the file's size.

Reading a seekable shard, a header that is byte for byte the one dlpipe's writer makes
(checksum included) is parsed here, at a third of tarfile's cost; from the first header that
is not (another writer's, pax, GNU, damaged), tarfile's parser reads the rest, with the
refusals above. A test flips every byte of a header and holds the two parsers to the same
samples or the same error.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import tarfile
from collections.abc import Callable, Generator, Iterator, Sequence, Set
from typing import IO, Any, NamedTuple

from dlpipe import storage
from dlpipe.errors import (
    InvalidFieldError,
    ShardCorruptError,
    UnsafeMemberError,
    UnsupportedStorageError,
)
from dlpipe.formats.base import (
    ShardFormat,
    ShardReader,
    check_schema,
    open_regular_file,
)
from dlpipe.formats.wds_index import IndexedFile, SampleIndex, recorded
from dlpipe.formats.wds_writer import (
    USTAR_AFTER_SIZE,
    USTAR_MIDDLE,
    USTAR_NAME_BYTES,
    ZERO_BLOCK,
    WdsWriter,
)
from dlpipe.manifest import ShardInfo
from dlpipe.sample import Sample, check_field_name, check_key

__all__ = ["WDS", "RefusedHeaderError", "StrictTarInfo", "tar_members"]

_MAX_EXTENDED_HEADER_BYTES = 64 << 10
_EXTENDED_TYPES = (tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME)
_REFUSED_TYPES = {
    tarfile.GNUTYPE_SPARSE: "a GNU sparse member",
    tarfile.XGLTYPE: "a pax global header",
    tarfile.SOLARIS_XHDTYPE: "a Solaris extended header",
    tarfile.GNUTYPE_LONGLINK: "a GNU long link name",
}


_OCTAL = frozenset(b"01234567")


class RefusedHeaderError(Exception):
    """A tar header kind dlpipe refuses (a link, a device, a sparse member, an oversized or
    chained extended header), raised from inside tarfile's header parsing before it reads
    what the header claims."""


class StrictTarInfo(tarfile.TarInfo):
    """tarfile's member parser, refusing the header kinds dlpipe never writes before it reads
    their data: tarfile would read a pax header of any claimed size into memory, recurse once
    per chained extended header, and expand sparse members to their claimed size."""

    def _proc_member(self, tarfile: Any) -> Any:
        if self.type in _REFUSED_TYPES:
            raise RefusedHeaderError(f"header at byte {self.offset} is {_REFUSED_TYPES[self.type]}")
        if self.type not in _EXTENDED_TYPES:
            return super()._proc_member(tarfile)  # type: ignore[misc]  # private in typeshed
        if self.size > _MAX_EXTENDED_HEADER_BYTES:
            raise RefusedHeaderError(
                f"extended header at byte {self.offset} claims {self.size} bytes "
                f"(dlpipe caps them at {_MAX_EXTENDED_HEADER_BYTES})"
            )
        if getattr(tarfile, "_dlpipe_in_extended", False):
            raise RefusedHeaderError(f"extended header at byte {self.offset} follows another one")
        tarfile._dlpipe_in_extended = True
        try:
            return super()._proc_member(tarfile)  # type: ignore[misc]  # private in typeshed
        finally:
            tarfile._dlpipe_in_extended = False


class WdsReader(ShardReader):
    """A tar shard: streamed pass by pass (`iter_from`), or read by index (`get`).

    `get` walks the member headers once, at its first call in a process (each header checked
    as a pass checks it: the same errors, naming the shard and sample; data seeked over), and
    keeps each sample's member offsets for the reader's life in that process (never pickled);
    then a sample is one positioned read per member of a descriptor of its own, so `get` and
    passes over the same reader never move each other's file position.
    """

    indexable = True

    def __init__(self, path: str, info: ShardInfo, fields: Sequence[str]) -> None:
        super().__init__(path, info, fields)
        self._indexed_file: IndexedFile | None = None  # this process's, for `get`
        self._index: SampleIndex | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_indexed_file": None, "_index": None}

    def _open(self) -> Any:
        return None  # tar shards are opened per pass (and by `get`, once per process)

    def close(self) -> None:
        """Close `get`'s descriptor too; the sample index is kept for a later `get`."""
        if self._indexed_file is not None and self._indexed_file.pid == os.getpid():
            self._indexed_file.file.close()
        self._indexed_file = None
        super().close()

    def get(self, index: int) -> Sample:
        """Sample `index` (0-based in the shard), read by positioned reads at the offsets the
        first `get` in this process found; the same sample and checks as a pass gives.

        Raises:
            IndexError: `index` is not in 0 .. the manifest's count - 1.
            ShardCorruptError: the shard is refused as a pass refuses it: any member header
                (`UnsafeMemberError` for an unsafe one), the count, the fields, this sample's
                bytes.
            UnsupportedStorageError: the shard is a URL (a dataset reads its cached copy).
        """
        index = operator.index(index)
        if not 0 <= index < self.info.samples:
            raise IndexError(
                f"sample {index} is outside shard {self.path}, which holds {self.info.samples}"
            )
        opened = self._file_for_get(index)
        key, members = self._sample_index(opened).sample(index)
        with self._named_errors([index]):
            fields = {
                field: self._read_member(opened.file, index, f"{key}.{field}", offset, size)
                for field, offset, size in members
            }
        return self.make_sample(index, key, fields)

    def _file_for_get(self, index: int) -> IndexedFile:
        """This process's descriptor for `get`, opened (with every open-time file check) at
        its first call here and after `close`."""
        opened = self._indexed_file
        if opened is not None and opened.pid == os.getpid():
            return opened
        if storage.is_url(self.path):
            raise UnsupportedStorageError(
                f"shard {self.path}: reading a wds sample by index needs a local file; "
                "open the dataset with `dlpipe.open_dataset`, which reads a URL's shards "
                "from local copies in its shard cache"
            )
        self.handle(index)  # a regular file, not a link, of the manifest's size
        with self._named_errors([index]):
            f = self._open_file()
        st = os.fstat(f.fileno())
        opened = IndexedFile(os.getpid(), f, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        self._indexed_file = opened
        return opened

    def _sample_index(self, opened: IndexedFile) -> SampleIndex:
        """Each sample's members, walked from the headers of `opened` unless the file that
        was walked is the same (device, inode, size, modification time)."""
        if self._index is None or self._index.file != opened.file_id:
            self._index = self._walk(opened)
        return self._index

    def _walk(self, opened: IndexedFile) -> SampleIndex:
        """Every sample's key and members from the headers alone, checked as a pass checks
        them (a pass's own grouping, its errors at the same sample): each member's kind, name
        and extent, no duplicate field, the fields of each sample, the count."""
        position, f, index = [0], opened.file, SampleIndex(opened.file_id)
        with self._named_errors(position):
            shard = _Shard(recorded(tar_members(f), index), functools.partial(_read_at, f))
            for key, fields in _group(shard, self, read=False, limit=self.info.samples):
                if set(fields) != set(self.fields):  # a pass's error for it, from make_sample
                    self.make_sample(position[0], key, fields)
                position[0] += 1
        if position[0] != self.info.samples:
            raise self.count_mismatch(position[0])
        return index

    def _read_member(self, f: IO[bytes], index: int, name: str, offset: int, size: int) -> bytes:
        """`size` bytes at `offset`, read without moving the file position; a member cut
        short (the file shrank under the reader) is the error a pass gives."""
        data = storage.read_at(f.fileno(), offset, size)
        if len(data) != size:
            raise self.corrupt(f"member {name!r} ends after {len(data)} of its {size} bytes", index)
        return data

    def __iter__(self) -> Iterator[Sample]:
        return self.iter_from(0)

    def iter_from(
        self, start: int, wanted: Set[int] | None = None
    ) -> Generator[Sample, None, None]:
        """Samples from index `start` on; earlier members are seeked over, not read. With
        `wanted`, only those whose index it holds: the others' member headers are read and
        checked, their data seeked over (skipped, in a stream)."""
        position = [start]
        with self._tar(position) as shard:
            groups = _group(shard, self, start, wanted=wanted, limit=self.info.samples)
            for key, fields in groups:
                if wanted is None or position[0] in wanted:
                    yield self.make_sample(position[0], key, fields)
                position[0] += 1
        if position[0] != self.info.samples:
            raise self.count_mismatch(position[0])

    def count_samples(self) -> int:
        """From the member headers alone (each one checked); no member data is read."""
        position = [0]
        with self._tar(position) as shard:
            for key, fields in _group(shard, self, read=False):
                try:
                    check_schema(key, fields, self.fields)
                except InvalidFieldError as exc:
                    raise self.corrupt(str(exc), position[0]) from None
                position[0] += 1
        return position[0]

    @contextlib.contextmanager
    def _tar(self, position: list[int]) -> Iterator[_Shard]:
        """The shard's members and how to read their data; errors become named ones at the
        sample ``position[0]``. A seekable file is read by `tar_members` and member
        data is one seek and read at its offset; a stream goes through tarfile's stream mode."""
        self.handle()  # checks the file and its size against the manifest
        with self._named_errors(position), self._open_file() as f:
            if f.seekable():
                yield _Shard(tar_members(f), functools.partial(_read_at, f))
            else:
                with tarfile.open(fileobj=f, mode="r|", tarinfo=StrictTarInfo) as tar:
                    yield _Shard(_members(tar), functools.partial(_extracted, tar))

    @contextlib.contextmanager
    def _named_errors(self, position: list[int]) -> Iterator[None]:
        """tarfile's and the file's errors as named ones at the sample ``position[0]``."""
        try:
            yield
        except ShardCorruptError:
            raise
        except RefusedHeaderError as exc:
            raise self.unsafe_member(
                f"{exc}; dlpipe never writes one and refuses it", position[0]
            ) from None
        except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
            raise self.corrupt(f"is not a readable tar ({exc})", position[0]) from exc

    def _open_file(self) -> IO[bytes]:
        if storage.is_url(self.path):
            return storage.open_read(self.path)
        f = open_regular_file(storage.local_path(self.path))
        try:
            self.check_same_file(os.fstat(f.fileno()))
        except ShardCorruptError:
            f.close()
            raise
        return f

    def unsafe_member(self, message: str, index: int | None = None) -> UnsafeMemberError:
        """An `UnsafeMemberError` naming this shard (and the sample index, when known)."""
        return UnsafeMemberError(str(self.corrupt(message, index)))


class _Shard(NamedTuple):
    """A shard's members in order, and how to read a member's data."""

    members: Iterator[tarfile.TarInfo]
    read: Callable[[tarfile.TarInfo], bytes]


def _read_at(f: IO[bytes], member: tarfile.TarInfo) -> bytes:
    f.seek(member.offset_data)
    return f.read(member.size)


def _extracted(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    stream = tar.extractfile(member)
    assert stream is not None  # regular files always have data
    return stream.read()


def tar_members(f: IO[bytes]) -> Iterator[tarfile.TarInfo]:
    """The members of a seekable tar: headers exactly as dlpipe's writer makes them are
    parsed here (`_template_member`, a third of tarfile's cost); from the first other header
    on (pax, GNU, another writer's fields, a bad checksum, the archive's end) tarfile's own
    parser reads the rest, with dlpipe's refusals (`StrictTarInfo`)."""
    offset, header = 0, b""
    while (member := _template_member(header := _block_at(f, offset), offset)) is not None:
        yield member
        offset = member.offset_data + -(-member.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    if offset > 0 and header == ZERO_BLOCK:
        return  # the end-of-archive blocks after dlpipe's members
    if offset > 0:  # tarfile's own check as it moves past a member: the member is all there
        f.seek(offset - 1)
        if not f.read(1):
            raise tarfile.ReadError("unexpected end of data")
    f.seek(offset)
    with tarfile.open(fileobj=f, mode="r:", tarinfo=StrictTarInfo) as tar:
        yield from _members(tar)


def _block_at(f: IO[bytes], offset: int) -> bytes:
    f.seek(offset)
    return f.read(tarfile.BLOCKSIZE)


def _template_member(header: bytes, offset: int) -> tarfile.TarInfo | None:
    """The regular file a header describes when it is byte for byte `_header`'s template
    (mode, owner, mtime, type, magic and empty fields as dlpipe writes them; the name ASCII
    and NUL-padded; the size and checksum octal; the checksum right), else None."""
    if (
        len(header) != tarfile.BLOCKSIZE
        or header[100:124] != USTAR_MIDDLE
        or header[136:148] != USTAR_AFTER_SIZE[:12]
        or header[155:] != USTAR_AFTER_SIZE[19:]
        or header[135:136] != tarfile.NUL
        or header[154:155] != tarfile.NUL
    ):
        return None
    size_digits, checksum_digits = header[124:135], header[148:154]
    if not _OCTAL.issuperset(size_digits + checksum_digits):
        return None
    if int(checksum_digits, 8) != sum(header) - sum(header[148:156]) + 8 * ord(" "):
        return None
    raw = header[:USTAR_NAME_BYTES]
    end = raw.find(tarfile.NUL)
    name = raw if end < 0 else raw[:end]
    if not name or not name.isascii() or raw[len(name) :].strip(tarfile.NUL):
        return None
    member = tarfile.TarInfo(name.decode("ascii"))
    member.size, member.mode, member.type = int(size_digits, 8), 0o444, tarfile.REGTYPE
    member.offset, member.offset_data = offset, offset + tarfile.BLOCKSIZE
    return member


def _members(tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The members in order, keeping none: tarfile's own iteration lists every one it saw."""
    while (member := tar.next()) is not None:
        tar.members.clear()  # type: ignore[attr-defined]  # not in typeshed
        yield member


def _group(
    shard: _Shard,
    reader: WdsReader,
    skip: int = 0,
    *,
    read: bool = True,
    wanted: Set[int] | None = None,
    limit: int | None = None,
) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, fields) of consecutive members; the first `skip` samples' data is never read (nor
    any with `read` False, nor one whose index `wanted` lacks: the fields then hold empty
    bytes). With `limit` (the manifest's count), a sample past it is a `SampleCountError`,
    raised before the last sample within it is yielded: a reader that stops at the manifest's
    count still meets it."""
    key: str | None = None
    fields: dict[str, bytes] = {}
    index = -1
    for member in shard.members:
        _check_extent(member, reader, max(index, 0))
        name_key, field = _split_member(member, reader)
        if name_key != key and limit is not None and index + 1 >= limit:
            more = _samples_from(shard.members, name_key)
            if more is None:
                raise reader.count_mismatch(limit, at_least=True)
            raise reader.count_mismatch(limit + more)
        if name_key != key:
            if key is not None and index >= skip:
                yield key, fields
            key, fields, index = name_key, {}, index + 1
        if field in fields:
            raise reader.corrupt(f"member {member.name!r} appears twice", index)
        if index < skip or not read or (wanted is not None and index not in wanted):
            fields[field] = b""
            continue
        data = shard.read(member)
        if len(data) != member.size:
            raise reader.corrupt(
                f"member {member.name!r} ends after {len(data)} of its {member.size} bytes", index
            )
        fields[field] = data
    if key is not None and index >= skip:
        yield key, fields


def _samples_from(members: Iterator[tarfile.TarInfo], key: str) -> int | None:
    """How many samples the rest of a shard holds, `key`'s included, from the member headers
    alone; None when they cannot be read to the end."""
    count = 1
    try:
        for member in members:
            name_key = member.name.partition(".")[0]
            if name_key != key:
                count, key = count + 1, name_key
    except (tarfile.TarError, RefusedHeaderError, EOFError, OSError, ValueError):
        return None
    return count


def _check_extent(member: tarfile.TarInfo, reader: WdsReader, index: int) -> None:
    """A member is plain and its data lies inside the shard file, before any of it is read."""
    if member.issparse() or any(k.startswith("GNU.sparse.") for k in member.pax_headers):
        raise reader.unsafe_member(
            f"member {member.name!r} is a sparse file (its holes expand to any size); dlpipe "
            "never writes one and refuses it",
            index,
        )
    if member.offset_data + member.size > reader.info.bytes:
        raise reader.corrupt(
            f"member {member.name!r} claims {member.size} bytes at byte {member.offset_data}, "
            f"past the end of the {reader.info.bytes}-byte file",
            index,
        )


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
