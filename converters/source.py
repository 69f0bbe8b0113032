"""What every raw-dataset source provides: a cheap `scan` that plans, a `load` that reads.

A source module (imagefolder, table, files, cifar, mnist, ...) subclasses `Source`:

- `detect(root)`: does `root` look like this layout? (cheap: names, not contents)
- `scan()`: every sample as an `Item` (key, split, label, a picklable `ref`, estimated bytes,
  image kind) plus the class names, without reading sample contents. The engine plans
  shards from it, so it must be deterministic.
- `load(item)`: the sample's fields, read in a worker process: the image's encoded bytes under
  ``"image"`` (whatever its file type), and any other fields under their final names (e.g.
  ``"json"`` for extra table columns). The engine adds ``cls`` from ``item.label``, decodes
  every image once (the integrity check), re-encodes it when asked or when its type differs
  from the dataset's image field, and stores it as ``jpg``/``png``/``webp``. A sample that
  cannot be read raises `SampleError`, which the engine skips or fails on as ``--on-error`` says.

Sources are pickled into worker processes (local pool or Ray): keep their state small and
open files lazily.

**What a source reads** (a raw folder is untrusted input; the rule every source follows):

- Only regular files. A FIFO, socket or device (even one named ``x.jpg``) is never opened by
  the scan and never read; it is one skipped entry, counted and listed (with its reason) in
  the scan description under ``skipped_entries`` and logged as a warning. Files are opened
  with ``O_NONBLOCK`` and read up to the size ``fstat`` gives, never to end of stream.
- Nothing outside the raw folder. A link to a file is followed only when its real path lies
  inside the raw folder's real path; a link out of it (``-> /dev/zero``, ``-> ~/secret.jpg``),
  a dangling link and a link loop are each one skipped entry. Links to folders are never
  followed (each is one skipped entry): inside the raw folder they could only scan a folder
  twice (``cat/loop -> ..``, ``dog -> cat``), outside it they leave it. Each real folder is
  scanned once (by device and inode), so even a bind-mount loop ends.
- No OS or tool folders: hidden names (a leading dot: ``.git``, ``.DS_Store``, AppleDouble
  ``._*``, ``.Trash-1000``) and the names in `IGNORED_NAMES` (``__MACOSX``, ``@eaDir``,
  ``Thumbs.db``, ``$RECYCLE.BIN``, ...) are never classes, samples or tables.
- Any file name: names that are not UTF-8 are kept as their bytes in keys (``%XX``) and shown
  with ``\\xNN`` escapes in messages, class names and the manifest (`display_path`).
"""

from __future__ import annotations

import argparse
import errno
import functools
import logging
import os
import stat
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, ClassVar

from dlpipe import storage
from dlpipe.converters.source_kinds import SOURCE_KINDS
from dlpipe.errors import DlpipeError
from dlpipe.options import Checked, OptionError, option

if TYPE_CHECKING:
    from dlpipe.converters.raw_tree import Listings

__all__ = [
    "IGNORED_NAMES",
    "IMAGE_SUFFIXES",
    "SPLIT_NAMES",
    "SPLIT_WORDS",
    "ConvertOptionError",
    "Item",
    "SampleError",
    "Scan",
    "Source",
    "SourceError",
    "SourceOptions",
    "display_path",
    "file_problem",
    "file_stamp",
    "image_kind_of_bytes",
    "image_kind_of_name",
    "is_ignored_name",
    "open_regular",
    "raw_folder_of",
    "read_file",
    "read_text",
    "unlistable",
]

log = logging.getLogger("dlpipe")

SPLIT_NAMES = {"train": "train", "val": "val", "validation": "val", "test": "test"}
"""Folder, file or column names that mean a split → the split's name in the dataset."""

SPLIT_WORDS = {
    **SPLIT_NAMES,
    "training": "train",
    "valid": "val",
    "testing": "test",
}
"""Every spelling of a split in a name that says it is one (a COCO instances file's split, a
Kaggle split folder ``valid/``) → the split's name; `SPLIT_NAMES` where a name may also be a
class (a folder)."""

IMAGE_SUFFIXES = frozenset(
    {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm"}
)

IGNORED_NAMES = frozenset(
    {
        "__macosx",  # zip archives made on macOS
        "@eadir",  # Synology thumbnails
        "__pycache__",
        "$recycle.bin",
        "system volume information",
        "lost+found",
        "thumbs.db",
        "ehthumbs.db",
        "desktop.ini",
        "icon\r",
    }
)
"""OS and tool names (compared lower-case) that are never classes, samples or tables; names
with a leading dot (``.git``, ``.svn``, ``.hg``, ``.ipynb_checkpoints``, ``.DS_Store``, ``._*``,
``.Trash-*``) are skipped too (`is_ignored_name`)."""


class SourceError(DlpipeError, ValueError):
    """The raw input as a whole is unusable: empty, unknown layout, a missing column, ..."""


class SampleError(DlpipeError, ValueError):
    """One sample cannot be read or is not what it claims to be (skipped or fatal by policy)."""


@dataclass(frozen=True)
class Item:
    """One planned sample.

    Attributes:
        key: the sample key (already valid under the key rule).
        label: index into the scan's classes, or None when the source has no labels.
        split: ``train``/``val``/``test``..., or None to let ``--val-fraction`` decide.
        ref: what `Source.load` needs to read it (a path, a row number, ...); picklable.
        size: estimated stored bytes (file size, byte length), for shard planning.
        image_kind: ``jpg``/``png``/``webp``/``other`` for the sample's image, or None.
        origin: what to name in an error about this sample (a path, ``table.csv row 7``).
        original: the full name the key was made from, when the key rule forced a shortened
            key (the engine records it in ``keys.jsonl``); None otherwise.
    """

    key: str
    label: int | None
    split: str | None
    ref: Any
    size: int
    image_kind: str | None
    origin: str
    original: str | None = None


@dataclass(frozen=True)
class Scan:
    """A source's full listing: class names (label index → name) and items.

    Attributes:
        classes: label index → class name.
        items: every sample.
        description: where the samples came from (the manifest's ``source``): the layout,
            why it was chosen, and ``unused`` (what in the raw folder was not read, a count
            per kind: annotation files, split lists, masks, images no split or row names,
            other).
        task: what the dataset is for (`dlpipe.annotations.TASKS`), None when unknown.
        field_schemas: annotation field → its schema (`dlpipe.annotations`), for the manifest.
        class_ids: the dataset's own id of each class (COCO's gapped category ids, YOLO's
            ``names`` keys), None when the index is the id.
    """

    classes: tuple[str, ...]
    items: tuple[Item, ...]
    description: dict[str, Any] = field(default_factory=dict)
    task: str | None = None
    field_schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    class_ids: tuple[int | str, ...] | None = None


class ConvertOptionError(OptionError):
    """A conversion option is unknown, of the wrong type, or breaks its rule."""


def _label_rule(text: str) -> str:
    from dlpipe.converters.filenames import label_rule  # a source module: imports this one

    try:
        label_rule(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


@dataclass(frozen=True, kw_only=True)
class SourceOptions(Checked):
    """How to read the raw data: its layout, and what a user says about it (``dlpipe
    convert``'s source options; each layout reads the fields in its `Source.options_read`)."""

    option_error: ClassVar[type[OptionError]] = ConvertOptionError

    kind: str = option(
        "raw layout (default: detected)",
        default="auto",
        choices=("auto", *SOURCE_KINDS),
        name="source",
    )
    image_col: str | None = option("table column holding image paths or bytes", default=None)
    label_col: str | None = option(
        "table column holding labels (names or integers); none: the table has no labels",
        default=None,
    )
    image_root: str | None = option(
        "folder a table's image paths are looked up in after the table's own folder "
        "(default: the one sub-folder beside the table that holds them)",
        default=None,
        metavar="DIR",
    )
    key_col: str | None = option(
        "the table column whose values become sample keys (escaped and, when too long, "
        "shortened by the key rule; duplicates are refused; default: a __key__, key or id "
        "column, else keys from the image paths or row numbers)",
        default=None,
    )
    keep_empty_classes: bool = option(
        "keep class folders without images as classes with no samples (else refused)",
        default=False,
    )
    label_from: str | None = option(
        "labels from image file names (the filenames source): name-prefix, the name before "
        "its trailing number (cat.0.jpg: cat; great_pyrenees_173.jpg: great_pyrenees), or a "
        "regular expression searched in each file name whose one group, or group named label, "
        "is the label",
        default=None,
        parse=_label_rule,
        metavar="name-prefix|REGEX",
    )
    instance_masks: bool = option(
        "COCO's polygon and RLE segmentations as masks.json: one COCO RLE mask per object of "
        "boxes.json (the coco source; off: counted as unused)",
        default=False,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.label_from is not None and self.kind not in ("auto", "filenames"):
            raise ConvertOptionError(
                f"--label-from takes labels from image file names, which only --source "
                f"filenames reads, not --source {self.kind}; drop one of the two"
            )
        if self.instance_masks and self.kind not in ("auto", "coco"):
            raise ConvertOptionError(
                f"--instance-masks converts COCO's segmentations, which only --source coco "
                f"reads, not --source {self.kind}; drop one of the two"
            )


class Source(ABC):
    """A raw dataset layout. Subclasses set `kind` and implement detect, scan and load."""

    kind: ClassVar[str]
    options_read: ClassVar[frozenset[str]] = frozenset()
    """The `SourceOptions` fields this layout reads; any other one given is refused, never
    ignored (`dlpipe.converters.sources.refuse_unread_options`)."""

    def __init__(
        self,
        root: str,
        options: SourceOptions | None = None,
        *,
        listings: Listings | None = None,
    ) -> None:
        self.root = root if storage.is_url(root) else os.path.abspath(root)
        self.options = options or SourceOptions()
        self._listings = listings

    def take_listings(self) -> Listings | None:
        """The folder listings detection made, handed to the scan once (so no folder is listed
        twice, and none travels with the source into worker processes)."""
        listings, self._listings = self._listings, None
        return listings

    @functools.cached_property
    def raw_folder(self) -> str:
        """The real path of the folder nothing is read outside of (see `raw_folder_of`)."""
        return raw_folder_of(self.root)

    @classmethod
    @abstractmethod
    def detect(cls, root: str, listings: Listings | None = None) -> bool:
        """True when `root` has this source's layout (checked by names only).

        Args:
            root: the raw folder or file.
            listings: where a source that lists folders keeps its listings for the scan.
        """

    @abstractmethod
    def scan(self) -> Scan:
        """Every sample, without reading sample contents; raises SourceError when unusable."""

    @abstractmethod
    def load(self, item: Item) -> dict[str, bytes]:
        """The sample's fields: encoded image bytes under ``"image"``, others by name."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"


def display_path(path: str) -> str:
    """`path` as JSON-safe text: bytes that are not UTF-8 shown as ``\\xNN``; a path in an
    unpacked view of archives as its archive member or raw file.

    Other characters stay as they are, control characters too: the result is data as well as
    message text (class names, the manifest's source account, ``keys.jsonl`` and
    ``errors.jsonl`` keep the real names). A terminal never sees them raw: the CLI escapes
    every line it prints (`dlpipe.text.printable`: ``\\x1b``, ``\\u202e``, ...).
    """
    path = _view_path_shown(path)
    try:
        return os.fsencode(path).decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return path.encode("utf-8", "backslashreplace").decode("utf-8")


def _view_path_shown(path: str) -> str:
    from dlpipe.converters.view_targets import shown_path  # it reads through this module

    return shown_path(path)


def is_ignored_name(name: str) -> bool:
    """True for hidden names and the OS/tool names of `IGNORED_NAMES`."""
    return name.startswith(".") or name.lower() in IGNORED_NAMES


def raw_folder_of(root: str) -> str:
    """The real path of the folder a source reads nothing outside of: `root` itself, or the
    folder holding it when `root` is a file (a table file)."""
    if storage.is_url(root):
        return root
    real = os.path.realpath(root)
    return real if os.path.isdir(real) else os.path.dirname(real)


def _link_problem(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "a symbolic link loop"
    if exc.errno == errno.ENOENT:
        return "a dangling symbolic link"
    return f"a link that cannot be followed ({exc.strerror or exc})"


def unlistable(folder: str, exc: OSError) -> SourceError:
    """The error for a raw folder that cannot be listed (a class would silently lose images)."""
    return SourceError(
        f"{display_path(folder)}: cannot be listed ({exc.strerror or exc}); fix its "
        "permissions or remove it"
    )


def file_problem(path: str, folder: str) -> str | None:
    """Why `path` is no regular file inside the real folder `folder`; None when it is one.

    Checked without opening the file: a FIFO, a device or a link out of the folder is named.
    """
    real = os.path.realpath(path)
    if not storage.is_inside(real, folder):
        shown = f"{display_path(real)}, outside the raw folder {display_path(folder)}"
        return f"a link to {shown}" if os.path.islink(path) else f"resolves to {shown}"
    try:
        mode = os.stat(real).st_mode
    except OSError as exc:
        return _link_problem(exc) if os.path.islink(path) else (exc.strerror or str(exc))
    return None if stat.S_ISREG(mode) else storage.file_kind(mode)


def open_regular(path: str, folder: str | None = None) -> IO[bytes]:
    """Open a raw file for reading, refusing anything but a regular file (inside `folder`).

    The open cannot hang (``O_NONBLOCK``: a FIFO opens at once and is then refused) and, when
    `folder` is given, follows no link out of it: a file that is no link is opened with
    ``O_NOFOLLOW`` and kept when the kernel places it inside `folder`; a link's real path is
    checked, then opened with ``O_NOFOLLOW``.

    Raises:
        SampleError: the file is missing, unreadable, outside `folder` or not a regular file.
    """
    from dlpipe.converters.view_targets import target_of

    placeholder = target_of(path)
    if placeholder is not None:  # an archive member or raw file, as unpacked (archive_view)
        return placeholder.open()
    return _open_raw(path, folder)


def _open_raw(path: str, folder: str | None) -> IO[bytes]:
    """A raw file that is no view placeholder: a URL's object, or a local regular file."""
    if storage.is_url(path):
        return _open_url(path)
    if folder is not None:
        opened = _open_inside(path, folder)
        if opened is not None:
            return opened
    target = path
    if folder is not None:
        target = os.path.realpath(path)
        if not storage.is_inside(target, folder):
            raise SampleError(
                f"{display_path(path)}: {file_problem(path, folder)}; dlpipe reads only "
                "files inside the raw folder (copy the file in, or give a folder above both)"
            )
    try:
        return storage.open_regular(target, follow_links=folder is None)
    except storage.NotRegularFileError as exc:
        raise _not_regular(path, exc.kind) from None
    except OSError as exc:
        reason = _link_problem(exc) if os.path.islink(target) else exc.strerror or exc
        raise SampleError(f"{display_path(path)}: cannot be read ({reason})") from exc


def _not_regular(path: str, kind: str) -> SampleError:
    return SampleError(
        f"{display_path(path)}: is {kind}; dlpipe reads only regular files (replace it with "
        "the file itself, or remove it)"
    )


def _open_inside(path: str, folder: str) -> IO[bytes] | None:
    """`path` opened without resolving it first, when it is no link and its opened file lies
    inside the real `folder`; None sends the caller to the slow path (see `_fd_inside`).

    Raises:
        SampleError: the file inside `folder` is no regular file (a FIFO, a device).
    """
    fd = _fd_inside(path, folder)
    return None if fd is None else os.fdopen(fd[0], "rb")


def _fd_inside(path: str, folder: str) -> tuple[int, int] | None:
    """The open descriptor and size of `path` when it is no link and its opened file lies
    inside the real `folder`; None sends the caller to the slow path, which resolves the path
    and names what is wrong (a link, a file outside `folder`, a missing file, no ``/proc``).

    The kernel says where the opened file is (``/proc/self/fd``), so the check is on the file
    read, not on a path that could change after it (``os.path.realpath``, 13-50 us a file).

    Raises:
        SampleError: the file inside `folder` is no regular file (a FIFO, a device).
    """
    no_follow = getattr(os, "O_NOFOLLOW", 0)
    if not no_follow:  # Windows
        return None
    try:
        fd = os.open(path, os.O_RDONLY | no_follow | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # a link, missing, unreadable, ...
        return None
    try:
        inside = storage.is_inside(os.readlink(f"/proc/self/fd/{fd}"), folder)
        info = os.fstat(fd)
    except OSError:  # no /proc
        inside = False
    if not inside:
        os.close(fd)
        return None
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _not_regular(path, storage.file_kind(info.st_mode))
    os.set_blocking(fd, True)
    return fd, info.st_size


def read_file(path: str, folder: str | None = None, *, max_bytes: int | None = None) -> bytes:
    """A raw regular file's bytes, read up to its size on disk (see `open_regular`).

    Args:
        path: the file.
        folder: the real raw folder the file must lie in (links out of it are refused).
        max_bytes: refuse a larger file (a label file, a class list).

    Raises:
        SampleError: the file cannot be read, is not a regular file, lies outside `folder`,
            or is over `max_bytes`.
    """
    from dlpipe.converters.view_targets import target_of

    placeholder = target_of(path)
    if placeholder is not None:  # an archive member or raw file, as unpacked (archive_view)
        _check_size(path, placeholder.size, max_bytes)
        return placeholder.read()
    opened = None if folder is None or storage.is_url(path) else _fd_inside(path, folder)
    if opened is not None:  # the common case, read straight from the descriptor
        fd, size = opened
        try:
            _check_size(path, size, max_bytes)
            return _read_fd(path, fd, size)
        finally:
            os.close(fd)
    with _open_raw(path, folder) as f:
        size = file_stamp(f)[0]
        _check_size(path, size, max_bytes)
        try:
            return f.read(size)
        except OSError as exc:
            raise _unreadable(path, exc) from exc


def _read_fd(path: str, fd: int, size: int) -> bytes:
    """Up to `size` bytes of the open regular file `fd` (fewer only when it ends sooner)."""
    try:
        return storage.read_at(fd, 0, size)
    except OSError as exc:
        raise _unreadable(path, exc) from exc


def _unreadable(path: str, exc: OSError) -> SampleError:
    return SampleError(f"{display_path(path)}: cannot be read ({exc.strerror or exc})")


def _open_url(url: str) -> IO[bytes]:
    try:
        return storage.open_read(url)
    except (OSError, ValueError, ImportError) as exc:  # FileNotFoundError, PermissionError...
        raise SampleError(f"{url}: cannot be read ({type(exc).__name__}: {exc})") from None


def file_stamp(f: IO[bytes]) -> tuple[int, int]:
    """An opened raw file's (size, version): a local file's size and modification time; a
    URL's size and a checksum of its ETag (or time), so a file replaced after the scan is
    caught before its bytes are read as the scan's."""
    details = getattr(f, "details", None)
    if isinstance(details, dict):  # an fsspec file
        version = details.get("ETag") or details.get("mtime") or details.get("LastModified")
        return int(details.get("size") or 0), zlib.crc32(str(version or "").encode())
    try:
        info = os.fstat(f.fileno())
    except (OSError, ValueError):  # an in-memory file (fsspec's memory://)
        position = f.tell()
        size = f.seek(0, os.SEEK_END)
        f.seek(position)
        return size, 0
    return info.st_size, info.st_mtime_ns


def _check_size(path: str, size: int, max_bytes: int | None) -> None:
    if max_bytes is not None and size > max_bytes:
        raise SampleError(
            f"{display_path(path)}: {size} bytes, over the {max_bytes}-byte limit for "
            "this kind of file"
        )


def image_kind_of_bytes(data: bytes) -> str:
    """``jpg``/``png``/``webp``/``other`` from an encoded image's magic bytes."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return "other"


def image_kind_of_name(name: str) -> str | None:
    """``jpg``/``png``/``webp``/``other`` from a file name's suffix; None when not an image."""
    suffix = os.path.splitext(name)[1].lower()
    if suffix not in IMAGE_SUFFIXES:
        return None
    return {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}.get(suffix, "other")


def read_text(path: str, folder: str, *, max_bytes: int, fix: str) -> str:
    """A small raw text file (a list, a class table, a label map) as UTF-8, a byte-order mark
    dropped; read as `read_file` reads (a regular file inside `folder`, at most `max_bytes`).

    Raises:
        SourceError: ``<path>: <why>; <fix>``, the file being unreadable, too large, not a
            regular file inside `folder`, or not UTF-8.
    """
    try:
        return read_file(path, folder, max_bytes=max_bytes).decode("utf-8-sig")
    except SampleError as exc:
        raise SourceError(f"{exc}; {fix}") from None
    except UnicodeDecodeError as exc:
        raise SourceError(f"{display_path(path)}: not UTF-8 text ({exc}); {fix}") from None
