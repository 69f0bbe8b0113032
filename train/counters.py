"""The trainer's own progress: `RunCounters` (steps, epochs, the epoch in progress, history)
and `EarlyStopping` (patience on the validation loss), each `Stateful`.

    counters = RunCounters()
    counters.step += 1; counters.stats.add(result, wait_s, total_s)
    stopping = EarlyStopping(patience=3)
    if stopping.update(val_loss): ...        # True: stop now
    state = {"trainer": counters.state_dict(), "early_stop": stopping.state_dict()}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from dlpipe.loading.state import require_fields
from dlpipe.train.progress import EpochStats

__all__ = ["EarlyStopping", "RunCounters"]


@dataclass
class RunCounters:
    """Where a run stands: what a checkpoint must carry for the run to continue and report
    whole (the epoch's running totals, the per-epoch history, the best top-1 so far)."""

    step: int = 0  # optimizer steps taken (skipped ones included)
    epoch: int = 0  # epochs finished
    bad_steps: int = 0  # non-finite steps in a row
    skipped_steps: int = 0  # steps whose optimizer update was skipped, all told
    best_top1: float | None = None
    stats: EpochStats = field(default_factory=EpochStats)
    history: list[dict[str, Any]] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        state = asdict(self)
        state["history"] = [dict(record) for record in self.history]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = tuple(f.name for f in fields(self))
        saved = require_fields(state, names, "trainer counters")
        self.step, self.epoch = int(saved["step"]), int(saved["epoch"])
        self.bad_steps, self.skipped_steps = int(saved["bad_steps"]), int(saved["skipped_steps"])
        self.best_top1 = saved["best_top1"]
        self.stats = EpochStats(**saved["stats"])
        self.history = [dict(record) for record in saved["history"]]


class EarlyStopping:
    """Stop once the validation loss has not improved for `patience` epochs in a row.

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
        saved = require_fields(state, ("best_loss", "stale_epochs"), "early stopping")
        self.best_loss, self.stale_epochs = saved["best_loss"], int(saved["stale_epochs"])
