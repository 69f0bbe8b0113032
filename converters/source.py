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
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dlpipe.errors import DlpipeError

__all__ = [
    "IMAGE_SUFFIXES",
    "SPLIT_NAMES",
    "Item",
    "SampleError",
    "Scan",
    "Source",
    "SourceError",
    "SourceOptions",
    "image_kind_of_bytes",
    "image_kind_of_name",
    "read_file",
]

SPLIT_NAMES = {"train": "train", "val": "val", "validation": "val", "test": "test"}
"""Folder, file or column names that mean a split → the split's name in the dataset."""

IMAGE_SUFFIXES = frozenset(
    {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm"}
)


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
    """A source's full listing: class names (label index → name) and items."""

    classes: tuple[str, ...]
    items: tuple[Item, ...]
    description: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class SourceOptions:
    """Options a user may give about the raw layout."""

    image_col: str | None = None
    label_col: str | None = None


class Source(ABC):
    """A raw dataset layout. Subclasses set `kind` and implement detect, scan and load."""

    kind: ClassVar[str]

    def __init__(self, root: str, options: SourceOptions | None = None) -> None:
        self.root = os.path.abspath(root)
        self.options = options or SourceOptions()

    @classmethod
    @abstractmethod
    def detect(cls, root: str) -> bool:
        """True when `root` has this source's layout (checked by names only)."""

    @abstractmethod
    def scan(self) -> Scan:
        """Every sample, without reading sample contents; raises SourceError when unusable."""

    @abstractmethod
    def load(self, item: Item) -> dict[str, bytes]:
        """The sample's fields: encoded image bytes under ``"image"``, others by name."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"


def read_file(path: str) -> bytes:
    """A raw file's bytes; an unreadable file is a `SampleError` naming it."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise SampleError(f"{path}: cannot be read ({exc.strerror or exc})") from exc


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
