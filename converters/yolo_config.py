"""The data YAML of the ``yolo`` source (`dlpipe.converters.yolo`): found at the top of the raw
folder, read with ``yaml.safe_load``, checked (``names``, ``nc``, ``kpt_shape``), and its
``path``, ``train``, ``val`` and ``test`` resolved to image folders and lists inside the raw
folder; and the `Layout` both YOLO layouts (this one and `dlpipe.converters.yolo_darknet`'s)
give the scan.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import yaml

from dlpipe.codecs import stable_message
from dlpipe.converters.raw_tree import RawEntry
from dlpipe.converters.source import (
    SampleError,
    SourceError,
    display_path,
    is_ignored_name,
    log,
    raw_folder_of,
    read_file,
)

__all__ = [
    "Labels",
    "Layout",
    "Splits",
    "classes_of",
    "data_yamls",
    "dataset_root",
    "describe",
    "find_data_yaml",
    "first_inside",
    "is_inside",
    "split_entries",
    "ultralytics_layout",
]

_MAX_YAML_BYTES = 1 << 20  # COCO's YAML is 3 KB, Objects365's 10 KB
_MAX_CANDIDATES = 16
_PREFERRED = ("data.yaml", "dataset.yaml")
_SPLIT_KEYS = (("train", "train"), ("val", "val"), ("validation", "val"), ("test", "test"))


@dataclass(frozen=True)
class Labels:
    """What `load` needs to read a label file: class id → label, and a pose line's length."""

    index: dict[int, int]
    fields: int | None  # 5 + keypoints x dims for pose datasets, else None

    @classmethod
    def of(cls, ids: list[int], data: dict[str, Any], shown: str) -> Labels:
        return cls({class_id: i for i, class_id in enumerate(ids)}, _pose_fields(data, shown))


Splits = dict[str, list[tuple[str, bool]]]  # split -> its (folder or list file, is a list)


@dataclass(frozen=True)
class Layout:
    """What a YOLO dataset's description file says, resolved inside the raw folder."""

    config: str  # the file that describes the dataset (data YAML, obj.data)
    classes: tuple[str, ...]
    ids: list[int]
    labels: Labels
    root: str  # the folder the splits are read from
    splits: Splits
    why: str  # the manifest's "layout"
    darknet: bool = False  # Darknet's: list rows read as Darknet does, labels beside images
    read: tuple[str, ...] = ()  # other files it was read from (Darknet's names file)


def describe(name: str, classes: tuple[str, ...], splits: Splits, what: str) -> str:
    """The manifest's ``layout`` line: the file, its class count, splits and layout name."""
    entries = "; ".join(
        f"{s}: {', '.join(display_path(p) for p, _ in e)}" for s, e in splits.items()
    )
    return f"{display_path(name)} names {len(classes)} classes and the splits ({entries}) ({what})"


def ultralytics_layout(
    path: str, data: dict[str, Any], top: str, files: dict[str, RawEntry], left_out: dict[str, str]
) -> Layout:
    """The `Layout` of the data YAML at `path` (its `data`), splits resolved inside `top`."""
    shown = display_path(path)
    classes, ids = classes_of(data, shown)
    labels = Labels.of(ids, data, shown)
    root = dataset_root(data, os.path.dirname(path), top, shown)
    splits = split_entries(data, root, top, files, shown, left_out)
    export = ", a Roboflow export" if "roboflow" in data else ""
    why = describe(os.path.basename(path), classes, splits, f"Ultralytics YOLO{export}")
    return Layout(path, classes, ids, labels, root, splits, why)


def _load_yaml(path: str, folder: str) -> Any:
    """A YAML file's value (safe_load, at most 1 MiB), or a SourceError naming the file."""
    try:
        return yaml.safe_load(read_file(path, folder, max_bytes=_MAX_YAML_BYTES))
    except SampleError as exc:
        raise SourceError(str(exc)) from exc
    except (yaml.YAMLError, RecursionError, ValueError) as exc:
        raise SourceError(
            f"{display_path(path)}: not readable YAML ({stable_message(exc)}); fix the file"
        ) from exc


def _is_data_yaml(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and "names" in value
        and any(key in value for key, _ in _SPLIT_KEYS[:3])
    )


def data_yamls(root: str) -> list[tuple[str, dict[str, Any]]]:
    """(path, value) of each data YAML at the top of `root` (or `root`, a YAML file)."""
    if os.path.isfile(root):
        paths = [root] if root.lower().endswith((".yaml", ".yml")) else []
    else:
        try:
            names = sorted(os.listdir(root))
        except OSError:
            return []
        paths = [
            os.path.join(root, n)
            for n in names
            if n.lower().endswith((".yaml", ".yml")) and not is_ignored_name(n)
        ][:_MAX_CANDIDATES]
    found = []
    for path in paths:
        try:
            value = _load_yaml(path, raw_folder_of(root))
        except SourceError:
            continue
        if _is_data_yaml(value):
            found.append((path, value))
    return found


def _choose(root: str, found: list[tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    if len(found) == 1:
        return found[0]
    if not found:
        raise SourceError(
            f"{display_path(root)}: no data YAML at its top (a *.yaml with names: and train: "
            "or val:, such as Ultralytics' data.yaml) and no Darknet obj.data; give the YAML "
            "file or its folder"
        )
    by_name = {os.path.basename(p).lower(): (p, v) for p, v in found}
    stem = os.path.basename(root.rstrip(os.sep)).lower()
    for name in (*_PREFERRED, f"{stem}.yaml", f"{stem}.yml"):
        if name in by_name:
            return by_name[name]
    shown = ", ".join(display_path(os.path.basename(p)) for p, _ in found)
    raise SourceError(
        f"{display_path(root)}: {len(found)} data YAMLs ({shown}); give the one to read as RAW"
    )


def find_data_yaml(root: str, raw_folder: str) -> tuple[str, dict[str, Any]]:
    """The data YAML `root` is or holds at its top: (path, value); when there is none, a
    SourceError saying what is wrong with the YAML there is."""
    found = data_yamls(root)
    if not found:  # say what is wrong with the YAML there is
        named = [root] if os.path.isfile(root) else [os.path.join(root, n) for n in _PREFERRED]
        for path in (p for p in named if os.path.lexists(p)):
            value = _load_yaml(path, raw_folder)
            keys = list(value)[:5] if isinstance(value, dict) else [value]
            raise SourceError(
                f"{display_path(path)}: has no names: and train: or val: (it holds "
                f"{', '.join(map(_shown, keys))}); a YOLO data YAML names the classes and "
                "the image folders"
            )
    return _choose(root, found)


def _shown(value: Any) -> str:
    """A YAML value for a message, short whatever it holds (aliases can make it huge)."""
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:40] + "...")
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    return f"a {type(value).__name__}"


def _class_id(key: Any, shown: str) -> int:
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    raise SourceError(
        f"{shown}: names key {_shown(key)} is not a class id (an integer >= 0); write names as a "
        "list, or as a mapping 0: person"
    )


def classes_of(data: dict[str, Any], shown: str) -> tuple[tuple[str, ...], list[int]]:
    """(names in id order, their ids) from ``names``, checked against ``nc``."""
    names = data.get("names")
    if isinstance(names, list):
        pairs = list(enumerate(names))
    elif isinstance(names, dict):
        pairs = sorted((_class_id(k, shown), v) for k, v in names.items())
    else:
        raise SourceError(
            f"{shown}: names is {type(names).__name__}, not a list of class names or a "
            "mapping of class id to name; fix the YAML"
        )
    ids = [i for i, _ in pairs]
    bad = [v for _, v in pairs if not isinstance(v, (str, int, float)) or isinstance(v, bool)]
    if not pairs or bad or len(set(ids)) != len(ids):
        what = (
            f"holds {_shown(bad[0])}, not a name"
            if bad
            else "repeats an id"
            if pairs
            else "is empty"
        )
        raise SourceError(f"{shown}: names {what}; give one name per class id")
    nc = data.get("nc")
    if nc is not None and (not isinstance(nc, int) or isinstance(nc, bool) or nc != len(pairs)):
        raise SourceError(
            f"{shown}: nc is {_shown(nc)} but names holds {len(pairs)}; make them agree"
        )
    return tuple(str(v) for _, v in pairs), ids


def _pose_fields(data: dict[str, Any], shown: str) -> int | None:
    shape = data.get("kpt_shape")
    if shape is None:
        return None
    if not (isinstance(shape, list) and len(shape) == 2 and all(_positive(v) for v in shape)):
        raise SourceError(f"{shown}: kpt_shape {_shown(shape)} is not [keypoints, 2 or 3]")
    return 5 + shape[0] * shape[1]


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def is_inside(path: str, top: str) -> bool:
    """True when the normalised `path` is `top` or below it."""
    return path == top or path.startswith(top.rstrip(os.sep) + os.sep)


def dataset_root(data: dict[str, Any], folder: str, top: str, shown: str) -> str:
    """The folder the splits are relative to: ``path`` when it is a folder inside `top`,
    else the YAML's `folder`."""
    value = data.get("path")
    if value is None or value in ("", "."):
        return folder
    if not isinstance(value, str):
        raise SourceError(f"{shown}: path is {_shown(value)}, not a folder name; fix the YAML")
    path = os.path.normpath(os.path.join(folder, value))
    if is_inside(path, top) and os.path.isdir(path):
        return path
    log.warning(
        "%s: path %r is no folder inside the raw folder; the splits are read relative to %s, "
        "the YAML's folder",
        shown,
        value,
        display_path(folder),
    )
    return folder


def split_entries(
    data: dict[str, Any],
    root: str,
    top: str,
    files: dict[str, RawEntry],
    shown: str,
    left_out: dict[str, str],
) -> Splits:
    """Split → its (folder or list file, is a list) entries, resolved inside `top`."""
    found: Splits = {}
    for key, split in _SPLIT_KEYS:
        value = data.get(key)
        if value is None or value in ("", []) or split in found:
            continue
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) and v.strip() for v in values):
            raise SourceError(
                f"{shown}: {key} is {_shown(value)}; give an image folder, a .txt list of images, "
                "or a list of those"
            )
        resolved = [(v, _resolve(v.strip(), root, top, files)) for v in values]
        missing = [v for v, target in resolved if target is None]
        if missing and split == "test":
            left_out[split] = f"{shown}: test: {_shown(missing[0])} names nothing in the raw folder"
        elif missing:
            raise SourceError(
                f"{shown}: {key}: {_shown(missing[0])} names no image folder or list inside "
                f"the raw folder (looked for from {display_path(root)}); fix the YAML, or "
                "restore it"
            )
        else:
            found[split] = [target for _, target in resolved if target is not None]
    if not found:
        raise SourceError(f"{shown}: train and val name no images; give train: images/train")
    return found


def _resolve(
    value: str, root: str, top: str, files: dict[str, RawEntry]
) -> tuple[str, bool] | None:
    """(folder or list file, is a list) that `value` names below `top`, or None; ``../x``
    naming nothing there is read as ``x`` (Ultralytics' rule for Roboflow's YAMLs)."""
    tries = [value, value[3:]] if value.startswith("../") else [value]
    return first_inside([os.path.join(root, rel) for rel in tries], top, files)


def first_inside(paths: list[str], top: str, files: dict[str, RawEntry]) -> tuple[str, bool] | None:
    """(folder or list file, is a list) of the first of `paths` that names a real folder or a
    listed file inside `top` (never a path out of it), or None."""
    for path in map(os.path.normpath, paths):
        if not is_inside(path, top):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            return path, False
        if path in files:
            return path, True
    return None
