"""A sample's annotation fields → the training target of its task, checked as untrusted input.

What the fields are comes from the manifest (`dlpipe.annotations`: ``task``, ``field_schemas``,
``classes``), never from their names; `TargetSpec.from_manifest` reads it once, and
`TargetSpec.target` turns one sample's fields into torchvision's conventions:

- detection: ``{"boxes": tv_tensors.BoundingBoxes (N, 4) float32, XYXY, canvas_size=(H, W),
  "labels": int64 (N,), "iscrowd": int64 (N,), "image_id": int}`` plus ``"masks":
  tv_tensors.Mask (N, H, W) uint8`` where the dataset has instance masks (``masks.json``);
  ``image_id`` is the source's id (the ``json`` field's ``image_id``, COCO's) when the sample
  has one, else the sample's index in its split;
- segmentation: ``tv_tensors.Mask (H, W)`` of the label map's values (uint8, int64 beyond
  255), the schema's ``ignore`` value kept where it is;
- captioning: the ``txt`` field as a str.

The checks are those convert made (`dlpipe.annotations.check_boxes`), made again because a
prepared dataset is untrusted: a box that is not 4 finite numbers, has no positive width and
height, lies further than `BOX_SLACK_PX` outside the image or has a label outside the classes;
instance masks of another size than the image or another count than the boxes; a label map of
another size than the image or holding a value that is neither one of the schema's values nor
its ``ignore``. Each is a `TargetError` naming the sample, the field, the value and the rule:
a per-sample error, as a field that does not decode is, never a silently wrong target. A box
within the slack is clamped onto the image (convert kept it as the annotation tool wrote it).

A DataLoader worker sends a batch's target dicts as a `TargetBatch`: one column per key, not a
shared-memory segment per tensor; they arrive as the plain list.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torchvision import tv_tensors
from torchvision.io import decode_png

from dlpipe import rle
from dlpipe.annotations import (
    BOXES_FIELD,
    MASK_FIELD,
    MASKS_FIELD,
    AnnotationError,
    check_boxes,
    read_masks,
)
from dlpipe.codecs import max_image_pixels, open_image
from dlpipe.errors import FieldDecodeError
from dlpipe.manifest import Manifest
from dlpipe.sample import KEY_FIELD, Sample

__all__ = [
    "BOX_SLACK_PX",
    "INLINE_BYTES",
    "TARGET_TASKS",
    "TargetBatch",
    "TargetError",
    "TargetSpec",
    "batch_for_transfer",
]

BOX_SLACK_PX = 1.0
"""How far past an edge a stored box may reach (convert's `check_boxes` slack)."""
TARGET_TASKS = ("detection", "segmentation", "captioning")
INLINE_BYTES = 1 << 16
"""A `TargetBatch` column up to this size travels inside the pickle; a larger one (instance
masks) as one tensor, in one shared-memory segment."""
_LABEL_MAP_MODES = ("L", "P", "I;16", "I", "1")


class TargetError(AnnotationError, FieldDecodeError):
    """A sample's annotation makes no valid target of its task: a per-sample error, caught
    wherever a field that does not decode is (it is both an `AnnotationError` and a
    `FieldDecodeError`)."""


@dataclass(frozen=True)
class TargetSpec:
    """What a dataset's annotation fields are, read once from its manifest.

    Attributes:
        task: one of `TARGET_TASKS`.
        num_classes: the manifest's class count (box labels are indices into it).
        field: the annotation field the task reads (``boxes.json``, ``seg.png``, ``txt``).
        instance_masks: whether detection targets carry ``masks`` (``masks.json``).
        mask_values: the values a label map may hold (segmentation), ``ignore`` included.
        ignore: the label map's ignore value (VOC's 255), or None.
    """

    task: str
    num_classes: int
    field: str
    instance_masks: bool = False
    mask_values: frozenset[int] = frozenset()
    ignore: int | None = None

    @classmethod
    def from_manifest(cls, manifest: Manifest, task: str | None = None) -> TargetSpec:
        """The spec of `manifest`'s `task` (default: the manifest's own).

        Raises:
            ValueError: no task, a task that has no target here, or the dataset lacks the
                field the task reads (naming the fields it has).
        """
        task = task or manifest.task
        if task not in TARGET_TASKS:
            raise ValueError(
                f"task {task!r} has no target here: give one of {', '.join(TARGET_TASKS)} "
                "(a dataset converted from a detection, segmentation or captioning layout "
                "names its task in dlpipe.json)"
            )
        schemas, num_classes = manifest.field_schemas, len(manifest.classes)
        if task == "detection":
            return cls(task, num_classes, _kind_field(schemas, "boxes", BOXES_FIELD, task),
                       instance_masks=MASKS_FIELD in schemas)  # fmt: skip
        if task == "segmentation":
            field = _kind_field(schemas, "mask", MASK_FIELD, task)
            values, ignore = _mask_values(schemas[field], num_classes)
            return cls(task, num_classes, field, mask_values=values, ignore=ignore)
        return cls(task, num_classes, _caption_field(manifest))

    def target(
        self, sample: Sample, size: tuple[int, int], index: int
    ) -> dict[str, Any] | tv_tensors.Mask | str:
        """The target of one sample whose image is `size` = (height, width).

        Args:
            sample: the sample's fields (bytes) and key.
            size: the decoded image's (height, width), which boxes and masks must fit.
            index: the sample's index in its split (detection's ``image_id`` without a
                source id).

        Raises:
            TargetError: naming the sample, the field and the rule its value breaks.
        """
        try:
            if self.task == "detection":
                return self._detection(sample, size, index)
            if self.task == "segmentation":
                return self._segmentation(_field(sample, self.field), size)
            return _text(_field(sample, self.field))
        except AnnotationError as exc:
            key = sample.get(KEY_FIELD, "?")
            raise TargetError(f"sample {key!r} field {self.field!r}: {exc}") from None

    def _detection(self, sample: Sample, size: tuple[int, int], index: int) -> dict[str, Any]:
        height, width = size
        data = _field(sample, self.field)
        record = check_boxes(data, width, height, self.num_classes, slack=BOX_SLACK_PX)
        boxes = _clamped(record["boxes"], size)
        labels = torch.tensor(record["labels"], dtype=torch.int64)
        target: dict[str, Any] = {
            "boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=size),
            "labels": labels,
            "iscrowd": torch.tensor(record.get("iscrowd", [0] * len(labels)), dtype=torch.int64),
            "image_id": _image_id(sample, index),
        }
        if self.instance_masks:
            target["masks"] = _instance_masks(_field(sample, MASKS_FIELD), size, len(labels))
        return target

    def _segmentation(self, data: bytes, size: tuple[int, int]) -> tv_tensors.Mask:
        array = _label_map(data, size)
        _check_values(array, self.mask_values, self.ignore)
        if array.dtype != np.uint8:
            array = array.astype(np.int64)
        return tv_tensors.Mask(torch.from_numpy(array))


def _kind_field(schemas: Mapping[str, Mapping[str, Any]], kind: str, usual: str, task: str) -> str:
    """The field whose schema is of `kind` (`usual` first), else a ValueError naming it."""
    fields = [name for name, schema in schemas.items() if schema.get("kind") == kind]
    if not fields:
        raise ValueError(
            f"the dataset's task is {task} but no field of dlpipe.json's field_schemas is of "
            f"kind {kind!r} (a {usual} field); convert it from a {task} layout"
        )
    return usual if usual in fields else sorted(fields)[0]


def _caption_field(manifest: Manifest) -> str:
    for name, schema in manifest.field_schemas.items():
        if schema.get("kind") == "caption":
            return name
    if "txt" in manifest.fields:
        return "txt"
    raise ValueError("the dataset's task is captioning but it has no txt field")


def _mask_values(schema: Mapping[str, Any], num_classes: int) -> tuple[frozenset[int], int | None]:
    """The values a label map may hold, and its ignore value, from a ``mask`` schema."""
    values, ignore = schema.get("values", "classes"), schema.get("ignore")
    try:
        allowed = set(range(num_classes)) if values == "classes" else {int(v) for v in values}
        if ignore is not None:
            allowed.add(int(ignore))
    except (TypeError, ValueError):
        raise ValueError(
            f"dlpipe.json's mask schema {dict(schema)!r} is not values ('classes' or an object "
            "of value -> name) and an integer ignore value; convert the dataset again"
        ) from None
    return frozenset(allowed), None if ignore is None else int(ignore)


def _field(sample: Sample, name: str) -> bytes:
    if name not in sample:
        raise AnnotationError("the sample has no such field (every sample of the task needs one)")
    return bytes(sample[name])  # type: ignore[arg-type]


def _text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AnnotationError(f"the caption is not UTF-8 ({exc})") from None


def _clamped(boxes: list[list[float]], size: tuple[int, int]) -> torch.Tensor:
    """(N, 4) float32 boxes, checked by `check_boxes`, clamped onto the image (they may reach
    `BOX_SLACK_PX` past an edge)."""
    height, width = size
    out = torch.tensor(boxes, dtype=torch.float64).reshape(-1, 4)
    out[:, 0::2] = out[:, 0::2].clamp(0, width)
    out[:, 1::2] = out[:, 1::2].clamp(0, height)
    return out.to(torch.float32)


def _image_id(sample: Sample, index: int) -> int:
    """The source's image id (the ``json`` field's ``image_id``, an integer) or `index`."""
    if "json" in sample:
        try:
            columns = json.loads(bytes(sample["json"]))  # type: ignore[arg-type]
        except (UnicodeDecodeError, ValueError, RecursionError):
            return index
        value = columns.get("image_id") if isinstance(columns, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return index


def _instance_masks(data: bytes, size: tuple[int, int], count: int) -> tv_tensors.Mask:
    """``masks.json`` as an (N, H, W) 0/1 uint8 Mask, one per box, of the image's size."""
    (height, width), counts = read_masks(data)
    if (height, width) != size:
        raise AnnotationError(
            f"masks.json is {width}x{height}, its image {size[1]}x{size[0]}; convert again"
        )
    if len(counts) != count:
        raise AnnotationError(f"masks.json holds {len(counts)} masks for {count} boxes")
    masks = np.zeros((count, height, width), np.uint8)
    for i, string in enumerate(counts):
        try:
            masks[i] = rle.decode(string, size)
        except rle.RLEError as exc:
            raise AnnotationError(f"mask {i} of masks.json: {exc}") from None
    return tv_tensors.Mask(torch.from_numpy(masks))


def _label_map(data: bytes, size: tuple[int, int]) -> np.ndarray:
    """A label-map PNG's values, (H, W), checked to be one of the image's size."""
    try:
        with open_image(data, max_image_pixels()) as image:
            mode, fmt = image.mode, image.format
            if fmt != "PNG" or mode not in _LABEL_MAP_MODES:
                raise AnnotationError(
                    f"the label map is a {fmt} image in mode {mode}; a label map is a "
                    "single-channel lossless PNG"
                )
            array = _greyscale_png(data) if mode == "L" else None  # what convert writes
            if array is None:
                array = np.array(image)  # a P image's palette indices, as convert stored them
    except FieldDecodeError as exc:
        raise AnnotationError(f"the label map does not decode: {exc}") from None
    except AnnotationError:
        raise
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ...
        raise AnnotationError(f"the label map does not decode ({exc})") from None
    if array.shape != size:
        raise AnnotationError(
            f"the label map is {array.shape[1]}x{array.shape[0]}, its image {size[1]}x{size[0]}"
        )
    return array.astype(np.uint8) if array.dtype == bool else array


def _greyscale_png(data: bytes) -> np.ndarray | None:
    """An 8-bit greyscale PNG's values through libpng (a third quicker than Pillow), or None
    where libpng refuses the bytes (Pillow then decodes them or names the error)."""
    try:
        values = decode_png(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    except RuntimeError:
        return None
    if values.dtype != torch.uint8 or values.shape[0] != 1:
        return None
    return values[0].numpy()


def _check_values(array: np.ndarray, allowed: frozenset[int], ignore: int | None) -> None:
    """Refuse a value outside `allowed`; the counting table is bounded by its largest."""
    if not array.size:
        return
    low, high = int(array.min()), int(array.max())
    if low < 0 or high > max(allowed, default=-1):
        unknown = [low if low < 0 else high]
    elif _within_runs(array, _runs(allowed)):
        return
    else:
        present = np.flatnonzero(np.bincount(array.ravel().astype(np.int64)))
        unknown = sorted(set(present.tolist()) - allowed)
    if unknown:
        rule = "" if ignore is None else f", or the ignore value {ignore}"
        raise AnnotationError(
            f"the label map holds value {unknown[0]}, which is not one of the schema's "
            f"{len(allowed) - (ignore is not None)} class values{rule}"
        )


_MAX_RUNS = 8  # past this many runs of values, counting them all is as quick


@functools.lru_cache(maxsize=64)
def _runs(allowed: frozenset[int]) -> tuple[tuple[int, int], ...]:
    """`allowed` as its runs of consecutive values, (first, last) each (VOC: 0-20, 255)."""
    runs: list[list[int]] = []
    for value in sorted(allowed):
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return tuple((first, last) for first, last in runs)


def _within_runs(array: np.ndarray, runs: tuple[tuple[int, int], ...]) -> bool:
    """Whether every value of `array` lies in one of `runs` (False: not checked this way, or
    not): a few vector comparisons, where counting values is slow on a map that is mostly one
    value (every count lands on one counter)."""
    if len(runs) > _MAX_RUNS:
        return False
    inside = np.zeros(array.shape, bool)
    for first, last in runs:
        inside |= (array >= first) & (array <= last)
    return bool(inside.all())


class TargetBatch(list[dict[str, Any]]):
    """The target dicts of one batch as a DataLoader worker sends them to the loader's process.

    Pickled, each tensor would travel in its own shared-memory segment, handed over through a
    connection to the worker's file-descriptor server: three small tensors a sample, about
    0.4 ms of the receiving process a sample, more than the rest of a batch costs it. A
    `TargetBatch` pickles as one column per key instead (every sample's boxes in one array,
    their lengths, each value's tensor type and metadata), inside the pickle up to
    `INLINE_BYTES` and as one tensor past it; it unpickles as the plain list of dicts, each
    tensor a view of its column, of the type and metadata it had (``BoundingBoxes``' format,
    canvas size and clamping mode). A column whose values are not tensors of one dtype and
    one shape past the first dimension (``image_id``; masks of images of other sizes)
    travels as its values; dicts with other keys, as the plain list.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        keys = list(self[0]) if self else []
        if any(list(target) != keys for target in self):
            return list, (list(self),)
        return _unpacked, (len(self), [_column(key, [t[key] for t in self]) for key in keys])


def batch_for_transfer(targets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`targets` as a `TargetBatch` inside a DataLoader worker (whose batches are pickled to
    the loader's process), else the list itself."""
    if torch.utils.data.get_worker_info() is None:
        return targets
    return TargetBatch(targets)


_Column = tuple[str, Any, list[int] | None, list[tuple[type, dict[str, Any]]] | None]


def _column(key: str, values: list[Any]) -> _Column:
    """(key, the values joined, their lengths, their types and metadata); the values as they
    are and None where they do not join."""
    first = values[0] if values else None
    joinable = isinstance(first, torch.Tensor) and first.dim() > 0 and all(
        isinstance(v, torch.Tensor) and v.dtype == first.dtype and v.shape[1:] == first.shape[1:]
        and v.device.type == "cpu" and not v.requires_grad for v in values
    )  # fmt: skip
    if not joinable:
        return key, values, None, None
    joined = torch.cat([v.as_subclass(torch.Tensor) for v in values])
    payload = joined.numpy() if joined.nbytes <= INLINE_BYTES else joined
    return key, payload, [len(v) for v in values], [(type(v), dict(vars(v))) for v in values]


def _unpacked(count: int, columns: list[_Column]) -> list[dict[str, Any]]:
    """A `TargetBatch`'s columns back as its list of dicts."""
    targets: list[dict[str, Any]] = [{} for _ in range(count)]
    for key, payload, lengths, kinds in columns:
        if lengths is None or kinds is None:
            values = payload
        else:
            joined = torch.from_numpy(payload) if isinstance(payload, np.ndarray) else payload
            parts = joined.split(lengths)
            values = [_typed(part, *kind) for part, kind in zip(parts, kinds, strict=True)]
        for target, value in zip(targets, values, strict=True):
            target[key] = value
    return targets


def _typed(part: torch.Tensor, cls: type, metadata: dict[str, Any]) -> torch.Tensor:
    """`part` as a `cls` tensor with `metadata` (a tv_tensor's attributes), as torch's own
    unpickling restores a tensor subclass."""
    if cls is torch.Tensor:
        return part
    value: torch.Tensor = part.as_subclass(cls)
    value.__dict__.update(metadata)
    return value
