"""The embedded demo dataset: coloured shapes on textured backgrounds, made on the fly.

Eight classes (the shape; colour, size, position, rotation and background vary), JPEGs of
64-128 px a side. Seeded: the same seed gives the same bytes. A small CNN separates the classes
well, so the demo and the tests can check that training learns something real.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterable, Iterator

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from dlpipe.sample import Sample

__all__ = [
    "SHAPE_CLASSES",
    "draw_mask",
    "render_shape",
    "split_samples",
    "synthetic_samples",
    "textured_background",
    "write_imagefolder",
]

SHAPE_CLASSES = ("bars", "circle", "crescent", "cross", "ring", "square", "star", "triangle")
_MIN_SIDE, _MAX_SIDE = 64, 128


def textured_background(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """Smooth colour blobs plus grain: compresses and decodes like a photo, not like noise."""
    grid = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    base = Image.fromarray(grid).resize((width, height), Image.Resampling.BICUBIC)
    grain = rng.normal(0, 10, size=(height, width, 3))
    pixels = np.clip(np.asarray(base, dtype=np.float64) + grain, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def _polygon(n: int, cx: float, cy: float, r: float, angle: float, inner: float = 0.0) -> list:
    points = []
    steps = n * 2 if inner else n
    for i in range(steps):
        radius = inner * r if inner and i % 2 else r
        a = angle + 2 * math.pi * i / steps
        points.append((cx + radius * math.cos(a), cy + radius * math.sin(a)))
    return points


def _rotated_rect(cx: float, cy: float, w: float, h: float, angle: float) -> list:
    c, s = math.cos(angle), math.sin(angle)
    corners = [(-w / 2, -h / 2), (w / 2, -h / 2), (w / 2, h / 2), (-w / 2, h / 2)]
    return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in corners]


def draw_mask(name: str, size: tuple[int, int], rng: np.random.Generator) -> Image.Image:
    """Shape `name` at a random place, size and rotation in a `size` canvas: a soft mode ``L``
    mask (255 inside, blurred edges)."""
    width, height = size
    r = float(rng.uniform(0.22, 0.34)) * min(width, height)
    cx = float(rng.uniform(r + 2, width - r - 2))
    cy = float(rng.uniform(r + 2, height - r - 2))
    angle = float(rng.uniform(0, 2 * math.pi))
    mask = Image.new("L", size, 0)
    draw = ImageDraw.Draw(mask)
    box = (cx - r, cy - r, cx + r, cy + r)
    if name == "circle":
        draw.ellipse(box, fill=255)
    elif name == "ring":
        draw.ellipse(box, outline=255, width=max(2, int(r * 0.3)))
    elif name == "crescent":
        draw.ellipse(box, fill=255)
        dx, dy = 0.55 * r * math.cos(angle), 0.55 * r * math.sin(angle)
        draw.ellipse((box[0] + dx, box[1] + dy, box[2] + dx, box[3] + dy), fill=0)
    elif name == "square":
        draw.polygon(_polygon(4, cx, cy, r, angle), fill=255)
    elif name == "triangle":
        draw.polygon(_polygon(3, cx, cy, r, angle), fill=255)
    elif name == "star":
        draw.polygon(_polygon(5, cx, cy, r, angle, inner=0.42), fill=255)
    elif name == "cross":
        for a in (angle, angle + math.pi / 2):
            draw.polygon(_rotated_rect(cx, cy, 2 * r, 0.55 * r, a), fill=255)
    elif name == "bars":
        for offset in (-0.5, 0.5):
            ox, oy = offset * r * -math.sin(angle), offset * r * math.cos(angle)
            draw.polygon(_rotated_rect(cx + ox, cy + oy, 2 * r, 0.35 * r, angle), fill=255)
    else:
        raise ValueError(f"unknown shape {name!r}; shapes: {', '.join(SHAPE_CLASSES)}")
    return mask.filter(ImageFilter.GaussianBlur(0.6))


def render_shape(label: int, rng: np.random.Generator) -> Image.Image:
    """One RGB image of shape class `label` on a random textured background."""
    width, height = (int(v) for v in rng.integers(_MIN_SIDE, _MAX_SIDE + 1, size=2))
    background = textured_background(rng, width, height)
    luma = float(np.asarray(background.convert("L")).mean())
    colour = rng.integers(0, 90, size=3) if luma > 128 else rng.integers(166, 256, size=3)
    fill = Image.new("RGB", (width, height), tuple(int(c) for c in colour))
    mask = draw_mask(SHAPE_CLASSES[label], (width, height), rng)
    return Image.composite(fill, background, mask)


def synthetic_samples(
    count: int, *, seed: int = 0, start: int = 0, quality: int = 90
) -> Iterator[Sample]:
    """Samples ``{"__key__", "jpg", "cls"}``; sample `i` has label ``i % 8``.

    Sample `i` depends only on (`seed`, `i`), so any range can be made on its own.
    """
    for index in range(start, start + count):
        label = index % len(SHAPE_CLASSES)
        rng = np.random.default_rng([seed, index])
        buffer = io.BytesIO()
        render_shape(label, rng).save(buffer, format="JPEG", quality=quality)
        yield {
            "__key__": f"{SHAPE_CLASSES[label]}_{index:06d}",
            "jpg": buffer.getvalue(),
            "cls": str(label).encode("ascii"),
        }


def split_samples(
    per_class: int, *, seed: int = 0, val_fraction: float = 0.2
) -> Iterator[tuple[str, Sample]]:
    """``(split, sample)`` pairs for `per_class` samples of each class.

    Every ``round(1 / val_fraction)``-th sample of a class goes to ``val``, so val is stratified.
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction {val_fraction} must be in [0, 1)")
    every = round(1 / val_fraction) if val_fraction else 0
    for index, sample in enumerate(synthetic_samples(per_class * len(SHAPE_CLASSES), seed=seed)):
        nth = index // len(SHAPE_CLASSES)
        yield ("val" if every and nth % every == every - 1 else "train"), sample


def write_imagefolder(root: str, pairs: Iterable[tuple[str, Sample]]) -> dict[str, int]:
    """Write ``(split, sample)`` pairs as ``root/<split>/<class>/<key>.jpg`` (the ImageFolder
    layout); returns the count per split."""
    counts: dict[str, int] = {}
    for split, sample in pairs:
        key = str(sample["__key__"])
        folder = os.path.join(root, split, SHAPE_CLASSES[int(sample["cls"])])
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, key + ".jpg"), "wb") as f:
            data = sample["jpg"]
            assert isinstance(data, bytes)
            f.write(data)
        counts[split] = counts.get(split, 0) + 1
    return counts
