"""Kaggle's layout as it ships: ``train.csv`` (``id,label``) beside ``train/``, ``test.csv``
(only ``id``) beside ``test/``, and ``sample_submission.csv``, which is no split."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from test_source_table_layouts import convert, jpeg, one_error_line, read_as_warnings

import dlpipe
from dlpipe.converters.source import SourceError, SourceOptions
from dlpipe.converters.sources import open_source
from dlpipe.converters.table import TableSource


def kaggle_competition(root: Path, *, id_col: str = "id", train: int = 6, test: int = 4) -> Path:
    for split, rows in (("train", train), ("test", test)):
        (root / split).mkdir(parents=True)
        for i in range(rows):
            (root / split / f"{split}{i:03d}.jpg").write_bytes(jpeg(i))
    labels = "".join(f"train{i:03d},{'cat' if i % 3 else 'dog'}\n" for i in range(train))
    (root / "train.csv").write_text(f"{id_col},label\n{labels}")
    (root / "test.csv").write_text(f"{id_col}\n" + "".join(f"test{i:03d}\n" for i in range(test)))
    submission = "".join(f"test{i:03d},cat\n" for i in range(test))
    (root / "sample_submission.csv").write_text(f"{id_col},label\n{submission}")
    return root


def test_kaggle_train_and_test_tables_convert_with_an_unlabelled_test_split(
    tmp_path, caplog
) -> None:
    raw = kaggle_competition(tmp_path / "comp")
    with caplog.at_level(logging.INFO, logger="dlpipe"):
        assert open_source(str(raw)).kind == "table"
    assert read_as_warnings(caplog) == []  # train/ and test/ hold no class folders
    out = tmp_path / "out"
    assert convert(raw, out) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert sorted(manifest.splits) == ["test", "train"]
    assert manifest.classes == ("cat", "dog")
    assert manifest.splits["train"].samples == 6 and manifest.splits["test"].samples == 4
    assert manifest.splits["train"].class_counts == (4, 2)
    assert manifest.fields_of("test") == {"jpg": "image"}
    assert manifest.source["tables"] == ["test.csv", "train.csv"]  # no sample_submission.csv
    train = {s["__key__"]: int(s["cls"]) for s in dlpipe.open_dataset(str(out), "train")}
    assert train == {f"train{i:03d}": 0 if i % 3 else 1 for i in range(6)}
    test = [dict(s) for s in dlpipe.open_dataset(str(out), "test")]
    assert sorted(s["__key__"] for s in test) == [f"test{i:03d}" for i in range(4)]
    assert all("cls" not in s for s in test)


def test_kaggle_image_id_column_with_key_col(tmp_path) -> None:
    raw = kaggle_competition(tmp_path / "comp", id_col="image_id")
    options = SourceOptions(image_col="image_id", key_col="image_id")
    source = open_source(str(raw), "table", options)
    items = source.scan().items
    assert sorted(it.key for it in items if it.split == "test") == [
        f"test{i:03d}" for i in range(4)
    ]
    assert {it.label for it in items if it.split == "test"} == {None}


def test_key_col_duplicates_and_unknown_columns_are_one_clear_error(tmp_path) -> None:
    raw = kaggle_competition(tmp_path / "comp", id_col="image_id")
    (raw / "train.csv").write_text("image_id,label,patient\ntrain000,cat,p1\ntrain001,dog,p1\n")
    options = SourceOptions(image_col="image_id", key_col="patient")
    with pytest.raises(SourceError) as err:
        TableSource(str(raw / "train.csv"), options).scan()
    assert str(err.value) == (
        "train.csv row 1: key 'p1' in column 'patient' is a duplicate (first in train.csv row "
        "0); keys must be unique in a split: fix the column, or give another column with "
        "--key-col"
    )
    with pytest.raises(SourceError, match=r"--key-col 'nope' is not a column; the columns are"):
        TableSource(
            str(raw / "train.csv"), SourceOptions(image_col="image_id", key_col="nope")
        ).scan()
    (raw / "train.csv").write_text("image_id,label,patient\ntrain000,cat,007\ntrain001,dog,a/b\n")
    keys = [it.key for it in TableSource(str(raw / "train.csv"), options).scan().items]
    assert keys == ["007", "a%2Fb"]  # read as text, escaped by the key rule


def test_key_col_on_the_command_line(tmp_path, capsys) -> None:
    raw = kaggle_competition(tmp_path / "comp", id_col="image_id")
    out = tmp_path / "out"
    assert (
        convert(raw, out, "--source", "table", "--image-col", "image_id", "--key-col", "image_id")
        == 0
    )
    keys = sorted(s["__key__"] for s in dlpipe.open_dataset(str(out), "train"))
    assert keys == [f"train{i:03d}" for i in range(6)]
    (raw / "train.csv").write_text("image_id,label\ntrain000,cat\ntrain000,dog\n")
    assert (
        convert(
            raw,
            tmp_path / "out2",
            "--source",
            "table",
            "--image-col",
            "image_id",
            "--key-col",
            "image_id",
        )
        == 2
    )
    line = one_error_line(capsys.readouterr().err)
    assert "train.csv row 1: key 'train000' in column 'image_id' is a duplicate" in line
    assert not (tmp_path / "out2").exists()
