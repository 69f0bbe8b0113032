"""Model factories the trainer tests load through ``--model trainer_models:NAME``."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn


class TinyCNN(nn.Module):
    """Two strided convolutions and a linear head: no BatchNorm, so DDP matches one process."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def tiny_cnn(num_classes: int) -> nn.Module:
    return TinyCNN(num_classes)


HOLD_ENV = "DLPIPE_TEST_MODEL_HOLD"
"""``<folder>:<step>``: the training forward of that step (1-based) announces itself with
``<folder>/held`` and waits there for ever, so a test kills the run at a known step."""


class _HoldsAtStep(TinyCNN):
    """TinyCNN (the same parameters and initialisation) that holds as `HOLD_ENV` says."""

    steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hold = os.environ.get(HOLD_ENV)
        if hold and self.training and torch.is_grad_enabled():
            self.steps += 1
            folder, step = hold.rsplit(":", 1)
            if self.steps == int(step):
                (Path(folder) / "held").touch()
                while True:
                    time.sleep(1)
        return super().forward(x)


def holds_at_step(num_classes: int) -> nn.Module:
    return _HoldsAtStep(num_classes)


class _OutOfMemoryAbove(TinyCNN):
    """Raises CUDA's out-of-memory error for batches larger than `limit` (an injected OOM)."""

    limit = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(x)


def oom_above_4(num_classes: int) -> nn.Module:
    return _OutOfMemoryAbove(num_classes)


class _Diverges(TinyCNN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * float("nan")


def diverges(num_classes: int) -> nn.Module:
    return _Diverges(num_classes)


class _HugeGradient(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient past float range."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.float() * 1e38


class _OverflowsOnce(TinyCNN):
    """The first training step's gradients overflow (the loss stays finite): a GradScaler
    must skip that optimizer step and halve its scale."""

    def __init__(self, num_classes: int) -> None:
        super().__init__(num_classes)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.training:
            self.calls += 1
            if self.calls == 1:
                return _HugeGradient.apply(out)
        return out


def overflows_once(num_classes: int) -> nn.Module:
    return _OverflowsOnce(num_classes)


def _block(inputs: int, outputs: int, stride: int = 1, dilation: int = 1) -> list[nn.Module]:
    """A 3x3 convolution, GroupNorm (per sample: a batch split over ranks normalises alike)
    and ReLU."""
    return [
        nn.Conv2d(inputs, outputs, 3, stride=stride, padding=dilation, dilation=dilation),
        nn.GroupNorm(4, outputs),
        nn.ReLU(),
    ]


class TinyDetector(nn.Module):
    """A one-level, anchor-free detector in torchvision's detection conventions: train mode
    takes (float 0..1 images, targets) and returns its losses, eval mode returns each image's
    boxes, scores and labels (0: the background). Each cell of a stride-4 grid predicts a class
    and its distances to the box edges; a cell is its box's when its centre is inside it. Each
    loss is a mean over images of a mean over the image, and GroupNorm, not BatchNorm: a batch's
    loss does not depend on how it is split, so DDP matches one process."""

    stride = 4

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            *_block(3, 16, stride=2),
            *_block(16, 32, stride=2),
            *_block(32, 32, dilation=2),
        )
        self.classes = nn.Conv2d(32, num_classes, 1)
        self.distances = nn.Conv2d(32, 4, 1)

    def forward(self, images: list[torch.Tensor], targets: list[dict] | None = None) -> Any:
        x = (torch.stack(images) - 0.5) / 0.25
        features = self.features(x)
        logits, distances = self.classes(features), self.distances(features)
        centres = self._centres(features)
        if self.training:
            assert targets is not None
            parts = [self._loss(logits[i], distances[i], centres, t) for i, t in enumerate(targets)]
            return {
                "classification": torch.stack([p[0] for p in parts]).mean(),
                "box_regression": torch.stack([p[1] for p in parts]).mean(),
            }
        return [self._detect(logits[i], distances[i], centres) for i in range(len(images))]

    def _centres(self, features: torch.Tensor) -> torch.Tensor:
        h, w = features.shape[-2:]
        ys = (torch.arange(h, dtype=torch.float32) + 0.5) * self.stride
        xs = (torch.arange(w, dtype=torch.float32) + 0.5) * self.stride
        grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
        return torch.stack([grid_x, grid_y], -1).reshape(-1, 2).to(features.device)

    def _loss(
        self, logits: torch.Tensor, distances: torch.Tensor, centres: torch.Tensor, target: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        boxes, labels = target["boxes"], target["labels"]
        count = centres.shape[0]
        classes = torch.zeros(count, dtype=torch.int64, device=centres.device)
        wanted = torch.zeros(count, 4, device=centres.device)
        if len(boxes):
            x, y = centres[:, :1], centres[:, 1:]
            left, top = x - boxes[:, 0], y - boxes[:, 1]
            edges = torch.stack([left, top, boxes[:, 2] - x, boxes[:, 3] - y], -1)  # (cells, G, 4)
            inside = edges.min(-1).values > 0
            area = ((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])).expand(count, -1)
            area = torch.where(inside, area, torch.full_like(area, float("inf")))
            best = area.argmin(1)
            positive = inside.any(1)
            classes = torch.where(positive, labels[best], classes)
            wanted = edges[torch.arange(count), best]
        flat = logits.flatten(1).t()
        classification = nn.functional.cross_entropy(flat, classes)
        positive = classes > 0
        if not positive.any():
            return classification, distances.sum() * 0
        predicted = distances.flatten(1).t()[positive]
        goal = torch.log(wanted[positive].clamp(min=1.0) / self.stride)
        return classification, nn.functional.smooth_l1_loss(predicted, goal)

    def _detect(self, logits: torch.Tensor, distances: torch.Tensor, centres: torch.Tensor) -> dict:
        from torchvision.ops import batched_nms

        probabilities = logits.flatten(1).t().softmax(1)[:, 1:]
        scores, labels = probabilities.max(1)
        edges = distances.flatten(1).t().exp() * self.stride
        x, y = centres[:, 0], centres[:, 1]
        boxes = torch.stack([x - edges[:, 0], y - edges[:, 1], x + edges[:, 2], y + edges[:, 3]], 1)
        keep = scores > 0.05
        boxes, scores, labels = boxes[keep], scores[keep], labels[keep] + 1
        kept = batched_nms(boxes, scores, labels, 0.5)[:100]
        return {"boxes": boxes[kept], "scores": scores[kept], "labels": labels[kept]}


def tiny_detector(num_classes: int) -> nn.Module:
    return TinyDetector(num_classes)


class TinySegmenter(nn.Module):
    """Four convolutions at half resolution, upsampled back: ``{"out": logits}`` as
    torchvision's segmentation models return; GroupNorm, not BatchNorm (DDP matches one
    process)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            *_block(3, 16, stride=2),
            *_block(16, 32, dilation=2),
            *_block(32, 32, dilation=4),
            nn.Conv2d(32, num_classes, 1),
        )

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.features(x)
        size = x.shape[-2:]
        return {"out": nn.functional.interpolate(logits, size=size, mode="bilinear")}


def tiny_segmenter(num_classes: int) -> nn.Module:
    return TinySegmenter(num_classes)
