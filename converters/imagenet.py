"""``imagenet``: ILSVRC2012 (ImageNet-1k) as it ships, the Kaggle download or the devkit.

Layouts (``root`` is the folder the download was extracted into):

- Kaggle "ImageNet Object Localization Challenge": ``LOC_synset_mapping.txt`` (a class a line,
  ``n01440764 tench, Tinca tinca``), ``LOC_val_solution.csv`` (``ImageId,PredictionString``; the
  label is the PredictionString's first token) and ``ILSVRC/Data/CLS-LOC/{train,val,test}/``;
  or ``train/`` and ``val/`` beside the LOC files.
- The devkit, as torchvision's ``ImageNet`` reads it: ``train/``, ``val/`` and
  ``ILSVRC2012_devkit_t12/data/`` with ``meta.mat`` (struct ``synsets``: ILSVRC2012_ID, WNID,
  words, num_children; the leaves, num_children == 0, are the classes; MATLAB v5/v7, parsed here
  with every length checked) and ``ILSVRC2012_validation_ground_truth.txt`` (line i: the
  ILSVRC2012_ID of ``ILSVRC2012_val_<i as 8 digits>``).

``train/<wnid>/**/<image>`` gives the train labels; ``val/`` may be flat or sorted into folders,
its labels always come from the label file, by file stem. Classes are the wnids sorted (index 0
= n01440764) in both splits; their names are ``class_names`` in the manifest's ``source``. The
unlabelled ``test/`` is left out (``source.left_out``).

Everything else below ``root`` is not read and is counted in ``source.unused``: the images of
``test/`` and images directly in ``train/`` (no synset folder) as images; Kaggle's
``LOC_train_solution.csv`` and ``ILSVRC/Annotations/`` (boxes) as annotation files;
``ILSVRC/ImageSets/`` and the devkit's ``ILSVRC2012_validation_blacklist.txt`` as split lists;
the rest (``LOC_sample_submission.csv``, the devkit's code and readme) as other.

Produces one sample per image: the image and ``cls``, split ``train`` or ``val``; keyed by the
path in ``train/`` without suffix, escaped (``n01440764%2Fn01440764_10026``), or the val stem.

A missing, oversized or malformed label file or split folder, or val images and labels that do
not pair up one to one, is a `SourceError`; a row naming no known class skips its sample (listed
in errors.jsonl). Files are read by the raw-folder rule of `dlpipe.converters.source`; a split
folder behind a symbolic link is refused.
"""

from __future__ import annotations

import csv
import io
import os
import re
from dataclasses import dataclass, replace
from typing import Any

from dlpipe.converters.listed import count_unused, unused_kind
from dlpipe.converters.matfile import read_struct_rows
from dlpipe.converters.raw_tree import Listings, RawEntry, RawTree, relative_path
from dlpipe.converters.source import (
    Item,
    SampleError,
    Scan,
    Source,
    SourceError,
    display_path,
    image_kind_of_name,
    raw_folder_of,
    read_file,
    read_text,
)
from dlpipe.sample import make_key

__all__ = ["ImageNetSource", "read_synsets"]

_MAPPING, _VAL_CSV = "LOC_synset_mapping.txt", "LOC_val_solution.csv"
_KAGGLE_DATA = ("ILSVRC", "Data", "CLS-LOC")
_DEVKIT, _META = "ILSVRC2012_devkit_t12", "meta.mat"
_TRUTH = "ILSVRC2012_validation_ground_truth.txt"
_WNID, _CLASS_ID = re.compile(r"n[0-9]{8}"), re.compile(r"[0-9]{1,9}")
_MAX_LABEL_FILE_BYTES = 64 << 20  # LOC_val_solution.csv is 2.4 MB
_MAX_MAT_BYTES = 16 << 20  # meta.mat, as read and decompressed (about 1.5 MB in the devkit)
_SYNSET_FIELDS = ("ILSVRC2012_ID", "WNID", "words", "num_children")
_BOXES, _BLACKLIST = "LOC_train_solution.csv", "ILSVRC2012_validation_blacklist.txt"


def _shown(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:40] + "...")


def _inside(root: str, path: str) -> None:
    """Refuse `path` unless it lies in `root` with no symbolic link on the way."""
    if os.path.realpath(path) != os.path.join(os.path.realpath(root), os.path.relpath(path, root)):
        raise SourceError(
            f"{display_path(path)} is (or lies under) a symbolic link, which dlpipe does not "
            "follow; give the real folder as raw, or move the files in"
        )


def _read_text(root: str, path: str) -> str:
    """A label file's text: a regular UTF-8 file inside `root`, at most 64 MiB."""
    _check_present(path)
    return read_text(path, raw_folder_of(root), max_bytes=_MAX_LABEL_FILE_BYTES, fix="restore it")


def _check_present(path: str) -> None:
    if not os.path.lexists(path):
        raise SourceError(
            f"{display_path(path)} is missing; it holds the labels (restore it from the download)"
        )


def _read_label_file(root: str, path: str, max_bytes: int = _MAX_LABEL_FILE_BYTES) -> bytes:
    _check_present(path)
    try:
        return read_file(path, raw_folder_of(root), max_bytes=max_bytes)
    except SampleError as exc:
        raise SourceError(str(exc)) from exc  # it names the file, the problem and the fix


def _kaggle_classes(root: str, path: str) -> dict[str, str]:
    """wnid → names from ``LOC_synset_mapping.txt``."""
    shown = display_path(path)
    names: dict[str, str] = {}
    for number, line in enumerate(_read_text(root, path).splitlines(), 1):
        wnid, _, words = line.strip().partition(" ")
        if not wnid:
            continue
        if not _WNID.fullmatch(wnid) or wnid in names:
            what = "repeats" if wnid in names else "is not a WordNet id (n and 8 digits)"
            raise SourceError(
                f"{shown} line {number}: {_shown(wnid)} {what}; each line is one class, "
                "'n01440764 tench, Tinca tinca' (restore the file from the download)"
            )
        names[wnid] = words.strip()
    return names


def _kaggle_val_labels(root: str, path: str) -> dict[str, tuple[str, str]]:
    """Val image stem → (label token, origin) from ``LOC_val_solution.csv``."""
    shown = display_path(path)
    rows = csv.reader(io.StringIO(_read_text(root, path)))
    labels: dict[str, tuple[str, str]] = {}
    try:
        header = next(rows, [])
        if [h.strip() for h in header] != ["ImageId", "PredictionString"]:
            raise SourceError(
                f"{shown}: header {_shown(','.join(header))}, expected ImageId,PredictionString"
            )
        for row in rows:
            origin = f"{shown} line {rows.line_num}"
            if not row:
                continue
            if len(row) != 2 or row[0].strip() in labels:
                what = "repeats its ImageId" if len(row) == 2 else f"has {len(row)} fields"
                raise SourceError(f"{origin} {what}; expected one ImageId,PredictionString row")
            tokens = row[1].split()
            labels[row[0].strip()] = (tokens[0] if tokens else "", origin)
    except csv.Error as exc:
        raise SourceError(f"{shown}: not a readable CSV ({exc}); restore it") from exc
    return labels


def _devkit_val_labels(
    root: str, path: str, id_to_wnid: dict[int, str]
) -> dict[str, tuple[str, str]]:
    """Val image stem → (label token, origin): line i labels ``ILSVRC2012_val_<i>``."""
    shown = display_path(path)
    labels: dict[str, tuple[str, str]] = {}
    for number, line in enumerate(_read_text(root, path).rstrip().splitlines(), 1):
        if not _CLASS_ID.fullmatch(line.strip()):
            raise SourceError(
                f"{shown} line {number}: {_shown(line)} is not an ILSVRC2012_ID (one integer a "
                "line, line i for ILSVRC2012_val_<i>); restore it from the devkit"
            )
        class_id = int(line)
        token = id_to_wnid.get(class_id, f"ILSVRC2012_ID {class_id}")
        labels[f"ILSVRC2012_val_{number:08d}"] = (token, f"{shown} line {number}")
    return labels


def read_synsets(root: str, path: str) -> list[tuple[Any, ...]]:
    """The ``synsets`` rows of a devkit ``meta.mat``: (ILSVRC2012_ID, WNID, words, num_children).

    Raises:
        SourceError: not a MATLAB v5/v7 file, malformed, over 16 MiB (read or decompressed),
            or without a ``synsets`` struct.
    """
    data = _read_label_file(root, path, _MAX_MAT_BYTES)
    return read_struct_rows(data, display_path(path), "synsets", _SYNSET_FIELDS, _MAX_MAT_BYTES)


def _devkit_classes(root: str, path: str) -> tuple[dict[str, str], dict[int, str]]:
    """(wnid → names, ILSVRC2012_ID → wnid) of the leaf synsets in ``meta.mat``."""
    shown = display_path(path)
    names: dict[str, str] = {}
    id_to_wnid: dict[int, str] = {}
    for number, (class_id, wnid, words, children) in enumerate(read_synsets(root, path), 1):
        if children != 0:
            continue
        valid_id = isinstance(class_id, float) and class_id.is_integer()
        if not (valid_id and isinstance(wnid, str) and _WNID.fullmatch(wnid)) or wnid in names:
            raise SourceError(
                f"{shown}: synset {number} has ILSVRC2012_ID {class_id!r} and WNID {wnid!r}; "
                "each leaf needs an integer id and its own wnid (re-extract the devkit)"
            )
        names[wnid] = words if isinstance(words, str) else ""
        id_to_wnid[int(class_id)] = wnid
    if not names:
        raise SourceError(
            f"{shown}: 'synsets' has no leaves (fields {', '.join(_SYNSET_FIELDS)}, "
            "num_children == 0); re-extract the devkit"
        )
    return names, id_to_wnid


@dataclass(frozen=True)
class _Layout:
    name: str  # "kaggle" or "devkit"
    splits: str  # the folder holding train/ and val/
    classes_file: str
    labels_file: str


def _find_layout(root: str) -> _Layout | None:
    """The layout `root` has by its names: the Kaggle LOC files, or the devkit folder."""
    if any(os.path.lexists(os.path.join(root, name)) for name in (_MAPPING, _VAL_CSV)):
        nested = os.path.join(root, *_KAGGLE_DATA)
        splits = nested if os.path.lexists(nested) else root
        return _Layout("kaggle", splits, os.path.join(root, _MAPPING), os.path.join(root, _VAL_CSV))
    data = os.path.join(root, _DEVKIT, "data")
    if os.path.isdir(os.path.join(root, _DEVKIT)):
        return _Layout("devkit", root, os.path.join(data, _META), os.path.join(data, _TRUTH))
    return None


class ImageNetSource(Source):
    kind = "imagenet"

    @classmethod
    def detect(cls, root: str, listings: Listings | None = None) -> bool:
        """True when `root` has the Kaggle LOC files or the devkit folder beside train/ or val/."""
        layout = _find_layout(root)
        return layout is not None and any(
            os.path.isdir(os.path.join(layout.splits, split)) for split in ("train", "val")
        )

    def scan(self) -> Scan:
        layout = _find_layout(self.root)
        if layout is None:
            raise SourceError(
                f"{display_path(self.root)}: neither {_MAPPING} + {_VAL_CSV} (Kaggle) nor "
                f"{_DEVKIT}/ is there; give the folder the ImageNet download was extracted to"
            )
        if layout.name == "kaggle":
            names = _kaggle_classes(self.root, layout.classes_file)
            val_labels = _kaggle_val_labels(self.root, layout.labels_file)
        else:
            names, id_to_wnid = _devkit_classes(self.root, layout.classes_file)
            val_labels = _devkit_val_labels(self.root, layout.labels_file, id_to_wnid)
        classes = tuple(sorted(names))
        index = {wnid: i for i, wnid in enumerate(classes)}
        tree = RawTree(self.root, self.take_listings())
        for split in ("train", "val"):
            self._check_folder(layout, split)
        files = list(tree.files(self.root))
        train, ignored = self._train_items(files, layout, index)
        val, val_ignored = self._val_items(files, layout, index, val_labels)
        read = {layout.classes_file, layout.labels_file} | {it.ref[0] for it in train + val}
        unread = [relative_path(e.path, self.root) for e in files if e.path not in read]
        description = {
            "kind": self.kind,
            "root": display_path(self.root),
            "layout": self._layout_text(layout),
            "labels_files": [display_path(layout.classes_file), display_path(layout.labels_file)],
            "class_names": [names[wnid] for wnid in classes],
            "ignored_files": ignored + val_ignored,
            "unused": count_unused(unread, _unused_kind),
            **tree.report(),
        }
        test = os.path.join(layout.splits, "test")
        if os.path.isdir(test):
            description["left_out"] = {"test": f"{display_path(test)}: no labels"}
        return Scan(classes=classes, items=tuple(train + val), description=description)

    def _layout_text(self, layout: _Layout) -> str:
        """Which layout was read, and the files that made it that one."""
        labels = ", ".join(
            display_path(os.path.relpath(p, self.root))
            for p in (layout.classes_file, layout.labels_file)
        )
        splits = os.path.relpath(layout.splits, self.root)
        where = "" if splits == "." else f"{display_path(splits)}/"
        what = "the Kaggle download" if layout.name == "kaggle" else "the devkit"
        return f"{layout.name}: {what} ({labels}) labels the images of {where}train/ and val/"

    def _check_folder(self, layout: _Layout, split: str) -> None:
        """Refuse a split folder that is missing or lies under a symbolic link."""
        folder = os.path.join(layout.splits, split)
        if not os.path.isdir(folder):
            raise SourceError(
                f"{display_path(folder)} is missing; the {layout.name} layout needs train/ and "
                "val/ (extract the ImageNet train and val images there)"
            )
        _inside(self.root, folder)

    def _images(
        self, files: list[RawEntry], layout: _Layout, split: str
    ) -> tuple[list[tuple[str, Item]], int]:
        """(path in the split folder without suffix, item with no label yet) of every image
        below the split's folder (`files`: every file below the root, as walked), and how many
        other files there are."""
        folder = os.path.join(layout.splits, split)
        below = folder + os.sep
        items, ignored = [], 0
        for entry in (e for e in files if e.path.startswith(below)):
            kind = image_kind_of_name(entry.name)
            if kind is None:
                ignored += 1
                continue
            rel = os.path.splitext(relative_path(entry.path, folder))[0]
            key, shortened = make_key(rel if split == "train" else rel.rpartition("/")[2])
            origin = display_path(entry.path)
            original = display_path(rel) if shortened else None
            item = Item(key, None, split, entry.path, entry.size, kind, origin, original)
            items.append((rel, item))
        return items, ignored

    def _train_items(
        self, files: list[RawEntry], layout: _Layout, index: dict[str, int]
    ) -> tuple[list[Item], int]:
        found, ignored = self._images(files, layout, "train")
        items = []
        for rel, item in found:
            wnid, slash, _ = rel.partition("/")
            if not slash:
                ignored += 1  # an image directly in train/ has no class folder
            elif wnid not in index:
                raise SourceError(
                    f"{display_path(os.path.join(layout.splits, 'train', wnid))}: "
                    f"{_shown(wnid)} is not one of the {len(index)} classes in "
                    f"{display_path(layout.classes_file)}; move it out of train/"
                )
            else:
                items.append(replace(item, label=index[wnid], ref=(item.ref, None)))
        return items, ignored

    def _val_items(
        self,
        files: list[RawEntry],
        layout: _Layout,
        index: dict[str, int],
        labels: dict[str, tuple[str, str]],
    ) -> tuple[list[Item], int]:
        found, ignored = self._images(files, layout, "val")
        classes_file = display_path(layout.classes_file)
        stems: dict[str, str] = {}
        for rel, item in found:
            stem = rel.rpartition("/")[2]
            if stem in stems:
                raise SourceError(f"{item.origin} and {stems[stem]} are both val image {stem}")
            stems[stem] = item.origin
        _match(os.path.join(layout.splits, "val"), layout.labels_file, stems, labels)
        items = []
        for rel, item in found:
            token, origin = labels[rel.rpartition("/")[2]]
            problem = None
            if token not in index:
                what = f"the label {_shown(token)} is not" if token else "no label; it needs"
                problem = f"{origin}: {what} one of the {len(index)} classes of {classes_file}"
            items.append(replace(item, label=index.get(token), ref=(item.ref, problem)))
        if all(item.label is None for item in items):
            raise SourceError(
                f"{items[0].ref[1]}, nor is any other val label: {display_path(layout.labels_file)}"
                f" does not go with {classes_file} (restore both from the download)"
            )
        return items, ignored

    def load(self, item: Item) -> dict[str, bytes]:
        """The image's bytes; a val sample whose label row names no class raises SampleError."""
        path, problem = item.ref
        if problem:
            raise SampleError(problem)
        return {"image": read_file(path, self.raw_folder)}


def _unused_kind(rel: str) -> str:
    """The kind of a file the scan did not read (see the module docstring)."""
    folders, _, name = rel.rpartition("/")
    parts = folders.split("/")
    if "Annotations" in parts or name == _BOXES:
        return "annotation files"
    if "ImageSets" in parts or name == _BLACKLIST:
        return "split lists"
    return unused_kind(rel)


def _match(
    folder: str, labels_file: str, stems: dict[str, str], labels: dict[str, tuple[str, str]]
) -> None:
    """Refuse val images without a label and labels without an image (stems → origins)."""
    unlabelled = [origin for stem, origin in stems.items() if stem not in labels]
    lost = [f"{origin} ({stem})" for stem, (_, origin) in labels.items() if stem not in stems]
    if stems and not unlabelled and not lost:
        return
    problems = [
        f"{found[0]}{f' (and {len(found) - 1} more)' if len(found) > 1 else ''} has no {what}"
        for found, what in ((unlabelled, "label"), (lost, "image"))
        if found
    ]
    raise SourceError(
        f"{display_path(folder)} holds {len(stems)} val images and "
        f"{display_path(labels_file)} labels {len(labels)}: "
        f"{'; '.join(problems) or 'no val images'}; each val image needs one label "
        "(restore the missing images or the label file from the download)"
    )
