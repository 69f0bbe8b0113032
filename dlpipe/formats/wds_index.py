"""A wds shard's sample index: each sample's key and members (field, data offset, size),
walked once from the member headers by `dlpipe.formats.wds.WdsReader.get`, which then reads
a sample's members by positioned reads (`dlpipe.storage.read_at`)."""

from __future__ import annotations

import array
import sys
import tarfile
from collections.abc import Iterator
from typing import IO, NamedTuple

__all__ = ["FileId", "IndexedFile", "SampleIndex", "recorded"]

FileId = tuple[int, int, int, int]
"""A shard file as `os.fstat` tells it: device, inode, size, modification time (ns)."""


class IndexedFile(NamedTuple):
    """The shard file `get` reads, opened in process `pid`."""

    pid: int
    file: IO[bytes]
    file_id: FileId


class SampleIndex:
    """Each sample's key and members (field, data offset, size) in shard order, as walked
    from the headers of the file `file`. Kept flat, about 120 bytes a sample of two fields
    (tuples would take 500): a process keeps one for each shard it reads by index."""

    def __init__(self, file: FileId) -> None:
        self.file = file
        self._keys: list[str] = []
        self._first = array.array("q")  # each sample's first member
        self._fields: list[str] = []  # each member's, interned: a few distinct strings
        self._offsets = array.array("q")
        self._sizes = array.array("q")

    def add(self, member: tarfile.TarInfo) -> None:
        """The next member of the shard: of the last sample added, or the first of the next
        one when its key differs (as `_group` groups them)."""
        key, _, field = member.name.partition(".")
        if not self._keys or self._keys[-1] != key:
            self._keys.append(key)
            self._first.append(len(self._offsets))
        self._fields.append(sys.intern(field))
        self._offsets.append(member.offset_data)
        self._sizes.append(member.size)

    def sample(self, index: int) -> tuple[str, Iterator[tuple[str, int, int]]]:
        """Sample `index`'s key and its members' (field, data offset, size)."""
        start = self._first[index]
        stop = self._first[index + 1] if index + 1 < len(self._first) else len(self._offsets)
        fields, offsets, sizes = self._fields, self._offsets, self._sizes
        members = zip(fields[start:stop], offsets[start:stop], sizes[start:stop], strict=True)
        return self._keys[index], members


def recorded(members: Iterator[tarfile.TarInfo], index: SampleIndex) -> Iterator[tarfile.TarInfo]:
    """`members`, each added to `index` as it goes by."""
    for member in members:
        index.add(member)
        yield member
