"""What runs between a loader's DataLoader and its caller: `Stages`, built from the worker
settings by `make_stages` (the thread engine, `dlpipe.loading.threads`; the GPU decode,
`dlpipe.loading.device_decode`; the collate that makes a batch of finished samples: its task's,
`dlpipe.loading.task_collate`, for a detection or segmentation recipe, with the sources'
indices last over a mixture)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dlpipe.loading.config import LoaderConfig, LoaderConfigError, WorkerSettings
from dlpipe.loading.device_decode import (
    DeviceDecoder,
    PlannedTransform,
    collate_planned,
    decode_device,
)
from dlpipe.loading.task_collate import WithSources, task_collate
from dlpipe.loading.task_transforms import TaskTransform
from dlpipe.loading.threads import ThreadEngine, collate_pending
from dlpipe.loading.transforms import ImageTransform
from dlpipe.loading.views import MixTransform, collate

__all__ = ["Stages", "make_stages"]


@dataclass(frozen=True)
class Stages:
    """What runs between a loader's DataLoader and its caller, as its `WorkerSettings` ask.

    Attributes:
        collate: makes a batch of transformed samples (in the DataLoader, or in the thread
            engine when its transforms resolve).
        threads: the thread engine, resolving the DataLoader's pending batches; None with
            worker processes.
        device: ``decode="cuda"``: decodes each planned batch on the GPU.
    """

    collate: Callable[[list[Any]], Any] = collate
    threads: ThreadEngine | None = None
    device: DeviceDecoder | None = None

    @property
    def dataloader_collate(self) -> Callable[[list[Any]], Any]:
        """What the DataLoader collates with: pending futures for the thread engine, which
        collates them itself when they resolve; else `collate`."""
        return collate_pending if self.threads is not None else self.collate


def make_stages(settings: WorkerSettings, config: LoaderConfig, fn: Any) -> tuple[Any, Stages]:
    """The per-sample function the view runs and the stages after the DataLoader; a
    detection or segmentation recipe's samples collate in torchvision's conventions
    (`dlpipe.loading.task_collate`).

    Raises:
        LoaderConfigError: ``decode="cuda"`` with anything but a classification recipe.
    """
    final: Callable[[list[Any]], Any] = collate
    mixed = isinstance(fn, MixTransform)
    recipe = fn.inners[0] if mixed else fn
    if isinstance(recipe, TaskTransform):
        final = task_collate(recipe.spec.task)
        final = WithSources(final) if mixed else final
    device = None
    if settings.decode == "cuda":
        if isinstance(fn, TaskTransform):
            raise LoaderConfigError(
                f"decode='cuda' with a {fn.spec.task} dataset: the GPU decodes the "
                "classification transforms only (no boxes or masks); pass decode='cpu' (with "
                "workers={'decode': 'cpu'})"
            )
        if not isinstance(fn, ImageTransform):
            raise LoaderConfigError(
                f"decode='cuda' with transform={config.transform!r}: the GPU decodes the image "
                "transforms of one dataset only; pass transform 'train' or 'eval', or "
                "decode='cpu' (always, for a mixture of datasets)"
            )
        assert config.image_size is not None  # a classification loader's is resolved
        device = DeviceDecoder(decode_device(), config.image_size)
        fn, final = PlannedTransform(fn), collate_planned
    if not settings.threads:
        return fn, Stages(final, None, device)
    depth = settings.prefetch_factor or 2
    threads = ThreadEngine(settings.threads, depth, settings.pin_memory, final)
    return threads.deferred(fn), Stages(final, threads, device)
