"""The joint transform recipes are torchvision's reference presets on uint8, seeded per sample:
the same seeds give the reference's pixels, boxes and masks; boxes and masks move with the
pixels; a sample is transformed the same in any process or thread; batches collate in
torchvision's conventions."""

from __future__ import annotations

import io
import multiprocessing
import pickle
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.nn.functional import max_pool2d
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import _utils as v2_utils

from dlpipe import rle
from dlpipe.annotations import encode_boxes, encode_masks
from dlpipe.errors import FieldDecodeError
from dlpipe.loading.targets import INLINE_BYTES, TargetBatch, TargetSpec
from dlpipe.loading.task_collate import (
    BatchShapeError,
    collate_detection,
    collate_segmentation,
    task_collate,
)
from dlpipe.loading.task_transforms import PadIfSmaller, TaskTransform, segmentation_ops
from dlpipe.loading.transforms import decode_rgb

HEIGHT, WIDTH = 90, 120
BOXES = [(10, 12, 50, 60), (70, 30, 110, 80)]  # object 0 red, object 1 green
DETECTION = TargetSpec("detection", 3, "boxes.json", instance_masks=True)
SEGMENTATION = TargetSpec("segmentation", 3, "seg.png", mask_values=frozenset({0, 1, 2, 255}),
                          ignore=255)  # fmt: skip


def png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return buffer.getvalue()


def box_mask(box: tuple[int, ...]) -> np.ndarray:
    mask = np.zeros((HEIGHT, WIDTH), np.uint8)
    mask[box[1] : box[3], box[0] : box[2]] = 1
    return mask


def detection_sample(key: str = "s0") -> dict[str, Any]:
    """Black image, object 0 a filled red box, object 1 a filled green box, with their masks."""
    pixels = np.zeros((HEIGHT, WIDTH, 3), np.uint8)
    for channel, box in enumerate(BOXES):
        pixels[box[1] : box[3], box[0] : box[2], channel] = 255
    masks = [rle.encode(box_mask(box)) for box in BOXES]
    return {"__key__": key, "png": png(pixels), "boxes.json": encode_boxes(BOXES, [0, 1]),
            "masks.json": encode_masks((HEIGHT, WIDTH), masks)}  # fmt: skip


def segmentation_sample(key: str = "g0") -> dict[str, Any]:
    """Image channel 0 = 100 x the label map's class, the map with a void row."""
    values = np.zeros((HEIGHT, WIDTH), np.uint8)
    values[10:50, 20:70], values[60:, 80:] = 1, 2
    values[5, :] = 255
    pixels = np.zeros((HEIGHT, WIDTH, 3), np.uint8)
    pixels[..., 0] = np.where(values == 255, 0, values * 100)
    return {"__key__": key, "png": png(pixels), "seg.png": png(values)}


# --- torchvision's references, transcribed from their v2 paths (uint8: no ToDtype, no
# Normalize, no ToPureTensor) ------------------------------------------------------------------


class ReferencePadIfSmaller(v2.Transform):
    """references/segmentation/v2_extras.py's PadIfSmaller."""

    def __init__(self, size: int, fill: Any = 0) -> None:
        super().__init__()
        self.size = size
        self.fill = v2_utils._setup_fill_arg(fill)

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        _, height, width = v2_utils.query_chw(flat_inputs)
        padding = [0, 0, max(self.size - width, 0), max(self.size - height, 0)]
        return dict(padding=padding, needs_padding=any(padding))

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        if not params["needs_padding"]:
            return inpt
        fill = v2_utils._convert_fill_arg(v2_utils._get_fill(self.fill, type(inpt)))
        return v2.functional.pad(inpt, padding=params["padding"], fill=fill)


def reference_detection(policy: str) -> v2.Compose:
    """references/detection/presets.py DetectionPresetTrain(use_v2=True, backend tv_tensor)."""
    mean = (123.0, 117.0, 104.0)
    policies = {
        "hflip": [v2.RandomHorizontalFlip(p=0.5)],
        "ssd": [v2.RandomPhotometricDistort(),
                v2.RandomZoomOut(fill=defaultdict(lambda: mean, {tv_tensors.Mask: 0})),
                v2.RandomIoUCrop(), v2.RandomHorizontalFlip(p=0.5)],
        "ssdlite": [v2.RandomIoUCrop(), v2.RandomHorizontalFlip(p=0.5)],
    }  # fmt: skip
    tail = [v2.ConvertBoundingBoxFormat(tv_tensors.BoundingBoxFormat.XYXY),
            v2.SanitizeBoundingBoxes()]  # fmt: skip
    return v2.Compose(policies[policy] + tail)


def reference_segmentation(recipe: str, base_size: int, crop_size: int) -> v2.Compose:
    """references/segmentation/presets.py SegmentationPreset{Train,Eval}(use_v2=True)."""
    if recipe == "eval":
        return v2.Compose([v2.Resize(size=(base_size, base_size))])
    return v2.Compose([
        v2.RandomResize(min_size=int(0.5 * base_size), max_size=int(2.0 * base_size)),
        v2.RandomHorizontalFlip(0.5),
        ReferencePadIfSmaller(crop_size, fill={tv_tensors.Mask: 255, "others": 0}),
        v2.RandomCrop(crop_size),
    ])  # fmt: skip


def run_reference(reference: v2.Compose, spec: TargetSpec, sample: dict, seed: int) -> Any:
    image = decode_rgb(sample["png"])
    target = spec.target(sample, (HEIGHT, WIDTH), 0)
    torch.manual_seed(seed)
    return reference(tv_tensors.Image(image), target)


def assert_same_detection(ours: tuple, theirs: tuple) -> None:
    assert torch.equal(ours[0], theirs[0].as_subclass(torch.Tensor))
    for name in ("boxes", "labels", "masks"):
        assert torch.equal(ours[1][name], theirs[1][name]), name
    assert len(ours[1]["iscrowd"]) == len(ours[1]["labels"])  # dropped with its box


@pytest.mark.parametrize("policy", ["hflip", "ssd", "ssdlite"])
def test_detection_recipes_are_torchvision_s_on_the_same_seeds(policy: str) -> None:
    ours = TaskTransform(DETECTION, policy, None, "png", seed=3)
    sample = detection_sample()
    seen = set()
    for index in range(12):
        out = ours(sample, epoch=1, index=index)
        reference = run_reference(reference_detection(policy), DETECTION, sample,
                                  ours.rng_seed(1, index))  # fmt: skip
        assert_same_detection(out, reference)
        seen.add(tuple(out[1]["boxes"].flatten().tolist()))
    assert len(seen) > 1  # the seeds draw different augmentations


@pytest.mark.parametrize("recipe", ["train", "eval"])
def test_segmentation_recipes_are_torchvision_s_on_the_same_seeds(recipe: str) -> None:
    ours = TaskTransform(SEGMENTATION, recipe, 64, "png", seed=5, base_size=80)
    sample = segmentation_sample()
    for index in range(8):
        image, mask = ours(sample, epoch=0, index=index)
        ref_image, ref_mask = run_reference(
            reference_segmentation(recipe, 80, 64), SEGMENTATION, sample, ours.rng_seed(0, index)
        )
        assert torch.equal(image, ref_image.as_subclass(torch.Tensor))
        assert torch.equal(mask, ref_mask) and isinstance(mask, tv_tensors.Mask)
        assert image.dtype == torch.uint8 and mask.dtype == torch.uint8


@pytest.mark.parametrize("shape", [(90, 120), (121, 77), (64, 64)])
def test_the_segmentation_train_crop_is_torchvision_s_byte_for_byte(shape) -> None:
    """The train recipe resizes only the crop window's mask and flips only the window's
    pixels: over seeds that pad, crop, flip and upscale, on a mask whose every value differs
    from its neighbours' (a wrong source row or column shows), the image and mask are the
    reference's exactly, the padding the ignore value."""
    noise = torch.Generator().manual_seed(shape[0])
    image = tv_tensors.Image(torch.randint(0, 256, (*shape, 3), dtype=torch.uint8,
                                           generator=noise).permute(2, 0, 1))  # fmt: skip
    mask = tv_tensors.Mask(torch.randint(0, 255, shape, dtype=torch.uint8, generator=noise))
    ours = TaskTransform(SEGMENTATION, "train", 64, "png", seed=1, base_size=80)
    padded = 0
    for index in range(40):
        seed = ours.rng_seed(0, index)
        out_image, out_mask = ours.apply(image, mask, seed)
        torch.manual_seed(seed)
        ref_image, ref_mask = reference_segmentation("train", 80, 64)(image, mask)
        assert torch.equal(out_image, ref_image) and torch.equal(out_mask, ref_mask)
        assert isinstance(out_mask, tv_tensors.Mask) and out_image.shape == (3, 64, 64)
        padded += bool((out_mask == 255).any())
    assert 0 < padded < 40  # resized smaller than the crop (padded) and larger


def bounds(pixels: torch.Tensor) -> list[float]:
    rows = torch.nonzero(pixels.any(1)).flatten()
    cols = torch.nonzero(pixels.any(0)).flatten()
    return [float(cols[0]), float(rows[0]), float(cols[-1] + 1), float(rows[-1] + 1)]


@pytest.mark.parametrize("policy", ["hflip", "ssdlite", "eval"])
def test_boxes_and_masks_move_with_the_pixels(policy: str) -> None:
    transform = TaskTransform(DETECTION, policy, None, "png", seed=0)
    for index in range(10):
        image, target = transform(detection_sample(), epoch=0, index=index)
        assert image.dtype == torch.uint8 and image.shape[0] == 3
        for box, label, mask in zip(target["boxes"], target["labels"], target["masks"],
                                    strict=True):  # fmt: skip
            lit = image[int(label)] > 128  # the object's own channel
            assert bounds(lit) == box.tolist() == bounds(mask.bool())
            assert torch.equal(lit, mask.bool())


def jpeg_sample() -> dict[str, Any]:
    """`detection_sample` with its image as a quality-95 JPEG too (``jpg``)."""
    sample = detection_sample()
    buffer = io.BytesIO()
    Image.open(io.BytesIO(sample["png"])).convert("RGB").save(buffer, "JPEG", quality=95)
    return {**sample, "jpg": buffer.getvalue()}


@pytest.mark.parametrize("policy", ["hflip", "eval"])
def test_a_detection_resize_by_2x_decodes_at_half_size_and_keeps_the_geometry(
    policy: str,
) -> None:
    """A 120 x 90 JPEG resized to 40 x 40 is decoded at DCT scale 1/2 (60 x 45); the boxes and
    masks are torchvision's on the full decode exactly (scaled by the true ratio of the final
    size to the original), the pixels within 2 levels on average: libjpeg's scaled decode
    averages each 2 x 2 block before the resize where the full path's antialiased resize
    weighs its neighbours, which differs by up to a few tens of levels on the boxes' hard
    edges and by nothing on flat colour."""
    sample = jpeg_sample()
    reduced = TaskTransform(DETECTION, policy, 40, "jpg", seed=3)
    assert reduced.decode_factor(WIDTH, HEIGHT) == 2
    assert reduced.decode(sample)[0].shape == (3, HEIGHT // 2, WIDTH // 2)
    reference = v2.Compose([*reference_detection("hflip").transforms[:1], v2.Resize((40, 40)),
                            *reference_detection("hflip").transforms[1:]])  # fmt: skip
    for index in range(4):
        image, target = reduced(sample, epoch=0, index=index)
        full = decode_rgb(sample["jpg"])
        torch.manual_seed(reduced.rng_seed(0, index))
        wanted = (v2.Resize((40, 40)) if policy == "eval" else reference)(
            tv_tensors.Image(full), DETECTION.target(sample, (HEIGHT, WIDTH), 0)
        )
        for name in ("boxes", "labels", "masks"):
            assert torch.equal(target[name], wanted[1][name]), name
        assert tuple(target["boxes"].canvas_size) == (40, 40)
        difference = (image.int() - wanted[0].as_subclass(torch.Tensor).int()).abs()
        assert image.shape == (3, 40, 40) and difference.float().mean() <= 2


def test_the_decode_scale_keeps_the_resize_s_size_and_divides_the_image() -> None:
    def factor(policy: str, size: int | None, width: int, height: int) -> int:
        return TaskTransform(DETECTION, policy, size, "jpg").decode_factor(width, height)

    assert factor("hflip", 64, 512, 512) == 8 and factor("eval", 100, 640, 480) == 4
    assert factor("hflip", 256, 512, 512) == 2 and factor("hflip", 300, 512, 512) == 1
    assert factor("hflip", 100, 640, 427) == 1  # 427 rows: no scaled grid on the original's
    png = TaskTransform(DETECTION, "hflip", 40, "png")  # not a JPEG: decoded whole
    assert png.decode(detection_sample())[0].shape == (3, HEIGHT, WIDTH)
    assert factor("ssd", 40, WIDTH, HEIGHT) == factor("hflip", None, WIDTH, HEIGHT) == 1
    ssd = TaskTransform(DETECTION, "ssd", 40, "jpg")  # its resize follows a crop
    assert ssd.decode(jpeg_sample())[0].shape == (3, HEIGHT, WIDTH)


def test_a_resized_detection_batch_stacks_and_its_boxes_bound_the_pixels() -> None:
    transform = TaskTransform(DETECTION, "ssd", 64, "png", seed=0)
    pairs = [transform(detection_sample(), 0, index) for index in range(6)]
    images, targets = collate_detection(pairs)
    assert isinstance(images, torch.Tensor) and images.shape == (6, 3, 64, 64)
    assert images.dtype == torch.uint8 and len(targets) == 6
    for target in targets:
        for box, mask in zip(target["boxes"], target["masks"], strict=True):
            assert np.allclose(bounds(mask.bool()), box.tolist(), atol=1.0)


def test_detection_images_of_several_sizes_collate_as_a_list() -> None:
    transform = TaskTransform(DETECTION, "ssdlite", None, "png", seed=0)
    pairs = [transform(detection_sample(), 0, index) for index in range(8)]
    images, targets = collate_detection(pairs)
    assert isinstance(images, list) and len(images) == len(targets) == 8
    assert len({tuple(image.shape) for image in images}) > 1


def test_segmentation_collates_to_uint8_images_and_uint8_masks() -> None:
    transform = TaskTransform(SEGMENTATION, "train", 48, "png", seed=0)
    images, masks = task_collate("segmentation")([transform(segmentation_sample(), 0, i)
                                                  for i in range(4)])  # fmt: skip
    assert images.shape == (4, 3, 48, 48) and images.dtype == torch.uint8
    assert masks.shape == (4, 48, 48) and masks.dtype == torch.uint8  # .long() on the device
    assert set(masks.unique().tolist()) <= {0, 1, 2, 255}
    # the class of a labelled pixel is where its pixel moved (channel 0 = 100 x class), away
    # from the edges the image's resize blurs
    values = masks[:, None].float()
    uniform = (max_pool2d(values, 7, 1, 3) == -max_pool2d(-values, 7, 1, 3))[:, 0]
    inside = uniform & (masks != 255)
    assert inside.sum() > 1000
    assert (images[:, 0][inside].long() - masks[inside].long() * 100).abs().max() <= 2
    with pytest.raises(BatchShapeError, match="one batch needs one size"):
        collate_segmentation([(torch.zeros(3, 4, 4), torch.zeros(4, 4)),
                              (torch.zeros(3, 5, 4), torch.zeros(5, 4))])  # fmt: skip


def test_a_segmentation_batch_with_a_mask_past_255_is_int64() -> None:
    image = torch.zeros(3, 4, 4, dtype=torch.uint8)
    small, large = torch.full((4, 4), 3, dtype=torch.uint8), torch.full((4, 4), 300)
    _, masks = collate_segmentation([(image, small), (image, large)])
    assert masks.dtype == torch.int64 and masks[:, 0, 0].tolist() == [3, 300]
    _, masks = collate_segmentation([(image, small), (image, small)])
    assert masks.dtype == torch.uint8 and masks[:, 0, 0].tolist() == [3, 3]


@pytest.mark.parametrize("channels_last", [True, False])
def test_the_pad_gives_torchvision_s_pixels_in_the_image_s_memory_order(channels_last) -> None:
    pixels = torch.randint(1, 255, (10, 12, 3), dtype=torch.uint8, generator=torch.Generator())
    image = tv_tensors.Image(
        pixels.permute(2, 0, 1) if channels_last else pixels.movedim(2, 0).contiguous()
    )
    padded = PadIfSmaller(32)(image)
    assert torch.equal(padded, v2.functional.pad(image, padding=[0, 0, 20, 22], fill=0))
    assert isinstance(padded, tv_tensors.Image)
    assert (padded.stride(0) == 1) == channels_last  # a batch of decoded images stacks as is


def test_the_crop_pads_a_small_image_with_0_and_its_mask_with_the_ignore_value() -> None:
    image = tv_tensors.Image(torch.full((3, 10, 12), 7, dtype=torch.uint8))
    mask = tv_tensors.Mask(torch.ones(10, 12, dtype=torch.uint8))
    pad, crop = segmentation_ops("train", 32, base_size=20, mask_fill=254)[2:]
    padded_image, padded_mask = pad((image, mask))
    assert padded_image.shape == (3, 32, 32) and padded_mask.shape == (32, 32)
    assert padded_image[:, 10:].eq(0).all() and padded_image[:, :, 12:].eq(0).all()
    assert padded_mask[10:].eq(254).all() and padded_mask[:10, :12].eq(1).all()
    assert crop((padded_image, padded_mask))[0].shape == (3, 32, 32)


def snapshot(pair: tuple[torch.Tensor, dict[str, Any]]) -> tuple:
    image, target = pair
    return (image.numpy().tobytes(), target["boxes"].tolist(), target["labels"].tolist(),
            target["iscrowd"].tolist(), target["masks"].numpy().tobytes())  # fmt: skip


def outputs(transform: TaskTransform, indices: range, epoch: int = 2) -> list[tuple]:
    return [snapshot(transform(detection_sample(f"s{i}"), epoch, i)) for i in indices]


def test_a_sample_is_transformed_the_same_in_any_process_or_thread() -> None:
    transform = TaskTransform(DETECTION, "ssd", 48, "png", seed=11)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    here = outputs(transform, range(6))
    assert torch.equal(torch.get_rng_state(), before)  # the caller's random stream is untouched
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda i: outputs(transform, range(i, i + 1))[0], range(6)))
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        spawned = pool.apply(outputs, (pickle.loads(pickle.dumps(transform)), range(6)))
    assert here == threaded == spawned
    assert outputs(transform, range(6)) == here
    assert outputs(transform, range(6), epoch=3) != here  # another epoch, other draws


def test_an_op_that_fails_leaves_the_caller_s_random_stream_untouched() -> None:
    transform = TaskTransform(DETECTION, "hflip", None, "png", seed=11)
    image = tv_tensors.Image(torch.zeros(3, 8, 8, dtype=torch.uint8))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with pytest.raises(TypeError):  # no target dict: SanitizeBoundingBoxes finds no labels
        transform.apply(image, None, transform.rng_seed(0, 0))
    assert torch.equal(torch.get_rng_state(), before)


def test_an_image_that_does_not_decode_and_a_bad_recipe_are_named() -> None:
    transform = TaskTransform(DETECTION, "eval", None, "png")
    with pytest.raises(FieldDecodeError, match="sample 'bad' field 'png': "):
        transform({**detection_sample("bad"), "png": b"not an image"})
    with pytest.raises(ValueError, match="detection recipe 'mosaic' is not one of train, hflip"):
        TaskTransform(DETECTION, "mosaic", None, "png")
    with pytest.raises(ValueError, match="segmentation needs an image_size"):
        TaskTransform(SEGMENTATION, "train", None, "png")


class Samples(torch.utils.data.Dataset):
    def __init__(self, transform: TaskTransform) -> None:
        self.transform = transform

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> Any:
        return self.transform(detection_sample(f"s{index}"), 0, index)


def test_batches_cross_worker_processes_with_their_tv_tensors() -> None:
    transform = TaskTransform(DETECTION, "ssdlite", 40, "png", seed=2)
    loader = torch.utils.data.DataLoader(
        Samples(transform), batch_size=4, num_workers=2, collate_fn=collate_detection
    )
    batches = list(loader)
    pairs = [transform(detection_sample(f"s{i}"), 0, i) for i in range(8)]
    assert [snapshot(p) for p in pairs] == [
        snapshot((images[i], targets[i])) for images, targets in batches for i in range(4)
    ]
    boxes = batches[0][1][0]["boxes"]
    assert isinstance(boxes, tv_tensors.BoundingBoxes) and tuple(boxes.canvas_size) == (40, 40)
    assert isinstance(batches[0][1][0]["masks"], tv_tensors.Mask)
    assert all(type(targets) is list for _, targets in batches)  # unpacked as it arrived


def test_a_worker_s_targets_travel_as_one_column_a_key_and_arrive_as_they_left() -> None:
    """Small columns travel inside the pickle (no shared-memory segment, whose hand-over costs
    a connection to the worker a tensor); masks past `INLINE_BYTES` as one tensor; the
    unpickled list has each value's type, metadata and values, a key's tensors one storage."""
    transform = TaskTransform(DETECTION, "hflip", None, "png", seed=2)
    targets = [transform(detection_sample(f"s{i}"), 0, i)[1] for i in range(4)]
    small = [{k: v for k, v in t.items() if k != "masks"} for t in targets]
    assert b"rebuild_storage" in bytes(ForkingPickler.dumps(small))  # a segment per tensor
    assert b"rebuild_storage" not in bytes(ForkingPickler.dumps(TargetBatch(small)))
    assert sum(t["masks"].nbytes for t in targets) > INLINE_BYTES
    arrived = pickle.loads(ForkingPickler.dumps(TargetBatch(targets)))
    assert type(arrived) is list and len(arrived) == 4
    for ours, sent in zip(arrived, targets, strict=True):
        assert ours.keys() == sent.keys() and ours["image_id"] == sent["image_id"]
        for name in ("boxes", "labels", "iscrowd", "masks"):
            assert type(ours[name]) is type(sent[name]) and torch.equal(ours[name], sent[name])
        assert ours["boxes"].format == sent["boxes"].format
        assert ours["boxes"].canvas_size == sent["boxes"].canvas_size == (HEIGHT, WIDTH)
    assert len({t["boxes"].untyped_storage().data_ptr() for t in arrived}) == 1
    odd = [{"boxes": torch.zeros(1, 4)}, {"other": 1}]  # other keys: the plain list
    assert pickle.loads(ForkingPickler.dumps(TargetBatch(odd)))[1] == {"other": 1}


def test_a_fork_while_a_thread_draws_gives_the_child_a_free_generator_lock() -> None:
    """A thread engine's thread may be inside the seeded draw when a loader forks its
    workers: the fork waits for the draw to end, and the child starts with its own free lock
    (it inherited a held one, and its workers hung)."""
    import os
    import threading

    from dlpipe.loading import task_transforms

    held, forking = threading.Event(), threading.Event()

    def draw() -> None:
        with task_transforms._RNG_LOCK:
            held.set()
            forking.wait(10)
            threading.Event().wait(0.5)  # still drawing as the fork starts (liveness only)

    drawer = threading.Thread(target=draw)
    drawer.start()
    held.wait(10)
    forking.set()
    pid = os.fork()
    if pid == 0:  # the child: its lock must be free
        os._exit(0 if task_transforms._RNG_LOCK.acquire(timeout=5) else 1)
    _, status = os.waitpid(pid, 0)
    drawer.join()
    assert os.waitstatus_to_exitcode(status) == 0
