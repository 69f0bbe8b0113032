"""The trainer's own progress: `RunCounters` (steps, epochs, the epoch in progress, history)
and `EarlyStopping` (patience on the validation loss, or 1 - the task's score), each
`Stateful`.

    counters = RunCounters()
    counters.step += 1; counters.stats.add(result, wait_s, total_s)
    stopping = EarlyStopping(patience=3)
    if stopping.update(val_loss): ...        # True: stop now
    state = {"trainer": counters.state_dict(), "early_stop": stopping.state_dict()}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from dlpipe.loading.state import (
    SAVED_BY_DLPIPE,
    is_int,
    mismatch,
    require_fields,
    require_float,
    require_int,
    require_like,
    require_list,
)
from dlpipe.train.progress import EpochStats

__all__ = ["EarlyStopping", "RunCounters"]


@dataclass
class RunCounters:
    """Where a run stands: what a checkpoint must carry for the run to continue and report
    whole (the epoch's running totals, the per-epoch history, the best val score so far)."""

    step: int = 0  # optimizer steps taken (skipped ones included)
    epoch: int = 0  # epochs finished
    bad_steps: int = 0  # non-finite steps in a row
    skipped_steps: int = 0  # steps whose optimizer update was skipped, all told
    best_top1: float | None = None  # the best val score: top-1, or mAP / mIoU (the task's)
    stats: EpochStats = field(default_factory=EpochStats)
    history: list[dict[str, Any]] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        state = asdict(self)
        state["history"] = [dict(record) for record in self.history]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`, every field checked first (`StateMismatchError` names it):
        counts are integers, not negative, within the steps taken; ``best_top1`` a fraction;
        ``stats`` the `EpochStats` fields; ``history`` one record per finished epoch."""
        what = "trainer counters"
        saved = require_fields(state, tuple(f.name for f in fields(self)), what)
        step = require_int(saved, "step", what)
        epoch = require_int(saved, "epoch", what)
        bad_steps = require_int(saved, "bad_steps", what, high=step)
        skipped_steps = require_int(saved, "skipped_steps", what, high=step)
        best_top1 = require_float(saved, "best_top1", what, high=1.0, optional=True)
        require_like(saved["stats"], asdict(EpochStats()), "stats", what)
        history = require_list(saved, "history", what)
        for number, record in enumerate(history, 1):
            rule = f"record {number} must be a dict of numbers whose epoch is {number}"
            if not _is_record(record, number):
                raise mismatch(what, f"history[{number - 1}]", record, rule, SAVED_BY_DLPIPE)
        if len(history) != epoch:
            rule = f"it must hold one record per finished epoch (epoch={epoch})"
            raise mismatch(what, "history", history, rule, SAVED_BY_DLPIPE)
        self.step, self.epoch, self.bad_steps, self.skipped_steps = (
            step, epoch, bad_steps, skipped_steps
        )  # fmt: skip
        self.best_top1 = best_top1
        self.stats = EpochStats(**saved["stats"])
        self.history = [dict(record) for record in history]


def _is_record(record: Any, epoch: int) -> bool:
    """One epoch's history record: numbers (or None) by name, its ``epoch`` the one given."""
    return (
        isinstance(record, dict)
        and record.get("epoch") == epoch
        and is_int(record["epoch"])
        and all(isinstance(key, str) for key in record)
        and all(value is None or isinstance(value, int | float) for value in record.values())
    )


class EarlyStopping:
    """Stop once the validation loss (for detection and segmentation: 1 - mAP or mIoU,
    `dlpipe.train.tasks.TrainTask.stop_value`) has not improved for `patience` epochs in a row.

    Args:
        patience: epochs without a new best val loss before `update` says stop; None never
            stops.
    """

    def __init__(self, patience: int | None) -> None:
        self.patience = patience
        self.best_loss: float | None = None
        self.stale_epochs = 0

    def update(self, val_loss: float) -> bool:
        """Record one epoch's val loss; True when the run should stop now."""
        if self.best_loss is None or val_loss < self.best_loss:
            self.best_loss, self.stale_epochs = val_loss, 0
        else:
            self.stale_epochs += 1
        return self.patience is not None and self.stale_epochs >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"best_loss": self.best_loss, "stale_epochs": self.stale_epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the best loss and the stale count (a resumed run may change `patience`)."""
        what = "early stopping"
        saved = require_fields(state, ("best_loss", "stale_epochs"), what)
        best_loss = require_float(saved, "best_loss", what, optional=True)
        self.stale_epochs = require_int(saved, "stale_epochs", what)
        self.best_loss = best_loss
