"""Datasets with split lists built in a folder exactly as their archives unpack (tiny images)."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import dlpipe
from dlpipe.cli import main
from dlpipe.sample import unescape_key

# Food-101: classes.txt is sorted; labels.txt holds the display names in the same order
FOOD_CLASSES = ["apple_pie", "baby_back_ribs", "beignets"]
FOOD_LABELS = ["Apple pie", "Baby back ribs", "Beignets"]
FOOD_TRAIN = {c: [f"{c}/{1000 + 17 * i + n}" for n in range(3)] for i, c in enumerate(FOOD_CLASSES)}
FOOD_TEST = {c: [f"{c}/{2000 + 13 * i + n}" for n in range(2)] for i, c in enumerate(FOOD_CLASSES)}


def jpeg(seed: int, size: tuple[int, int] = (36, 32)) -> bytes:
    """A JPEG of random 4x4-pixel blocks (distinct difference hashes: no near duplicates)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (-(-size[1] // 4), -(-size[0] // 4), 3), dtype=np.uint8)
    pixels = np.kron(blocks, np.ones((4, 4, 1), dtype=np.uint8))[: size[1], : size[0]]
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


def png(pixels: np.ndarray, mode: str | None = None) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode).save(buffer, "PNG")
    return buffer.getvalue()


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)
    return path


def make_food101(parent: Path) -> Path:
    """``food-101.tar.gz`` unpacked into `parent`; returns the ``food-101`` folder."""
    root = parent / "food-101"
    listed = [rel for lists in (FOOD_TRAIN, FOOD_TEST) for rels in lists.values() for rel in rels]
    for seed, rel in enumerate(sorted(listed)):
        write(root / "images" / f"{rel}.jpg", jpeg(seed))
    write(root / "images" / "beignets" / "999999.jpg", jpeg(99))  # in no list
    write(root / "meta" / "classes.txt", "".join(f"{c}\n" for c in FOOD_CLASSES))
    write(root / "meta" / "labels.txt", "".join(f"{c}\n" for c in FOOD_LABELS))
    for split, lists in (("train", FOOD_TRAIN), ("test", FOOD_TEST)):
        lines = [rel for c in reversed(FOOD_CLASSES) for rel in lists[c]]  # not in class order
        write(root / "meta" / f"{split}.txt", "\n".join(lines) + "\n")
        write(root / "meta" / f"{split}.json", json.dumps(lists))
    write(root / "README.txt", "Food-101 data set\n")
    write(root / "license_agreement.txt", "license\n")
    return root


def convert(raw: Path, out: Path, fmt: str = "wds", *extra: str) -> int:
    return main(["convert", str(raw), "--to", fmt, "--out", str(out), "--workers", "1", *extra])


def samples(out: Path, split: str) -> dict[str, dict]:
    """Every sample of a split by its unescaped key."""
    dataset = dlpipe.open_dataset(out, split, rank=0, world_size=1)
    return {unescape_key(s["__key__"]): s for s in dataset}


def image_of(sample: dict) -> Image.Image:
    return Image.open(io.BytesIO(sample["jpg"] if "jpg" in sample else sample["png"]))


def appledouble() -> bytes:
    """A macOS ``._name`` AppleDouble header (what tar archives made on a Mac carry)."""
    return struct.pack(">IIH", 0x00051607, 0x00020000, 0) + b"Mac OS X        " + bytes(40)


# CUB-200-2011: classes are 1-based ids; images are numbered in class order
CUB_CLASSES = ["001.Black_footed_Albatross", "002.Laysan_Albatross", "003.Sooty_Albatross"]
CUB_FLAGS = [1, 0, 1, 0, 1, 1, 0, 1, 0]  # train_test_split.txt, image 1 first


def cub_image(image_id: int) -> str:
    """images.txt's path of image `image_id` (3 per class)."""
    name = CUB_CLASSES[(image_id - 1) // 3]
    species = "_".join(p.title() for p in name.split(".", 1)[1].split("_"))
    return f"{name}/{species}_{image_id:04d}_{100 + image_id}.jpg"


def cub_box(image_id: int) -> tuple[float, float, float, float]:
    """bounding_boxes.txt's x, y, width, height of image `image_id` (inside 36x32)."""
    return (float(image_id), 2.0 + image_id / 2, 20.0 + image_id / 2, 12.5)


def make_cub(parent: Path) -> Path:
    """``CUB_200_2011.tgz`` unpacked into `parent`; returns the ``CUB_200_2011`` folder."""
    root = parent / "CUB_200_2011"
    ids = range(1, len(CUB_FLAGS) + 1)
    for i in ids:
        write(root / "images" / cub_image(i), jpeg(200 + i))
    write(root / "images" / CUB_CLASSES[0] / "Not_Listed_0001.jpg", jpeg(299))
    write(root / "classes.txt", "".join(f"{c + 1} {n}\n" for c, n in enumerate(CUB_CLASSES)))
    write(root / "images.txt", "".join(f"{i} {cub_image(i)}\n" for i in ids))
    write(root / "image_class_labels.txt", "".join(f"{i} {(i - 1) // 3 + 1}\n" for i in ids))
    write(root / "train_test_split.txt", "".join(f"{i} {CUB_FLAGS[i - 1]}\n" for i in ids))
    boxes = "".join(f"{i} " + " ".join(str(v) for v in cub_box(i)) + "\n" for i in ids)
    write(root / "bounding_boxes.txt", boxes)
    write(root / "parts" / "parts.txt", "1 back\n2 beak\n")
    write(root / "parts" / "part_locs.txt", "".join(f"{i} 1 10.0 11.0 1\n" for i in ids))
    write(root / "parts" / "part_click_locs.txt", "1 1 10.0 11.0 1 0.5\n")
    write(root / "attributes" / "certainties.txt", "1 not visible\n")
    write(root / "attributes" / "image_attribute_labels.txt", "1 1 0 3 27.7\n")
    write(root / "attributes" / "class_attribute_labels_continuous.txt", "0.0 0.0\n")
    write(root / "README", "The Caltech-UCSD Birds-200-2011 dataset\n")
    write(parent / "attributes.txt", "1 has_bill_shape::curved_(up_or_down)\n")
    return root


# Oxford-IIIT Pet: (file-name breed, CLASS-ID, SPECIES, BREED-ID) of four of the 37 classes
PETS = [("Abyssinian", 1, 1, 1), ("american_bulldog", 2, 2, 1), ("Bengal", 6, 1, 2),
        ("great_pyrenees", 16, 2, 10)]  # fmt: skip
PETS_HEADER = (
    "#Image CLASS-ID SPECIES BREED ID\n#ID: 1:37 Class ids\n#SPECIES: 1:Cat 2:Dog\n"
    "#BREED ID: 1-25:Cat 1:12:Dog\n#All images with 1st letter as captial are cat images\n"
    "#images with small first letter are dog images\n"
)


def pets_lines() -> dict[str, list[str]]:
    """trainval.txt and test.txt lines: images 1 and 2 of each breed train, 3 test."""
    lists: dict[str, list[str]] = {"trainval": [], "test": []}
    for breed, class_id, species, breed_id in PETS:
        for n in (1, 2, 173):
            split = "test" if n == 173 else "trainval"
            lists[split].append(f"{breed}_{n} {class_id} {species} {breed_id}")
    return lists


def trimap(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 4, (32, 36), dtype=np.uint8)


def make_pets(parent: Path) -> Path:
    """``images.tar.gz`` and ``annotations.tar.gz`` unpacked side by side in `parent`."""
    lists = pets_lines()
    listed = [line.split()[0] for lines in lists.values() for line in lines]
    for seed, stem in enumerate([*listed, "Bengal_99"]):  # Bengal_99: in no list
        write(parent / "images" / f"{stem}.jpg", jpeg(300 + seed))
        write(parent / "annotations" / "trimaps" / f"{stem}.png", png(trimap(seed)))
        write(parent / "annotations" / "trimaps" / f"._{stem}.png", appledouble())
    for n in (100, 101, 102):  # the real images/ holds three .mat files
        write(parent / "images" / f"Abyssinian_{n}.mat", b"MATLAB 5.0 MAT-file")
    for stem in ("Abyssinian_1", "great_pyrenees_2"):  # head boxes of some trainval images
        write(parent / "annotations" / "xmls" / f"{stem}.xml", f"<annotation>{stem}</annotation>")
    for split, lines in lists.items():
        write(parent / "annotations" / f"{split}.txt", "".join(f"{x}\n" for x in lines))
    every = sorted(lists["trainval"] + lists["test"], key=str.lower)
    write(parent / "annotations" / "list.txt", PETS_HEADER + "".join(f"{x}\n" for x in every))
    write(parent / "annotations" / "README", "OXFORD-IIIT PET Dataset\n")
    return parent


# Flowers-102: image i (1-based) has FLOWER_LABELS[i - 1]; image 13 is in no split
FLOWER_LABELS = [77, 77, 1, 1, 102, 102, 50, 50, 1, 77, 102, 50, 1]
FLOWER_SETID = {"trnid": [1, 3, 5, 7], "valid": [2, 4, 6, 8], "tstid": [12, 9, 10, 11]}


def savemat(path: Path, variables: dict, **options: object) -> Path:
    sio = pytest.importorskip("scipy.io")
    path.parent.mkdir(parents=True, exist_ok=True)
    sio.savemat(str(path), variables, **options)  # type: ignore[attr-defined]
    return path


def make_flowers(parent: Path, **options: object) -> Path:
    """torchvision's ``flowers-102/``: ``102flowers.tgz``'s ``jpg/`` and the two .mat files."""
    root = parent / "flowers-102"
    for i in range(1, len(FLOWER_LABELS) + 1):
        write(root / "jpg" / f"image_{i:05d}.jpg", jpeg(400 + i))
    savemat(root / "imagelabels.mat", {"labels": np.array([FLOWER_LABELS], np.uint8)}, **options)
    setid = {k: np.array([v], np.uint16) for k, v in FLOWER_SETID.items()}
    savemat(root / "setid.mat", setid, **options)
    return root


# Stanford Cars: three class names; (fname, class, x1, y1, x2, y2) per image, 1-based bounds
CAR_NAMES = ["AM General Hummer SUV 2000", "Acura RL Sedan 2012", "Acura TL Sedan 2012"]
CAR_TRAIN = [("00001.jpg", 1, 1, 1, 36, 32), ("00002.jpg", 3, 4, 5, 30, 20),
             ("00003.jpg", 2, 2, 3, 20, 30), ("00004.jpg", 1, 10, 2, 35, 31)]  # fmt: skip
CAR_TEST = [("00001.jpg", 2, 3, 3, 33, 29), ("00002.jpg", 3, 1, 1, 12, 12),
            ("00003.jpg", 1, 5, 6, 25, 26)]  # fmt: skip
CAR_FIELDS = ("bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2", "class", "fname")


def car_annotations(rows: list[tuple], labelled: bool = True) -> dict:
    fields = CAR_FIELDS if labelled else tuple(f for f in CAR_FIELDS if f != "class")
    annotations = np.zeros((1, len(rows)), dtype=[(f, "O") for f in fields])
    for i, (fname, class_id, x1, y1, x2, y2) in enumerate(rows):
        values = {"bbox_x1": x1, "bbox_y1": y1, "bbox_x2": x2, "bbox_y2": y2, "class": class_id}
        for name in fields[:-1]:
            annotations[0, i][name] = np.array([[values[name]]], np.uint16)
        annotations[0, i]["fname"] = fname
    return {"annotations": annotations}


def make_cars(parent: Path) -> Path:
    """torchvision's ``stanford_cars/`` (the devkit, both image folders, the test labels)."""
    root = parent / "stanford_cars"
    for split, rows in (("train", CAR_TRAIN), ("test", CAR_TEST)):
        for seed, (fname, *_) in enumerate(rows):
            write(root / f"cars_{split}" / fname, jpeg(500 + 10 * len(split) + seed))
    names = np.empty((1, len(CAR_NAMES)), dtype=object)
    names[0, :] = CAR_NAMES
    savemat(root / "devkit" / "cars_meta.mat", {"class_names": names})
    savemat(root / "devkit" / "cars_train_annos.mat", car_annotations(CAR_TRAIN))
    savemat(root / "devkit" / "cars_test_annos.mat", car_annotations(CAR_TEST, labelled=False))
    savemat(root / "cars_test_annos_withlabels.mat", car_annotations(CAR_TEST))
    write(
        root / "devkit" / "README.txt", "This file gives documentation for the cars 196 dataset.\n"
    )
    write(root / "devkit" / "eval_train.m", "function eval_train()\n")
    write(root / "devkit" / "train_perfect_preds.txt", "1\n3\n2\n1\n")
    return root
