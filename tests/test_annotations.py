"""The annotation fields (`dlpipe.annotations`): boxes and masks checked against their image at
conversion, scaled with it by ``--max-side``, and the manifest's task, schema and class ids."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_source_table_layouts import convert, one_error_line

import dlpipe
from dlpipe import rle
from dlpipe.annotations import (
    BOXES_SCHEMA,
    INSTANCE_MASKS_SCHEMA,
    AnnotationError,
    check_boxes,
    encode_boxes,
    encode_masks,
    fit_annotations,
    mask_schema,
    read_boxes,
)
from dlpipe.manifest import parse_manifest


def image_bytes(width: int, height: int, fmt: str = "JPEG") -> bytes:
    rng = np.random.default_rng(width * 1000 + height)
    pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def label_map(width: int, height: int) -> bytes:
    """A label map with a value per 10-pixel column band (0, 1, 2, ...) and a 255 border."""
    values = (np.arange(width) // 10).astype(np.uint8)[None, :].repeat(height, axis=0)
    values[0, :] = 255
    buffer = io.BytesIO()
    Image.fromarray(values, mode="L").save(buffer, format="PNG")
    return buffer.getvalue()


def test_boxes_round_trip_as_plain_json() -> None:
    data = encode_boxes(
        [[1, 2.5, 30, 40], [0, 0, 64, 48]], [3, 0], iscrowd=[0, 1], ids=[7, 9], difficult=[1, 0]
    )
    assert json.loads(data) == {
        "boxes": [[1, 2.5, 30, 40], [0, 0, 64, 48]],
        "labels": [3, 0],
        "iscrowd": [0, 1],
        "ids": [7, 9],
        "difficult": [1, 0],
    }
    assert read_boxes(data)["labels"] == [3, 0]
    assert json.loads(encode_boxes([], [])) == {"boxes": [], "labels": [], "iscrowd": []}
    assert dlpipe.decode_field("boxes.json", data)["ids"] == [7, 9]  # the json codec reads it


@pytest.mark.parametrize(
    ("data", "rule"),
    [
        (b"not json", "not UTF-8 JSON"),
        (b"[1, 2]", 'with a "boxes" list'),
        (b'{"boxes": [[0, 0, 1, 1]], "labels": []}', "not a list of 1 entries"),
        (b'{"boxes": [[0, 0, 1]], "labels": [0], "iscrowd": [0]}', "not 4 finite numbers"),
        (b'{"boxes": [[0, 0, 1, true]], "labels": [0], "iscrowd": [0]}', "not 4 finite"),
        (b'{"boxes": [[0, 0, 1, 1e999]], "labels": [0], "iscrowd": [0]}', "not 4 finite"),
        (b'{"boxes": [[0, 0, 1, 1]], "labels": [-1], "iscrowd": [0]}', "class indices"),
        (b'{"boxes": [[0, 0, 1, 1]], "labels": [0.5], "iscrowd": [0]}', "class indices"),
        (b'{"boxes": [[0, 0, 1, 1]], "labels": [0], "iscrowd": [2]}', "not 0 or 1"),
        (b'{"boxes": [[0, 0, 1, 1]]}', "class indices"),
    ],
)
def test_malformed_boxes_are_refused_naming_the_rule(data: bytes, rule: str) -> None:
    with pytest.raises(AnnotationError, match=rule):
        read_boxes(data)


@pytest.mark.parametrize(
    ("box", "label", "rule"),
    [
        ([10, 10, 10, 20], 0, "no positive width and height"),
        ([10, 20, 30, 5], 0, "no positive width and height"),
        ([-2, 0, 10, 10], 0, "outside the 64x48 image"),
        ([0, 0, 65.5, 10], 0, "outside the 64x48 image"),
        ([0, 0, 10, 49.01], 0, "outside the 64x48 image"),
        ([0, 0, 10, 10], 5, "label 5 is not one of the 5 classes"),
    ],
)
def test_boxes_that_do_not_fit_the_image_are_refused(box, label, rule) -> None:
    with pytest.raises(AnnotationError, match=rule):
        check_boxes(encode_boxes([box], [label]), 64, 48, num_classes=5)


def test_a_box_within_the_slack_of_an_edge_is_kept_as_given() -> None:
    data = encode_boxes([[-1, -0.5, 65, 49]], [4])
    assert check_boxes(data, 64, 48, num_classes=5)["boxes"] == [[-1, -0.5, 65, 49]]


def test_a_resize_scales_boxes_and_resizes_masks_by_nearest_neighbour() -> None:
    fields = {
        "boxes.json": encode_boxes([[10, 20, 50, 40]], [1], iscrowd=[1], ids=["a"], truncated=[1]),
        "seg.png": label_map(80, 60),
    }
    fitted = fit_annotations(fields, (80, 60), (40, 30), num_classes=2)
    record = json.loads(fitted["boxes.json"])
    assert record["boxes"] == [[5, 10, 25, 20]]
    assert (record["iscrowd"], record["ids"], record["truncated"]) == ([1], ["a"], [1])
    mask = np.asarray(Image.open(io.BytesIO(fitted["seg.png"])))
    assert mask.shape == (30, 40) and set(np.unique(mask)) <= {0, 1, 2, 3, 4, 5, 6, 7, 255}
    assert fit_annotations(fields, (80, 60), (80, 60)) == fields  # unchanged bytes


def test_a_resize_takes_the_samples_other_images_of_its_size_along() -> None:
    fields = {
        "cond.png": label_map(80, 60),
        "view.jpg": image_bytes(80, 60),
        "thumb.jpg": image_bytes(20, 15),
        "json": b"{}",
    }
    fitted = fit_annotations(fields, (80, 60), (40, 30))
    cond = Image.open(io.BytesIO(fitted["cond.png"]))
    assert (cond.format, cond.mode, cond.size) == ("PNG", "L", (40, 30))
    assert set(np.unique(np.asarray(cond))) <= {0, 1, 2, 3, 4, 5, 6, 7, 255}  # no blending
    view = Image.open(io.BytesIO(fitted["view.jpg"]))
    assert (view.format, view.size) == ("JPEG", (40, 30))
    assert fitted["thumb.jpg"] == fields["thumb.jpg"] and fitted["json"] == b"{}"


@pytest.mark.parametrize(
    ("mask", "rule"),
    [
        (label_map(40, 60), "the mask is 40x60, its image 80x60"),
        (image_bytes(80, 60, "PNG"), "mode RGB"),
        (image_bytes(80, 60), "a JPEG image"),
        (b"\x89PNG\r\n\x1a\nbroken", "not a readable PNG"),
    ],
)
def test_a_mask_that_is_no_label_map_of_the_image_is_refused(mask: bytes, rule: str) -> None:
    with pytest.raises(AnnotationError, match=rule):
        fit_annotations({"seg.png": mask}, (80, 60), (80, 60))


def instance_masks(width: int, height: int, count: int) -> tuple[list[np.ndarray], bytes]:
    """`count` masks of a `width` x `height` image (a growing block each) and their bytes."""
    masks = []
    for i in range(count):
        mask = np.zeros((height, width), np.uint8)
        mask[i : 10 + 3 * i, 2 * i : 7 + 5 * i] = 1
        masks.append(mask)
    return masks, encode_masks((height, width), [rle.encode(m) for m in masks])


def test_instance_masks_are_kept_and_resized_by_nearest_neighbour() -> None:
    masks, data = instance_masks(80, 60, 2)
    boxes = encode_boxes([[0, 0, 7, 10], [2, 1, 12, 13]], [0, 1])
    fields = {"boxes.json": boxes, "masks.json": data}
    assert fit_annotations(fields, (80, 60), (80, 60)) == fields  # unchanged bytes
    record = json.loads(fit_annotations(fields, (80, 60), (40, 30))["masks.json"])
    assert record["size"] == [30, 40] and len(record["counts"]) == 2
    for mask, counts in zip(masks, record["counts"], strict=True):
        resized = Image.fromarray(mask).resize((40, 30), Image.Resampling.NEAREST)
        assert np.array_equal(rle.decode(counts, (30, 40)), np.asarray(resized))
    assert dlpipe.decode_field("masks.json", data)["size"] == [60, 80]  # the json codec reads it


@pytest.mark.parametrize(
    ("data", "rule"),
    [
        (instance_masks(40, 60, 2)[1], "masks.json is 40x60, its image 80x60"),
        (instance_masks(80, 60, 3)[1], "holds 3 masks for the 2 objects of boxes.json"),
        (encode_masks((60, 80), ["52203", "0"]), "mask 0 of masks.json is no 80x60 mask"),
        (encode_masks((60, 80), ["0ac0", "o"]), "mask 0 of masks.json is no 80x60 mask"),
        (b'{"size": [60, 80], "counts": [1, 2]}', '"counts": ["<RLE>", ...]}'),
        (b'{"size": [60], "counts": []}', '{"size": [height, width]'),
        (b"\xff", "not UTF-8 JSON"),
    ],
)
def test_instance_masks_that_do_not_fit_the_image_are_refused(data: bytes, rule: str) -> None:
    fields = {
        "boxes.json": encode_boxes([[0, 0, 7, 10], [2, 1, 12, 13]], [0, 1]),
        "masks.json": data,
    }
    with pytest.raises(AnnotationError, match=re.escape(rule)):
        fit_annotations(fields, (80, 60), (80, 60))


def grouped_files(root: Path, boxes: dict[str, list], *, size=(80, 60)) -> Path:
    """A ``files`` layout: ``<key>.jpg``, ``<key>.boxes.json``, ``<key>.seg.png``, ``<key>.cls``."""
    root.mkdir(parents=True)
    for key, objects in boxes.items():
        (root / f"{key}.jpg").write_bytes(image_bytes(*size))
        (root / f"{key}.boxes.json").write_bytes(
            encode_boxes([b for b, _ in objects], [c for _, c in objects])
        )
        (root / f"{key}.seg.png").write_bytes(label_map(*size))
        (root / f"{key}.cls").write_bytes(b"1")
    (root / "classes.txt").write_text("cat\ndog\n")
    return root


def stored(out: Path) -> dict[str, dict]:
    return {s["__key__"]: dlpipe.decode_sample(s) for s in dlpipe.open_dataset(str(out), "train")}


def test_convert_scales_boxes_and_masks_with_max_side(tmp_path) -> None:
    raw = grouped_files(tmp_path / "raw", {"a": [([8, 6, 40, 30], 0)], "b": [([0, 0, 80, 60], 1)]})
    assert convert(raw, tmp_path / "out", "--max-side", "40") == 0
    got = stored(tmp_path / "out")
    assert got["a"]["boxes.json"]["boxes"] == [[4, 3, 20, 15]]
    assert got["b"]["boxes.json"]["boxes"] == [[0, 0, 40, 30]]
    assert got["a"]["jpg"].size == (40, 30) and got["a"]["seg.png"].size == (40, 30)
    assert got["a"]["boxes.json"]["labels"] == [0] and got["b"]["cls"] == 1


def test_a_sample_whose_box_leaves_the_image_is_skipped_and_listed(tmp_path, capsys) -> None:
    raw = grouped_files(
        tmp_path / "raw", {"good": [([1, 1, 9, 9], 0)], "bad": [([70, 10, 95, 20], 1)]}
    )
    assert convert(raw, tmp_path / "out") == 0
    assert set(stored(tmp_path / "out")) == {"good"}
    errors = [json.loads(line) for line in (tmp_path / "out" / "errors.jsonl").open()]
    assert [e["key"] for e in errors] == ["bad"]
    assert "box [70, 10, 95, 20] lies outside the 80x60 image" in errors[0]["error"]
    assert convert(raw, tmp_path / "out2", "--on-error", "fail") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "raw/bad." in line and "outside the 80x60 image" in line


def test_a_sample_whose_box_names_an_unknown_class_is_skipped(tmp_path) -> None:
    raw = grouped_files(tmp_path / "raw", {"good": [([1, 1, 9, 9], 1)], "bad": [([1, 1, 9, 9], 2)]})
    assert convert(raw, tmp_path / "out") == 0
    errors = (tmp_path / "out" / "errors.jsonl").read_text()
    assert "label 2 is not one of the 2 classes" in errors


def manifest_json(**extra) -> dict:
    return {
        "schema": "dlpipe.manifest",
        "schema_version": 1,
        "dlpipe_version": "0.1.0",
        "format": "wds",
        "format_version": 1,
        "fields": {"jpg": "image", "boxes.json": "json", "seg.png": "image", "masks.json": "json"},
        "classes": ["person", "bicycle", "car"],
        "splits": {
            "train": {
                "samples": 1,
                "bytes": 10,
                "shards": [
                    {"name": "train-000000.tar", "samples": 1, "bytes": 10, "sha256": "0" * 64}
                ],
            }
        },
        "options": {},
        "source": {},
        **extra,
    }


def test_the_manifest_keeps_task_schema_and_class_ids() -> None:
    schema = {
        "boxes.json": BOXES_SCHEMA,
        "seg.png": mask_schema({1: "pet"}, ignore=255),
        "masks.json": INSTANCE_MASKS_SCHEMA,
    }
    data = manifest_json(task="detection", field_schemas=schema, class_ids=[1, 2, 90])
    manifest = parse_manifest(json.dumps(data).encode(), "dlpipe.json")
    assert manifest.task == "detection" and manifest.class_ids == (1, 2, 90)
    assert manifest.field_schemas["seg.png"] == {
        "kind": "mask", "encoding": "png", "values": {"1": "pet"}, "ignore": 255
    }  # fmt: skip
    assert manifest.to_json() == data
    plain = parse_manifest(json.dumps(manifest_json()).encode(), "dlpipe.json")
    assert plain.task is None and plain.field_schemas == {} and plain.class_ids is None
    assert set(plain.to_json()) == set(manifest_json())  # nothing new in an old manifest


@pytest.mark.parametrize(
    ("extra", "rule"),
    [
        ({"task": "segmentatoin"}, "task 'segmentatoin' is not one of"),
        ({"task": 1}, "task 1 is not one of"),
        ({"field_schemas": []}, "'field_schemas' is not a JSON object"),
        ({"field_schemas": {"txt": {"kind": "caption"}}}, "does not have"),
        ({"field_schemas": {"boxes.json": {"kind": "polygons"}}}, "kind is one of"),
        ({"class_ids": [1, 2]}, "not a list of 3 ids"),
        ({"class_ids": [1, 1, 2]}, "names one id twice"),
        ({"class_ids": [1, True, 2]}, "not an integer or a string"),
    ],
)
def test_a_manifest_with_a_bad_task_schema_or_class_ids_is_refused(extra, rule) -> None:
    with pytest.raises(dlpipe.ManifestError, match=rule):
        parse_manifest(json.dumps(manifest_json(**extra)).encode(), "dlpipe.json")


def test_the_manual_reads_boxes_with_plain_webdataset(tmp_path) -> None:
    """docs/formats.md's data-model example runs, without dlpipe, in a converted wds folder."""
    readme = (Path(__file__).resolve().parent.parent / "docs" / "formats.md").read_text()
    (block,) = [
        b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "boxes.json" in b
    ]
    assert "dlpipe" not in block
    raw = grouped_files(tmp_path / "raw", {k: [([8, 6, 40, 30], 0)] for k in ("a", "b")})
    assert convert(raw, tmp_path / "out") == 0
    done = subprocess.run(
        [sys.executable, "-c", block + "\nprint(image.size, objects)"],
        cwd=tmp_path / "out",
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout.strip() == "(80, 60) {'boxes': [[8, 6, 40, 30]], 'iscrowd': [0], 'labels': [0]}"
    )
