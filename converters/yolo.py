"""``yolo``: an Ultralytics YOLO detection dataset (a data YAML, images, one label file per
image) as Ultralytics, Roboflow's YOLO exports and Datumaro write it.

Layout: ``root`` holds the data YAML at its top, or is the YAML file. The YAML is the one
``*.yaml``/``*.yml`` there with ``names`` and ``train`` or ``val``; of several, ``data.yaml``,
then ``dataset.yaml``, then the one named as the folder (as Ultralytics picks), else refused.
It is read with ``yaml.safe_load`` (at most 1 MiB) and gives:

- ``names``: a list (index = class id) or a mapping ``{0: person, 1: bicycle}``; a mapping with
  gaps keeps its ids as the manifest's ``class_ids`` (classes in id order, label = position).
  ``nc``, when given, must equal the number of names.
- ``path``: the dataset root, relative to the YAML's folder; one that is not a folder inside
  the raw folder (the author's ``/content/datasets/x``) is ignored with a warning, and the
  YAML's folder is the root.
- ``train``, ``val`` (or ``validation``), ``test``: each empty, a folder of images (read
  recursively), a text file listing images (``./images/train/x.jpg``: relative to the list's
  folder), or a list of those, relative to the root. An entry ``../x`` that names nothing
  inside the raw folder is read as ``x``, as Ultralytics does for Roboflow's
  ``train: ../train/images`` beside ``train/images/`` and ``train/labels/``.

Labels (Ultralytics' ``img2label_paths``): ``.../images/.../x.jpg`` has its objects in
``.../labels/.../x.txt`` (the last ``images`` folder of its path in the raw folder named
``labels``; with none, ``x.txt`` beside the image), a line each: ``class cx cy w h``, normalised
to the image's width and height. A polygon line, ``class x1 y1 x2 y2 x3 y3 ...`` (YOLO
segmentation, OBB corners), is stored as the polygon's bounding box, as Ultralytics' detection
reads it (``segments2boxes``; the schema says ``"polygons": "bounding box"``). With
``kpt_shape`` (pose), a line is the box and its keypoints; the keypoints are not kept. A
coordinate may lie up to 0.01 outside [0, 1] (Ultralytics' tolerance); boxes are clipped to
the image. An image without a label file, or with an empty one, is a background image.

Without a data YAML, Darknet's layout (darknet's ``obj.data``, CVAT's "YOLO 1.1" export) is read
as `dlpipe.converters.yolo_darknet` says: ``x.txt`` beside each image, lines as above.

Produces one sample per image: the image and ``boxes.json`` (`dlpipe.annotations`: pixel XYXY
``[(cx - w/2) W, (cy - h/2) H, (cx + w/2) W, (cy + h/2) H]``, W x H from the image's header;
labels = class positions), task ``detection``, splits as the YAML names them. Key: the image's
path in its split folder (for a listed image, in the raw folder) without suffix, escaped.

A missing or malformed YAML, ``names`` or ``nc``, a train/val entry naming nothing, a split
without images or (but ``test``, which is then left out) without one label file, an image in
two splits, or a list whose rows mostly name no image is a `SourceError`. A label line with a
wrong field count, a number that is not finite, a class not in ``names``, a box of no positive
size or out of the tolerance, a label file that is not UTF-8, or objects on a JPEG whose EXIF
orientation turns it (its labels are of the turned picture, its pixels are stored as they lie)
is a per-sample `SampleError`.
"""

from __future__ import annotations

import functools
import os
import re

from dlpipe.annotations import BOXES_FIELD, BOXES_SCHEMA, encode_boxes
from dlpipe.codecs import image_size, open_image, stable_message
from dlpipe.converters.raw_tree import Listings, RawEntry, RawTree, relative_path
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
    read_text,
)
from dlpipe.converters.yolo_config import (
    Labels,
    Layout,
    classes_of,
    data_yamls,
    find_data_yaml,
    ultralytics_layout,
)
from dlpipe.converters.yolo_darknet import (
    DarknetConfig,
    darknet_file,
    darknet_layout,
    darknet_paths,
)
from dlpipe.sample import make_key

__all__ = ["YoloSource", "label_path", "read_yolo_labels"]

_MAX_LIST_BYTES = 256 << 20
_MAX_LABEL_BYTES = 16 << 20
_TOLERANCE = 0.01  # Ultralytics' verify_image_label: coordinates in [-0.01, 1.01]
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_CLASS = re.compile(r"\d+(?:\.0*)?")
_IMAGES, _LABELS = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
_ORIENTATION = 0x0112
BOXES_FROM_POLYGONS = {**BOXES_SCHEMA, "polygons": "bounding box"}
_LABELS_LIE = {  # by Layout.darknet
    False: "YOLO labels lie in a labels/ folder beside images/ (images/train/x.jpg → "
    "labels/train/x.txt)",
    True: "Darknet's lie beside each image (obj_train_data/x.jpg → obj_train_data/x.txt)",
}
_ROWS_FROM = {
    False: "the list's folder (./images/train/x.jpg)",
    True: "the folder holding data/ (data/obj_train_data/x.jpg)",
}


def label_path(image: str, top: str) -> str:
    """The label file of `image` (a path below `top`): the last ``images`` folder of its path
    below `top` renamed ``labels``, the suffix ``.txt``."""
    head, sep, tail = image[len(top) :].rpartition(_IMAGES)
    rel = head + _LABELS + tail if sep else image[len(top) :]
    return top + os.path.splitext(rel)[0] + ".txt"


def _number(token: str, where: str) -> float:
    if not _NUMBER.fullmatch(token):
        raise SampleError(f"{where}: {token[:40]!r} is not a finite number")
    return float(token)


def _line_box(fields: list[str], pose: int | None, where: str) -> list[float]:
    """A label line's normalised box ``[x0, y0, x1, y1]`` (polygons: their bounding box)."""
    count = len(fields)
    if count == 5 or (pose is not None and count == pose):
        cx, cy, w, h = (_number(t, where) for t in fields[1:5])
        if not (w > 0 and h > 0):
            raise SampleError(f"{where}: the box's width {w} and height {h} must be positive")
        box = [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]
    elif pose is None and count >= 7 and count % 2:
        values = [_number(t, where) for t in fields[1:]]
        xs, ys = values[0::2], values[1::2]
        box = [min(xs), min(ys), max(xs), max(ys)]
        if not (box[2] > box[0] and box[3] > box[1]):
            raise SampleError(f"{where}: the polygon encloses no area")
    else:
        shapes = f"'class cx cy w h' + keypoints ({pose} fields)" if pose else (
            "'class cx cy w h' (5 fields) or a polygon 'class x1 y1 x2 y2 x3 y3 ...' (an odd "
            "count of 7 or more)"
        )  # fmt: skip
        raise SampleError(f"{where}: {count} fields; a YOLO label line is {shapes}")
    if min(box) < -_TOLERANCE or max(box) > 1 + _TOLERANCE:
        raise SampleError(
            f"{where}: the box {[round(v, 6) for v in box]} lies outside the image (normalised "
            f"coordinates are in [0, 1], give or take {_TOLERANCE})"
        )
    return [min(max(v, 0.0), 1.0) for v in box]


def read_yolo_labels(text: str, labels: Labels, origin: str) -> list[tuple[int, list[float]]]:
    """(label, normalised clipped box) of each object line of a label file.

    Raises:
        SampleError: naming the file, the line and what is wrong with it.
    """
    objects = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields:
            continue
        where = f"{origin} line {number}"
        if not _CLASS.fullmatch(fields[0]) or int(float(fields[0])) not in labels.index:
            ids = sorted(labels.index)
            raise SampleError(
                f"{where}: class {fields[0][:40]!r} is not one of the {len(ids)} class ids of "
                f"names ({ids[0]}-{ids[-1]})"
            )
        objects.append(
            (labels.index[int(float(fields[0]))], _line_box(fields, labels.fields, where))
        )
    return objects


def _image_size(data: bytes, origin: str) -> tuple[int, int]:
    """The image's (width, height) from its header; SampleError when its labels do not
    describe its stored pixels (an EXIF orientation that turns it)."""
    try:
        size = image_size(data)
        turned = None
        if size is None or data[:3] == b"\xff\xd8\xff":
            image = open_image(data)
            size = size or image.size
            if image.format == "JPEG":
                turned = image.getexif().get(_ORIENTATION)
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ...
        raise SampleError(f"{origin}: not a readable image ({stable_message(exc)})") from None
    if turned not in (None, 1):
        raise SampleError(
            f"{origin}: EXIF orientation {turned}: its YOLO labels are of the turned picture, "
            "but its pixels are stored as they lie; turn the pixels (exiftran -ai, or "
            "PIL.ImageOps.exif_transpose) and convert again"
        )
    return size


class YoloSource(Source):
    kind = "yolo"
    _labels: Labels | None = None

    @classmethod
    def detect(cls, root: str, listings: Listings | None = None) -> bool:
        """True when `root` is, or holds at its top, a YAML with ``names`` and ``train`` or
        ``val``, or Darknet's ``obj.data`` (see `darknet_file`)."""
        return bool(data_yamls(root)) or darknet_file(root) is not None

    @property
    def _top(self) -> str:
        """The folder the samples are looked for in: `root`, or the YAML file's folder."""
        return self.root if os.path.isdir(self.root) else os.path.dirname(self.root)

    @functools.cached_property
    def _darknet(self) -> DarknetConfig | None:
        """Darknet's description of the dataset, when it has that and no data YAML."""
        path = None if data_yamls(self.root) else darknet_file(self.root)
        return None if path is None else DarknetConfig.read(path, self._top, self.raw_folder)

    def _rules(self) -> Labels:
        """Class id → label and the pose line length, from the YAML (once per process)."""
        if self._labels is None and self._darknet is not None:
            self._labels = self._darknet.labels
        elif self._labels is None:
            path, data = find_data_yaml(self.root, self.raw_folder)
            _, ids = classes_of(data, display_path(path))
            self._labels = Labels.of(ids, data, display_path(path))
        return self._labels

    def _layout(self, files: dict[str, RawEntry], left_out: dict[str, str]) -> Layout:
        if self._darknet is not None:
            return darknet_layout(self._darknet, self._top, files, left_out)
        path, data = find_data_yaml(self.root, self.raw_folder)
        return ultralytics_layout(path, data, self._top, files, left_out)

    def scan(self) -> Scan:
        top = self._top
        tree = RawTree(top, self.take_listings())
        files = {e.path: e for e in tree.files(top)}
        left_out: dict[str, str] = {}
        layout = self._layout(files, left_out)
        self._labels = layout.labels
        scanner = _SplitScanner(top, files, tree, self.raw_folder, layout.darknet)
        items: list[Item] = []
        for split, entries in layout.splits.items():
            found = scanner.items(split, entries)
            if isinstance(found, str):
                left_out[split] = found
            else:
                items += found
        if not items:
            raise SourceError(f"{display_path(layout.config)}: its splits hold no images")
        used = {layout.config, *layout.read, *scanner.lists}
        used |= {p for it in items for p in it.ref[:2] if p}
        description = {
            "kind": self.kind,
            "root": display_path(self.root),
            "config": display_path(layout.config),
            "dataset_root": display_path(layout.root),
            "layout": layout.why,
            "splits": {s: [display_path(p) for p, _ in e] for s, e in layout.splits.items()},
            "background_images": sum(1 for it in items if it.ref[1] is None and not it.ref[2]),
            "unused": _unused(top, files, used, layout.darknet),
            **tree.report(),
        }
        if layout.labels.fields is not None:
            description["keypoints"] = "not kept (the boxes are)"
        if left_out:
            description["left_out"] = left_out
        ids = layout.ids
        return Scan(
            classes=layout.classes,
            items=tuple(items),
            description=description,
            task="detection",
            field_schemas={BOXES_FIELD: dict(BOXES_FROM_POLYGONS)},
            class_ids=None if ids == list(range(len(ids))) else tuple(ids),
        )

    def load(self, item: Item) -> dict[str, bytes]:
        """The image and its ``boxes.json`` in pixels; SampleError for a bad label file."""
        image, label, problem = item.ref
        if problem:
            raise SampleError(problem)
        data = read_file(image, self.raw_folder)
        objects: list[tuple[int, list[float]]] = []
        if label is not None:
            raw = read_file(label, self.raw_folder, max_bytes=_MAX_LABEL_BYTES)
            try:
                text = raw.decode("utf-8-sig")
            except UnicodeDecodeError as exc:
                raise SampleError(f"{display_path(label)}: not UTF-8 text ({exc})") from None
            objects = read_yolo_labels(text, self._rules(), display_path(label))
        boxes: list[list[float]] = []
        if objects:
            width, height = _image_size(data, item.origin)
            boxes = [[x0 * width, y0 * height, x1 * width, y1 * height]
                     for _, (x0, y0, x1, y1) in objects]  # fmt: skip
        return {"image": data, BOXES_FIELD: encode_boxes(boxes, [n for n, _ in objects])}


class _SplitScanner:
    """The items of each split, refusing an image in two splits; of Darknet's layout, list rows
    read as Darknet reads them (`darknet_paths`), each label file beside its image."""

    def __init__(
        self, top: str, files: dict[str, RawEntry], tree: RawTree, raw_folder: str, darknet: bool
    ) -> None:
        self.top, self.files, self.tree, self.raw_folder = top, files, tree, raw_folder
        self.darknet = darknet  # Layout.darknet
        self.images = sorted(p for p in files if os.path.splitext(p)[1].lower() in IMAGE_SUFFIXES)
        self.lists: list[str] = []
        self.split_of: dict[str, str] = {}

    def items(self, split: str, entries: list[tuple[str, bool]]) -> list[Item] | str:
        """The split's items, or why an unlabelled test split is left out."""
        rows: list[tuple[str, str, str | None]] = []  # (image, key text, problem)
        for path, is_list in entries:
            if is_list:
                rows += self._listed(path)
            else:
                prefix = path.rstrip(os.sep) + os.sep
                rows += [
                    (p, relative_path(p, path), None) for p in self.images if p.startswith(prefix)
                ]
        shown = ", ".join(display_path(p) for p, _ in entries)
        items = [self._item(split, *row) for row in rows]
        labelled = sum(1 for it in items if it.ref[1] is not None)
        if items and labelled:
            return self._once(split, items)
        what = f"none of its {len(items)} images has a label file" if items else "no images"
        if split == "test":
            return f"{shown}: {what}"
        if items:
            expected = display_path(self._label_of(items[0].ref[0]))
            what += f" ({items[0].origin} would have {expected})"
        raise SourceError(f"{split} ({shown}): {what}; {_LABELS_LIE[self.darknet]}")

    def _label_of(self, image: str) -> str:
        return os.path.splitext(image)[0] + ".txt" if self.darknet else label_path(image, self.top)

    def _image_of(self, name: str, folder: str) -> str:
        """The image a list row names: relative to the list's `folder` (Darknet: see
        `darknet_paths`); the first place looked when it names none."""
        tries = [os.path.normpath(os.path.join(folder, name))]
        tries = darknet_paths(name, self.top, folder) if self.darknet else tries
        return next((p for p in tries if p in self.files), tries[0])

    def _listed(self, path: str) -> list[tuple[str, str, str | None]]:
        """The rows of an image list: a path a line, relative to the list's folder."""
        self.lists.append(path)
        shown = display_path(path)
        text = read_text(path, self.raw_folder, max_bytes=_MAX_LIST_BYTES, fix="fix the image list")
        rows: list[tuple[str, str, str | None]] = []
        missing = []
        for number, line in enumerate(text.splitlines(), 1):
            name = line.strip()
            if not name or os.path.splitext(name)[1].lower() not in IMAGE_SUFFIXES:
                continue
            image = self._image_of(name, os.path.dirname(path))
            if image in self.files:
                rows.append((image, relative_path(image, self.top), None))
            else:
                problem = f"{shown} line {number}: {name[:200]!r} names no image in the raw folder"
                rows.append((image, name, problem))
                missing.append(problem)
        if len(missing) * 2 > len(rows):
            raise SourceError(
                f"{missing[0]}, nor do {len(missing) - 1} more of its {len(rows)} rows; "
                f"write each path relative to {_ROWS_FROM[self.darknet]}"
            )
        return rows

    def _item(self, split: str, image: str, text: str, problem: str | None) -> Item:
        label = None
        if problem is None:
            found = self._label_of(image)
            if found in self.files:
                label = found
            elif display_path(found) in self.tree.skipped:
                why = self.tree.skipped[display_path(found)]
                problem = f"{display_path(found)}: {why}; a label file is a regular file"
        key, shortened = make_key(os.path.splitext(text)[0])
        size = sum(self.files[p].size for p in (image, label) if p in self.files)
        kind = image_kind_of_name(image) or "other"
        original = display_path(text) if shortened else None
        ref = (image, label, problem)
        return Item(key, None, split, ref, size, kind, display_path(image), original)

    def _once(self, split: str, items: list[Item]) -> list[Item]:
        """`items`, once each: refuse an image in two splits, or two images of one key."""
        keys: dict[str, str] = {}
        for item in items:
            other = self.split_of.setdefault(item.ref[0], split)
            if other != split:
                raise SourceError(
                    f"{item.origin} is in {other} and in {split}; each image belongs to one "
                    "split (fix the YAML's splits or lists)"
                )
            if item.key in keys:
                raise SourceError(
                    f"{item.origin} and {keys[item.key]} both make the key {item.key!r} in "
                    f"{split} (an image listed twice, or two folders of one split holding the "
                    "same file names); fix the YAML's splits or lists"
                )
            keys[item.key] = item.origin
        return items


def _unused(top: str, files: dict[str, RawEntry], used: set[str], darknet: bool) -> dict[str, int]:
    """What was not read: label files of no image, other files."""
    counts = dict.fromkeys(("annotation files", "split lists", "masks", "other"), 0)
    for path in files:
        if path not in used:
            label = path.endswith(".txt") and (darknet or _LABELS in path[len(top) :])
            counts["annotation files" if label else "other"] += 1
    return counts
