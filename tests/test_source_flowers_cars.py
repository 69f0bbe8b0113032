"""flowers102 and stanford-cars read their MATLAB split files as torchvision does, bounded."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import error_records, one_error
from splitlist_fixtures import (
    CAR_NAMES,
    CAR_TEST,
    CAR_TRAIN,
    FLOWER_LABELS,
    FLOWER_SETID,
    car_annotations,
    convert,
    make_cars,
    make_flowers,
    samples,
    savemat,
)

import dlpipe
from dlpipe.annotations import BOXES_SCHEMA
from dlpipe.converters.source import SourceError
from dlpipe.converters.sources import open_source
from dlpipe.converters.splitlist_mat import load_mat

pytest.importorskip("scipy.io")

FLOWER_SPLITS = {"train": "trnid", "val": "valid", "test": "tstid"}


@pytest.mark.parametrize(
    ("given", "options"), [("parent", {}), ("flowers-102", {"do_compression": True})]
)
def test_flowers_converts_three_splits(tmp_path: Path, given: str, options: dict) -> None:
    from torchvision.datasets import Flowers102

    flowers = make_flowers(tmp_path / "raw", **options)
    out = tmp_path / "out"
    assert convert(flowers.parent if given == "parent" else flowers, out, "lmdb") == 0
    manifest = dlpipe.read_manifest(str(out))
    assert list(manifest.classes) == Flowers102.classes
    assert manifest.class_ids == tuple(range(1, 103))
    assert manifest.source["unused"]["images"] == 1  # image 13 is in no split
    assert {k: s.samples for k, s in manifest.splits.items()} == {"train": 4, "val": 4, "test": 4}
    for split, variable in FLOWER_SPLITS.items():
        got = samples(out, split)
        expected = {f"image_{i:05d}": FLOWER_LABELS[i - 1] - 1 for i in FLOWER_SETID[variable]}
        assert {k: int(s["cls"]) for k, s in got.items()} == expected
        for key, sample in got.items():
            assert sample["jpg"] == (flowers / "jpg" / f"{key}.jpg").read_bytes()


def test_detection_by_names(tmp_path: Path) -> None:
    flowers = make_flowers(tmp_path / "raw")
    cars = make_cars(tmp_path / "raw")
    assert open_source(str(flowers)).kind == "flowers102"
    assert open_source(str(cars)).kind == "stanford-cars"
    assert open_source(str(tmp_path / "raw")).kind == "flowers102"  # flowers-102/ comes first


def _ids(flowers: Path, **changes: list) -> None:
    savemat(flowers / "setid.mat", {k: np.array([v], np.float64)
                                    for k, v in {**FLOWER_SETID, **changes}.items()})  # fmt: skip


@pytest.mark.parametrize("case", ["no-label", "label-out-of-range", "no-image"])
def test_flowers_bad_image_is_one_skipped_sample(tmp_path: Path, case: str, capsys) -> None:
    flowers = make_flowers(tmp_path / "raw")
    setid = flowers / "setid.mat"
    if case == "no-label":
        _ids(flowers, tstid=[12, 9, 10, 11, 40])
        key, expected = "image_00040", f"{setid} 'tstid' entry 5: image 40 has no label"
    elif case == "label-out-of-range":
        labels = np.array([[0, *FLOWER_LABELS[1:]]], np.uint8)
        savemat(flowers / "imagelabels.mat", {"labels": labels})
        key, expected = "image_00001", "'trnid' entry 1: image 1 has label 0, not one of 1..102"
    else:
        (flowers / "jpg" / "image_00009.jpg").unlink()
        key, expected = "image_00009", f"names {flowers / 'jpg' / 'image_00009.jpg'}, which does"
    out = tmp_path / "out"
    assert convert(flowers, out) == 0
    (error,) = error_records(out)
    assert error["key"] == key and expected in error["error"], error
    assert convert(flowers, tmp_path / "fail", "wds", "--on-error", "fail") == 2
    assert expected in one_error(capsys)


def _break_flowers(flowers: Path, case: str) -> str:
    setid = flowers / "setid.mat"
    if case == "not-whole":
        _ids(flowers, valid=[2, 4.5])
        return f"{setid} 'valid' is missing or not a vector of whole numbers"
    if case == "two-splits":
        _ids(flowers, valid=[2, 4, 6, 8, 1])
        return "both name 'jpg/image_00001.jpg', in splits train and val"
    if case == "garbage":
        setid.write_bytes(b"MATLAB 7.3 MAT-file, HDF5" + bytes(200))
        return f"{setid}: no MATLAB 5 header"
    if case == "no-labels-file":
        (flowers / "imagelabels.mat").unlink()
        return f"{flowers}: not the Flowers-102 layout, which has jpg/, imagelabels.mat"
    if case == "most-missing":
        for i in (2, 4, 6):
            (flowers / "jpg" / f"image_{i:05d}.jpg").unlink()
        return f"{setid} 'valid': 3 of its 4 entries cannot be used, e.g. {setid} 'valid' entry 1"
    savemat(flowers / "setid.mat", {"trnid": np.array([[1, 3]], np.uint16)})
    return f"{setid} 'valid' is missing or not a vector of whole numbers"


FLOWER_CASES = ["not-whole", "two-splits", "garbage", "no-labels-file", "most-missing",
                "no-valid"]  # fmt: skip


@pytest.mark.parametrize("case", FLOWER_CASES)
def test_flowers_broken_split_files_are_one_error_line(tmp_path: Path, case: str, capsys) -> None:
    flowers = make_flowers(tmp_path / "raw")
    expected = _break_flowers(flowers, case)
    kind = ("--source", "flowers102") if case == "no-labels-file" else ()
    assert convert(flowers, tmp_path / "out", "wds", *kind) == 2
    assert expected in one_error(capsys)


def _patched(data: bytes, old: bytes, new: bytes) -> bytes:
    assert data.count(old) == 1
    return data.replace(old, new)


def test_crafted_mat_files_are_refused_before_scipy_allocates(tmp_path: Path) -> None:
    path = savemat(tmp_path / "x.mat", {"labels": np.zeros((1, 4), np.uint8)})
    dims = struct.pack("<II", 5, 8) + struct.pack("<ii", 1, 4)  # miINT32, 8 bytes: 1 x 4
    huge = struct.pack("<II", 5, 8) + struct.pack("<ii", 1, 1 << 30)
    path.write_bytes(_patched(path.read_bytes(), dims, huge))
    with pytest.raises(SourceError, match="an array claims 1073741824 elements"):
        load_mat(str(tmp_path), str(path))
    cell = np.empty((1, 2), dtype=object)
    cell[0, :] = ["a", "b"]
    path = savemat(tmp_path / "cell.mat", {"names": cell})
    inner = struct.pack("<II", 5, 8) + struct.pack("<ii", 1, 1)  # the first name: 1 x 1 char
    path.write_bytes(
        path.read_bytes().replace(
            inner, struct.pack("<II", 5, 8) + struct.pack("<ii", 1 << 20, 1 << 10), 1
        )
    )
    with pytest.raises(SourceError, match="an array claims"):
        load_mat(str(tmp_path), str(path))
    nested: object = "deep"
    for _ in range(20):
        outer = np.empty((1, 1), dtype=object)
        outer[0, 0] = nested
        nested = outer
    path = savemat(tmp_path / "deep.mat", {"nested": nested})
    with pytest.raises(SourceError, match="nested over 16 deep"):
        load_mat(str(tmp_path), str(path))
    bomb = savemat(tmp_path / "bomb.mat", {"big": np.zeros((1, 17 << 20), np.uint8)},
                   do_compression=True)  # fmt: skip
    assert bomb.stat().st_size < 1 << 20
    with pytest.raises(SourceError, match="a variable inflates past 16 MiB"):
        load_mat(str(tmp_path), str(bomb))


def test_missing_scipy_names_the_install(tmp_path: Path, monkeypatch, capsys) -> None:
    flowers = make_flowers(tmp_path / "raw")
    monkeypatch.setitem(sys.modules, "scipy.io", None)
    monkeypatch.setitem(sys.modules, "scipy", None)
    assert convert(flowers, tmp_path / "out") == 2
    line = one_error(capsys)
    assert "reading MATLAB files needs scipy, which is not installed: pip install scipy" in line


def _box(row: tuple) -> list:
    _, _, x1, y1, x2, y2 = row
    return [x1 - 1, y1 - 1, x2, y2]


def test_cars_converts_splits_classes_and_boxes(tmp_path: Path) -> None:
    cars = make_cars(tmp_path / "raw")
    out = tmp_path / "out"
    assert convert(tmp_path / "raw", out, "hdf5") == 0
    manifest = dlpipe.read_manifest(str(out))
    assert list(manifest.classes) == CAR_NAMES and manifest.class_ids == (1, 2, 3)
    assert manifest.field_schemas == {"boxes.json": BOXES_SCHEMA}
    # devkit/cars_test_annos.mat (no labels) is not read; README, eval_train.m, the preds
    assert manifest.source["unused"] == {"images": 0, "annotation files": 1, "split lists": 0,
                                         "masks": 0, "other": 3}  # fmt: skip
    for split, rows in (("train", CAR_TRAIN), ("test", CAR_TEST)):
        got = samples(out, split)
        assert sorted(got) == [row[0][:-4] for row in rows]
        for row in rows:
            sample = got[row[0][:-4]]
            assert int(sample["cls"]) == row[1] - 1
            assert json.loads(sample["boxes.json"]) == {
                "boxes": [_box(row)], "labels": [row[1] - 1], "iscrowd": [0]
            }  # fmt: skip
            assert sample["jpg"] == (cars / f"cars_{split}" / row[0]).read_bytes()


def test_cars_without_test_labels_leaves_the_test_split_out(tmp_path: Path) -> None:
    cars = make_cars(tmp_path / "raw")
    (cars / "cars_test_annos_withlabels.mat").unlink()
    out = tmp_path / "out"
    assert convert(cars, out) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert list(manifest.splits) == ["train"]
    assert "test" in manifest.source["left_out"]
    assert manifest.source["unused"]["images"] == len(CAR_TEST)


def test_cars_bad_class_is_one_skipped_sample(tmp_path: Path) -> None:
    cars = make_cars(tmp_path / "raw")
    rows = [*CAR_TRAIN[:3], ("00004.jpg", 9, 10, 2, 35, 31)]
    savemat(cars / "devkit" / "cars_train_annos.mat", car_annotations(rows))
    out = tmp_path / "out"
    assert convert(cars, out) == 0
    (error,) = error_records(out)
    annos = cars / "devkit" / "cars_train_annos.mat"
    assert error["key"] == "00004"
    assert f"{annos} 'annotations' entry 4: has class 9, not one of 1..3" in error["error"]
