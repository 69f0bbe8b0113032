"""The oxford-pets source reads Oxford-IIIT Pet as its archives unpack: breeds and trimaps."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import error_records, one_error
from PIL import Image
from splitlist_fixtures import (
    PETS,
    convert,
    image_of,
    make_pets,
    pets_lines,
    png,
    samples,
    trimap,
    write,
)

import dlpipe
from dlpipe.annotations import mask_schema
from dlpipe.converters.sources import open_source

NAMES = ["Abyssinian", "American Bulldog", "Bengal", "Great Pyrenees"]


def _seeds() -> dict[str, int]:
    listed = [x.split()[0] for lines in pets_lines().values() for x in lines]
    return {stem: seed for seed, stem in enumerate(listed)}


@pytest.mark.parametrize(("given", "fmt"), [("folder", "wds"), ("torchvision", "lmdb")])
def test_pets_converts_breeds_and_every_trimap_pixel(tmp_path: Path, given: str, fmt: str) -> None:
    raw = tmp_path / "raw"
    pets = make_pets(raw / "oxford-iiit-pet" if given == "torchvision" else raw)
    out = tmp_path / "out"
    assert convert(raw, out, fmt) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert list(manifest.classes) == NAMES and manifest.class_ids == (1, 2, 6, 16)
    assert manifest.source["breeds"] == [breed for breed, *_ in PETS]
    assert manifest.task == "classification"
    assert manifest.field_schemas == {
        "seg.png": mask_schema({1: "pet", 2: "background", 3: "border"})
    }
    # Bengal_99 and its trimap are in no list; 2 xmls; 3 .mat files and the README; the
    # AppleDouble ._*.png files are never read nor counted
    assert manifest.source["unused"] == {"images": 1, "annotation files": 2, "split lists": 0,
                                         "masks": 1, "other": 4}  # fmt: skip
    assert {k: s.samples for k, s in manifest.splits.items()} == {"trainval": 8, "test": 4}
    seeds = _seeds()
    for split, lines in pets_lines().items():
        got = samples(out, split)
        expected = {x.split()[0]: [int(v) for v in x.split()[1:]] for x in lines}
        assert sorted(got) == sorted(expected)
        for stem, sample in got.items():
            class_id, species, breed_id = expected[stem]
            assert int(sample["cls"]) == [p[1] for p in PETS].index(class_id)
            assert json.loads(sample["json"]) == {
                "species": ["Cat", "Dog"][species - 1], "breed_id": breed_id
            }  # fmt: skip
            mask = np.asarray(Image.open(io.BytesIO(sample["seg.png"])))
            assert np.array_equal(mask, trimap(seeds[stem]))
            assert sample["jpg"] == (pets / "images" / f"{stem}.jpg").read_bytes()


def test_pets_is_detected_before_file_name_labels(tmp_path: Path) -> None:
    pets = make_pets(tmp_path / "raw")
    assert open_source(str(pets)).kind == "oxford-pets"
    (pets / "annotations" / "trainval.txt").unlink()
    assert open_source(str(pets)).kind == "oxford-pets"  # test.txt alone still names it


def test_a_png_named_jpg_is_converted(tmp_path: Path) -> None:
    """A few images of the real archive are PNGs (some RGBA) behind a .jpg name."""
    pets = make_pets(tmp_path / "raw")
    rgba = np.random.default_rng(0).integers(0, 256, (32, 36, 4), dtype=np.uint8)
    write(pets / "images" / "Abyssinian_2.jpg", png(rgba, "RGBA"))
    assert convert(pets, tmp_path / "out") == 0
    sample = samples(tmp_path / "out", "trainval")["Abyssinian_2"]
    assert image_of(sample).size == (36, 32) and "seg.png" in sample


def _break_sample(pets: Path, case: str) -> tuple[str, str, str]:
    """Break one image one way; (split, image, what its errors.jsonl line must say)."""
    notes = pets / "annotations"
    if case == "malformed":
        text = (notes / "test.txt").read_text().replace("Bengal_173 6 1 2", "Bengal_173 6 cat 2")
        (notes / "test.txt").write_text(text)
        return "test", "Bengal_173", f"{notes / 'test.txt'} line 3: 'Bengal_173 6 cat 2' is not"
    if case == "no-trimap":
        (notes / "trimaps" / "Bengal_2.png").unlink()
        return (
            "trainval",
            "Bengal_2",
            f"image Bengal_2 has no trimap {'annotations/trimaps/Bengal_2.png'}",
        )
    if case == "odd-trimap":
        write(notes / "trimaps" / "Bengal_2.png", png(np.zeros((32, 36), np.uint8)))
        return "trainval", "Bengal_2", "this one has values [0]"
    if case == "trimap-size":
        write(notes / "trimaps" / "Bengal_2.png", png(np.ones((8, 8), np.uint8)))
        return "trainval", "Bengal_2", "the mask is 8x8, its image 36x32"
    (pets / "images" / "Bengal_2.jpg").unlink()
    return "trainval", "Bengal_2", f"names {pets / 'images' / 'Bengal_2.jpg'}, which does not exist"


@pytest.mark.parametrize(
    "case", ["malformed", "no-trimap", "odd-trimap", "trimap-size", "no-image"]
)
def test_one_bad_image_is_one_skipped_sample(tmp_path: Path, case: str, capsys) -> None:
    pets = make_pets(tmp_path / "raw")
    split, stem, expected = _break_sample(pets, case)
    out = tmp_path / "out"
    assert convert(pets, out, "hdf5") == 0
    (error,) = error_records(out)
    assert error["key"] == stem and expected in error["error"], error
    assert stem not in samples(out, split)
    assert dlpipe.read_manifest(str(out)).splits[split].samples == (3 if split == "test" else 7)
    assert convert(pets, tmp_path / "fail", "wds", "--on-error", "fail") == 2
    assert expected in one_error(capsys)


def _break_dataset(pets: Path, case: str) -> str:
    notes = pets / "annotations"
    if case == "two-breeds":
        write(notes / "test.txt", (notes / "test.txt").read_text() + "beagle_1 2 2 4\n")
        return f"{notes / 'test.txt'} line 5: CLASS-ID 2 is breed 'beagle', but"
    if case == "in-both-splits":
        write(notes / "test.txt", (notes / "test.txt").read_text() + "Bengal_1 6 1 2\n")
        return "both name 'images/Bengal_1.jpg', in splits trainval and test"
    if case == "no-test-list":
        (notes / "test.txt").unlink()
        return f"{notes / 'test.txt'} is missing"
    if case == "no-trimaps":
        for path in (notes / "trimaps").iterdir():
            path.unlink()
        return f"{notes / 'trainval.txt'}: 8 of its 8 entries cannot be used, e.g. "
    write(notes / "trainval.txt", "Abyssinian_1\nBengal_1\n")
    write(notes / "test.txt", "great_pyrenees_173\n")
    (notes / "list.txt").unlink()
    return f"{notes / 'trainval.txt'}: no line 'Image CLASS-ID SPECIES BREED-ID'"


@pytest.mark.parametrize("case", ["two-breeds", "in-both-splits", "no-test-list", "no-trimaps",
                                  "no-class-ids"])  # fmt: skip
def test_a_broken_dataset_is_one_error_line(tmp_path: Path, case: str, capsys) -> None:
    pets = make_pets(tmp_path / "raw")
    expected = _break_dataset(pets, case)
    assert convert(pets, tmp_path / "out") == 2
    line = one_error(capsys)
    assert expected in line, line
    assert not (tmp_path / "out" / "dlpipe.json").exists()
