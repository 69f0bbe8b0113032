"""Rule 3 of the class-folder guard (`dlpipe.converters.guard`): the layout files at a folder's
top that say which known layout it is, looked at by name and, for JSON and YAML, by their head:
COCO annotation files, VOC's ``JPEGImages/`` beside its parts, a YOLO data YAML or ``labels/``
beside ``images/``, Hugging Face ``metadata.*`` files, and split lists.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dlpipe.converters.raw_tree import RawEntry, RawTree
from dlpipe.converters.source import SampleError, display_path, open_regular

if TYPE_CHECKING:
    from dlpipe.converters.guard import Peek

__all__ = ["METADATA", "Layout", "layout_of", "registered"]

_HEAD_BYTES = 1 << 20
_COCO_NAME = re.compile(
    r"((instances|person_keypoints|captions|panoptic|image_info|stuff)_.*|.*\.coco)\.json"
)
_YAML_NAMES = re.compile(rb"(?m)^names\s*:")
_VOC_PARTS = ("annotations", "imagesets", "segmentationclass", "segmentationobject")
_LIST_FILES = frozenset(
    {
        *("train.txt", "val.txt", "test.txt", "trainval.txt", "list.txt", "classes.txt"),
        *("images.txt", "train_test_split.txt", "image_class_labels.txt", "labels.txt"),
        *("train_list.txt", "val_list.txt", "test_list.txt", "valid.txt", "bounding_boxes.txt"),
    }
)
_LIST_FOLDERS = ("meta", "annotations", "splits", "lists")
METADATA = ("metadata.csv", "metadata.jsonl", "metadata.parquet")


@dataclass(frozen=True)
class Layout:
    """A known layout: the ``--source`` that reads it and what the message calls it."""

    kind: str
    looks: str


def _head(path: str, raw_folder: str, limit: int) -> bytes:
    try:
        with open_regular(path, raw_folder) as f:
            return f.read(limit)
    except (SampleError, OSError):
        return b""


def _rel(path: str, root: str) -> str:
    return display_path(os.path.relpath(path, root))


def _files(entries: list[RawEntry]) -> list[RawEntry]:
    return [e for e in entries if not e.is_dir]


def _folders_named(entries: list[RawEntry], names: tuple[str, ...]) -> list[RawEntry]:
    return [e for e in entries if e.is_dir and e.name.lower() in names]


def _coco(tree: RawTree, root: str, entries: list[RawEntry]) -> Layout | None:
    candidates = _files(entries)
    for folder in _folders_named(entries, ("annotations", "annotation")):
        candidates += _files(tree.listing(folder.path))
    jsons = [e for e in candidates if e.name.lower().endswith(".json")]
    named = [e for e in jsons if _COCO_NAME.fullmatch(e.name.lower())]
    for entry in named or jsons[:8]:
        head = b"" if named else _head(entry.path, tree.folder, _HEAD_BYTES)
        if named or (b'"images"' in head and b'"annotations"' in head):
            what = "detection " if entry.name.lower().startswith("instances_") else ""
            return Layout("coco", f"a COCO {what}dataset ({_rel(entry.path, root)})")
    return None


def _voc(entries: list[RawEntry]) -> Layout | None:
    found = {e.name.lower(): e.name for e in entries if e.is_dir}
    parts = [found[p] for p in _VOC_PARTS if p in found]
    if "jpegimages" not in found or not parts:
        return None
    shown = ", ".join(f"{n}/" for n in [found["jpegimages"], *parts])
    return Layout("voc", f"a Pascal VOC dataset ({shown})")


def _yolo(tree: RawTree, root: str, entries: list[RawEntry], splits: list[str]) -> Layout | None:
    for entry in _files(entries):
        is_yaml = entry.name.lower().endswith((".yaml", ".yml"))
        if is_yaml and _YAML_NAMES.search(_head(entry.path, tree.folder, 64 << 10)):
            return Layout("yolo", f"a YOLO dataset ({display_path(entry.name)} names its classes)")
    for folder in [root, *splits]:
        names = {e.name.lower() for e in tree.folders(folder)}
        if {"images", "labels"} <= names:
            where = _rel(os.path.join(folder, "labels"), root)
            return Layout("yolo", f"a YOLO dataset ({where}/ beside images/)")
    return None


def _hf(tree: RawTree, root: str, splits: list[str], peeks: dict[str, Peek]) -> Layout | None:
    for folder in [root, *splits]:
        for entry in _files(tree.listing(folder)):
            if entry.name.lower() in METADATA:
                return Layout("hf", _hf_looks(_rel(entry.path, root)))
    for path, peek in peeks.items():
        if peek.metadata is not None:
            return Layout("hf", _hf_looks(_rel(os.path.join(path, peek.metadata), root)))
    return None


def _hf_looks(where: str) -> str:
    return f"a Hugging Face image folder with metadata ({where})"


_NAMED_SPLIT_LISTS = (  # dataset, its own --source (else splitlist), the files that tell it
    ("CUB-200-2011", "cub200", ("train_test_split.txt", "image_class_labels.txt")),
    ("Food-101", "food101", ("meta/classes.txt",)),
    ("Oxford-IIIT Pet", "oxford-pets", ("annotations/trainval.txt", "annotations/list.txt")),
)


def _split_lists(tree: RawTree, root: str, entries: list[RawEntry]) -> Layout | None:
    found = [e for e in _files(entries) if e.name.lower() in _LIST_FILES]
    for folder in _folders_named(entries, _LIST_FOLDERS):
        found += [e for e in _files(tree.listing(folder.path)) if e.name.lower() in _LIST_FILES]
    if not found:
        return None
    rels = [_rel(e.path, root) for e in found]
    lowered = {r.lower() for r in rels}
    known = next((k for k in _NAMED_SPLIT_LISTS if lowered & set(k[2])), None)
    shown = ", ".join(rels[:4]) + (", ..." if len(rels) > 4 else "")
    if known is None:
        return Layout("splitlist", f"a dataset with split lists ({shown})")
    kind = known[1] if registered(known[1]) else "splitlist"
    return Layout(kind, f"{known[0]} (split lists {shown})")


def layout_of(root: str, tree: RawTree, splits: list[str], peeks: dict[str, Peek]) -> Layout | None:
    """The known layout whose files lie at `root`'s top (rule 3), or None.

    Args:
        root: the folder (absolute).
        tree: its listings.
        splits: its split folders (absolute), if any.
        peeks: the first entries of each class folder, by its path.
    """
    entries = tree.listing(root)
    return (
        _coco(tree, root, entries)
        or _voc(entries)
        or _yolo(tree, root, entries, splits)
        or _hf(tree, root, splits, peeks)
        or _split_lists(tree, root, entries)
    )


def registered(kind: str) -> bool:
    from dlpipe.converters.sources import SOURCE_KINDS

    return kind in SOURCE_KINDS
