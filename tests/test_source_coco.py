"""The coco source reads COCO instances files as cocodataset.org, CVAT/Datumaro and Roboflow ship
them, checks every box against the JSON, and refuses hostile files with one error line."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import error_records
from PIL import Image
from test_rle import pixel_centres

import dlpipe
from dlpipe import rle
from dlpipe.annotations import BOXES_SCHEMA, INSTANCE_MASKS_SCHEMA
from dlpipe.cli import main
from dlpipe.converters import coco_json
from dlpipe.converters.coco import CocoSource, split_of
from dlpipe.converters.config import ConvertConfig, ConvertOptionError
from dlpipe.converters.source import SampleError, SourceOptions
from dlpipe.converters.sources import SOURCE_KINDS, open_source
from dlpipe.sample import unescape_key

# gapped ids, as COCO's 80 categories use 1..90; the file lists them out of id order
CATEGORIES = [
    {"supercategory": "vehicle", "id": 5, "name": "airplane"},
    {"supercategory": "person", "id": 1, "name": "person"},
    {"supercategory": "indoor", "id": 90, "name": "toothbrush"},
    {"supercategory": "vehicle", "id": 2, "name": "bicycle"},
]
CLASSES = ["person", "bicycle", "airplane", "toothbrush"]  # sorted by id
CLASS_IDS = [1, 2, 5, 90]
SIZES = [(40, 30), (32, 48), (48, 36), (24, 24)]  # (width, height) of each split's images


def _jpeg(size: tuple[int, int], seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def _polygon(x: float, y: float, w: float, h: float) -> list[list[float]]:
    return [[x, y, x + w, y, x + w, y + h, x, y + h]]


def _images(first_id: int, count: int, name: str = "{:012d}.jpg") -> list[dict[str, Any]]:
    """``images`` entries as COCO ships them (license, urls, date beside the four we read)."""
    return [
        {"license": 4, "file_name": name.format(first_id + i), "coco_url": "http://x/y.jpg",
         "height": SIZES[i % 4][1], "width": SIZES[i % 4][0], "date_captured": "2013-11-14",
         "flickr_url": "http://x/z.jpg", "id": first_id + i}
        for i in range(count)
    ]  # fmt: skip


def crowd_rle(box: list[float], width: int, height: int) -> dict[str, Any]:
    """COCO's uncompressed RLE of a box's pixels (column-major runs, zeros first), made here."""
    x0, y0, w, h = (round(v) for v in box)
    counts, value, run = [], 0, 0
    for x in range(width):
        for y in range(height):
            inside = int(x0 <= x < x0 + w and y0 <= y < y0 + h)
            if inside != value:
                counts.append(run)
                value, run = inside, 0
            run += 1
    return {"counts": [*counts, run], "size": [height, width]}


def _annotation(
    ann_id: int, image_id: int, category: int, box: list[float], crowd: int = 0,
    size: tuple[int, int] = SIZES[2],
):  # fmt: skip
    segmentation: Any = _polygon(*box)
    if crowd:  # COCO's crowd regions are uncompressed RLE (of the image's size)
        segmentation = crowd_rle(box, *size)
    area = box[2] * box[3]
    return {"segmentation": segmentation, "area": area, "iscrowd": crowd, "image_id": image_id,
            "bbox": box, "category_id": category, "id": ann_id}  # fmt: skip


def instances(images: list[dict[str, Any]], annotations: list[dict[str, Any]]) -> dict[str, Any]:
    """An instances file's object, its keys in COCO's order (categories last)."""
    return {
        "info": {"description": "COCO 2017 Dataset", "version": "1.0", "year": 2017},
        "licenses": [{"url": "http://creativecommons.org/licenses/by-nc-sa/2.0/", "id": 1}],
        "images": images,
        "annotations": annotations,
        "categories": CATEGORIES,
    }


def _train_annotations() -> list[dict[str, Any]]:
    """Interleaved across images (the file's order is not image order); image 4 has none."""
    return [
        _annotation(101, 1, 1, [1.5, 2.25, 10.0, 12.5]),
        _annotation(102, 2, 90, [0, 0, 32, 48]),
        _annotation(103, 1, 5, [20, 5, 15.75, 20]),
        _annotation(900100000001, 3, 1, [3, 4, 30, 20], crowd=1),
        _annotation(104, 1, 2, [0.5, 0.5, 5, 5]),
        _annotation(105, 3, 90, [10, 10, 1.25, 2.5]),
    ]


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))  # one line, as COCO ships it


def make_coco(root: Path) -> Path:
    """COCO 2017 as cocodataset.org ships it: annotations/ beside train2017/, val2017/ and
    test2017/ (whose image_info file has no annotations)."""
    train, val = _images(1, 4), _images(11, 3)
    write_json(root / "annotations" / "instances_train2017.json",
               instances(train, _train_annotations()))  # fmt: skip
    val_annotations = [_annotation(201, 11, 2, [2, 3, 8, 9]), _annotation(202, 13, 5, [1, 1, 4, 4])]
    write_json(root / "annotations" / "instances_val2017.json", instances(val, val_annotations))
    captions = {"info": {}, "images": train, "annotations": [
        {"image_id": 1, "id": 1, "caption": "A person on a bicycle."}]}  # fmt: skip
    write_json(root / "annotations" / "captions_train2017.json", captions)
    keypoints = instances(val, [])
    write_json(root / "annotations" / "person_keypoints_val2017.json", keypoints)
    test_info = {"info": {}, "images": _images(21, 1), "categories": CATEGORIES}
    write_json(root / "annotations" / "image_info_test2017.json", test_info)
    for folder, entries in (("train2017", train), ("val2017", val), ("test2017", _images(21, 1))):
        (root / folder).mkdir()
        for entry in entries:
            data = _jpeg((entry["width"], entry["height"]), entry["id"])
            (root / folder / entry["file_name"]).write_bytes(data)
    return root


def convert(raw: Path, out: Path, fmt: str = "wds", *extra: str, source: str = "coco") -> int:
    """Convert through the CLI; ``source="auto"`` detects the layout."""
    command = ["convert", str(raw), "--to", fmt, "--out", str(out), "--workers", "1", *extra]
    return main([*command, "--source", source] if source != "auto" else command)


def expected_samples(data: dict[str, Any], scale: float = 1.0) -> dict[str, dict[str, Any]]:
    """key → the boxes.json record and image id the JSON says, computed here independently."""
    labels = {c["id"]: i for i, c in enumerate(sorted(data["categories"], key=lambda c: c["id"]))}
    expected = {}
    for image in data["images"]:
        objects = [a for a in data["annotations"] if a["image_id"] == image["id"]]
        record = {
            "boxes": [[round(v * scale, 4) if scale != 1 else v for v in
                       (x, y, x + w, y + h)] for x, y, w, h in (a["bbox"] for a in objects)],
            "labels": [labels[a["category_id"]] for a in objects],
            "iscrowd": [a["iscrowd"] for a in objects],
            "ids": [a["id"] for a in objects],
        }  # fmt: skip
        expected[os.path.splitext(image["file_name"])[0]] = {"boxes": record, "id": image["id"]}
    return expected


def read_samples(out: Path, split: str) -> dict[str, dict[str, Any]]:
    found = {}
    for sample in dlpipe.open_dataset(out, split, rank=0, world_size=1):
        assert "cls" not in sample
        boxes = json.loads(sample["boxes.json"])
        image_id = json.loads(sample["json"])["image_id"]
        size = Image.open(io.BytesIO(sample["jpg"])).size
        found[unescape_key(sample["__key__"])] = {"boxes": boxes, "id": image_id, "size": size}
    return found


def check_split(out: Path, split: str, data: dict[str, Any], scale: float = 1.0) -> None:
    found = read_samples(out, split)
    expected = expected_samples(data, scale)
    assert sorted(found) == sorted(expected)
    sizes = {os.path.splitext(i["file_name"])[0]: (i["width"], i["height"]) for i in data["images"]}
    for key, sample in found.items():
        assert sample["boxes"] == expected[key]["boxes"], key
        assert sample["id"] == expected[key]["id"]
        w, h = sizes[key]
        assert sample["size"] == (round(w * scale), round(h * scale))


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


@pytest.mark.parametrize("fmt", ["wds", "lmdb", "hdf5"])
def test_coco_as_shipped_converts_every_box(tmp_path: Path, fmt: str, caplog) -> None:
    raw = make_coco(tmp_path / "coco")
    out = tmp_path / "out"
    with caplog.at_level("WARNING", logger="dlpipe"):
        assert convert(raw, out, fmt, source="auto") == 0
    manifest = dlpipe.read_manifest(str(out))
    assert list(manifest.classes) == CLASSES and list(manifest.class_ids or ()) == CLASS_IDS
    assert manifest.task == "detection" and manifest.field_schemas == {"boxes.json": BOXES_SCHEMA}
    assert {k: s.samples for k, s in manifest.splits.items()} == {"train": 4, "val": 3}
    check_split(out, "train", _load(raw / "annotations" / "instances_train2017.json"))
    check_split(out, "val", _load(raw / "annotations" / "instances_val2017.json"))
    source = manifest.source
    assert source["kind"] == "coco" and source["skipped"] == 0
    assert source["unused"] == {"annotation files": 3, "split lists": 0, "masks": 0,
                                "instance masks": 8, "other": 0}  # fmt: skip
    assert list(source["left_out"]) == ["test2017"]
    assert "no instances file reads it" in source["left_out"]["test2017"]
    assert source["orphan_annotations"] == 0
    assert "--instance-masks converts them" in source["segmentation"]
    assert "images in <split>/ (COCO as shipped)" in source["layout"]
    assert not [r for r in caplog.records if "not read" in r.getMessage()]


def test_background_image_and_crowd_region(tmp_path: Path) -> None:
    raw = make_coco(tmp_path / "coco")
    assert convert(raw, tmp_path / "out") == 0
    train = read_samples(tmp_path / "out", "train")
    assert train["000000000004"]["boxes"] == {"boxes": [], "labels": [], "iscrowd": [], "ids": []}
    crowd = train["000000000003"]["boxes"]
    assert crowd["iscrowd"] == [1, 0] and crowd["ids"] == [900100000001, 105]
    assert crowd["boxes"][0] == [3, 4, 33, 24] and crowd["labels"] == [0, 3]


def test_max_side_scales_the_boxes_with_the_image(tmp_path: Path) -> None:
    raw = make_coco(tmp_path / "coco")
    out = tmp_path / "out"
    assert convert(raw, out, "wds", "--max-side", "24") == 0
    data = _load(raw / "annotations" / "instances_train2017.json")
    found = read_samples(out, "train")
    # image 1 is 40x30 → 24x18 (0.6); its first box [1.5, 2.25, 11.5, 14.75] scales with it
    assert found["000000000001"]["size"] == (24, 18)
    assert found["000000000001"]["boxes"]["boxes"][0] == [0.9, 1.35, 6.9, 8.85]
    assert found["000000000004"]["size"] == (24, 24)  # not larger: kept
    first = data["images"][0]
    assert (first["width"], first["height"]) == (40, 30)


def _roboflow(root: Path) -> dict[str, dict[str, Any]]:
    """Roboflow's COCO export: <split>/_annotations.coco.json beside the split's images, with
    its category 0 (the dataset's name, the others' supercategory)."""
    categories = [{"id": 0, "name": "cells", "supercategory": "none"},
                  {"id": 1, "name": "platelets", "supercategory": "cells"},
                  {"id": 2, "name": "rbc", "supercategory": "cells"}]  # fmt: skip
    datas = {}
    for n, split in enumerate(["train", "valid", "test"]):
        images = _images(n * 10, 2, "img{}_jpg.rf.3f2a.jpg")
        annotations = [
            {"id": n * 10, "image_id": n * 10, "category_id": 1 + n % 2, "bbox": [1, 2, 3, 4],
             "area": 12, "segmentation": [], "iscrowd": 0},
        ]  # fmt: skip
        data = {"info": {"year": "2023"}, "licenses": [], "categories": categories,
                "images": images, "annotations": annotations}  # fmt: skip
        write_json(root / split / "_annotations.coco.json", data)
        for entry in images:
            data_bytes = _jpeg((entry["width"], entry["height"]), entry["id"])
            (root / split / entry["file_name"]).write_bytes(data_bytes)
        datas[split_of(split) or ""] = data
    (root / "README.roboflow.txt").write_text("exported from roboflow.com\n")
    return datas


def test_roboflow_export(tmp_path: Path) -> None:
    raw = tmp_path / "rf"
    datas = _roboflow(raw)
    out = tmp_path / "out"
    assert convert(raw, out, "lmdb", source="auto") == 0
    manifest = dlpipe.read_manifest(str(out))
    assert list(manifest.classes) == ["cells", "platelets", "rbc"]
    assert list(manifest.class_ids or ()) == [0, 1, 2]
    assert sorted(manifest.splits) == ["test", "train", "val"]
    for split, data in datas.items():
        check_split(out, split, data)
    assert manifest.source["unused"]["other"] == 0
    assert "Roboflow" in manifest.source["layout"]


@pytest.mark.parametrize("nested", [False, True], ids=["images", "images-default"])
def test_cvat_export_without_split(tmp_path: Path, nested: bool) -> None:
    """CVAT's COCO 1.0: annotations/instances_default.json and images/ (or images/default/)."""
    raw = tmp_path / "cvat"
    data = instances(_images(1, 4, "frame_{:06d}.PNG"), _train_annotations())
    write_json(raw / "annotations" / "instances_default.json", data)
    folder = raw / "images" / ("default" if nested else "")
    folder.mkdir(parents=True)
    for entry in data["images"]:
        Image.new("RGB", (entry["width"], entry["height"]), (9, 90, 200)).save(
            folder / entry["file_name"], "PNG"
        )
    out = tmp_path / "out"
    assert convert(raw, out, "hdf5") == 0
    manifest = dlpipe.read_manifest(str(out))
    assert list(manifest.splits) == ["train"]  # no official split: all train (no --val-fraction)
    dataset = dlpipe.open_dataset(out, "train", rank=0, world_size=1)
    expected = expected_samples(data)
    for sample in dataset:
        key = unescape_key(sample["__key__"])
        assert json.loads(sample["boxes.json"]) == expected[key]["boxes"]
    assert len(dataset) == 4


def test_datumaro_images_per_split(tmp_path: Path) -> None:
    raw = make_coco(tmp_path / "coco")
    (raw / "images").mkdir()
    for split in ("train2017", "val2017"):
        (raw / split).rename(raw / "images" / split)
    assert convert(raw, tmp_path / "out") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert {k: s.samples for k, s in manifest.splits.items()} == {"train": 4, "val": 3}
    assert "images/<split>/" in manifest.source["layout"]
    check_split(tmp_path / "out", "val", _load(raw / "annotations" / "instances_val2017.json"))


def test_detection_by_names(tmp_path: Path) -> None:
    assert list(SOURCE_KINDS).index("coco") < list(SOURCE_KINDS).index("imagefolder")
    raw = make_coco(tmp_path / "coco")
    assert open_source(str(raw)).kind == "coco"
    _roboflow(tmp_path / "rf")
    assert open_source(str(tmp_path / "rf")).kind == "coco"
    write_json(tmp_path / "cvat" / "annotations" / "instances_default.json", {})
    (tmp_path / "cvat" / "images").mkdir()
    assert CocoSource.detect(str(tmp_path / "cvat"))
    assert not CocoSource.detect(str(tmp_path / "rf" / "train"))
    for name in ("instances_train2017.json", "instances_val2017.json"):
        (raw / "annotations" / name).unlink()
    assert not CocoSource.detect(str(raw))  # captions and keypoints alone are not detection


@pytest.mark.parametrize(
    ("name", "split"),
    [("train2017", "train"), ("val2014", "val"), ("test2017", "test"), ("test-dev2017", "test"),
     ("valid", "val"), ("validation", "val"), ("default", None), (None, None),
     ("minival2014", "minival2014"), ("my-split", "my_split"), ("Train", "train")],
)  # fmt: skip
def test_split_names(name: str | None, split: str | None) -> None:
    assert split_of(name) == split


@pytest.mark.parametrize("indent", [None, 2], ids=["compact", "indented"])
def test_stream_reads_what_json_load_reads_across_buffer_edges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, indent: int | None
) -> None:
    """A 5-character buffer cuts every number, string, escape and UTF-8 sequence somewhere."""
    monkeypatch.setattr(coco_json, "_CHUNK_CHARS", 5)
    data = instances(_images(1, 4, 'caf\u00e9/{:03d} "q" \\.jpg'), _train_annotations())
    data["numbers"] = [123456789, -2.5e3, 1e-7]  # top-level numbers end at no delimiter of theirs
    data["count"] = 987654321
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(data, indent=indent, ensure_ascii=indent is None), "utf-8")
    found = coco_json.read_instances(str(path), str(tmp_path))
    assert found.images == {i["id"]: (i["file_name"], i["width"], i["height"], None)
                            for i in data["images"]}  # fmt: skip
    assert found.categories == {c["id"]: c["name"] for c in CATEGORIES}
    expected: dict[int, list[tuple[Any, ...]]] = {}
    for a in data["annotations"]:
        expected.setdefault(a["image_id"], []).append(
            (a["id"], a["category_id"], *a["bbox"], a["iscrowd"])
        )
    assert found.objects == expected and found.masks == len(data["annotations"])


def _one_error(capsys, *, warnings: bool = False) -> str:
    """The one ``error:`` line on stderr (with `warnings`, after any ``warning:`` lines)."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    if warnings:
        lines = [line for line in lines if not line.startswith("warning: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


def _break_sample(raw: Path, case: str) -> tuple[str, str]:
    """Break image 2 of train2017 one way; return its key and what the error must name."""
    path = raw / "annotations" / "instances_train2017.json"
    data = _load(path)
    bad = next(a for a in data["annotations"] if a["image_id"] == 2)
    if case == "unknown-category":
        bad["category_id"] = 3
        expected = "annotation 102 of image 2 has category_id 3, which is not one of the 4"
    elif case == "zero-width":
        bad["bbox"] = [1, 1, 0, 5]
        expected = "'bbox' [1, 1, 0, 5] has no positive width and height"
    elif case == "three-numbers":
        bad["bbox"] = [1, 1, 5]
        expected = "'bbox' [1, 1, 5] is not 4 numbers"
    elif case == "bad-crowd":
        bad["iscrowd"] = 2
        expected = "'iscrowd' 2 is not 0 or 1"
    elif case == "missing-image":
        (raw / "train2017" / "000000000002.jpg").unlink()
        expected = f"{raw / 'train2017' / '000000000002.jpg'}: cannot be read"
    elif case == "wrong-size":
        data["images"][1]["width"] = 33
        expected = "the image is 32x48, but its entry (image id 2) gives width 33 and height 48"
    elif case == "leaves-the-folder":
        data["images"][1]["file_name"] = "../../secret.jpg"
        (raw.parent / "secret.jpg").write_bytes(_jpeg((32, 48), 2))
        write_json(path, data)
        return "../../secret", "has file_name '../../secret.jpg', which lies outside"
    elif case == "link-out":
        image = raw / "train2017" / "000000000002.jpg"
        (raw.parent / "elsewhere.jpg").write_bytes(image.read_bytes())
        image.unlink()
        image.symlink_to(raw.parent / "elsewhere.jpg")
        expected = "outside the raw folder"
    else:  # outside the box frame: the worker's check of every box against its image
        bad["bbox"] = [10, 10, 30, 48]
        expected = "lies outside the 32x48 image"
    write_json(path, data)
    return "000000000002", expected


SAMPLE_CASES = ["unknown-category", "zero-width", "three-numbers", "bad-crowd", "missing-image",
                "wrong-size", "leaves-the-folder", "link-out", "outside-image"]  # fmt: skip


@pytest.mark.parametrize("case", SAMPLE_CASES)
def test_bad_annotation_skips_only_its_image(tmp_path: Path, case: str, capsys) -> None:
    raw = make_coco(tmp_path / "coco")
    key, expected = _break_sample(raw, case)
    out = tmp_path / "out"
    assert convert(raw, out) == 0
    assert "skipped 1 samples" in capsys.readouterr().out
    (error,) = error_records(out)
    assert unescape_key(error["key"]) == key and expected in error["error"], error
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.splits["train"].samples == 3 and manifest.source["skipped"] == 1
    assert key not in read_samples(out, "train")
    assert convert(raw, tmp_path / "fail", "wds", "--on-error", "fail") == 2
    assert expected in _one_error(capsys, warnings=case in ("link-out", "leaves-the-folder"))


def test_orphan_annotations_and_unlisted_files_are_counted_and_warned(
    tmp_path: Path, caplog
) -> None:
    raw = make_coco(tmp_path / "coco")
    path = raw / "annotations" / "instances_val2017.json"
    data = _load(path)
    data["annotations"].append(_annotation(299, 777, 1, [1, 1, 2, 2]))
    write_json(path, data)
    (raw / "val2017" / "000000000099.jpg").write_bytes(_jpeg((8, 8), 99))
    (raw / "val2017" / "notes.txt").write_text("not listed")
    out = tmp_path / "out"
    with caplog.at_level("WARNING", logger="dlpipe"):
        assert convert(raw, out) == 0
    messages = " | ".join(r.getMessage() for r in caplog.records)
    assert "1 annotations name an image id their file does not list (777)" in messages
    assert "2 files in the image folders are in no instances file" in messages
    source = dlpipe.read_manifest(str(out)).source
    assert source["orphan_annotations"] == 1 and source["unused"]["other"] == 2
    assert dlpipe.read_manifest(str(out)).splits["val"].samples == 3


def _replace(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def _break_file(raw: Path, case: str) -> str:
    """Break the train instances file as a whole; return what the error line must name."""
    path = raw / "annotations" / "instances_train2017.json"
    text = path.read_text()
    data = json.loads(text)
    if case == "deep-nesting":
        path.write_text('{"images": [' + "[" * 100_000 + "]" * 100_000 + "]}")
        return "nesting deeper than 16 levels"
    if case == "deep-and-truncated":
        path.write_text('{"images": ' + "[" * 100_000)
        return "nesting deeper than 16 levels"
    if case == "huge-number":
        path.write_text(_replace(text, "[1.5, 2.25, 10.0, 12.5]", "[1.5, 2.25, 1e999, 12.5]"))
        return "not finite or beyond"
    if case == "nan":
        path.write_text(_replace(text, '"area": 125.0', '"area": NaN'))
        return "not finite or beyond"
    if case == "long-integer":
        path.write_text(_replace(text, '"id": 101', '"id": 1' + "0" * 5000))
        return "an integer of too many digits"
    if case == "truncated":
        path.write_text(text[: len(text) // 2])
        return "(is it truncated?)"
    if case == "not-an-object":
        path.write_text(json.dumps([data]))
        return "the file is not a JSON object (it begins with '[')"
    if case == "no-categories":
        del data["categories"]
        write_json(path, data)
        return "no 'categories' list"
    if case == "duplicate-key":
        path.write_text(text[:-1] + ', "images": []}')
        return "the key 'images' given twice"
    if case == "not-utf8":
        path.write_bytes(
            _replace(text, "COCO 2017", "COCO \udcff2017").encode("utf-8", "surrogateescape")
        )
        return "not UTF-8 text"
    if case == "duplicate-image-id":
        data["images"][1]["id"] = 1
        write_json(path, data)
        return "images[1]: image id 1 is given twice"
    if case == "categories-differ":
        data["categories"][0]["name"] = "aeroplane"
        write_json(path, data)
        return "categories differ from"
    if case == "two-files-one-split":
        write_json(raw / "annotations" / "instances_train2014.json", data)
        return "are both split train"
    if case == "no-image-folder":
        for p in (raw / "train2017").iterdir():
            p.unlink()
        (raw / "train2017").rmdir()
        return f"its images are in none of {raw / 'train2017'}"
    # most images missing: the wrong folder, or not extracted
    for name in ("000000000001.jpg", "000000000002.jpg", "000000000003.jpg"):
        (raw / "train2017" / name).unlink()
    return f"{raw / 'train2017'}: 3 of the 4 images"


FILE_CASES = ["deep-nesting", "deep-and-truncated", "huge-number", "nan", "long-integer",
              "truncated", "not-an-object", "no-categories", "duplicate-key", "not-utf8",
              "duplicate-image-id", "categories-differ", "two-files-one-split",
              "no-image-folder", "images-missing"]  # fmt: skip


@pytest.mark.parametrize("case", FILE_CASES)
def test_bad_instances_file_is_one_error_line(tmp_path: Path, case: str, capsys) -> None:
    raw = make_coco(tmp_path / "coco")
    expected = _break_file(raw, case)
    assert convert(raw, tmp_path / "out") == 2
    line = _one_error(capsys)
    assert expected in line, line
    assert not (tmp_path / "out" / "dlpipe.json").exists()


def test_instances_file_that_is_a_fifo_is_refused_without_hanging(tmp_path: Path) -> None:
    raw = make_coco(tmp_path / "coco")
    path = raw / "annotations" / "instances_val2017.json"
    path.unlink()
    os.mkfifo(path)
    command = [sys.executable, "-m", "dlpipe", "convert", str(raw), "--to", "wds",
               "--out", str(tmp_path / "out"), "--source", "coco"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: is a FIFO"), done.stderr


def _write_large(path: Path, images: int, per_image: int) -> None:
    """An instances file of `images` x `per_image` annotations, each with a 32-vertex polygon
    (the polygons are most of COCO's bytes), written in pieces."""
    vertices = ", ".join(f"{100 + i * 0.37:.2f}" for i in range(64))
    with path.open("w") as f:
        f.write('{"info": {}, "images": [')
        f.write(", ".join(
            json.dumps({"id": i, "file_name": f"{i:012d}.jpg", "width": 640, "height": 480})
            for i in range(images)
        ))  # fmt: skip
        f.write('], "annotations": [')
        for i in range(images):
            f.write("" if i == 0 else ", ")
            f.write(", ".join(
                f'{{"segmentation": [[{vertices}]], "area": 702.1, "iscrowd": 0, "image_id": {i}, '
                f'"bbox": [{i % 600}.07, 395.93, 38.65, 28.67], "category_id": 5, '
                f'"id": {i * per_image + j}}}'
                for j in range(per_image)
            ))  # fmt: skip
        f.write('], "categories": ' + json.dumps(CATEGORIES) + "}")


_MEASURE = textwrap.dedent(
    """
    import json, sys, tracemalloc
    from dlpipe.converters.coco_json import read_instances
    path, how = sys.argv[1], sys.argv[2]
    tracemalloc.start()  # Python's own allocations, after the imports: no page-cache noise
    if how in ("stream", "spans"):
        found = read_instances(path, sys.argv[3], spans=how == "spans")
        count = sum(len(v) for v in found.objects.values())
    else:
        with open(path) as f:
            count = len(json.load(f)["annotations"])
    peak = tracemalloc.get_traced_memory()[1]
    print(json.dumps({"kib": peak // 1024, "annotations": count}))
    """
)


def _peak_kib(path: Path, how: str) -> dict[str, int]:
    command = [sys.executable, "-c", _MEASURE, str(path), how, str(path.parent)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout)  # type: ignore[no-any-return]


@pytest.mark.slow
def test_large_instances_file_is_read_with_bounded_memory(tmp_path: Path) -> None:
    """100k annotations (63 MB): the stream's peak of Python allocations is about 0.46x the file
    (the compact per-annotation tuples it keeps; 29 MB on CPython 3.11), 0.54x with each
    annotation's byte span (``--instance-masks``: 34 MB); json.load, the control, peaks at about
    5x the file, so the bound tells them apart."""
    path = tmp_path / "instances_train.json"
    _write_large(path, images=10_000, per_image=10)
    size_kib = path.stat().st_size // 1024
    stream = _peak_kib(path, "stream")
    assert stream["annotations"] == 100_000
    bound = size_kib * 6 // 10
    assert stream["kib"] < bound, (stream, size_kib)
    spans = _peak_kib(path, "spans")  # --instance-masks: one int more per annotation
    assert spans["annotations"] == 100_000 and spans["kib"] < bound, (spans, size_kib)
    control = _peak_kib(path, "load")
    assert control["annotations"] == 100_000 and control["kib"] > bound, (control, size_kib)


def test_dlpipe_train_as_a_classifier_refuses_a_detection_dataset_naming_its_task(
    tmp_path: Path, capsys
) -> None:
    assert convert(make_coco(tmp_path / "raw"), tmp_path / "out") == 0
    capsys.readouterr()
    args = ["train", str(tmp_path / "out"), "--task", "classification"]
    assert main([*args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert line.startswith("error: ") and "is a detection dataset" in line
    assert "--task detection" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


# --- --instance-masks: masks.json ----------------------------------------------------------------


def expected_masks(data: dict[str, Any]) -> dict[str, tuple[list[int], list[np.ndarray]]]:
    """key → [height, width] and each object's mask, made here from the JSON: a rectangle's
    polygon by pycocotools' pixel-centre rule (`test_rle.pixel_centres`), a crowd region by
    expanding its column-major runs."""
    expected = {}
    for image in data["images"]:
        h, w = image["height"], image["width"]
        masks = []
        for a in (a for a in data["annotations"] if a["image_id"] == image["id"]):
            segmentation = a["segmentation"]
            if isinstance(segmentation, dict):
                runs = segmentation["counts"]
                flat = np.repeat(np.arange(len(runs)) % 2, runs).astype(np.uint8)
                masks.append(flat.reshape(w, h).T)
            else:
                x, y, bw, bh = a["bbox"]
                masks.append(pixel_centres((x, y, x + bw, y + bh), h, w))
        expected[os.path.splitext(image["file_name"])[0]] = ([h, w], masks)
    return expected


def stored_masks(out: Path, split: str) -> dict[str, dict[str, Any]]:
    found = {}
    for sample in dlpipe.open_dataset(out, split, rank=0, world_size=1):
        record = json.loads(sample["masks.json"])
        assert set(record) == {"size", "counts"}
        boxes = json.loads(sample["boxes.json"])["boxes"]
        assert len(record["counts"]) == len(boxes)
        size = Image.open(io.BytesIO(sample["jpg"])).size
        assert record["size"] == [size[1], size[0]]
        masks = [rle.decode(c, record["size"]) for c in record["counts"]]
        found[unescape_key(sample["__key__"])] = {**record, "masks": masks}
    return found


@pytest.mark.parametrize("fmt", ["wds", "lmdb", "hdf5"])
def test_instance_masks_in_every_format_are_pycocotools_masks(tmp_path: Path, fmt: str) -> None:
    raw = make_coco(tmp_path / "coco")
    out = tmp_path / "out"
    assert convert(raw, out, fmt, "--instance-masks") == 0
    manifest = dlpipe.read_manifest(str(out))
    schemas = {"boxes.json": BOXES_SCHEMA, "masks.json": INSTANCE_MASKS_SCHEMA}
    assert manifest.field_schemas == schemas and manifest.fields["masks.json"] == "json"
    assert manifest.options["instance_masks"] is True and manifest.source["skipped"] == 0
    assert manifest.source["unused"]["instance masks"] == 0
    assert "converted" in manifest.source["segmentation"]
    for split in ("train", "val"):
        data = _load(raw / "annotations" / f"instances_{split}2017.json")
        found, expected = stored_masks(out, split), expected_masks(data)
        assert sorted(found) == sorted(expected)
        for key, (size, masks) in expected.items():
            assert found[key]["size"] == size and len(found[key]["masks"]) == len(masks)
            for got, wanted in zip(found[key]["masks"], masks, strict=True):
                assert np.array_equal(got, wanted), key
    train = stored_masks(out, "train")
    crowd = _load(raw / "annotations" / "instances_train2017.json")["annotations"][3]
    assert crowd["iscrowd"] == 1  # its counts are kept as given, as frPyObjects keeps them
    assert train["000000000003"]["counts"][0] == rle.string_of(crowd["segmentation"]["counts"])
    assert train["000000000004"]["counts"] == []  # a background image: no objects, no masks


def test_instance_masks_follow_max_side(tmp_path: Path) -> None:
    raw = make_coco(tmp_path / "coco")
    out = tmp_path / "out"
    assert convert(raw, out, "wds", "--instance-masks", "--max-side", "24") == 0
    found = stored_masks(out, "train")
    expected = expected_masks(_load(raw / "annotations" / "instances_train2017.json"))
    assert found["000000000001"]["size"] == [18, 24]  # 40x30 → 24x18
    assert found["000000000004"]["size"] == [24, 24]  # not larger: kept
    for key, (_, masks) in expected.items():
        height, width = found[key]["size"]
        for got, wanted in zip(found[key]["masks"], masks, strict=True):
            resized = Image.fromarray(wanted).resize((width, height), Image.Resampling.NEAREST)
            assert np.array_equal(got, np.asarray(resized)), key


MASK_CASES = {
    "rle-size": ({"counts": [1536], "size": [30, 40]}, "its RLE's size [30, 40] is not [48, 32]"),
    "rle-sum": ({"counts": [5, 10], "size": [48, 32]}, "cover 15 pixels, not the 48x32 = 1536"),
    "rle-string": ({"counts": "52203", "size": [48, 32]}, "cover 16 pixels, not the 48x32"),
    "rle-negative": ({"counts": [1537, -1], "size": [48, 32]}, "not a list of integers >= 0"),
    "polygon-text": ([[0, 0, "x", 0, 32, 48]], "polygon 0 is not a list of finite numbers"),
    "polygon-far": ([[0, 0, 1e9, 0, 32, 48]], "polygon 0 has a coordinate beyond"),
    "neither": (5, "5 is neither polygons nor an RLE"),
}


@pytest.mark.parametrize("case", list(MASK_CASES))
def test_a_bad_instance_mask_skips_only_its_image(tmp_path: Path, case: str, capsys) -> None:
    raw = make_coco(tmp_path / "coco")
    path = raw / "annotations" / "instances_train2017.json"
    data = _load(path)
    segmentation, rule = MASK_CASES[case]
    next(a for a in data["annotations"] if a["id"] == 102)["segmentation"] = segmentation
    write_json(path, data)
    out = tmp_path / "out"
    assert convert(raw, out, "wds", "--instance-masks") == 0
    (error,) = error_records(out)
    assert unescape_key(error["key"]) == "000000000002", error
    assert "annotation 102" in error["error"] and rule in error["error"], error
    assert sorted(stored_masks(out, "train")) == ["000000000001", "000000000003", "000000000004"]
    capsys.readouterr()
    assert convert(raw, tmp_path / "fail", "wds", "--instance-masks", "--on-error", "fail") == 2
    assert rule in _one_error(capsys)
    assert convert(raw, tmp_path / "boxes") == 0  # without the option the masks are not read


def test_objects_without_segmentation_get_all_zero_masks(tmp_path: Path) -> None:
    raw = tmp_path / "rf"
    _roboflow(raw)  # Roboflow writes "segmentation": [] for box-only objects
    out = tmp_path / "out"
    assert convert(raw, out, "wds", "--instance-masks", source="auto") == 0
    found = stored_masks(out, "train")
    counts = [m for sample in found.values() for m in sample["masks"]]
    assert len(counts) == 1 and not counts[0].any()


def test_instance_masks_with_another_source_is_refused(tmp_path: Path, capsys) -> None:
    folders = tmp_path / "folders"
    for name in ("cat", "dog"):
        (folders / name).mkdir(parents=True)
        (folders / name / "a.jpg").write_bytes(_jpeg((8, 8), 1))
    out = tmp_path / "out"
    assert convert(folders, out, "wds", "--instance-masks", source="imagefolder") == 2
    line = _one_error(capsys)
    assert "--instance-masks" in line and "--source imagefolder" in line
    assert convert(folders, out, "wds", "--instance-masks", source="auto") == 2
    line = _one_error(capsys)
    assert "reads as imagefolder" in line and "--instance-masks" in line
    with pytest.raises(ConvertOptionError, match="--instance-masks"):
        ConvertConfig.from_options(str(folders), "wds", source="voc", instance_masks=True)
    assert not (out / "dlpipe.json").exists()


def test_instance_masks_is_repeated_by_the_printed_resume_command(tmp_path: Path) -> None:
    config = ConvertConfig.from_options(str(tmp_path / "raw"), "lmdb", instance_masks=True)
    assert config.command("--resume").endswith(" --instance-masks --resume")


def test_an_instances_file_changed_after_the_scan_skips_its_images(tmp_path: Path) -> None:
    raw = make_coco(tmp_path / "coco")
    source = CocoSource(str(raw), SourceOptions(instance_masks=True))
    item = next(i for i in source.scan().items if i.key == "000000000001")
    assert len(json.loads(source.load(item)["masks.json"])["counts"]) == 3
    path = raw / "annotations" / "instances_train2017.json"
    path.write_text(" " + path.read_text())  # every span moves by one byte
    with pytest.raises(SampleError, match="changed since the scan"):
        source.load(item)


@pytest.mark.parametrize("bom", [False, True], ids=["plain", "bom"])
@pytest.mark.parametrize("indent", [None, 2], ids=["compact", "indented"])
def test_spans_point_at_each_annotation_across_buffer_edges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, indent: int | None, bom: bool
) -> None:
    """Byte spans through a 5-character buffer, in a file of multi-byte characters (UTF-8
    names before and among the annotations) and an optional byte-order mark."""
    monkeypatch.setattr(coco_json, "_CHUNK_CHARS", 5)
    data = instances(_images(1, 4, "caf\u00e9-\u732b/{:03d}.jpg"), _train_annotations())
    data["info"]["description"] = "\u00fcber \U0001f431 COCO"
    for a in data["annotations"]:
        a["note"] = "\u732b" * (a["id"] % 3)
    path = tmp_path / "instances.json"
    text = json.dumps(data, indent=indent, ensure_ascii=False)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8"))
    found = coco_json.read_instances(str(path), str(tmp_path), spans=True)
    stat = path.stat()
    assert found.stamp == (stat.st_size, stat.st_mtime_ns) and found.spans is not None
    raw, by_id = path.read_bytes(), {a["id"]: a for a in data["annotations"]}
    spans = [(obj, span) for i in found.objects for obj, span in
             zip(found.objects[i], found.spans[i], strict=True)]  # fmt: skip
    assert len(spans) == len(by_id)
    for obj, span in spans:
        element = raw[span >> 32 : (span >> 32) + (span & 0xFFFFFFFF)]
        assert json.loads(element) == by_id[obj[0]]
