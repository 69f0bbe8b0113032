"""A Pascal VOC year folder's class list: VOC's own 20 classes, or the ``labelmap.txt`` that
CVAT's and Datumaro's "Pascal VOC" exports write at the top of the year folder.

``labelmap.txt`` as Datumaro writes it (``write_label_map``; CVAT exports through Datumaro)::

    # label:color_rgb:parts:actions
    background:0,0,0::
    cat:128,0,0::
    person:192,128,128:head,hand,foot:jumping,phoning

Empty lines and lines starting with ``#`` are comments; every other line is four
``:``-separated fields: the label name, its mask colour ``r,g,b`` (may be empty), and the
person-layout parts and actions (not kept). The line in VOC's border colour ``224,224,192``
(Datumaro's ``ignored``) is the void, not a class: mask value 255. The other lines are the
classes, in file order. A line without four fields or a name, a colour that is not three
numbers 0-255, a name or colour given twice is a `SourceError` naming the file and line.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from dlpipe.annotations import voc_colour
from dlpipe.converters.source import (
    SampleError,
    SourceError,
    display_path,
    read_text,
)

__all__ = ["VOC_CLASSES", "VOC_LABELMAP", "VOID_COLOUR", "Labelmap", "read_labelmap"]

VOC_CLASSES = ("aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair",
               "cow", "diningtable", "dog", "horse", "motorbike", "person", "pottedplant",
               "sheep", "sofa", "train", "tvmonitor")  # fmt: skip
"""VOC's 20 object classes in the devkit's order (``VOCinit.m``)."""
VOID = 255
VOID_COLOUR = (224, 224, 192)
"""VOC's colour of the void border (palette index 255)."""
_MAX_LABELMAP_BYTES = 1 << 20  # Datumaro's VOC labelmap is under 1 KB
_CHANNEL = re.compile(r"\d{1,3}")
_BACKGROUND = "background"

Colour = tuple[int, int, int]


@dataclass(frozen=True)
class Labelmap:
    """The labels of a VOC year folder.

    Attributes:
        names: the labels in file order, the void (`VOID_COLOUR`) left out.
        colours: each label's mask colour (None where the line gives none).
        has_void: the labelmap lists the void colour, mapped to 255 in an RGB mask.
        path: the ``labelmap.txt`` read, None for VOC's own classes.
    """

    names: tuple[str, ...]
    colours: tuple[Colour | None, ...]
    has_void: bool
    path: str | None = None

    def classes(self, task: str) -> tuple[str, ...]:
        """Detection: the names without ``background``; segmentation: every name (index =
        mask value).

        Raises:
            SourceError: a segmentation labelmap of more than 255 classes (0-254; 255 is void).
        """
        if task == "detection":
            return tuple(n for n in self.names if n != _BACKGROUND)
        if len(self.names) > VOID:
            raise SourceError(
                f"{self.shown}: lists {len(self.names)} labels; a voc-seg mask holds at most "
                f"{VOID} classes (0-{VOID - 1}, {VOID} the void): merge labels"
            )
        return self.names

    @property
    def shown(self) -> str:
        """The labelmap's path, or what stands for VOC's own classes, for messages."""
        return display_path(self.path) if self.path else "VOC's classes"

    def unknown_class(self, task: str) -> str:
        """What an object's unknown class name is not one of, for a message."""
        if self.path is None:
            return f"not one of VOC's 20 classes ({', '.join(VOC_CLASSES)})"
        classes = self.classes(task)
        listed = ", ".join(classes[:30]) + (", ..." if len(classes) > 30 else "")
        return f"not one of the {len(classes)} classes of {self.shown} ({listed})"

    @functools.cached_property
    def detection_index(self) -> dict[str, int]:
        """Class name → label of a detection object."""
        return {name: i for i, name in enumerate(self.classes("detection"))}

    @functools.cached_property
    def _colour_index(self) -> dict[int, int]:
        """Packed ``r << 16 | g << 8 | b`` → mask value."""
        found = {_pack(c): i for i, c in enumerate(self.colours) if c is not None}
        if self.has_void:
            found[_pack(VOID_COLOUR)] = VOID
        return found

    def indices_of_colours(self, pixels: np.ndarray, origin: str) -> np.ndarray:
        """An RGB mask's (H, W, 3) colours as (H, W) class indices, 255 for the void colour.

        Raises:
            SampleError: a colour the labelmap does not list.
        """
        r, g, b = (pixels[..., c].astype(np.uint32) for c in range(3))
        packed = (r << 16) | (g << 8) | b
        colours, inverse = np.unique(packed, return_inverse=True)
        lookup = self._colour_index
        unknown = [int(c) for c in colours if int(c) not in lookup]
        if unknown:
            shown = "; ".join(",".join(map(str, _unpack(c))) for c in unknown[:5])
            raise SampleError(
                f"{origin}: colours {shown} are no label of {self.shown} (an RGB class mask "
                "uses the labelmap's colours); add the label, or repaint those pixels"
            )
        values = np.array([lookup[int(c)] for c in colours], np.uint8)
        return values[inverse.reshape(-1)].reshape(packed.shape)


VOC_LABELMAP = Labelmap(
    (_BACKGROUND, *VOC_CLASSES),
    tuple(voc_colour(i) for i in range(len(VOC_CLASSES) + 1)),
    has_void=True,
)
"""VOC's own labels: background, the 20 classes, the void border (Datumaro's default map)."""


def _pack(colour: Colour) -> int:
    return (colour[0] << 16) | (colour[1] << 8) | colour[2]


def _unpack(packed: int) -> Colour:
    return (packed >> 16) & 255, (packed >> 8) & 255, packed & 255


def read_labelmap(path: str, raw_folder: str) -> Labelmap:
    """The labels of a ``labelmap.txt`` (a regular file inside `raw_folder`).

    Raises:
        SourceError: the file cannot be read, or a line is malformed (named with its number).
    """
    shown = display_path(path)
    text = read_text(path, raw_folder, max_bytes=_MAX_LABELMAP_BYTES, fix="export it again")
    names: dict[str, int] = {}
    colours: dict[Colour, int] = {}
    labels: list[tuple[str, Colour | None]] = []
    has_void = False
    for number, line in enumerate(text.splitlines(), 1):
        text_line = line.strip()
        if not text_line or text_line.startswith("#"):
            continue
        name, colour = _label(text_line, f"{shown} line {number}")
        where = f"{shown} line {number}: label {name[:40]!r}"
        _once(names, name, number, where, "give each label one line (remove or rename one)")
        if colour is not None:
            where = f"{shown} line {number}: colour {','.join(map(str, colour))}"
            _once(colours, colour, number, where, "give each label its own colour")
        if colour == VOID_COLOUR:
            has_void = True
        else:
            labels.append((name, colour))
    if not labels:
        raise SourceError(
            f"{shown}: lists no label; write one line name:r,g,b:parts:actions per label "
            "(background:0,0,0:: first), or remove the file to read VOC's own classes"
        )
    return Labelmap(
        tuple(n for n, _ in labels), tuple(c for _, c in labels), has_void=has_void, path=path
    )


def _label(line: str, where: str) -> tuple[str, Colour | None]:
    """(name, colour) of one ``name:r,g,b:parts:actions`` line."""
    fields = line.split(":")
    example = "write name:r,g,b:parts:actions, such as cat:128,0,0::"
    if len(fields) != 4:
        raise SourceError(
            f"{where}: {line[:60]!r} has {len(fields)} ':'-separated fields, not 4; {example}"
        )
    name, colour = fields[0].strip(), fields[1].strip()
    if not name:
        raise SourceError(f"{where}: {line[:60]!r} has no label name; {example}")
    if not colour:
        return name, None
    channels = [c.strip() for c in colour.split(",")]
    if len(channels) != 3 or not all(_CHANNEL.fullmatch(c) and int(c) <= 255 for c in channels):
        raise SourceError(
            f"{where}: label {name[:40]!r} has colour {colour[:40]!r}, not r,g,b with each "
            f"0-255; {example}"
        )
    return name, (int(channels[0]), int(channels[1]), int(channels[2]))


def _once(seen: dict[Any, int], value: object, number: int, where: str, fix: str) -> None:
    """Refuse a name or colour already given on an earlier line."""
    if value in seen:
        raise SourceError(f"{where} is given twice (also line {seen[value]}); {fix}")
    seen[value] = number
