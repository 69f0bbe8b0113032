"""Where every number of a training run goes: JSON lines, TensorBoard and, if asked, W&B.

`RunLogger` writes, in the run folder::

    metrics.jsonl    one JSON object per line: "step", "epoch" and named events ("resume", ...);
                     epochs count from 1, as the console's ``epoch 1/90`` (the trainer's
                     "schedule" event says so with ``"first_epoch": 1``; runs before it: 0)
    tensorboard/     TensorBoard event files: train/*, epoch/*, val/*, val_class/*, val/confusion
    confusion.png    the latest validation confusion matrix (classification; `render_confusion`)
    predictions.png  a few validation images with predicted and true boxes or masks, after
                     the latest evaluation (detection, segmentation; `dlpipe.train.pictures`)
    wandb-id.txt     the W&B run id, so a resumed run continues the same W&B run (--wandb only)

Every file is appended to or replaced, never truncated, so a resumed run continues them. Only
rank 0 logs: the other ranks make a logger with ``enabled=False``, which does nothing.
"""

from __future__ import annotations

import io
import json
import math
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import IO, Any

import numpy as np
from PIL import Image

from dlpipe import storage
from dlpipe.errors import DlpipeError
from dlpipe.train.confusion import MAX_CONFUSION_CLASSES, render_confusion
from dlpipe.train.metrics import EvalResult
from dlpipe.train.tasks import TaskScores

__all__ = [
    "CONFUSION_NAME",
    "METRICS_NAME",
    "PREDICTIONS_NAME",
    "MissingExtraError",
    "RunLogger",
]

METRICS_NAME = "metrics.jsonl"
CONFUSION_NAME = "confusion.png"
PREDICTIONS_NAME = "predictions.png"
JSONL_CONFUSION_CLASSES = 100
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_NAME = "wandb-id.txt"
_WANDB_MISSING = "--wandb needs the wandb package: pip install 'dlpipe[wandb]' (or drop --wandb)"
_TENSORBOARD_MISSING = "the trainer's logs need the tensorboard package: pip install tensorboard"


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
        result: EvalResult | TaskScores | None,
        *,
        source_samples: Sequence[int] | None = None,
    ) -> str | None:
        """Logs the end of an epoch: its values and, if there was validation, its result.

        Args:
            epoch: The epoch just finished, counted from 1 (the console's numbering).
            step: Global optimizer step at its end (the x axis in TensorBoard and W&B).
            values: Name to value (None for a value not measured); ``epoch/<name>`` scalars.
            result: The validation result (a classifier's, or a detection or segmentation
                run's `TaskScores`), or None if this epoch was not validated.
            source_samples: A mixture's samples from each dataset this epoch, over all ranks
                (``"source_samples"``; ``epoch/source_samples/<i>`` scalars); None for one.

        Returns:
            Path of the picture written (the confusion matrix, or the predictions of
            `TaskScores.picture`), or None (no result or picture, logging disabled, or more
            than `MAX_CONFUSION_CLASSES` classes).

        Raises:
            ValueError: If a name is reserved, or the result's class count differs from
                ``classes``.
        """
        if not self.enabled:
            return None
        record: dict[str, Any] = {"event": "epoch", "epoch": epoch, "step": step}
        record = _merge(record, values)
        scalars = {f"epoch/{key}": value for key, value in values.items() if value is not None}
        if source_samples is not None:
            record = _merge(record, {"source_samples": list(source_samples)})
            scalars.update({f"epoch/source_samples/{i}": n for i, n in enumerate(source_samples)})
        if isinstance(result, TaskScores):
            record = _merge(record, result.fields)
            scalars.update(result.scalars)
        elif result is not None:
            record = _merge(record, self._result_fields(result))
            scalars.update(self._result_scalars(result))
        self._write_line(record)
        self._log_scalars(scalars, step)
        if isinstance(result, TaskScores):
            return None if result.picture is None else self._log_picture(result.picture, step)
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
            # C x C numbers a line: past JSONL_CONFUSION_CLASSES only the PNG and TensorBoard
            "confusion": result.confusion if len(self.classes) <= JSONL_CONFUSION_CLASSES else None,
        }

    def _result_scalars(self, result: EvalResult) -> dict[str, float]:
        scalars = {"val/loss": result.loss, "val/top1": result.top1, "val/top5": result.top5}
        for name, accuracy in zip(self.classes, result.per_class_accuracy, strict=True):
            if accuracy is not None:
                scalars[f"val_class/{name}"] = accuracy
        return scalars

    def _log_confusion(self, result: EvalResult, step: int) -> str:
        image = render_confusion(result.confusion, self.classes)
        return self._log_image(image, "val/confusion", CONFUSION_NAME, step)

    def _log_picture(self, image: Image.Image, step: int) -> str:
        return self._log_image(image, "val/predictions", PREDICTIONS_NAME, step)

    def _log_image(self, image: Image.Image, tag: str, name: str, step: int) -> str:
        """`image` as the run folder's PNG `name` and TensorBoard's (and W&B's) `tag`."""
        path = _save_png_atomic(image, os.path.join(self.run_dir, name))
        pixels = np.asarray(image.convert("RGB"), dtype=np.uint8)
        self._writer.add_image(tag, pixels, global_step=step, dataformats="HWC")
        self._writer.flush()
        if self._wandb_run is not None:
            self._wandb_run.log({tag: self._wandb.Image(image)}, step=step)
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
    storage.atomic_write_bytes(path, run_id.encode() + b"\n")
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


def _save_png_atomic(image: Image.Image, path: str) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    storage.atomic_write_bytes(path, buffer.getvalue())
    return path
