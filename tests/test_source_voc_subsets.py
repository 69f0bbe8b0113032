"""A CVAT "Pascal VOC" export names its subset lists after its subsets (``default.txt``,
``Train.txt``, ``Validation.txt``): voc and voc-seg read each as a split (``default`` as none),
still pass over per-class lists, and refuse a name they cannot store or an id in two lists."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import one_error
from PIL import Image
from test_source_voc import _jpeg, annotation_xml, by_key, convert, make_voc
from test_source_voc_labelmap import FRAMES, LABELS, SEG_CLASSES, index_mask, labelmap_text, rgb_png

import dlpipe

IDS = list(FRAMES)


def make_cvat_export(raw: Path, subsets: dict[str, list[str]] | None = None) -> Path:
    """A CVAT "Pascal VOC" export as it ships, unpacked: ``labelmap.txt``, ``Annotations/``,
    ``JPEGImages/``, ``ImageSets/Main/<subset>.txt`` and a per-class ``<label>_<subset>.txt``
    ('<id> 1' or '<id> -1') for every label, plus the segmentation lists and masks."""
    subsets = {"default": IDS} if subsets is None else subsets
    for folder in ("Annotations", "JPEGImages", "SegmentationClass", "ImageSets/Main",
                   "ImageSets/Segmentation"):  # fmt: skip
        (raw / folder).mkdir(parents=True)
    (raw / "labelmap.txt").write_text(labelmap_text(void=False))
    for seed, (ident, (width, height, objects)) in enumerate(FRAMES.items()):
        (raw / "JPEGImages" / f"{ident}.jpg").write_bytes(_jpeg(width, height, seed))
        voc_objects = [(n, "Unspecified", 0, 0, *box) for n, *box in objects]
        xml = annotation_xml(ident, width, height, voc_objects)
        (raw / "Annotations" / f"{ident}.xml").write_text(xml)
        (raw / "SegmentationClass" / f"{ident}.png").write_bytes(rgb_png(cvat_mask(ident)))
    for subset, ids in subsets.items():
        for task in ("Main", "Segmentation"):
            (raw / "ImageSets" / task / f"{subset}.txt").write_text("".join(f"{i}\n" for i in ids))
        for label, _ in LABELS:
            lines = [f"{i} {1 if _shows(i, label) else -1}\n" for i in ids]
            (raw / "ImageSets" / "Main" / f"{label}_{subset}.txt").write_text("".join(lines))
    return raw


def cvat_mask(ident: str) -> np.ndarray:
    """`index_mask` without the void: CVAT's labelmap has no void line."""
    mask = index_mask(ident)
    mask[mask == 255] = 0
    return mask


def _shows(ident: str, label: str) -> bool:
    return any(name == label for name, *_ in FRAMES[ident][2])


def test_a_cvat_export_converts_every_box_of_its_default_subset(tmp_path: Path) -> None:
    raw = make_cvat_export(tmp_path / "raw")
    assert convert(raw, tmp_path / "out", "lmdb") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.classes == ("roof", "solar_panel", "crack")
    assert {k: s.samples for k, s in manifest.splits.items()} == {"train": 3}
    source = manifest.source
    assert source["skipped"] == 0
    assert source["split_lists"] == {"default": str(raw / "ImageSets" / "Main" / "default.txt")}
    # the 4 per-class lists and the Segmentation list; the 3 masks
    assert source["unused"] == {"annotation files": 0, "split lists": 5, "masks": 3, "other": 0}
    samples = by_key(tmp_path / "out", "train")
    assert sorted(samples) == IDS
    for ident, sample in samples.items():
        boxes = json.loads(sample["boxes.json"])
        objects = FRAMES[ident][2]
        assert [manifest.classes[label] for label in boxes["labels"]] == [o[0] for o in objects]
        assert boxes["boxes"] == [[x0 - 1, y0 - 1, x1, y1] for _, x0, y0, x1, y1 in objects]
        assert boxes["difficult"] == boxes["truncated"] == [0] * len(objects)
        assert sample["jpg"] == (raw / "JPEGImages" / f"{ident}.jpg").read_bytes()


def test_the_default_subset_is_divided_by_val_fraction(tmp_path: Path) -> None:
    raw = make_cvat_export(tmp_path / "raw")
    assert convert(raw, tmp_path / "out", "wds", "--val-fraction", "0.34") == 0
    splits = dlpipe.read_manifest(str(tmp_path / "out")).splits
    assert {k: s.samples for k, s in splits.items()} == {"train": 2, "val": 1}


def test_a_cvat_segmentation_export_reads_its_default_subset(tmp_path: Path) -> None:
    raw = make_cvat_export(tmp_path / "raw")
    assert convert(raw, tmp_path / "out", "wds", "--source", "voc-seg") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.classes == SEG_CLASSES and set(manifest.splits) == {"train"}
    samples = by_key(tmp_path / "out", "train")
    assert sorted(samples) == IDS
    for ident, sample in samples.items():
        mask = np.asarray(Image.open(io.BytesIO(sample["seg.png"])))
        assert np.array_equal(mask, cvat_mask(ident))


@pytest.mark.parametrize("kind", ["voc", "voc-seg"])
def test_named_subsets_map_to_train_and_val(tmp_path: Path, kind: str) -> None:
    subsets = {"Train": IDS[:2], "Validation": IDS[2:]}
    raw = make_cvat_export(tmp_path / "raw", subsets)
    assert convert(raw, tmp_path / "out", "wds", "--source", kind) == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert {k: s.samples for k, s in manifest.splits.items()} == {"train": 2, "val": 1}
    assert sorted(by_key(tmp_path / "out", "train")) == IDS[:2]
    assert sorted(by_key(tmp_path / "out", "val")) == IDS[2:]
    assert set(manifest.source["split_lists"]) == {"train", "val"}


def test_another_subset_name_is_its_own_split(tmp_path: Path) -> None:
    raw = make_cvat_export(tmp_path / "raw", {"train": IDS[:2], "Holdout_2": IDS[2:]})
    assert convert(raw, tmp_path / "out", "wds") == 0
    splits = dlpipe.read_manifest(str(tmp_path / "out")).splits
    assert {k: s.samples for k, s in splits.items()} == {"train": 2, "holdout_2": 1}


def test_vocs_per_class_lists_stay_unread_beside_its_splits(tmp_path: Path) -> None:
    voc = make_voc(tmp_path / "raw")
    for name in ("cat_val.txt", "pottedplant_trainval.txt", "train_train.txt"):
        (voc / "ImageSets" / "Main" / name).write_text("2008_000001 -1\n2008_000003  1\n")
    assert convert(tmp_path / "raw", tmp_path / "out") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert {k: s.samples for k, s in manifest.splits.items()} == {"train": 2, "val": 2}
    assert manifest.source["unused"]["split lists"] == 6 + 3


def _break(raw: Path, case: str) -> str:
    lists = raw / "ImageSets" / "Main"
    if case == "bad-name":
        (lists / "my-set.txt").write_text(f"{IDS[0]}\n")
        return "my-set.txt: subset 'my-set' is no split name dlpipe can store"
    if case == "two-files-one-name":
        (lists / "Validation.txt").write_text(f"{IDS[0]}\n")
        (lists / "val.txt").write_text(f"{IDS[1]}\n")
        return "both name subset 'val'"
    if case == "in-two-subsets":
        (lists / "Train.txt").write_text(f"{IDS[1]}\n")
        return f"id '{IDS[1]}' is listed twice"
    (lists / "default_extra.txt").write_text(f"{IDS[0]} 1\n")  # no label 'default'
    return f"default_extra.txt line 1: '{IDS[0]} 1' is not one image id"


@pytest.mark.parametrize(
    "case", ["bad-name", "two-files-one-name", "in-two-subsets", "unknown-class-list"]
)
def test_a_bad_subset_list_is_one_error_line(tmp_path: Path, case: str, capsys) -> None:
    raw = make_cvat_export(tmp_path / "raw")
    expected = _break(raw, case)
    assert convert(raw, tmp_path / "out", "wds") == 2
    line = one_error(capsys)
    assert expected in line, line
    assert not (tmp_path / "out" / "dlpipe.json").exists()
