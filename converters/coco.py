"""``coco``: object detection in COCO's instances format, as cocodataset.org, Datumaro/CVAT
and Roboflow ship it.

Layouts (``root`` is the folder the download was extracted into):

- COCO as shipped (and MMDetection's layout): ``annotations/instances_<split>.json`` with the
  images in ``<split>/`` (``instances_train2017.json`` → ``train2017/``).
- Datumaro's and CVAT's export: ``annotations/instances_<split>.json`` with the images in
  ``images/<split>/``, or all in ``images/`` (CVAT's ``instances_default.json`` + ``images/``).
  ``annotations/instances.json`` (no split) reads the same way.
- Roboflow's export: ``<split>/_annotations.coco.json`` with the images beside it (``train/``,
  ``valid/``, ``test/``); read only when there is no ``annotations/`` instances file.

Each image's folder is the first of ``<split>/``, ``images/<split>/``, ``images/`` that exists;
``file_name`` is a path in it (torchvision's ``CocoDetection(root, annFile)``). Split names:
a trailing year goes (``train2017`` → ``train``), ``valid``/``validation`` → ``val``,
``test-dev`` → ``test``, ``default`` and ``instances.json`` → no split (``--val-fraction``
decides); any other name is kept, characters other than letters, digits and ``_`` as ``_``.
Not read: ``captions_*``, ``person_keypoints_*``, ``image_info_*`` (``test2017`` has no
annotations: its folder is named in ``source.left_out``) and any other file beside them,
counted in ``source.unused``.

Produces one sample per ``images`` entry (an image without annotations is a background
sample): the image, ``boxes.json`` (`dlpipe.annotations`: XYXY pixel boxes ``[x, y, x + w,
y + h]``, labels, iscrowd, ids = annotation ids, in the file's order) and ``json``
(``{"image_id": <COCO id>}``, to map results back). Classes are the categories sorted by id;
the manifest's ``class_ids`` keeps COCO's gapped ids (1..90). Key: ``file_name`` without its
suffix. Polygons and RLE masks are converted only with ``--instance-masks``
(`SourceOptions.instance_masks`): then every sample also has ``masks.json``, one COCO RLE per
object of ``boxes.json`` (`dlpipe.converters.coco_masks`: read back from the instances file by
each annotation's byte span, so the scan's memory stays bounded); without it they are counted
as ``unused["instance masks"]``.

Errors: an instances file that cannot be read as COCO (`dlpipe.converters.coco_json`), splits
with different categories, two files for one split, or a split whose images are mostly missing
is a `SourceError`. One image is skipped (errors.jsonl) when an annotation has an unknown
category, a box that is not 4 numbers with a positive size, or a bad crowd flag, when its file
is missing, or when its width/height in the JSON differ from the image's own. Annotations of
an image id the file does not list are counted (``orphan_annotations``) and warned about;
files in an image folder that no instances file lists are counted as ``unused["other"]``.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from dlpipe.annotations import (
    BOXES_FIELD,
    BOXES_SCHEMA,
    INSTANCE_MASKS_SCHEMA,
    MASKS_FIELD,
    encode_boxes,
)
from dlpipe.codecs import check_image_pixels
from dlpipe.converters.coco_json import ImageId, Instances, Object, read_instances
from dlpipe.converters.coco_masks import MaskRef, masks_field
from dlpipe.converters.raw_tree import Listings, RawTree, relative_path
from dlpipe.converters.source import (
    SPLIT_WORDS,
    Item,
    SampleError,
    Scan,
    Source,
    SourceError,
    display_path,
    image_kind_of_name,
    is_ignored_name,
    log,
    read_file,
)
from dlpipe.errors import FieldDecodeError
from dlpipe.sample import make_key

__all__ = ["CocoSource", "split_of"]

_ANNOTATIONS, _IMAGES, _ROBOFLOW = "annotations", "images", "_annotations.coco.json"
_INSTANCES = re.compile(r"instances(?:_(.+))?\.json")
_YEAR = re.compile(r"(.+?)(?:19|20)[0-9]{2}")
_SPLITS = {**SPLIT_WORDS, "test-dev": "test", "testdev": "test"}
_EXAMPLES = 3


def split_of(name: str | None) -> str | None:
    """The dataset split of an instances file's split name (module docstring); None: none."""
    if name is None or name == "default":
        return None
    year = _YEAR.fullmatch(name)
    known = _SPLITS.get((year.group(1) if year else name).lower())
    return known or re.sub(r"[^A-Za-z0-9_]", "_", name)[:100]


@dataclass(frozen=True)
class _Part:
    """One instances file, its split and its image folder."""

    json: str
    name: str | None  # the split as the file names it
    images: str
    layout: str

    @property
    def split(self) -> str | None:
        return split_of(self.name)


class _Ref(NamedTuple):
    """What `CocoSource.load` needs of one image."""

    path: str
    size: tuple[int | None, int | None]  # (width, height) in the JSON
    image_id: ImageId
    objects: tuple[Object, ...]  # (id, label index, x, y, w, h, iscrowd)
    problem: str | None
    masks: MaskRef | None = None  # with --instance-masks: where the segmentations are


def _instances_names(root: str) -> list[str]:
    try:
        names = os.listdir(os.path.join(root, _ANNOTATIONS))
    except OSError:
        return []
    return sorted(n for n in names if _INSTANCES.fullmatch(n))


def _roboflow_names(root: str) -> list[str]:
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    return [
        n
        for n in names
        if not is_ignored_name(n) and os.path.isfile(os.path.join(root, n, _ROBOFLOW))
    ]


def _inside(root: str, path: str) -> None:
    """Refuse a folder that is (or lies under) a symbolic link."""
    if os.path.realpath(path) != os.path.join(os.path.realpath(root), os.path.relpath(path, root)):
        raise SourceError(
            f"{display_path(path)} is (or lies under) a symbolic link, which dlpipe does not "
            "follow; give the real folder as raw, or move the files in"
        )


class CocoSource(Source):
    kind = "coco"
    options_read = frozenset({"instance_masks"})

    @classmethod
    def detect(cls, root: str, listings: Listings | None = None) -> bool:
        """True when `root` has ``annotations/instances*.json`` or ``<split>/`` folders holding
        Roboflow's ``_annotations.coco.json`` (by names only)."""
        return os.path.isdir(root) and bool(_instances_names(root) or _roboflow_names(root))

    def scan(self) -> Scan:
        tree = RawTree(self.root, self.take_listings())
        parts, unused = self._parts(tree)
        files = self._image_files(tree, parts)
        listed: set[str] = set()
        items: list[Item] = []
        categories: dict[int, str] | None = None
        orphans: dict[ImageId, int] = {}
        masks = self.options.instance_masks
        for part in parts:
            found = read_instances(part.json, self.raw_folder, spans=masks)
            categories = _same_categories(categories, found, parts[0], part)
            part_items, part_orphans = self._items(part, found, files, listed)
            items += part_items
            for image_id, count in part_orphans.items():
                orphans[image_id] = orphans.get(image_id, 0) + count
            unused["instance masks"] += 0 if masks else found.masks
        assert categories is not None
        unlisted = [path for path in files if path not in listed]
        unused["other"] += len(unlisted)
        _warn(self.root, orphans, unlisted)
        ids = tuple(sorted(categories))
        description = {
            "kind": self.kind,
            "root": display_path(self.root),
            "layout": "; ".join(dict.fromkeys(p.layout for p in parts)),
            "annotation_files": {display_path(p.json): p.split or "none" for p in parts},
            "orphan_annotations": sum(orphans.values()),
            "segmentation": (
                f"converted: {MASKS_FIELD}, one COCO RLE per object (--instance-masks)"
                if masks
                else "not converted (instance masks are counted in 'unused'; --instance-masks "
                f"converts them to {MASKS_FIELD})"
            ),
            "unused": unused,
            **self._left_out(tree, parts),
            **tree.report(),
        }
        return Scan(
            classes=tuple(categories[i] for i in ids),
            items=tuple(items),
            description=description,
            task="detection",
            field_schemas={
                BOXES_FIELD: dict(BOXES_SCHEMA),
                **({MASKS_FIELD: dict(INSTANCE_MASKS_SCHEMA)} if masks else {}),
            },
            class_ids=ids,
        )

    def _parts(self, tree: RawTree) -> tuple[list[_Part], dict[str, int]]:
        """The instances files with their image folders, and the unused counts so far."""
        unused = {"annotation files": 0, "split lists": 0, "masks": 0, "instance masks": 0,
                  "other": 0}  # fmt: skip
        annotations = os.path.join(self.root, _ANNOTATIONS)
        names = _instances_names(self.root)  # any kind of entry: a FIFO is refused when read
        if names:
            _inside(self.root, annotations)
            for entry in tree.listing(annotations):
                if not entry.is_dir and not _INSTANCES.fullmatch(entry.name):
                    json_file = entry.name.lower().endswith(".json")
                    unused["annotation files" if json_file else "other"] += 1
            found = [(os.path.join(annotations, n), _INSTANCES.fullmatch(n)) for n in names]
            named = [(path, match.group(1)) for path, match in found if match]
            _check_splits(named)
            return [self._official(path, name) for path, name in named], unused
        layout = f"{_ROBOFLOW} in each split folder, beside its images (Roboflow)"
        named = [(os.path.join(self.root, n, _ROBOFLOW), n) for n in _roboflow_names(self.root)]
        if not named:
            raise SourceError(
                f"{display_path(self.root)}: neither {_ANNOTATIONS}/instances_<split>.json nor "
                f"<split>/{_ROBOFLOW} is there; give the folder the COCO download was extracted to"
            )
        _check_splits(named)
        for path, _ in named:
            _inside(self.root, os.path.dirname(path))
        return [_Part(path, name, os.path.dirname(path), layout) for path, name in named], unused

    def _official(self, path: str, name: str | None) -> _Part:
        """The part of ``annotations/instances[_<name>].json``: its image folder found."""
        file = f"{_ANNOTATIONS}/instances{'_<split>' if name else ''}.json"
        candidates = [(os.path.join(self.root, _IMAGES), f"{file}, images in {_IMAGES}/ (CVAT)")]
        if name:
            candidates[:0] = [
                (os.path.join(self.root, name), f"{file}, images in <split>/ (COCO as shipped)"),
                (os.path.join(self.root, _IMAGES, name), f"{file}, images in {_IMAGES}/<split>/"),
            ]
        for folder, layout in candidates:
            if os.path.isdir(folder):
                _inside(self.root, folder)
                return _Part(path, name, folder, layout)
        tried = ", ".join(display_path(folder) for folder, _ in candidates)
        raise SourceError(
            f"{display_path(path)}: its images are in none of {tried}; extract them into "
            f"{display_path(candidates[0][0])} (or move {os.path.basename(path)} out of "
            f"{_ANNOTATIONS}/ to leave this split out)"
        )

    @staticmethod
    def _image_files(tree: RawTree, parts: list[_Part]) -> dict[str, int]:
        """Path → size of every file below the image folders (each folder walked once); the
        annotation files among them left out."""
        folders = sorted({p.images for p in parts})
        tops = [f for f in folders if not any(f.startswith(o + os.sep) for o in folders)]
        files = {entry.path: entry.size for top in tops for entry in tree.files(top)}
        for part in parts:
            files.pop(part.json, None)
        return files

    def _items(
        self, part: _Part, found: Instances, files: dict[str, int], listed: set[str]
    ) -> tuple[list[Item], dict[ImageId, int]]:
        """The part's items (its paths added to `listed`), and its orphan annotations' image
        ids with their counts."""
        labels = {category_id: i for i, category_id in enumerate(sorted(found.categories))}
        items, missing = [], []
        for image_id, (name, width, height, problem) in found.images.items():
            objects, problem = _objects(found, image_id, labels, problem)
            spans = found.spans.pop(image_id, ()) if found.spans is not None else None
            rel = posixpath.normpath(name)
            path = os.path.normpath(os.path.join(part.images, rel))
            if rel.startswith(("../", "/")) or rel == "..":
                problem = problem or (
                    f"{found.shown}: image {image_id!r} has file_name {name!r:.80}, which lies "
                    f"outside {display_path(part.images)}"
                )
            elif path not in files:
                missing.append(path)
            listed.add(path)
            key, shortened = make_key(os.path.splitext(rel)[0])
            masks = None if spans is None else MaskRef(part.json, found.stamp, tuple(spans))
            ref = _Ref(path, (width, height), image_id, objects, problem, masks)
            size = files.get(path, 0) + (64 if masks is None else 256) * len(objects)
            kind = image_kind_of_name(path) or "other"
            origin = display_path(path)
            original = display_path(rel) if shortened else None
            items.append(Item(key, None, part.split, ref, size, kind, origin, original))
        _check_missing(part, len(items), missing)
        orphans = {image_id: len(objects) for image_id, objects in found.objects.items()}
        found.objects.clear()
        found.spans = None
        return items, orphans

    def _left_out(self, tree: RawTree, parts: list[_Part]) -> dict[str, Any]:
        """Folders at the top (or in ``images/``) whose images no instances file reads."""
        used = {p.images for p in parts}
        left = []
        for entry in tree.folders(self.root):
            if entry.name == _ANNOTATIONS or entry.path in used:
                continue
            if not any(u.startswith(entry.path + os.sep) for u in used):
                left.append(entry.path)
            elif entry.name == _IMAGES:
                left += [e.path for e in tree.folders(entry.path) if e.path not in used]
        reason = "no instances file reads it (image_info files list images without annotations)"
        return {"left_out": {relative_path(p, self.root): reason for p in left}} if left else {}

    def load(self, item: Item) -> dict[str, bytes]:
        """The image, its ``boxes.json``, ``json`` and (``--instance-masks``) ``masks.json``;
        SampleError for a bad annotation, a missing image, or an image whose size is not the
        JSON's."""
        ref: _Ref = item.ref
        if ref.problem:
            raise SampleError(ref.problem)
        data = read_file(ref.path, self.raw_folder)
        frame = _check_frame(data, ref, item.origin)
        objects = ref.objects
        boxes = encode_boxes(
            [(x, y, x + w, y + h) for _, _, x, y, w, h, _ in objects],
            [o[1] for o in objects],
            iscrowd=[o[6] for o in objects],
            ids=[o[0] for o in objects],
        )
        image_id = json.dumps({"image_id": ref.image_id}).encode("utf-8")
        fields = {"image": data, BOXES_FIELD: boxes, "json": image_id}
        if ref.masks is not None and frame is not None:  # no frame: the image check names it
            ids = [o[0] for o in objects]
            fields[MASKS_FIELD] = masks_field(ref.masks, ids, frame, self.raw_folder, item.origin)
        return fields


def _objects(
    found: Instances, image_id: ImageId, labels: dict[int, int], problem: str | None
) -> tuple[tuple[Object, ...], str | None]:
    """An image's objects with label indices, or the first problem of its entry or objects."""
    objects: list[Object] = []
    for obj in found.objects.pop(image_id, ()):
        if isinstance(obj, str):
            problem = problem or obj
            continue
        label = labels.get(obj[1])
        if label is None:
            problem = problem or (
                f"{found.shown}: annotation {obj[0]!r} of image {image_id!r} has category_id "
                f"{obj[1]}, which is not one of the {len(labels)} categories"
            )
            continue
        objects.append((obj[0], label, obj[2], obj[3], obj[4], obj[5], obj[6]))
    return (() if problem else tuple(objects)), problem


def _check_frame(data: bytes, ref: _Ref, origin: str) -> tuple[int, int] | None:
    """The image's (width, height) from its header, refused when it is not the width/height
    its boxes are drawn on; None when the header gives none."""
    try:
        actual = check_image_pixels(data)
    except FieldDecodeError:
        return None  # not an image, or too large: the worker names it
    if any(given not in (None, real) for given, real in zip(ref.size, actual, strict=True)):
        raise SampleError(
            f"{origin}: the image is {actual[0]}x{actual[1]}, but its entry (image id "
            f"{ref.image_id!r}) gives width {ref.size[0]} and height {ref.size[1]}, so its "
            "boxes are drawn on another frame; fix the entry or replace the image"
        )
    return actual


def _same_categories(
    first: dict[int, str] | None, found: Instances, first_part: _Part, part: _Part
) -> dict[int, str]:
    if first is None or first == found.categories:
        return found.categories
    differ = sorted(set(first.items()) ^ set(found.categories.items()))[0]
    raise SourceError(
        f"{found.shown}: its categories differ from {display_path(first_part.json)}'s (e.g. "
        f"id {differ[0]} {differ[1]!r}); every split needs the same categories (re-export them)"
    )


def _check_splits(named: list[tuple[str, str | None]]) -> None:
    """Refuse two instances files for one split (train2014 beside train2017)."""
    seen: dict[str | None, str] = {}
    for path, name in named:
        other = seen.setdefault(split_of(name), path)
        if other != path:
            raise SourceError(
                f"{display_path(other)} and {display_path(path)} are both split "
                f"{split_of(name) or '(none)'}; move one of them out of the raw folder"
            )


def _check_missing(part: _Part, count: int, missing: list[str]) -> None:
    """Refuse a split whose images are mostly not there (a wrong folder, not extracted)."""
    if missing and len(missing) * 2 > count:
        raise SourceError(
            f"{display_path(part.images)}: {len(missing)} of the {count} images "
            f"{display_path(part.json)} lists are not there (e.g. {display_path(missing[0])}); "
            "extract the split's images there"
        )


def _warn(root: str, orphans: dict[ImageId, int], unlisted: list[str]) -> None:
    if orphans:
        ids = ", ".join(repr(i) for i in list(orphans)[:_EXAMPLES])
        log.warning(
            "%s: %d annotations name an image id their file does not list (%s%s); they are "
            "not read",
            display_path(root),
            sum(orphans.values()),
            ids,
            ", ..." if len(orphans) > _EXAMPLES else "",
        )
    if unlisted:
        shown = ", ".join(display_path(p) for p in unlisted[:_EXAMPLES])
        log.warning(
            "%s: %d files in the image folders are in no instances file and are not read: %s%s",
            display_path(root),
            len(unlisted),
            shown,
            ", ..." if len(unlisted) > _EXAMPLES else "",
        )
