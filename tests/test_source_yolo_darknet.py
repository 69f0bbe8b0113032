"""The yolo source reads Darknet's YOLO layout as CVAT's "YOLO 1.1" export ships it (obj.data,
obj.names, train.txt of data/obj_train_data/... rows, label files beside the images) and as
AlexeyAB's darknet lays it out (all of it in data/), box by box in pixels, and never reads a path
out of the raw folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import error_records, one_error
from PIL import Image
from test_source_yolo import by_key, convert, image_bytes, pixel_boxes

import dlpipe
from dlpipe.converters.sources import open_source
from dlpipe.sample import make_key

NAMES = ["car", "person"]
# subset -> image name -> ((width, height), label file text, or None for no label file)
CVAT = {
    "train": {
        "frame_000000.jpg": ((64, 48), "0 0.500000 0.500000 0.250000 0.500000\n"
                                       "1 0.100000 0.200000 0.200000 0.400000\n"),
        "frame_000001.jpg": ((40, 30), "1 0.990000 0.500000 0.030000 0.200000\n"),  # clipped
        "frame_000002.jpg": ((32, 32), None),  # no label file: a background image
        "frame_000003.jpg": ((30, 20), ""),  # an empty one, as CVAT writes for no boxes
    },
    "valid": {"frame_000004.jpg": ((50, 40), "0 0.250000 0.750000 0.500000 0.500000\n")},
}  # fmt: skip
OBJ_DATA = "classes = 2\ntrain = data/train.txt\nvalid = data/valid.txt\nnames = data/obj.names\n"


def make_cvat(raw: Path, obj_data: str = OBJ_DATA + "backup = backup/\n") -> Path:
    """CVAT's "YOLO 1.1" export unzipped: obj.data, obj.names, <subset>.txt and
    obj_<subset>_data/ holding each image and its label file."""
    raw.mkdir(parents=True, exist_ok=True)
    (raw / "obj.data").write_text(obj_data)
    (raw / "obj.names").write_text("".join(f"{n}\n" for n in NAMES))
    for subset, files in CVAT.items():
        folder = raw / f"obj_{subset}_data"
        folder.mkdir()
        for seed, (name, (size, text)) in enumerate(files.items()):
            (folder / name).write_bytes(image_bytes(name, size, seed))
            if text is not None:
                (folder / name).with_suffix(".txt").write_text(text)
        rows = "".join(f"data/obj_{subset}_data/{name}\n" for name in files)
        (raw / f"{subset}.txt").write_text(rows)
    return raw


def key(subset: str, name: str, where: str = "cvat-zip") -> str:
    """A listed image's key: its path in the raw folder, without suffix."""
    prefix = "data/" if where == "darknet-data" else ""
    return make_key(f"{prefix}obj_{subset}_data/{Path(name).stem}")[0]


@pytest.mark.parametrize("where", ["cvat-zip", "darknet-data"])
def test_a_cvat_yolo_export_converts_every_box_in_pixels(tmp_path: Path, where: str) -> None:
    raw = tmp_path / "raw"
    top = make_cvat(raw if where == "cvat-zip" else raw / "data")  # darknet: unzipped in data/
    assert open_source(str(raw)).kind == "yolo"
    out = tmp_path / "out"
    assert convert(raw, out, "lmdb") == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == tuple(NAMES) and manifest.class_ids is None
    assert manifest.task == "detection"
    assert {k: s.samples for k, s in manifest.splits.items()} == {"train": 4, "val": 1}
    source = manifest.source
    assert source["kind"] == "yolo" and source["skipped"] == 0
    assert source["config"] == str(top / "obj.data") and "Darknet YOLO" in source["layout"]
    assert source["splits"] == {"train": [str(top / "train.txt")], "val": [str(top / "valid.txt")]}
    assert source["background_images"] == 1
    assert source["unused"] == {"annotation files": 0, "split lists": 0, "masks": 0, "other": 0}
    for subset, split in (("train", "train"), ("valid", "val")):
        samples = by_key(out, split)
        assert sorted(samples) == sorted(key(subset, name, where) for name in CVAT[subset])
        for name, (size, text) in CVAT[subset].items():
            sample = samples[key(subset, name, where)]
            assert json.loads(sample["boxes.json"]) == pixel_boxes(text or "", size), name
            assert sample["jpg"] == (top / f"obj_{subset}_data" / name).read_bytes()
            assert Image.open(top / f"obj_{subset}_data" / name).size == size
    train = by_key(out, "train")
    # by hand, on 64x48: "0 .5 .5 .25 .5" is x 24..40 y 12..36; "1 .1 .2 .2 .4" x 0..12.8 y 0..19.2
    first = json.loads(train[key("train", "frame_000000.jpg", where)]["boxes.json"])
    assert first["boxes"][0] == [24, 12, 40, 36]
    assert first["boxes"][1] == pytest.approx([0, 0, 12.8, 19.2])
    assert first["labels"] == [0, 1]


def test_obj_names_beside_obj_train_data_is_read_without_obj_data(tmp_path: Path) -> None:
    raw = make_cvat(tmp_path / "raw")
    (raw / "obj.data").unlink()
    (raw / "valid.txt").unlink()  # valid from its folder, train from its list
    assert open_source(str(raw)).kind == "yolo"
    assert convert(raw, tmp_path / "out") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.classes == tuple(NAMES)
    assert manifest.source["splits"]["val"] == [str(raw / "obj_valid_data")]
    assert sorted(by_key(tmp_path / "out", "val")) == ["frame_000004"]  # its path in its folder


def test_classes_that_disagree_with_the_names_file_are_one_error(tmp_path: Path, capsys) -> None:
    raw = make_cvat(tmp_path / "raw", OBJ_DATA.replace("classes = 2", "classes = 3"))
    assert convert(raw, tmp_path / "out") == 2
    line = one_error(capsys)
    assert f"{raw / 'obj.data'}: classes = '3' but {raw / 'obj.names'} names 2 classes" in line
    assert not (tmp_path / "out" / "dlpipe.json").exists()


def test_a_list_row_escaping_the_raw_folder_is_never_read(tmp_path: Path, capsys) -> None:
    raw = make_cvat(tmp_path / "raw")
    outside = tmp_path / "outside"  # what ../outside/x.jpg names, beside raw/
    outside.mkdir()
    (outside / "x.jpg").write_bytes(image_bytes("x.jpg", (20, 20), 9))
    (outside / "x.txt").write_text("0 0.5 0.5 0.5 0.5\n")
    train = raw / "train.txt"
    train.write_text(train.read_text() + "../outside/x.jpg\ndata/../../outside/x.jpg\n")
    assert convert(raw, tmp_path / "out") == 0  # 2 of 6 rows: skipped samples, named
    errors = error_records(tmp_path / "out")
    assert len(errors) == 2 and all(
        "names no image in the raw folder" in e["error"] for e in errors
    )
    assert sorted(by_key(tmp_path / "out", "train")) == sorted(
        key("train", n) for n in CVAT["train"]
    )
    train.write_text("../outside/x.jpg\n" * 3 + "data/obj_train_data/frame_000000.jpg\n")
    assert convert(raw, tmp_path / "out2") == 2  # most rows name nothing inside: refused
    assert "train.txt line 1: '../outside/x.jpg' names no image in the raw folder" in one_error(
        capsys
    )
    (outside / "train.txt").write_text("x.jpg\n")
    (raw / "obj.data").write_text(OBJ_DATA.replace("data/train.txt", "../outside/train.txt"))
    assert convert(raw, tmp_path / "out3") == 2
    assert "train = '../outside/train.txt' names no image list or folder inside the raw folder" in (
        one_error(capsys)
    )


BAD_CONFIGS = {
    "no-names": (OBJ_DATA.replace("names = data/obj.names\n", ""), "no 'names =' line"),
    "missing-names": (OBJ_DATA.replace("obj.names", "classes.names"), "names no file inside"),
    "not-key-value": (OBJ_DATA + "backup backup/\n", "line 5: 'backup backup/' is not 'key ="),
    "missing-train": (
        OBJ_DATA.replace("data/train.txt", "data/training.txt"),
        "train = 'data/training.txt' names no image list",
    ),
    "classes-not-a-count": (OBJ_DATA.replace("= 2", "= two"), "classes = 'two' but"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_a_bad_obj_data_is_one_error_line(tmp_path: Path, case: str, capsys) -> None:
    text, expected = BAD_CONFIGS[case]
    raw = make_cvat(tmp_path / "raw", text)
    assert convert(raw, tmp_path / "out", "wds", "--source", "yolo") == 2
    assert expected in one_error(capsys)


def test_a_missing_image_or_bad_label_line_skips_only_its_sample(tmp_path: Path) -> None:
    raw = make_cvat(tmp_path / "raw")
    (raw / "obj_train_data" / "frame_000001.jpg").unlink()
    (raw / "obj_train_data" / "frame_000000.txt").write_text("5 0.5 0.5 0.1 0.1\n")
    assert convert(raw, tmp_path / "out") == 0
    errors = {e["key"]: e["error"] for e in error_records(tmp_path / "out")}
    missing = make_key("data/obj_train_data/frame_000001")[0]  # the row, as it names nothing
    assert (
        "train.txt line 2: 'data/obj_train_data/frame_000001.jpg' names no image" in errors[missing]
    )
    assert (
        "line 1: class '5' is not one of the 2 class ids"
        in errors[key("train", "frame_000000.jpg")]
    )
    assert sorted(by_key(tmp_path / "out", "train")) == [
        key("train", "frame_000002.jpg"),
        key("train", "frame_000003.jpg"),
    ]


def test_auto_detection_reads_yolo_and_the_class_folder_guard_stays_out(tmp_path: Path) -> None:
    raw = make_cvat(tmp_path / "raw")
    source = open_source(str(raw))  # tried before class folders: their guard never refuses it
    assert source.kind == "yolo" and source.scan().classes == tuple(NAMES)
    assert open_source(str(raw), "imagefolder").kind == "imagefolder"  # only when asked
    assert open_source(str(raw / "obj.data")).kind == "yolo"  # the file itself, as RAW
    (raw / "obj.data").rename(raw / "notes.data")
    (raw / "obj.names").rename(raw / "classes.names")
    assert open_source(str(raw)).kind != "yolo"  # neither file: not Darknet's layout
