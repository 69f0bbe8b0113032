"""Classification metrics that add up exactly across DDP ranks.

`EvalCounts` keeps only sums: the loss sum, the sample count, the top-1 and top-k hit counts and
a confusion matrix. Sums of integers are exact, so the trainer can ``all_reduce(SUM)`` every
tensor of `EvalCounts.tensors` in place and each rank's `EvalCounts.result` is the result of one
pass over the whole validation set, whatever the split between ranks (uneven splits included).

`EvalCounts.update` never waits on the device: it launches a few small kernels and returns, so
a validation loop on a GPU runs without a host sync per batch. The one sync is in `result`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["EvalCounts", "EvalResult", "top_k"]

_LOSS, _COUNT, _CORRECT1, _CORRECTK = range(4)


def top_k(num_classes: int) -> int:
    """The k of the top-k accuracy: 5, or fewer when there are fewer classes.

    Args:
        num_classes: Number of classes of the classifier.

    Returns:
        ``min(5, num_classes)``.
    """
    return min(5, num_classes)


@dataclass(frozen=True)
class EvalResult:
    """One evaluation pass, summed over every rank.

    Attributes:
        loss: Mean loss per sample.
        top1: Fraction of samples whose highest logit is the true class (0..1).
        top5: Fraction of samples whose true class is among the ``top_k(C)`` highest logits.
        samples: Number of samples evaluated.
        per_class_accuracy: Recall of each class; ``None`` for a class without samples (so the
            list stays plain JSON, which has no NaN).
        confusion: ``C x C`` counts; rows are the true class, columns the predicted class.
    """

    loss: float
    top1: float
    top5: float
    samples: int
    per_class_accuracy: list[float | None]
    confusion: list[list[int]]


class EvalCounts:
    """Accumulates evaluation counts on the model's device.

    Counts are integers (the totals are float64, exact for integers below 2**53), so summing
    the tensors of several `EvalCounts` gives exactly the counts of one over all their batches.

    Args:
        num_classes: Number of classes ``C`` of the logits.
        device: Where the counts live; the device of the logits passed to `update`.

    Raises:
        ValueError: If ``num_classes`` is below 1.
    """

    def __init__(self, num_classes: int, device: torch.device | str = "cpu") -> None:
        if num_classes < 1:
            raise ValueError(f"num_classes is {num_classes}; a classifier needs at least 1 class")
        self.num_classes = num_classes
        self.k = top_k(num_classes)
        self._totals = torch.zeros(4, dtype=torch.float64, device=device)
        self._confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)

    def update(self, logits: torch.Tensor, labels: torch.Tensor, loss_sum: torch.Tensor) -> None:
        """Adds one batch, without a host sync.

        Args:
            logits: ``(N, C)`` scores of any float dtype.
            labels: ``(N,)`` int64 true classes in ``0..C-1``.
            loss_sum: Scalar tensor, the sum of the batch's per-sample losses.

        Raises:
            ValueError: If the shapes do not match ``(N, C)`` and ``(N,)``. Labels outside
                ``0..C-1`` cannot be checked without a sync; `result` reports them.
        """
        self._check_shapes(logits, labels)
        logits, labels = logits.detach(), labels.detach()
        top = logits.topk(self.k, dim=1).indices
        preds = top[:, 0]  # top-1 from the same call, so a tie cannot make top-1 miss top-k
        self._totals[_LOSS] += loss_sum.detach().to(self._totals)
        self._totals[_COUNT] += labels.numel()
        self._totals[_CORRECT1] += (preds == labels).sum()
        self._totals[_CORRECTK] += (top == labels[:, None]).any(dim=1).sum()
        self._count_confusion(labels, preds)

    def _check_shapes(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        if logits.dim() != 2 or logits.shape[1] != self.num_classes:
            raise ValueError(
                f"logits have shape {tuple(logits.shape)}; expected (N, {self.num_classes}): "
                "num_classes must match the model's output"
            )
        if labels.shape != logits.shape[:1]:
            raise ValueError(
                f"labels have shape {tuple(labels.shape)}; expected ({logits.shape[0]},), "
                "one class index per row of logits"
            )

    def _count_confusion(self, labels: torch.Tensor, preds: torch.Tensor) -> None:
        # torch.bincount would read its input's max back to the host (a sync per batch on CUDA);
        # index_add_ into the flat matrix counts the same cells without one. Labels out of range
        # are left out here and surface in result() as a count mismatch.
        c = self.num_classes
        valid = (labels >= 0) & (labels < c)
        cells = torch.where(valid, labels * c + preds, torch.zeros_like(labels))
        self._confusion.view(-1).index_add_(0, cells, valid.to(torch.int64))

    def tensors(self) -> list[torch.Tensor]:
        """The tensors to ``all_reduce(SUM)`` in place across ranks.

        Returns:
            ``[totals, confusion]``: float64 ``(4,)`` holding loss sum, sample count, top-1
            hits and top-k hits; int64 ``(C, C)`` confusion counts. Both are the live state.
        """
        return [self._totals, self._confusion]

    def result(self) -> EvalResult:
        """Reads the counts back to the host (one sync) and computes the metrics.

        Returns:
            The `EvalResult` of every batch added (and reduced) so far.

        Raises:
            ValueError: If no samples were added, or some labels were outside ``0..C-1``.
        """
        loss_sum, count, correct1, correctk = self._totals.tolist()
        confusion: list[list[int]] = self._confusion.tolist()
        samples = round(count)
        if samples == 0:
            raise ValueError(
                "no validation samples: EvalCounts.result() needs at least one update(); "
                "check that the validation split is not empty"
            )
        counted = sum(map(sum, confusion))
        if counted != samples:
            raise ValueError(
                f"{samples - counted} of {samples} labels were outside 0..{self.num_classes - 1}; "
                "num_classes must cover every label of the dataset"
            )
        return EvalResult(
            loss=loss_sum / count,
            top1=correct1 / count,
            top5=correctk / count,
            samples=samples,
            per_class_accuracy=_recalls(confusion),
            confusion=confusion,
        )


def _recalls(confusion: list[list[int]]) -> list[float | None]:
    """Per-class recall from a confusion matrix; ``None`` for a row without samples."""
    return [row[i] / sum(row) if sum(row) else None for i, row in enumerate(confusion)]
