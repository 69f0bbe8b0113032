"""A CVAT/Datumaro "Pascal VOC" export's ``labelmap.txt`` names the voc and voc-seg classes:
every box's label and every mask pixel follow its lines, a malformed line is one error line,
an unknown mask colour one skipped sample, and VOC's own labelmap changes nothing."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import error_records, one_error
from PIL import Image
from test_source_voc import _jpeg, _png, annotation_xml, by_key, convert, make_voc, voc_palette

import dlpipe
from dlpipe.converters.voc import VOC_CLASSES

HEADER = "# label:color_rgb:parts:actions\n"
# the labelmap's lines in file order: (name, colour); background first, as CVAT writes it
LABELS = [("background", (0, 0, 0)), ("roof", (51, 221, 255)), ("solar_panel", (250, 50, 83)),
          ("crack", (36, 179, 83))]  # fmt: skip
VOID_LINE = "ignored:224,224,192::\n"
# id -> (width, height, objects: (name, xmin, ymin, xmax, ymax), 1-based inclusive)
FRAMES = {
    "frame_000000": (40, 32, [("solar_panel", 3, 4, 20, 18), ("roof", 22, 2, 40, 30)]),
    "frame_000001": (36, 30, [("crack", 5, 5, 9, 25)]),
    "frame_000002": (32, 32, [("roof", 1, 1, 32, 32), ("crack", 10, 10, 12, 20),
                              ("solar_panel", 14, 3, 30, 9)]),
}  # fmt: skip
SPLITS = {"train": ["frame_000000", "frame_000001"], "val": ["frame_000002"]}
SEG_CLASSES = tuple(name for name, _ in LABELS)


def labelmap_text(labels: list = LABELS, void: bool = True) -> str:
    """``labelmap.txt`` as Datumaro's ``write_label_map`` writes it."""
    lines = "".join(f"{name}:{','.join(map(str, colour))}::\n" for name, colour in labels)
    return HEADER + lines + (VOID_LINE if void else "")


def index_mask(ident: str) -> np.ndarray:
    """Each object's box filled with its labelmap index, its top row the void (255)."""
    width, height, objects = FRAMES[ident]
    mask = np.zeros((height, width), np.uint8)
    for name, xmin, ymin, xmax, ymax in objects:
        mask[ymin - 1 : ymax, xmin - 1 : xmax] = SEG_CLASSES.index(name)
        mask[ymin - 1, xmin - 1 : xmax] = 255
    return mask


def rgb_png(mask: np.ndarray) -> bytes:
    """A class mask painted in the labelmap's colours, as CVAT's export writes it."""
    colours = np.zeros((256, 3), np.uint8)
    colours[: len(LABELS)] = [colour for _, colour in LABELS]
    colours[255] = (224, 224, 192)
    buffer = io.BytesIO()
    Image.fromarray(colours[mask], "RGB").save(buffer, "PNG")
    return buffer.getvalue()


def make_export(raw: Path, masks: str = "rgb", labelmap: str | None = None) -> Path:
    """An unpacked CVAT "Pascal VOC" export: the year folder's content at the top."""
    for folder in ("Annotations", "JPEGImages", "SegmentationClass", "SegmentationObject",
                   "ImageSets/Main", "ImageSets/Segmentation"):  # fmt: skip
        (raw / folder).mkdir(parents=True)
    (raw / "labelmap.txt").write_text(labelmap_text() if labelmap is None else labelmap)
    for seed, (ident, (width, height, objects)) in enumerate(FRAMES.items()):
        (raw / "JPEGImages" / f"{ident}.jpg").write_bytes(_jpeg(width, height, seed))
        voc_objects = [(n, "Unspecified", 0, 0, *box) for n, *box in objects]
        xml = annotation_xml(ident, width, height, voc_objects)
        (raw / "Annotations" / f"{ident}.xml").write_text(xml)
        mask = index_mask(ident)
        data = rgb_png(mask) if masks == "rgb" else _png(mask)
        (raw / "SegmentationClass" / f"{ident}.png").write_bytes(data)
        (raw / "SegmentationObject" / f"{ident}.png").write_bytes(data)
    for split, ids in SPLITS.items():
        for task in ("Main", "Segmentation"):
            (raw / "ImageSets" / task / f"{split}.txt").write_text("".join(f"{i}\n" for i in ids))
    return raw


def test_detection_labels_follow_the_labelmap_order_without_background(tmp_path: Path) -> None:
    raw = make_export(tmp_path / "raw")
    assert convert(raw, tmp_path / "out", "lmdb") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.classes == ("roof", "solar_panel", "crack") and manifest.class_ids is None
    assert manifest.source["skipped"] == 0
    assert manifest.source["labelmap"] == str(raw / "labelmap.txt")
    assert manifest.source["unused"]["other"] == 0  # the labelmap was read
    for split, ids in SPLITS.items():
        samples = by_key(tmp_path / "out", split)
        assert sorted(samples) == ids
        for ident, sample in samples.items():
            boxes = json.loads(sample["boxes.json"])
            names = [manifest.classes[label] for label in boxes["labels"]]
            assert names == [name for name, *_ in FRAMES[ident][2]]
            assert boxes["boxes"] == [[x0 - 1, y0 - 1, x1, y1] for _, x0, y0, x1, y1 in
                                      FRAMES[ident][2]]  # fmt: skip


@pytest.mark.parametrize("masks", ["rgb", "palette", "greyscale"])
def test_segmentation_maps_every_pixel_through_the_labelmap(tmp_path: Path, masks: str) -> None:
    raw = make_export(tmp_path / "raw", masks)
    if masks == "greyscale":
        for ident in FRAMES:
            (raw / "SegmentationClass" / f"{ident}.png").write_bytes(_png(index_mask(ident), "L"))
    assert convert(raw, tmp_path / "out", "wds", "--source", "voc-seg") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.classes == SEG_CLASSES and manifest.task == "segmentation"
    assert manifest.field_schemas["seg.png"]["ignore"] == 255
    assert manifest.source["skipped"] == 0
    for split, ids in SPLITS.items():
        samples = by_key(tmp_path / "out", split)
        assert sorted(samples) == ids
        for ident, sample in samples.items():
            mask = Image.open(io.BytesIO(sample["seg.png"]))
            assert mask.mode == "L"
            assert np.array_equal(np.asarray(mask), index_mask(ident))


def test_a_palette_mask_keeps_its_indices_whatever_its_palette(tmp_path: Path) -> None:
    """Index i is the labelmap's line i, not the colour VOC's palette gives index i."""
    raw = make_export(tmp_path / "raw", "palette")
    assert voc_palette()[3:6] != list(LABELS[1][1])
    assert convert(raw, tmp_path / "out", "wds", "--source", "voc-seg") == 0
    sample = by_key(tmp_path / "out", "val")["frame_000002"]
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(sample["seg.png"]))),
                          index_mask("frame_000002"))  # fmt: skip


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("unknown", "colours 9,9,9 are no label of"),
        ("void-unlisted", "colours 224,224,192 are no label of"),
        ("index", "pixel values [4] are no class (0 = background, 1-3 the classes"),
    ],
)
def test_a_mask_value_the_labelmap_lacks_skips_only_its_sample(
    tmp_path: Path, case: str, expected: str
) -> None:
    labelmap = labelmap_text(void=case != "void-unlisted")
    raw = make_export(tmp_path / "raw", "palette" if case == "index" else "rgb", labelmap)
    png = raw / "SegmentationClass" / "frame_000001.png"
    if case == "unknown":
        pixels = np.array(Image.open(png))
        pixels[3, 4] = (9, 9, 9)
        Image.fromarray(pixels).save(png)
    elif case == "index":
        mask = index_mask("frame_000001")
        mask[0, 0] = len(LABELS)
        png.write_bytes(_png(mask))
    else:  # only frame_000001 keeps its void row
        for ident in ("frame_000000", "frame_000002"):
            mask = index_mask(ident)
            (png.parent / f"{ident}.png").write_bytes(rgb_png(np.where(mask == 255, 0, mask)))
    out = tmp_path / "out"
    assert convert(raw, out, "wds", "--source", "voc-seg") == 0
    (error,) = error_records(out)
    assert error["key"] == "frame_000001"
    assert expected in error["error"] and "labelmap.txt" in error["error"], error
    assert sorted(by_key(out, "train")) == ["frame_000000"]


def test_an_object_of_a_class_the_labelmap_lacks_skips_its_sample(tmp_path: Path) -> None:
    raw = make_export(tmp_path / "raw")
    xml = raw / "Annotations" / "frame_000001.xml"
    xml.write_text(xml.read_text().replace("<name>crack</name>", "<name>cat</name>"))
    assert convert(raw, tmp_path / "out", "wds") == 0
    (error,) = error_records(tmp_path / "out")
    assert error["key"] == "frame_000001"
    assert "object 1 ('cat'): not one of the 3 classes of" in error["error"]
    assert "labelmap.txt (roof, solar_panel, crack)" in error["error"]


BAD_LABELMAPS = {
    "no-name": (":128,0,0::", "line 3: ':128,0,0::' has no label name"),
    "fields": ("cat:128,0,0", "line 3: 'cat:128,0,0' has 2 ':'-separated fields, not 4"),
    "colour-range": ("cat:300,0,0::", "line 3: label 'cat' has colour '300,0,0', not r,g,b"),
    "colour-count": ("cat:128,0::", "line 3: label 'cat' has colour '128,0', not r,g,b"),
    "colour-word": ("cat:red::", "line 3: label 'cat' has colour 'red', not r,g,b"),
    "duplicate-name": (
        "roof:1,2,3::",
        "line 3: label 'roof' is given twice (also line 2); give each label one",
    ),
    "duplicate-colour": (
        "cat:51,221,255::",
        "line 3: colour 51,221,255 is given twice (also line 2); give each label its own",
    ),
    "empty": (None, "labelmap.txt: lists no label; write one line name:r,g,b:parts:actions"),
}


@pytest.mark.parametrize("case", BAD_LABELMAPS)
@pytest.mark.parametrize("kind", ["voc", "voc-seg"])
def test_a_malformed_labelmap_is_one_error_line(
    tmp_path: Path, case: str, kind: str, capsys
) -> None:
    line, expected = BAD_LABELMAPS[case]
    text = HEADER if line is None else f"{HEADER}roof:51,221,255::\n{line}\nbush:1,1,1::\n"
    raw = make_export(tmp_path / "raw", labelmap=text)
    assert convert(raw, tmp_path / "out", "wds", "--source", kind) == 2
    error = one_error(capsys)
    assert expected in error and str(raw / "labelmap.txt") in error, error
    if "twice" not in expected:
        assert "name:r,g,b:parts:actions" in error
    assert not (tmp_path / "out" / "dlpipe.json").exists()


def test_a_labelmap_linked_out_of_the_raw_folder_is_refused(tmp_path: Path, capsys) -> None:
    raw = make_export(tmp_path / "raw")
    (tmp_path / "outside.txt").write_text(labelmap_text())
    (raw / "labelmap.txt").unlink()
    os.symlink(tmp_path / "outside.txt", raw / "labelmap.txt")
    assert convert(raw, tmp_path / "out", "wds") == 2
    assert "labelmap.txt" in one_error(capsys)


def voc_labelmap(void: bool) -> str:
    """Datumaro's default VOC labelmap (``make_voc_label_map``): VOC's colours, in order."""
    palette = voc_palette()
    names = ("background", *VOC_CLASSES)
    return labelmap_text([(n, tuple(palette[3 * i : 3 * i + 3])) for i, n in enumerate(names)],
                         void)  # fmt: skip


@pytest.mark.parametrize("void", [False, True], ids=["21-lines", "with-ignored"])
@pytest.mark.parametrize("kind", ["voc", "voc-seg"])
def test_vocs_own_labelmap_changes_nothing(tmp_path: Path, kind: str, void: bool) -> None:
    without, labelled = tmp_path / "without", tmp_path / "labelled"
    make_voc(without)
    voc = make_voc(labelled)
    (voc / "labelmap.txt").write_text(voc_labelmap(void))
    results = []
    for raw in (without, labelled):
        out = tmp_path / f"out-{raw.name}"
        assert convert(raw, out, "wds", "--source", kind) == 0
        manifest = dlpipe.read_manifest(str(out))
        samples = {s: by_key(out, s) for s in manifest.splits}
        fields = {s: {k: {f: v for f, v in d.items() if f != "__url__"} for k, d in got.items()}
                  for s, got in samples.items()}  # fmt: skip
        source = manifest.source
        results.append((manifest.classes, manifest.class_ids, manifest.field_schemas,
                        source["unused"], source["skipped"], fields))  # fmt: skip
    assert results[0] == results[1]
    expected = VOC_CLASSES if kind == "voc" else ("background", *VOC_CLASSES)
    assert results[0][0] == expected
