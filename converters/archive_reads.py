"""Archive members read in place, in any process (a conversion's workers too): each process
keeps the archives it reads open (up to 8), checked against the (size, mtime) they were listed
at, so an archive changed after the scan fails its samples instead of giving other bytes.
A zip member is read through ``zipfile`` (its CRC checked, never past its listed size), a tar
member by one seek and read at its offset, a ``.tar.gz`` member through its saved
``indexed_gzip`` seek points (`dlpipe.converters.archives`)."""

from __future__ import annotations

import atexit
import tempfile
import zipfile
from collections.abc import Callable
from typing import IO, Any

from dlpipe.converters.archives import GZ_SPACING, Member
from dlpipe.converters.source import SampleError, display_path, file_stamp

__all__ = ["member_file", "read_member"]

_CHUNK = 1 << 20


class _Open:
    """The archives this process has open, each checked against its listing's stamp."""

    def __init__(self) -> None:
        # (path, stamp) -> (what reads members, the file under it that must be closed too)
        self._files: dict[tuple[str, tuple[int, int]], tuple[Any, IO[bytes] | None]] = {}

    def get(self, path: str, kind: str, stamp: tuple[int, int], gz_index: str | None) -> Any:
        key = (path, stamp)
        found = self._files.get(key)
        if found is None:
            if len(self._files) >= 8:
                self.close()
            found = self._open(path, kind, stamp, gz_index)
            self._files[key] = found
        return found[0]

    @staticmethod
    def _open(
        path: str, kind: str, stamp: tuple[int, int], gz_index: str | None
    ) -> tuple[Any, IO[bytes] | None]:
        f = open(path, "rb")  # noqa: SIM115 (kept open for the process's later reads)
        if file_stamp(f) != stamp:
            f.close()
            raise SampleError(
                f"{display_path(path)}: changed since the scan (its size or time differs); "
                "convert again"
            )
        if kind == "zip":
            return zipfile.ZipFile(f), f
        if kind == "tar":
            return f, None
        f.close()
        import indexed_gzip

        reader = indexed_gzip.indexed_gzip._IndexedGzipFile(  # unbuffered: exact reads
            path, spacing=GZ_SPACING, index_file=gz_index, drop_handles=False
        )
        return reader, None

    def close(self) -> None:
        for reader, under in self._files.values():
            reader.close()
            if under is not None:
                under.close()
        self._files.clear()


_OPEN = _Open()
atexit.register(_OPEN.close)  # closed, not left to the collector (ResourceWarning)


def read_member(
    path: str, kind: str, stamp: tuple[int, int], member: Member, gz_index: str | None
) -> bytes:
    """A member's bytes, read in place (a SampleError naming `path` and the member when the
    archive changed or its data is damaged)."""
    data = bytearray()
    _copy_member(path, kind, stamp, member, gz_index, data.extend)
    return bytes(data)


def member_file(
    path: str, kind: str, stamp: tuple[int, int], member: Member, gz_index: str | None
) -> IO[bytes]:
    """A member as a real file (an unlinked temporary one, so ``fileno``, ``fstat`` and
    ``mmap`` work as on the file unpacked), copied in bounded memory."""
    f = tempfile.TemporaryFile()  # noqa: SIM115 (the caller closes it)
    try:
        _copy_member(path, kind, stamp, member, gz_index, f.write)
    except BaseException:
        f.close()
        raise
    f.seek(0)
    return f


def _copy_member(
    path: str,
    kind: str,
    stamp: tuple[int, int],
    member: Member,
    gz_index: str | None,
    write: Callable[[bytes], Any],
) -> None:
    shown = f"{display_path(path)}: member {display_path(member.name)}"
    copied = 0
    try:
        f = _OPEN.get(path, kind, stamp, gz_index)
        if kind == "zip":
            with f.open(f.infolist()[member.where]) as stream:
                while chunk := stream.read(min(_CHUNK, member.size + 1 - copied)):
                    write(chunk)
                    copied += len(chunk)
        else:
            while copied < member.size:
                f.seek(member.where + copied)
                chunk = f.read(min(_CHUNK, member.size - copied))
                if not chunk:
                    break
                write(chunk)
                copied += len(chunk)
    except SampleError:
        raise
    except Exception as exc:  # zipfile's, tarfile's, indexed_gzip's ZranError and CrcError
        _OPEN.close()
        raise SampleError(f"{shown} cannot be read ({type(exc).__name__}: {exc})") from None
    if copied != member.size:
        raise SampleError(f"{shown} holds {copied} bytes, not the {member.size} listed")
