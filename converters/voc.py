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
  its index in `VOC_CLASSES`; or of a labelmap's classes, below), its ``<bndbox>`` (1-based
  inclusive pixels, stored as the pixel-edge box ``[xmin - 1, ymin - 1, xmax, ymax]``) and its
  ``difficult`` and ``truncated`` flags (0 when absent); ``pose``, ``occluded`` and the
  person-layout ``<part>`` boxes are not kept. Auto-detection picks ``voc`` when
  ``ImageSets/Main/`` is there.
- ``voc-seg`` (semantic segmentation, torchvision's ``VOCSegmentation``): the ids of
  ``ImageSets/Segmentation/{train,val,test}.txt`` (``trainval.txt`` as above); each sample:
  the image and ``seg.png``, ``SegmentationClass/<id>.png``'s palette indices as a mode ``L``
  PNG (every reader then sees the class index, not the palette colour): 0 = background,
  1-20 = `VOC_CLASSES`, 255 = the void border (the schema's ``ignore``). Classes:
  ``background`` + the 20. Give ``--source voc-seg``; it is auto-detected only where
  ``ImageSets/Main/`` is missing.

Custom classes (CVAT's and Datumaro's "Pascal VOC" exports): a ``labelmap.txt`` at the top of
the year folder (`dlpipe.converters.voc_labelmap`: ``# label:color_rgb:parts:actions``, then
one ``name:r,g,b:parts:actions`` line per label, e.g. ``background:0,0,0::``,
``cat:128,0,0::``) replaces VOC's classes; its line in VOC's border colour ``224,224,192``
(Datumaro's ``ignored``) is the void, not a class. ``voc``: classes = its names in file order
without ``background`` (VOC detection has none). ``voc-seg``: classes = its names in file order
(``background`` first, index 0, as both tools write it); a palette or greyscale mask keeps its
values (value i = the labelmap's i-th label, 255 void); an RGB mask (what both tools write) is
mapped colour by colour to its label's index, ``224,224,192`` to 255 when the labelmap lists
it; a colour the labelmap does not list is a per-sample `SampleError` naming it. Without the
file an RGB mask is refused as before. A malformed labelmap (a line without four ``:`` fields
or a name, a colour that is not ``r,g,b`` 0-255, a name or colour given twice) is one
`SourceError` naming the file and line; VOC's own 21 lines (Datumaro's default map, with or
without ``ignored``) give exactly the classes and samples of a tree without it.

Subset lists (`dlpipe.converters.voc_lists`; CVAT names them after its subsets, as Datumaro
does): every ``ImageSets/Main/*.txt`` (voc-seg: ``ImageSets/Segmentation/*.txt``) but a
per-class list ``<class>_<subset>.txt`` (a labelmap class, else one of VOC's) is read. Its
name, case aside, maps as dlpipe's split names do (``Train`` → ``train``, ``Validation`` →
``val``); ``trainval`` only as above; CVAT's ``default.txt`` gives no split (all to train, or
``--val-fraction``); another name is its own split. A name that is not letters, digits and
``_`` after mapping, or two files mapping to one name, is a `SourceError` naming the files.

Keys are the ids (``2008_000008``). A split list whose line is not one id, an id listed twice
or in two splits, or more than half of a list's ids without their image or annotation file is
a `SourceError` naming the list; a ``test`` list whose ids mostly have no annotation (VOC2012's
withheld test set) is left out (``source.left_out``). One sample's missing file, malformed XML
(anything with a DTD or an entity declaration is refused unparsed), unknown class name, missing
or reversed ``<bndbox>``, a flag that is not 0/1, or a mask that is no palette/greyscale PNG
(or, with a labelmap, RGB PNG) or holds a value that is no class index and not 255 (outside
0-20 and 255 for VOC's classes), is a per-sample `SampleError`. ``source.unused`` counts the
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
from dlpipe.converters.voc_labelmap import (
    VOC_CLASSES,
    VOC_LABELMAP,
    VOID,
    Labelmap,
    read_labelmap,
)
from dlpipe.converters.voc_lists import check_once, read_ids, split_of, subset_lists
from dlpipe.sample import make_key

__all__ = ["VOC_CLASSES", "VocSegmentationSource", "VocSource", "read_voc_objects", "voc_roots"]

_LABELMAP = "labelmap.txt"
_NESTS = ((), ("VOCdevkit",), ("TrainVal", "VOCdevkit"))
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
    schema: dict[str, dict[str, Any]]
    what: str  # the layout, for the description


_DETECTION = _Task(
    "detection", "Main", "Annotations", ".xml", {BOXES_FIELD: dict(BOXES_SCHEMA)},
    "Annotations/, ImageSets/Main/ and JPEGImages/ (Pascal VOC detection; --source voc-seg "
    "reads SegmentationClass/ instead)",
)  # fmt: skip
_SEGMENTATION = _Task(
    "segmentation", "Segmentation", "SegmentationClass", ".png",
    {MASK_FIELD: mask_schema(None, ignore=VOID)},
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


def read_voc_objects(data: bytes, origin: str, labelmap: Labelmap = VOC_LABELMAP) -> bytes:
    """The ``boxes.json`` of one VOC annotation file (`encode_boxes`, labels into the
    labelmap's detection classes, `VOC_CLASSES` by default, boxes
    ``[xmin - 1, ymin - 1, xmax, ymax]``, difficult and truncated flags).

    Raises:
        SampleError: naming the file, the object and what is wrong with it.
    """
    root = parse_xml(data, origin)
    if root.tag != "annotation":
        raise SampleError(f"{origin}: the root element is <{root.tag}>, not <annotation>")
    boxes: list[list[float]] = []
    index = labelmap.detection_index
    labels, difficult, truncated = [], [], []
    for number, obj in enumerate(root.findall("object"), 1):
        name = (obj.findtext("name") or "").strip()
        where = f"{origin}: object {number} ({name[:40]!r})"
        if name not in index:
            raise SampleError(f"{where}: {labelmap.unknown_class('detection')}")
        box = obj.find("bndbox")
        if box is None:
            raise SampleError(f"{where}: has no <bndbox>")
        xmin, ymin, xmax, ymax = (
            _coordinate(box, t, where) for t in ("xmin", "ymin", "xmax", "ymax")
        )
        if xmax < xmin or ymax < ymin:
            raise SampleError(f"{where}: <bndbox> {xmin}, {ymin}, {xmax}, {ymax} is reversed")
        boxes.append([xmin - 1, ymin - 1, xmax, ymax])
        labels.append(index[name])
        difficult.append(_flag(obj, "difficult", where))
        truncated.append(_flag(obj, "truncated", where))
    return encode_boxes(boxes, labels, difficult=difficult, truncated=truncated)


def read_voc_mask(data: bytes, origin: str, labelmap: Labelmap = VOC_LABELMAP) -> bytes:
    """A ``SegmentationClass`` PNG's class indices as a mode ``L`` PNG: a palette or greyscale
    PNG's values as they are, an RGB PNG's colours (read only with a ``labelmap.txt``) mapped
    to their labels' indices.

    Raises:
        SampleError: another kind of image, a value that is no class index and not 255, or a
            colour the labelmap does not list.
    """
    from PIL import Image

    try:
        mask = open_image(data)
        mask.load()
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ...
        raise SampleError(f"{origin}: not a readable PNG ({stable_message(exc)})") from None
    modes = ("P", "L", "RGB") if labelmap.path else ("P", "L")
    if mask.format != "PNG" or mask.mode not in modes:
        coloured = f", or an RGB PNG in the colours of {labelmap.shown}" if labelmap.path else ""
        raise SampleError(
            f"{origin}: a {mask.format} image in mode {mask.mode}; a VOC class mask is a "
            f"palette (or greyscale) PNG whose pixel value is the class index{coloured}"
        )
    if mask.mode == "RGB":
        pixels = labelmap.indices_of_colours(np.asarray(mask), origin)
    else:
        pixels = np.asarray(mask)
        classes = labelmap.classes("segmentation")
        of = f" of {labelmap.shown}" if labelmap.path else ""
        bad = [int(v) for v in np.unique(pixels) if len(classes) <= v < VOID]
        if bad:
            raise SampleError(
                f"{origin}: pixel values {bad[:5]} are no class (0 = {classes[0]}, "
                f"1-{len(classes) - 1} the classes{of}, 255 the void border)"
            )
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


class _VocSource(Source):
    """What both VOC tasks share: the year folder, its labelmap, the split lists, the items."""

    layout: ClassVar[_Task]
    _labelmap: Labelmap = VOC_LABELMAP  # the scan's, carried to the workers' loads

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

    def _lists(self, year: str, files: dict[str, RawEntry]) -> dict[str, str]:
        """Subset name → its list file (`dlpipe.converters.voc_lists`)."""
        folder = os.path.join(year, "ImageSets", self.layout.lists)
        return subset_lists(folder, files, self._labelmap.names)

    def scan(self) -> Scan:
        year = self._year_folder()
        tree = RawTree(self.root, self.take_listings())
        files = {e.path: e for e in tree.files(year)}
        images = _by_stem(files, os.path.join(year, "JPEGImages"))
        labelmap_path = os.path.join(year, _LABELMAP)
        if os.path.lexists(labelmap_path):
            self._labelmap = read_labelmap(labelmap_path, self.raw_folder)
        classes = self._labelmap.classes(self.layout.task)
        lists = self._lists(year, files)
        items_of: dict[str, list[Item]] = {}
        left_out: dict[str, str] = {}
        for name, path in lists.items():
            found = self._split_items(year, name, path, images, files)
            if isinstance(found, str):
                left_out[name] = found
            else:
                items_of[name] = found
        check_once(items_of, lists)
        items = [item for found in items_of.values() for item in found]
        used = set(lists.values()) | {p for item in items for p in item.ref[:2] if p}
        used |= {self._labelmap.path} if self._labelmap.path else set()
        description = {
            "kind": self.kind,
            "root": display_path(self.root),
            "year_folder": display_path(year),
            "layout": f"{display_path(os.path.basename(year))}/ holds {self.layout.what}",
            "split_lists": {name: display_path(path) for name, path in lists.items()},
            "unused": _unused(year, files, used),
            **tree.report(),
        }
        if self._labelmap.path:
            description["labelmap"] = self._labelmap.shown
        if left_out:
            description["left_out"] = left_out
        return Scan(
            classes=classes,
            items=tuple(items),
            description=description,
            task=self.layout.task,
            field_schemas=self.layout.schema,
        )

    def _split_items(
        self,
        year: str,
        name: str,
        path: str,
        images: dict[str, RawEntry],
        files: dict[str, RawEntry],
    ) -> list[Item] | str:
        """The items of subset `name` (one with a problem per id missing a file), or why a
        test list whose annotations are withheld is left out."""
        task, shown = self.layout, display_path(path)
        ids = read_ids(self.raw_folder, path)
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
            long_id = ident if shortened else None
            items.append(Item(key, None, split_of(name), ref, size, kind, origin, long_id))
        if ids and len(lacking) * 2 <= len(ids):
            return items
        if name == "test" and ids and unannotated * 2 > len(ids):
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
            fields[BOXES_FIELD] = read_voc_objects(data, origin, self._labelmap)
        else:
            data = read_file(annotation, self.raw_folder, max_bytes=_MAX_MASK_BYTES)
            fields[MASK_FIELD] = read_voc_mask(data, origin, self._labelmap)
        return fields


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
