"""What a run reports as it goes: the epoch's running totals, the epoch line, the verdict on
the input pipeline, and the summary `Trainer.fit` returns.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from typing import Any

from dlpipe.train.step import StepResult

__all__ = ["INPUT_BOUND_SHARE", "EpochStats", "RunSummary", "epoch_line", "input_verdict"]

INPUT_BOUND_SHARE = 0.10  # waiting for data more than this share of step time is worth fixing


@dataclass
class EpochStats:
    """Running totals of the epoch in progress (checkpointed, so a resumed epoch reports whole)."""

    loss_sum: float = 0.0
    samples: int = 0
    steps: int = 0
    wait_s: float = 0.0
    busy_s: float = 0.0

    def add(self, result: StepResult, wait_s: float, total_s: float) -> None:
        if math.isfinite(result.loss):
            self.loss_sum += result.loss * result.samples
            self.samples += result.samples
        self.steps += 1
        self.wait_s += wait_s
        self.busy_s += total_s


@dataclass
class RunSummary:
    run_dir: str
    epochs_done: int
    steps: int
    stopped: str  # completed | early_stop | max_steps | signal | resumed_complete
    last_val: dict[str, Any] | None = None
    checkpoint: str | None = None
    best_top1: float | None = None
    history: list[dict[str, Any]] = field(default_factory=list)


def epoch_line(record: dict[str, Any], epochs: int, step: int) -> str:
    """``epoch 3/90 | step 1200 | train loss ... | data wait 4%``."""
    parts = [f"epoch {record['epoch']}/{epochs}", f"step {step}"]
    if record["train_loss"] is not None:
        parts.append(f"train loss {record['train_loss']:.4f}")
    if "val_loss" in record:
        parts += [
            f"val loss {record['val_loss']:.4f}",
            f"top-1 {100 * record['top1']:.2f}%",
            f"top-5 {100 * record['top5']:.2f}%",
        ]
    parts += [
        f"lr {record['lr']:.3g}",
        f"{record['samples_per_s']:.0f} samples/s",
        f"data wait {100 * record['data_wait']:.0f}%",
    ]
    return " | ".join(parts)


def input_verdict(
    wait: float, data: str, micro_batch: int, image_size: int, min_crop_scale: float, cuda: bool
) -> str | None:
    """Advice when the steps waited for data more than `INPUT_BOUND_SHARE` of the time: the
    ``bench-loader`` command that measures (and keys its profile by) this run's loader config."""
    if wait <= INPUT_BOUND_SHARE:
        return None
    command = (
        f"dlpipe bench-loader {shlex.quote(data)} --batch-size {micro_batch} "
        f"--image-size {image_size} --min-crop-scale {min_crop_scale:g}"
    )
    return (
        f"input-bound: waiting for data {100 * wait:.0f}% of the time: run {command}"
        + (" --device cuda" if cuda else "")
        + " (its verdict names the slow stage; dlpipe train then uses the tuned workers)"
    )
