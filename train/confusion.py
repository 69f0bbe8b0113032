"""The validation confusion matrix as a picture (Pillow only): rows are true classes, columns
predictions, cells shaded by the row's share and labelled with counts where they fit.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

__all__ = ["MAX_CONFUSION_CLASSES", "render_confusion"]

MAX_CONFUSION_CLASSES = 1000
_WHITE = np.array([255.0, 255.0, 255.0])
_DARK_BLUE = np.array([8.0, 48.0, 107.0])
_MAX_GRID_PX = 1600
_MAX_CELL_PX = 40
_MIN_NUMBER_CELL_PX = 18
_MIN_LABEL_CELL_PX = 10
_MAX_LABEL_CHARS = 16
_PAD_PX = 6


def render_confusion(confusion: Sequence[Sequence[int]], classes: Sequence[str]) -> Image.Image:
    """Draws a confusion matrix with Pillow.

    Cells are coloured by their row-normalised value (white to dark blue) and show their count
    when they are large enough; class names label the rows (left) and columns (bottom) when
    there are few enough classes to read them. The title gives the overall accuracy.

    Args:
        confusion: ``C x C`` counts, rows the true class and columns the predicted class.
        classes: The ``C`` class names.

    Returns:
        An RGB image, at most about 2000 px a side for up to `MAX_CONFUSION_CLASSES` classes.

    Raises:
        ValueError: If the matrix is not square, does not match ``classes``, is empty or has
            more than `MAX_CONFUSION_CLASSES` classes.
    """
    counts = _check_confusion(confusion, classes)
    n = len(classes)
    cell = max(2, min(_MAX_CELL_PX, _MAX_GRID_PX // n))
    font = ImageFont.load_default()
    labels = [_label_text(name) for name in classes] if cell >= _MIN_LABEL_CELL_PX else []
    text_h = _text_size(font, "Ag")[1]
    label_w = max((_text_size(font, text)[0] for text in labels), default=0)
    left = _PAD_PX + text_h + _PAD_PX + label_w + (_PAD_PX if labels else 0)
    top = _PAD_PX + text_h + _PAD_PX
    grid = n * cell
    title = _title(counts)
    width = max(left + grid + _PAD_PX, _text_size(font, title)[0] + 2 * _PAD_PX)
    height = top + grid + (_PAD_PX + label_w if labels else 0) + _PAD_PX + text_h + _PAD_PX
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    x = (width - _text_size(font, title)[0]) // 2
    draw.text((x, _PAD_PX), title, fill="black", font=font)
    _draw_cells(canvas, font, counts, cell, (left, top))
    if labels:
        _draw_labels(canvas, font, labels, cell, (left, top))
    _draw_axis_titles(canvas, font, (left, top), grid, height)
    return canvas


def _check_confusion(confusion: Sequence[Sequence[int]], classes: Sequence[str]) -> np.ndarray:
    counts = np.asarray(confusion, dtype=np.int64)
    n = len(classes)
    if n == 0 or counts.shape != (n, n):
        raise ValueError(
            f"confusion has shape {counts.shape} but there are {n} class names; "
            "it must be C x C with C >= 1 matching the class names"
        )
    if n > MAX_CONFUSION_CLASSES:
        raise ValueError(
            f"{n} classes are too many to draw (at most {MAX_CONFUSION_CLASSES}); "
            "read the confusion matrix from metrics.jsonl instead"
        )
    return counts


def _label_text(name: str) -> str:
    # The default font may lack glyphs (and the bitmap fallback only knows Latin-1): keep ASCII.
    plain = "".join(
        ch for ch in unicodedata.normalize("NFKD", name) if not unicodedata.combining(ch)
    )
    text = plain.encode("ascii", "replace").decode("ascii")
    return text if len(text) <= _MAX_LABEL_CHARS else text[: _MAX_LABEL_CHARS - 2] + ".."


def _text_size(font: Any, text: str) -> tuple[int, int]:
    box = font.getbbox(text)
    return int(box[2]), int(box[3])


def _title(counts: np.ndarray) -> str:
    total = int(counts.sum())
    if not total:
        return "confusion matrix - no samples"
    correct = int(np.trace(counts))
    return f"confusion matrix - accuracy {correct / total:.2%} ({correct}/{total})"


def _draw_cells(
    canvas: Image.Image, font: Any, counts: np.ndarray, cell: int, origin: tuple[int, int]
) -> None:
    row_sums = counts.sum(axis=1, keepdims=True)
    share = counts / np.maximum(row_sums, 1)
    rgb = _WHITE + share[..., None] * (_DARK_BLUE - _WHITE)
    tile = Image.fromarray(rgb.round().astype(np.uint8), "RGB")
    grid = cell * len(counts)
    canvas.paste(tile.resize((grid, grid), Image.Resampling.NEAREST), origin)
    draw = ImageDraw.Draw(canvas)
    x0, y0 = origin
    if cell >= 8:
        for i in range(len(counts) + 1):
            draw.line([(x0 + i * cell, y0), (x0 + i * cell, y0 + grid)], fill=(210, 210, 210))
            draw.line([(x0, y0 + i * cell), (x0 + grid, y0 + i * cell)], fill=(210, 210, 210))
    if cell >= _MIN_NUMBER_CELL_PX:
        _draw_counts(draw, font, counts, share, cell, origin)


def _draw_counts(
    draw: ImageDraw.ImageDraw,
    font: Any,
    counts: np.ndarray,
    share: np.ndarray,
    cell: int,
    origin: tuple[int, int],
) -> None:
    for (row, col), count in np.ndenumerate(counts):
        text = str(count)
        w, h = _text_size(font, text)
        if w > cell - 2:
            continue  # a number wider than its cell would spill over its neighbours
        x = origin[0] + col * cell + (cell - w) // 2
        y = origin[1] + row * cell + (cell - h) // 2
        draw.text((x, y), text, fill="white" if share[row, col] > 0.5 else "black", font=font)


def _draw_labels(
    canvas: Image.Image,
    font: Any,
    labels: list[str],
    cell: int,
    origin: tuple[int, int],
) -> None:
    draw = ImageDraw.Draw(canvas)
    x0, y0 = origin
    grid = cell * len(labels)
    for i, text in enumerate(labels):
        w, h = _text_size(font, text)
        draw.text((x0 - _PAD_PX - w, y0 + i * cell + (cell - h) // 2), text, "black", font)
        upright = _rotated_text(font, text)
        x = x0 + i * cell + (cell - upright.width) // 2
        canvas.paste(upright, (x, y0 + grid + _PAD_PX))


def _rotated_text(font: Any, text: str) -> Image.Image:
    w, h = _text_size(font, text)
    image = Image.new("RGB", (max(w, 1), max(h, 1)), "white")
    ImageDraw.Draw(image).text((0, 0), text, fill="black", font=font)
    return image.rotate(90, expand=True)


def _draw_axis_titles(
    canvas: Image.Image, font: Any, origin: tuple[int, int], grid: int, height: int
) -> None:
    x0, y0 = origin
    draw = ImageDraw.Draw(canvas)
    w, h = _text_size(font, "predicted")
    draw.text((x0 + (grid - w) // 2, height - _PAD_PX - h), "predicted", "black", font)
    upright = _rotated_text(font, "true")
    canvas.paste(upright, (_PAD_PX, y0 + (grid - upright.height) // 2))
