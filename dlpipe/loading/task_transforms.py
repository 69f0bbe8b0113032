"""Joint transform recipes for detection and segmentation: torchvision's reference presets on
uint8 ``tv_tensors``, seeded per sample.

`TaskTransform` decodes a sample's image (`dlpipe.loading.transforms.decode_rgb`: one pixel
limit, libjpeg-turbo, Pillow for the rest), makes its target (`dlpipe.loading.targets`) and runs
the recipe's ``torchvision.transforms.v2`` ops on both, so boxes and masks move with every
pixel; no box geometry is written here. The recipes follow torchvision's
``references/detection/presets.py`` and ``references/segmentation/presets.py`` (their
``use_v2`` paths) step by step, except that the image stays uint8 (no ``ToDtype``, no
``Normalize``: the loader's batches are uint8 and are normalised on the device) and tensors
stay ``tv_tensors`` (no ``ToPureTensor``: targets keep ``BoundingBoxes`` and ``Mask``):

- detection ``hflip`` (also ``train``, torchvision's default policy): RandomHorizontalFlip;
  ``ssd``: RandomPhotometricDistort, RandomZoomOut (fill: the reference's mean, 0 for masks),
  RandomIoUCrop, RandomHorizontalFlip; ``ssdlite``: RandomIoUCrop, RandomHorizontalFlip; each
  then ConvertBoundingBoxFormat(XYXY) and SanitizeBoundingBoxes (labels and iscrowd dropped
  with their boxes). ``eval``: nothing. With an `image_size`, every detection recipe ends
  with a resize to `image_size` x `image_size` (SSD's fixed input), so a batch stacks; without
  one the images keep their sizes, as the references leave them for the model to resize.
- segmentation ``train``: RandomResize(0.5 x base, 2 x base), RandomHorizontalFlip,
  `PadIfSmaller` (image 0, mask the ignore value, 255 without one), RandomCrop(image_size);
  ``eval``: Resize((base, base)). ``base_size`` defaults to ``image_size`` x 520/480, the
  references' ratio. The train ops run as `segmentation_train` (below), byte for byte theirs.

**Seeded per sample.** v2 ops draw from torch's global generator, so each sample's ops run
with it seeded by (seed, epoch, sample index) (`TaskTransform.rng_seed`), saved and put back
around them, under a lock: the same sample at the same epoch gets the same pixels, boxes and
masks in any worker, process or thread, and the caller's random stream is untouched. The lock
makes the thread engine run the joint ops of its samples one at a time (the decode runs
outside it); DataLoader worker processes never wait on it.

**Reduced-size decode.** A detection ``hflip`` (``train``) or ``eval`` recipe with an
`image_size` resizes the whole image last; where that shrinks a YCbCr or greyscale JPEG by 2x
or more on both sides, the image is decoded at libjpeg's DCT scale 1/k (the largest k in 2, 4,
8 that divides both sides and keeps each at least `image_size`:
`dlpipe.loading.transforms.decode_jpeg_scaled`) and the resize does the rest. The target is
made at the original size (boxes checked and clamped there, ``canvas_size`` the original), and
every v2 op moves each ``tv_tensor`` by its own size, so the boxes and masks end scaled by the
true ratio of the final size to the original: exactly where the full decode puts them. With
k dividing both sides the scaled pixel (i, j) is the original k x k block at (i k, j k), so
the pixels sit on the same grid and differ from the full decode's only by how that block is
averaged (a few levels; `tests/test_task_transforms.py` states the bound). On 512 x 512
scenes (quality 90) resized to 256 or 128 px, one core: the decode with the target 0.9-0.95 ms
a sample instead of 1.25, the whole ``hflip`` sample 1.5 ms instead of 2.4 (the resize starts
from a quarter or a sixteenth of the pixels). The ``ssd`` and ``ssdlite`` recipes
resize after a crop drawn from the boxes, and segmentation's resize is drawn inside its op:
they decode the whole image.

**The segmentation train crop is drawn before the mask is resized** (`segmentation_train`):
RandomResize's size, the flip and RandomCrop's box depend only on the image's size, so after
the same draws from the same generator the image is resized whole by v2's own kernel, then
flipped and padded only inside the crop window, and the mask's window is gathered from the rows
and columns torch's nearest resize of the whole mask picks (taken from that kernel): the v2
ops' image and mask byte for byte, without resizing the whole mask or flipping the whole
resized image. On 512 px scenes (crop 480), one core: the ops 1.2 ms a sample instead of 1.9.
The image's resize stays whole: a region resized alone samples another grid (torch's resize
takes no sub-pixel offset), and Pillow's resize of the window's exact source box, within 2
levels of it, took twice as long as torch's resize of the whole image.

**Crop-aware decode** is not done here: the whole image is decoded (`TaskTransform.decode`),
and ``bench-loader``'s verdict says so (`dlpipe.loading.verdicts.crop_verdict`). The
segmentation train crop's source region is known before decoding, but its pixels are the
whole image's resize cut (above), and a region decoded alone and resized samples another
grid: not the same pixels. The detection ``ssdlite`` crop (RandomIoUCrop) is drawn inside
torchvision's op, from the boxes as well (drawing it before the decode is not done yet);
``ssd`` zooms out (pads) before it, and ``hflip`` and ``eval`` keep every pixel.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.nn.functional import interpolate
from torchvision import tv_tensors
from torchvision.transforms import v2

from dlpipe.codecs import check_image_pixels, max_image_pixels
from dlpipe.errors import FieldDecodeError
from dlpipe.loading.config import TASK_RECIPES
from dlpipe.loading.targets import TargetSpec
from dlpipe.loading.transforms import dct_factor, decode_jpeg_scaled, decode_rgb, image_field
from dlpipe.manifest import Manifest
from dlpipe.sample import KEY_FIELD, Sample

__all__ = [
    "DETECTION_MEAN",
    "RECIPES",
    "PadIfSmaller",
    "TaskTransform",
    "detection_ops",
    "make_task_transform",
    "segmentation_ops",
    "segmentation_train",
]

RECIPES = TASK_RECIPES
"""The recipes of each task (`dlpipe.loading.config.TASK_RECIPES`, where `LoaderConfig` checks a
name); detection's ``train`` is ``hflip`` (torchvision's default)."""
DETECTION_MEAN = (123, 117, 104)
"""The zoom-out fill of the ``ssd`` policy (the reference's mean, in uint8 levels)."""
_BASE_OVER_CROP = 520 / 480  # the segmentation references' base_size / crop_size
_RESIZED_WHOLE = ("hflip", "train", "eval")  # detection recipes whose one resize is the last op
_RNG_LOCK = threading.Lock()  # one seeded draw at a time on torch's default generator


def _fresh_rng_lock() -> None:
    """A forked child's own lock, free: no thread of the child holds the parent's."""
    global _RNG_LOCK
    _RNG_LOCK = threading.Lock()


# A fork waits for the seeded draw under way: a thread of the thread engine (one a closed
# loader let finish its last transform) inside it at the fork left the lock, and torch's
# generator, held in the child forever, and its DataLoader workers hung.
os.register_at_fork(
    before=lambda: _RNG_LOCK.acquire(),
    after_in_parent=lambda: _RNG_LOCK.release(),
    after_in_child=_fresh_rng_lock,
)

Op = Callable[[Any], Any]


class PadIfSmaller(v2.Transform):
    """Pad the bottom and right of an image (fill 0) and its mask (fill `mask_fill`) up to
    `size` on each side; a larger side is left as it is (the segmentation reference's
    ``v2_extras.PadIfSmaller``)."""

    def __init__(self, size: int, mask_fill: int = 255) -> None:
        super().__init__()
        self.size, self.mask_fill = size, mask_fill

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        height, width = v2.functional.get_size(
            next(i for i in flat_inputs if isinstance(i, tv_tensors.Image))
        )
        return {"padding": [0, 0, max(self.size - width, 0), max(self.size - height, 0)]}

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        if not any(params["padding"]):
            return inpt
        if isinstance(inpt, tv_tensors.Image) and inpt.dim() == 3:
            return _pad_image_in_its_order(inpt, params["padding"])
        fill = self.mask_fill if isinstance(inpt, tv_tensors.Mask) else 0
        return v2.functional.pad(inpt, padding=params["padding"], fill=fill)


def _pad_image_in_its_order(image: tv_tensors.Image, padding: list[int]) -> tv_tensors.Image:
    """`image` (C, H, W) padded with 0 at the right and bottom (`padding`: left, top, right,
    bottom), in the image's memory order: torch's pad makes a channels-last image contiguous
    (a transposing copy, 5 times the time), and a batch of both orders stacks slower."""
    channels, height, width = image.shape
    size = (height + padding[1] + padding[3], width + padding[0] + padding[2])
    if image.stride(0) == 1:  # channels-last, as decoded
        out = image.new_zeros((*size, channels)).permute(2, 0, 1)
    else:
        out = image.new_zeros((channels, *size))
    out[:, padding[1] : padding[1] + height, padding[0] : padding[0] + width] = image
    return tv_tensors.wrap(out.as_subclass(torch.Tensor), like=image)


def _labels_and_crowd(inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """What SanitizeBoundingBoxes drops with each removed box, beside the box and its mask."""
    target = inputs[1]
    return target["labels"], target["iscrowd"]


def detection_ops(policy: str, image_size: int | None = None) -> list[Op]:
    """The v2 ops of a detection recipe (`RECIPES`), on (image, target dict) pairs.

    Raises:
        ValueError: an unknown policy, naming the known ones.
    """
    flip = v2.RandomHorizontalFlip(p=0.5)
    policies: dict[str, list[Op]] = {
        "hflip": [flip],
        "ssd": [
            v2.RandomPhotometricDistort(),
            v2.RandomZoomOut(fill=defaultdict(lambda: DETECTION_MEAN, {tv_tensors.Mask: 0})),
            v2.RandomIoUCrop(),
            flip,
        ],
        "ssdlite": [v2.RandomIoUCrop(), flip],
        "eval": [],
    }
    policies["train"] = policies["hflip"]
    if policy not in policies:
        raise ValueError(
            f"detection recipe {policy!r} is not one of {', '.join(RECIPES['detection'])}"
        )
    ops = list(policies[policy])
    if image_size is not None:
        ops.append(v2.Resize((image_size, image_size)))
    if policy != "eval":
        ops += [
            v2.ConvertBoundingBoxFormat(tv_tensors.BoundingBoxFormat.XYXY),
            v2.SanitizeBoundingBoxes(labels_getter=_labels_and_crowd),
        ]
    return ops


def segmentation_ops(
    recipe: str, crop_size: int, base_size: int | None = None, mask_fill: int = 255
) -> list[Op]:
    """The v2 ops of a segmentation recipe (``train``/``eval``), on (image, Mask) pairs.

    Raises:
        ValueError: an unknown recipe.
    """
    base = round(crop_size * _BASE_OVER_CROP) if base_size is None else base_size
    if recipe == "train":
        return [
            v2.RandomResize(min_size=int(0.5 * base), max_size=int(2.0 * base)),
            v2.RandomHorizontalFlip(0.5),
            PadIfSmaller(crop_size, mask_fill),
            v2.RandomCrop(crop_size),
        ]
    if recipe == "eval":
        return [v2.Resize(size=(base, base))]
    raise ValueError(f"segmentation recipe {recipe!r} is not one of train, eval")


def segmentation_train(
    image: torch.Tensor, mask: torch.Tensor, ops: list[Op]
) -> tuple[tv_tensors.Image, tv_tensors.Mask]:
    """`segmentation_ops`' ``train`` `ops` on (image, mask), the crop drawn before the mask's
    resize: the same draws from torch's default generator in the same order (RandomResize's
    size, the flip, RandomCrop's top and left), the image resized whole by v2's own kernel
    (its pixels), then flipped, padded and cropped only inside the crop window; the mask
    resized only inside that window, from the rows and columns torch's nearest resize of the
    whole mask picks (`_nearest_indices`): byte for byte the ops' outputs (a test holds them
    equal), without a resized whole mask, a flipped whole image or v2's per-call dispatch."""
    resize, _, pad, crop = ops
    assert isinstance(resize, v2.RandomResize) and isinstance(pad, PadIfSmaller)
    assert isinstance(crop, v2.RandomCrop)
    size = int(torch.randint(resize.min_size, resize.max_size, ()))
    flip = not bool(torch.rand(1) >= 0.5)  # v2.RandomHorizontalFlip(0.5)'s draw
    resized = v2.functional.resize_image(image.as_subclass(torch.Tensor), [size], antialias=True)
    height, width = resized.shape[-2:]
    side = crop.size[0]  # square: RandomCrop(crop_size)
    top = int(torch.randint(0, height - side + 1, ())) if height > side else 0
    left = int(torch.randint(0, width - side + 1, ())) if width > side else 0
    rows = slice(top, min(top + side, height))  # the window inside the flipped image
    cols = slice(left, min(left + side, width))
    if flip:  # the flipped image's columns [left, right) are the image's [width - right, ...)
        cols = slice(width - cols.stop, width - cols.start)
    out_image = _window(resized[:, rows, cols], side, 0, flip)
    values = mask.as_subclass(torch.Tensor).numpy()  # numpy's take: 2.5x torch's index_select
    values = values.take(_nearest_indices(mask.shape[0], height)[rows], axis=0)
    values = values.take(_nearest_indices(mask.shape[1], width)[cols], axis=1)
    out_mask = _window(torch.from_numpy(values), side, pad.mask_fill, flip)
    return tv_tensors.Image(out_image), tv_tensors.Mask(out_mask)


def _window(part: torch.Tensor, side: int, fill: int, flip: bool) -> torch.Tensor:
    """`part` ((C,) h, w), flipped left-right if `flip`, at the top left of a `side` x `side`
    window filled with `fill` (PadIfSmaller's bottom and right); an image stays in its memory
    order (channels-last as decoded: see `_pad_image_in_its_order`)."""
    part = part.flip(-1) if flip else part
    if part.shape[-2:] == (side, side):
        return part
    if part.dim() == 3 and part.stride(0) == 1:
        out = part.new_full((side, side, part.shape[0]), fill).permute(2, 0, 1)
    else:
        out = part.new_full((*part.shape[:-2], side, side), fill)
    out[..., : part.shape[-2], : part.shape[-1]] = part
    return out


def _nearest_indices(size: int, resized: int) -> np.ndarray:
    """The source index of each of `resized` positions in torch's nearest resize of `size`
    ones (v2's mask resize), taken from that kernel itself on the positions' own indices."""
    positions = torch.arange(size, dtype=torch.float32).view(1, 1, size)
    return interpolate(positions, size=resized, mode="nearest")[0, 0].long().numpy()


class TaskTransform:
    """A detection or segmentation sample → (uint8 image (3, H, W), target), picklable for
    DataLoader workers.

    Args:
        spec: what the dataset's annotation fields are (`TargetSpec.from_manifest`); its task
            picks the recipes.
        recipe: one of ``RECIPES[spec.task]``.
        image_size: segmentation: the train crop's side (eval resizes to `base_size`);
            detection: the side every image is resized to last, or None to keep sizes.
        field: the sample's image field.
        seed: the augmentation seed (with the epoch and the sample index).
        base_size: segmentation's base size (default ``image_size`` x 520/480).

    Raises:
        ValueError: a task without recipes here, or a recipe the task does not have.
    """

    seeded_by_position = True  # takes (epoch, index): see `dlpipe.loading.views.apply_transform`

    def __init__(
        self,
        spec: TargetSpec,
        recipe: str,
        image_size: int | None,
        field: str,
        seed: int = 0,
        *,
        base_size: int | None = None,
    ) -> None:
        if spec.task not in RECIPES:
            raise ValueError(f"task {spec.task!r} has no joint transform recipes here")
        if recipe not in RECIPES[spec.task]:
            raise ValueError(
                f"{spec.task} recipe {recipe!r} is not one of {', '.join(RECIPES[spec.task])}"
            )
        if spec.task == "segmentation" and image_size is None:
            raise ValueError("segmentation needs an image_size: the train crop's side")
        self.spec, self.recipe, self.image_size, self.field = spec, recipe, image_size, field
        self.seed, self.base_size = seed, base_size
        self.max_pixels = max_image_pixels()  # carried into spawned workers with the transform
        self._ops: list[Op] | None = None

    def ops(self) -> list[Op]:
        """The recipe's v2 ops (made once per process)."""
        if self._ops is None:
            if self.spec.task == "detection":
                self._ops = detection_ops(self.recipe, self.image_size)
            else:
                fill = 255 if self.spec.ignore is None else self.spec.ignore
                assert self.image_size is not None  # checked in __init__
                self._ops = segmentation_ops(self.recipe, self.image_size, self.base_size, fill)
        return self._ops

    def rng_seed(self, epoch: int, index: int) -> int:
        """The seed of torch's generator while sample `index`'s ops run in `epoch`."""
        key = np.random.SeedSequence([self.seed, epoch, index]).generate_state(2, np.uint64)
        return int(key[0] >> np.uint64(1))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ops": None}

    def __call__(self, sample: Sample, epoch: int = 0, index: int = 0) -> tuple[torch.Tensor, Any]:
        """The transformed (image, target) of `sample`, the `index`-th of its split.

        Raises:
            FieldDecodeError: the image does not decode (naming the sample and field).
            TargetError: the annotation makes no valid target (`dlpipe.loading.targets`).
        """
        image, target = self.apply(*self.decode(sample, index), self.rng_seed(epoch, index))
        return image.as_subclass(torch.Tensor), target

    def decode(self, sample: Sample, index: int = 0) -> tuple[tv_tensors.Image, Any]:
        """The sample's whole image (at DCT scale 1/`decode_factor` where the recipe's resize
        allows it) and its target at the image's original size, before the recipe's ops.

        Raises:
            FieldDecodeError, TargetError: as `__call__`.
        """
        data = bytes(sample[self.field])  # type: ignore[arg-type]
        try:
            image, size = self._decoded(data)
        except FieldDecodeError as exc:
            key = sample.get(KEY_FIELD, "?")
            raise type(exc)(f"sample {key!r} field {self.field!r}: {exc}") from None
        return tv_tensors.Image(image), self.spec.target(sample, size, index)

    def _decoded(self, data: bytes) -> tuple[torch.Tensor, tuple[int, int]]:
        """(the image, DCT-scaled where `decode_factor` says so, its original (height, width))."""
        if self.scales_decode:
            width, height = check_image_pixels(data, self.max_pixels)
            factor = self.decode_factor(width, height)
            scaled = decode_jpeg_scaled(data, factor) if factor > 1 else None
            if scaled is not None:  # else not such a JPEG: the whole decode names any error
                return scaled, (height, width)
        image = decode_rgb(data, self.max_pixels)
        return image, (image.shape[-2], image.shape[-1])

    @property
    def scales_decode(self) -> bool:
        """Whether the recipe resizes the whole image last (detection ``hflip``/``train``,
        ``eval``, with an `image_size`), so its JPEGs may decode at a DCT scale."""
        return bool(
            self.spec.task == "detection" and self.image_size and self.recipe in _RESIZED_WHOLE
        )

    def decode_factor(self, width: int, height: int) -> int:
        """The DCT scale divisor k a `width` x `height` image is decoded at before the
        recipe's last resize: the largest that keeps both sides at least `image_size`
        (`dct_factor`) and divides both (the scaled pixels then lie on the original's grid);
        1 where the recipe does not resize the whole image last (`scales_decode`)."""
        if not self.scales_decode or self.image_size is None:
            return 1
        factor = dct_factor(width, height, self.image_size)
        while width % factor or height % factor:
            factor //= 2
        return factor

    def apply(self, image: tv_tensors.Image, target: Any, rng_seed: int) -> tuple[Any, Any]:
        """The recipe's ops on (image, target), torch's generator seeded with `rng_seed`."""
        pair = (image, target)
        generator = torch.default_generator  # v2 ops draw from it, and from no device's
        with _RNG_LOCK:
            caller_state = generator.get_state()
            try:
                # not torch.manual_seed: it seeds every device's generator too (on a machine
                # without CUDA set up, formatting a stack each time: 0.2-0.6 ms a sample)
                generator.manual_seed(rng_seed)
                if self.spec.task == "segmentation" and self.recipe == "train":
                    pair = segmentation_train(image, target, self.ops())
                else:
                    for op in self.ops():
                        pair = op(pair)
            finally:
                generator.set_state(caller_state)
        return pair

    def __repr__(self) -> str:
        return f"TaskTransform({self.spec.task!r}, {self.recipe!r}, image_size={self.image_size})"


def make_task_transform(
    manifest: Manifest,
    recipe: str,
    image_size: int | None,
    seed: int = 0,
    *,
    task: str | None = None,
    base_size: int | None = None,
) -> TaskTransform:
    """The `TaskTransform` of a dataset: its task (or `task`), annotation fields and image
    field read from `manifest`.

    Raises:
        ValueError: as `TargetSpec.from_manifest` and `TaskTransform`.
    """
    spec = TargetSpec.from_manifest(manifest, task)
    field = image_field(list(manifest.fields))
    return TaskTransform(spec, recipe, image_size, field, seed, base_size=base_size)
