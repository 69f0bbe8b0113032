"""The ``wds`` shard writer: POSIX ustar members ``{key}.{field}`` (pax for names over 100
bytes), mtime 0, owner 0:0, mode 0444, so shards are reproducible; and the header template
the reader's fast parser compares headers with (`dlpipe.formats.wds`)."""

from __future__ import annotations

import hashlib
import tarfile

from dlpipe.formats.base import ShardFileWriter, start_writeback

__all__ = ["USTAR_AFTER_SIZE", "USTAR_MIDDLE", "USTAR_NAME_BYTES", "ZERO_BLOCK", "WdsWriter"]


class WdsWriter(ShardFileWriter):
    """Writes members straight to the file, hashing the bytes as they go out.

    tarfile's ``addfile`` copies every member through file objects and builds each header
    through a ``TarInfo`` (a quarter of a conversion's time, then a tenth); here a header is a
    template plus name, size and checksum, writes go through a 1 MiB buffer, and the sha256 is
    taken on the way out, so the finished shard is never read back (benchmarks/convert.py).
    Every 8 MiB the disk is asked to start writing (`start_writeback`), so the fsync that
    publishes the shard waits for its last few MiB, not all of it.
    """

    def __init__(self, path: str, fields: list[str]) -> None:
        super().__init__(path, fields)
        self._file = open(path, "wb", buffering=_WRITE_BUFFER_BYTES)  # noqa: SIM115 (close())
        self._written = 0
        self._flushed = 0  # bytes handed to the kernel's write-back so far
        self._digest = hashlib.sha256()

    def add(self, key: str, fields: dict[str, bytes]) -> None:
        pending: list[bytes] = []  # headers, small values and padding: written as one piece
        for name, data in fields.items():
            pending.append(_header(f"{key}.{name}", len(data)))
            if len(data) > _JOINED_BYTES:  # an image: written as it is, never copied
                self._write(b"".join(pending))
                self._write(data)
                pending.clear()
            else:
                pending.append(data)
            pending.append(ZERO_BLOCK[: -len(data) % tarfile.BLOCKSIZE])
        self._write(b"".join(pending))

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._digest.update(data)
        self._written += len(data)
        if self._written - self._flushed >= _WRITEBACK_BYTES:
            self._file.flush()
            start_writeback(self._file.fileno(), self._flushed, self._written - self._flushed)
            self._flushed = self._written

    def close(self) -> None:
        # two zero blocks end the archive; pad to a whole record, as tar(1) and tarfile do
        end = self._written + 2 * tarfile.BLOCKSIZE
        self._write(tarfile.NUL * (2 * tarfile.BLOCKSIZE + (-end) % tarfile.RECORDSIZE))
        self._file.close()

    def sha256(self) -> str:
        """The hex sha256 of every byte written (the whole file once closed)."""
        return self._digest.hexdigest()


_WRITE_BUFFER_BYTES = 1 << 20
_WRITEBACK_BYTES = 8 << 20
_JOINED_BYTES = 4096  # a field up to this size is joined to its header, not written alone

ZERO_BLOCK = tarfile.NUL * tarfile.BLOCKSIZE
USTAR_NAME_BYTES = tarfile.LENGTH_NAME
_MAX_USTAR_SIZE = 8**11 - 1  # 11 octal digits: what a ustar size field holds


def _ustar_template() -> tuple[bytes, bytes, int]:
    """The fixed parts of dlpipe's ustar header around the name and size, and their checksum.

    Field by field what ``TarInfo.tobuf(USTAR_FORMAT)`` writes for a regular file of mode
    0444, owner 0:0 with empty names, mtime 0; the checksum field counts as 8 spaces.
    """
    middle = b"0000444\0" + b"0000000\0" * 2  # mode, uid, gid (after the 100-byte name)
    after_size = b"%011o\0" % 0 + b" " * 8 + tarfile.REGTYPE + tarfile.NUL * 100
    after_size += tarfile.POSIX_MAGIC  # then empty uname, gname, device numbers, prefix
    after_size += tarfile.NUL * (tarfile.BLOCKSIZE - 124 - 12 - len(after_size))
    return middle, after_size, sum(middle) + sum(after_size)


USTAR_MIDDLE, USTAR_AFTER_SIZE, _USTAR_FIXED_SUM = _ustar_template()


def _header(name: str, size: int) -> bytes:
    """A POSIX header for a regular file: ustar when the name fits in 100 bytes, else pax.

    ASCII names of up to 100 bytes (every name dlpipe's key rule makes short enough) take the
    template; any other name goes through tarfile, which writes the same bytes more slowly.
    """
    if not name.isascii() or len(name) > USTAR_NAME_BYTES or size > _MAX_USTAR_SIZE:
        return _tarfile_header(name, size)
    raw = name.encode("ascii")
    size_field = b"%011o\0" % size
    checksum = _USTAR_FIXED_SUM + sum(raw) + sum(size_field)
    # mtime (12 bytes), then the checksum as tarfile writes it: 6 octal digits, NUL, space
    after = USTAR_AFTER_SIZE[:12] + b"%06o\0" % checksum + USTAR_AFTER_SIZE[19:]
    return b"".join(
        (raw, tarfile.NUL * (USTAR_NAME_BYTES - len(raw)), USTAR_MIDDLE, size_field, after)
    )


def _tarfile_header(name: str, size: int) -> bytes:
    """`_header` through tarfile's ``TarInfo``: pax for names over 100 bytes."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o444
    info.uname = info.gname = ""
    if len(name) <= tarfile.LENGTH_NAME:
        return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict")
