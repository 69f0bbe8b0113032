"""Darknet's YOLO layout for the ``yolo`` source (`dlpipe.converters.yolo`), as AlexeyAB's darknet
and CVAT's "YOLO 1.1" export (Datumaro's YOLO exporter) write it.

Layout: ``obj.data`` at the top of the raw folder or in its ``data/`` folder (or given as RAW),
``key = value`` lines (``#`` starts a comment)::

    classes = 2
    train = data/train.txt
    valid = data/valid.txt
    names = data/obj.names
    backup = backup/

``names`` is a text file of class names, one a line in id order (blank lines skipped);
``classes``, when given, must equal their count. ``train``, ``valid`` (or ``val``) and ``test``
name an image list (a path a line) or a folder of images: the splits train, val and test; other
keys (``backup``, ``eval``) are not read. Darknet reads these paths and the lists' rows
(``data/obj_train_data/frame_000001.jpg``) from the folder it runs in, the one holding
``data/``; so a path is looked for from the raw folder's top, then from the folder of the file
naming it, then without its leading ``data/`` (CVAT's zip holds what goes in ``data/``), and
never outside the raw folder. Without ``obj.data``, ``obj.names`` beside ``obj_train_data/``
(or ``obj_valid_data/``) is read the same way, each split from its list (``train.txt``,
``valid.txt``) when there is one, else from its folder.

Labels: ``x.txt`` beside each image ``x.jpg``, lines ``class cx cy w h`` as Ultralytics'.

A missing, unreadable or malformed ``obj.data`` or names file, a ``classes`` that is not the
names' count, or a train/valid entry naming nothing inside the raw folder is a `SourceError`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from dlpipe.converters.listed import read_list_file
from dlpipe.converters.raw_tree import RawEntry
from dlpipe.converters.source import SourceError, display_path
from dlpipe.converters.yolo_config import (
    Labels,
    Layout,
    Splits,
    describe,
    first_inside,
    is_inside,
)

__all__ = ["DarknetConfig", "darknet_file", "darknet_layout", "darknet_paths"]

_OBJ_DATA = ("obj.data", os.path.join("data", "obj.data"))
_SUBSETS = {"train": ("train.txt", "obj_train_data"), "val": ("valid.txt", "obj_valid_data")}
_SPLIT_KEYS = {"train": "train", "valid": "val", "val": "val", "test": "test"}
_COMMENT = re.compile(r"(^|\s)#.*")
_DATA = "data" + os.sep


def darknet_file(root: str) -> str | None:
    """The file that makes `root` a Darknet dataset: ``obj.data`` at its top or in its
    ``data/``, `root` itself when it is a ``*.data`` file, or ``obj.names`` beside
    ``obj_train_data/`` or ``obj_valid_data/``; else None (names only, nothing is read)."""
    if not os.path.isdir(root):
        return root if root.lower().endswith(".data") and os.path.isfile(root) else None
    for name in _OBJ_DATA:
        if os.path.isfile(os.path.join(root, name)):
            return os.path.join(root, name)
    names = os.path.join(root, "obj.names")
    subsets = (os.path.join(root, folder) for _, folder in _SUBSETS.values())
    return names if os.path.isfile(names) and any(map(os.path.isdir, subsets)) else None


def darknet_paths(value: str, top: str, folder: str) -> list[str]:
    """Where Darknet's path `value` may lie: from the folder holding ``data/`` (`top`), from
    `folder` (that of the file naming it), and without a leading ``data/``."""
    rel = os.path.normpath(value.replace("\\", "/"))
    paths = [os.path.join(top, rel), os.path.join(folder, rel)]
    if rel.startswith(_DATA):
        paths.append(os.path.join(top, rel[len(_DATA) :]))
    return [os.path.normpath(p) for p in paths]


def _options(path: str, raw_folder: str) -> dict[str, str]:
    """obj.data's ``key = value`` lines (the first of a key, as Darknet's option_find)."""
    values: dict[str, str] = {}
    text = read_list_file(raw_folder, path, "the Darknet dataset's settings")
    for number, raw in enumerate(text.splitlines(), 1):
        line = _COMMENT.sub("", raw).strip()
        if not line or line.startswith(";"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise SourceError(
                f"{display_path(path)} line {number}: {line[:80]!r} is not 'key = value'; "
                "Darknet's obj.data holds lines such as 'train = data/train.txt'"
            )
        values.setdefault(key.strip().lower(), value.strip())
    return values


@dataclass(frozen=True)
class DarknetConfig:
    """A Darknet dataset's description: its file, the names file and classes, and the value
    naming each split's list or folder."""

    path: str  # obj.data, or obj.names when there is none
    names: str
    classes: tuple[str, ...]
    entries: dict[str, str]  # split -> the path naming its list or folder

    @classmethod
    def read(cls, path: str, top: str, raw_folder: str) -> DarknetConfig:
        """Read `path` (from `darknet_file`) and its names file, inside `top`.

        Raises:
            SourceError: naming the file, the value and what is wrong.
        """
        if not path.lower().endswith(".data"):  # obj.names beside obj_train_data/
            entries = {}
            for split, (listed, folder) in _SUBSETS.items():
                if os.path.isfile(os.path.join(top, listed)):
                    entries[split] = listed
                elif os.path.isdir(os.path.join(top, folder)):
                    entries[split] = folder
            return cls(path, path, _names(path, raw_folder, None, path), entries)
        options = _options(path, raw_folder)
        shown = display_path(path)
        if not options.get("names"):
            raise SourceError(
                f"{shown}: no 'names =' line; name the file of class names (names = data/obj.names)"
            )
        names = _inside(options["names"], top, os.path.dirname(path))
        if names is None:
            raise SourceError(
                f"{shown}: names = {options['names'][:200]!r} names no file inside the raw "
                "folder; fix obj.data, or restore the names file"
            )
        entries = {}
        for key, split in _SPLIT_KEYS.items():
            if options.get(key) and split not in entries:
                entries[split] = options[key]
        return cls(path, names, _names(names, raw_folder, options.get("classes"), path), entries)

    @property
    def labels(self) -> Labels:
        return Labels({i: i for i in range(len(self.classes))}, None)


def _inside(value: str, top: str, folder: str) -> str | None:
    """The regular file `value` names inside `top` (as `darknet_paths` looks), or None."""
    found = (p for p in darknet_paths(value, top, folder) if is_inside(p, top))
    return next((p for p in found if os.path.isfile(p)), None)


def _names(path: str, raw_folder: str, count: str | None, config: str) -> tuple[str, ...]:
    """The class names of the names file `path`, checked against obj.data's ``classes``."""
    text = read_list_file(raw_folder, path, "the Darknet dataset's class names")
    names = tuple(n.strip() for n in text.splitlines() if n.strip())
    shown = display_path(path)
    if not names:
        raise SourceError(f"{shown}: holds no class names; write one class name a line")
    if count is not None and (not count.isdigit() or int(count) != len(names)):
        raise SourceError(
            f"{display_path(config)}: classes = {count[:40]!r} but {shown} names "
            f"{len(names)} classes; make them agree"
        )
    return names


def darknet_layout(
    config: DarknetConfig, top: str, files: dict[str, RawEntry], left_out: dict[str, str]
) -> Layout:
    """The `Layout` of a Darknet dataset, each split's list or folder found inside `top`."""
    shown = display_path(config.path)
    splits: Splits = {}
    for split, value in config.entries.items():
        found = first_inside(darknet_paths(value, top, os.path.dirname(config.path)), top, files)
        if found is not None:
            splits[split] = [found]
        elif split == "test":
            left_out[split] = f"{shown}: test = {value[:200]!r} names nothing in the raw folder"
        else:
            key = "valid" if split == "val" else split
            raise SourceError(
                f"{shown}: {key} = {value[:200]!r} names no image list or folder inside the raw "
                f"folder (looked for from {display_path(top)}, with and without data/); fix "
                "obj.data, or restore the list"
            )
    if not splits:
        raise SourceError(f"{shown}: names no train or valid image list; add train = train.txt")
    name = os.path.basename(config.path)
    why = describe(
        name, config.classes, splits, "Darknet YOLO, as darknet and CVAT's YOLO 1.1 write it"
    )
    read = () if config.names == config.path else (config.names,)
    return Layout(config.path, config.classes, list(range(len(config.classes))), config.labels,
                  top, splits, why, darknet=True, read=read)  # fmt: skip
