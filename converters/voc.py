"""``voc`` and ``voc-seg``: Pascal VOC 2007-2012 as the devkit ships it, for detection or for
semantic segmentation.

Layout: ``root`` is a year folder (``VOC2012/`` with ``Annotations/``, ``ImageSets/``,
``JPEGImages/``, ``SegmentationClass/``, ``SegmentationObject/``), the ``VOCdevkit/`` folder
holding one, or the folder a VOC tar was unpacked into (``VOCdevkit/VOC2012/``; VOC2011's
``TrainVal/VOCdevkit/VOC2011/``). Several year folders are refused: give the one to convert.

One tree, two tasks, two source kinds (the task is a choice of files, not an option):

- ``voc`` (detection, torchvision's ``VOCDetection``): the ids of ``ImageSets/Main/train.txt``,
  ``val.txt`` and, when present, ``test.txt`` (VOC2007's test tar); ``trainval.txt`` is their
  union and is read only when neither ``train.txt`` nor ``val.txt`` exists (split
  ``trainval``). Each sample: ``JPEGImages/<id>.jpg`` and ``boxes.json`` from
  ``Annotations/<id>.xml``: every ``<object>``'s ``<name>`` (one of VOC's 20 classes, label =
  its index in `VOC_CLASSES`), its ``<bndbox>`` (1-based inclusive pixels, stored as the
  pixel-edge box ``[xmin - 1, ymin - 1, xmax, ymax]``) and its ``difficult`` and ``truncated``
  flags (0 when absent); ``pose``, ``occluded`` and the person-layout ``<part>`` boxes are not
  kept. Auto-detection picks ``voc`` when ``ImageSets/Main/`` is there.
- ``voc-seg`` (semantic segmentation, torchvision's ``VOCSegmentation``): the ids of
  ``ImageSets/Segmentation/{train,val,test}.txt`` (``trainval.txt`` as above); each sample:
  the image and ``seg.png``, ``SegmentationClass/<id>.png``'s palette indices as a mode ``L``
  PNG (every reader then sees the class index, not the palette colour): 0 = background,
  1-20 = `VOC_CLASSES`, 255 = the void border (the schema's ``ignore``). Classes:
  ``background`` + the 20. Give ``--source voc-seg``; it is auto-detected only where
  ``ImageSets/Main/`` is missing.

Keys are the ids (``2008_000008``). A split list whose line is not one id, an id listed twice
or in two splits, or more than half of a list's ids without their image or annotation file is
a `SourceError` naming the list; a ``test`` list whose ids mostly have no annotation (VOC2012's
withheld test set) is left out (``source.left_out``). One sample's missing file, malformed XML
(anything with a DTD or an entity declaration is refused unparsed), unknown class name, missing
or reversed ``<bndbox>``, a flag that is not 0/1, or a mask that is no palette/greyscale PNG or
holds a value outside 0-20 and 255, is a per-sample `SampleError`. ``source.unused`` counts the
annotation files, split lists (per-class lists, Action/Layout), masks (``SegmentationObject/``)
and other files (images in no split list) that were not read.
"""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from typing import Any, ClassVar
from xml.etree import ElementTree
from xml.parsers import expat

import numpy as np

from dlpipe import storage
from dlpipe.annotations import BOXES_FIELD, BOXES_SCHEMA, MASK_FIELD, encode_boxes, mask_schema
from dlpipe.codecs import open_image, stable_message
from dlpipe.converters.raw_tree import Listings, RawEntry, RawTree
from dlpipe.converters.source import (
    IMAGE_SUFFIXES,
    Item,
    SampleError,
    Scan,
    Source,
    SourceError,
    display_path,
    image_kind_of_name,
    read_file,
)
from dlpipe.sample import make_key, unescape_key

__all__ = ["VOC_CLASSES", "VocSegmentationSource", "VocSource", "read_voc_objects", "voc_roots"]

VOC_CLASSES = ("aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair",
               "cow", "diningtable", "dog", "horse", "motorbike", "person", "pottedplant",
               "sheep", "sofa", "train", "tvmonitor")  # fmt: skip
"""VOC's 20 object classes in the devkit's order (``VOCinit.m``)."""
_INDEX = {name: i for i, name in enumerate(VOC_CLASSES)}
_VOID = 255
_SPLITS = ("train", "val", "test")
_NESTS = ((), ("VOCdevkit",), ("TrainVal", "VOCdevkit"))
_MAX_LIST_BYTES = 16 << 20  # VOC2012's largest list (trainval.txt) is 180 KB
_MAX_XML_BYTES = 1 << 20  # VOC's annotation files are 1-5 KB
_MAX_MASK_BYTES = 64 << 20
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


@dataclass(frozen=True)
class _Task:
    """What one task reads from a year folder, and what it produces."""

    task: str
    lists: str  # ImageSets/<lists>/
    folder: str  # where each sample's annotation lies
    suffix: str
    classes: tuple[str, ...]
    schema: dict[str, dict[str, Any]]
    what: str  # the layout, for the description


_DETECTION = _Task(
    "detection", "Main", "Annotations", ".xml", VOC_CLASSES, {BOXES_FIELD: dict(BOXES_SCHEMA)},
    "Annotations/, ImageSets/Main/ and JPEGImages/ (Pascal VOC detection; --source voc-seg "
    "reads SegmentationClass/ instead)",
)  # fmt: skip
_SEGMENTATION = _Task(
    "segmentation", "Segmentation", "SegmentationClass", ".png", ("background", *VOC_CLASSES),
    {MASK_FIELD: mask_schema(None, ignore=_VOID)},
    "SegmentationClass/, ImageSets/Segmentation/ and JPEGImages/ (Pascal VOC semantic "
    "segmentation)",
)  # fmt: skip


def voc_roots(root: str) -> list[str]:
    """The VOC year folders `root` is or holds (by names: ``JPEGImages/`` and ``ImageSets/``)."""
    if _is_year_folder(root):
        return [root]
    found = []
    for nest in _NESTS:
        base = os.path.join(root, *nest)
        try:
            names = sorted(os.listdir(base))
        except OSError:
            continue
        found += [os.path.join(base, n) for n in names if _is_year_folder(os.path.join(base, n))]
    return found


def _is_year_folder(folder: str) -> bool:
    return all(os.path.isdir(os.path.join(folder, n)) for n in ("JPEGImages", "ImageSets"))


def _has_task(folder: str, task: _Task) -> bool:
    lists = os.path.join(folder, "ImageSets", task.lists)
    return os.path.isdir(lists) and os.path.isdir(os.path.join(folder, task.folder))


class _Refused(Exception):
    """A DTD or an entity declaration in an annotation file (never expanded)."""


def parse_xml(data: bytes, origin: str) -> ElementTree.Element:
    """The element tree of an untrusted XML file, refusing any DTD or entity declaration
    (so no entity is ever expanded: a billion laughs, an external file) in any encoding.

    Raises:
        SampleError: a DTD, malformed XML, or an encoding expat cannot read.
    """
    builder = ElementTree.TreeBuilder()
    parser = expat.ParserCreate()

    def refuse(*_: Any) -> None:
        raise _Refused

    parser.StartDoctypeDeclHandler = refuse
    parser.EntityDeclHandler = refuse
    parser.StartElementHandler = builder.start
    parser.EndElementHandler = builder.end
    parser.CharacterDataHandler = builder.data
    try:
        parser.Parse(data, True)
        return builder.close()
    except _Refused:
        raise SampleError(
            f"{origin}: holds a DTD or an entity declaration (<!DOCTYPE>, <!ENTITY>), which "
            "dlpipe never expands; VOC annotations have none (restore the file)"
        ) from None
    except (expat.ExpatError, ValueError, LookupError, AssertionError) as exc:
        raise SampleError(f"{origin}: not well-formed XML ({stable_message(exc)})") from None


def _coordinate(box: ElementTree.Element, tag: str, where: str) -> float:
    text = (box.findtext(tag) or "").strip()
    if not _NUMBER.fullmatch(text):
        raise SampleError(f"{where}: <{tag}> is {text[:40]!r}, not a number")
    return float(text)


def _flag(obj: ElementTree.Element, tag: str, where: str) -> int:
    text = obj.findtext(tag)
    if text is None:
        return 0
    if text.strip() not in ("0", "1"):
        raise SampleError(f"{where}: <{tag}> is {text.strip()[:40]!r}, not 0 or 1")
    return int(text)


def read_voc_objects(data: bytes, origin: str) -> bytes:
    """The ``boxes.json`` of one VOC annotation file (`encode_boxes`, labels into
    `VOC_CLASSES`, boxes ``[xmin - 1, ymin - 1, xmax, ymax]``, difficult and truncated flags).

    Raises:
        SampleError: naming the file, the object and what is wrong with it.
    """
    root = parse_xml(data, origin)
    if root.tag != "annotation":
        raise SampleError(f"{origin}: the root element is <{root.tag}>, not <annotation>")
    boxes: list[list[float]] = []
    labels, difficult, truncated = [], [], []
    for number, obj in enumerate(root.findall("object"), 1):
        name = (obj.findtext("name") or "").strip()
        where = f"{origin}: object {number} ({name[:40]!r})"
        if name not in _INDEX:
            raise SampleError(f"{where}: not one of VOC's 20 classes ({', '.join(VOC_CLASSES)})")
        box = obj.find("bndbox")
        if box is None:
            raise SampleError(f"{where}: has no <bndbox>")
        xmin, ymin, xmax, ymax = (
            _coordinate(box, t, where) for t in ("xmin", "ymin", "xmax", "ymax")
        )
        if xmax < xmin or ymax < ymin:
            raise SampleError(f"{where}: <bndbox> {xmin}, {ymin}, {xmax}, {ymax} is reversed")
        boxes.append([xmin - 1, ymin - 1, xmax, ymax])
        labels.append(_INDEX[name])
        difficult.append(_flag(obj, "difficult", where))
        truncated.append(_flag(obj, "truncated", where))
    return encode_boxes(boxes, labels, difficult=difficult, truncated=truncated)


def read_voc_mask(data: bytes, origin: str) -> bytes:
    """A ``SegmentationClass`` PNG's class indices as a mode ``L`` PNG.

    Raises:
        SampleError: not a palette or greyscale PNG, or a value outside 0-20 and 255.
    """
    from PIL import Image

    try:
        mask = open_image(data)
        mask.load()
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ...
        raise SampleError(f"{origin}: not a readable PNG ({stable_message(exc)})") from None
    if mask.format != "PNG" or mask.mode not in ("P", "L"):
        raise SampleError(
            f"{origin}: a {mask.format} image in mode {mask.mode}; a VOC class mask is a "
            "palette (or greyscale) PNG whose pixel value is the class index"
        )
    pixels = np.asarray(mask)
    bad = [int(v) for v in np.unique(pixels) if len(VOC_CLASSES) < v < _VOID]
    if bad:
        raise SampleError(
            f"{origin}: pixel values {bad[:5]} are no class (0 = background, 1-20 the classes, "
            "255 the void border)"
        )
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _read_ids(root: str, path: str) -> list[tuple[int, str]]:
    """(line number, id) of a split list: one id a line."""
    try:
        text = read_file(path, root, max_bytes=_MAX_LIST_BYTES).decode("utf-8-sig")
    except (SampleError, UnicodeDecodeError) as exc:
        raise SourceError(f"{display_path(path)}: {exc}; restore it from the download") from exc
    ids = []
    for number, line in enumerate(text.splitlines(), 1):
        word = line.strip()
        if not word:
            continue
        if len(word.split()) != 1 or "/" in word or "\\" in word or word.startswith("."):
            raise SourceError(
                f"{display_path(path)} line {number}: {word[:40]!r} is not one image id (a "
                "split list holds one id a line, such as 2008_000008; per-class lists "
                "'<id> 1' are not split lists)"
            )
        ids.append((number, word))
    return ids


class _VocSource(Source):
    """What both VOC tasks share: the year folder, the split lists, the items."""

    layout: ClassVar[_Task]

    @classmethod
    def detect(cls, root: str, listings: Listings | None = None) -> bool:
        """True when `root` is, or holds, a VOC year folder with this task's files."""
        return os.path.isdir(root) and any(_has_task(r, cls.layout) for r in voc_roots(root))

    def _year_folder(self) -> str:
        task = self.layout
        roots = [r for r in voc_roots(self.root) if _has_task(r, task)]
        if not roots:
            raise SourceError(
                f"{display_path(self.root)}: no VOC year folder with JPEGImages/, "
                f"ImageSets/{task.lists}/ and {task.folder}/ (expected VOC2012/, "
                "VOCdevkit/VOC2012/ or a folder holding VOCdevkit/)"
            )
        if len(roots) > 1:
            raise SourceError(
                f"{display_path(self.root)}: holds {len(roots)} VOC year folders "
                f"({', '.join(map(display_path, roots))}); give the one to convert as RAW"
            )
        if not storage.is_inside(os.path.realpath(roots[0]), self.raw_folder):
            raise SourceError(
                f"{display_path(roots[0])} is a symbolic link out of the raw folder; give the "
                "real folder as RAW"
            )
        return roots[0]

    def _lists(self, year: str) -> dict[str, str]:
        """Split → its list file: train/val/test, or trainval when neither train nor val."""
        folder = os.path.join(year, "ImageSets", self.layout.lists)
        found = {s: os.path.join(folder, f"{s}.txt") for s in _SPLITS}
        found = {s: p for s, p in found.items() if os.path.lexists(p)}
        trainval = os.path.join(folder, "trainval.txt")
        if "train" not in found and "val" not in found and os.path.lexists(trainval):
            found["trainval"] = trainval
        if not found:
            raise SourceError(
                f"{display_path(folder)}: no split list (train.txt, val.txt, trainval.txt); "
                "restore ImageSets/ from the VOC download"
            )
        return found

    def scan(self) -> Scan:
        year = self._year_folder()
        tree = RawTree(self.root, self.take_listings())
        files = {e.path: e for e in tree.files(year)}
        images = _by_stem(files, os.path.join(year, "JPEGImages"))
        items: list[Item] = []
        left_out: dict[str, str] = {}
        lists = self._lists(year)
        for split, path in lists.items():
            found = self._split_items(year, split, path, images, files)
            if isinstance(found, str):
                left_out[split] = found
            else:
                items += found
        _check_once(items, lists)
        used = set(lists.values()) | {p for item in items for p in item.ref[:2] if p}
        description = {
            "kind": self.kind,
            "root": display_path(self.root),
            "year_folder": display_path(year),
            "layout": f"{display_path(os.path.basename(year))}/ holds {self.layout.what}",
            "split_lists": {split: display_path(path) for split, path in lists.items()},
            "unused": _unused(year, files, used),
            **tree.report(),
        }
        if left_out:
            description["left_out"] = left_out
        return Scan(
            classes=self.layout.classes,
            items=tuple(items),
            description=description,
            task=self.layout.task,
            field_schemas=self.layout.schema,
        )

    def _split_items(
        self,
        year: str,
        split: str,
        path: str,
        images: dict[str, RawEntry],
        files: dict[str, RawEntry],
    ) -> list[Item] | str:
        """The split's items (one with a problem per id missing a file), or why a test split
        whose annotations are withheld is left out."""
        task, shown = self.layout, display_path(path)
        ids = _read_ids(self.raw_folder, path)
        items, lacking, unannotated = [], [], 0
        for number, ident in ids:
            image = images.get(ident)
            annotation = files.get(os.path.join(year, task.folder, ident + task.suffix))
            problem = None
            if image is None or annotation is None:
                unannotated += annotation is None
                missing = "JPEGImages" if image is None else task.folder
                problem = f"{shown} line {number}: id {ident!r} has no file in {missing}/"
                lacking.append(problem)
            key, shortened = make_key(ident)
            shown_image = display_path(os.path.join(year, "JPEGImages", f"{ident}.jpg"))
            origin = display_path(image.path) if image else shown_image
            size = sum(e.size for e in (image, annotation) if e is not None)
            kind = image_kind_of_name(image.name) if image else "jpg"
            ref = (image and image.path, annotation and annotation.path, problem)
            items.append(
                Item(key, None, split, ref, size, kind, origin, ident if shortened else None)
            )
        if ids and len(lacking) * 2 <= len(ids):
            return items
        if split == "test" and ids and unannotated * 2 > len(ids):
            return f"{shown}: {unannotated} of its {len(ids)} ids have no {task.folder}/ file"
        first = lacking[0] if lacking else f"{shown} lists no id"
        more = f", nor do {len(lacking) - 1} more of its {len(ids)} ids" if len(lacking) > 1 else ""
        raise SourceError(
            f"{first}{more}; restore JPEGImages/ and {task.folder}/ from the VOC download"
        )

    def load(self, item: Item) -> dict[str, bytes]:
        """The image and its ``boxes.json`` or ``seg.png``; SampleError for a bad annotation."""
        image, annotation, problem = item.ref
        if problem:
            raise SampleError(problem)
        fields = {"image": read_file(image, self.raw_folder)}
        origin = display_path(annotation)
        if self.layout is _DETECTION:
            data = read_file(annotation, self.raw_folder, max_bytes=_MAX_XML_BYTES)
            fields[BOXES_FIELD] = read_voc_objects(data, origin)
        else:
            data = read_file(annotation, self.raw_folder, max_bytes=_MAX_MASK_BYTES)
            fields[MASK_FIELD] = read_voc_mask(data, origin)
        return fields


def _check_once(items: list[Item], lists: dict[str, str]) -> None:
    """Refuse an id listed twice, in one split list or in two (a leak between splits)."""
    seen: dict[str, str] = {}
    for item in items:
        split = item.split or ""
        if item.key in seen:
            raise SourceError(
                f"{display_path(lists[split])}: id {unescape_key(item.key)!r} is listed twice "
                f"(also in {display_path(lists[seen[item.key]])}); each image belongs to one "
                "split (restore the lists from the VOC download)"
            )
        seen[item.key] = split


def _by_stem(files: dict[str, RawEntry], folder: str) -> dict[str, RawEntry]:
    """Image stem → entry of the images directly in `folder` (``.jpg`` first)."""
    found: dict[str, RawEntry] = {}
    for path, entry in files.items():
        stem, suffix = os.path.splitext(entry.name)
        image = os.path.dirname(path) == folder and suffix.lower() in IMAGE_SUFFIXES
        if image and (stem not in found or suffix == ".jpg"):
            found[stem] = entry
    return found


def _unused(year: str, files: dict[str, RawEntry], used: set[str]) -> dict[str, int]:
    """What was not read, by kind: annotation files, split lists, masks, other."""
    kinds = {"Annotations": "annotation files", "ImageSets": "split lists",
             "SegmentationClass": "masks", "SegmentationObject": "masks"}  # fmt: skip
    counts = dict.fromkeys(("annotation files", "split lists", "masks", "other"), 0)
    for path in files:
        if path not in used:
            top = os.path.relpath(path, year).split(os.sep, 1)[0]
            counts[kinds.get(top, "other")] += 1
    return counts


class VocSource(_VocSource):
    """Pascal VOC for detection: images and ``boxes.json`` (see the module docstring)."""

    kind = "voc"
    layout = _DETECTION


class VocSegmentationSource(_VocSource):
    """Pascal VOC for semantic segmentation: images and ``seg.png`` (the module docstring)."""

    kind = "voc-seg"
    layout = _SEGMENTATION
