"""The detection and segmentation hooks of the training loop (`dlpipe.train.tasks`).

**Detection** follows torchvision's detection models and their reference: the model takes a
list of float images in 0..1 (it normalises and resizes inside, ``GeneralizedRCNNTransform``)
and, in train mode, the targets, and returns its loss parts (summed into the loss, each
logged); in eval mode it returns each image's boxes, scores and labels. Label 0 is the
background, so the dataset's class ``k`` is the model's ``k + 1`` and a model has
``len(classes) + 1`` outputs (`dlpipe.train.models`). Scores: COCO mAP
(`dlpipe.train.task_metrics.DetectionEval`, gathered exactly across ranks).

**Segmentation** follows torchvision's segmentation reference: the images are normalised on
the device as a classifier's are, the model returns ``{"out": logits}`` (and ``"aux"``, weighed
0.5) or the logits, and the loss is cross-entropy that leaves the dataset's ignore value out,
each sample's mean over its counted pixels. Scores: mIoU and pixel accuracy
(`dlpipe.train.task_metrics.SegmentationEval`, summed exactly across ranks) and the val loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from dlpipe.loading.targets import TargetSpec
from dlpipe.manifest import Manifest
from dlpipe.train.pictures import render_detections, render_segmentation
from dlpipe.train.task_metrics import DetectionEval, SegmentationEval
from dlpipe.train.tasks import Evaluator, Result, TaskScores, TrainTask

if TYPE_CHECKING:
    from dlpipe.train.distributed import Distributed
    from dlpipe.train.step import StepRunner

__all__ = ["PICTURE_IMAGES", "DetectionTask", "SegmentationTask"]

PICTURE_IMAGES = 4
"""Validation images in the picture drawn after each evaluation."""
_NO_IGNORE = -100  # cross_entropy's default ignore_index: no target holds it


def float_images(images: Any, device: torch.device) -> list[torch.Tensor]:
    """A uint8 batch (N, 3, H, W) or list of (3, H, W) images → float 0..1 images on `device`
    (what torchvision's detection models take)."""
    return [image.to(device, non_blocking=True).float().div_(255) for image in images]


def _model_target(target: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """A loader target in the model's terms: plain tensors on `device`, labels shifted past
    the background (0)."""
    out = {
        "boxes": target["boxes"].as_subclass(torch.Tensor).float().to(device),
        "labels": target["labels"].to(device) + 1,
    }
    if "masks" in target:
        out["masks"] = target["masks"].as_subclass(torch.Tensor).to(device)
    return out


class DetectionTask(TrainTask):
    """Loss: the sum of the model's loss parts; scores: COCO mAP; best and early stopping by
    mAP@[.5:.95] (detection models give no val loss in eval mode)."""

    name, metric, stop_on = "detection", "map", "val mAP"

    def loss(
        self, runner: StepRunner, model: torch.nn.Module, images: Any, targets: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        inputs = float_images(images, runner.device)
        wanted = [_model_target(target, runner.device) for target in targets]
        with runner.autocast():
            parts = model(inputs, wanted)
        if not isinstance(parts, dict) or not parts:
            raise TypeError(
                f"the detection model returned {type(parts).__name__} in train mode; it must "
                "return its losses as a dict of tensors, as torchvision's detection models do"
            )
        count = len(inputs)
        sums = {name: value.float() * count for name, value in sorted(parts.items())}
        return torch.stack(list(sums.values())).sum(), {k: v.detach() for k, v in sums.items()}

    def evaluator(self, device: torch.device, *, keep_pictures: bool) -> Evaluator:
        return _DetectionEvaluator(self.classes, keep_pictures)


class _DetectionEvaluator(Evaluator):
    def __init__(self, classes: list[str], keep_pictures: bool) -> None:
        self.classes, self.keep = classes, PICTURE_IMAGES if keep_pictures else 0
        self.eval = DetectionEval(len(classes))
        self.shown: list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]] = []

    def forward(self, runner: StepRunner, model: torch.nn.Module, images: Any, targets: Any) -> Any:
        with runner.autocast():
            found = model(float_images(images, runner.device))
        return list(images), [_dataset_prediction(p) for p in found], targets

    def update(self, output: Any) -> None:
        images, predictions, targets = output
        self.eval.update(predictions, targets)
        for item in zip(images, predictions, targets, strict=True):
            if len(self.shown) < self.keep:
                self.shown.append((item[0].cpu(), item[1], item[2]))

    def result(self, dist: Distributed) -> Result:
        scores = self.eval.result(lambda obj: dist.all_gather(obj, what="gathering the detections"))
        per_class = dict(zip(self.classes, scores.per_class_ap, strict=True))
        history = {"map": scores.map, "map_50": scores.map_50, "map_75": scores.map_75}
        scalars = {f"val/{key}": value for key, value in history.items()}
        scalars.update({f"val_class/{k}": v for k, v in per_class.items() if v is not None})
        picture = render_detections(self.shown, self.classes) if self.shown else None
        fields = {**history, "per_class_ap": per_class, "val_images": scores.images}
        return TaskScores(scores.map, history, fields, scalars, picture)


def _dataset_prediction(prediction: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model's prediction on the host, in the dataset's classes (background dropped)."""
    labels = prediction["labels"].detach().cpu()
    keep = labels >= 1
    return {
        "boxes": prediction["boxes"].detach().float().cpu()[keep],
        "scores": prediction["scores"].detach().float().cpu()[keep],
        "labels": labels[keep] - 1,
    }


class SegmentationTask(TrainTask):
    """Loss: cross-entropy without the ignore value (+ 0.5 x the aux head's); scores: mIoU,
    pixel accuracy, val loss; best and early stopping by mIoU."""

    name, metric, stop_on = "segmentation", "miou", "val mIoU"

    def __init__(self, classes: list[str], ignore: int | None) -> None:
        super().__init__(classes)
        self.ignore = ignore

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> SegmentationTask:
        spec = TargetSpec.from_manifest(manifest, "segmentation")
        return cls(list(manifest.classes), spec.ignore)

    def loss(
        self, runner: StepRunner, model: torch.nn.Module, images: Any, targets: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out, masks = self.outputs(runner, model, images, targets)
        logits = out["out"] if isinstance(out, dict) else out
        loss = self.sample_losses(logits, masks).sum()
        if isinstance(out, dict) and out.get("aux") is not None:
            loss = loss + 0.5 * self.sample_losses(out["aux"], masks).sum()
        return loss, {}

    def outputs(
        self, runner: StepRunner, model: torch.nn.Module, images: Any, masks: Any
    ) -> tuple[Any, torch.Tensor]:
        """The model's output for a uint8 batch (normalised on the device) and the masks
        there."""
        x = runner.inputs(images)
        with runner.autocast():
            out = model(x)
        return out, masks.to(runner.device, non_blocking=True).long()  # uint8 batches

    def sample_losses(self, logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """Each sample's cross-entropy, the mean over its counted pixels (0 with none)."""
        ignore = _NO_IGNORE if self.ignore is None else self.ignore
        pixels = F.cross_entropy(logits.float(), masks, ignore_index=ignore, reduction="none")
        counted = (masks != ignore).flatten(1).sum(1).clamp(min=1)
        return pixels.flatten(1).sum(1) / counted

    def evaluator(self, device: torch.device, *, keep_pictures: bool) -> Evaluator:
        return _SegmentationEvaluator(self, device, keep_pictures)


class _SegmentationEvaluator(Evaluator):
    def __init__(self, task: SegmentationTask, device: torch.device, keep_pictures: bool) -> None:
        self.task, self.keep = task, PICTURE_IMAGES if keep_pictures else 0
        self.eval = SegmentationEval(len(task.classes), task.ignore, device)
        self.loss = torch.zeros(2, dtype=torch.float64, device=device)  # sum, samples
        self.shown: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(self, runner: StepRunner, model: torch.nn.Module, images: Any, targets: Any) -> Any:
        out, masks = self.task.outputs(runner, model, images, targets)
        logits = out["out"] if isinstance(out, dict) else out
        return images, logits.argmax(1), masks, self.task.sample_losses(logits, masks)

    def update(self, output: Any) -> None:
        images, predictions, masks, losses = output
        self.eval.update(predictions, masks)
        self.loss += torch.stack([losses.double().sum(), losses.new_tensor(len(losses)).double()])
        for item in zip(images, predictions, masks, strict=True):
            if len(self.shown) < self.keep:
                self.shown.append((item[0].cpu(), item[1].cpu(), item[2].cpu()))

    def result(self, dist: Distributed) -> Result:
        dist.all_reduce_(*self.eval.tensors(), self.loss, what="summing the evaluation counts")
        scores = self.eval.result()
        loss_sum, samples = self.loss.tolist()
        per_class = dict(zip(self.task.classes, scores.per_class_iou, strict=True))
        history = {
            "val_loss": loss_sum / samples,
            "miou": scores.miou,
            "pixel_acc": scores.pixel_accuracy,
        }
        scalars = {"val/loss": history["val_loss"], "val/miou": scores.miou}
        scalars["val/pixel_acc"] = scores.pixel_accuracy
        scalars.update({f"val_class/{k}": v for k, v in per_class.items() if v is not None})
        fields = {**history, "per_class_iou": per_class, "val_samples": int(samples)}
        fields["val_pixels"] = scores.pixels
        picture = None
        if self.shown:
            picture = render_segmentation(self.shown, len(self.task.classes))
        return TaskScores(scores.miou, history, fields, scalars, picture)
