"""An option the chosen layout does not read is refused with one error line, never ignored:
an ignored --label-col or --key-col would convert another dataset than the one asked for."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import one_error_line
from splitlist_fixtures import jpeg, write

from dlpipe.cli import main
from dlpipe.converters import sources
from dlpipe.converters.source import SourceOptions


def _class_folders(root: Path) -> Path:
    for i in range(4):
        write(root / ("cat" if i % 2 else "dog") / f"{i}.jpg", jpeg(i))
    return root


def _table(root: Path) -> Path:
    for i in range(4):
        write(root / "img" / f"{i}.jpg", jpeg(i))
    write(
        root / "labels.csv", "image,label\n" + "".join(f"img/{i}.jpg,{i % 2}\n" for i in range(4))
    )
    return root


@pytest.mark.parametrize(
    ("layout", "extra", "flag"),
    [
        (_class_folders, ["--image-col", "path"], "--image-col"),
        (_class_folders, ["--label-col", "label"], "--label-col"),
        (_class_folders, ["--image-root", "."], "--image-root"),
        (_class_folders, ["--key-col", "id"], "--key-col"),
        (_class_folders, ["--instance-masks"], "--instance-masks"),
        (
            _class_folders,
            ["--source", "imagefolder", "--label-from", "name-prefix"],
            "--label-from",
        ),
        (_table, ["--keep-empty-classes"], "--keep-empty-classes"),
        (_table, ["--source", "files", "--label-col", "label"], "--label-col"),
    ],
)
def test_an_option_the_layout_does_not_read_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layout, extra: list[str], flag: str
) -> None:
    raw = layout(tmp_path / "raw")
    out = tmp_path / "out"
    assert main(["convert", str(raw), "--to", "wds", "--out", str(out), *extra]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert flag in line and "drop" in line  # and which layout reads it
    assert not out.exists()


def test_the_options_a_layout_reads_still_convert(tmp_path: Path) -> None:
    raw = _table(tmp_path / "raw")
    args = ["--image-col", "image", "--label-col", "label", "--key-col", "image"]
    assert main(["convert", str(raw), "--to", "wds", "--out", str(tmp_path / "out"), *args]) == 0


def test_every_option_is_read_by_some_layout_and_explained() -> None:
    read = set().union(*(sources._source_class(k).options_read for k in sources.SOURCE_KINDS))
    names = {f.name for f in dataclasses.fields(SourceOptions)} - {"kind"}  # the layout itself
    assert names == read == set(sources._OPTION_USE)
