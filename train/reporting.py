"""Where every number of a training run goes: JSON lines, TensorBoard and, if asked, W&B.

`RunLogger` writes, in the run folder::

    metrics.jsonl    one JSON object per line: "step", "epoch" and named events ("resume", ...)
    tensorboard/     TensorBoard event files: train/*, epoch/*, val/*, val_class/*, val/confusion
    confusion.png    the latest validation confusion matrix (see `render_confusion`)
    wandb-id.txt     the W&B run id, so a resumed run continues the same W&B run (--wandb only)

Every file is appended to or replaced, never truncated, so a resumed run continues them. Only
rank 0 logs: the other ranks make a logger with ``enabled=False``, which does nothing.
"""

from __future__ import annotations

import io
import json
import math
import os
import tempfile
import time
import unicodedata
import uuid
from collections.abc import Mapping, Sequence
from typing import IO, Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from dlpipe.errors import DlpipeError
from dlpipe.train.metrics import EvalResult

__all__ = [
    "CONFUSION_NAME",
    "MAX_CONFUSION_CLASSES",
    "METRICS_NAME",
    "MissingExtraError",
    "RunLogger",
    "render_confusion",
]

METRICS_NAME = "metrics.jsonl"
CONFUSION_NAME = "confusion.png"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_NAME = "wandb-id.txt"
MAX_CONFUSION_CLASSES = 1000
_WANDB_MISSING = "--wandb needs the wandb package: pip install 'dlpipe[wandb]' (or drop --wandb)"
_TENSORBOARD_MISSING = "the trainer's logs need the tensorboard package: pip install tensorboard"

_WHITE = np.array([255.0, 255.0, 255.0])
_DARK_BLUE = np.array([8.0, 48.0, 107.0])
_MAX_GRID_PX = 1600
_MAX_CELL_PX = 40
_MIN_NUMBER_CELL_PX = 18
_MIN_LABEL_CELL_PX = 10
_MAX_LABEL_CHARS = 16
_PAD_PX = 6


class MissingExtraError(DlpipeError, ImportError):
    """An optional feature was asked for but its package (a dlpipe extra) is not installed."""


class RunLogger:
    """Sends a run's numbers to ``metrics.jsonl``, TensorBoard and optionally W&B.

    Args:
        run_dir: The run folder; created if missing.
        enabled: False on ranks other than 0: every method does nothing and nothing is created.
        classes: Class names, index order; they name per-class accuracies and confusion rows.
        wandb_project: W&B project to log to as well; None for no W&B.
        config: The resolved run config, stored with the W&B run.

    Raises:
        MissingExtraError: If ``wandb_project`` is given and wandb is not installed, or
            tensorboard is not installed.
        ValueError: If ``classes`` holds the same name twice.
    """

    def __init__(
        self,
        run_dir: str,
        *,
        enabled: bool,
        classes: Sequence[str],
        wandb_project: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        self.classes = list(classes)
        self._file: IO[str] | None = None
        self._writer: Any = None
        self._wandb: Any = None
        self._wandb_run: Any = None
        _check_classes(self.classes)
        if not enabled:
            return
        wandb = _import_wandb() if wandb_project is not None else None
        writer_cls = _import_summary_writer()
        os.makedirs(run_dir, exist_ok=True)
        self._file = open(os.path.join(run_dir, METRICS_NAME), "a", encoding="utf-8")  # noqa: SIM115
        self._writer = writer_cls(log_dir=os.path.join(run_dir, TENSORBOARD_DIR))
        if wandb is not None:
            try:
                self._wandb_run = wandb.init(
                    project=wandb_project,
                    config=config,
                    dir=run_dir,
                    resume="allow",
                    id=_wandb_run_id(run_dir),
                )
            except BaseException:
                self.close()
                raise
            self._wandb = wandb

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def step(self, step: int, values: Mapping[str, float]) -> None:
        """Logs training values of one optimizer step (loss, learning rate, throughput...).

        Args:
            step: Global optimizer step.
            values: Name to value; TensorBoard and W&B get them as ``train/<name>``.

        Raises:
            ValueError: If a name is one of the reserved keys ``event``, ``step``, ``time``.
        """
        if not self.enabled:
            return
        self._write_line(_merge({"event": "step", "step": step}, values))
        scalars = {f"train/{key}": value for key, value in values.items()}
        self._log_scalars(scalars, step)

    def epoch(
        self,
        epoch: int,
        step: int,
        values: Mapping[str, float | None],
        result: EvalResult | None,
    ) -> str | None:
        """Logs the end of an epoch: its values and, if there was validation, its result.

        Args:
            epoch: The epoch just finished.
            step: Global optimizer step at its end (the x axis in TensorBoard and W&B).
            values: Name to value (None for a value not measured); ``epoch/<name>`` scalars.
            result: The validation result, or None if this epoch was not validated.

        Returns:
            Path of the confusion matrix PNG written, or None (no result, logging disabled, or
            more than `MAX_CONFUSION_CLASSES` classes).

        Raises:
            ValueError: If a name is reserved, or the result's class count differs from
                ``classes``.
        """
        if not self.enabled:
            return None
        record: dict[str, Any] = {"event": "epoch", "epoch": epoch, "step": step}
        record = _merge(record, values)
        scalars = {f"epoch/{key}": value for key, value in values.items() if value is not None}
        if result is not None:
            record = _merge(record, self._result_fields(result))
            scalars.update(self._result_scalars(result))
        self._write_line(record)
        self._log_scalars(scalars, step)
        if result is None or len(self.classes) > MAX_CONFUSION_CLASSES:
            return None
        return self._log_confusion(result, step)

    def event(self, name: str, **fields: Any) -> None:
        """Logs a named event ("resume", "oom_backoff", "stop"...) to ``metrics.jsonl``.

        Args:
            name: The event's name, stored as ``"event"``.
            **fields: JSON-able details; non-finite floats are stored as null.

        Raises:
            ValueError: If a field is named ``event`` or ``time``.
        """
        if not self.enabled:
            return
        self._write_line(_merge({"event": name}, fields, reserved=("event", "time")))

    def close(self) -> None:
        """Flushes and closes every sink. Safe to call more than once."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def _write_line(self, record: Mapping[str, Any]) -> None:
        if self._file is None:
            raise ValueError(f"RunLogger for {self.run_dir} is closed; log before close()")
        line = {**record, "time": time.time()}
        self._file.write(json.dumps(_plain(line), allow_nan=False) + "\n")
        self._file.flush()

    def _log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=step)
        if self._wandb_run is not None and scalars:
            self._wandb_run.log(dict(scalars), step=step)

    def _result_fields(self, result: EvalResult) -> dict[str, Any]:
        if len(result.per_class_accuracy) != len(self.classes):
            raise ValueError(
                f"the validation result has {len(result.per_class_accuracy)} classes but the "
                f"logger was given {len(self.classes)} class names; pass the dataset's classes"
            )
        return {
            "val_loss": result.loss,
            "top1": result.top1,
            "top5": result.top5,
            "val_samples": result.samples,
            "per_class_accuracy": dict(zip(self.classes, result.per_class_accuracy, strict=True)),
            "confusion": result.confusion,
        }

    def _result_scalars(self, result: EvalResult) -> dict[str, float]:
        scalars = {"val/loss": result.loss, "val/top1": result.top1, "val/top5": result.top5}
        for name, accuracy in zip(self.classes, result.per_class_accuracy, strict=True):
            if accuracy is not None:
                scalars[f"val_class/{name}"] = accuracy
        return scalars

    def _log_confusion(self, result: EvalResult, step: int) -> str:
        image = render_confusion(result.confusion, self.classes)
        path = _save_png_atomic(image, os.path.join(self.run_dir, CONFUSION_NAME))
        pixels = np.asarray(image.convert("RGB"), dtype=np.uint8)
        self._writer.add_image("val/confusion", pixels, global_step=step, dataformats="HWC")
        self._writer.flush()
        if self._wandb_run is not None:
            self._wandb_run.log({"val/confusion": self._wandb.Image(image)}, step=step)
        return path


def _check_classes(classes: list[str]) -> None:
    seen: set[str] = set()
    for name in classes:
        if name in seen:
            raise ValueError(
                f"class name {name!r} appears twice in classes; each class needs its own name "
                "(they key the per-class accuracies)"
            )
        seen.add(name)


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as err:
        raise MissingExtraError(_WANDB_MISSING) from err
    return wandb


def _import_summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise MissingExtraError(_TENSORBOARD_MISSING) from err
    return SummaryWriter


def _wandb_run_id(run_dir: str) -> str:
    """The run's W&B id, made and stored in ``wandb-id.txt`` on the first call."""
    path = os.path.join(run_dir, WANDB_ID_NAME)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            run_id = f.read().strip()
        if run_id:
            return run_id
    run_id = uuid.uuid4().hex[:16]
    _replace_atomic(path, run_id.encode() + b"\n")
    return run_id


def _merge(
    record: Mapping[str, Any],
    values: Mapping[str, Any],
    reserved: Sequence[str] = ("event", "epoch", "step", "time"),
) -> dict[str, Any]:
    clash = sorted(set(values) & (set(record) | set(reserved)))
    if clash:
        raise ValueError(
            f"logged names {clash} clash with the keys RunLogger writes itself; rename them"
        )
    return {**record, **values}


def _plain(value: Any) -> Any:
    """``value`` as plain JSON: non-finite floats become None, numpy/torch scalars Python ones."""
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if hasattr(value, "item"):
        return _plain(value.item())
    raise TypeError(f"cannot log {type(value).__name__} value {value!r}: not JSON")


def _replace_atomic(path: str, data: bytes) -> None:
    """Writes ``data`` to a temp file beside ``path``, fsyncs it, then renames it over ``path``."""
    folder, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _save_png_atomic(image: Image.Image, path: str) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    _replace_atomic(path, buffer.getvalue())
    return path


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
