"""Batches of detection and segmentation samples, in torchvision's conventions.

- detection: ``(images, targets)``: a uint8 (N, 3, H, W) batch when every image of the batch
  has one size (a recipe with an ``image_size``), else the list of the N uint8 (3, H_i, W_i)
  images (what torchvision's detection models take); ``targets`` the list of the N target
  dicts (`dlpipe.loading.targets`), as they are.
- segmentation: ``(images, masks)``: uint8 (N, 3, H, W) and the label maps' values as
  they are, uint8 (N, H, W) (int64 where a map holds values past 255), the ignore value kept;
  ``CrossEntropyLoss(ignore_index=...)`` takes int64, so the trainer casts on the device
  (``masks.long()``): an int64 batch is 8 times the bytes to make, move between processes
  and copy to the device. Every sample of a batch has one size (the train crop, the eval
  resize), else a `BatchShapeError` naming the sizes.

Over a mixture (`WithSources`), each sample's source index comes last, as a classification
mixture's does: ``(images, targets, sources)``, ``(images, masks, sources)``, sources an
int64 (N,) batch.

Images are stacked as `dlpipe.loading.views.stack_in_memory_order` stacks classification
crops: channels-last samples make a channels-last batch, into shared memory in a worker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from dlpipe.errors import DlpipeError
from dlpipe.loading.targets import batch_for_transfer
from dlpipe.loading.views import stack_in_memory_order

__all__ = [
    "BatchShapeError",
    "WithSources",
    "collate_detection",
    "collate_segmentation",
    "task_collate",
]


class BatchShapeError(DlpipeError, ValueError):
    """The samples of a segmentation batch differ in size."""


def collate_detection(
    batch: Sequence[tuple[torch.Tensor, dict[str, Any]]],
) -> tuple[torch.Tensor | list[torch.Tensor], list[dict[str, Any]]]:
    """(image, target) pairs → (a uint8 batch, or a list of images when sizes differ; the list
    of targets)."""
    images = [image for image, _ in batch]
    targets = batch_for_transfer([target for _, target in batch])  # few fds between processes
    if len({tuple(image.shape) for image in images}) == 1:
        return stack_in_memory_order(images), targets
    return images, targets


def collate_segmentation(
    batch: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(image, mask) pairs → (uint8 (N, 3, H, W), uint8 (N, H, W) masks, int64 when a
    mask of the batch is).

    Raises:
        BatchShapeError: the samples differ in size (naming the sizes).
    """
    sizes = sorted({tuple(image.shape[-2:]) for image, _ in batch})
    if len(sizes) > 1:
        raise BatchShapeError(
            f"a segmentation batch holds images of sizes {sizes}; one batch needs one size: "
            "use a recipe that crops or resizes (train, eval) with an image_size"
        )
    images = stack_in_memory_order([image for image, _ in batch])
    masks = [mask.as_subclass(torch.Tensor) for _, mask in batch]
    if len({mask.dtype for mask in masks}) > 1:
        masks = [mask.to(torch.int64) for mask in masks]
    return images, stack_in_memory_order(masks)


class WithSources:
    """A mixture's collate: `collate`'s batch of the samples without their last item (the
    source index), then the sources as an int64 (N,) batch."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate

    def __call__(self, batch: Sequence[tuple[Any, ...]]) -> tuple[Any, ...]:
        sources = torch.tensor([sample[-1] for sample in batch], dtype=torch.int64)
        return (*self.collate([sample[:-1] for sample in batch]), sources)


def task_collate(task: str) -> Callable[[Any], Any]:
    """The collate function of `task` (``detection`` or ``segmentation``).

    Raises:
        ValueError: another task.
    """
    collates: dict[str, Callable[[Any], Any]] = {
        "detection": collate_detection,
        "segmentation": collate_segmentation,
    }
    if task not in collates:
        raise ValueError(f"task {task!r} has no collate here; known: {', '.join(collates)}")
    return collates[task]
