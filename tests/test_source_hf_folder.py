"""Hugging Face ``datasets`` image folders with metadata files, built as its docs show them
(huggingface.co/docs/datasets/image_dataset, huggingface.co/docs/hub/datasets-image): captions,
labels, class folders, split folders, object detection and ``*_file_name`` columns, each sample
checked against its metadata row; and the bad rows an attacker or a typo writes."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import error_records, one_error, one_error_line
from PIL import Image, ImageDraw

import dlpipe
from dlpipe.cli import main
from dlpipe.converters.sources import open_source
from dlpipe.sample import unescape_key

# the captions of the docs' example (hub docs, "Additional columns")
POKEMON = {
    "1.jpg": "a drawing of a green pokemon with red eyes",
    "2.jpg": "a green and yellow toy with a red nose",
    "3.jpg": "a red and white ball with an angry look on its face",
    "4.jpg": "a cartoon ball with a smile on it's face",
}
# the object-detection example of the datasets docs (COCO [x, y, width, height] boxes)
OBJECTS = {
    "0001.png": {"bbox": [[302.0, 109.0, 73.0, 52.0]], "categories": [0]},
    "0002.png": {"bbox": [[810.0, 100.0, 57.0, 28.0]], "categories": [1]},
    "0003.png": {
        "bbox": [[160.0, 31.0, 248.0, 616.0], [741.0, 68.0, 202.0, 401.0]],
        "categories": [2, 2],
    },
}


def image(seed: int, size: tuple[int, int] = (24, 16), kind: str = "PNG") -> bytes:
    """A small image of its own (noise, so no two are near-duplicates)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, kind)
    return out.getvalue()


def big_image(seed: int) -> bytes:
    """A 960x660 PNG (room for the docs' boxes) that stays small on disk."""
    im = Image.new("RGB", (960, 660), (seed * 50 % 256, 80, 120))
    draw = ImageDraw.Draw(im)
    for i in range(6):
        x, y = (seed * 97 + i * 131) % 900, (seed * 53 + i * 71) % 600
        draw.rectangle([x, y, x + 40, y + 40], fill=(i * 40, 255 - seed * 30 % 256, 0))
    out = io.BytesIO()
    im.save(out, "PNG")
    return out.getvalue()


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def convert(raw: Path, out: Path, *flags: str, fmt: str = "wds") -> int:
    return main(["convert", str(raw), "--to", fmt, "--out", str(out), "--workers", "1", *flags])


def read_split(out: Path, split: str = "train") -> dict[str, dict[str, bytes]]:
    return {s["__key__"]: dict(s) for s in dlpipe.open_dataset(str(out), split)}


def captions(root: Path) -> Path:
    """The hub docs' layout: ``train/`` holding the images and ``metadata.jsonl``."""
    (root / "train").mkdir(parents=True)
    for i, name in enumerate(POKEMON):
        (root / "train" / name).write_bytes(image(i, kind="JPEG"))
    write_jsonl(
        root / "train" / "metadata.jsonl", [{"file_name": n, "text": t} for n, t in POKEMON.items()]
    )
    return root


def test_captions_jsonl_become_txt_with_the_captioning_task(tmp_path: Path) -> None:
    raw, out = captions(tmp_path / "raw"), tmp_path / "out"
    assert open_source(str(raw)).kind == "hf"
    assert convert(raw, out) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.task == "captioning" and manifest.classes == ()
    assert manifest.field_schemas == {"txt": {"kind": "caption"}}
    assert list(manifest.splits) == ["train"] and manifest.fields_of("train") == {
        "jpg": "image",
        "txt": "text",
    }
    got = read_split(out)
    assert sorted(got) == ["1", "2", "3", "4"]
    for name, text in POKEMON.items():
        sample = got[name.removesuffix(".jpg")]
        assert sample["txt"].decode() == text
        assert sample["jpg"] == (raw / "train" / name).read_bytes()  # a JPEG is kept as it is
    assert manifest.source["kind"] == "hf"
    assert manifest.source["metadata"] == ["train/metadata.jsonl"]
    assert manifest.source["unused"]["images"] == 0


def test_csv_metadata_with_images_in_a_sub_folder_and_a_label_column(tmp_path: Path) -> None:
    """Hub docs "Relative paths": ``file_name`` is a path in the metadata file's folder."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    labels = {}
    for split, count in (("train", 6), ("test", 3)):
        (raw / split / "images").mkdir(parents=True)
        lines = ["file_name,label,width_cm"]
        for i in range(count):
            name = f"{split}{i}.png"
            (raw / split / "images" / name).write_bytes(image(100 + i + 10 * len(split)))
            labels[(split, name)] = ("red", "green", "blue")[i % 3]
            lines.append(f"images/{name},{labels[(split, name)]},{i * 1.5}")
        (raw / split / "metadata.csv").write_text("\n".join(lines) + "\n")
    assert convert(raw, out, fmt="lmdb") == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == ("blue", "green", "red")  # names sorted
    assert manifest.task == "classification"
    assert sorted(manifest.splits) == ["test", "train"]
    for split in ("train", "test"):
        got = read_split(out, split)
        assert len(got) == (6 if split == "train" else 3)
        for (s, name), label in labels.items():
            if s != split:
                continue
            sample = got[f"images%2F{name.removesuffix('.png')}"]
            assert manifest.classes[int(sample["cls"])] == label
            i = int(name.removesuffix(".png").removeprefix(split))
            assert json.loads(sample["json"]) == {"width_cm": i * 1.5}
            assert sample["png"] == (raw / split / "images" / name).read_bytes()


def test_integer_labels_and_an_unlabelled_test_split(tmp_path: Path) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    for split, labels in (("train", [0, 2, 1, 2]), ("test", [-1, -1])):
        (raw / split).mkdir(parents=True)
        rows = []
        for i, label in enumerate(labels):
            (raw / split / f"{i}.png").write_bytes(image(200 + i + 50 * len(split)))
            rows.append({"file_name": f"{i}.png", "label": label})
        write_jsonl(raw / split / "metadata.jsonl", rows)
    assert convert(raw, out, fmt="hdf5") == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == ("0", "1", "2")
    assert {k: int(s["cls"]) for k, s in read_split(out).items()} == {
        "0": 0,
        "1": 2,
        "2": 1,
        "3": 2,
    }
    assert manifest.fields_of("test") == {"png": "image"}  # no labels: no cls
    assert sorted(read_split(out, "test")) == ["0", "1"]


def test_parquet_metadata_names_integer_labels_by_its_class_label_feature(tmp_path: Path) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    (raw / "train").mkdir(parents=True)
    for i in range(4):
        (raw / "train" / f"{i}.png").write_bytes(image(300 + i))
    table = pa.table({"file_name": [f"{i}.png" for i in range(4)], "label": [1, 0, 1, 2]})
    features = {"label": {"names": ["cat", "dog", "bird"], "_type": "ClassLabel"}}
    meta = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    pq.write_table(table.replace_schema_metadata(meta), raw / "train" / "metadata.parquet")
    assert convert(raw, out) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == ("cat", "dog", "bird")  # the feature's order, not sorted
    assert {k: int(s["cls"]) for k, s in read_split(out).items()} == {
        "0": 1,
        "1": 0,
        "2": 1,
        "3": 2,
    }


def class_folders(root: Path) -> Path:
    """``train/<class>/<image>`` beside a ``train/metadata.jsonl`` of extra columns."""
    rows = []
    for i, cls in enumerate(["dog", "cat", "dog", "bird", "cat"]):
        (root / "train" / cls).mkdir(parents=True, exist_ok=True)
        (root / "train" / cls / f"{i}.png").write_bytes(image(400 + i))
        rows.append({"file_name": f"{cls}/{i}.png", "photographer": f"p{i}", "score": i / 2})
    write_jsonl(root / "train" / "metadata.jsonl", rows)
    return root


def test_class_folders_beside_metadata_give_labels_and_json(tmp_path: Path, caplog) -> None:
    raw, out = class_folders(tmp_path / "raw"), tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="dlpipe"):
        assert convert(raw, out) == 0
    assert any("labels come from the images' folders" in r.message for r in caplog.records)
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == ("bird", "cat", "dog") and manifest.task == "classification"
    assert manifest.source["labels"] == "folders"
    got = read_split(out)
    for i, cls in enumerate(["dog", "cat", "dog", "bird", "cat"]):
        sample = got[f"{cls}%2F{i}"]
        assert manifest.classes[int(sample["cls"])] == cls
        assert (
            sample["json"]
            == json.dumps({"photographer": f"p{i}", "score": i / 2}, separators=(",", ":")).encode()
        )
    assert convert(raw, tmp_path / "bare", "--label-col", "none") == 0
    assert dlpipe.read_manifest(str(tmp_path / "bare")).classes == ()
    assert "cls" not in next(iter(read_split(tmp_path / "bare").values()))


def test_one_image_folder_or_mixed_depths_give_no_folder_labels(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    (raw / "train" / "images").mkdir(parents=True)
    (raw / "train" / "images" / "a.png").write_bytes(image(1))
    (raw / "train" / "images" / "b.png").write_bytes(image(2))
    write_jsonl(
        raw / "train" / "metadata.jsonl",
        [{"file_name": "images/a.png", "x": 1}, {"file_name": "images/b.png", "x": 2}],
    )
    assert open_source(str(raw)).scan().classes == ()  # one folder is no class
    (raw / "train" / "c.png").write_bytes(image(3))
    (raw / "train" / "images2").mkdir()
    (raw / "train" / "images2" / "d.png").write_bytes(image(4))
    rows = [{"file_name": n, "x": 0} for n in ("images/a.png", "c.png", "images2/d.png")]
    write_jsonl(raw / "train" / "metadata.jsonl", rows)
    assert open_source(str(raw)).scan().classes == ()  # c.png is in no folder


@pytest.mark.parametrize("top", ["", "data/"])
def test_split_folders_each_with_their_metadata(tmp_path: Path, top: str) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    expected = {}
    for n, folder in enumerate(["train", "validation", "test"]):
        split_dir = raw / top / folder
        split_dir.mkdir(parents=True)
        rows = []
        for i in range(2 + n):
            (split_dir / f"{i:04d}.png").write_bytes(image(500 + 10 * n + i))
            rows.append({"file_name": f"{i:04d}.png", "text": f"{folder} caption {i}"})
        write_jsonl(split_dir / "metadata.jsonl", rows)
        expected[{"validation": "val"}.get(folder, folder)] = rows
    assert convert(raw, out) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert sorted(manifest.splits) == ["test", "train", "val"]
    for split, rows in expected.items():
        got = read_split(out, split)
        assert {k: s["txt"].decode() for k, s in got.items()} == {
            r["file_name"].removesuffix(".png"): r["text"] for r in rows
        }


def detection(root: Path, objects: dict | None = None, extra: dict | None = None) -> Path:
    (root / "train").mkdir(parents=True)
    rows = []
    for i, (name, objs) in enumerate((objects or OBJECTS).items()):
        (root / "train" / name).write_bytes(big_image(i + 1))
        rows.append({"file_name": name, "objects": objs, **(extra or {})})
    write_jsonl(root / "train" / "metadata.jsonl", rows)
    return root


def test_objects_become_boxes_json_from_coco_xywh(tmp_path: Path) -> None:
    raw, out = detection(tmp_path / "raw"), tmp_path / "out"
    assert convert(raw, out, fmt="hdf5") == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.task == "detection" and manifest.classes == ("0", "1", "2")
    assert manifest.field_schemas["boxes.json"]["format"] == "XYXY"
    assert manifest.source["bbox_format"].startswith("COCO [x_min, y_min, width, height]")
    got = read_split(out)
    assert sorted(got) == ["0001", "0002", "0003"]
    for name, objs in OBJECTS.items():
        boxes = json.loads(got[name.removesuffix(".png")]["boxes.json"])
        assert boxes["boxes"] == [[x, y, x + w, y + h] for x, y, w, h in objs["bbox"]]
        assert boxes["labels"] == objs["categories"]
        assert boxes["iscrowd"] == [0] * len(objs["bbox"])
        assert "json" not in got[name.removesuffix(".png")]


def test_objects_spelled_category_or_as_a_list_with_ids_and_areas(tmp_path: Path) -> None:
    objects = {
        "a.png": {"bbox": [[1, 2, 30, 40]], "category": ["car"], "id": [7], "area": [1200]},
        "b.png": [
            {"bbox": [10, 10, 5, 5], "category": "person", "id": 8, "area": 25},
            {"bbox": [0, 0, 959, 659], "category": "car", "id": 9, "area": 632081},
        ],
    }
    raw, out = detection(tmp_path / "raw", objects), tmp_path / "out"
    assert convert(raw, out) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == ("car", "person")
    got = read_split(out)
    a, b = json.loads(got["a"]["boxes.json"]), json.loads(got["b"]["boxes.json"])
    assert a == {"boxes": [[1, 2, 31, 42]], "labels": [0], "iscrowd": [0], "ids": [7]}
    assert b["boxes"] == [[10, 10, 15, 15], [0, 0, 959, 659]] and b["labels"] == [1, 0]
    assert b["ids"] == [8, 9]
    assert json.loads(got["a"]["json"]) == {"objects": {"area": [1200]}}
    assert json.loads(got["b"]["json"]) == {"objects": {"area": [25, 632081]}}


def test_parquet_objects_take_class_names_from_the_features(tmp_path: Path) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    (raw / "train").mkdir(parents=True)
    for i, name in enumerate(OBJECTS):
        (raw / "train" / name).write_bytes(big_image(i + 1))
    table = pa.table({"file_name": list(OBJECTS), "objects": list(OBJECTS.values())})
    features = {
        "file_name": {"dtype": "string", "_type": "Value"},
        "objects": {
            "feature": {
                "bbox": {"feature": {"dtype": "float32", "_type": "Value"}, "_type": "Sequence"},
                "categories": {"names": ["cat", "dog", "fish"], "_type": "ClassLabel"},
            },
            "_type": "Sequence",
        },
    }
    meta = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    pq.write_table(table.replace_schema_metadata(meta), raw / "train" / "metadata.parquet")
    assert convert(raw, out) == 0
    assert dlpipe.read_manifest(str(out)).classes == ("cat", "dog", "fish")
    assert json.loads(read_split(out)["0003"]["boxes.json"])["labels"] == [2, 2]


def test_file_name_columns_add_images_of_their_own(tmp_path: Path) -> None:
    """ControlNet-style: ``image_file_name`` and ``conditioning_image_file_name`` + ``text``."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    (raw / "train" / "images").mkdir(parents=True)
    (raw / "train" / "conditioning").mkdir()
    rows = []
    for i in range(3):
        (raw / "train" / "images" / f"{i}.jpg").write_bytes(image(600 + i, kind="JPEG"))
        (raw / "train" / "conditioning" / f"{i}.png").write_bytes(image(700 + i))
        rows.append({
            "image_file_name": f"images/{i}.jpg",
            "conditioning_image_file_name": f"conditioning/{i}.png",
            "text": f"prompt {i}",
        })  # fmt: skip
    write_jsonl(raw / "train" / "metadata.jsonl", rows)
    assert convert(raw, out) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.fields_of("train") == {
        "jpg": "image",
        "conditioning_image.png": "image",
        "txt": "text",
    }
    got = read_split(out)
    for i in range(3):
        sample = got[f"images%2F{i}"]
        assert sample["jpg"] == (raw / "train" / "images" / f"{i}.jpg").read_bytes()
        expected = (raw / "train" / "conditioning" / f"{i}.png").read_bytes()
        assert sample["conditioning_image.png"] == expected
        assert sample["txt"] == f"prompt {i}".encode()
    assert manifest.source["unused"]["images"] == 0


def test_other_columns_are_sorted_json_safe_values(tmp_path: Path) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    (raw / "train").mkdir(parents=True)
    (raw / "train" / "a.png").write_bytes(image(1))
    (raw / "train" / "b.png").write_bytes(image(2))
    (raw / "train" / "metadata.jsonl").write_text(
        '{"file_name": "a.png", "z": NaN, "tags": ["x", "y"], "meta": {"k": 1}, "ü": "é"}\n'
        '{"file_name": "b.png", "z": 1.5}\n'
    )
    assert convert(raw, out) == 0
    got = read_split(out)
    assert got["a"]["json"] == '{"meta":{"k":1},"tags":["x","y"],"z":null,"ü":"é"}'.encode()
    assert json.loads(got["b"]["json"]) == {"meta": None, "tags": None, "z": 1.5, "ü": None}


def test_a_file_named_by_two_rows_gives_two_samples(tmp_path: Path) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    (raw / "train").mkdir(parents=True)
    (raw / "train" / "a.png").write_bytes(image(1))
    rows = [{"file_name": "a.png", "text": "first"}, {"file_name": "a.png", "text": "second"}]
    write_jsonl(raw / "train" / "metadata.jsonl", rows)
    assert convert(raw, out) == 0
    got = read_split(out)
    assert {k: s["txt"] for k, s in got.items()} == {"a": b"first", "a%231": b"second"}


def test_images_no_row_names_are_counted_and_warned_about(tmp_path: Path, caplog) -> None:
    raw, out = captions(tmp_path / "raw"), tmp_path / "out"
    (raw / "train" / "stray.png").write_bytes(image(99))
    (raw / "train" / "notes.txt").write_text("not data")
    with caplog.at_level(logging.WARNING, logger="dlpipe"):
        assert convert(raw, out) == 0
    assert any("1 image files are named by no metadata row" in r.message for r in caplog.records)
    unused = dlpipe.read_manifest(str(out)).source["unused"]
    assert unused["images"] == 1 and unused["other"] == 1
    assert dlpipe.read_manifest(str(out)).splits["train"].samples == 4


# --- bad rows ---------------------------------------------------------------------------


def test_a_row_naming_a_missing_file_is_one_skipped_sample(tmp_path: Path) -> None:
    raw, out = captions(tmp_path / "raw"), tmp_path / "out"
    (raw / "train" / "3.jpg").unlink()
    assert convert(raw, out) == 0
    assert sorted(read_split(out)) == ["1", "2", "4"]
    (error,) = error_records(out)
    assert error["origin"] == "train/metadata.jsonl line 3 (3.jpg)"
    assert "file_name '3.jpg'" in error["error"] and "no such file" in error["error"]


def test_most_rows_missing_stops_naming_the_file_a_row_and_where_it_looked(
    tmp_path: Path, capsys
) -> None:
    raw, out = captions(tmp_path / "raw"), tmp_path / "out"
    rows = [{"file_name": f"pics/{n}", "text": t} for n, t in POKEMON.items()]
    write_jsonl(raw / "train" / "metadata.jsonl", rows)
    assert convert(raw, out) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "train/metadata.jsonl: 4 of its first 4 rows name no file" in line
    assert "line 1: 'pics/1.jpg'" in line and f"{raw / 'train' / 'pics' / '1.jpg'}" in line
    assert not (out / "dlpipe.json").exists()


def test_a_malformed_jsonl_line_is_one_error_naming_file_and_line(tmp_path: Path, capsys) -> None:
    raw, out = captions(tmp_path / "raw"), tmp_path / "out"
    path = raw / "train" / "metadata.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = '{"file_name": "3.jpg", "text": "unterminated}'
    path.write_text("\n".join(lines) + "\n")
    assert open_source(str(raw)).kind == "hf"  # detected by its header; the scan names the line
    assert convert(raw, out) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "train/metadata.jsonl line 3: not JSON" in line and "fix or remove the line" in line
    path.write_text(path.read_text().replace(lines[2], "[1, 2]"))
    assert convert(raw, out) == 2
    assert "line 3: a JSON list, not an object" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("bbox", "why"),
    [
        ([10, 10, 0, 5], "has no positive width and height"),
        ([10, 10, 5, -1], "has no positive width and height"),
        ([10, 10, 5], "is not 4 numbers"),
        ([10, "x", 5, 5], "is not 4 numbers"),
    ],
)
def test_a_bad_bbox_skips_only_its_sample(tmp_path: Path, bbox: list, why: str) -> None:
    objects = dict(OBJECTS)
    objects["0002.png"] = {"bbox": [bbox], "categories": [1]}
    raw, out = detection(tmp_path / "raw", objects), tmp_path / "out"
    assert convert(raw, out) == 0
    assert sorted(read_split(out)) == ["0001", "0003"]
    (error,) = error_records(out)
    assert error["origin"] == "train/metadata.jsonl line 2 (0002.png)"
    assert f"object 0: bbox {bbox!r} {why}" in error["error"]


def test_a_box_past_the_image_or_a_negative_category_is_skipped(tmp_path: Path) -> None:
    objects = dict(OBJECTS)
    objects["0001.png"] = {"bbox": [[900, 600, 100, 100]], "categories": [0]}  # past 960x660
    objects["0002.png"] = {"bbox": [[1, 1, 5, 5]], "categories": [-1]}
    raw, out = detection(tmp_path / "raw", objects), tmp_path / "out"
    assert convert(raw, out) == 0
    assert sorted(read_split(out)) == ["0003"]
    by_origin = {e["origin"]: e["error"] for e in error_records(out)}
    assert "lies outside the 960x660 image" in by_origin["train/metadata.jsonl line 1 (0001.png)"]
    assert (
        "category -1 is not one of the 3 classes"
        in by_origin["train/metadata.jsonl line 2 (0002.png)"]
    )


@pytest.mark.parametrize("name", ["../x.jpg", "images/../../x.jpg", "/etc/passwd", "C:/x.jpg"])
def test_a_path_leaving_the_metadata_folder_is_refused_and_never_read(
    tmp_path: Path, name: str
) -> None:
    raw, out = captions(tmp_path / "raw"), tmp_path / "out"
    (raw / "x.jpg").write_bytes(image(42, kind="JPEG"))  # inside the raw folder, not train/
    rows = [{"file_name": n, "text": t} for n, t in POKEMON.items()]
    rows[1]["file_name"] = name
    write_jsonl(raw / "train" / "metadata.jsonl", rows)
    assert convert(raw, out) == 0
    got = read_split(out)
    assert sorted(got) == ["1", "3", "4"]
    assert all(s["jpg"] != (raw / "x.jpg").read_bytes() for s in got.values())
    (error,) = error_records(out)
    assert "leads outside the metadata file's folder train" in error["error"]


def test_a_fifo_named_by_a_row_is_skipped_not_opened(tmp_path: Path) -> None:
    import os

    raw, out = captions(tmp_path / "raw"), tmp_path / "out"
    (raw / "train" / "2.jpg").unlink()
    os.mkfifo(raw / "train" / "2.jpg")
    assert convert(raw, out) == 0
    (error,) = error_records(out)
    assert "file_name '2.jpg'" in error["error"] and "FIFO" in error["error"].upper()


def test_an_empty_caption_or_label_in_a_labelled_split_skips_its_row(tmp_path: Path) -> None:
    raw, out = captions(tmp_path / "raw"), tmp_path / "out"
    rows = [{"file_name": n, "text": t} for n, t in POKEMON.items()]
    rows[0]["text"] = None
    write_jsonl(raw / "train" / "metadata.jsonl", rows)
    assert convert(raw, out) == 0
    assert sorted(read_split(out)) == ["2", "3", "4"]
    assert "caption is empty" in error_records(out)[0]["error"]


# --- neighbours: what stays a table, what is no HF folder ---------------------------------


def test_a_labels_table_beside_images_stays_a_table(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    (raw / "images").mkdir(parents=True)
    (raw / "images" / "0.jpg").write_bytes(image(0, kind="JPEG"))
    (raw / "labels.csv").write_text("file_name,label\n0.jpg,cat\n")
    assert open_source(str(raw)).kind == "table"
    (raw / "labels.csv").rename(raw / "metadata.csv")  # no file_name header: not HF's
    (raw / "metadata.csv").write_text("image,label\nimages/0.jpg,cat\n")
    assert open_source(str(raw)).kind == "table"


def test_metadata_csv_with_file_name_and_label_is_read_as_hf_not_table(tmp_path: Path) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    raw.mkdir()
    for i in range(4):
        (raw / f"{i}.png").write_bytes(image(800 + i))
    rows = "".join(f'{i}.png,{"ab"[i % 2]},"caption, {i}\non two lines"\n' for i in range(4))
    (raw / "metadata.csv").write_text("file_name,label,text\n" + rows)
    assert open_source(str(raw)).kind == "hf"
    assert convert(raw, out) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == ("a", "b") and manifest.task == "classification"
    assert manifest.field_schemas == {"txt": {"kind": "caption"}}
    got = read_split(out)
    assert {k: (int(s["cls"]), s["txt"]) for k, s in got.items()} == {
        str(i): (i % 2, f"caption, {i}\non two lines".encode()) for i in range(4)
    }


def test_no_file_name_column_under_source_hf_is_one_clear_error(tmp_path: Path, capsys) -> None:
    raw = tmp_path / "raw"
    (raw / "train").mkdir(parents=True)
    (raw / "train" / "a.png").write_bytes(image(1))
    write_jsonl(raw / "train" / "metadata.jsonl", [{"image": "a.png", "text": "x"}])
    assert convert(raw, tmp_path / "out", "--source", "hf") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "train/metadata.jsonl: no file_name column (the columns are image, text)" in line


def test_a_split_folder_beside_an_unsplit_metadata_file_is_refused(tmp_path: Path, capsys) -> None:
    raw = captions(tmp_path / "raw")
    (raw / "extra").mkdir()
    (raw / "extra" / "e.png").write_bytes(image(5))
    write_jsonl(raw / "extra" / "metadata.jsonl", [{"file_name": "e.png", "text": "e"}])
    assert convert(raw, tmp_path / "out") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "extra/metadata.jsonl: names no split" in line


# --- --key-col and --image-root ----------------------------------------------------------------


def write_metadata(folder: Path, rows: list[dict], kind: str) -> None:
    """``metadata.<kind>`` in `folder` holding `rows` (jsonl, csv or parquet)."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        write_jsonl(folder / "metadata.jsonl", rows)
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), folder / "metadata.parquet")
    else:
        columns = list(rows[0])
        lines = [",".join(columns)] + [",".join(str(r[c]) for c in columns) for r in rows]
        (folder / "metadata.csv").write_text("\n".join(lines) + "\n")


def keyed(root: Path, ids: list, kind: str = "jsonl", split: str = "train") -> Path:
    """`split`/ with one image per id and a metadata file whose ``id`` column holds `ids`."""
    rows = []
    for i, ident in enumerate(ids):
        (root / split).mkdir(parents=True, exist_ok=True)
        (root / split / f"{i}.png").write_bytes(image(500 + i + 10 * len(split)))
        rows.append({"file_name": f"{i}.png", "id": ident, "text": f"image {i}"})
    write_metadata(root / split, rows, kind)
    return root


@pytest.mark.parametrize(
    ("kind", "ids", "keys"),
    [
        ("jsonl", ["a/b", 7, 8.0], ["a/b", "7", "8"]),
        ("csv", ["a/b", "x y", "c"], ["a/b", "x y", "c"]),
        ("parquet", [10, 11, 12], ["10", "11", "12"]),
    ],
)
def test_key_col_names_the_keys_in_every_metadata_format(
    tmp_path: Path, kind: str, ids: list, keys: list[str]
) -> None:
    raw, out = keyed(tmp_path / "raw", ids, kind), tmp_path / "out"
    assert convert(raw, out, "--key-col", "id") == 0
    got = {unescape_key(k): s for k, s in read_split(out).items()}
    assert sorted(got) == sorted(keys)
    for i, key in enumerate(keys):
        assert got[key]["png"] == (raw / "train" / f"{i}.png").read_bytes()
        assert got[key]["txt"] == f"image {i}".encode()
        assert "id" in json.loads(got[key]["json"])  # the key column is kept, as tables keep it
    assert convert(raw, tmp_path / "default") == 0  # without --key-col: the file names
    assert sorted(read_split(tmp_path / "default")) == ["0", "1", "2"]


def test_key_col_too_long_for_a_key_is_shortened_and_listed(tmp_path: Path) -> None:
    long_id = "sample-" + "z" * 300
    raw, out = keyed(tmp_path / "raw", [long_id, "short"]), tmp_path / "out"
    assert convert(raw, out, "--key-col", "id") == 0
    records = [json.loads(x) for x in (out / "keys.jsonl").read_text().splitlines()]
    assert [r["original"] for r in records] == [long_id]
    assert set(read_split(out)) == {records[0]["key"], "short"}


@pytest.mark.parametrize(
    ("ids", "first", "again"),
    [(["a", "b", "a"], 1, 3), ([7, 7.0], 1, 2), (["7", 7], 1, 2), (["a/b", "a/b"], 1, 2)],
)
def test_key_col_duplicates_in_a_split_are_one_error_line(
    tmp_path: Path, capsys, ids: list, first: int, again: int
) -> None:
    raw, out = keyed(tmp_path / "raw", ids), tmp_path / "out"
    assert convert(raw, out, "--key-col", "id") == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"train/metadata.jsonl line {again}: key " in line
    assert f"in column 'id' is a duplicate (first in train/metadata.jsonl line {first})" in line
    assert "--key-col" in line and not out.exists()


def test_key_col_equal_keys_in_two_splits_are_fine(tmp_path: Path) -> None:
    raw, out = keyed(tmp_path / "raw", ["a", "b"]), tmp_path / "out"
    keyed(raw, ["a", "b"], split="test")
    assert convert(raw, out, "--key-col", "id") == 0
    assert sorted(read_split(out)) == sorted(read_split(out, "test")) == ["a", "b"]


@pytest.mark.parametrize(
    ("value", "shown"),
    [(None, "None"), ("", "''"), (True, "True"), ([1], "[1]"), ({"a": 1}, "{'a': 1}"),
     (float("nan"), "nan"), (float("inf"), "inf")],
)  # fmt: skip
def test_key_col_values_that_cannot_be_keys_are_one_error_line(
    tmp_path: Path, capsys, value: object, shown: str
) -> None:
    raw, out = keyed(tmp_path / "raw", ["a", value, "c"]), tmp_path / "out"
    assert convert(raw, out, "--key-col", "id") == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"train/metadata.jsonl line 2: id {shown} cannot be a key" in line
    assert "another column with --key-col" in line and not out.exists()


def test_key_col_missing_from_a_row_or_the_file_is_one_error_line(tmp_path: Path, capsys) -> None:
    raw, out = keyed(tmp_path / "raw", ["a", "b"]), tmp_path / "out"
    write_jsonl(raw / "train" / "metadata.jsonl", [{"file_name": "0.png", "id": "a"},
                                                   {"file_name": "1.png"}])  # fmt: skip
    assert convert(raw, out, "--key-col", "id") == 2
    assert "train/metadata.jsonl line 2: id None cannot be a key" in one_error(capsys)
    assert convert(raw, out, "--key-col", "ID") == 2
    line = one_error(capsys)
    assert "train/metadata.jsonl: --key-col 'ID' is not a column" in line
    assert line.endswith("the columns are file_name, id")
    assert not out.exists()


@pytest.mark.parametrize("given", ["train", ".", "absolute"])
@pytest.mark.parametrize("source", [(), ("--source", "hf")], ids=["detected", "named"])
def test_image_root_is_refused_in_one_line_as_hf_resolves_file_name_itself(
    tmp_path: Path, capsys, given: str, source: tuple[str, ...]
) -> None:
    raw, out = captions(tmp_path / "raw"), tmp_path / "out"
    root = str(raw / "train") if given == "absolute" else given
    assert convert(raw, out, *source, "--image-root", root) == 2
    line = one_error(capsys)
    assert line.startswith(f"error: --image-root {root!r}: a Hugging Face image folder names")
    assert "relative to its metadata file's folder" in line and "--source table" in line
    assert not out.exists()


def test_the_table_source_the_refusal_names_reads_an_image_root(tmp_path: Path) -> None:
    raw, out = tmp_path / "raw", tmp_path / "out"
    (raw / "pics").mkdir(parents=True)
    for name in POKEMON:
        (raw / "pics" / name).write_bytes(image(len(name), kind="JPEG"))
    write_jsonl(raw / "metadata.jsonl", [{"file_name": n, "text": t} for n, t in POKEMON.items()])
    assert convert(raw, out, "--source", "table", "--image-root", "pics") == 0
    manifest = dlpipe.read_manifest(str(out))
    assert sum(s.samples for s in manifest.splits.values()) == len(POKEMON)
