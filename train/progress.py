"""What a run reports as it goes: the batch plan, the epoch's running totals, the epoch line,
the verdict on the input pipeline, a micro-batch backoff, an early stop, and the summary
`Trainer.fit` returns.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from dlpipe.train.config import BatchPlan
from dlpipe.train.step import StepResult

if TYPE_CHECKING:
    from dlpipe.train.counters import RunCounters

__all__ = [
    "INPUT_BOUND_SHARE",
    "EpochStats",
    "RunSummary",
    "backoff_line",
    "epoch_line",
    "epoch_values",
    "input_verdict",
    "plan_line",
    "run_summary",
    "stop_line",
]

INPUT_BOUND_SHARE = 0.10  # waiting for data more than this share of step time is worth fixing
_VAL_PARTS = (  # the validation numbers an epoch line shows, where the task has them
    ("val_loss", "val loss", ".4f"),
    ("top1", "top-1", ".2%"),
    ("top5", "top-5", ".2%"),
    ("map", "mAP", ".3f"),
    ("map_50", "mAP@.5", ".3f"),
    ("miou", "mIoU", ".2%"),
    ("pixel_acc", "pixel acc", ".2%"),
)


@dataclass
class EpochStats:
    """Running totals of the epoch in progress (checkpointed, so a resumed epoch reports whole)."""

    loss_sum: float = 0.0
    samples: int = 0
    steps: int = 0
    wait_s: float = 0.0
    busy_s: float = 0.0
    first_wait_s: float = 0.0  # the epoch's first batch: the workers' start-up, once per epoch

    def add(self, result: StepResult, wait_s: float, total_s: float) -> None:
        if self.steps == 0:
            self.first_wait_s = wait_s
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


def epoch_values(stats: EpochStats, lr: float) -> dict[str, Any]:
    """The epoch's logged values from its running totals (``data_wait``: share of step time;
    ``data_wait_after_first``: the same without the epoch's first batch, whose wait is the
    loader's start-up and weighs more the shorter the epoch)."""
    total_s = max(stats.busy_s, 1e-9)
    after_first_s = max(stats.busy_s - stats.first_wait_s, 1e-9)
    return {
        "train_loss": stats.loss_sum / stats.samples if stats.samples else None,
        "lr": lr,
        "samples_per_s": stats.samples / total_s,
        "data_wait": stats.wait_s / total_s,
        "data_wait_after_first": (stats.wait_s - stats.first_wait_s) / after_first_s,
        "first_batch_wait_s": stats.first_wait_s,
        "steps": stats.steps,
        "epoch_s": stats.busy_s,
    }


def epoch_line(record: dict[str, Any], epochs: int, step: int) -> str:
    """``epoch 3/90 | step 1200 | train loss ... | data wait 4%``."""
    parts = [f"epoch {record['epoch']}/{epochs}", f"step {step}"]
    if record["train_loss"] is not None:
        parts.append(f"train loss {record['train_loss']:.4f}")
    parts += [
        f"{label} {value:{form}}"
        for key, label, form in _VAL_PARTS
        if (value := record.get(key)) is not None
    ]
    parts += [
        f"lr {record['lr']:.3g}",
        f"{record['samples_per_s']:.0f} samples/s",
        f"data wait {100 * record['data_wait']:.0f}%",
    ]
    after_first = record.get("data_wait_after_first")
    if after_first is not None and record["data_wait"] - after_first >= 0.01:
        parts[-1] += f" ({100 * after_first:.0f}% after the first batch)"
    return " | ".join(parts)


def input_verdict(
    wait: float,
    data: str,
    micro_batch: int,
    image_size: int | None,
    min_crop_scale: float,
    cuda: bool,
) -> str | None:
    """Advice when the steps waited for data more than `INPUT_BOUND_SHARE` of the time (`wait`:
    the epoch's first batch aside, the workers' start-up that no setting removes): the
    ``bench-loader`` command that measures (and keys its profile by) this run's loader config."""
    if wait <= INPUT_BOUND_SHARE:
        return None
    size = "" if image_size is None else f" --image-size {image_size}"
    command = (
        f"dlpipe bench-loader {shlex.quote(data)} --batch-size {micro_batch}{size} "
        f"--min-crop-scale {min_crop_scale:g}"
    )
    return (
        f"input-bound: waiting for data {100 * wait:.0f}% of the time after the first batch: "
        f"run {command}"
        + (" --device cuda" if cuda else "")
        + " (its verdict names the slow stage; dlpipe train then uses the tuned workers)"
    )


def plan_line(plan: BatchPlan, steps_per_epoch: int) -> str:
    """``global batch 256 = 2 ranks x micro-batch 64 x 2 accumulation steps; ...``."""
    ranks = f"{plan.world_size} rank{'s' if plan.world_size > 1 else ''}"
    return (
        f"global batch {plan.batch_size} = {ranks} x micro-batch {plan.micro_batch} x "
        f"{plan.accumulation} accumulation steps; {steps_per_epoch} steps per epoch"
    )


def backoff_line(phase: str, micro_batch: int, accumulation: int, global_batch: int) -> str:
    """What an out-of-memory backoff changed (rich markup)."""
    return (
        f"[yellow]out of memory[/yellow] in {phase}: micro-batch now "
        f"{micro_batch}, accumulation {accumulation} (global batch {global_batch} "
        "unchanged); retrying the step"
    )


def stop_line(why: str, signal: str | None, max_steps: int | None, step: int, path: str) -> str:
    """Why the run stopped early (``signal`` or ``max_steps``) and its checkpoint (markup)."""
    what = {
        "signal": f"stopped on {signal or 'a signal'}",
        "max_steps": f"reached --max-steps {max_steps}",
    }[why]
    return f"{what} at step {step}; checkpoint {escape(path)}"


def run_summary(run_dir: str, counters: RunCounters, stopped: str, path: str | None) -> RunSummary:
    """The run's `RunSummary` from its counters; ``path`` is its last checkpoint."""
    return RunSummary(
        run_dir=run_dir,
        epochs_done=counters.epoch,
        steps=counters.step,
        stopped=stopped,
        last_val=counters.history[-1] if counters.history else None,
        checkpoint=path,
        best_top1=counters.best_top1,
        history=counters.history,
    )
