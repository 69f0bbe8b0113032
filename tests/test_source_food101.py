"""The food101 source reads Food-101 as its archive unpacks, and refuses broken split lists."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import error_records, one_error
from splitlist_fixtures import (
    FOOD_CLASSES,
    FOOD_LABELS,
    FOOD_TEST,
    FOOD_TRAIN,
    convert,
    jpeg,
    make_food101,
    samples,
    write,
)

import dlpipe
from dlpipe.converters.sources import open_source


def _expected(lists: dict[str, list[str]]) -> dict[str, int]:
    return {rel: FOOD_CLASSES.index(c) for c, rels in lists.items() for rel in rels}


@pytest.mark.parametrize(("given", "fmt"), [("parent", "wds"), ("food-101", "lmdb")])
def test_food101_converts_both_official_splits(tmp_path: Path, given: str, fmt: str) -> None:
    food = make_food101(tmp_path / "raw")
    raw = food.parent if given == "parent" else food
    out = tmp_path / "out"
    assert convert(raw, out, fmt) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert list(manifest.classes) == sorted(FOOD_CLASSES) == FOOD_CLASSES
    assert manifest.task == "classification" and manifest.class_ids is None
    source = manifest.source
    assert source["kind"] == "food101" and source["class_names"] == FOOD_LABELS
    prefix = "food-101/" if given == "parent" else ""
    assert source["layout"] == "Food-101 (" + ", ".join(
        f"{prefix}meta/{n}" for n in ("classes.txt", "labels.txt", "test.txt", "train.txt")
    ) + ")"  # fmt: skip
    # beignets/999999.jpg is in no list; train.json and test.json are not read
    assert source["unused"] == {"images": 1, "annotation files": 0, "split lists": 2,
                                "masks": 0, "other": 2}  # fmt: skip
    assert {k: s.samples for k, s in manifest.splits.items()} == {"train": 9, "test": 6}
    for split, lists in (("train", FOOD_TRAIN), ("test", FOOD_TEST)):
        got = samples(out, split)
        assert {k: int(s["cls"]) for k, s in got.items()} == _expected(lists)
        for key, sample in got.items():
            assert sample["jpg"] == (food / "images" / f"{key}.jpg").read_bytes()
    assert "beignets/999999" not in samples(out, "train")


def test_food101_is_detected_by_its_names(tmp_path: Path) -> None:
    food = make_food101(tmp_path / "raw")
    assert open_source(str(food)).kind == "food101"
    assert open_source(str(food.parent)).kind == "food101"
    (food / "meta" / "classes.txt").unlink()  # without it the folder is no Food-101
    assert open_source(str(food)).kind != "food101"


def _break(food: Path, case: str) -> str:
    """Break one line of train.txt; return what its errors.jsonl line must say."""
    train = food / "meta" / "train.txt"
    lines = train.read_text().splitlines()
    bad = {
        "malformed": "apple_pie 1005649",
        "no-slash": "apple_pie",
        "unknown-class": "churros/1004234",
        "missing-image": "apple_pie/424242",
    }[case]
    lines.insert(2, bad)
    train.write_text("\n".join(lines) + "\n")
    where = f"{train} line 3: "
    if case == "unknown-class":
        return where + "names class 'churros', not one of the 3 in classes.txt"
    if case == "missing-image":
        image = food / "images" / "apple_pie" / "424242.jpg"
        return where + f"names {image}, which does not exist"
    return where + f"{bad!r} is not '<class>/<image id>'"


@pytest.mark.parametrize("case", ["malformed", "no-slash", "unknown-class", "missing-image"])
def test_one_bad_line_skips_only_its_sample(tmp_path: Path, case: str, capsys) -> None:
    food = make_food101(tmp_path / "raw")
    expected = _break(food, case)
    out = tmp_path / "out"
    assert convert(food, out, "hdf5") == 0
    (error,) = error_records(out)
    assert expected in error["error"], error
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.splits["train"].samples == 9 and manifest.source["skipped"] == 1
    assert convert(food, tmp_path / "fail", "wds", "--on-error", "fail") == 2
    assert expected in one_error(capsys)


def _break_dataset(food: Path, case: str) -> str:
    meta = food / "meta"
    if case == "images-missing":
        for image in (food / "images" / "apple_pie").iterdir():
            image.unlink()
        for image in (food / "images" / "baby_back_ribs").iterdir():
            image.unlink()
        image = food / "images" / "baby_back_ribs" / "1017.jpg"
        return (
            f"{meta / 'train.txt'}: 6 of its 9 entries cannot be used, e.g. "
            f"{meta / 'train.txt'} line 4: names {image}, which does not exist"
        )
    if case == "duplicate-class":
        write(meta / "classes.txt", "apple_pie\nbeignets\napple_pie\n")
        return f"{meta / 'classes.txt'} names 'apple_pie' twice"
    if case == "labels-count":
        write(meta / "labels.txt", "Apple pie\n")
        return f"{meta / 'labels.txt'} has 1 names for the 3 classes of classes.txt"
    if case == "train-and-test":
        write(meta / "test.txt", (meta / "test.txt").read_text() + "apple_pie/1000\n")
        return "both name 'images/apple_pie/1000.jpg', in splits train and test"
    if case == "no-test-list":
        (meta / "test.txt").unlink()
        return f"{meta / 'test.txt'} is missing"
    (meta / "train.txt").write_bytes(b"\xff\xfe garbage")
    return f"{meta / 'train.txt'}: not UTF-8 text"


DATASET_CASES = ["images-missing", "duplicate-class", "labels-count", "train-and-test",
                 "no-test-list", "not-utf8"]  # fmt: skip


@pytest.mark.parametrize("case", DATASET_CASES)
def test_a_broken_dataset_is_one_error_line(tmp_path: Path, case: str, capsys) -> None:
    food = make_food101(tmp_path / "raw")
    expected = _break_dataset(food, case)
    assert convert(food, tmp_path / "out") == 2
    line = one_error(capsys)
    assert expected in line, line
    assert not (tmp_path / "out" / "dlpipe.json").exists()


def test_a_listed_image_that_is_a_fifo_is_one_skipped_sample(tmp_path: Path) -> None:
    food = make_food101(tmp_path / "raw")
    image = food / "images" / "apple_pie" / "1000.jpg"
    image.unlink()
    os.mkfifo(image)
    out = tmp_path / "out"
    assert convert(food, out) == 0
    (error,) = error_records(out)
    assert f"names {image}, which is a FIFO" in error["error"]
    assert dlpipe.read_manifest(str(out)).source["skipped_entries"] == 1


def test_labels_txt_is_optional(tmp_path: Path) -> None:
    food = make_food101(tmp_path / "raw")
    (food / "meta" / "labels.txt").unlink()
    write(food / "images" / "apple_pie" / "extra.png", jpeg(5))  # another image in no list
    assert convert(food, tmp_path / "out") == 0
    source = dlpipe.read_manifest(str(tmp_path / "out")).source
    assert "class_names" not in source and source["unused"]["images"] == 2
