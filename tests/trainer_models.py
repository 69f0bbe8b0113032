"""Model factories the trainer tests load through ``--model trainer_models:NAME``."""

from __future__ import annotations

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
