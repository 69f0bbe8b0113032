"""The voc and voc-seg sources read Pascal VOC as the devkit tar unpacks, box by box and pixel
by pixel, and turn a bad annotation into one skipped sample, a bad tree into one error line."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from conftest import error_records, one_error
from PIL import Image

import dlpipe
from dlpipe.cli import main
from dlpipe.converters.sources import open_source
from dlpipe.converters.voc import VOC_CLASSES, voc_roots

# id -> (width, height, objects: (name, pose, truncated, difficult, xmin, ymin, xmax, ymax))
OBJECTS = {
    "2008_000001": (48, 40, [("person", "Frontal", 0, 0, 5, 6, 30, 39),
                             ("dog", "Left", 1, 0, 20, 10, 48, 40)]),
    "2008_000002": (40, 32, [("tvmonitor", "Unspecified", 0, 1, 1, 1, 12, 9)]),
    "2008_000003": (32, 48, [("aeroplane", "Rear", 1, 1, 2.5, 3, 31, 47.5),
                             ("car", "Unspecified", 0, 0, 4, 4, 4, 4)]),
    "2008_000004": (36, 30, [("bird", "Left", 0, 0, 10, 10, 20, 20)]),
    "2008_000009": (30, 30, [("cat", "Right", 0, 0, 3, 3, 9, 9)]),  # an action/layout-only image
}  # fmt: skip
MAIN = {"train": ["2008_000001", "2008_000002"], "val": ["2008_000003", "2008_000004"]}
SEGMENTATION = {"train": ["2008_000001", "2008_000002"], "val": ["2008_000003"]}
TEST_OBJECTS = {"2008_000010": (20, 24, [("sheep", "Left", 0, 0, 1, 2, 19, 24)])}


def _jpeg(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, "JPEG")
    return buffer.getvalue()


def voc_palette() -> list[int]:
    """VOC's colour map (``VOClabelcolormap.m``): bit-interleaved RGB of each index."""
    palette = []
    for index in range(256):
        r = g = b = 0
        c = index
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        palette += [r, g, b]
    return palette


def mask_of(ident: str) -> np.ndarray:
    """A class mask: background, each object's box filled with its class + 1, a void border."""
    width, height, objects = OBJECTS[ident]
    mask = np.zeros((height, width), np.uint8)
    for name, *_, xmin, ymin, xmax, ymax in objects:
        x0, y0 = int(xmin) - 1, int(ymin) - 1
        mask[y0 : int(ymax), x0 : int(xmax)] = VOC_CLASSES.index(name) + 1
        mask[y0, x0 : int(xmax)] = 255
    return mask


def _png(mask: np.ndarray, mode: str = "P") -> bytes:
    image = Image.fromarray(mask.astype(np.uint8))
    if mode == "P":
        image = image.convert("P")
        image.putpalette(voc_palette())
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def annotation_xml(ident: str, width: int, height: int, objects: list) -> str:
    """An Annotations/<id>.xml as VOC2012 writes it (tabs, <part>s of a person)."""
    parts = []
    for name, pose, truncated, difficult, xmin, ymin, xmax, ymax in objects:
        layout = (
            "\t\t<part>\n\t\t\t<name>head</name>\n\t\t\t<bndbox>\n\t\t\t\t<xmin>6</xmin>\n"
            "\t\t\t\t<ymin>7</ymin>\n\t\t\t\t<xmax>9</xmax>\n\t\t\t\t<ymax>11</ymax>\n"
            "\t\t\t</bndbox>\n\t\t</part>\n"
            if name == "person"
            else ""
        )
        parts.append(
            f"\t<object>\n\t\t<name>{name}</name>\n\t\t<pose>{pose}</pose>\n"
            f"\t\t<truncated>{truncated}</truncated>\n\t\t<occluded>0</occluded>\n"
            f"\t\t<bndbox>\n\t\t\t<xmin>{xmin}</xmin>\n\t\t\t<ymin>{ymin}</ymin>\n"
            f"\t\t\t<xmax>{xmax}</xmax>\n\t\t\t<ymax>{ymax}</ymax>\n\t\t</bndbox>\n"
            f"\t\t<difficult>{difficult}</difficult>\n{layout}\t</object>\n"
        )
    return (
        f"<annotation>\n\t<folder>VOC2012</folder>\n\t<filename>{ident}.jpg</filename>\n"
        "\t<source>\n\t\t<database>The VOC2008 Database</database>\n"
        "\t\t<annotation>PASCAL VOC2008</annotation>\n\t\t<image>flickr</image>\n\t</source>\n"
        f"\t<size>\n\t\t<width>{width}</width>\n\t\t<height>{height}</height>\n"
        f"\t\t<depth>3</depth>\n\t</size>\n\t<segmented>1</segmented>\n{''.join(parts)}"
        "</annotation>\n"
    )


def make_voc(raw: Path, year: str = "VOC2012", *, test: bool = False) -> Path:
    """``raw/VOCdevkit/<year>/`` as the trainval tar unpacks (and, with `test`, the test tar);
    returns the year folder."""
    voc = raw / "VOCdevkit" / year
    for folder in ("Annotations", "JPEGImages", "SegmentationClass", "SegmentationObject",
                   "ImageSets/Main", "ImageSets/Segmentation", "ImageSets/Layout",
                   "ImageSets/Action"):  # fmt: skip
        (voc / folder).mkdir(parents=True)
    objects = {**OBJECTS, **(TEST_OBJECTS if test else {})}
    for seed, (ident, (width, height, objs)) in enumerate(objects.items()):
        (voc / "JPEGImages" / f"{ident}.jpg").write_bytes(_jpeg(width, height, seed))
        (voc / "Annotations" / f"{ident}.xml").write_text(
            annotation_xml(ident, width, height, objs)
        )
    lists = {**MAIN, **({"test": list(TEST_OBJECTS)} if test else {})}
    for split, ids in lists.items():
        (voc / "ImageSets" / "Main" / f"{split}.txt").write_text("".join(f"{i}\n" for i in ids))
    trainval = MAIN["train"] + MAIN["val"]
    (voc / "ImageSets" / "Main" / "trainval.txt").write_text("".join(f"{i}\n" for i in trainval))
    (voc / "ImageSets" / "Main" / "aeroplane_train.txt").write_text(
        "2008_000001 -1\n2008_000002 -1\n"
    )
    (voc / "ImageSets" / "Action" / "jumping_train.txt").write_text("2008_000009  1  1\n")
    (voc / "ImageSets" / "Layout" / "train.txt").write_text("2008_000009 1\n")
    for split, ids in SEGMENTATION.items():
        (voc / "ImageSets" / "Segmentation" / f"{split}.txt").write_text(
            "".join(f"{i}\n" for i in ids)
        )
    for ident in SEGMENTATION["train"] + SEGMENTATION["val"]:
        (voc / "SegmentationClass" / f"{ident}.png").write_bytes(_png(mask_of(ident)))
        (voc / "SegmentationObject" / f"{ident}.png").write_bytes(
            _png((mask_of(ident) > 0).astype(np.uint8))
        )
    return voc


def convert(raw: Path, out: Path, fmt: str = "wds", *extra: str) -> int:
    return main(["convert", str(raw), "--to", fmt, "--out", str(out), "--workers", "1", *extra])


def by_key(out: Path, split: str) -> dict[str, dict]:
    dataset = dlpipe.open_dataset(str(out), split, rank=0, world_size=1)
    return {s["__key__"]: s for s in dataset}


def expected_boxes(ident: str, objects: dict = OBJECTS) -> dict:
    _, _, objs = objects[ident]
    return {
        "boxes": [[xmin - 1, ymin - 1, xmax, ymax] for *_, xmin, ymin, xmax, ymax in objs],
        "labels": [VOC_CLASSES.index(o[0]) for o in objs],
        "iscrowd": [0] * len(objs),
        "difficult": [o[3] for o in objs],
        "truncated": [o[2] for o in objs],
    }


@pytest.mark.parametrize("fmt", ["wds", "lmdb", "hdf5"])
def test_detection_reads_every_box_and_flag_of_train_and_val(tmp_path: Path, fmt: str) -> None:
    raw = tmp_path / "raw"
    make_voc(raw)
    assert convert(raw, tmp_path / "out", fmt) == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.classes == VOC_CLASSES and manifest.task == "detection"
    assert manifest.field_schemas == {"boxes.json": {"kind": "boxes", "format": "XYXY",
                                              "units": "pixels", "labels": "classes"}}  # fmt: skip
    assert manifest.class_ids is None
    assert {k: s.samples for k, s in manifest.splits.items()} == {"train": 2, "val": 2}
    source = manifest.source
    assert source["kind"] == "voc" and source["skipped"] == 0
    assert source["year_folder"] == str(raw / "VOCdevkit" / "VOC2012")
    # 2008_000009's XML; trainval, aeroplane_train, Action, Layout, 2 Segmentation lists;
    # 3 SegmentationClass + 3 SegmentationObject masks; the image 2008_000009.jpg
    assert source["unused"] == {"annotation files": 1, "split lists": 6, "masks": 6, "other": 1}
    for split, ids in MAIN.items():
        samples = by_key(tmp_path / "out", split)
        assert sorted(samples) == ids
        for ident, sample in samples.items():
            assert json.loads(sample["boxes.json"]) == expected_boxes(ident)
            raw_image = (raw / "VOCdevkit" / "VOC2012" / "JPEGImages" / f"{ident}.jpg").read_bytes()
            assert sample["jpg"] == raw_image
            assert "cls" not in sample


@pytest.mark.parametrize("given", ["parent", "VOCdevkit", "VOC2012"])
def test_the_devkit_folder_the_year_folder_or_the_folder_above_read_alike(
    tmp_path: Path, given: str
) -> None:
    make_voc(tmp_path / "raw")
    root = {"parent": tmp_path / "raw", "VOCdevkit": tmp_path / "raw" / "VOCdevkit",
            "VOC2012": tmp_path / "raw" / "VOCdevkit" / "VOC2012"}[given]  # fmt: skip
    assert open_source(str(root)).kind == "voc"
    assert convert(root, tmp_path / "out") == 0
    assert sorted(by_key(tmp_path / "out", "val")) == MAIN["val"]


def test_voc2011_nests_its_devkit_in_trainval(tmp_path: Path) -> None:
    make_voc(tmp_path / "unpacked", "VOC2011")
    (tmp_path / "raw" / "TrainVal").mkdir(parents=True)
    (tmp_path / "unpacked" / "VOCdevkit").rename(tmp_path / "raw" / "TrainVal" / "VOCdevkit")
    year = tmp_path / "raw" / "TrainVal" / "VOCdevkit" / "VOC2011"
    assert voc_roots(str(tmp_path / "raw")) == [str(year)]
    assert convert(tmp_path / "raw", tmp_path / "out", "lmdb") == 0
    assert dlpipe.read_manifest(str(tmp_path / "out")).splits["train"].samples == 2


def test_voc2007_test_split_is_read_when_its_annotations_ship(tmp_path: Path) -> None:
    make_voc(tmp_path / "raw", "VOC2007", test=True)
    assert convert(tmp_path / "raw", tmp_path / "out") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert {k: s.samples for k, s in manifest.splits.items()} == {"train": 2, "val": 2, "test": 1}
    (sample,) = by_key(tmp_path / "out", "test").values()
    assert json.loads(sample["boxes.json"]) == expected_boxes("2008_000010", TEST_OBJECTS)


def test_a_test_list_without_annotations_is_left_out(tmp_path: Path) -> None:
    voc = make_voc(tmp_path / "raw", test=True)
    (voc / "Annotations" / "2008_000010.xml").unlink()  # VOC2012 withholds them
    assert convert(tmp_path / "raw", tmp_path / "out") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert set(manifest.splits) == {"train", "val"}
    assert "1 of its 1 ids have no Annotations/ file" in manifest.source["left_out"]["test"]


def test_trainval_is_read_only_when_train_and_val_lists_are_missing(tmp_path: Path) -> None:
    voc = make_voc(tmp_path / "raw")
    for split in ("train", "val"):
        (voc / "ImageSets" / "Main" / f"{split}.txt").unlink()
    assert convert(tmp_path / "raw", tmp_path / "out") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert {k: s.samples for k, s in manifest.splits.items()} == {"trainval": 4}


@pytest.mark.parametrize("fmt", ["wds", "hdf5"])
def test_segmentation_keeps_the_class_index_of_every_pixel(tmp_path: Path, fmt: str) -> None:
    make_voc(tmp_path / "raw")
    assert convert(tmp_path / "raw", tmp_path / "out", fmt, "--source", "voc-seg") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.classes == ("background", *VOC_CLASSES) and manifest.task == "segmentation"
    assert manifest.field_schemas == {
        "seg.png": {"kind": "mask", "encoding": "png", "values": "classes", "ignore": 255}
    }
    assert manifest.source["unused"] == {
        "annotation files": 5, "split lists": 6, "masks": 3, "other": 2
    }  # fmt: skip
    for split, ids in SEGMENTATION.items():
        samples = by_key(tmp_path / "out", split)
        assert sorted(samples) == ids
        for ident, sample in samples.items():
            assert "boxes.json" not in sample
            mask = Image.open(io.BytesIO(sample["seg.png"]))
            assert mask.mode == "L" and mask.size == OBJECTS[ident][:2]
            assert np.array_equal(np.asarray(mask), mask_of(ident))
            assert {0, 255} < set(np.unique(np.asarray(mask)).tolist())


def test_segmentation_follows_a_resize_by_nearest_neighbour(tmp_path: Path) -> None:
    make_voc(tmp_path / "raw")
    extra = ("--source", "voc-seg", "--max-side", "24")
    assert convert(tmp_path / "raw", tmp_path / "out", "wds", *extra) == 0
    sample = by_key(tmp_path / "out", "train")["2008_000001"]
    stored = Image.open(io.BytesIO(sample["jpg"]))
    mask = Image.open(io.BytesIO(sample["seg.png"]))
    assert mask.size == stored.size == (24, 20)
    expected = Image.fromarray(mask_of("2008_000001")).resize((24, 20), Image.Resampling.NEAREST)
    assert np.array_equal(np.asarray(mask), np.asarray(expected))


def test_auto_detection_picks_detection_and_names_voc_seg(tmp_path: Path, caplog) -> None:
    make_voc(tmp_path / "raw")
    with caplog.at_level(logging.WARNING, logger="dlpipe"):
        assert open_source(str(tmp_path / "raw")).kind == "voc"
    assert any("--source voc-seg" in r.message for r in caplog.records)
    voc = tmp_path / "raw" / "VOCdevkit" / "VOC2012"
    for name in ("train.txt", "val.txt", "trainval.txt", "aeroplane_train.txt"):
        (voc / "ImageSets" / "Main" / name).unlink()
    (voc / "ImageSets" / "Main").rmdir()
    assert open_source(str(tmp_path / "raw")).kind == "voc-seg"  # a segmentation-only tree


BILLION_LAUGHS = """<?xml version="1.0"?>
<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol1 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
<!ENTITY lol2 "&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;">]>
<annotation><object><name>&lol2;</name></object></annotation>
"""


def _break(xml: Path, case: str) -> str:
    """Break one annotation file; return what its error must say."""
    text = xml.read_text()
    if case == "entity":
        xml.write_text(BILLION_LAUGHS)
        return "holds a DTD or an entity declaration"
    if case == "external-entity":
        xml.write_text('<!DOCTYPE a [<!ENTITY x SYSTEM "file:///etc/passwd">]><annotation/>')
        return "holds a DTD or an entity declaration"
    if case == "utf16-entity":
        xml.write_bytes(BILLION_LAUGHS.replace('"1.0"', '"1.0" encoding="UTF-16"').encode("utf-16"))
        return "holds a DTD or an entity declaration"
    if case == "malformed":
        xml.write_text(text[: len(text) // 2])
        return "not well-formed XML"
    if case == "unknown-class":
        xml.write_text(text.replace("<name>tvmonitor</name>", "<name>television</name>"))
        return "object 1 ('television'): not one of VOC's 20 classes"
    if case == "no-bndbox":
        start, end = text.index("\t\t<bndbox>"), text.index("</bndbox>") + len("</bndbox>")
        xml.write_text(text[:start] + text[end:])
        return "object 1 ('tvmonitor'): has no <bndbox>"
    if case == "reversed":
        xml.write_text(text.replace("<xmax>12</xmax>", "<xmax>0</xmax>"))
        return "<bndbox> 1.0, 1.0, 0.0, 9.0 is reversed"
    if case == "not-a-number":
        xml.write_text(text.replace("<ymin>1</ymin>", "<ymin>nan</ymin>"))
        return "<ymin> is 'nan', not a number"
    if case == "flag":
        xml.write_text(text.replace("<difficult>1</difficult>", "<difficult>yes</difficult>"))
        return "<difficult> is 'yes', not 0 or 1"
    if case == "outside":
        xml.write_text(text.replace("<xmax>12</xmax>", "<xmax>45</xmax>"))
        return "lies outside the 40x32 image"
    if case == "root":
        xml.write_text("<voc>" + text.split("<annotation>", 1)[1].replace("annotation>", "voc>"))
        return "the root element is <voc>, not <annotation>"
    xml.unlink()
    return "line 2: id '2008_000002' has no file in Annotations/"


BAD_XML = ["entity", "external-entity", "utf16-entity", "malformed", "unknown-class",
           "no-bndbox", "reversed", "not-a-number", "flag", "outside", "root",
           "missing"]  # fmt: skip


@pytest.mark.parametrize("case", BAD_XML)
def test_a_bad_annotation_skips_only_its_sample(tmp_path: Path, case: str, capsys) -> None:
    voc = make_voc(tmp_path / "raw")
    expected = _break(voc / "Annotations" / "2008_000002.xml", case)
    out = tmp_path / "out"
    assert convert(tmp_path / "raw", out, "lmdb") == 0
    (error,) = error_records(out)
    assert error["key"] == "2008_000002" and expected in error["error"], error
    assert sorted(by_key(out, "train")) == ["2008_000001"]
    assert json.loads(by_key(out, "train")["2008_000001"]["boxes.json"]) == expected_boxes(
        "2008_000001"
    )
    assert convert(tmp_path / "raw", tmp_path / "fail", "wds", "--on-error", "fail") == 2
    assert expected in one_error(capsys)


def _break_mask(png: Path, case: str) -> str:
    if case == "rgb":
        Image.open(png).convert("RGB").save(png)
        return "a PNG image in mode RGB; a VOC class mask is a palette"
    if case == "value":
        mask = mask_of("2008_000001")
        mask[0, 0] = 30
        png.write_bytes(_png(mask))
        return "pixel values [30] are no class"
    if case == "size":
        png.write_bytes(_png(mask_of("2008_000001")[:20]))
        return "the mask is 48x20, its image 48x40"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    return "not a readable PNG"


@pytest.mark.parametrize("case", ["rgb", "value", "size", "garbage"])
def test_a_bad_mask_skips_only_its_sample(tmp_path: Path, case: str) -> None:
    voc = make_voc(tmp_path / "raw")
    expected = _break_mask(voc / "SegmentationClass" / "2008_000001.png", case)
    out = tmp_path / "out"
    assert convert(tmp_path / "raw", out, "wds", "--source", "voc-seg") == 0
    (error,) = error_records(out)
    assert error["key"] == "2008_000001" and expected in error["error"], error
    assert sorted(by_key(out, "train")) == ["2008_000002"]


def test_a_greyscale_mask_is_read_as_its_values(tmp_path: Path) -> None:
    voc = make_voc(tmp_path / "raw")
    (voc / "SegmentationClass" / "2008_000003.png").write_bytes(_png(mask_of("2008_000003"), "L"))
    assert convert(tmp_path / "raw", tmp_path / "out", "wds", "--source", "voc-seg") == 0
    sample = by_key(tmp_path / "out", "val")["2008_000003"]
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(sample["seg.png"]))),
                          mask_of("2008_000003"))  # fmt: skip


def _break_tree(raw: Path, voc: Path, case: str) -> str:
    main_lists = voc / "ImageSets" / "Main"
    if case == "two-years":
        make_voc(raw / "second", "VOC2007")
        (raw / "second" / "VOCdevkit" / "VOC2007").rename(raw / "VOCdevkit" / "VOC2007")
        return "holds 2 VOC year folders"
    if case == "per-class-list":
        (main_lists / "train.txt").write_text("2008_000001 -1\n2008_000002 1\n")
        return "train.txt line 1: '2008_000001 -1' is not one image id"
    if case == "path-in-list":
        (main_lists / "train.txt").write_text("2008_000001\n../../../etc/passwd\n")
        return "line 2: '../../../etc/passwd' is not one image id"
    if case == "in-two-splits":
        (main_lists / "val.txt").write_text("2008_000003\n2008_000001\n")
        return "id '2008_000001' is listed twice"
    if case == "images-missing":
        for ident in MAIN["val"]:
            (voc / "JPEGImages" / f"{ident}.jpg").unlink()
        return "val.txt line 1: id '2008_000003' has no file in JPEGImages/, nor do 1 more"
    if case == "no-lists":
        for path in main_lists.iterdir():
            path.unlink()
        return "no split list (train.txt, val.txt, trainval.txt)"
    if case == "not-utf8":
        (main_lists / "val.txt").write_bytes(b"\xff\xfe2\x00")
        return "val.txt: not UTF-8 text ('utf-8' codec can't decode"
    (main_lists / "val.txt").write_text("\n")
    return "val.txt lists no id"


TREE_CASES = ["two-years", "per-class-list", "path-in-list", "in-two-splits", "images-missing",
              "no-lists", "not-utf8", "empty-list"]  # fmt: skip


@pytest.mark.parametrize("case", TREE_CASES)
def test_a_broken_tree_is_one_error_line(tmp_path: Path, case: str, capsys) -> None:
    raw = tmp_path / "raw"
    voc = make_voc(raw)
    expected = _break_tree(raw, voc, case)
    assert convert(raw, tmp_path / "out", "hdf5", "--source", "voc") == 2
    line = one_error(capsys)
    assert expected in line, line
    assert not (tmp_path / "out" / "dlpipe.json").exists()


def test_one_missing_image_is_a_skipped_sample(tmp_path: Path) -> None:
    voc = make_voc(tmp_path / "raw")
    (voc / "JPEGImages" / "2008_000004.jpg").unlink()
    assert convert(tmp_path / "raw", tmp_path / "out") == 0
    (error,) = error_records(tmp_path / "out")
    assert error["key"] == "2008_000004"
    assert "val.txt line 2: id '2008_000004' has no file in JPEGImages/" in error["error"]


def test_linked_annotation_out_of_the_folder_is_never_read(tmp_path: Path) -> None:
    voc = make_voc(tmp_path / "raw")
    secret = tmp_path / "secret.xml"
    secret.write_text(annotation_xml("2008_000001", 48, 40, [("cat", "x", 0, 0, 1, 1, 9, 9)]))
    (voc / "Annotations" / "2008_000001.xml").unlink()
    (voc / "Annotations" / "2008_000001.xml").symlink_to(secret)
    assert convert(tmp_path / "raw", tmp_path / "out") == 0
    (error,) = error_records(tmp_path / "out")
    assert error["key"] == "2008_000001" and "has no file in Annotations/" in error["error"]
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.source["skipped_entries"] == 1
