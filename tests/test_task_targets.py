"""A sample's annotation fields become torchvision's detection and segmentation targets, and a
bad annotation is one named per-sample error, never a silently wrong target."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors

from dlpipe import rle
from dlpipe.annotations import (
    BOXES_SCHEMA,
    INSTANCE_MASKS_SCHEMA,
    AnnotationError,
    encode_boxes,
    encode_masks,
    mask_schema,
)
from dlpipe.errors import FieldDecodeError
from dlpipe.loading.targets import TargetError, TargetSpec
from dlpipe.manifest import Manifest, SplitInfo

HEIGHT, WIDTH = 30, 40


def manifest(task: str | None, schemas: dict, fields: dict | None = None) -> Manifest:
    fields = fields or {"jpg": "jpg", **{name: "json" for name in schemas}}
    return Manifest(
        format="wds", format_version=1, fields=fields, splits={"train": SplitInfo(())},
        classes=("a", "b", "c"), task=task, field_schemas=schemas,
    )  # fmt: skip


def png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return buffer.getvalue()


def box_mask(box: tuple[int, int, int, int]) -> np.ndarray:
    mask = np.zeros((HEIGHT, WIDTH), np.uint8)
    mask[box[1] : box[3], box[0] : box[2]] = 1
    return mask


DETECTION = TargetSpec.from_manifest(
    manifest("detection", {"boxes.json": BOXES_SCHEMA, "masks.json": INSTANCE_MASKS_SCHEMA})
)
SEGMENTATION = TargetSpec.from_manifest(
    manifest("segmentation", {"seg.png": mask_schema(ignore=255)})
)
BOXES = [(2, 3, 12, 20), (20, 0, 40, 30)]


def detection_sample(**fields: bytes) -> dict:
    sample = {
        "__key__": "img7",
        "boxes.json": encode_boxes(BOXES, [2, 0], iscrowd=[0, 1]),
        "masks.json": encode_masks((HEIGHT, WIDTH), [rle.encode(box_mask(b)) for b in BOXES]),
    }
    return {**sample, **fields}


def test_a_detection_target_is_torchvision_s() -> None:
    target = DETECTION.target(detection_sample(), (HEIGHT, WIDTH), index=5)
    boxes = target["boxes"]
    assert isinstance(boxes, tv_tensors.BoundingBoxes) and boxes.format.name == "XYXY"
    assert tuple(boxes.canvas_size) == (HEIGHT, WIDTH) and boxes.dtype == torch.float32
    assert boxes.tolist() == [list(map(float, b)) for b in BOXES]
    assert target["labels"].tolist() == [2, 0] and target["labels"].dtype == torch.int64
    assert target["iscrowd"].tolist() == [0, 1] and target["image_id"] == 5
    masks = target["masks"]
    assert isinstance(masks, tv_tensors.Mask) and masks.shape == (2, HEIGHT, WIDTH)
    for mask, box in zip(masks, BOXES, strict=True):
        assert np.array_equal(mask.numpy(), box_mask(box))


def test_image_id_is_the_source_s_when_the_sample_has_one() -> None:
    sample = detection_sample(json=json.dumps({"image_id": 139}).encode())
    assert DETECTION.target(sample, (HEIGHT, WIDTH), index=5)["image_id"] == 139


def test_a_background_image_has_empty_targets() -> None:
    sample = {"__key__": "bg", "boxes.json": encode_boxes([], []), "masks.json":
              encode_masks((HEIGHT, WIDTH), [])}  # fmt: skip
    target = DETECTION.target(sample, (HEIGHT, WIDTH), index=0)
    assert target["boxes"].shape == (0, 4) and target["labels"].shape == (0,)
    assert target["masks"].shape == (0, HEIGHT, WIDTH)


def test_a_box_within_the_slack_is_clamped_onto_the_image() -> None:
    sample = {"__key__": "k", "boxes.json": encode_boxes([[-0.5, 0, 40.75, 30]], [1])}
    spec = TargetSpec.from_manifest(manifest("detection", {"boxes.json": BOXES_SCHEMA}))
    target = spec.target(sample, (HEIGHT, WIDTH), index=0)
    assert target["boxes"].tolist() == [[0.0, 0.0, 40.0, 30.0]] and "masks" not in target


BAD_DETECTION = {
    "box outside the image": (
        {"boxes.json": encode_boxes([[2, 3, 12, 20], [20, 0, 45, 30]], [0, 1])},
        "object 1: box [20, 0, 45, 30] lies outside the 40x30 image",
    ),
    "NaN coordinate": (
        {"boxes.json": b'{"boxes":[[NaN,0,4,4]],"labels":[0],"iscrowd":[0]}'},
        "is not 4 finite numbers",
    ),
    "non-positive size": (
        {"boxes.json": encode_boxes([[5, 5, 5, 9]], [0])},
        "box [5, 5, 5, 9] has no positive width and height",
    ),
    "label outside the classes": (
        {"boxes.json": encode_boxes([[1, 1, 5, 5]], [3])},
        "label 3 is not one of the 3 classes",
    ),
    "masks of another size": (
        {"masks.json": encode_masks((HEIGHT, WIDTH + 1), ["", ""])},
        "masks.json is 41x30, its image 40x30",
    ),
    "fewer masks than boxes": (
        {"masks.json": encode_masks((HEIGHT, WIDTH), [rle.encode(box_mask(BOXES[0]))])},
        "masks.json holds 1 masks for 2 boxes",
    ),
    "a mask that is no mask of the image": (
        {"masks.json": encode_masks((HEIGHT, WIDTH), [rle.string_of([5]), rle.string_of([5])])},
        "mask 0 of masks.json",
    ),
}


@pytest.mark.parametrize("case", BAD_DETECTION)
def test_a_bad_detection_annotation_is_a_named_per_sample_error(case: str) -> None:
    fields, rule = BAD_DETECTION[case]
    with pytest.raises(TargetError) as caught:
        DETECTION.target(detection_sample(**fields), (HEIGHT, WIDTH), index=0)
    message = str(caught.value)
    assert message.startswith("sample 'img7' field 'boxes.json': ") and rule in message
    assert isinstance(caught.value, FieldDecodeError) and isinstance(caught.value, AnnotationError)


def test_a_missing_annotation_field_is_named() -> None:
    with pytest.raises(TargetError, match="sample 'k' field 'boxes.json': the sample has no"):
        DETECTION.target({"__key__": "k"}, (HEIGHT, WIDTH), index=0)


def label_map() -> np.ndarray:
    values = np.zeros((HEIGHT, WIDTH), np.uint8)
    values[5:10, 5:20], values[12:, :8], values[0, :] = 1, 2, 255
    return values


def test_a_segmentation_target_is_a_mask_with_the_ignore_value_kept() -> None:
    target = SEGMENTATION.target({"__key__": "s", "seg.png": png(label_map())}, (30, 40), 0)
    assert isinstance(target, tv_tensors.Mask) and target.dtype == torch.uint8
    assert np.array_equal(target.numpy(), label_map())
    assert SEGMENTATION.ignore == 255 and SEGMENTATION.mask_values == {0, 1, 2, 255}


def test_named_values_and_a_16_bit_map_follow_the_schema() -> None:
    schema = mask_schema({0: "road", 7: "car", 300: "sky"})
    spec = TargetSpec.from_manifest(manifest("segmentation", {"seg.png": schema}))
    values = np.full((HEIGHT, WIDTH), 300, np.uint16)
    values[:, :5] = 7
    buffer = io.BytesIO()
    Image.fromarray(values).save(buffer, "PNG")  # mode I;16
    target = spec.target({"__key__": "s", "seg.png": buffer.getvalue()}, (HEIGHT, WIDTH), 0)
    assert target.dtype == torch.int64 and set(target.unique().tolist()) == {7, 300}
    assert spec.ignore is None


@pytest.mark.parametrize("step", [2, 1])  # 10 runs of values (each counted), or one
def test_a_value_between_the_schema_s_values_is_refused(step: int) -> None:
    schema = mask_schema({value: f"c{value}" for value in range(0, 20, step)})
    spec = TargetSpec.from_manifest(manifest("segmentation", {"seg.png": schema}))
    values = np.zeros((HEIGHT, WIDTH), np.uint8)
    values[0, :4] = [2, 4, 18, 19 if step == 1 else 3]
    sample = {"__key__": "s", "seg.png": png(values)}
    if step == 1:
        assert set(spec.target(sample, (HEIGHT, WIDTH), 0).unique().tolist()) == {0, 2, 4, 18, 19}
        return
    with pytest.raises(TargetError, match="holds value 3, which is not one of the schema's 10"):
        spec.target(sample, (HEIGHT, WIDTH), 0)


BAD_SEGMENTATION = {
    "another size": (png(np.zeros((HEIGHT, WIDTH - 1), np.uint8)), "the label map is 39x30"),
    "a value outside the classes": (
        png(np.where(label_map() == 2, 3, label_map()).astype(np.uint8)),
        "holds value 3, which is not one of the schema's 3 class values, or the ignore value 255",
    ),
    "an RGB image": (png(np.zeros((HEIGHT, WIDTH, 3), np.uint8)), "in mode RGB"),
    "not an image": (b"not a png", "the label map does not decode"),
}


@pytest.mark.parametrize("case", BAD_SEGMENTATION)
def test_a_bad_label_map_is_a_named_per_sample_error(case: str) -> None:
    data, rule = BAD_SEGMENTATION[case]
    with pytest.raises(TargetError) as caught:
        SEGMENTATION.target({"__key__": "s1", "seg.png": data}, (HEIGHT, WIDTH), 0)
    assert str(caught.value).startswith("sample 's1' field 'seg.png': ")
    assert rule in str(caught.value)


def test_a_caption_is_text() -> None:
    spec = TargetSpec.from_manifest(manifest("captioning", {}, {"jpg": "jpg", "txt": "txt"}))
    assert spec.target({"__key__": "c", "txt": b"a red circle"}, (1, 1), 0) == "a red circle"
    with pytest.raises(TargetError, match="not UTF-8"):
        spec.target({"__key__": "c", "txt": b"\xff\xfe"}, (1, 1), 0)


def test_the_spec_comes_from_the_manifest_never_from_field_names() -> None:
    with pytest.raises(ValueError, match="task None has no target here"):
        TargetSpec.from_manifest(manifest(None, {"boxes.json": BOXES_SCHEMA}))
    with pytest.raises(ValueError, match="no field of dlpipe.json's field_schemas is of kind"):
        TargetSpec.from_manifest(manifest("detection", {}, {"jpg": "jpg", "boxes.json": "json"}))
    assert TargetSpec.from_manifest(manifest(None, {"boxes.json": BOXES_SCHEMA}), "detection")
