"""Detection and segmentation metrics that are exact across DDP ranks.

**Detection: COCO mAP** (`DetectionEval`). Each rank keeps its images' predictions and targets
(numpy on the host, one `ImageRecord` each); `DetectionEval.result` gathers every rank's
records, orders them by image id and runs COCO's evaluation (``COCOeval``, box IoU, 101-point
interpolated precision, up to 100 detections per image) on the union, on every rank. The same
records in the same order give the same numbers, so 1 rank and N ranks agree exactly, and no
rank waits for another's result. The evaluation is faster_coco_eval's ``COCOeval_faster``
(``pip install 'dlpipe[detection]'``): pycocotools' algorithm in C++, the same numbers (a test
holds them equal), chosen by measurement: on 500 images x 20 boxes in 20 classes it took 0.47 s,
pycocotools 2.65 s, torchmetrics' ``MeanAveragePrecision`` 1.63 s (on faster_coco_eval) and
5.92 s (on pycocotools); all four gave the same mAP.

**Segmentation: mIoU and pixel accuracy** (`SegmentationEval`), from a confusion matrix of
integer pixel counts: ``all_reduce(SUM)`` of `SegmentationEval.tensors` makes each rank's
counts those of one pass over the whole split, exactly, as `dlpipe.train.metrics.EvalCounts`
does for classification. Pixels whose target is the ignore index are not counted.
"""

from __future__ import annotations

import contextlib
import io
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from dlpipe.errors import DlpipeError

__all__ = [
    "DetectionEval",
    "DetectionResult",
    "ImageRecord",
    "SegmentationEval",
    "SegmentationResult",
    "coco_map",
]

_MAX_DETECTIONS = 100  # COCO's per-image limit for mAP


class ImageRecord(NamedTuple):
    """One image's targets and predictions, XYXY pixel boxes (numpy, on the host)."""

    image_id: int
    boxes: np.ndarray  # (G, 4) float64
    labels: np.ndarray  # (G,) int64
    iscrowd: np.ndarray  # (G,) int64
    pred_boxes: np.ndarray  # (D, 4) float64
    pred_scores: np.ndarray  # (D,) float64
    pred_labels: np.ndarray  # (D,) int64


@dataclass(frozen=True)
class DetectionResult:
    """COCO box mAP over every rank's images.

    Attributes:
        map: mAP@[.5:.95] (COCO's primary metric), 0..1.
        map_50: mAP at IoU 0.5 (VOC's metric), 0..1.
        map_75: mAP at IoU 0.75, 0..1.
        per_class_ap: AP@[.5:.95] of each class; None for a class without (non-crowd) targets.
        images: images evaluated.
    """

    map: float
    map_50: float
    map_75: float
    per_class_ap: list[float | None]
    images: int


def _numpy(tensor: Any, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    array: np.ndarray = torch.as_tensor(tensor).detach().cpu().numpy().astype(dtype, copy=False)
    return array.reshape(shape)


class DetectionEval:
    """Accumulates detection predictions and targets for COCO mAP.

    Args:
        num_classes: the dataset's class count (labels are 0..C-1).

    Raises:
        ValueError: fewer than 1 class.
    """

    def __init__(self, num_classes: int) -> None:
        if num_classes < 1:
            raise ValueError(f"num_classes is {num_classes}; a detector needs at least 1 class")
        self.num_classes = num_classes
        self.records: list[ImageRecord] = []

    def update(
        self, predictions: Sequence[Mapping[str, Any]], targets: Sequence[Mapping[str, Any]]
    ) -> None:
        """Adds one batch in torchvision's conventions (one sync: the host copy).

        Args:
            predictions: per image ``{"boxes": (D, 4) XYXY, "scores": (D,), "labels": (D,)}``
                (what torchvision's detectors return in eval mode).
            targets: per image ``{"boxes": (G, 4) XYXY, "labels": (G,), "image_id": int}``
                and optionally ``"iscrowd"`` (`dlpipe.loading.targets`).

        Raises:
            ValueError: the two lists differ in length.
        """
        if len(predictions) != len(targets):
            raise ValueError(
                f"{len(predictions)} predictions for {len(targets)} targets: give one "
                "prediction dict per image of the batch"
            )
        for prediction, target in zip(predictions, targets, strict=True):
            count = len(target["labels"])
            found = len(prediction["labels"])
            crowd = target.get("iscrowd", torch.zeros(count, dtype=torch.int64))
            self.records.append(
                ImageRecord(
                    int(target["image_id"]),
                    _numpy(target["boxes"], np.float64, (count, 4)),
                    _numpy(target["labels"], np.int64, (count,)),
                    _numpy(crowd, np.int64, (count,)),
                    _numpy(prediction["boxes"], np.float64, (found, 4)),
                    _numpy(prediction["scores"], np.float64, (found,)),
                    _numpy(prediction["labels"], np.int64, (found,)),
                )
            )

    def result(self, all_gather: Callable[[Any], list[Any]] | None = None) -> DetectionResult:
        """COCO mAP over every rank's records (call it on every rank).

        Args:
            all_gather: gathers one picklable object from every rank, in rank order
                (`dlpipe.train.distributed.Distributed.all_gather`); by default
                ``torch.distributed.all_gather_object`` when a process group is initialized,
                else this rank's records alone.

        Raises:
            ValueError: no images, or an image id on two ranks (or twice on one).
        """
        gather = all_gather or _default_all_gather
        every = [record for part in gather(self.records) for record in part]
        return coco_map(every, self.num_classes)


def _default_all_gather(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def coco_map(records: Sequence[ImageRecord], num_classes: int) -> DetectionResult:
    """COCO box mAP of `records` (any order: they are sorted by image id first).

    Raises:
        ValueError: no images, an image id given twice, or a label outside 0..C-1.
    """
    ordered = sorted(records, key=lambda r: r.image_id)
    if not ordered:
        raise ValueError("no validation images: DetectionEval.result() needs an update()")
    for before, after in itertools.pairwise(ordered):
        if before.image_id == after.image_id:
            raise ValueError(
                f"image id {after.image_id} was evaluated twice (on two ranks, or twice in a "
                "pass): every validation image needs its own id and one rank"
            )
    _check_labels(ordered, num_classes)
    evaluator = _evaluate(ordered, num_classes)
    stats = evaluator.stats
    precision = np.asarray(evaluator.eval["precision"])  # [IoU, recall, class, area, max dets]
    return DetectionResult(
        map=_score(stats[0]),
        map_50=_score(stats[1]),
        map_75=_score(stats[2]),
        per_class_ap=[_mean_precision(precision[:, :, k, 0, -1]) for k in range(num_classes)],
        images=len(ordered),
    )


def _check_labels(records: Sequence[ImageRecord], num_classes: int) -> None:
    for record in records:
        for labels in (record.labels, record.pred_labels):
            if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
                raise ValueError(
                    f"image {record.image_id} has a label outside 0..{num_classes - 1}; "
                    "num_classes must cover every label of the dataset and the model"
                )


def _score(value: float) -> float:
    """COCO's -1 (nothing to evaluate) as 0.0; a score otherwise."""
    return max(float(value), 0.0)


def _mean_precision(precision: np.ndarray) -> float | None:
    valid = precision[precision > -1]
    return float(valid.mean()) if valid.size else None


def _coco_backend() -> tuple[Any, Any]:
    try:
        from faster_coco_eval import COCO, COCOeval_faster
    except ImportError:
        raise DlpipeError(
            "COCO mAP needs faster-coco-eval: pip install 'dlpipe[detection]'"
        ) from None
    return COCO, COCOeval_faster


def coco_dataset(records: Sequence[ImageRecord], num_classes: int, predictions: bool) -> dict:
    """The COCO-format dict of the records' targets or (with `predictions`) detections."""
    annotations: list[dict[str, Any]] = []
    for record in records:
        if predictions:
            keep = np.argsort(-record.pred_scores, kind="stable")[:_MAX_DETECTIONS]
            boxes, labels = record.pred_boxes[keep], record.pred_labels[keep]
            extra = [{"score": float(s)} for s in record.pred_scores[keep]]
        else:
            boxes, labels = record.boxes, record.labels
            extra = [{"iscrowd": int(c)} for c in record.iscrowd]
        for box, label, more in zip(boxes, labels, extra, strict=True):
            x0, y0, x1, y1 = (float(v) for v in box)
            annotations.append({
                "id": len(annotations) + 1, "image_id": record.image_id,
                "category_id": int(label), "bbox": [x0, y0, x1 - x0, y1 - y0],
                "area": (x1 - x0) * (y1 - y0), "iscrowd": 0, **more,
            })  # fmt: skip
    return {
        "images": [{"id": r.image_id} for r in records],
        "categories": [{"id": k, "name": str(k)} for k in range(num_classes)],
        "annotations": annotations,
    }


def _evaluate(records: Sequence[ImageRecord], num_classes: int) -> Any:
    coco, coco_eval = _coco_backend()
    with contextlib.redirect_stdout(io.StringIO()):  # the backends print their progress
        truth = coco(coco_dataset(records, num_classes, predictions=False))
        found = coco(coco_dataset(records, num_classes, predictions=True))
        evaluator = coco_eval(truth, found, "bbox")
        evaluator.params.imgIds = [r.image_id for r in records]
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return evaluator


@dataclass(frozen=True)
class SegmentationResult:
    """Semantic segmentation scores over every rank's pixels.

    Attributes:
        miou: mean IoU over the classes present in targets or predictions, 0..1.
        pixel_accuracy: share of counted pixels predicted right, 0..1.
        per_class_iou: IoU of each class; None for a class neither in targets nor predictions.
        pixels: pixels counted (the ignore index left out).
        confusion: ``C x C`` pixel counts; rows the true class, columns the predicted.
    """

    miou: float
    pixel_accuracy: float
    per_class_iou: list[float | None]
    pixels: int
    confusion: list[list[int]]


class SegmentationEval:
    """Accumulates a pixel confusion matrix on the model's device, without a host sync.

    Args:
        num_classes: the model's class count ``C``.
        ignore_index: the target value that is not counted (VOC's 255), or None.
        device: where the counts live.

    Raises:
        ValueError: fewer than 1 class.
    """

    def __init__(
        self, num_classes: int, ignore_index: int | None = 255, device: torch.device | str = "cpu"
    ) -> None:
        if num_classes < 1:
            raise ValueError(f"num_classes is {num_classes}; a segmenter needs at least 1 class")
        self.num_classes, self.ignore_index = num_classes, ignore_index
        self._counted = torch.zeros(1, dtype=torch.int64, device=device)
        self._confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)

    def update(self, outputs: torch.Tensor, masks: torch.Tensor) -> None:
        """Adds one batch.

        Args:
            outputs: ``(N, C, H, W)`` logits, or ``(N, H, W)`` predicted classes.
            masks: ``(N, H, W)`` target classes (the ignore index where not counted).

        Raises:
            ValueError: shapes that do not match. Targets outside 0..C-1 (other than the
                ignore index) are found in `result`.
        """
        preds = outputs.argmax(1) if outputs.dim() == 4 else outputs
        if preds.shape != masks.shape:
            raise ValueError(
                f"predictions of shape {tuple(preds.shape)} for masks of shape "
                f"{tuple(masks.shape)}: the model's output must have the masks' size"
            )
        c = self.num_classes
        truth, preds = masks.detach().reshape(-1).long(), preds.detach().reshape(-1).long()
        counted = truth != self.ignore_index if self.ignore_index is not None else truth >= 0
        valid = counted & (truth >= 0) & (truth < c) & (preds >= 0) & (preds < c)
        cells = torch.where(valid, truth * c + preds, torch.zeros_like(truth))
        self._confusion.view(-1).index_add_(0, cells, valid.to(torch.int64))
        self._counted += counted.sum()

    def tensors(self) -> list[torch.Tensor]:
        """The tensors to ``all_reduce(SUM)`` in place across ranks (the live state)."""
        return [self._counted, self._confusion]

    def result(self) -> SegmentationResult:
        """Reads the counts back (one sync) and computes the scores.

        Raises:
            ValueError: no pixels counted, or some targets or predictions outside 0..C-1.
        """
        counted = int(self._counted.item())
        confusion = self._confusion.cpu().numpy()
        total = int(confusion.sum())
        if counted == 0:
            raise ValueError("no validation pixels: every target pixel was the ignore index")
        if total != counted:
            raise ValueError(
                f"{counted - total} of {counted} pixels had a target or prediction outside "
                f"0..{self.num_classes - 1}; num_classes must cover every class of the dataset"
            )
        hits = np.diag(confusion)
        union = confusion.sum(0) + confusion.sum(1) - hits
        per_class = [float(h / u) if u else None for h, u in zip(hits, union, strict=True)]
        present = [v for v in per_class if v is not None]
        return SegmentationResult(
            miou=float(np.mean(present)),
            pixel_accuracy=float(hits.sum() / total),
            per_class_iou=per_class,
            pixels=total,
            confusion=confusion.tolist(),
        )
