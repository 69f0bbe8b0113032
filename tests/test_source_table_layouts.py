"""Tables as datasets ship: a table beside a folder of images (Kaggle), detection that says
why, an early stop when the paths point nowhere, and tables without labels."""

from __future__ import annotations

import io
import logging
import os
from pathlib import Path

import pytest
from conftest import one_error_line
from PIL import Image

import dlpipe
from dlpipe.cli import main
from dlpipe.converters.source import SourceError, SourceOptions
from dlpipe.converters.sources import open_source
from dlpipe.converters.table import TableSource


def jpeg(index: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 6), (index * 40 % 256, 90, 200)).save(out, "JPEG")
    return out.getvalue()


def kaggle(root: Path, rows: int = 6, *, suffix: str = ".jpg", folder: str = "train") -> Path:
    """Kaggle's usual ``train.csv`` (``id,label``) beside ``train/<id>.jpg``."""
    (root / folder).mkdir(parents=True)
    lines = ["id,label"]
    for i in range(rows):
        (root / folder / f"img{i:03d}.jpg").write_bytes(jpeg(i))
        lines.append(f"img{i:03d}{suffix},{'cat' if i % 2 else 'dog'}")
    (root / "train.csv").write_text("\n".join(lines) + "\n")
    return root


def labels_beside_images(root: Path, rows: int = 6) -> Path:
    """``labels.csv`` (``filename,label``) with the files under ``images/``."""
    (root / "images").mkdir(parents=True)
    lines = ["filename,label"]
    for i in range(rows):
        (root / "images" / f"{i}.jpg").write_bytes(jpeg(i))
        lines.append(f"{i}.jpg,{'cat' if i % 2 else 'dog'}")
    (root / "labels.csv").write_text("\n".join(lines) + "\n")
    return root


def convert(raw: Path, out: Path, *flags: str) -> int:
    return main(["convert", str(raw), "--to", "wds", "--out", str(out), "--workers", "1", *flags])


def samples(out: Path) -> list[dict]:
    return [dlpipe.decode_sample(s) for s in dlpipe.open_dataset(str(out), "train")]


def test_labels_csv_beside_images_folder_is_detected_and_converts(tmp_path, capsys) -> None:
    raw = labels_beside_images(tmp_path / "raw")
    assert convert(raw, tmp_path / "out") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.source["kind"] == "table" and manifest.classes == ("cat", "dog")
    assert manifest.source["image_roots"] == {"labels.csv": "images"}
    got = samples(tmp_path / "out")
    assert len(got) == 6 and sorted(int(g["cls"]) for g in got) == [0, 0, 0, 1, 1, 1]
    assert manifest.source.get("skipped", 0) == 0


def test_kaggle_ids_without_suffix_resolve_to_the_one_image(tmp_path, caplog) -> None:
    raw = kaggle(tmp_path / "raw", suffix="")
    (raw / "test").mkdir()  # the unlabelled images Kaggle ships beside: not chosen
    (raw / "test" / "other.jpg").write_bytes(jpeg(9))
    with caplog.at_level(logging.INFO, logger="dlpipe"):
        assert convert(raw, tmp_path / "out") == 0
    assert any("train.csv" in r.message and "--image-root" in r.message for r in caplog.records)
    got = samples(tmp_path / "out")
    assert len(got) == 6
    assert sorted(g["__key__"] for g in got) == [f"img{i:03d}" for i in range(6)]


def test_an_id_matching_two_images_is_not_guessed(tmp_path) -> None:
    raw = kaggle(tmp_path / "raw", suffix="", rows=3)
    (raw / "train" / "img000.png").write_bytes(jpeg(0))
    result = TableSource(str(raw)).scan()
    assert result.items[0].size == 0 and result.items[1].size > 0  # img000 names two files


def test_explicit_image_root_relative_to_the_raw_folder(tmp_path) -> None:
    raw = labels_beside_images(tmp_path / "raw")
    (raw / "thumbs").mkdir()
    (raw / "thumbs" / "0.jpg").write_bytes(jpeg(0))  # two folders hold files: no auto choice
    assert convert(raw, tmp_path / "out", "--image-root", "images") == 0
    assert len(samples(tmp_path / "out")) == 6


def test_image_root_outside_the_raw_folder_is_refused(tmp_path, capsys) -> None:
    raw = labels_beside_images(tmp_path / "raw")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    assert convert(raw, tmp_path / "out", "--image-root", str(outside)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--image-root" in line and "outside the raw folder" in line
    assert not (tmp_path / "out").exists()


def test_image_root_that_is_no_folder_is_refused(tmp_path, capsys) -> None:
    raw = labels_beside_images(tmp_path / "raw")
    assert convert(raw, tmp_path / "out", "--image-root", "nope") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--image-root nope: not a folder" in line


def test_an_auto_image_root_never_follows_a_folder_link_out(tmp_path) -> None:
    outside = tmp_path / "secret"
    labels_beside_images(outside)
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "labels.csv").write_bytes((outside / "labels.csv").read_bytes())
    (raw / "images").symlink_to(outside / "images")
    with pytest.raises(SourceError, match=r"6 of the first 6 image paths name no file"):
        TableSource(str(raw)).scan()


def test_most_paths_missing_stops_early_with_one_line(tmp_path, capsys) -> None:
    raw = labels_beside_images(tmp_path / "raw", rows=30)
    for path in (raw / "images").iterdir():
        path.rename(raw / "images" / ("x" + path.name))
    assert convert(raw, tmp_path / "out", "--source", "table") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "labels.csv: 30 of the first 30 image paths name no file" in line
    assert "row 0: '0.jpg'" in line and str(raw) in line and "--image-root DIR" in line
    assert not (tmp_path / "out").exists()
    assert len(list((raw / "images").iterdir())) == 30  # nothing of the user's touched


def test_a_few_missing_images_are_still_skipped_samples(tmp_path, capsys) -> None:
    raw = labels_beside_images(tmp_path / "raw", rows=10)
    (raw / "images" / "3.jpg").unlink()
    assert convert(raw, tmp_path / "out") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.source["skipped"] == 1 and len(samples(tmp_path / "out")) == 9


def test_the_first_twenty_missing_stop_even_when_later_rows_exist(tmp_path) -> None:
    raw = labels_beside_images(tmp_path / "raw", rows=60)
    for i in range(20):
        (raw / "images" / f"{i}.jpg").unlink()
    with pytest.raises(SourceError, match=r"20 of the first 60 image paths .*row 0: '0\.jpg'"):
        TableSource(str(raw), SourceOptions(image_root="images")).scan()


def read_as_warnings(caplog) -> list[str]:
    return [
        r.message for r in caplog.records if r.levelno == logging.WARNING and "read as" in r.message
    ]


def test_table_beside_class_folders_warns_naming_the_other_source(tmp_path, capsys) -> None:
    raw = tmp_path / "raw"
    for i, cls in enumerate(["cat", "dog", "cat", "dog"]):
        (raw / cls).mkdir(parents=True, exist_ok=True)
        (raw / cls / f"{i}.jpg").write_bytes(jpeg(i))
    rows = "".join(
        f"{c}/{i}.jpg,{'big' if i < 2 else 'small'}\n"
        for i, c in enumerate(["cat", "dog", "cat", "dog"])
    )
    (raw / "labels.csv").write_text("filename,label\n" + rows)
    assert convert(raw, tmp_path / "out") == 0
    printed = capsys.readouterr()
    lines = [line for line in (printed.out + printed.err).splitlines() if "read as" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: ")
    assert (
        "read as table (--source table) because labels.csv has an image and a label column"
        in lines[0]
    )
    assert "--source imagefolder" in lines[0]
    assert dlpipe.read_manifest(str(tmp_path / "out")).classes == ("big", "small")
    assert convert(raw, tmp_path / "out2", "--source", "imagefolder") == 0
    assert dlpipe.read_manifest(str(tmp_path / "out2")).classes == ("cat", "dog")


def split_class_folders(raw: Path) -> None:
    """``raw/{train,val}/{cat,dog}/1.jpg``: an ImageFolder with split folders."""
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            (raw / split / cls).mkdir(parents=True)
            (raw / split / cls / "1.jpg").write_bytes(jpeg(1))


def test_plain_layouts_detect_without_a_warning(tmp_path, caplog) -> None:
    raw = tmp_path / "raw"
    split_class_folders(raw)
    (raw / "notes.csv").write_text("a,b\n1,2\n")  # a table without image and label columns
    with caplog.at_level(logging.INFO, logger="dlpipe"):
        assert open_source(str(raw)).kind == "imagefolder"
        assert open_source(str(labels_beside_images(tmp_path / "t") / "labels.csv")).kind == "table"
    assert read_as_warnings(caplog) == []


def test_two_tables_or_a_table_without_labels_stay_other_layouts(tmp_path) -> None:
    raw = labels_beside_images(tmp_path / "raw")
    (raw / "more.csv").write_text("filename,label\n0.jpg,cat\n")
    assert not TableSource.detect(str(raw))  # which table is meant is not guessed
    (raw / "more.csv").unlink()
    (raw / "labels.csv").write_text("filename,size\n0.jpg,3\n")
    assert not TableSource.detect(str(raw))
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "labels.csv")  # detection never opens a FIFO (it would hang)
    (fifo / "images").mkdir()
    assert not TableSource.detect(str(fifo))
    (tmp_path / "link" / "images").mkdir(parents=True)
    (tmp_path / "outside.csv").write_text("filename,label\n0.jpg,cat\n")
    (tmp_path / "link" / "labels.csv").symlink_to(tmp_path / "outside.csv")  # a link out
    assert not TableSource.detect(str(tmp_path / "link"))


def test_label_col_none_gives_samples_without_cls(tmp_path, capsys) -> None:
    raw = labels_beside_images(tmp_path / "raw")
    assert convert(raw, tmp_path / "out", "--source", "table", "--label-col", "none") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.classes == ()
    got = [dict(s) for s in dlpipe.open_dataset(str(tmp_path / "out"), "train")]
    assert len(got) == 6 and all("cls" not in s for s in got)
    assert all(b'"label":' in s["json"] for s in got)  # the label column is kept as data


def hf_split(path: Path, labels: list[int]) -> None:
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    features = {"label": {"_type": "ClassLabel", "names": ["cat", "dog"]}}
    table = pa.table(
        {
            "image": [{"bytes": jpeg(i), "path": None} for i in range(len(labels))],
            "label": labels,
        }
    ).replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def test_hugging_face_unlabelled_test_split_converts_without_cls(tmp_path, caplog) -> None:
    raw = tmp_path / "hf"
    hf_split(raw / "data/train-00000-of-00001.parquet", [0, 1, 1, 0])
    hf_split(raw / "data/test-00000-of-00001.parquet", [-1, -1, -1])
    test_file = raw / "data/test-00000-of-00001.parquet"
    with caplog.at_level(logging.INFO, logger="dlpipe"):
        assert convert(test_file, tmp_path / "out") == 0  # the split given on its own
    assert read_as_warnings(caplog) == []  # a folder of only tables is no ambiguity
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.classes == () and "cls" not in manifest.fields
    test = list(dlpipe.open_dataset(str(tmp_path / "out"), "test"))
    assert len(test) == 3 and all("cls" not in s for s in test)


def test_a_minus_one_among_real_labels_is_still_an_error(tmp_path, capsys) -> None:
    raw = tmp_path / "hf"
    hf_split(raw / "data/train-00000-of-00001.parquet", [0, -1, 1])
    assert convert(raw, tmp_path / "out") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "row 1: label -1 is outside 0..1" in line


def test_image_root_link_out_of_the_raw_folder_is_refused(tmp_path, capsys) -> None:
    outside = labels_beside_images(tmp_path / "secret")
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "labels.csv").write_bytes((outside / "labels.csv").read_bytes())
    (raw / "pics").symlink_to(outside / "images")
    assert convert(raw, tmp_path / "out", "--source", "table", "--image-root", "pics") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--image-root pics: resolves to" in line and str(outside / "images") in line
    assert len(list((outside / "images").iterdir())) == 6


def test_a_wrong_image_root_stops_early_naming_it(tmp_path, capsys) -> None:
    raw = labels_beside_images(tmp_path / "raw")
    (raw / "masks").mkdir()
    assert convert(raw, tmp_path / "out", "--image-root", "masks") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "6 of the first 6 image paths name no file" in line
    assert str(raw / "masks") in line and "check --image-root" in line


def test_loose_images_beside_split_folders_are_named_in_a_warning(tmp_path, capsys) -> None:
    raw = tmp_path / "raw"
    split_class_folders(raw)
    for name in ("stray1.jpg", "stray2.png"):
        (raw / name).write_bytes(jpeg(2))
    assert convert(raw, tmp_path / "out") == 0
    printed = capsys.readouterr()
    printed_lines = (printed.out + printed.err).splitlines()
    assert "source: imagefolder: its sub-folders read as class folders of images" in printed_lines
    lines = [line for line in printed_lines if "class folder" in line and "source:" not in line]
    assert len(lines) == 1 and lines[0].startswith("warning: ")
    assert "the 2 image files at its top (stray1.jpg, stray2.png)" in lines[0]
    assert "--source files" in lines[0]
    assert dlpipe.read_manifest(str(tmp_path / "out")).splits["train"].samples == 2


def test_the_printed_resume_command_carries_the_image_root(tmp_path) -> None:
    from dlpipe.converters.engine import ConvertConfig

    config = ConvertConfig.from_options(
        raw=str(tmp_path), to="wds", out=str(tmp_path / "out"), image_root="pics"
    )
    assert "--image-root pics" in config.command("--resume")


def test_images_no_row_names_are_counted_as_not_used(tmp_path, capsys) -> None:
    raw = labels_beside_images(tmp_path / "raw")
    for name in ("extra1.jpg", "extra2.png"):
        (raw / "images" / name).write_bytes(jpeg(7))
    (raw / "images" / "readme.txt").write_text("not an image")
    assert convert(raw, tmp_path / "out") == 0
    assert "not used: 2 images" in capsys.readouterr().out
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.source["unused"] == {"images": 2}
    assert manifest.splits["train"].samples == 6
