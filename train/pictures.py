"""The picture a detection or segmentation run draws after each evaluation (Pillow only): a few
validation images with what the model found beside the truth.

- detection: one panel per image, the true boxes in green and the predicted boxes scoring at
  least `MIN_SCORE` in red, each labelled with its class (and score);
- segmentation: one row per image: the image, the true mask, the predicted mask, in Pascal
  VOC's palette (the ignore value, and any value outside the classes, white).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from dlpipe.annotations import voc_colour

__all__ = ["MIN_SCORE", "render_detections", "render_segmentation"]

MIN_SCORE = 0.3
"""Predicted boxes scoring below this are not drawn."""
_MIN_SIDE_PX = 256  # small images are enlarged to this side, so boxes and labels read
_PAD_PX = 6
_TRUE = (40, 200, 60)
_PREDICTED = (230, 40, 40)


def _panel(image: torch.Tensor) -> tuple[Image.Image, float]:
    """A uint8 (3, H, W) image as RGB, enlarged to `_MIN_SIDE_PX`; and the scale."""
    pixels = image.permute(1, 2, 0).contiguous().numpy()
    picture = Image.fromarray(pixels, "RGB")
    scale = max(1.0, _MIN_SIDE_PX / max(1, min(picture.size)))
    size = (round(picture.width * scale), round(picture.height * scale))
    return picture.resize(size, Image.Resampling.NEAREST), scale


def _boxes(
    draw: ImageDraw.ImageDraw,
    boxes: Any,
    texts: list[str],
    colour: tuple[int, int, int],
    scale: float,
) -> None:
    font = ImageFont.load_default()
    for box, text in zip(torch.as_tensor(boxes).reshape(-1, 4).tolist(), texts, strict=True):
        x0, y0, x1, y1 = (v * scale for v in box)
        draw.rectangle([x0, y0, x1, y1], outline=colour, width=2)
        draw.text((x0 + 2, y0 + 1), text, fill=colour, font=font)


def _row(panels: Sequence[Image.Image]) -> Image.Image:
    width = sum(p.width for p in panels) + _PAD_PX * (len(panels) + 1)
    height = max(p.height for p in panels) + 2 * _PAD_PX
    canvas = Image.new("RGB", (width, height), "white")
    x = _PAD_PX
    for panel in panels:
        canvas.paste(panel, (x, _PAD_PX))
        x += panel.width + _PAD_PX
    return canvas


def _stack(rows: Sequence[Image.Image]) -> Image.Image:
    canvas = Image.new("RGB", (max(r.width for r in rows), sum(r.height for r in rows)), "white")
    y = 0
    for row in rows:
        canvas.paste(row, (0, y))
        y += row.height
    return canvas


def _name(classes: Sequence[str], label: int) -> str:
    return classes[label] if 0 <= label < len(classes) else str(label)


def render_detections(
    shown: Sequence[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]], classes: Sequence[str]
) -> Image.Image:
    """Draws (image, prediction, target) triples side by side.

    Args:
        shown: uint8 (3, H, W) images with their predictions (``boxes``, ``scores``,
            ``labels`` in the dataset's classes) and targets (``boxes``, ``labels``).
        classes: the class names.

    Returns:
        An RGB image: one panel per image, true boxes green, predicted boxes red.
    """
    panels = []
    for image, prediction, target in shown:
        panel, scale = _panel(image)
        draw = ImageDraw.Draw(panel)
        names = [_name(classes, int(k)) for k in target["labels"]]
        _boxes(draw, target["boxes"], names, _TRUE, scale)
        keep = prediction["scores"] >= MIN_SCORE
        labels, scores = prediction["labels"][keep].tolist(), prediction["scores"][keep].tolist()
        texts = [f"{_name(classes, k)} {s:.2f}" for k, s in zip(labels, scores, strict=True)]
        _boxes(draw, prediction["boxes"][keep], texts, _PREDICTED, scale)
        panels.append(panel)
    return _row(panels)


def _mask_picture(mask: torch.Tensor, num_classes: int, size: tuple[int, int]) -> Image.Image:
    palette = np.array([voc_colour(k) for k in range(num_classes)], dtype=np.uint8)
    values = mask.numpy().astype(np.int64)
    inside = (values >= 0) & (values < num_classes)
    pixels = np.full((*values.shape, 3), 255, dtype=np.uint8)  # the ignore value: white
    pixels[inside] = palette[values[inside]]
    return Image.fromarray(pixels, "RGB").resize(size, Image.Resampling.NEAREST)


def render_segmentation(
    shown: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    num_classes: int,
) -> Image.Image:
    """Draws (image, predicted mask, true mask) triples, one row each: image | truth | found.

    Args:
        shown: uint8 (3, H, W) images with (H, W) predicted and true class maps.
        num_classes: the class count (colours from Pascal VOC's palette; any other value,
            the ignore value among them, white).

    Returns:
        An RGB image.
    """
    rows = []
    for image, predicted, truth in shown:
        panel, _ = _panel(image)
        masks = [_mask_picture(m, num_classes, panel.size) for m in (truth, predicted)]
        rows.append(_row([panel, *masks]))
    return _stack(rows)
