"""Archives as downloaded (``.zip``, ``.tar``, ``.tar.gz``/``.tgz``): their members listed
once, and any member read in place, without unpacking the archive.

- A **zip** is read through its central directory (random access by nature). Its declared
  sizes bound every read (``zipfile`` stops at a member's declared size and checks its CRC);
  an archive that declares more than deflate's 1032:1 ratio allows, whose members' data
  overlap (the overlapping-entries bomb) or whose central directory is damaged is refused
  whole; an encrypted member or an unknown compression method is one skipped entry.
- A plain **tar** is walked header by header, seeking over member data; a member is one seek
  and read at its offset.
- A **gzip-compressed tar** has no random access of its own: the scan decompresses it once
  with ``indexed_gzip``, which keeps a seek point (32 KiB of inflate window) every
  `GZ_SPACING` bytes of the tar, so a member costs at most that much decompression. The
  index is saved beside the listing, and each worker process imports it. A stream that
  inflates to more than `_MAX_RATIO` times its size (a gzip bomb) is refused.

Tar headers are parsed with the WebDataset reader's refusals (`dlpipe.formats.wds`): a pax
header of any claimed size is never read into memory. Member names are untrusted: an
absolute name, a ``..`` step, a link, a device or a FIFO is one skipped entry (the archive
is read as if unpacked, so nothing can land outside its folder), as is a member replaced by a
later one of the same name. Other compressions (``.tar.bz2``, ``.tar.xz``, ``.tar.zst``,
``.7z``, ``.rar``) are refused with the command that makes them readable.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dlpipe.converters.source import SourceError, display_path
from dlpipe.converters.wds_tars import KEY_EXT
from dlpipe.formats.wds import RefusedHeaderError, StrictTarInfo

__all__ = [
    "GZ_SPACING",
    "Archive",
    "Member",
    "archive_kind",
    "index_archive",
    "looks_like_shard",
    "refuse_unreadable_archive",
    "top_names",
]

GZ_SPACING = 1 << 20  # a member read decompresses at most this much more than its size
_MAX_RATIO = 1032  # deflate's best ratio: more out of a zip or gzip stream is a bomb
_PEEK = 64  # tar members looked at to tell a WebDataset shard from a packed folder
_UNREADABLE = {  # suffix -> the command that makes it readable
    **dict.fromkeys((".tar.bz2", ".tbz2", ".tbz"), "bunzip2 -k"),
    **dict.fromkeys((".tar.xz", ".txz"), "unxz -k"),
    **dict.fromkeys((".tar.zst", ".tzst"), "zstd -d"),
    ".tar.lz4": "lz4 -d",
    ".7z": "7z x",
    ".rar": "unrar x",
}
_UNPACK_ONLY = (".7z", ".rar")  # the others are tars without random access: decompress them
_LINK_TYPES = {
    tarfile.SYMTYPE: "a symbolic link in the archive (links are not followed)",
    tarfile.LNKTYPE: "a hard link in the archive (links are not followed)",
    tarfile.CHRTYPE: "a device in the archive",
    tarfile.BLKTYPE: "a device in the archive",
    tarfile.FIFOTYPE: "a FIFO in the archive",
}


def archive_kind(name: str) -> str | None:
    """``zip``, ``tar`` or ``tgz`` from a file name's suffix; None when it is no archive that
    dlpipe reads in place."""
    lower = name.lower()
    if lower.endswith(".zip"):
        return "zip"
    if lower.endswith(".tar"):
        return "tar"
    if lower.endswith((".tar.gz", ".tgz")):
        return "tgz"
    return None


def refuse_unreadable_archive(path: str) -> None:
    """A `SourceError` for an archive dlpipe cannot read in place, with the command that
    makes it readable; nothing for any other file."""
    lower = path.lower()
    suffix = next((s for s in _UNREADABLE if lower.endswith(s)), None)
    if suffix is None:
        return
    command = f"`{_UNREADABLE[suffix]} {display_path(path)}`"
    if suffix not in _UNPACK_ONLY:
        why = "has no random access that dlpipe can use"
        fix = f"decompress it to a plain .tar ({command}), which convert reads in place"
    else:
        why = "is not an archive dlpipe reads in place (.zip, .tar, .tar.gz)"
        fix = f"unpack it ({command}) and convert the folder"
    raise SourceError(f"{display_path(path)}: a {suffix} archive {why}; {fix}")


@dataclass(frozen=True)
class Member:
    """A regular file inside an archive: its safe relative name, size and where it lies
    (the zip member's position in the central directory; the tar member's data offset)."""

    name: str
    size: int
    where: int


@dataclass
class Archive:
    """An archive's listing: its kind, the (size, mtime) it was listed at, its regular-file
    members, its folders, and the members skipped (name → why)."""

    path: str
    kind: str
    stamp: tuple[int, int]
    members: list[Member] = field(default_factory=list)
    folders: set[str] = field(default_factory=set)
    skipped: dict[str, str] = field(default_factory=dict)

    def add(self, raw_name: str, size: int, where: int, is_dir: bool = False) -> None:
        name, problem = _safe_name(raw_name)
        if problem is not None:
            self.skipped.setdefault(raw_name, problem)
        elif is_dir:
            self.folders.add(name)
        elif name:
            self.members.append(Member(name, size, where))


def _safe_name(raw: str) -> tuple[str, str | None]:
    """The member's name as a relative ``/`` path, or why it is unsafe (it would land outside
    the folder it is unpacked in)."""
    name = raw.replace("\\", "/")  # zips made on Windows
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return "", "an absolute path in the archive"
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        return "", "a '..' path in the archive (it would land outside its folder)"
    if "\x00" in name:
        return "", "a NUL byte in its name"
    return "/".join(parts), None


def _stamp(path: str) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_size, info.st_mtime_ns


def index_archive(path: str, gz_index: str | None = None) -> Archive:
    """List `path`'s members (module docstring); for a ``tgz``, save its seek points to
    `gz_index`.

    Raises:
        SourceError: the archive cannot be read, is damaged or is a bomb.
    """
    kind = archive_kind(path)
    assert kind is not None, path
    try:
        archive = Archive(path, kind, _stamp(path))
        if kind == "zip":
            _index_zip(archive)
        else:
            _index_tar(archive, gz_index)
    except SourceError:
        raise
    except (zipfile.BadZipFile, tarfile.TarError, RefusedHeaderError, EOFError, ValueError) as exc:
        raise SourceError(
            f"{display_path(path)}: not a readable {kind} archive ({exc}); download it again"
        ) from None
    except OSError as exc:
        raise SourceError(
            f"{display_path(path)}: cannot be read ({exc.strerror or exc}); download it again"
        ) from None
    return archive


def _most_bytes(archive: Archive) -> int:
    """The most bytes the archive's compressed data can inflate to (a MiB of slack)."""
    return _MAX_RATIO * max(archive.stamp[0], 1) + (1 << 20)


def _index_zip(archive: Archive) -> None:
    with zipfile.ZipFile(archive.path) as zf:
        infos = zf.infolist()
    declared = sum(i.file_size for i in infos)
    if declared > _most_bytes(archive):
        raise SourceError(
            f"{display_path(archive.path)}: its members claim {declared} bytes from a "
            f"{archive.stamp[0]}-byte file, more than compression can give (a zip bomb); "
            "refused"
        )
    spans = sorted((i.header_offset, i.header_offset + i.compress_size) for i in infos)
    if any(end > nxt for (_, end), (nxt, _) in itertools.pairwise(spans)):
        raise SourceError(
            f"{display_path(archive.path)}: its members' data overlap (a zip bomb or a "
            "damaged archive); refused"
        )
    for position, info in enumerate(infos):
        if info.flag_bits & 0x1:
            archive.skipped.setdefault(info.filename, "encrypted")
        elif not _supported(info):
            archive.skipped.setdefault(info.filename, "an unknown compression method")
        else:
            archive.add(info.filename, info.file_size, position, info.is_dir())


def _supported(info: zipfile.ZipInfo) -> bool:
    return info.compress_type in (
        zipfile.ZIP_STORED,
        zipfile.ZIP_DEFLATED,
        zipfile.ZIP_BZIP2,
        zipfile.ZIP_LZMA,
    )


def _index_tar(archive: Archive, gz_index: str | None) -> None:
    with _tar_of(archive.path, archive.kind) as (f, tar):
        for member in _walk(tar, archive):
            if member.isreg():
                archive.add(member.name, member.size, member.offset_data)
            elif member.isdir():
                archive.add(member.name, 0, 0, is_dir=True)
            else:
                reason = _LINK_TYPES.get(member.type, f"a tar member of type {member.type!r}")
                archive.skipped.setdefault(member.name, reason)
        if gz_index is not None:
            f.raw.export_index(gz_index)


def _walk(tar: tarfile.TarFile, archive: Archive) -> Iterator[tarfile.TarInfo]:
    """The members, without keeping them all in memory, checking a gzip stream's ratio."""
    limit = _most_bytes(archive)
    while (member := tar.next()) is not None:
        if archive.kind == "tgz" and member.offset_data + member.size > limit:
            raise SourceError(
                f"{display_path(archive.path)}: inflates to more than {limit} bytes, more "
                "than gzip can give from its size (a gzip bomb); refused"
            )
        tar.members.clear()  # type: ignore[attr-defined]  # tarfile keeps every header
        yield member


@contextlib.contextmanager
def _tar_of(path: str, kind: str) -> Iterator[tuple[Any, tarfile.TarFile]]:
    """The tar (plain, or through a gzip stream that builds its seek points as it is read)
    and its header reader, with the WebDataset reader's refusals."""
    if kind == "tar":
        stream: Any = open(path, "rb")  # noqa: SIM115 (closed below)
    else:
        import indexed_gzip

        stream = indexed_gzip.IndexedGzipFile(
            path, spacing=GZ_SPACING, buffer_size=1 << 16, drop_handles=False
        )
    with stream, tarfile.open(fileobj=stream, mode="r:", tarinfo=StrictTarInfo) as tar:
        yield stream, tar


def top_names(path: str) -> set[str]:
    """The names at the top of the archive (the folders and files unpacking it would make
    beside it), read cheaply: a zip's whole central directory, a tar's first member only."""
    kind = archive_kind(path)
    try:
        if kind == "zip":
            with zipfile.ZipFile(path) as zf:
                names = zf.namelist()
        else:
            with _tar_of(path, kind or "tar") as (_, tar):
                first = tar.next()
                names = [first.name] if first is not None else []
    except (zipfile.BadZipFile, tarfile.TarError, RefusedHeaderError, EOFError, OSError):
        return set()  # indexing it names the problem
    return {top for n in names if (top := _safe_name(n)[0].split("/")[0])}


def looks_like_shard(path: str) -> bool:
    """True when the tar `path` reads as a WebDataset shard, not a packed folder: its first
    `_PEEK` files all lie at its top (no folder: ``k0.jpg``, ``k0.txt``), or at least half
    of them lie in runs of one key (``a/x.jpg`` then ``a/x.cls``), as the writers of shards
    make them (a packed folder's runs are rare: Pets' few ``.mat`` beside its photos)."""
    kind = archive_kind(path)
    if kind not in ("tar", "tgz"):
        return False
    keys: list[str | None] = []
    flat = True
    try:
        with _tar_of(path, kind) as (_, tar):
            while len(keys) < _PEEK and (member := tar.next()) is not None:
                flat = flat and "/" not in _safe_name(member.name)[0] and not member.isdir()
                if member.isreg():
                    match = KEY_EXT.fullmatch(member.name)
                    keys.append(match.group(1) if match else None)
    except (tarfile.TarError, RefusedHeaderError, EOFError, OSError):
        return False  # listing it names the problem
    if flat and keys:
        return True
    grouped = sum(
        1
        for i, key in enumerate(keys)
        if key is not None
        and ((i > 0 and keys[i - 1] == key) or (i + 1 < len(keys) and keys[i + 1] == key))
    )
    return grouped > 0 and 2 * grouped >= len(keys)
