"""Optimizer and learning-rate schedule: SGD with momentum or AdamW, linear warm-up
then cosine decay, counted in optimizer steps so the recipe does not depend on the world size.

Weight decay skips biases and normalisation weights (every parameter with fewer than two
dimensions), as the torchvision and timm reference recipes do.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from dlpipe.train.config import OptimConfig

__all__ = ["build_optimizer", "build_scheduler", "lr_factor"]


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.Optimizer:
    assert config.lr is not None and config.weight_decay is not None  # resolved config
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim > 1 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum)
    return torch.optim.AdamW(groups, lr=config.lr)


def lr_factor(step: int, *, warmup_steps: int, total_steps: int) -> float:
    """The multiple of the peak learning rate after `step` optimizer steps."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    schedule = functools.partial(lr_factor, warmup_steps=warmup_steps, total_steps=total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
