"""The rows of a Hugging Face image folder's metadata: their objects, labels, keys and fields.

`parse_objects` reads an ``objects`` cell (COCO ``[x, y, width, height]`` boxes → XYXY);
`assign_labels` names the classes (a ``label`` column, the objects' categories, or the images'
folders) and turns each row's into class indices; `path_keys` and `column_keys` make the
sample keys (from the image paths, or the ``--key-col`` column); `row_fields` encodes a row's
``txt``, ``boxes.json`` and ``json``. A row that breaks a rule fails (`Row.fail`): its sample is
skipped and listed. The rules are stated in `dlpipe.converters.hf_folder`.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
from collections import Counter
from typing import Any

from dlpipe.annotations import encode_boxes
from dlpipe.converters.column_keys import UniqueKeys, column_key
from dlpipe.converters.hf_metadata import (
    NO_LABEL,
    UNLABELLED,
    MetadataFile,
    Roles,
    resolve_path,
)
from dlpipe.converters.raw_tree import RawEntry
from dlpipe.converters.source import SourceError, display_path, log
from dlpipe.converters.table import jsonable
from dlpipe.sample import make_key

__all__ = [
    "Objects",
    "Row",
    "assign_labels",
    "column_keys",
    "first_with",
    "object_extras",
    "parse_objects",
    "path_keys",
    "row_fields",
]

_CATEGORY_KEYS = ("categories", "category")

Objects = tuple[list[list[float]], list[Any], dict[str, list[Any]]]
"""An ``objects`` cell: XYXY boxes, categories (raw, then class indices), other lists."""


class Row:
    """One row after the scan's first pass: its files, raw label and objects, or a problem."""

    def __init__(self, meta: MetadataFile, index: int, roles: Roles) -> None:
        self.meta, self.index, self.roles = meta, index, roles
        self.values = meta.rows[index]
        self.origin = meta.origin(index)
        self.image: RawEntry | None = None
        self.image_rel: str | None = None  # relative to the root
        self.extras: list[tuple[str, RawEntry]] = []
        self.problem: str | None = None
        self.missing = False
        self.label: Any = None
        self.objects: Objects | None = None

    def fail(self, problem: str) -> None:
        """Fail the row (its sample is skipped), keeping the first problem."""
        self.problem = self.problem or problem


def parse_objects(value: Any) -> Objects:
    """(XYXY boxes, raw categories, other per-object lists) of an ``objects`` cell; ValueError
    naming what is wrong."""
    if isinstance(value, list):  # a list of {bbox, category} objects
        if not all(isinstance(o, dict) for o in value):
            raise ValueError("objects is a list of something other than objects")
        keys = list(dict.fromkeys(k for o in value for k in o))
        value = {k: [o.get(k) for o in value] for k in keys}
    if not isinstance(value, dict):
        raise ValueError("objects is empty; give {'bbox': [], 'categories': []} for no objects")
    key = next((k for k in _CATEGORY_KEYS if k in value), None)
    bboxes, cats = value.get("bbox"), value.get(key) if key else None
    if not isinstance(bboxes, list) or not isinstance(cats, list) or len(bboxes) != len(cats):
        raise ValueError(
            "objects needs a bbox list and a categories (or category) list of one length"
        )
    boxes = []
    for i, box in enumerate(bboxes):
        if not (isinstance(box, list) and len(box) == 4 and all(_finite(v) for v in box)):
            raise ValueError(f"object {i}: bbox {box!r} is not 4 numbers [x, y, width, height]")
        x, y, w, h = box
        if w <= 0 or h <= 0:
            raise ValueError(
                f"object {i}: bbox {box!r} has no positive width and height (HF object "
                "detection boxes are COCO's [x_min, y_min, width, height])"
            )
        boxes.append([x, y, x + w, y + h])
    rest = {k: v for k, v in value.items() if k not in ("bbox", key)}
    return boxes, cats, rest


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def column_keys(rows: list[Row], column: str) -> list[tuple[str, str | None]]:
    """Each row's key from `column` (``--key-col``), as the table source makes keys from its
    id column: the value (an integral float as its integer) escaped by the key rule, the full
    value kept when the key had to be shortened. A value that is no string or number (empty,
    a list, a boolean) and a key twice in one split are a `SourceError` naming the row."""
    keys: list[tuple[str, str | None]] = []
    seen = UniqueKeys()
    for row in rows:
        value = row.values.get(column)
        made = column_key(value, row.origin, column)
        seen.add(row.meta.split, made, row.origin, column)
        keys.append((made.key, made.original))
    return keys


def path_keys(rows: list[Row]) -> list[tuple[str, str | None]]:
    """Each row's key from its image's path in its split folder, without suffix (``#1``,
    ``#2``... for a file named again), and the full text when the key was shortened."""
    seen: Counter[tuple[str | None, str]] = Counter()
    keys: list[tuple[str, str | None]] = []
    for row in rows:
        rel = resolve_path(row.meta.folder, row.values.get(row.roles.image)) or f"row{row.index}"
        stem = os.path.splitext(_in_split(rel, row.meta.split))[0]
        count = seen[(row.meta.split, stem)]
        seen[(row.meta.split, stem)] += 1
        text = stem if not count else f"{stem}#{count}"
        key, shortened = make_key(text)
        keys.append((key, display_path(text) if shortened else None))
    return keys


def _in_split(rel: str, split: str | None) -> str:
    """`rel` (relative to the root) relative to its split folder (``[data/]<split>/``)."""
    if split is None:
        return rel
    parts = rel.split("/")
    start = 1 if parts[0] == "data" else 0
    return "/".join(parts[start + 1 :]) or rel


def _class_label_names(feature: Any) -> tuple[str, ...] | None:
    """The names of a HF ``ClassLabel`` feature, looking through list/sequence wrappers."""
    while isinstance(feature, (dict, list)):
        if isinstance(feature, list):
            feature = feature[0] if len(feature) == 1 else None
        elif feature.get("_type") == "ClassLabel":
            return tuple(str(n) for n in feature.get("names") or ()) or None
        else:
            feature = feature.get("feature")
    return None


def _category_feature(features: dict[str, Any], objects: str) -> Any:
    feature = features.get(objects)
    for _ in range(4):  # Sequence({...}) or [{...}] around the objects' dict
        if isinstance(feature, list) and len(feature) == 1:
            feature = feature[0]
        elif isinstance(feature, dict) and "feature" in feature:
            feature = feature["feature"]
    if isinstance(feature, dict):
        return next((feature[k] for k in _CATEGORY_KEYS if k in feature), None)
    return None


def _classes_of(values: list[Any], names: tuple[str, ...] | None, what: str) -> tuple[str, ...]:
    """The classes of raw labels: ints (named by `names`, else "0".."max") or sorted strings."""
    kinds = {type(v) for v in values}
    if kinds <= {int}:
        top = max(values, default=-1)
        return names or tuple(str(i) for i in range(top + 1))
    if kinds <= {str}:
        return tuple(sorted(set(values)))
    shown = " and ".join(sorted(k.__name__ for k in kinds))
    raise SourceError(f"{what} are {shown}; give integers (class indices) or names, one kind")


def _index_of(value: Any, classes: tuple[str, ...], index: dict[str, int]) -> int | None:
    if isinstance(value, str):
        return index.get(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(classes):
        return value
    return None


def assign_labels(
    rows: list[Row], metas: list[tuple[MetadataFile, Roles]], label_col: str | None, root: str
) -> tuple[tuple[str, ...], str | None]:
    """The classes, with each row's label (or objects' categories) turned into class indices
    (None: no label), and where the labels came from: ``objects``, ``column`` or ``folders``
    (None: none). A row whose label or category is not a class fails.

    Args:
        rows: every row of the dataset.
        metas: the metadata files and their column roles.
        label_col: ``--label-col`` (``none``: no labels, not even from folders).
        root: the raw folder, for the log line.
    """
    objects, labels = first_with(metas, "objects"), first_with(metas, "label")
    if objects and labels:
        raise SourceError(
            f"{objects[0].name} has objects, {labels[0].name} a label column; a dataset's "
            "classes are one or the other (pick none with --label-col none)"
        )
    if objects:
        meta, roles = objects
        feature = _category_feature(meta.features, roles.objects or "")
        return _object_classes(rows, _class_label_names(feature)), "objects"
    if labels:
        meta, roles = labels
        names = _class_label_names(meta.features.get(roles.label or ""))
        classes = _column_classes(rows, names, roles.label or "")
        return classes, "column" if classes else None
    if first_with(metas, "caption") or (label_col or "").lower() == NO_LABEL:
        return (), None
    folders = _folder_labels(rows)
    if folders is None:
        return (), None
    for row, name in zip(rows, folders, strict=True):
        row.label = name
    classes = tuple(sorted({n for n in folders if n}))
    log.info(
        "%s: labels come from the images' folders (%s); --label-col none leaves them out",
        display_path(root),
        ", ".join(classes[:5]) + (", ..." if len(classes) > 5 else ""),
    )
    return _column_classes(rows, None, "folder"), "folders"


def _object_classes(rows: list[Row], names: tuple[str, ...] | None) -> tuple[str, ...]:
    for row in rows:
        if row.objects is not None:
            cats = [_category(row, i, c) for i, c in enumerate(row.objects[1])]
            row.objects = (row.objects[0], cats, row.objects[2])
    values = [c for r in rows if r.objects for c in r.objects[1] if _is_label(c)]
    classes = _classes_of(values, names, "objects' categories")
    index = {name: i for i, name in enumerate(classes)}
    for row in rows:
        if row.objects is None:
            continue
        labels = []
        for i, cat in enumerate(row.objects[1]):
            label = _index_of(cat, classes, index)
            if label is None:
                row.fail(f"object {i}: category {cat!r} is not one of the {len(classes)} classes")
            labels.append(label)
        row.objects = (row.objects[0], labels, row.objects[2])
    return classes


def _column_classes(rows: list[Row], names: tuple[str, ...] | None, column: str) -> tuple[str, ...]:
    for row in rows:
        value = row.label
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if value is not None and not _is_label(value):
            row.fail(f"label {value!r} is not a class index or name")
            value = None
        row.label = None if value == UNLABELLED else value
    values = [r.label for r in rows if r.label is not None]
    classes = _classes_of(values, names, f"{column!r} labels")
    index = {name: i for i, name in enumerate(classes)}
    labelled = {r.meta.split for r in rows if r.label is not None}
    for row in rows:
        if row.label is None:
            if row.meta.split in labelled:
                row.fail(f"no label ({column} is empty or -1) in a labelled split")
            continue
        label = _index_of(row.label, classes, index)
        if label is None:
            row.fail(f"label {row.label!r} is not one of the {len(classes)} classes")
        row.label = label
    return classes


def _folder_labels(rows: list[Row]) -> list[str | None] | None:
    """Each row's image folder name, when every image lies in a sub-folder of its metadata
    file's folder at one depth and there are several names (ImageFolder's rule); else None."""
    paths = [
        r.image_rel[len(r.meta.folder) + 1 :] if r.meta.folder and r.image_rel else r.image_rel
        for r in rows
    ]
    known = [p for p in paths if p is not None]
    if not known or any("/" not in p for p in known) or len({p.count("/") for p in known}) != 1:
        return None
    names = [posixpath.basename(posixpath.dirname(p)) if p else None for p in paths]
    return names if len({n for n in names if n}) > 1 else None


def _is_label(value: Any) -> bool:
    return isinstance(value, (int, str)) and not isinstance(value, bool)


def _category(row: Row, i: int, value: Any) -> Any:
    """An object's category as an int or a name; other values fail the row."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not _is_label(value):
        row.fail(f"object {i}: category {value!r} is not a class index or name")
    return value


def row_fields(row: Row, with_json: bool) -> dict[str, bytes]:
    """The row's txt, boxes.json and json fields (json when its split has any other columns);
    a problem (an empty caption, objects that cannot be stored) fails the row."""
    roles, values = row.roles, row.values
    fields: dict[str, bytes] = {}
    if roles.caption:
        text = values.get(roles.caption)
        if not isinstance(text, str):
            row.fail(f"the {roles.caption!r} caption is empty; fill it or drop the row")
            return {}
        fields["txt"] = text.encode("utf-8")
    extra = {name: jsonable(values.get(name)) for name in roles.json}
    if row.objects is not None:
        boxes, labels, rest = row.objects
        others = object_extras(row)
        try:
            fields["boxes.json"] = encode_boxes(
                boxes, labels, iscrowd=rest.get("iscrowd"), ids=jsonable(rest.get("id"))
            )
        except (TypeError, ValueError) as exc:
            row.fail(f"objects cannot be stored ({exc})")
            return {}
        if others:
            extra[roles.objects or "objects"] = jsonable(others)
    if with_json:
        text = json.dumps(extra, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        fields["json"] = text.encode("utf-8")
    return fields


def object_extras(row: Row) -> dict[str, Any]:
    """The per-object lists besides bbox, categories, id and iscrowd (``area``...): to json."""
    rest = row.objects[2] if row.objects else {}
    return {k: v for k, v in rest.items() if k not in ("iscrowd", "id")}


def first_with(
    metas: list[tuple[MetadataFile, Roles]], role: str
) -> tuple[MetadataFile, Roles] | None:
    """The first metadata file (and its roles) with a column in `role`."""
    return next(((m, r) for m, r in metas if getattr(r, role)), None)
