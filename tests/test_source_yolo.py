"""The yolo source reads Ultralytics YOLO datasets as Ultralytics, Roboflow and Datumaro write
them, box by box in pixels, and turns a bad label line into one skipped sample, a bad data YAML
into one error line."""

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
from dlpipe.converters.source import SourceError
from dlpipe.converters.sources import open_source
from dlpipe.converters.yolo import label_path
from dlpipe.sample import make_key

NAMES = ["person", "bicycle", "car"]
# split -> image name -> ((width, height), label file text, or None for no label file)
ULTRALYTICS = {
    "train": {
        "0001.jpg": ((64, 48), "0 0.5 0.5 0.25 0.5\n2 0.1 0.2 0.2 0.4\n"),
        # a polygon (YOLO segmentation) and a box reaching 0.005 past the right edge
        "0002.png": ((40, 30), "1 0.1 0.1 0.9 0.2 0.5 0.8\n0 0.995 0.5 0.02 0.2\n"),
        "0003.jpg": ((32, 32), None),  # no label file: a background image
        "0004.jpg": ((30, 20), ""),  # an empty label file: a background image too
    },
    "val": {"0005.jpg": ((50, 40), "1 0.25 0.75 0.5 0.5\r\n\r\n")},
}
DATA_YAML = """\
# Ultralytics YOLO 🚀, AGPL-3.0 license
# Train/val/test sets as 1) dir: path/to/imgs, 2) file: path/to/imgs.txt, or 3) list
path: {path} # dataset root dir
train: images/train # train images (relative to 'path')
val: images/val # val images (relative to 'path')
test: # test images (optional)

# Classes
names:
{names}
"""


def image_bytes(name: str, size: tuple[int, int], seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, "PNG" if name.endswith(".png") else "JPEG")
    return buffer.getvalue()


def write_split(images: Path, labels: Path, files: dict) -> None:
    images.mkdir(parents=True, exist_ok=True)
    labels.mkdir(parents=True, exist_ok=True)
    for seed, (name, (size, text)) in enumerate(files.items()):
        (images / name).write_bytes(image_bytes(name, size, seed))
        if text is not None:
            (labels / name).with_suffix(".txt").write_bytes(text.encode())


def names_yaml(style: str, ids: list[int] | None = None) -> str:
    if style == "list":
        return f"  - {NAMES[0]}\n  - {NAMES[1]}\n  - {NAMES[2]}"
    return "\n".join(f"  {i}: {n}" for i, n in zip(ids or range(3), NAMES, strict=True))


def make_ultralytics(raw: Path, style: str = "dict", path: str = ".") -> Path:
    """``data.yaml`` beside ``images/{train,val}`` and ``labels/{train,val}``, as the
    Ultralytics docs lay out coco8."""
    for split, files in ULTRALYTICS.items():
        write_split(raw / "images" / split, raw / "labels" / split, files)
    (raw / "labels" / "train.cache").write_bytes(b"\x80\x04 a numpy pickle Ultralytics writes")
    (raw / "data.yaml").write_text(DATA_YAML.format(path=path, names=names_yaml(style)))
    return raw


def pixel_boxes(text: str, size: tuple[int, int], index: dict[int, int] | None = None) -> dict:
    """The boxes.json a label file's text must become: normalised centre boxes (or polygons'
    bounding boxes) clipped to [0, 1] and scaled by the image's width and height."""
    width, height = size
    boxes, labels = [], []
    for line in text.splitlines():
        if not line.split():
            continue
        cls, *values = line.split()
        numbers = [float(v) for v in values]
        if len(numbers) == 4:
            cx, cy, w, h = numbers
            box = [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]
        else:
            xs, ys = numbers[0::2], numbers[1::2]
            box = [min(xs), min(ys), max(xs), max(ys)]
        x0, y0, x1, y1 = (min(max(v, 0.0), 1.0) for v in box)
        boxes.append([x0 * width, y0 * height, x1 * width, y1 * height])
        labels.append((index or {}).get(int(cls), int(cls)))
    return {"boxes": boxes, "labels": labels, "iscrowd": [0] * len(boxes)}


def convert(raw: Path, out: Path, fmt: str = "wds", *extra: str) -> int:
    return main(["convert", str(raw), "--to", fmt, "--out", str(out), "--workers", "1", *extra])


def by_key(out: Path, split: str) -> dict[str, dict]:
    dataset = dlpipe.open_dataset(str(out), split, rank=0, world_size=1)
    return {s["__key__"]: s for s in dataset}


def key(name: str) -> str:
    return make_key(Path(name).stem)[0]


def check_samples(out: Path, layout: dict, index: dict[int, int] | None = None) -> None:
    """Every sample of every split against its image and label file."""
    for split, files in layout.items():
        samples = by_key(out, split)
        assert sorted(samples) == sorted(key(name) for name in files)
        for name, (size, text) in files.items():
            sample = samples[key(name)]
            got = json.loads(sample["boxes.json"])
            assert got == pixel_boxes(text or "", size, index), (split, name)
            stored = sample["png" if "png" in sample else "jpg"]
            assert Image.open(io.BytesIO(stored)).size == size


@pytest.mark.parametrize("fmt", ["wds", "lmdb", "hdf5"])
@pytest.mark.parametrize("style", ["list", "dict"])
def test_ultralytics_layout_converts_every_box_in_pixels(
    tmp_path: Path, fmt: str, style: str
) -> None:
    raw = make_ultralytics(tmp_path / "raw", style)
    out = tmp_path / "out"
    assert convert(raw, out, fmt) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == tuple(NAMES) and manifest.class_ids is None
    assert manifest.task == "detection"
    assert manifest.field_schemas == {"boxes.json": {
        "kind": "boxes", "format": "XYXY", "units": "pixels", "labels": "classes",
        "polygons": "bounding box"}}  # fmt: skip
    assert {k: s.samples for k, s in manifest.splits.items()} == {"train": 4, "val": 1}
    source = manifest.source
    assert source["kind"] == "yolo" and source["skipped"] == 0
    assert source["config"] == str(raw / "data.yaml") and source["dataset_root"] == str(raw)
    assert source["background_images"] == 1
    assert source["unused"] == {"annotation files": 0, "split lists": 0, "masks": 0, "other": 1}
    check_samples(out, ULTRALYTICS)
    train = by_key(out, "train")
    # by hand: "0 0.5 0.5 0.25 0.5" on 64x48 is x 24..40, y 12..36
    assert json.loads(train["0001"]["boxes.json"])["boxes"][0] == [24, 12, 40, 36]
    # the polygon's bounding box, and the box clipped at the right edge, on 40x30
    assert json.loads(train["0002"]["boxes.json"])["boxes"][0] == pytest.approx([4, 3, 36, 24])
    assert json.loads(train["0002"]["boxes.json"])["boxes"][1][2] == 40
    assert json.loads(train["0003"]["boxes.json"]) == {"boxes": [], "labels": [], "iscrowd": []}
    assert train["0001"]["jpg"] == (raw / "images" / "train" / "0001.jpg").read_bytes()


def test_gapped_names_keep_their_ids(tmp_path: Path) -> None:
    raw = make_ultralytics(tmp_path / "raw")
    ids = [0, 3, 7]
    (raw / "data.yaml").write_text(DATA_YAML.format(path="", names=names_yaml("dict", ids)))
    layout = {s: dict(files) for s, files in ULTRALYTICS.items()}
    for split, files in layout.items():
        for name, (size, text) in files.items():
            if text:
                text = "".join(f"{ids[int(x.split()[0])]} {x.split(' ', 1)[1]}\n"
                               for x in text.splitlines() if x.strip())  # fmt: skip
                (raw / "labels" / split / name).with_suffix(".txt").write_text(text)
            files[name] = (size, text)
    assert convert(raw, tmp_path / "out", "lmdb") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.classes == tuple(NAMES) and manifest.class_ids == (0, 3, 7)
    check_samples(tmp_path / "out", layout, index={0: 0, 3: 1, 7: 2})


ROBOFLOW = {
    "train": {"cat1_jpg.rf.3f2a.jpg": ((48, 48), "0 0.5 0.5 0.5 0.5\n1 0.25 0.25 0.1 0.1\n"),
              "dog2_jpg.rf.9c1e.jpg": ((48, 48), "1 0.6 0.4 0.3 0.2\n")},
    "valid": {"cat3_jpg.rf.77aa.jpg": ((40, 40), "0 0.5 0.5 1 1\n")},
    "test": {"dog4_jpg.rf.0b0b.jpg": ((40, 40), "1 0.4 0.4 0.2 0.2\n")},
}  # fmt: skip
ROBOFLOW_YAML = """\
train: ../train/images
val: ../valid/images
test: ../test/images

nc: 2
names: ['cat', 'dog']

roboflow:
  workspace: my-workspace
  project: pets-x8f2q
  version: 3
  license: CC BY 4.0
  url: https://universe.roboflow.com/my-workspace/pets-x8f2q/dataset/3
"""


def make_roboflow(raw: Path) -> Path:
    """A Roboflow "YOLOv8" export, unzipped: data.yaml, README files, {train,valid,test}/."""
    for split, files in ROBOFLOW.items():
        write_split(raw / split / "images", raw / split / "labels", files)
    (raw / "data.yaml").write_text(ROBOFLOW_YAML)
    (raw / "README.dataset.txt").write_text("# pets > 2024-01-01\n")
    (raw / "README.roboflow.txt").write_text("\npets - v3 2024-01-01\n")
    return raw


def test_roboflow_export_reads_its_parent_relative_splits(tmp_path: Path) -> None:
    raw = make_roboflow(tmp_path / "raw")
    assert open_source(str(raw)).kind == "yolo"
    assert convert(raw, tmp_path / "out", "hdf5") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.classes == ("cat", "dog")
    assert {k: s.samples for k, s in manifest.splits.items()} == {"train": 2, "val": 1, "test": 1}
    assert "Roboflow" in manifest.source["layout"]
    assert manifest.source["splits"]["val"] == [str(raw / "valid" / "images")]
    assert manifest.source["unused"]["other"] == 2  # the two READMEs
    layout = {"train": ROBOFLOW["train"], "val": ROBOFLOW["valid"], "test": ROBOFLOW["test"]}
    check_samples(tmp_path / "out", layout)


def test_a_parent_folder_outside_the_raw_folder_is_never_read(tmp_path: Path) -> None:
    raw = make_roboflow(tmp_path / "raw")
    outside = tmp_path / "train" / "images"  # what ../train/images names, beside raw/
    write_split(outside, tmp_path / "train" / "labels", {"x.jpg": ((20, 20), "0 .5 .5 .5 .5")})
    assert convert(raw, tmp_path / "out") == 0
    assert sorted(by_key(tmp_path / "out", "train")) == [key(n) for n in ROBOFLOW["train"]]


def test_image_lists_as_datumaro_writes_them(tmp_path: Path) -> None:
    raw = make_ultralytics(tmp_path / "raw")
    for split, files in ULTRALYTICS.items():
        (raw / f"{split}.txt").write_text("".join(f"./images/{split}/{n}\n" for n in files))
    (raw / "data.yaml").write_text(
        "train: train.txt\nval: val.txt\nnames:\n  0: person\n  1: bicycle\n  2: car\n"
    )
    assert convert(raw, tmp_path / "out") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.splits["train"].samples == 4
    train = by_key(tmp_path / "out", "train")
    assert sorted(train) == [f"images%2Ftrain%2F000{i}" for i in range(1, 5)]
    got = json.loads(train["images%2Ftrain%2F0001"]["boxes.json"])
    assert got == pixel_boxes(ULTRALYTICS["train"]["0001.jpg"][1], (64, 48))


def test_the_yaml_file_itself_may_be_given(tmp_path: Path) -> None:
    raw = make_ultralytics(tmp_path / "raw", path="/content/datasets/mini")
    (raw / "data.yaml").rename(raw / "mini.yaml")
    assert convert(raw / "mini.yaml", tmp_path / "out", "wds", "--source", "yolo") == 0
    assert dlpipe.read_manifest(str(tmp_path / "out")).splits["val"].samples == 1


def test_a_foreign_path_key_is_ignored_with_a_warning(tmp_path: Path, caplog) -> None:
    raw = make_ultralytics(tmp_path / "raw", path="/content/datasets/mini")
    with caplog.at_level(logging.WARNING, logger="dlpipe"):
        assert convert(raw, tmp_path / "out") == 0
    assert any("path '/content/datasets/mini' is no folder inside" in r.message
               for r in caplog.records)  # fmt: skip
    check_samples(tmp_path / "out", ULTRALYTICS)


def test_a_path_key_naming_a_subfolder_is_the_root(tmp_path: Path) -> None:
    make_ultralytics(tmp_path / "raw" / "coco8")
    (tmp_path / "raw" / "coco8" / "data.yaml").rename(tmp_path / "raw" / "coco8.yaml")
    text = (tmp_path / "raw" / "coco8.yaml").read_text().replace("path: .", "path: coco8")
    (tmp_path / "raw" / "coco8.yaml").write_text(text)
    assert convert(tmp_path / "raw", tmp_path / "out") == 0
    check_samples(tmp_path / "out", ULTRALYTICS)


def test_an_unlabelled_or_missing_test_split_is_left_out(tmp_path: Path) -> None:
    raw = make_roboflow(tmp_path / "raw")
    for path in (raw / "test" / "labels").iterdir():
        path.unlink()
    assert convert(raw, tmp_path / "out") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert set(manifest.splits) == {"train", "val"}
    assert "none of its 1 images has a label file" in manifest.source["left_out"]["test"]
    (raw / "test" / "images" / "dog4_jpg.rf.0b0b.jpg").unlink()
    (raw / "test" / "images").rmdir()
    (raw / "test" / "labels").rmdir()
    assert convert(raw, tmp_path / "out2") == 0
    left_out = dlpipe.read_manifest(str(tmp_path / "out2")).source["left_out"]
    assert "test: '../test/images' names nothing" in left_out["test"]


def test_label_paths_rename_the_last_images_folder() -> None:
    top = "/data/raw"
    assert label_path("/data/raw/images/train/a.b.jpg", top) == "/data/raw/labels/train/a.b.txt"
    assert label_path("/data/raw/images/x/images/y.png", top) == "/data/raw/images/x/labels/y.txt"
    assert label_path("/data/raw/train/y.jpg", top) == "/data/raw/train/y.txt"
    assert label_path("/images/raw/a.jpg", "/images/raw") == "/images/raw/a.txt"


BAD_LINES = {
    "four-fields": ("0 0.5 0.5 0.25\n", "line 1: 4 fields; a YOLO label line is"),
    "six-fields": ("0 0.5 0.5 0.2 0.2 0.9\n", "line 1: 6 fields"),
    "unknown-class": ("0 0.5 0.5 0.2 0.2\n7 0.5 0.5 0.1 0.1\n", "line 2: class '7' is not one"),
    "negative-class": ("-1 0.5 0.5 0.1 0.1\n", "class '-1' is not one of the 3 class ids"),
    "nan": ("0 nan 0.5 0.1 0.1\n", "line 1: 'nan' is not a finite number"),
    "inf": ("0 0.5 0.5 inf 0.1\n", "'inf' is not a finite number"),
    "underscore": ("0 0.5 0.5 1_0 0.1\n", "'1_0' is not a finite number"),
    "zero-width": ("0 0.5 0.5 0 0.1\n", "width 0.0 and height 0.1 must be positive"),
    "outside": ("0 1.5 0.5 0.1 0.1\n", "lies outside the image"),
    "pixels": ("0 32 24 16 24\n", "lies outside the image"),
    "flat-polygon": ("0 0.1 0.1 0.5 0.1 0.9 0.1\n", "the polygon encloses no area"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_a_bad_label_line_skips_only_its_sample(tmp_path: Path, case: str, capsys) -> None:
    raw = make_ultralytics(tmp_path / "raw")
    text, expected = BAD_LINES[case]
    label = raw / "labels" / "train" / "0001.txt"
    label.write_text(text)
    out = tmp_path / "out"
    assert convert(raw, out) == 0
    (error,) = error_records(out)
    assert error["key"] == "0001" and f"{label} " in error["error"], error
    assert expected in error["error"], error
    assert sorted(by_key(out, "train")) == ["0002", "0003", "0004"]
    assert convert(raw, tmp_path / "fail", "lmdb", "--on-error", "fail") == 2
    assert expected in one_error(capsys)


def test_a_label_file_that_is_not_utf8_skips_its_sample(tmp_path: Path) -> None:
    raw = make_ultralytics(tmp_path / "raw")
    (raw / "labels" / "train" / "0001.txt").write_bytes(b"0 0.5 0.5 0.1 0.1\n\xff\xfe\n")
    assert convert(raw, tmp_path / "out") == 0
    (error,) = error_records(tmp_path / "out")
    assert error["key"] == "0001" and "not UTF-8 text" in error["error"]


def test_labels_of_an_exif_turned_jpeg_are_refused(tmp_path: Path) -> None:
    raw = make_ultralytics(tmp_path / "raw")
    image = Image.open(raw / "images" / "train" / "0001.jpg")
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned 90 degrees: the labels are of the turned picture
    image.save(raw / "images" / "train" / "0001.jpg", exif=exif)
    assert convert(raw, tmp_path / "out") == 0
    (error,) = error_records(tmp_path / "out")
    assert error["key"] == "0001" and "EXIF orientation 6" in error["error"]


def test_a_label_file_that_is_a_fifo_is_never_opened(tmp_path: Path) -> None:
    import os

    raw = make_ultralytics(tmp_path / "raw")
    os.mkfifo(raw / "labels" / "train" / "0003.txt")
    assert convert(raw, tmp_path / "out") == 0
    (error,) = error_records(tmp_path / "out")
    assert error["key"] == "0003" and "0003.txt: a FIFO" in error["error"], error


HOSTILE_YAML = (
    "train: images/train\nval: images/val\nnames: !!python/object/apply:os.system ['touch {}']\n"
)
LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
)


def _break_yaml(raw: Path, case: str, tmp_path: Path) -> str:
    yaml_path = raw / "data.yaml"
    text = yaml_path.read_text()
    if case == "python-tag":
        yaml_path.write_text(HOSTILE_YAML.format(tmp_path / "pwned"))
        return "not readable YAML"
    if case == "laughs":
        yaml_path.write_text(LAUGHS + "train: images/train\nval: images/val\nnames: *i\n")
        return "names holds"
    if case == "nc-mismatch":
        yaml_path.write_text(text + "nc: 5\n")
        return "nc is 5 but names holds 3; make them agree"
    if case == "no-names":
        yaml_path.write_text("train: images/train\nval: images/val\nnc: 3\n")
        return "has no names: and train: or val:"
    if case == "bad-key":
        yaml_path.write_text(text.replace("  0: person", "  a: person"))
        return "names key 'a' is not a class id"
    if case == "not-yaml":
        yaml_path.write_text("names: [a, b\ntrain: {")
        return "not readable YAML"
    if case == "too-big":
        yaml_path.write_text(text + "#" * (1 << 20))
        return "over the 1048576-byte limit"
    if case == "missing-train":
        yaml_path.write_text(text.replace("images/train", "images/training"))
        return "train: 'images/training' names no image folder or list inside the raw folder"
    if case == "outside":
        yaml_path.write_text(text.replace("images/train", str(tmp_path)))
        return "names no image folder or list inside the raw folder"
    if case == "in-two-splits":
        yaml_path.write_text(text.replace("val: images/val", "val: [images/val, images/train]"))
        return "0001.jpg is in train and in val"
    if case == "no-labels":
        (raw / "labels").rename(raw / "annotations")
        return "train (" + str(raw / "images" / "train") + "): none of its 4 images has a label"
    if case == "list-of-foreign-paths":
        (raw / "train.txt").write_text(
            "".join(f"/content/ds/images/train/{n}\n" for n in ULTRALYTICS["train"])
        )
        yaml_path.write_text(text.replace("train: images/train", "train: train.txt"))
        return "train.txt line 1: '/content/ds/images/train/0001.jpg' names no image"
    yaml_path.write_text(text.replace("train: images/train", "train: images/empty"))
    (raw / "images" / "empty").mkdir()
    return "train (" + str(raw / "images" / "empty") + "): no images"


YAML_CASES = ["python-tag", "laughs", "nc-mismatch", "no-names", "bad-key", "not-yaml",
              "too-big", "missing-train", "outside", "in-two-splits", "no-labels",
              "list-of-foreign-paths", "empty-train"]  # fmt: skip


@pytest.mark.parametrize("case", YAML_CASES)
def test_a_bad_dataset_is_one_error_line(tmp_path: Path, case: str, capsys) -> None:
    raw = make_ultralytics(tmp_path / "raw")
    expected = _break_yaml(raw, case, tmp_path)
    assert convert(raw, tmp_path / "out", "wds", "--source", "yolo") == 2
    line = one_error(capsys)
    assert expected in line, line
    assert not (tmp_path / "out" / "dlpipe.json").exists()
    assert not (tmp_path / "pwned").exists()


def test_detection_needs_a_data_yaml_and_is_tried_before_class_folders(tmp_path: Path) -> None:
    raw = make_ultralytics(tmp_path / "raw")
    assert open_source(str(raw)).kind == "yolo"
    (raw / "data.yaml").rename(raw / "notes.yaml")
    assert open_source(str(raw)).kind == "yolo"  # any *.yaml with names and train/val
    (raw / "notes.yaml").write_text("title: my notes\n")
    with pytest.raises(SourceError, match="--source yolo"):  # images/ and labels/ no classes
        open_source(str(raw))
    (raw / "other.yaml").write_text("train: a\nval: b\nnames: [x]\n")
    (raw / "more.yaml").write_text("train: a\nval: b\nnames: [y]\n")
    with pytest.raises(SourceError, match="2 data YAMLs"):
        open_source(str(raw), "yolo").scan()


def test_a_pose_dataset_keeps_its_boxes_and_says_keypoints_are_dropped(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    pose = "0 0.5 0.5 0.5 0.5 0.4 0.4 2 0.6 0.6 1\n"  # box + 2 keypoints of (x, y, visible)
    train = {"p.jpg": ((40, 40), pose), "r.jpg": ((40, 40), pose)}
    write_split(raw / "images" / "train", raw / "labels" / "train", train)
    write_split(raw / "images" / "val", raw / "labels" / "val", {"q.jpg": ((20, 20), pose)})
    (raw / "data.yaml").write_text(
        "train: images/train\nvalidation: images/val\nkpt_shape: [2, 3]\nflip_idx: [1, 0]\n"
        "names:\n  0: person\n"
    )
    assert convert(raw, tmp_path / "out") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.source["keypoints"] == "not kept (the boxes are)"
    (sample,) = by_key(tmp_path / "out", "val").values()  # validation: is val
    assert json.loads(sample["boxes.json"])["boxes"] == [[5, 5, 15, 15]]
    (raw / "labels" / "train" / "p.txt").write_text("0 0.1 0.1 0.9 0.2 0.5 0.8\n")
    assert convert(raw, tmp_path / "out2") == 0  # a polygon is no pose line
    (error,) = error_records(tmp_path / "out2")
    assert "7 fields; a YOLO label line is 'class cx cy w h' + keypoints (11" in error["error"]
