"""The class-folder safety net (`dlpipe.converters.guard`): public datasets as they unpack are
never read as class folders of their parts, an archive's one top folder is never one class,
and ordinary class folders still convert as before.

The layouts' own sources (coco, yolo, voc, splitlist, hf) are replaced here by sources that
match nothing, so each test shows what answers when no specific source recognised a variant:
the guard, with one ``error:`` line that names what it found, what it looks like and the
command that converts it.
"""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import pytest
from PIL import Image

import dlpipe
from dlpipe.cli import main
from dlpipe.converters import sources
from dlpipe.converters.guard import is_structure_name
from dlpipe.converters.source import Scan, Source

STRUCTURE_KINDS = ("coco", "yolo", "voc", "splitlist", "hf")
BASE_KINDS = ("cifar", "mnist", "table", "filenames", "files", "imagenet", "imagefolder")


class NeverSource(Source):
    """A registered layout that never matches (its own detection missed this variant)."""

    kind = "never"

    @classmethod
    def detect(cls, root: str, listings: object = None) -> bool:
        return False

    def scan(self) -> Scan:
        raise AssertionError("never chosen")

    def load(self, item: object) -> dict[str, bytes]:
        raise AssertionError("never chosen")


class AlwaysSource(NeverSource):
    """A registered layout that matches every folder."""

    kind = "always"

    @classmethod
    def detect(cls, root: str, listings: object = None) -> bool:
        return True


@pytest.fixture(autouse=True)
def no_specific_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layout's own source but the generic ones matches nothing."""
    for kind in {*sources.SOURCE_KINDS, *STRUCTURE_KINDS} - set(BASE_KINDS):
        monkeypatch.setitem(sources.SOURCE_KINDS, kind, f"{__name__}:NeverSource")


def jpeg(index: int = 0) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 6), (index * 40 % 256, 90, 200)).save(out, "JPEG")
    return out.getvalue()


def png(index: int = 0) -> bytes:
    out = io.BytesIO()
    Image.new("L", (8, 6), index % 3).save(out, "PNG")
    return out.getvalue()


def put(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())


def class_folders(root: Path, names: tuple[str, ...] = ("cat", "dog"), per: int = 3) -> Path:
    for name in names:
        for i in range(per):
            put(root / name / f"{i:03d}.jpg", jpeg(i))
    return root


def pets(root: Path, *, images: str = "images", annotations: str = "annotations") -> Path:
    """Oxford-IIIT Pet as images.tar.gz + annotations.tar.gz unpack."""
    for breed in ("Abyssinian", "Bengal", "great_pyrenees"):
        for i in range(1, 4):
            put(root / images / f"{breed}_{i}.jpg", jpeg(i))
            put(root / annotations / "trimaps" / f"{breed}_{i}.png", png(i))
            put(root / annotations / "xmls" / f"{breed}_{i}.xml", "<annotation/>")
    put(root / images / "Abyssinian_1.mat", b"MATLAB 5.0")
    for name in ("list.txt", "trainval.txt", "test.txt", "README"):
        put(root / annotations / name, "Abyssinian_1 1 1 1\n")
    return root


def coco(root: Path, annotation: str = "instances_train2017.json") -> Path:
    document = {"info": {}, "images": [], "annotations": [], "categories": []}
    put(root / "annotations" / annotation, json.dumps(document))
    for split in ("train2017", "val2017"):
        for i in range(3):
            put(root / split / f"{i:012d}.jpg", jpeg(i))
    return root


def yolo(root: Path, yaml_name: str = "data.yaml") -> Path:
    put(root / yaml_name, "path: .\ntrain: images/train\nval: images/val\nnames:\n  0: cat\n")
    for split in ("train", "val"):
        for i in range(3):
            put(root / "images" / split / f"{i}.jpg", jpeg(i))
            put(root / "labels" / split / f"{i}.txt", "0 0.5 0.5 0.2 0.2\n")
    return root


def voc(devkit: Path) -> Path:
    year = devkit / "VOC2012"
    for i in range(3):
        stem = f"2007_{i:06d}"
        put(year / "JPEGImages" / f"{stem}.jpg", jpeg(i))
        put(year / "Annotations" / f"{stem}.xml", "<annotation/>")
        put(year / "SegmentationClass" / f"{stem}.png", png(i))
        put(year / "SegmentationObject" / f"{stem}.png", png(i))
    put(year / "ImageSets" / "Main" / "train.txt", "2007_000000\n")
    put(year / "ImageSets" / "Segmentation" / "train.txt", "2007_000000\n")
    return devkit


def food101(root: Path) -> Path:
    for name in ("apple_pie", "baklava"):
        for i in range(3):
            put(root / "images" / name / f"{100 + i}.jpg", jpeg(i))
    put(root / "meta" / "classes.txt", "apple_pie\nbaklava\n")
    put(root / "meta" / "labels.txt", "Apple pie\nBaklava\n")
    for split in ("train", "test"):
        put(root / "meta" / f"{split}.txt", "apple_pie/100\n")
        put(root / "meta" / f"{split}.json", '{"apple_pie": ["apple_pie/100"]}')
    put(root / "README.txt", "Food-101")
    put(root / "license_agreement.txt", "...")
    return root


def cub(root: Path) -> Path:
    for name in ("001.Black_footed_Albatross", "002.Laysan_Albatross"):
        for i in range(3):
            put(root / "images" / name / f"{name}_{i}.jpg", jpeg(i))
    for name in ("images.txt", "train_test_split.txt", "bounding_boxes.txt", "classes.txt"):
        put(root / name, "1 1\n")
    put(root / "image_class_labels.txt", "1 1\n")
    put(root / "parts" / "parts.txt", "1 back\n")
    put(root / "parts" / "part_locs.txt", "1 1 0 0 0\n")
    put(root / "attributes" / "certainties.txt", "1 not visible\n")
    put(root / "attributes" / "image_attribute_labels.txt", "1 1 0 0 0\n")
    put(root / "README", "CUB-200-2011")
    return root


def convert(raw: Path, out: Path, *flags: str) -> int:
    return main(["convert", str(raw), "--to", "lmdb", "--out", str(out), "--workers", "1", *flags])


def refused(raw: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Convert `raw`; assert exit 2, one ``error:`` line, no traceback, nothing written."""
    out = tmp_path / "out"
    assert convert(raw, out) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert not out.exists()
    assert "--keep-empty-classes" not in lines[0]
    return lines[0]


def kind_of(dataset: str) -> str:
    """A named split-list dataset's own --source, when registered, else splitlist."""
    return dataset if dataset in sources.SOURCE_KINDS else "splitlist"


def command(path: Path, kind: str | None = None) -> str:
    source = f" --source {kind}" if kind else ""
    return f"`dlpipe convert {path}{source} --to wds|lmdb|hdf5`"


# --- Oxford-IIIT Pet ---------------------------------------------------------------------------


def test_oxford_pets_is_refused_naming_its_split_lists_and_its_file_name_labels(
    tmp_path, capsys
) -> None:
    raw = pets(tmp_path / "oxford-iiit-pet")
    line = refused(raw, tmp_path, capsys)
    assert "annotations/, images/ would be its classes" in line
    assert "Oxford-IIIT Pet" in line and "annotations/trainval.txt" in line
    assert command(raw, kind_of("oxford-pets")) in line
    assert command(raw / "images", "filenames") in line  # the labels are in the names
    assert command(raw, "imagefolder") in line  # what reads the folders as classes anyway


@pytest.mark.parametrize(("images", "annotations"), [("Images", "Annotations"), ("imgs", "anns")])
def test_oxford_pets_folder_names_in_any_case_or_short_form_are_refused(
    tmp_path, capsys, images, annotations
) -> None:
    raw = pets(tmp_path / "pets", images=images, annotations=annotations)
    line = refused(raw, tmp_path, capsys)
    assert f"{annotations}/" in line and f"{images}/" in line


def test_pets_without_split_lists_is_still_refused_as_a_datasets_parts(tmp_path, capsys) -> None:
    raw = pets(tmp_path / "pets")
    for name in ("list.txt", "trainval.txt", "test.txt"):
        (raw / "annotations" / name).unlink()
    line = refused(raw, tmp_path, capsys)
    assert "names of a dataset's parts" in line
    assert "--source KIND" in line and "coco, yolo, voc, splitlist, hf" in line


def test_pets_read_as_class_folders_only_when_asked(tmp_path, capsys) -> None:
    raw = pets(tmp_path / "pets")
    out = tmp_path / "out"
    assert convert(raw, out, "--source", "imagefolder") == 0  # the explicit reading skips it
    assert dlpipe.read_manifest(str(out)).classes == ("annotations", "images")


# --- COCO ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "annotation",
    ["instances_train2017.json", "person_keypoints_val2017.json", "captions_train2014.json"],
)
def test_coco_is_refused_naming_its_annotation_file(tmp_path, capsys, annotation) -> None:
    raw = coco(tmp_path / "coco", annotation)
    line = refused(raw, tmp_path, capsys)
    assert "annotations/, train2017/, val2017/ would be its classes" in line
    assert f"COCO {'detection ' if annotation.startswith('instances') else ''}dataset" in line
    assert f"(annotations/{annotation})" in line
    assert command(raw, "coco") in line


def test_a_json_with_images_and_annotations_keys_is_coco_whatever_its_name(
    tmp_path, capsys
) -> None:
    raw = coco(tmp_path / "coco", "labels_2023.json")
    (raw / "train2017").rename(raw / "pictures")
    (raw / "val2017").rename(raw / "more")
    line = refused(raw, tmp_path, capsys)
    assert "COCO dataset (annotations/labels_2023.json)" in line


def test_coco_with_test_split_folders_and_no_annotations_is_refused_by_the_names(
    tmp_path, capsys
) -> None:
    raw = tmp_path / "coco"
    for split in ("train2014", "val2014", "test2015"):
        put(raw / split / "000000000001.jpg", jpeg(1))
    line = refused(raw, tmp_path, capsys)
    assert "test2015/, train2014/, val2014/ would be its classes" in line
    assert "names of a dataset's parts" in line


def test_coco_annotations_alone_are_a_coco_dataset_not_one_class(tmp_path, capsys) -> None:
    raw = tmp_path / "coco"
    put(raw / "annotations" / "instances_val2017.json", '{"images": []}')
    put(raw / "annotations" / "captions_val2017.json", '{"images": []}')
    put(raw / "annotations" / "000.jpg", jpeg())  # so the folder reads as one class
    line = refused(raw, tmp_path, capsys)
    assert "COCO" in line and command(raw, "coco") in line


def test_coco_read_as_class_folders_is_refused_without_keep_empty_advice(tmp_path, capsys) -> None:
    raw = coco(tmp_path / "coco")
    assert convert(raw, tmp_path / "out", "--source", "imagefolder") == 2
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("error:"))
    assert "annotations" in line and "annotation files" in line
    assert "--keep-empty-classes" not in line
    assert not (tmp_path / "out").exists()


# --- YOLO ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("yaml_name", ["data.yaml", "dataset.yaml", "coco128.yml"])
def test_yolo_is_refused_naming_its_yaml(tmp_path, capsys, yaml_name) -> None:
    raw = yolo(tmp_path / "yolo", yaml_name)
    line = refused(raw, tmp_path, capsys)
    assert "images/, labels/ would be its classes" in line
    assert f"YOLO dataset ({yaml_name} names its classes)" in line
    assert command(raw, "yolo") in line


def test_yolo_without_a_yaml_is_told_by_labels_beside_images(tmp_path, capsys) -> None:
    raw = yolo(tmp_path / "yolo")
    (raw / "data.yaml").unlink()
    line = refused(raw, tmp_path, capsys)
    assert "YOLO dataset (labels/ beside images/)" in line


def test_roboflow_yolo_export_with_split_folders_is_refused(tmp_path, capsys) -> None:
    raw = tmp_path / "export"
    put(raw / "data.yaml", "train: ../train/images\nval: ../valid/images\nnc: 1\nnames: ['a']\n")
    for split in ("train", "valid", "test"):
        put(raw / split / "images" / "a.jpg", jpeg())
        put(raw / split / "labels" / "a.txt", "0 0.5 0.5 0.1 0.1\n")
    line = refused(raw, tmp_path, capsys)
    assert "YOLO" in line and command(raw, "yolo") in line


def test_yolo_read_as_class_folders_never_suggests_keeping_labels_as_a_class(
    tmp_path, capsys
) -> None:
    raw = yolo(tmp_path / "yolo")
    assert convert(raw, tmp_path / "out", "--source", "imagefolder") == 2
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("error:"))
    assert str(raw / "labels") in line and "--keep-empty-classes" not in line


# --- Pascal VOC ------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_voc_at_any_depth_names_the_year_folder_and_source_voc(tmp_path, capsys, depth) -> None:
    devkit = voc(tmp_path / "download" / "VOCdevkit")
    raw = [devkit / "VOC2012", devkit, devkit.parent][depth]
    line = refused(raw, tmp_path, capsys)
    assert "Pascal VOC dataset (JPEGImages/, Annotations/, ImageSets/" in line
    assert command(devkit / "VOC2012", "voc") in line
    chain = ["", "VOC2012", "VOCdevkit/VOC2012"][depth]
    assert (f"its only folder, {chain}/, would be its one class" in line) == bool(chain)


# --- Food-101 and CUB-200-2011 ---------------------------------------------------------------


def test_food101_as_unpacked_names_the_inner_folder_and_its_split_lists(tmp_path, capsys) -> None:
    raw = tmp_path / "download"
    food101(raw / "food-101")
    line = refused(raw, tmp_path, capsys)
    assert "its only folder, food-101/, would be its one class" in line
    assert "images/, meta/ would be its classes" in line
    assert "meta/classes.txt" in line and "Food-101" in line
    assert command(raw / "food-101", kind_of("food101")) in line
    assert command(raw, "imagefolder") in line


def test_food101_given_directly_is_refused(tmp_path, capsys) -> None:
    raw = food101(tmp_path / "food-101")
    line = refused(raw, tmp_path, capsys)
    assert command(raw, kind_of("food101")) in line and "its only folder" not in line


@pytest.mark.parametrize("wrapped", [False, True])
def test_cub_is_refused_naming_its_lists(tmp_path, capsys, wrapped) -> None:
    inner = cub(tmp_path / "download" / "CUB_200_2011")
    if wrapped:
        put(inner.parent / "attributes.txt", "1 has_bill_shape::curved\n")  # as the tgz has
    raw = inner.parent if wrapped else inner
    line = refused(raw, tmp_path, capsys)
    assert "attributes/, images/, parts/ would be its classes" in line
    assert "CUB-200-2011 (split lists bounding_boxes.txt, classes.txt" in line
    assert command(inner, kind_of("cub200")) in line


# --- one folder: an archive's top folder -----------------------------------------------------


def test_an_archives_folder_of_class_folders_is_named_with_its_command(tmp_path, capsys) -> None:
    raw = tmp_path / "kagglecatsanddogs"
    class_folders(raw / "PetImages", ("Cat", "Dog"))
    put(raw / "readme[1].txt", "Microsoft")
    put(raw / "MSR-LA - 3467.docx", b"PK")
    line = refused(raw, tmp_path, capsys)
    assert "its only folder, PetImages/, would be its one class" in line
    assert "PetImages/ holds the class folders Cat/, Dog/" in line
    assert command(raw / "PetImages") in line


def test_two_nested_archive_folders_name_the_innermost(tmp_path, capsys) -> None:
    raw = tmp_path / "dl"
    class_folders(raw / "dataset" / "dataset", ("a", "b"))
    line = refused(raw, tmp_path, capsys)
    assert "its only folder, dataset/dataset/, would be its one class" in line
    assert command(raw / "dataset" / "dataset") in line


def test_an_archives_folder_of_split_folders_is_named(tmp_path, capsys) -> None:
    raw = tmp_path / "dl"
    class_folders(raw / "data" / "train")
    class_folders(raw / "data" / "val")
    line = refused(raw, tmp_path, capsys)
    assert command(raw / "data") in line


@pytest.mark.parametrize("inner", [Path("images"), Path("dogs-vs-cats/train")])
def test_an_archives_folder_of_labelled_file_names_reads_as_filenames(
    tmp_path, capsys, inner
) -> None:
    raw = tmp_path / "dl"
    for label in ("cat", "dog"):
        for i in range(3):
            put(raw / inner / f"{label}.{i}.jpg", jpeg(i))  # never one sample "cat" of 3 fields
    if inner.parent.name:
        put(raw / inner.parent / "test1" / "1.jpg", jpeg())
        put(raw / inner.parent / "sampleSubmission.csv", "id,label\n1,0.5\n")
    line = refused(raw, tmp_path, capsys)
    top = inner.parts[0]
    assert f"{top}/ reads as the filenames layout" in line
    assert command(raw / top) in line


def test_one_folder_of_unlabelled_images_offers_the_files_source(tmp_path, capsys) -> None:
    raw = tmp_path / "faces"
    for i in range(4):
        put(raw / "img_align_celeba" / f"{i:06d}.jpg", jpeg(i))
    line = refused(raw, tmp_path, capsys)
    assert "images without labels" in line
    assert command(raw / "img_align_celeba", "files") in line
    assert command(raw, "imagefolder") in line  # one class, when that is what is meant


def test_one_class_in_every_split_is_refused(tmp_path, capsys) -> None:
    raw = tmp_path / "raw"
    class_folders(raw / "train", ("cat",))
    class_folders(raw / "val", ("cat",))
    line = refused(raw, tmp_path, capsys)
    assert "one class folder, cat/" in line and "a dataset of one class" in line


def test_one_class_folder_converts_when_asked(tmp_path) -> None:
    raw = class_folders(tmp_path / "raw", ("only",))
    out = tmp_path / "out"
    assert convert(raw, out, "--source", "imagefolder") == 0
    assert dlpipe.read_manifest(str(out)).classes == ("only",)


# --- other structure -------------------------------------------------------------------------


def test_kaggle_split_folders_without_labelled_names_are_refused(tmp_path, capsys) -> None:
    raw = tmp_path / "comp"
    for i in range(3):
        put(raw / "train" / f"{i}.jpg", jpeg(i))
        put(raw / "test1" / f"{i}.jpg", jpeg(i))
    line = refused(raw, tmp_path, capsys)
    assert "test1/, train/ would be its classes" in line
    assert command(raw, "filenames") in line


@pytest.mark.parametrize(
    ("splits", "extra"),
    [
        (("Training", "Test"), "test-multiple_fruits"),  # Fruits-360
        (("seg_train", "seg_test"), "seg_pred"),  # Intel image classification
        (("training_set", "test_set"), None),  # Kaggle's cats and dogs
    ],
)
def test_split_folders_of_class_folders_under_other_names_are_not_classes(
    tmp_path, capsys, splits, extra
) -> None:
    raw = tmp_path / "raw"
    for split in splits:
        class_folders(raw / split, ("Apple Braeburn", "Banana"))
    if extra:
        put(raw / extra / "0.jpg", jpeg())
    line = refused(raw, tmp_path, capsys)
    assert all(f"{split}/" in line for split in splits)
    assert f"convert the class folders of one split with {command(raw / splits[0])}" in line


def test_omniglot_background_and_evaluation_are_not_two_classes(tmp_path, capsys) -> None:
    raw = tmp_path / "omniglot"
    for part in ("images_background", "images_evaluation"):
        put(raw / part / "Latin" / "character01" / "0001_01.png", png())
    line = refused(raw, tmp_path, capsys)
    assert "images_background/, images_evaluation/" in line


@pytest.mark.parametrize(("photos", "masks"), [("img", "gt"), ("rgb", "depth"), ("IMG", "Mask")])
def test_masks_named_as_their_photos_are_not_a_class(tmp_path, capsys, photos, masks) -> None:
    raw = tmp_path / "seg"
    for i in range(3):
        put(raw / photos / f"{i:04d}.jpg", jpeg(i))
        put(raw / masks / f"{i:04d}.png", png(i))
    line = refused(raw, tmp_path, capsys)
    assert f"{masks}/ holds images named as those of another folder" in line


def test_a_folder_of_annotation_files_among_classes_is_refused(tmp_path, capsys) -> None:
    raw = class_folders(tmp_path / "raw")
    for i in range(3):
        put(raw / "boxes_xml" / f"{i:03d}.xml", "<annotation/>")
    line = refused(raw, tmp_path, capsys)
    assert "boxes_xml/ holds 3 .xml files and no images" in line


@pytest.mark.parametrize(
    ("name", "layout", "kind"),
    [
        ("classes.txt", "split lists (classes.txt)", "splitlist"),
        ("train.txt", "split lists (train.txt)", "splitlist"),
        ("metadata.jsonl", "Hugging Face image folder with metadata (metadata.jsonl)", "hf"),
    ],
)
def test_layout_files_beside_class_folders_are_named(tmp_path, capsys, name, layout, kind) -> None:
    raw = class_folders(tmp_path / "raw")
    put(raw / name, "cat\ndog\n")
    line = refused(raw, tmp_path, capsys)
    assert "cat/, dog/ would be its classes" in line and layout in line
    assert command(raw, kind) in line


def test_hugging_face_metadata_inside_a_split_folder_is_named(tmp_path, capsys) -> None:
    raw = tmp_path / "hf"
    class_folders(raw / "train")
    class_folders(raw / "test")
    put(raw / "train" / "metadata.csv", "file_name,text\n")
    line = refused(raw, tmp_path, capsys)
    assert "(train/metadata.csv)" in line and command(raw, "hf") in line


def test_a_layout_without_its_source_says_so(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delitem(sources.SOURCE_KINDS, "coco")
    raw = coco(tmp_path / "coco")
    line = refused(raw, tmp_path, capsys)
    assert "no coco source" in line and "--source coco" not in line


def test_no_warning_offers_a_datasets_parts_as_class_folders(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setitem(sources.SOURCE_KINDS, "yolo", f"{__name__}:AlwaysSource")
    raw = yolo(tmp_path / "yolo")
    with caplog.at_level(logging.WARNING, logger="dlpipe"):
        assert sources.open_source(str(raw)).kind == "always"
    assert not any("imagefolder" in r.getMessage() for r in caplog.records)
    plain = class_folders(tmp_path / "plain")
    put(plain / "data.txt", "beside")
    monkeypatch.setitem(sources.SOURCE_KINDS, "yolo", f"{__name__}:NeverSource")
    monkeypatch.setitem(sources.SOURCE_KINDS, "cifar", f"{__name__}:AlwaysSource")
    with caplog.at_level(logging.WARNING, logger="dlpipe"):
        sources.open_source(str(plain))
    assert any("--source imagefolder" in r.getMessage() for r in caplog.records)  # a control


def test_special_files_at_the_top_are_not_opened(tmp_path, capsys) -> None:
    raw = yolo(tmp_path / "yolo")
    (raw / "data.yaml").unlink()
    os.mkfifo(raw / "data.yaml")  # opening it for reading would block
    (raw / "meta.json").symlink_to("/etc/hostname")  # a link out of the raw folder
    line = refused(raw, tmp_path, capsys)
    assert "YOLO dataset (labels/ beside images/)" in line


# --- negative controls: ordinary class folders convert as before ----------------------------


@pytest.mark.parametrize(
    "names",
    [
        ("cat", "dog", "n01440764"),
        ("mask", "no_mask"),
        ("0", "1", "2"),
        ("with_mask", "without_mask", "label_printer"),
        ("Abyssinian", "Bengal"),
    ],
)
def test_ordinary_class_folders_convert_as_before(tmp_path, capsys, names) -> None:
    raw = class_folders(tmp_path / "raw", names)
    put(raw / "README.md", "my dataset")
    put(raw / "LICENSE.txt", "CC-BY")
    out = tmp_path / "out"
    assert convert(raw, out) == 0, capsys.readouterr().err
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.source["kind"] == "imagefolder"
    assert manifest.classes == tuple(sorted(names))
    assert manifest.splits["train"].samples == 3 * len(names)


def test_split_folders_of_classes_and_captions_beside_images_convert(tmp_path, capsys) -> None:
    raw = tmp_path / "raw"
    for split in ("train", "val"):
        class_folders(raw / split, ("n01440764", "n01443537"))
        for i in range(3):
            put(raw / split / "n01440764" / f"{i:03d}.txt", "a caption")
    class_folders(raw / "train" / "n01443537" / "extra", ("nested",))  # nested class trees
    out = tmp_path / "out"
    assert convert(raw, out) == 0, capsys.readouterr().err
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == ("n01440764", "n01443537")
    assert sorted(manifest.splits) == ["train", "val"]


def test_a_genuinely_empty_class_folder_still_gets_the_keep_empty_advice(tmp_path, capsys) -> None:
    raw = class_folders(tmp_path / "raw")
    (raw / "bird").mkdir()
    assert convert(raw, tmp_path / "out") == 2
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("error:"))
    assert str(raw / "bird") in line and "--keep-empty-classes" in line


@pytest.mark.parametrize(
    ("name", "structure"),
    [
        ("images", True),
        ("Annotations", True),
        ("annotations_trainval2017", True),
        ("train2017", True),
        ("val2014", True),
        ("test-dev2017", True),
        ("test1", True),
        ("trainval", True),
        ("training_set", True),
        ("seg_train", True),
        ("Test", True),
        ("test_tube", False),
        ("dev_board", False),
        ("JPEGImages", True),
        ("SegmentationClass", True),
        ("ground_truth", True),
        ("cat", False),
        ("n01440764", False),
        ("mask", False),
        ("trainer", False),
        ("testudo", False),
        ("valley", False),
        ("0", False),
    ],
)
def test_structure_names(name, structure) -> None:
    assert is_structure_name(name) is structure
