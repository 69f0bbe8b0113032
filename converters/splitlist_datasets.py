"""Food-101 and CUB-200-2011, each read exactly as its archive unpacks.

Each is a `dlpipe.converters.listed.ListedSource`: detected by its file names (RAW is the
folder the archive made, or the folder holding it), its splits read from its own list files,
held to the shared rules (a missing or malformed entry is one skipped sample, a list most of
whose lines fail stops the scan, unlisted images are counted under ``unused``).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from dlpipe.annotations import BOXES_FIELD, BOXES_SCHEMA, encode_boxes
from dlpipe.converters.listed import (
    Listed,
    ListedSource,
    Listing,
    data_lines,
    failed,
    find_base,
    join,
    read_list_file,
    shown_line,
)
from dlpipe.converters.raw_tree import RawEntry
from dlpipe.converters.source import SourceError, display_path

__all__ = ["LAYOUTS", "Cub200Source", "Food101Source"]


class Food101Source(ListedSource):
    """``food101``: Food-101 (``food-101.tar.gz``), as torchvision's ``Food101`` reads it.

    Layout: ``food-101/images/<class>/<id>.jpg``; ``food-101/meta/train.txt`` and ``test.txt``
    (one image a line, its path in ``images/`` without ``.jpg``: ``apple_pie/1005649``),
    ``meta/classes.txt`` (one class a line: ``apple_pie``), optional ``meta/labels.txt`` (line
    i: the display name of class line i, ``Apple pie``); ``train.json``/``test.json`` (the same
    lists by class) are not read. RAW is ``food-101/`` or the folder holding it.

    Produces image + ``cls``; splits ``train`` and ``test``; classes = classes.txt sorted (as
    torchvision sorts train.json's keys: 0 = ``apple_pie``), display names in
    ``source.class_names``; key = the list line, escaped (``apple_pie%2F1005649``). A line that
    is not ``<class>/<id>`` or names a class classes.txt lacks is a skipped sample.
    """

    kind = "food101"
    name = "Food-101"
    needs = "meta/classes.txt, meta/train.txt or test.txt and images/ (or food-101/ holding them)"

    @classmethod
    def find_base(cls, root: str) -> str | None:
        return find_base(
            root,
            ("", "food-101"),
            ("meta/classes.txt", "images/"),
            ("meta/train.txt", "meta/test.txt"),
        )

    def read_lists(self, base: str, files: dict[str, RawEntry]) -> Listing:
        meta = join(base, "meta")
        names = self._names(join(meta, "classes.txt"), "the class names")
        classes = sorted(names)
        index = {name: i for i, name in enumerate(classes)}
        read = {join(meta, "classes.txt"), join(meta, "train.txt"), join(meta, "test.txt")}
        description: dict[str, Any] = {}
        if join(meta, "labels.txt") in files:
            shown = self._names(join(meta, "labels.txt"), "the class display names", unique=False)
            if len(shown) != len(names):
                raise SourceError(
                    f"{display_path(self.path(join(meta, 'labels.txt')))} has {len(shown)} "
                    f"names for the {len(names)} classes of classes.txt; restore both"
                )
            display = dict(zip(names, shown, strict=True))
            description["class_names"] = [display[name] for name in classes]
            read.add(join(meta, "labels.txt"))
        entries = []
        for split in ("train", "test"):
            list_file = self.path(join(meta, f"{split}.txt"))
            for number, line in data_lines(read_list_file(self.raw_folder, list_file)):
                entry = Listed(split, join(base, "images", f"{line}.jpg"), line, None,
                               display_path(list_file), number)  # fmt: skip
                entries.append(_food_label(entry, line, index))
        return Listing(
            layout=f"Food-101 ({', '.join(sorted(read))})",
            classes=tuple(classes),
            entries=entries,
            read=read,
            description=description,
        )

    def _names(self, rel: str, what: str, unique: bool = True) -> list[str]:
        names = [
            line for _, line in data_lines(read_list_file(self.raw_folder, self.path(rel), what))
        ]
        if unique and len(set(names)) != len(names):
            repeated = next(n for n in names if names.count(n) > 1)
            raise SourceError(
                f"{display_path(self.path(rel))} names {shown_line(repeated)} twice; restore it"
            )
        return names

    def unused_kind(self, rel: str) -> str:
        if rel.endswith(("meta/train.json", "meta/test.json")):
            return "split lists"
        return super().unused_kind(rel)


def _food_label(entry: Listed, line: str, index: dict[str, int]) -> Listed:
    name, _, image_id = line.partition("/")
    if not name or not image_id or "/" in image_id or " " in line or ".." in line:
        return failed(entry, f"{shown_line(line)} is not '<class>/<image id>'")
    if name not in index:
        return failed(entry, f"names class {shown_line(name)}, not one of the "
                              f"{len(index)} in classes.txt")  # fmt: skip
    return replace(entry, label=index[name])


_Rows = dict[int, tuple[int, list[str]]]  # image id -> (line number, the other fields)


def _id_table(source: ListedSource, rel: str, known: set[int] | None, what: str) -> _Rows:
    """A CUB table ``<id> <fields...>`` by id; an id that is not a positive integer, repeats, or
    (when `known` is given) names no image of images.txt is a SourceError naming the line."""
    path = source.path(rel)
    rows: _Rows = {}
    for number, line in data_lines(read_list_file(source.raw_folder, path, what)):
        first, *fields = line.split()
        problem = None
        if not first.isascii() or not first.isdigit():
            problem = f"{shown_line(first)} is not an id"
        elif int(first) in rows:
            problem = f"repeats id {first} (line {rows[int(first)][0]})"
        elif known is not None and int(first) not in known:
            problem = f"names image {first}, which images.txt does not list"
        if problem:
            raise SourceError(
                f"{display_path(path)} line {number}: {problem}; each line is '<id> ...' for "
                "one image (restore the file from the download)"
            )
        rows[int(first)] = (number, fields)
    return rows


class Cub200Source(ListedSource):
    """``cub200``: CUB-200-2011 (``CUB_200_2011.tgz``), as its README describes it.

    Layout: ``CUB_200_2011/images.txt`` (``<image_id> <path in images/>``),
    ``train_test_split.txt`` (``<image_id> <1|0>``, 1 = train), ``image_class_labels.txt``
    (``<image_id> <class_id>``), ``classes.txt`` (``<class_id> <name>``, 1-based),
    ``bounding_boxes.txt`` (``<image_id> <x> <y> <width> <height>`` in pixels),
    ``images/<class>/<file>.jpg``; ``parts/``, ``attributes/``, ``README`` and the
    ``attributes.txt`` beside the folder are not read (counted in ``unused``). RAW is
    ``CUB_200_2011/`` or the folder holding it.

    Produces image + ``cls`` + ``boxes.json`` (the image's one box, XYXY ``[x, y, x + width,
    y + height]``, labelled with the image's class); splits ``train`` and ``test``; classes =
    classes.txt's names by id (0 = id 1), the ids in ``class_ids``; key = the path in
    ``images/`` without suffix, escaped. An image without a label or a box row, or whose row is
    malformed, is a skipped sample; an image without a split row is not converted (counted in
    ``unused``); a malformed images.txt, classes.txt or split row stops the scan.
    """

    kind = "cub200"
    name = "CUB-200-2011"
    needs = "images.txt, train_test_split.txt and images/ (or CUB_200_2011/ holding them)"
    _TABLES = ("images.txt", "train_test_split.txt", "image_class_labels.txt",
               "classes.txt", "bounding_boxes.txt")  # fmt: skip

    @classmethod
    def find_base(cls, root: str) -> str | None:
        names = ("images.txt", "train_test_split.txt", "images/")
        return find_base(root, ("", "CUB_200_2011"), names)

    def read_lists(self, base: str, files: dict[str, RawEntry]) -> Listing:
        images, splits, labels, classes, boxes = (join(base, t) for t in self._TABLES)
        class_rows = _id_table(self, classes, None, "the class names")
        if any(len(fields) != 1 for _, fields in class_rows.values()):
            number = next(n for n, fields in class_rows.values() if len(fields) != 1)
            raise SourceError(f"{display_path(self.path(classes))} line {number}: not "
                              "'<class_id> <name>'; restore it")  # fmt: skip
        ids = sorted(class_rows)
        index = {class_id: i for i, class_id in enumerate(ids)}
        paths = _id_table(self, images, None, "the image paths")
        known = set(paths)
        flags = _id_table(self, splits, known, "the train/test split")
        label_rows = _id_table(self, labels, known, "the image labels")
        box_rows = _id_table(self, boxes, known, "the bounding boxes")
        list_file = display_path(self.path(images))
        entries = []
        for image_id, (number, fields) in sorted(paths.items()):
            if len(fields) != 1:
                raise SourceError(f"{list_file} line {number}: not '<image_id> <path>'; restore it")
            split = _cub_split(self.path(splits), flags.get(image_id))
            if split is None:
                continue  # named by no split: counted as unused
            rel = fields[0]
            entry = Listed(split, join(base, "images", rel), os.path.splitext(rel)[0], None,
                           list_file, number)  # fmt: skip
            entries.append(_cub_annotations(entry, image_id, label_rows, box_rows, index))
        return Listing(
            layout=f"CUB-200-2011 ({', '.join(join(base, t) for t in self._TABLES)})",
            classes=tuple(class_rows[i][1][0] for i in ids),
            entries=entries,
            read={images, splits, labels, classes, boxes},
            field_schemas={BOXES_FIELD: BOXES_SCHEMA},
            class_ids=tuple(ids),
        )

    def unused_kind(self, rel: str) -> str:
        parts = rel.split("/")
        if "parts" in parts or "attributes" in parts or parts[-1] == "attributes.txt":
            return "annotation files"
        if "segmentations" in parts:
            return "masks"
        return super().unused_kind(rel)

    def annotations(self, extra: Any) -> dict[str, bytes]:
        box, label = extra
        return {BOXES_FIELD: encode_boxes([box], [label])}


def _cub_split(path: str, row: tuple[int, list[str]] | None) -> str | None:
    if row is None:
        return None
    number, fields = row
    if fields not in (["1"], ["0"]):
        raise SourceError(
            f"{display_path(path)} line {number}: {shown_line(' '.join(fields))} is not 1 "
            "(train) or 0 (test); restore the file from the download"
        )
    return "train" if fields == ["1"] else "test"


def _cub_annotations(
    entry: Listed, image_id: int, labels: _Rows, boxes: _Rows, index: dict[int, int]
) -> Listed:
    """The entry with its label and box, or the problem that keeps it out."""
    label_row, box_row = labels.get(image_id), boxes.get(image_id)
    if label_row is None or box_row is None:
        what = "image_class_labels.txt" if label_row is None else "bounding_boxes.txt"
        return failed(entry, f"image {image_id} has no row in {what}")
    number, fields = label_row
    if len(fields) != 1 or not fields[0].isdigit() or int(fields[0]) not in index:
        given = shown_line(" ".join(fields))
        return failed(entry, f"image_class_labels.txt line {number} gives image {image_id} "
                             f"the class {given}, not one of classes.txt")  # fmt: skip
    label = index[int(fields[0])]
    number, fields = box_row
    try:
        x, y, width, height = (float(v) for v in fields)
    except ValueError:
        return failed(entry, f"bounding_boxes.txt line {number}: {shown_line(' '.join(fields))} "
                              "is not '<x> <y> <width> <height>'")  # fmt: skip
    box = [x, y, x + width, y + height]
    return replace(entry, label=label, extra=(box, label))


LAYOUTS: tuple[type[ListedSource], ...] = (Food101Source, Cub200Source)
"""The layouts of this module, which the generic ``splitlist`` rule leaves to them."""
