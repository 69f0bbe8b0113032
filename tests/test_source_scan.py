"""Detection and the scan list a raw tree once: every folder one ``os.scandir``, every file at
most one ``lstat`` (for its size), and the listings do not travel with the source."""

from __future__ import annotations

import collections
import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

import dlpipe
from dlpipe.cli import main
from dlpipe.converters.sources import open_source


class _CountedEntry:
    """A directory entry that counts its ``stat`` calls (the per-file system calls)."""

    def __init__(self, entry: os.DirEntry[str], stats: collections.Counter[str]) -> None:
        self._entry = entry
        self._stats = stats

    def stat(self, **kwargs: Any) -> os.stat_result:
        self._stats[self._entry.path] += 1
        return self._entry.stat(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._entry, name)


class _CountedScandir:
    def __init__(self, it: Any, stats: collections.Counter[str]) -> None:
        self._it, self._stats = it, stats

    def __enter__(self) -> _CountedScandir:
        return self

    def __exit__(self, *exc: object) -> None:
        self._it.close()

    def __iter__(self) -> Any:
        return (_CountedEntry(e, self._stats) for e in self._it)


@pytest.fixture
def listed(monkeypatch) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """(folder → scandir calls, entry path → DirEntry.stat calls), for every folder listed."""
    scans: collections.Counter[str] = collections.Counter()
    stats: collections.Counter[str] = collections.Counter()
    real = os.scandir

    def counted(path: Any = ".") -> Any:
        if isinstance(path, int):  # a folder fd (shutil.rmtree): not a raw folder
            return real(path)
        scans[os.path.realpath(path)] += 1
        return _CountedScandir(real(path), stats)

    monkeypatch.setattr(os, "scandir", counted)
    return scans, stats


def image(kind: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 3), (200, 10, 10)).save(out, kind)
    return out.getvalue()


def class_tree(root: Path, classes: int = 3, files: int = 4) -> Path:
    for c in range(classes):
        (root / f"class{c}" / "sub").mkdir(parents=True)
        for i in range(files):
            (root / f"class{c}" / f"{i}.jpg").write_bytes(image("JPEG"))
        (root / f"class{c}" / "sub" / "deep.png").write_bytes(image("PNG"))
        (root / f"class{c}" / "notes.txt").write_text("not an image")
    return root


def folders_of(root: Path) -> set[str]:
    """Every real folder of `root` (links not followed), listed without os.scandir."""
    found = {os.path.realpath(root)}
    for name in os.listdir(root):
        path = root / name
        if path.is_dir() and not path.is_symlink():
            found |= folders_of(path)
    return found


def test_auto_detection_and_scan_list_each_folder_once(tmp_path, listed) -> None:
    raw = class_tree(tmp_path / "raw")
    scans, stats = listed
    source = open_source(str(raw))
    scan = source.scan()
    assert source.kind == "imagefolder" and len(scan.items) == 15
    raw_scans = {f: n for f, n in scans.items() if f.startswith(str(raw))}
    assert set(raw_scans) == folders_of(raw)
    assert max(raw_scans.values()) == 1, raw_scans  # detection's listings are reused
    files = [p for p in stats if os.path.isfile(p)]
    assert len(files) == 3 * 5 + 3 and max(stats[p] for p in files) == 1  # one lstat: the size
    assert source.take_listings() is None  # handed to the scan, not kept
    assert b"Listings" not in pickle.dumps(source)  # what the workers receive


def test_split_folders_and_a_files_layout_are_listed_once_too(tmp_path, listed) -> None:
    raw = tmp_path / "raw"
    for split in ("train", "val"):
        class_tree(raw / split, classes=2, files=2)
    grouped = tmp_path / "grouped"
    (grouped / "train").mkdir(parents=True)
    for i in range(3):
        (grouped / "train" / f"{i}.jpg").write_bytes(b"\xff\xd8\xff")
        (grouped / "train" / f"{i}.json").write_text("{}")
    scans, _ = listed
    for root, kind, count in ((raw, "imagefolder", 2 * 2 * 3), (grouped, "files", 3)):
        source = open_source(str(root))
        assert source.kind == kind and len(source.scan().items) == count
        in_root = {f: n for f, n in scans.items() if f.startswith(str(root))}
        assert set(in_root) == folders_of(root) and max(in_root.values()) == 1, in_root


def test_convert_lists_the_raw_tree_once_and_keeps_the_link_rules(tmp_path, listed, capsys) -> None:
    raw = class_tree(tmp_path / "raw", classes=2, files=2)
    (raw / "class0" / "inside.jpg").symlink_to(raw / "class1" / "0.jpg")  # followed: inside
    (raw / "class0" / "loop").symlink_to(raw / "class1", target_is_directory=True)  # never
    (tmp_path / "secret.jpg").write_bytes(b"\xff\xd8\xff")
    (raw / "class1" / "out.jpg").symlink_to(tmp_path / "secret.jpg")  # a link out: skipped
    scans, _ = listed
    out = tmp_path / "out"
    code = main(["convert", str(raw), "--to", "wds", "--out", str(out), "--workers", "1"])
    assert code == 0
    assert dlpipe.read_manifest(str(out)).splits["train"].samples == 2 * 3 + 1
    raw_scans = {f: n for f, n in scans.items() if f.startswith(str(raw))}
    assert set(raw_scans) == folders_of(raw) and max(raw_scans.values()) == 1, raw_scans
    description = dlpipe.read_manifest(str(out)).source
    reasons = sorted(e["reason"] for e in description["skipped_examples"])
    assert description["skipped_entries"] == 2, description
    assert reasons[0].startswith("a link to ") and "outside the raw folder" in reasons[0]
    assert reasons[1] == "a link to a folder (folder links are not followed)"
