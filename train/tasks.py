"""What a task adds to the one training loop: its loss hook, its evaluation and its scores.

    task = make_task("detection", manifest)
    loss_sum, parts = task.loss(runner, model, images, targets)   # summed over the samples
    evaluator = task.evaluator(runner.device, keep_pictures=True)  # `StepRunner.evaluate`
    record = task.history(result)        # the epoch's numbers: top1 | map | miou ...

The loop, AMP, DDP, accumulation, out-of-memory backoff, checkpoints, signals and resume are
the trainer's (`dlpipe.train.trainer`, `dlpipe.train.step`) and the same for every task; a
task only says how a batch becomes a loss, how a validation pass becomes scores
(`dlpipe.train.metrics` for classification, `dlpipe.train.task_metrics` for detection and
segmentation, each exact across ranks), which score picks ``best.pt`` and stops early, and the
picture drawn after each evaluation (the confusion matrix; `dlpipe.train.pictures`).

Every loss is a sum over the batch's samples (the step divides by the step's sample count),
so a step's loss and gradient are the same on 1 rank or N.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
import torch.nn.functional as F
from PIL import Image

from dlpipe.manifest import Manifest
from dlpipe.train.metrics import EvalCounts, EvalResult

if TYPE_CHECKING:
    from dlpipe.train.distributed import Distributed
    from dlpipe.train.step import StepRunner

__all__ = ["ClassificationTask", "Evaluator", "Result", "TaskScores", "TrainTask", "make_task"]


@dataclass(frozen=True)
class TaskScores:
    """A detection or segmentation evaluation, summed over every rank.

    Attributes:
        metric: the task's headline score (mAP or mIoU), 0..1: it picks ``best.pt`` and
            stops early.
        history: the epoch's numbers (``map``, ``map_50`` / ``miou``, ``pixel_acc``,
            ``val_loss``): the epoch line and ``RunSummary.history``.
        fields: what ``metrics.jsonl``'s epoch line adds (history, per class, counts).
        scalars: TensorBoard's ``val/*`` and ``val_class/*`` values.
        picture: a few validation images with predictions and truth (rank 0), or None.
    """

    metric: float
    history: dict[str, float]
    fields: dict[str, Any]
    scalars: dict[str, float]
    picture: Image.Image | None = field(default=None, compare=False)


Result: TypeAlias = EvalResult | TaskScores  # what an evaluation gives, by task


class Evaluator:
    """One validation pass of a task: `forward` one chunk (retried smaller on out-of-memory),
    `update` with what it returned, `result` once (collective)."""

    def forward(self, runner: StepRunner, model: torch.nn.Module, images: Any, targets: Any) -> Any:
        raise NotImplementedError

    def update(self, output: Any) -> None:
        raise NotImplementedError

    def result(self, dist: Distributed) -> Result:
        raise NotImplementedError


class TrainTask:
    """A task's hooks (subclasses: `ClassificationTask`, `dlpipe.train.task_hooks`'s).

    Attributes:
        name: the task (``classification``, ``detection``, ``segmentation``).
        metric: the history key of the score that picks ``best.pt`` (higher is better).
        stop_on: what early stopping watches, in words.
    """

    name = ""
    metric = ""
    stop_on = ""

    def __init__(self, classes: list[str]) -> None:
        self.classes = classes

    def loss(
        self, runner: StepRunner, model: torch.nn.Module, images: Any, targets: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The batch's training loss summed over its samples, and its named parts (sums too;
        empty when the loss has none)."""
        raise NotImplementedError

    def evaluator(self, device: torch.device, *, keep_pictures: bool) -> Evaluator:
        raise NotImplementedError

    def history(self, result: Result) -> dict[str, float]:
        """The epoch's validation numbers, as the history and the epoch line hold them."""
        assert isinstance(result, TaskScores)
        return dict(result.history)

    def score(self, result: Result) -> float:
        """The score ``best.pt`` keeps the highest of."""
        assert isinstance(result, TaskScores)
        return result.metric

    def stop_value(self, result: Result) -> float:
        """What early stopping waits to see fall: the val loss, or 1 - the task's score."""
        return 1.0 - self.score(result)


class ClassificationTask(TrainTask):
    """Cross-entropy on the logits; top-1, top-5 and the confusion matrix; best by top-1,
    early stopping on the val loss."""

    name, metric, stop_on = "classification", "top1", "val loss"

    def __init__(self, classes: list[str], label_smoothing: float = 0.0) -> None:
        super().__init__(classes)
        self.label_smoothing = label_smoothing

    def loss(
        self, runner: StepRunner, model: torch.nn.Module, images: Any, targets: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits, y = runner.logits(model, images, targets)
        loss = F.cross_entropy(
            logits.float(), y, reduction="sum", label_smoothing=self.label_smoothing
        )
        return loss, {}

    def evaluator(self, device: torch.device, *, keep_pictures: bool) -> Evaluator:
        return _ClassificationEvaluator(len(self.classes), device)

    def history(self, result: Result) -> dict[str, float]:
        assert isinstance(result, EvalResult)
        return {"val_loss": result.loss, "top1": result.top1, "top5": result.top5}

    def score(self, result: Result) -> float:
        assert isinstance(result, EvalResult)
        return result.top1

    def stop_value(self, result: Result) -> float:
        assert isinstance(result, EvalResult)
        return result.loss


class _ClassificationEvaluator(Evaluator):
    def __init__(self, num_classes: int, device: torch.device) -> None:
        self.counts = EvalCounts(num_classes, device)

    def forward(self, runner: StepRunner, model: torch.nn.Module, images: Any, targets: Any) -> Any:
        logits, y = runner.logits(model, images, targets)
        return logits, y, F.cross_entropy(logits.float(), y, reduction="sum")

    def update(self, output: Any) -> None:
        self.counts.update(*output)

    def result(self, dist: Distributed) -> Result:
        dist.all_reduce_(*self.counts.tensors(), what="summing the evaluation counts")
        return self.counts.result()


def make_task(name: str, manifest: Manifest, *, label_smoothing: float = 0.0) -> TrainTask:
    """The hooks of task `name` for the dataset of `manifest` (its classes; for segmentation
    its ignore value).

    Raises:
        ValueError: a task without hooks (`dlpipe.train.config.TASKS` lists those that have).
    """
    from dlpipe.train.task_hooks import DetectionTask, SegmentationTask

    classes = list(manifest.classes)
    if name == "classification":
        return ClassificationTask(classes, label_smoothing)
    if name == "detection":
        return DetectionTask(classes)
    if name == "segmentation":
        return SegmentationTask.from_manifest(manifest)
    raise ValueError(
        f"task {name!r} cannot be trained: give classification, detection or segmentation"
    )
