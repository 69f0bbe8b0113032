"""Sample → (uint8 CHW image tensor, label): decode and crop on uint8, float only on the device.

JPEG, PNG and WebP decode through ``torchvision.io.decode_image`` (libjpeg-turbo) straight to
RGB tensors; anything it refuses (CMYK, odd PNG modes) falls back to Pillow, so every image
kind gives the same result type. The ``train`` recipe is RandomResizedCrop + horizontal flip,
``eval`` is resize to ``image_size / 0.875`` + centre crop (torchvision's reference recipes),
both torchvision.transforms.v2 on uint8 tensors. Augmentation randomness is seeded per
(seed, epoch, sample index), so a resumed or re-sharded run augments every sample the same way.
Every decode is preceded by the pixel limit's header check (`dlpipe.codecs.check_image_pixels`):
an image over it is an `ImageTooLargeError`, before any decoder allocates for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2

from dlpipe.codecs import (
    IMAGE_EXTENSIONS,
    check_image_pixels,
    max_image_pixels,
    open_image,
    stable_message,
)
from dlpipe.errors import FieldDecodeError
from dlpipe.sample import KEY_FIELD, Sample

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImageTransform",
    "decode_rgb",
    "image_field",
    "normalize",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def decode_rgb(data: bytes, max_pixels: int | None = None) -> torch.Tensor:
    """Encoded image bytes → uint8 tensor (3, H, W).

    Args:
        data: the encoded image.
        max_pixels: the pixel limit (default `dlpipe.codecs.max_image_pixels()`).

    Raises:
        ImageTooLargeError: the header gives more pixels than the limit.
        FieldDecodeError: no decoder here can read the bytes.
    """
    limit = max_image_pixels() if max_pixels is None else max_pixels
    check_image_pixels(data, limit)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    try:
        return decode_image(raw, mode=ImageReadMode.RGB)
    except RuntimeError:  # a kind libjpeg/libpng here refuses: Pillow decodes everything else
        pass
    try:
        with open_image(data, limit) as image:
            array = np.asarray(image.convert("RGB"))
    except FieldDecodeError:
        raise
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ...
        raise FieldDecodeError(
            f"image ({len(data)} bytes) does not decode: {stable_message(exc)}"
        ) from None
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def image_field(fields: list[str] | tuple[str, ...]) -> str:
    """The dataset's image field (the first whose extension is an image type)."""
    for name in fields:
        if name.rsplit(".", 1)[-1] in IMAGE_EXTENSIONS:
            return name
    raise ValueError(f"the dataset has no image field (fields: {', '.join(fields)})")


class ImageTransform:
    """Picklable per-sample transform for DataLoader workers (fork or spawn)."""

    def __init__(
        self, recipe: str, image_size: int, field: str, seed: int = 0, min_scale: float = 0.08
    ) -> None:
        if recipe not in ("train", "eval"):
            raise ValueError(f"transform {recipe!r} must be 'train', 'eval', None or a callable")
        if not 0 < min_scale <= 1:
            raise ValueError(f"min_scale {min_scale} must be in (0, 1]: the smallest crop's area")
        self.recipe, self.image_size, self.field, self.seed = recipe, image_size, field, seed
        self.min_scale = min_scale
        self.max_pixels = max_image_pixels()  # carried into spawned workers with the transform
        self._ops: Callable[[torch.Tensor], torch.Tensor] | None = None

    def ops(self) -> Callable[[torch.Tensor], torch.Tensor]:
        if self._ops is None:
            size = self.image_size
            if self.recipe == "train":
                steps: list[Any] = [
                    v2.RandomResizedCrop(size, scale=(self.min_scale, 1.0), antialias=True),
                    v2.RandomHorizontalFlip(),
                ]
            else:
                steps = [v2.Resize(round(size / 0.875), antialias=True), v2.CenterCrop(size)]
            self._ops = v2.Compose(steps)
        return self._ops

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ops": None}

    def __call__(self, sample: Sample, epoch: int = 0, index: int = 0) -> tuple[torch.Tensor, int]:
        try:
            image = decode_rgb(bytes(sample[self.field]), self.max_pixels)  # type: ignore[arg-type]
        except FieldDecodeError as exc:  # name the sample: the error surfaces far from here
            key = sample.get(KEY_FIELD, "?")
            raise type(exc)(f"sample {key!r} field {self.field!r}: {exc}") from None
        label = int(bytes(sample["cls"])) if "cls" in sample else -1  # type: ignore[arg-type]
        if self.recipe == "train":
            with torch.random.fork_rng(devices=[]):
                key = np.random.SeedSequence([self.seed, epoch, index]).generate_state(1)[0]
                # the CPU generator only: torch.manual_seed also queues CUDA/XPU/MTIA seeding,
                # formatting a stack trace each time (a third of the loader's time)
                torch.default_generator.manual_seed(int(key))
                return self.ops()(image), label
        return self.ops()(image), label

    def __repr__(self) -> str:
        return f"ImageTransform({self.recipe!r}, image_size={self.image_size})"


def normalize(
    images: torch.Tensor,
    device: torch.device | str | None = None,
    mean: tuple[float, ...] = IMAGENET_MEAN,
    std: tuple[float, ...] = IMAGENET_STD,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """uint8 NCHW batch → normalised float on `device` (the copy stays uint8: 4x less traffic).

    Pass a batch from pinned memory to make the copy asynchronous.
    """
    images = images.to(device, non_blocking=True) if device is not None else images
    scale = torch.tensor(std, device=images.device, dtype=dtype).view(1, -1, 1, 1) * 255
    shift = torch.tensor(mean, device=images.device, dtype=dtype).view(1, -1, 1, 1) * 255
    return (images.to(dtype) - shift) / scale
