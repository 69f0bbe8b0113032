"""Annotation fields beyond ``cls``: object boxes, segmentation maps, and what the manifest
says about them.

Every annotation is an ordinary field (a name and bytes, `dlpipe.sample`), readable without
dlpipe by the codec its extension names:

- ``boxes.json`` (kind ``boxes``): one JSON object per sample, each per-object attribute a list
  in the same object order::

      {"boxes": [[x_min, y_min, x_max, y_max], ...],   # absolute pixels of the stored image
       "labels": [3, 17, ...],                         # index into the manifest's classes
       "iscrowd": [0, 1, ...],                         # COCO's crowd flag (0 when absent)
       "ids": [...],                                   # optional: the source's object ids
       "difficult": [...], "truncated": [...]}         # optional: VOC's flags, 0/1

  Boxes are XYXY in pixel-edge coordinates: the image spans ``[0, W] x [0, H]``, so a box
  covering the whole image is ``[0, 0, W, H]`` (torchvision's ``BoundingBoxes`` format
  ``"XYXY"`` with ``canvas_size=(H, W)``). COCO's ``[x, y, w, h]`` is ``[x, y, x + w, y + h]``;
  VOC's 1-based inclusive pixel indices are ``[xmin - 1, ymin - 1, xmax, ymax]``; YOLO's
  normalised centre boxes are scaled by the image size. A sample without objects (a
  background image) has empty lists. When convert resizes an image (``--max-side``) its boxes
  are scaled with it.
- ``seg.png`` (kind ``mask``): a semantic label map as a lossless PNG (mode ``L``, or ``I;16``
  beyond 255 values) of the stored image's size; each pixel's value is described by the
  field's schema (``values``: value → name, and ``ignore``, e.g. VOC's 255 border). Resized
  with the image by nearest neighbour.
- ``masks.json`` (kind ``instance_masks``): one binary mask per object of ``boxes.json``, in
  its object order, as COCO's compressed RLE (`dlpipe.rle`)::

      {"size": [H, W], "counts": ["<compressed RLE>", ...]}

  ``pycocotools.mask.decode({"size": [H, W], "counts": s})`` (or `dlpipe.rle.decode`) gives
  an object's (H, W) 0/1 mask of the stored image. Resized with the image by nearest
  neighbour (and encoded again).
- ``txt`` (kind ``caption``): UTF-8 text; ``json``: the source's other per-sample columns.

The manifest's ``task`` (one of `TASKS`, or absent) says what the dataset is for, and its
``field_schemas`` maps each annotation field to its kind and conventions (`BOXES_SCHEMA`,
`mask_schema`, `INSTANCE_MASKS_SCHEMA`), so a reader never guesses a task from field names.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

import numpy as np

from dlpipe import rle
from dlpipe.errors import DlpipeError

__all__ = [
    "BOXES_FIELD",
    "BOXES_SCHEMA",
    "CAPTION_SCHEMA",
    "INSTANCE_MASKS_SCHEMA",
    "MASKS_FIELD",
    "MASK_FIELD",
    "OBJECT_FLAGS",
    "TASKS",
    "AnnotationError",
    "check_boxes",
    "check_field_schemas",
    "encode_boxes",
    "encode_masks",
    "fit_annotations",
    "four_numbers",
    "mask_schema",
    "read_boxes",
    "read_masks",
    "voc_colour",
]

BOXES_FIELD = "boxes.json"
MASK_FIELD = "seg.png"
MASKS_FIELD = "masks.json"
TASKS = ("classification", "detection", "segmentation", "captioning")
OBJECT_FLAGS = ("iscrowd", "difficult", "truncated")
"""Per-object 0/1 attributes a ``boxes.json`` may carry (``iscrowd`` always)."""

BOXES_SCHEMA: dict[str, Any] = {
    "kind": "boxes",
    "format": "XYXY",
    "units": "pixels",
    "labels": "classes",
}
INSTANCE_MASKS_SCHEMA: dict[str, Any] = {
    "kind": "instance_masks",
    "encoding": "coco_rle",
    "order": BOXES_FIELD,
}
CAPTION_SCHEMA: dict[str, Any] = {"kind": "caption"}
_KINDS = ("boxes", "mask", "instance_masks", "caption", "columns")
_MAX_OBJECTS = 100_000  # per image: COCO's most crowded image has under 1,000
_EXACT = 2**53  # a float's whole numbers are exact below it
_JSON = json.JSONEncoder(separators=(",", ":"), sort_keys=True)  # json.dumps's, made once
_NUMBER_TYPES = frozenset({int, float})  # what JSON numbers decode to (bools are not numbers)


class AnnotationError(DlpipeError, ValueError):
    """An annotation is malformed or does not fit its image (a per-sample error in convert)."""


def mask_schema(values: Mapping[int, str] | None = None, ignore: int | None = None) -> dict:
    """The schema of a ``seg.png`` field: pixel value → name (None: the manifest's classes,
    by index), and the value that marks pixels to ignore."""
    schema: dict[str, Any] = {"kind": "mask", "encoding": "png"}
    schema["values"] = (
        "classes" if values is None else {str(k): v for k, v in sorted(values.items())}
    )
    if ignore is not None:
        schema["ignore"] = ignore
    return schema


def encode_boxes(
    boxes: Sequence[Sequence[float]],
    labels: Sequence[int],
    *,
    iscrowd: Sequence[int] | None = None,
    ids: Sequence[int | str] | None = None,
    **flags: Sequence[int],
) -> bytes:
    """The ``boxes.json`` bytes for one sample's objects (compact JSON, sorted keys).

    Args:
        boxes: XYXY pixel-edge boxes of the source image.
        labels: each object's class index.
        iscrowd: each object's crowd flag (default all 0).
        ids: the source's object ids, kept as they are.
        **flags: other per-object 0/1 flags by name (``difficult``, ``truncated``).
    """
    record: dict[str, Any] = {
        "boxes": [[_number(v) for v in map(float, box)] for box in boxes],
        "labels": list(map(int, labels)),
        "iscrowd": list(map(int, iscrowd)) if iscrowd is not None else [0] * len(boxes),
    }
    if ids is not None:
        record["ids"] = list(ids)
    for name, values in flags.items():
        if name not in OBJECT_FLAGS:
            raise ValueError(f"unknown object flag {name!r}; known: {', '.join(OBJECT_FLAGS)}")
        record[name] = list(map(int, values))
    return _JSON.encode(record).encode("utf-8")


def _number(number: float) -> float | int:
    """An int when the float is whole (VOC's pixels), else the float, for short, stable JSON."""
    return int(number) if number.is_integer() and -_EXACT < number < _EXACT else number


def read_boxes(data: bytes) -> dict[str, list[Any]]:
    """Parse and check the structure of ``boxes.json`` bytes (not against an image).

    Raises:
        AnnotationError: not JSON, a missing or ragged list, a box that is not 4 finite
            numbers, a negative label, a flag that is not 0/1.
    """
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise AnnotationError(f"boxes.json is not UTF-8 JSON ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("boxes"), list):
        raise AnnotationError('boxes.json is not an object with a "boxes" list')
    count = len(record["boxes"])
    if count > _MAX_OBJECTS:
        raise AnnotationError(f"boxes.json holds {count} objects, over {_MAX_OBJECTS}")
    for name, values in record.items():
        if not isinstance(values, list) or len(values) != count:
            raise AnnotationError(f'boxes.json "{name}" is not a list of {count} entries')
    if not _plain_boxes(record["boxes"]):
        for box in record["boxes"]:  # the first bad box named
            if not (
                isinstance(box, list)
                and len(box) == 4
                and all(_is_number(v) and math.isfinite(v) for v in box)
            ):
                raise AnnotationError(
                    f"box {box!r} is not 4 finite numbers [x_min, y_min, x_max, y_max]"
                )
    labels = record.get("labels")
    if labels is None or not (_all_ints(labels) and min(labels, default=0) >= 0):
        raise AnnotationError('boxes.json "labels" are not class indices (integers >= 0)')
    for name in OBJECT_FLAGS:
        if name in record and not (_all_ints(record[name]) and set(record[name]) <= {0, 1}):
            raise AnnotationError(f'boxes.json "{name}" holds a value that is not 0 or 1')
    return record


def _plain_boxes(boxes: list[Any]) -> bool:
    """True when every box is a list of 4 finite JSON numbers (a sum that is not finite, or
    an int too large for a float, sends the caller to its box-by-box check)."""
    for box in boxes:
        if not four_numbers(box):
            return False
        try:
            if not math.isfinite(box[0] + box[1] + box[2] + box[3]):
                return False
        except OverflowError:
            return False
    return True


def four_numbers(box: Any) -> TypeGuard[list[Any]]:
    """Whether `box` is a list of 4 JSON numbers (ints or floats as `json` decodes them; no
    bools, no subclasses): the quick test of a box's shape."""
    return (
        type(box) is list
        and len(box) == 4
        and type(box[0]) in _NUMBER_TYPES
        and type(box[1]) in _NUMBER_TYPES
        and type(box[2]) in _NUMBER_TYPES
        and type(box[3]) in _NUMBER_TYPES
    )


def _all_ints(values: list[Any]) -> bool:
    """True when every value is a JSON integer (bools are not)."""
    return set(map(type, values)) <= {int}


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_boxes(
    data: bytes, width: int, height: int, num_classes: int | None = None, slack: float = 1.0
) -> dict[str, list[Any]]:
    """`read_boxes`, then each box against a `width` x `height` image and the class count.

    A box may reach `slack` pixels past an edge (annotation tools round outwards); one further
    out, or with no positive width and height, is refused.

    Raises:
        AnnotationError: naming the object, the box and the rule it breaks.
    """
    record = read_boxes(data)
    for i, (x0, y0, x1, y1) in enumerate(record["boxes"]):
        if not (x1 > x0 and y1 > y0):
            raise AnnotationError(
                f"object {i}: box [{x0}, {y0}, {x1}, {y1}] has no positive width and height"
            )
        if x0 < -slack or y0 < -slack or x1 > width + slack or y1 > height + slack:
            raise AnnotationError(
                f"object {i}: box [{x0}, {y0}, {x1}, {y1}] lies outside the {width}x{height} image"
            )
        label = record["labels"][i]
        if num_classes is not None and label >= num_classes:
            raise AnnotationError(
                f"object {i}: label {label} is not one of the {num_classes} classes"
            )
    return record


def _scaled_boxes(record: dict[str, list[Any]], sx: float, sy: float) -> bytes:
    boxes = [
        [round(x0 * sx, 4), round(y0 * sy, 4), round(x1 * sx, 4), round(y1 * sy, 4)]
        for x0, y0, x1, y1 in record["boxes"]
    ]
    flags = {name: record[name] for name in OBJECT_FLAGS[1:] if name in record}
    return encode_boxes(
        boxes, record["labels"], iscrowd=record["iscrowd"], ids=record.get("ids"), **flags
    )


def _fitted_mask(data: bytes, size_in: tuple[int, int], size_out: tuple[int, int]) -> bytes:
    """The mask checked to be a lossless label map of the source image's size, resized to the
    stored image's by nearest neighbour (re-encoded only then)."""
    from PIL import Image

    from dlpipe.codecs import open_image

    try:
        mask = open_image(data)
        mask.load()
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ...
        raise AnnotationError(f"the mask is not a readable PNG ({exc})") from None
    if mask.format != "PNG" or mask.mode not in ("L", "P", "I;16", "I", "1"):
        raise AnnotationError(
            f"the mask is a {mask.format} image in mode {mask.mode}; a label map is a "
            "single-channel lossless PNG"
        )
    if mask.size != size_in:
        raise AnnotationError(
            f"the mask is {mask.size[0]}x{mask.size[1]}, its image {size_in[0]}x{size_in[1]}"
        )
    if size_in == size_out:
        return data
    if mask.mode == "P":  # the palette index is the class value (VOC's SegmentationClass)
        mask = Image.frombytes("L", mask.size, mask.tobytes())
    buffer = io.BytesIO()
    mask.resize(size_out, Image.Resampling.NEAREST).save(buffer, format="PNG")
    return buffer.getvalue()


def encode_masks(size: tuple[int, int], counts: Sequence[str]) -> bytes:
    """The ``masks.json`` bytes: the image's (height, width) and each object's compressed RLE
    string (compact JSON, sorted keys)."""
    record = {"counts": list(counts), "size": [int(size[0]), int(size[1])]}
    return json.dumps(record, separators=(",", ":"), sort_keys=True).encode("utf-8")


def read_masks(data: bytes) -> tuple[tuple[int, int], list[str]]:
    """The (height, width) and RLE strings of ``masks.json`` bytes, their structure checked
    (not the strings: `dlpipe.rle.check`).

    Raises:
        AnnotationError: not UTF-8 JSON, or not ``{"size": [H, W], "counts": [str, ...]}``.
    """
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise AnnotationError(f"masks.json is not UTF-8 JSON ({exc})") from None
    size = record.get("size") if isinstance(record, dict) else None
    counts = record.get("counts") if isinstance(record, dict) else None
    if not (
        isinstance(size, list)
        and len(size) == 2
        and all(_is_int(v) and v >= 0 for v in size)
        and isinstance(counts, list)
        and all(isinstance(c, str) for c in counts)
    ):
        raise AnnotationError(
            'masks.json is not {"size": [height, width], "counts": ["<RLE>", ...]}'
        )
    if len(counts) > _MAX_OBJECTS:
        raise AnnotationError(f"masks.json holds {len(counts)} masks, over {_MAX_OBJECTS}")
    return (size[0], size[1]), counts


def _fitted_masks(
    data: bytes, size_in: tuple[int, int], size_out: tuple[int, int], objects: int | None
) -> bytes:
    """``masks.json`` checked against the source image (its size, one decodable mask per
    object), each mask resized to the stored image by nearest neighbour when they differ."""
    from PIL import Image

    (height, width), counts = read_masks(data)
    if (width, height) != size_in:
        raise AnnotationError(
            f"masks.json is {width}x{height}, its image {size_in[0]}x{size_in[1]}"
        )
    if objects is not None and len(counts) != objects:
        raise AnnotationError(
            f"masks.json holds {len(counts)} masks for the {objects} objects of boxes.json"
        )
    for i, string in enumerate(counts):
        try:
            rle.check(string, (height, width))
        except rle.RLEError as exc:
            raise AnnotationError(
                f"mask {i} of masks.json is no {width}x{height} mask: {exc}"
            ) from None
    if size_in == size_out:
        return data
    resized = []
    for string in counts:  # the resize of seg.png: the same pixels chosen
        mask = Image.fromarray(np.ascontiguousarray(rle.decode(string, (height, width))))
        resized.append(rle.encode(np.asarray(mask.resize(size_out, Image.Resampling.NEAREST))))
    return encode_masks((size_out[1], size_out[0]), resized)


def fit_annotations(
    fields: dict[str, bytes],
    size_in: tuple[int, int],
    size_out: tuple[int, int],
    num_classes: int | None = None,
) -> dict[str, bytes]:
    """Check a sample's annotation fields against its image and follow a resize.

    Args:
        fields: the sample's fields as the source gave them.
        size_in: the source image's (width, height).
        size_out: the stored image's (width, height).
        num_classes: the dataset's class count, for box labels.

    Returns:
        `fields`, with ``boxes.json`` scaled and ``seg.png`` and ``masks.json`` resized when the
        sizes differ, and every other image field of the source image's size resized with it
        (a single-channel PNG by nearest neighbour, others with Lanczos).

    Raises:
        AnnotationError: a box outside the image, a degenerate box, an unknown label, a mask
            of another size or not a label map, instance masks of another size, another count
            than the boxes or not decodable.
    """
    out = dict(fields)
    objects = None
    if BOXES_FIELD in fields:
        record = check_boxes(fields[BOXES_FIELD], *size_in, num_classes)
        objects = len(record["boxes"])
        if size_in != size_out:
            sx, sy = size_out[0] / size_in[0], size_out[1] / size_in[1]
            out[BOXES_FIELD] = _scaled_boxes(record, sx, sy)
    if MASK_FIELD in fields:
        out[MASK_FIELD] = _fitted_mask(fields[MASK_FIELD], size_in, size_out)
    if MASKS_FIELD in fields:
        out[MASKS_FIELD] = _fitted_masks(fields[MASKS_FIELD], size_in, size_out, objects)
    if size_in != size_out:
        for name, data in fields.items():
            if name not in ("image", MASK_FIELD) and name.rsplit(".", 1)[-1] in _IMAGE_FORMATS:
                out[name] = _fitted_image(data, size_in, size_out)
    return out


_IMAGE_FORMATS = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}
_LABEL_MODES = ("1", "L", "P", "I", "I;16")


def _fitted_image(data: bytes, size_in: tuple[int, int], size_out: tuple[int, int]) -> bytes:
    """Another image of the sample (a conditioning image, a second view) resized with the main
    one when it has the main one's size: a single-channel PNG (a label map) by nearest
    neighbour, anything else with Lanczos, re-encoded in its own format; one of another size
    is kept as it is."""
    from PIL import Image

    from dlpipe.codecs import open_image

    try:
        image = open_image(data)
        if image.size != size_in:
            return data
        image.load()
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ...
        raise AnnotationError(f"a second image of the sample is not readable ({exc})") from None
    label_map = image.format == "PNG" and image.mode in _LABEL_MODES
    if image.mode == "P" and label_map:
        image = Image.frombytes("L", image.size, image.tobytes())
    method = Image.Resampling.NEAREST if label_map else Image.Resampling.LANCZOS
    buffer = io.BytesIO()
    image.resize(size_out, method).save(buffer, format=image.format or "PNG", quality=95)
    return buffer.getvalue()


def check_field_schemas(schema: Any, fields: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Validate a manifest's ``field_schemas``: an object of field name → an object with a known
    ``kind``, for fields the dataset has.

    Raises:
        ValueError: naming the entry and the rule.
    """
    if not isinstance(schema, dict):
        raise ValueError("'field_schemas' is not a JSON object")
    for name, entry in schema.items():
        if name not in fields:
            raise ValueError(f"field_schemas names field {name!r}, which the dataset does not have")
        if not isinstance(entry, dict) or entry.get("kind") not in _KINDS:
            raise ValueError(f"field_schemas.{name} is not an object whose kind is one of {_KINDS}")
    return dict(schema)


def voc_colour(index: int) -> tuple[int, int, int]:
    """Pascal VOC's palette colour of label `index` (``VOClabelcolormap.m``: the index's bits
    interleaved over R, G and B from the top bit down): the colour a VOC label map and
    ``labelmap.txt`` give each class."""
    rgb = [0, 0, 0]
    for bit in range(7, -1, -1):
        for channel in range(3):
            rgb[channel] |= ((index >> channel) & 1) << bit
        index >>= 3
    return rgb[0], rgb[1], rgb[2]
