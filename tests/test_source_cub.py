"""The cub200 source reads CUB-200-2011 as its archive unpacks: splits, classes and boxes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import error_records, one_error
from splitlist_fixtures import (
    CUB_CLASSES,
    CUB_FLAGS,
    convert,
    cub_box,
    cub_image,
    make_cub,
    samples,
    write,
)

import dlpipe
from dlpipe.annotations import BOXES_SCHEMA
from dlpipe.converters.sources import open_source
from dlpipe.sample import unescape_key


def _expected(split: str) -> dict[str, int]:
    flag = 1 if split == "train" else 0
    return {
        cub_image(i).rsplit(".", 1)[0]: (i - 1) // 3
        for i in range(1, len(CUB_FLAGS) + 1)
        if CUB_FLAGS[i - 1] == flag
    }


@pytest.mark.parametrize(("given", "fmt"), [("parent", "wds"), ("CUB_200_2011", "hdf5")])
def test_cub_converts_splits_classes_and_every_box(tmp_path: Path, given: str, fmt: str) -> None:
    cub = make_cub(tmp_path / "raw")
    raw = cub.parent if given == "parent" else cub
    out = tmp_path / "out"
    assert convert(raw, out, fmt) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert list(manifest.classes) == CUB_CLASSES and manifest.class_ids == (1, 2, 3)
    assert manifest.task == "classification"
    assert manifest.field_schemas == {"boxes.json": BOXES_SCHEMA}
    assert {k: s.samples for k, s in manifest.splits.items()} == {"train": 5, "test": 4}
    unused = manifest.source["unused"]
    # parts/ (3) and attributes/ (3) inside, attributes.txt beside: only when the parent is given
    expected = {"images": 1, "annotation files": 7 if given == "parent" else 6,
                "split lists": 0, "masks": 0, "other": 1}  # fmt: skip
    assert unused == expected
    prefix = "CUB_200_2011/" if given == "parent" else ""
    assert manifest.source["layout"].startswith(f"CUB-200-2011 ({prefix}images.txt, ")
    ids = {cub_image(i).rsplit(".", 1)[0]: i for i in range(1, len(CUB_FLAGS) + 1)}
    for split in ("train", "test"):
        got = samples(out, split)
        assert {k: int(s["cls"]) for k, s in got.items()} == _expected(split)
        for key, sample in got.items():
            image_id = ids[key]
            x, y, w, h = cub_box(image_id)
            assert json.loads(sample["boxes.json"]) == {
                "boxes": [[x, y, x + w, y + h]], "labels": [(image_id - 1) // 3], "iscrowd": [0]
            }  # fmt: skip
            assert sample["jpg"] == (cub / "images" / f"{key}.jpg").read_bytes()


def test_cub_is_detected_by_its_names(tmp_path: Path) -> None:
    cub = make_cub(tmp_path / "raw")
    assert open_source(str(cub)).kind == "cub200"
    assert open_source(str(cub.parent)).kind == "cub200"


def _rewrite(path: Path, image_id: int, line: str | None) -> None:
    """Replace (None: drop) the row of `image_id` in a CUB table."""
    rows = [x for x in path.read_text().splitlines() if x.split()[0] != str(image_id)]
    if line is not None:
        rows.insert(image_id - 1, line)
    path.write_text("\n".join(rows) + "\n")


def _break_sample(cub: Path, case: str) -> tuple[int, str]:
    """Break image 4 (a test image) one way; return its id and what its error must say."""
    if case == "no-label":
        _rewrite(cub / "image_class_labels.txt", 4, None)
        return 4, f"{cub / 'images.txt'} line 4: image 4 has no row in image_class_labels.txt"
    if case == "bad-label":
        _rewrite(cub / "image_class_labels.txt", 4, "4 seven")
        return 4, "image_class_labels.txt line 4 gives image 4 the class 'seven', not one of"
    if case == "unknown-class":
        _rewrite(cub / "image_class_labels.txt", 4, "4 200")
        return 4, "the class '200', not one of classes.txt"
    if case == "bad-box":
        _rewrite(cub / "bounding_boxes.txt", 4, "4 1.0 2.0 wide 3.0")
        return 4, "bounding_boxes.txt line 4: '1.0 2.0 wide 3.0' is not '<x> <y> <width> <height>'"
    if case == "no-box":
        _rewrite(cub / "bounding_boxes.txt", 4, None)
        return 4, "image 4 has no row in bounding_boxes.txt"
    if case == "empty-box":
        _rewrite(cub / "bounding_boxes.txt", 4, "4 5.0 5.0 0.0 10.0")
        return 4, "has no positive width and height"
    if case == "box-outside":
        _rewrite(cub / "bounding_boxes.txt", 4, "4 30.0 5.0 20.0 10.0")
        return 4, "lies outside the 36x32 image"
    (cub / "images" / cub_image(4)).unlink()
    return 4, f"names {cub / 'images' / cub_image(4)}, which does not exist"


SAMPLE_CASES = ["no-label", "bad-label", "unknown-class", "bad-box", "no-box", "empty-box",
                "box-outside", "missing-image"]  # fmt: skip


@pytest.mark.parametrize("case", SAMPLE_CASES)
def test_one_bad_image_is_one_skipped_sample(tmp_path: Path, case: str, capsys) -> None:
    cub = make_cub(tmp_path / "raw")
    image_id, expected = _break_sample(cub, case)
    out = tmp_path / "out"
    assert convert(cub, out) == 0
    (error,) = error_records(out)
    assert unescape_key(error["key"]) == cub_image(image_id).rsplit(".", 1)[0]
    assert expected in error["error"], error
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.splits["test"].samples == 3 and manifest.splits["train"].samples == 5
    assert convert(cub, tmp_path / "fail", "lmdb", "--on-error", "fail") == 2
    assert expected in one_error(capsys)


def _break_dataset(cub: Path, case: str) -> str:
    if case == "bad-split-flag":
        _rewrite(cub / "train_test_split.txt", 3, "3 2")
        return f"{cub / 'train_test_split.txt'} line 3: '2' is not 1 (train) or 0 (test)"
    if case == "bad-image-id":
        _rewrite(cub / "images.txt", 3, f"three {cub_image(3)}")
        return f"{cub / 'images.txt'} line 3: 'three' is not an id"
    if case == "no-image-path":
        _rewrite(cub / "images.txt", 3, "3")
        return f"{cub / 'images.txt'} line 3: not '<image_id> <path>'"
    if case == "label-for-no-image":
        write(
            cub / "image_class_labels.txt", (cub / "image_class_labels.txt").read_text() + "99 1\n"
        )
        return "image_class_labels.txt line 10: names image 99, which images.txt does not list"
    if case == "repeated-id":
        write(cub / "bounding_boxes.txt", (cub / "bounding_boxes.txt").read_text() + "2 1 1 5 5\n")
        return "bounding_boxes.txt line 10: repeats id 2 (line 2)"
    if case == "classes-line":
        write(cub / "classes.txt", "1 001.Black_footed_Albatross\n2\n")
        return f"{cub / 'classes.txt'} line 2: not '<class_id> <name>'"
    if case == "most-images-missing":
        for i in (1, 3, 5, 6, 8):
            (cub / "images" / cub_image(i)).unlink()
        images = cub / "images.txt"
        return f"{images}: 5 of its 9 entries cannot be used, e.g. {images} line 1: names"
    (cub / "train_test_split.txt").unlink()
    return f"{cub}: not the CUB-200-2011 layout, which has images.txt, train_test_split.txt"


DATASET_CASES = ["bad-split-flag", "bad-image-id", "no-image-path", "label-for-no-image",
                 "repeated-id", "classes-line", "most-images-missing",
                 "no-split-table"]  # fmt: skip


@pytest.mark.parametrize("case", DATASET_CASES)
def test_a_broken_table_is_one_error_line(tmp_path: Path, case: str, capsys) -> None:
    cub = make_cub(tmp_path / "raw")
    expected = _break_dataset(cub, case)
    kind = ("--source", "cub200") if case == "no-split-table" else ()
    assert convert(cub, tmp_path / "out", "wds", *kind) == 2
    line = one_error(capsys)
    assert expected in line, line
    assert not (tmp_path / "out" / "dlpipe.json").exists()


def test_an_image_without_a_split_row_is_unused_not_train(tmp_path: Path) -> None:
    cub = make_cub(tmp_path / "raw")
    _rewrite(cub / "train_test_split.txt", 2, None)  # image 2 is a test image
    out = tmp_path / "out"
    assert convert(cub, out) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert {k: s.samples for k, s in manifest.splits.items()} == {"train": 5, "test": 3}
    assert manifest.source["unused"]["images"] == 2 and manifest.source["skipped"] == 0
    key = cub_image(2).rsplit(".", 1)[0]
    assert key not in samples(out, "train") and key not in samples(out, "test")
