"""Decode on the GPU: the workers read bytes and plan the crop, the batch decodes on the device.

With ``decode="cuda"`` a loader's workers (or threads) do no pixel work for a JPEG: each reads
the header (size, colour space), checks the pixel limit, draws the train crop's box and flip
from the sample's seeded generator (the very draws the CPU path makes, so a GPU-decoded sample
is the CPU-decoded one within decoder and interpolation error) or computes the eval resize and
centre crop, and sends the encoded bytes with that plan (`EncodedImage`). A batch travels
packed (`PlannedBatch`): every JPEG end to end in one tensor, the plans in another, so the trip
to the main process and the pinning cost a few tensors per batch, not two per sample (each
tensor a shared-memory segment, a file descriptor over a socket and a pinned buffer of its
own). The main process decodes the whole batch in one call (``torchvision.io.decode_jpeg``
on a list, batched nvJPEG on CUDA), then crops and resizes (bilinear, antialiased) each
image on the device (their sizes differ), and flips and rounds the batch at once: the loader
yields uint8 (N, 3, S, S) batches already on the GPU, channels-last as the CPU path's. (A
batched resize, each image's crop and resize as torch's antialias weight matrices in two
batched matrix products, ran at 0.95x this on an H200: the dense products do about 60x the
multiply-adds of the banded filter.)

A seekable JPEG (``convert --seekable-jpeg``) travels cut to the MCUs around its train box
(`dlpipe.jpeg_seek`), so the device decodes, and nvJPEG's host-side Huffman stage reads, only
those; the box's pixels are the whole JPEG's.

What nvJPEG cannot take here (PNG, WebP, CMYK/YCCK JPEGs) is decoded on the CPU in the worker
as before and travels as a finished crop; the batch mixes both. A JPEG that fails on the device
is retried alone to name its sample (`FieldDecodeError`), as the CPU path names it.

The loader decodes one batch ahead on a background thread (`DeviceDecoder.batches`; on CUDA on
a side stream the caller's stream waits for), so decoding the next batch overlaps the training
step on this one. The same code runs on the CPU device (torchvision's CPU ``decode_jpeg``):
that is how it is tested on machines without CUDA.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import accumulate, pairwise
from typing import Any, NamedTuple

import torch
import torch.nn.functional as nnf
from torchvision.io import ImageReadMode, decode_jpeg

from dlpipe.codecs import check_image_pixels, stable_message
from dlpipe.errors import DlpipeError, FieldDecodeError
from dlpipe.jpeg_seek import cut_window
from dlpipe.loading.transforms import (
    SCALABLE_COLORSPACES,
    ImageTransform,
    jpeg_header,
    sample_label,
)
from dlpipe.sample import KEY_FIELD, Sample

__all__ = [
    "DecodeDeviceError",
    "DeviceDecoder",
    "EncodedImage",
    "PlannedBatch",
    "PlannedTransform",
    "collate_planned",
    "decode_device",
]


class DecodeDeviceError(DlpipeError, ValueError):
    """``decode="cuda"`` was asked for where no CUDA device (or no nvJPEG) is."""


def decode_device() -> torch.device:
    """The device ``decode="cuda"`` decodes on: the current CUDA device.

    Raises:
        DecodeDeviceError: torch sees no CUDA device here.
    """
    if not torch.cuda.is_available():
        raise DecodeDeviceError(
            "decode='cuda' needs a CUDA device, and torch.cuda.is_available() is False here; "
            "pass decode='cpu' (or leave it to the saved profile)"
        )
    return torch.device("cuda", torch.cuda.current_device())


class EncodedImage(NamedTuple):
    """A JPEG to decode on the device and what to do with it there.

    ``plan`` is 7 ints: ``top, left, height, width`` of the crop, ``flip``, and the size
    ``resize_h, resize_w`` the whole image is resized to first (0, 0: crop the full-size image
    and resize the crop to the output size, the train recipe; else resize, then crop the
    output-size window at ``top, left``, the eval recipe).
    """

    data: bytes
    plan: tuple[int, ...]
    key: str


class PlannedBatch(NamedTuple):
    """A batch of planned samples as it travels to the main process (`collate_planned`).

    Attributes:
        data: uint8 (total,), the batch's encoded JPEGs end to end.
        offsets: int64 (M + 1,): JPEG j is ``data[offsets[j]:offsets[j + 1]]``.
        plans: int64 (M, 7), each JPEG's `EncodedImage.plan`.
        keys: each JPEG's sample key, to name one that fails to decode.
        encoded_at: int64 (M,), each JPEG's place in the batch.
        finished: uint8 (N - M, 3, S, S), the crops the workers made of what the device does
            not decode (PNG, CMYK JPEGs...); empty (0,) when there are none.
        finished_at: int64 (N - M,), their places in the batch.
    """

    data: torch.Tensor
    offsets: torch.Tensor
    plans: torch.Tensor
    keys: list[str]
    encoded_at: torch.Tensor
    finished: torch.Tensor
    finished_at: torch.Tensor

    @property
    def samples(self) -> int:
        """The batch's sample count."""
        return len(self.encoded_at) + len(self.finished_at)


class PlannedTransform:
    """The worker side of ``decode="cuda"``: an `ImageTransform`'s plan instead of its pixels
    for a JPEG the device decodes; the transform itself for anything else. Picklable."""

    seeded_by_position = True  # takes (epoch, index), as the transform it wraps

    def __init__(self, transform: ImageTransform) -> None:
        self.transform = transform

    def __call__(self, sample: Sample, epoch: int = 0, index: int = 0) -> tuple[Any, int]:
        t = self.transform
        data = bytes(sample[t.field])  # type: ignore[arg-type]
        header = jpeg_header(data)
        if header is None or header[2] not in SCALABLE_COLORSPACES:  # nvJPEG: YCbCr, grey
            return t(sample, epoch, index)
        try:
            width, height = check_image_pixels(data, t.max_pixels)
        except FieldDecodeError as exc:
            raise t.named(exc, sample) from None
        plan = self._plan(width, height, epoch, index)
        if t.recipe == "train":
            data, plan = _windowed(data, plan)
        key = str(sample.get(KEY_FIELD, "?"))
        return EncodedImage(data, tuple(plan), key), sample_label(sample)

    def _plan(self, width: int, height: int, epoch: int, index: int) -> list[int]:
        t, size = self.transform, self.transform.image_size
        if t.recipe == "train":
            generator = t.generator(epoch, index)
            box = t.sample_box(width, height, generator)
            flip = bool(torch.rand(1, generator=generator) < 0.5)  # the CPU path's draw
            return [*box, int(flip), 0, 0]
        short, long = sorted((width, height))  # v2.Resize(round(size / 0.875)) + CenterCrop
        resize = round(size / 0.875)
        new_short, new_long = resize, int(resize * long / short)
        new_h, new_w = (new_short, new_long) if height <= width else (new_long, new_short)
        top, left = round((new_h - size) / 2.0), round((new_w - size) / 2.0)
        return [top, left, size, size, 0, new_h, new_w]


def _windowed(data: bytes, plan: list[int]) -> tuple[bytes, list[int]]:
    """A seekable JPEG (`dlpipe.jpeg_seek`) cut to the MCUs around the train box, and the box
    in the cut: the device decodes (and the batch carries) only those; else as it was."""
    top, left, height, width = plan[:4]
    window = cut_window(data, (top, left, height, width))
    if window is None:
        return data, plan
    cut, _, top, left = window
    return cut, [plan[0] - top, plan[1] - left, *plan[2:]]


def collate_planned(items: Sequence[tuple[Any, int]]) -> tuple[PlannedBatch, torch.Tensor]:
    """Planned samples (an `EncodedImage` or a finished uint8 crop each, and a label) packed
    as one `PlannedBatch`, and the labels as int64 (N,)."""
    encoded = [(i, p) for i, (p, _) in enumerate(items) if isinstance(p, EncodedImage)]
    finished = [(i, p) for i, (p, _) in enumerate(items) if not isinstance(p, EncodedImage)]
    offsets = [0, *accumulate(len(p.data) for _, p in encoded)]
    buffer = bytearray(offsets[-1])
    view = memoryview(buffer)
    for (_, payload), (start, end) in zip(encoded, pairwise(offsets), strict=True):
        view[start:end] = payload.data
    batch = PlannedBatch(
        data=torch.frombuffer(buffer, dtype=torch.uint8) if buffer else _empty(torch.uint8),
        offsets=torch.tensor(offsets, dtype=torch.int64),
        plans=torch.tensor([p.plan for _, p in encoded], dtype=torch.int64).reshape(-1, 7),
        keys=[p.key for _, p in encoded],
        encoded_at=torch.tensor([i for i, _ in encoded], dtype=torch.int64),
        finished=torch.stack([p for _, p in finished]) if finished else _empty(torch.uint8),
        finished_at=torch.tensor([i for i, _ in finished], dtype=torch.int64),
    )
    return batch, torch.tensor([label for _, label in items])


def _empty(dtype: torch.dtype) -> torch.Tensor:
    return torch.empty((0,), dtype=dtype)


class DeviceDecoder:
    """The main-process side of ``decode="cuda"``: a planned batch → uint8 (N, 3, S, S) on
    `device`, labels as they came."""

    def __init__(self, device: torch.device, image_size: int) -> None:
        self.device, self.size = device, image_size

    def batches(self, items: Iterator[tuple[Any, Any]]) -> Iterator[tuple[Any, Any]]:
        """(planned batch, tag) pairs → (decoded batch, tag), decoding one batch ahead on a
        background thread, so the decode of the next batch overlaps the caller's step on
        this one; on CUDA the thread works on its own stream, and the caller's current stream
        waits for that batch's work (an event) before the batch is handed over."""
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        with ThreadPoolExecutor(1, thread_name_prefix="dlpipe-device-decode") as pool:
            ahead: tuple[Future[Any], Any] | None = None
            for batch, tag in items:
                future = pool.submit(self._on_stream, stream, batch)
                if ahead is not None:
                    yield _handed_over(*ahead[0].result()), ahead[1]
                ahead = (future, tag)
            if ahead is not None:
                yield _handed_over(*ahead[0].result()), ahead[1]

    def _on_stream(self, stream: Any, batch: Any) -> tuple[Any, Any]:
        if stream is None:
            return self(batch), None
        with torch.cuda.stream(stream):
            decoded = self(batch)
            done = torch.cuda.Event()
            done.record(stream)
        return decoded, done

    def __call__(
        self, batch: tuple[PlannedBatch, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        planned, labels = batch
        out = torch.empty(  # channels-last, as the CPU path's batches
            (planned.samples, 3, self.size, self.size),
            dtype=torch.uint8,
            device=self.device,
            memory_format=torch.channels_last,
        )
        if len(planned.encoded_at):
            out[planned.encoded_at.to(self.device)] = self.finish(
                self.decode(planned), planned.plans
            )
        if len(planned.finished_at):
            finished = planned.finished.to(self.device, non_blocking=True)
            out[planned.finished_at.to(self.device, non_blocking=True)] = finished
        return out, labels

    def decode(self, planned: PlannedBatch) -> list[torch.Tensor]:
        """The batch's JPEGs decoded on the device, uint8 (3, H, W) each, in their order."""
        bounds = planned.offsets.tolist()
        datas = [planned.data[start:end] for start, end in pairwise(bounds)]
        if not datas:
            return []
        try:
            return list(decode_jpeg(datas, mode=ImageReadMode.RGB, device=self.device))
        except RuntimeError:
            pass  # one bad JPEG fails the whole call: decode each to name it
        images = []
        for data, key in zip(datas, planned.keys, strict=True):
            try:
                images.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device))
            except RuntimeError as exc:
                raise FieldDecodeError(
                    f"sample {key!r}: the JPEG does not decode on {self.device}: "
                    f"{stable_message(exc)}"
                ) from None
        return images

    def finish(self, images: list[torch.Tensor], plans: torch.Tensor) -> torch.Tensor:
        """Each decoded image cropped and resized as planned (in float, one image at a time:
        the sizes differ), then the whole batch flipped, rounded and made uint8 at once."""
        resized = torch.empty(
            (len(images), 3, self.size, self.size),
            dtype=torch.float32,
            device=self.device,
            memory_format=torch.channels_last,
        )
        for k, (image, plan) in enumerate(zip(images, plans.tolist(), strict=True)):
            top, left, height, width, _, resize_h, resize_w = plan
            if resize_h:  # eval: resize the whole image, then the centre window
                pixels = _resize(image.unsqueeze(0).float(), resize_h, resize_w)
                resized[k] = pixels[0, :, top : top + height, left : left + width]
            else:  # train: the box of the full image (cut before the float copy), resized
                box = image[:, top : top + height, left : left + width].unsqueeze(0).float()
                resized[k] = _resize(box, self.size)[0]
        flips = plans[:, 4].to(self.device, non_blocking=True).bool()[:, None, None, None]
        flipped = torch.where(flips, resized.flip(-1), resized)
        return flipped.round_().clamp_(0, 255).to(torch.uint8)


def _handed_over(decoded: tuple[torch.Tensor, torch.Tensor], done: Any) -> Any:
    """A batch decoded on a side stream, made safe on the caller's current stream."""
    if done is not None:
        images = decoded[0]
        current = torch.cuda.current_stream(images.device)
        current.wait_event(done)
        images.record_stream(current)  # its memory is not reused before the caller is done
    return decoded


def _resize(pixels: torch.Tensor, height: int, width: int | None = None) -> torch.Tensor:
    size = (height, width if width is not None else height)
    if tuple(pixels.shape[-2:]) == size:
        return pixels
    return nnf.interpolate(pixels, size=size, mode="bilinear", antialias=True, align_corners=False)
