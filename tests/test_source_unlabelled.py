"""A split without labels beside labelled ones (Hugging Face's test split of -1 labels):
its samples carry no cls, its manifest entry lists its own fields, and it reads and verifies."""

from __future__ import annotations

import json
from pathlib import Path

from test_source_table_layouts import convert, hf_split, jpeg, one_error_line

import dlpipe
from dlpipe.cli import main
from dlpipe.manifest import parse_manifest


def hf_export(root: Path) -> Path:
    hf_split(root / "data/train-00000-of-00001.parquet", [0, 1, 1, 0])
    hf_split(root / "data/test-00000-of-00001.parquet", [-1, -1, -1])
    return root


def test_unlabelled_split_beside_labelled_ones_converts_without_cls(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert convert(hf_export(tmp_path / "hf"), out) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == ("cat", "dog") and "cls" in manifest.fields
    assert manifest.splits["train"].fields is None  # the dataset's fields
    assert manifest.fields_of("test") == {"jpg": "image"}
    assert manifest.splits["test"].class_counts is None
    train = list(dlpipe.open_dataset(str(out), "train"))
    test = list(dlpipe.open_dataset(str(out), "test"))
    assert sorted(int(s["cls"]) for s in train) == [0, 0, 1, 1]
    assert len(test) == 3 and all(set(s) == {"__key__", "jpg"} for s in test)
    assert main(["verify", str(out), "--decode"]) == 0


def test_a_split_of_empty_labels_is_unlabelled_but_an_empty_label_among_others_is_not(
    tmp_path, capsys
) -> None:
    raw = tmp_path / "raw"
    (raw / "images").mkdir(parents=True)
    for i in range(4):
        (raw / "images" / f"{i}.jpg").write_bytes(jpeg(i))
    (raw / "train.csv").write_text("file,label\n0.jpg,cat\n1.jpg,dog\n")
    (raw / "test.csv").write_text("file,label\n2.jpg,\n3.jpg,\n")  # a placeholder column
    assert convert(raw, tmp_path / "out", "--source", "table") == 0
    assert dlpipe.read_manifest(str(tmp_path / "out")).fields_of("test") == {"jpg": "image"}
    (raw / "test.csv").write_text("file,label\n2.jpg,cat\n3.jpg,\n")
    assert convert(raw, tmp_path / "out2", "--source", "table") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "test.csv row 1: the label column 'label' is empty" in line


def test_old_manifests_without_split_fields_still_read(tmp_path) -> None:
    out = tmp_path / "out"
    assert convert(hf_export(tmp_path / "hf"), out) == 0
    data = json.loads((out / "dlpipe.json").read_text())
    del data["splits"]["test"]  # a manifest as dlpipe wrote it before split fields
    old = parse_manifest(json.dumps(data).encode(), "dlpipe.json")
    assert old.splits["train"].fields is None and old.fields_of("train") == old.fields


def test_training_on_the_unlabelled_split_is_refused_in_one_line(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert convert(hf_export(tmp_path / "hf"), out) == 0
    capsys.readouterr()
    args = ["--train-split", "test", "--val-split", "train", "--batch-size", "2", "--epochs", "1"]
    code = main(["train", str(out), *args, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2, err
    line = one_error_line(err)
    assert "test" in line and "cls" in line
