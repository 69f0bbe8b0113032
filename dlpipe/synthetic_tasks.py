"""The detection and segmentation demo data: several shapes per image, with the boxes and masks
the drawing knows, written in layouts that dlpipe's own sources convert.

Each scene is a square JPEG on the classification demo's textured background
(`dlpipe.synthetic`) holding 1 to `max_objects` shapes of the eight `SHAPE_CLASSES`, each in a
square tile of its own (tiles never overlap, so every shape is whole and its mask is exactly
its visible pixels). An object's mask is its soft shape mask at >= 128; its box bounds that
mask in pixel-edge coordinates. Scene `i` depends only on (`seed`, `i`).

- `write_coco`: COCO's layout (the ``coco`` source): ``annotations/instances_train.json`` and
  ``instances_val.json`` (categories 1-8 in `SHAPE_CLASSES` order; per object ``bbox`` [x, y,
  w, h], ``category_id``, ``segmentation`` as COCO's compressed RLE, ``area`` = the mask's
  pixels, ``iscrowd`` 0) with the JPEGs in ``train/`` and ``val/``. ``dlpipe convert RAW --to
  wds --instance-masks`` gives ``boxes.json`` and ``masks.json`` (task detection).
- `write_voc_segmentation`: Pascal VOC's segmentation layout (the ``voc-seg`` source):
  ``VOC2012/JPEGImages/``, ``SegmentationClass/`` (greyscale label maps: 0 background, 1-8 the
  shapes in `SHAPE_CLASSES` order, 255 the soft edge of each shape, VOC's void border),
  ``ImageSets/Segmentation/{train,val}.txt`` and a ``labelmap.txt`` naming the nine classes
  (CVAT's and Datumaro's VOC export). ``dlpipe convert RAW`` gives ``seg.png`` (task
  segmentation, ignore 255).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
from PIL import Image

from dlpipe import rle
from dlpipe.annotations import voc_colour
from dlpipe.synthetic import SHAPE_CLASSES, draw_mask, textured_background

__all__ = ["Scene", "SceneObject", "render_scene", "write_coco", "write_voc_segmentation"]

VOID = 255
_EDGE = (48, 208)  # soft-mask levels of a shape's edge: void in the label map
_TILE = (0.28, 0.5)  # a tile's side, as a share of the image side
_PLACEMENT_TRIES = 30


class SceneObject(NamedTuple):
    """One drawn shape: its class index, (H, W) bool mask and XYXY pixel-edge box."""

    label: int
    mask: np.ndarray
    box: tuple[int, int, int, int]


class Scene(NamedTuple):
    """One image and the shapes drawn on it, with its label map (`write_voc_segmentation`)."""

    image: Image.Image
    objects: list[SceneObject]
    label_map: np.ndarray


def _tiles(rng: np.random.Generator, size: int, count: int) -> list[tuple[int, int, int]]:
    """Up to `count` non-overlapping square tiles (left, top, side) in a `size` image."""
    tiles: list[tuple[int, int, int]] = []
    for _ in range(count * _PLACEMENT_TRIES):
        if len(tiles) == count:
            break
        side = int(rng.integers(round(_TILE[0] * size), round(_TILE[1] * size) + 1))
        left, top = (int(v) for v in rng.integers(0, size - side + 1, size=2))
        if all(_apart((left, top, side), tile) for tile in tiles):
            tiles.append((left, top, side))
    return tiles


def _apart(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    return a[0] + a[2] <= b[0] or b[0] + b[2] <= a[0] or a[1] + a[2] <= b[1] or b[1] + b[2] <= a[1]


def render_scene(index: int, *, seed: int = 0, size: int = 128, max_objects: int = 4) -> Scene:
    """Scene `index`: a `size` x `size` image with 1 to `max_objects` shapes.

    Raises:
        ValueError: a size under 32 pixels or fewer than 1 object.
    """
    if size < 32 or max_objects < 1:
        raise ValueError(f"size {size} must be >= 32 and max_objects {max_objects} >= 1")
    rng = np.random.default_rng([seed, index])
    image = textured_background(rng, size, size)
    soft = np.zeros((size, size), np.uint8)
    label_map = np.zeros((size, size), np.uint8)
    objects = []
    for left, top, side in _tiles(rng, size, int(rng.integers(1, max_objects + 1))):
        label = int(rng.integers(len(SHAPE_CLASSES)))
        tile = np.asarray(draw_mask(SHAPE_CLASSES[label], (side, side), rng))
        window = (slice(top, top + side), slice(left, left + side))
        soft[window] = tile
        edge = (tile >= _EDGE[0]) & (tile < _EDGE[1])
        label_map[window] = np.where(tile >= _EDGE[1], label + 1, label_map[window])
        label_map[window] = np.where(edge, VOID, label_map[window])
        mask = np.zeros((size, size), bool)
        mask[window] = tile >= 128
        if mask.any():
            objects.append(SceneObject(label, mask, _bounds(mask)))
        _paint(image, tile, (left, top), rng)
    return Scene(image, objects, label_map)


def _bounds(mask: np.ndarray) -> tuple[int, int, int, int]:
    rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
    return int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1


def _paint(image: Image.Image, tile: np.ndarray, corner: tuple[int, int], rng: Any) -> None:
    """Composite a colour through the soft tile mask, contrasting with what lies under it."""
    side = tile.shape[0]
    box = (corner[0], corner[1], corner[0] + side, corner[1] + side)
    under = image.crop(box)
    luma = float(np.asarray(under.convert("L")).mean())
    colour = rng.integers(0, 90, size=3) if luma > 128 else rng.integers(166, 256, size=3)
    fill = Image.new("RGB", (side, side), tuple(int(c) for c in colour))
    image.paste(Image.composite(fill, under, Image.fromarray(tile)), box[:2])


def _jpeg(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def _scenes(counts: dict[str, int], seed: int, size: int) -> Iterator[tuple[str, int, Scene]]:
    """(split, index, scene) for `counts` scenes per split, indices running on across splits."""
    start = 0
    for split, count in counts.items():
        for index in range(start, start + count):
            yield split, index, render_scene(index, seed=seed, size=size)
        start += count


def write_coco(
    root: str, train: int = 200, val: int = 50, *, seed: int = 0, size: int = 128
) -> dict[str, int]:
    """Write `train` and `val` scenes in COCO's layout under `root`; returns the objects per
    split."""
    splits: dict[str, dict[str, list]] = {}
    for split, index, scene in _scenes({"train": train, "val": val}, seed, size):
        os.makedirs(os.path.join(root, split), exist_ok=True)
        name = f"{index:06d}.jpg"
        with open(os.path.join(root, split, name), "wb") as f:
            f.write(_jpeg(scene.image))
        data = splits.setdefault(split, {"images": [], "annotations": []})
        data["images"].append({"id": index + 1, "file_name": name, "width": size, "height": size})
        for obj in scene.objects:
            data["annotations"].append(_annotation(obj, index + 1, size))
    categories = [{"id": i + 1, "name": name} for i, name in enumerate(SHAPE_CLASSES)]
    os.makedirs(os.path.join(root, "annotations"), exist_ok=True)
    for split, data in splits.items():
        for i, annotation in enumerate(data["annotations"]):
            annotation["id"] = i + 1
        path = os.path.join(root, "annotations", f"instances_{split}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({**data, "categories": categories}, f)
    return {split: len(data["annotations"]) for split, data in splits.items()}


def _annotation(obj: SceneObject, image_id: int, size: int) -> dict[str, Any]:
    x0, y0, x1, y1 = obj.box
    return {
        "image_id": image_id,
        "category_id": obj.label + 1,
        "bbox": [x0, y0, x1 - x0, y1 - y0],
        "area": int(obj.mask.sum()),
        "iscrowd": 0,
        "segmentation": {"size": [size, size], "counts": rle.encode(obj.mask)},
    }


def write_voc_segmentation(
    root: str, train: int = 200, val: int = 50, *, seed: int = 0, size: int = 128
) -> dict[str, int]:
    """Write `train` and `val` scenes in Pascal VOC's segmentation layout under
    ``root/VOC2012``; returns the images per split."""
    year = os.path.join(root, "VOC2012")
    for folder in ("JPEGImages", "SegmentationClass", os.path.join("ImageSets", "Segmentation")):
        os.makedirs(os.path.join(year, folder), exist_ok=True)
    ids: dict[str, list[str]] = {}
    for split, index, scene in _scenes({"train": train, "val": val}, seed, size):
        ident = f"2026_{index:06d}"
        with open(os.path.join(year, "JPEGImages", f"{ident}.jpg"), "wb") as f:
            f.write(_jpeg(scene.image))
        Image.fromarray(scene.label_map).save(
            os.path.join(year, "SegmentationClass", f"{ident}.png")
        )
        ids.setdefault(split, []).append(ident)
    for split, names in ids.items():
        with open(os.path.join(year, "ImageSets", "Segmentation", f"{split}.txt"), "w") as f:
            f.write("".join(f"{name}\n" for name in names))
    lines = ["# label:color_rgb:parts:actions"]
    for i, name in enumerate(("background", *SHAPE_CLASSES)):
        lines.append(f"{name}:{','.join(map(str, voc_colour(i)))}::")
    with open(os.path.join(year, "labelmap.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return {split: len(names) for split, names in ids.items()}
