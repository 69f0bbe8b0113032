"""One optimizer step: micro-batches, AMP, gradient sync on the last one, agreement, OOM backoff.

Per rank a step takes up to ``accumulation`` loader batches (fewer at the end of an epoch).
Every micro-batch's loss is a sum divided by this rank's sample count for the step, so the
gradient is the mean over the step's global samples, tail steps included (DDP averages the
ranks, which all hold the same count). Gradient all-reduce is suppressed (``no_sync``) on all
but the last micro-batch.

Before the last backward pass the ranks agree, in one small all-reduce, on the step's loss and
sample count, whether any rank ran out of memory, and whether any rank was asked to stop
(SIGTERM). On out-of-memory every rank drops the step's gradients, halves the micro-batch
(the loader's batches are cut in two), doubles the accumulation and retries the same samples,
so the global batch and the data order stay the same. A non-finite loss or gradient norm skips
the optimizer step on every rank; with fp16 the GradScaler decides, and a step it skipped does
not advance the learning-rate schedule.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dlpipe.errors import DlpipeError
from dlpipe.loading.state import (
    SAVED_BY_DLPIPE,
    mismatch,
    require_fields,
    require_float,
    require_int,
    require_like,
)
from dlpipe.loading.transforms import normalize
from dlpipe.train.distributed import Distributed
from dlpipe.train.tasks import ClassificationTask, Evaluator, Result, TrainTask

__all__ = ["Precision", "StepResult", "StepRunner", "TrainingError", "resolve_precision"]

Batch = tuple[Any, Any]  # (images, targets): a tensor or a list of each (`StepRunner.chunks`)


class TrainingError(DlpipeError, RuntimeError):
    """Training cannot go on (diverged, out of memory at the smallest micro-batch)."""


@dataclass(frozen=True)
class Precision:
    name: str  # fp32 | bf16 | fp16
    dtype: torch.dtype | None  # autocast dtype, None for fp32

    @property
    def needs_scaler(self) -> bool:
        return self.name == "fp16"


def resolve_precision(name: str, device: torch.device) -> Precision:
    """``auto``: bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPUs."""
    if name == "auto":
        if device.type != "cuda":
            name = "fp32"
        else:
            name = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    return Precision(name, dtypes[name])


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean per global sample; nan when not finite
    samples: int  # global samples in the step
    grad_norm: float | None
    skipped: bool  # the optimizer did not step (non-finite loss or gradients)
    stop: bool  # some rank was asked to stop: checkpoint after this step
    parts: dict[str, float] = field(default_factory=dict)  # the loss's parts, mean per sample


class StepRunner:
    """Runs optimizer steps for a (possibly DDP-wrapped, compiled) model.

    Args:
        model: what forward runs (DDP and/or compiled); its parameters are optimised.
        optimizer, scheduler: the scheduler counts optimizer steps taken.
        dist: the process group helpers.
        precision: the autocast recipe; fp16 brings a GradScaler.
        clip_grad: max gradient norm, or None.
        task: the loss hook (`dlpipe.train.tasks`); default: classification's cross-entropy.
        channels_last: feed NHWC-strided inputs (else NCHW, whatever the loader's layout).
        on_backoff: told (micro-batch, accumulation) after an out-of-memory backoff.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        dist: Distributed,
        precision: Precision,
        *,
        clip_grad: float | None = None,
        task: TrainTask | None = None,
        channels_last: bool = False,
        on_backoff: Callable[[int], None] | None = None,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.dist, self.precision, self.device = dist, precision, dist.device
        self.clip_grad = clip_grad
        self.task = task if task is not None else ClassificationTask([])
        self.channels_last = channels_last
        self.on_backoff = on_backoff
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=precision.needs_scaler)
        self.splits = 1  # each loader batch is cut in this many micro-batches (OOM backoff)
        self.stop_requested = False  # set from a signal handler

    def state_dict(self) -> dict[str, Any]:
        """The GradScaler (empty without fp16) and the micro-batch backoff (`splits`)."""
        return {"scaler": self.scaler.state_dict(), "splits": self.splits}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`; the backoff stays (the same memory needs the same cut)."""
        what = "step runner"
        saved = require_fields(state, ("scaler", "splits"), what)
        splits = require_int(saved, "splits", what, low=1)
        if splits & (splits - 1):  # the backoff doubles it from 1
            raise mismatch(what, "splits", splits, "it must be a power of 2", SAVED_BY_DLPIPE)
        scaler = saved["scaler"]
        if not isinstance(scaler, dict):
            raise mismatch(what, "scaler", scaler, "it must be a dict", SAVED_BY_DLPIPE)
        if scaler and self.scaler.is_enabled():
            require_like(scaler, self.scaler.state_dict(), "scaler", what)
            scale = {"scaler.scale": scaler["scale"]}  # 0 zeroes every gradient
            require_float(scale, "scaler.scale", what, low=sys.float_info.min)
            self.scaler.load_state_dict(dict(scaler))
        self.splits = splits

    def run(self, batches: list[Batch]) -> StepResult:
        """One optimizer step over this rank's `batches`, retried smaller on out-of-memory."""
        while True:
            result = self._attempt(batches)
            if result is not None:
                return result
            self.back_off(max(len(targets) for _, targets in batches))

    def _attempt(self, batches: list[Batch]) -> StepResult | None:
        chunks = list(self._chunks(batches))
        count = sum(len(targets) for _, targets in batches)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        part_sums: dict[str, torch.Tensor] = {}
        last_loss, oom = None, False
        try:
            for i, (images, targets) in enumerate(chunks):
                last = i == len(chunks) - 1
                with self._sync(last):
                    loss, parts = self.task.loss(self, self.model, images, targets)
                    loss_sum += loss.detach()
                    for name, value in parts.items():
                        part_sums[name] = part_sums.get(name, 0) + value.double()
                    if last:
                        last_loss = loss  # its backward syncs: agree first
                    else:
                        self._backward(loss / count)
        except torch.OutOfMemoryError:
            oom = True
        agreed = torch.tensor(
            [float(loss_sum), count, float(oom), float(self.stop_requested)],
            dtype=torch.float64,
            device=self.device,
        )
        self.dist.all_reduce_(agreed, what="agreeing on the step's loss, samples and stop flag")
        total, samples, any_oom, any_stop = agreed.tolist()
        if any_oom:
            return None
        loss_mean = total / samples
        parts = self._agreed_parts(part_sums, samples)
        if not math.isfinite(loss_mean):
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(math.nan, int(samples), None, True, any_stop > 0, parts)
        assert last_loss is not None
        try:
            self.dist.guarded("the gradient all-reduce", lambda: self._backward(last_loss / count))
        except torch.OutOfMemoryError:
            if self.dist.enabled:  # the other ranks wait in this backward's all-reduce
                raise TrainingError(
                    "out of memory in the gradient-synchronising backward pass; it cannot be "
                    "retried safely with several ranks. Restart with a smaller --micro-batch"
                ) from None
            return None
        norm, skipped = self._optimizer_step()
        return StepResult(loss_mean, int(samples), norm, skipped, any_stop > 0, parts)

    def _agreed_parts(self, sums: dict[str, torch.Tensor], samples: float) -> dict[str, float]:
        """The loss parts' means per global sample (every rank's model names the same parts;
        a task whose loss has none costs no collective)."""
        if not sums:
            return {}
        values = torch.stack([sums[name] for name in sorted(sums)])
        self.dist.all_reduce_(values, what="summing the step's loss parts")
        return {name: v / samples for name, v in zip(sorted(sums), values.tolist(), strict=True)}

    def _chunks(self, batches: list[Batch]) -> Iterator[Batch]:
        for images, labels in batches:
            yield from self.chunks(images, labels)

    def _sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        no_sync = getattr(self.model, "no_sync", None)
        if last or not self.dist.enabled or no_sync is None:
            return contextlib.nullcontext()
        return no_sync()  # type: ignore[no-any-return,unused-ignore]

    def inputs(self, images: torch.Tensor) -> torch.Tensor:
        """A uint8 batch on the device, laid out as the model wants it and normalised there."""
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        images = images.to(self.device, non_blocking=True)  # the loader's layout
        return normalize(images.contiguous(memory_format=layout))  # laid out in uint8

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The precision's autocast (off for fp32)."""
        dtype = self.precision.dtype
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    def logits(
        self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`model`'s logits for a uint8 batch (normalised on the device, under autocast), and
        the labels on the device; training and evaluation share it."""
        x = self.inputs(images)
        y = labels.to(self.device, non_blocking=True)
        with self.autocast():
            return model(x), y

    def _backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def _optimizer_step(self) -> tuple[float, bool]:
        """Unscale, measure (and clip) the gradient norm, step; returns (norm, skipped)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if self.clip_grad is not None:
            torch.nn.utils.clip_grads_with_norm_(params, self.clip_grad, norm)
        norm_value = float(norm)
        if self.scaler.is_enabled():
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # skips the step itself on inf/nan gradients
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale
        else:
            skipped = not math.isfinite(norm_value)
            if not skipped:
                self.optimizer.step()
        if not skipped:
            self.scheduler.step()
        return norm_value, skipped

    def chunks(self, images: Any, targets: Any) -> Iterator[Batch]:
        """One loader batch as the micro-batches the current backoff allows (images and
        targets each a tensor or a list: detection's)."""
        size = math.ceil(len(targets) / self.splits)
        yield from zip(_pieces(images, size), _pieces(targets, size), strict=True)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: Any, evaluator: Evaluator) -> Result:
        """Every sample of `loader` (this rank's part) through `model` (not DDP: no collective
        until the end, so an out-of-memory retry is per rank); the task's `evaluator` sums
        or gathers the scores over ranks."""
        self.dist.average_buffers(model)
        model.eval()
        for images, targets in loader:
            while True:
                try:
                    outputs = [
                        evaluator.forward(self, model, x, y)
                        for x, y in self.chunks(images, targets)
                    ]
                    break
                except torch.OutOfMemoryError:
                    self.back_off(len(targets))
            for output in outputs:
                evaluator.update(output)
        result = evaluator.result(self.dist)
        model.train()
        return result

    def back_off(self, loader_batch: int) -> None:
        """Halve the micro-batch after an out-of-memory error (raises at one sample)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.splits >= loader_batch:
            raise TrainingError(
                "out of memory with a micro-batch of 1 sample; use a smaller model or "
                "--image-size, --precision bf16, or a GPU with more memory"
            )
        self.splits *= 2
        if self.on_backoff is not None:
            self.on_backoff(math.ceil(loader_batch / self.splits))


def _pieces(items: Any, size: int) -> list[Any]:
    """A tensor's or a list's consecutive pieces of `size` (the last may be shorter)."""
    if isinstance(items, torch.Tensor):
        return list(items.split(size))
    return [items[start : start + size] for start in range(0, len(items), size)]
