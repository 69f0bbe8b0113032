"""``splitlist``: the generic rule for images whose official split lives in list files.

Layout (`SplitListSource`):

- Lists: ``train.txt``, ``val.txt``, ``test.txt`` and/or ``trainval.txt``, all in one of: the
  folder itself, ``meta/``, ``splits/``, ``lists/`` (lists in two of them are refused). Blank
  lines and lines starting with ``#`` are skipped; every other line is ``<path>`` or
  ``<path> <label>``, whitespace-separated (paths with spaces are not supported).
- Paths: relative (``./`` allowed; ``..`` or an absolute path is a skipped sample), looked up
  from the folder, then from ``images/``. A path without an image suffix
  (``apple_pie/1005649``) names the one image file with that stem (two, ``x.jpg`` and
  ``x.png``, is a skipped sample).
- Labels: a list whose lines have a second column takes its labels from it: integers are class
  ids (sorted numerically, kept as ``class_ids`` unless they are 0..n-1), anything else class
  names (sorted); a list of bare paths beside such lists is a split without labels. When no
  list has a label column, the image's parent folder is its class (``cat/001.jpg``: ``cat``,
  sorted as imagefolder sorts them) if some list names images in two or more folders and every
  image lies in a folder; otherwise there are no labels (``train/1.jpg`` beside
  ``test/2.jpg`` gives no classes). A line with another field count than its list's is a
  skipped sample.
- Splits: the list's name. ``trainval.txt`` beside ``train.txt``/``val.txt`` must name exactly
  their union (it is checked, not converted); an image in two lists is refused.
- Keys: the listed path without its image suffix, escaped by the key rule.

Not claimed: a folder a dataset's own layout claims (Food-101, CUB, Pets, Flowers, Cars), a
YOLO folder (``data.yaml`` or ``dataset.yaml`` at its top), a folder with no image or other
sub-folder beside its lists. A table mapping images to a ``split`` column is the ``table``
source's. Missing images, lists most of whose lines fail and unlisted images follow the rules
of `dlpipe.converters.listed`.
"""

from __future__ import annotations

import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from typing import Any

from dlpipe.converters.listed import (
    Listed,
    ListedSource,
    Listing,
    data_lines,
    read_list_file,
    shown_line,
)
from dlpipe.converters.raw_tree import RawEntry, relative_path
from dlpipe.converters.source import (
    SourceError,
    display_path,
    image_kind_of_name,
    is_ignored_name,
)

__all__ = ["SplitListSource"]

_LIST_NAMES = ("train", "val", "test", "trainval")
_LIST_FOLDERS = ("", "meta", "splits", "lists")
_IMAGE_BASES = ("", "images/")
_INTEGER = re.compile(r"-?[0-9]{1,18}")


@dataclass(frozen=True)
class _Line:
    number: int
    tokens: list[str]


def _list_folders(root: str) -> dict[str, dict[str, str]]:
    """List folder ("" for the root) → split name → list file, for the folders holding lists."""
    found: dict[str, dict[str, str]] = {}
    for folder in _LIST_FOLDERS:
        lists = {
            name: path
            for name in _LIST_NAMES
            if os.path.isfile(path := os.path.join(root, folder, f"{name}.txt"))
        }
        if lists:
            found[folder] = lists
    return found


def _has_images_beside(root: str, list_folder: str) -> bool:
    try:
        names = [n for n in os.listdir(root) if not is_ignored_name(n)]
    except OSError:
        return False
    return any(
        (os.path.isdir(os.path.join(root, n)) and n != list_folder) or image_kind_of_name(n)
        for n in names
    )


def _claimed_by_a_dataset(root: str) -> bool:
    from dlpipe.converters import oxford_pets, splitlist_datasets, splitlist_mat

    layouts = (*splitlist_datasets.LAYOUTS, oxford_pets.OxfordPetsSource, *splitlist_mat.LAYOUTS)
    return any(cls.find_base(root) is not None for cls in layouts)


class SplitListSource(ListedSource):
    """The generic split-list rule of the module docstring."""

    kind = "splitlist"
    name = "generic split-list"
    needs = "train.txt, val.txt, test.txt or trainval.txt in it, meta/, splits/ or lists/"

    @classmethod
    def find_base(cls, root: str) -> str | None:
        folders = _list_folders(root)
        yolo = any(os.path.exists(os.path.join(root, n)) for n in ("data.yaml", "dataset.yaml"))
        if not folders or yolo:
            return None
        if not any(_has_images_beside(root, folder) for folder in folders):
            return None
        return None if _claimed_by_a_dataset(root) else root

    def read_lists(self, base: str, files: dict[str, RawEntry]) -> Listing:
        folders = _list_folders(self.root)
        if len(folders) != 1:
            where = " and ".join(display_path(os.path.join(self.root, f)) for f in folders)
            raise SourceError(
                f"split lists lie in both {where}; keep the lists of one folder (the generic "
                "split-list rule reads train/val/test/trainval.txt from one place)"
            )
        ((_, paths),) = folders.items()
        parsed = {split: self._parse(path) for split, path in paths.items()}
        shown = {split: display_path(path) for split, path in paths.items()}
        parsed = _without_redundant_trainval(parsed, shown)
        stems: dict[str, list[str]] = defaultdict(list)
        for rel in files:
            if image_kind_of_name(rel):
                stems[os.path.splitext(rel)[0]].append(rel)
        entries = [
            self._entry(split, shown[split], line, files, stems)
            for split, lines in parsed.items()
            for line in lines
        ]
        entries, classes, class_ids, labels = _labelled(entries, parsed)
        read = {relative_path(p, self.root) for p in paths.values()}
        return Listing(
            layout=f"generic split lists ({', '.join(sorted(read))}); labels: {labels}",
            classes=classes,
            entries=entries,
            read=read,
            class_ids=class_ids,
        )

    def _parse(self, path: str) -> list[_Line]:
        lines = [
            _Line(n, text.split()) for n, text in data_lines(read_list_file(self.raw_folder, path))
        ]
        columns = Counter(len(line.tokens) for line in lines).most_common(1)
        if columns and columns[0][0] not in (1, 2):
            raise SourceError(
                f"{display_path(path)}: most lines have {columns[0][0]} fields; a split list's "
                "lines are '<image path>' or '<image path> <label>'"
            )
        return lines

    def _entry(
        self,
        split: str,
        list_file: str,
        line: _Line,
        files: dict[str, RawEntry],
        stems: dict[str, list[str]],
    ) -> Listed:
        path = _normal(line.tokens[0])
        key = os.path.splitext(path)[0] if image_kind_of_name(path) else path
        listed = Listed(split, None, key, None, list_file, line.number)
        if len(line.tokens) > 2:
            problem = f"has {len(line.tokens)} fields, expected '<image path> [<label>]'"
            return _with(listed, problem=f"{listed.origin}: {problem}")
        parts = path.split("/")
        if path.startswith("/") or ".." in parts or "" in parts:
            problem = f"{shown_line(line.tokens[0])} is not a relative path inside the folder"
            return _with(listed, problem=f"{listed.origin}: {problem}")
        exact = image_kind_of_name(path) is not None
        for base in _IMAGE_BASES:
            found = [base + path] if exact and base + path in files else stems.get(base + path, [])
            if len(found) > 1:
                names = ", ".join(display_path(f) for f in found)
                return _with(listed, problem=f"{listed.origin}: names {len(found)} images: {names}")
            if found:
                return _with(listed, image=found[0], extra=line.tokens[1:])
        suffix = "" if exact else ".<image suffix>"
        looked = " or ".join(display_path(self.path(b + path)) + suffix for b in _IMAGE_BASES)
        return _with(listed, image=path, looked_for=looked, extra=line.tokens[1:])


def _with(listed: Listed, **changes: Any) -> Listed:
    return replace(listed, **changes)


def _normal(path: str) -> str:
    while path.startswith("./"):
        path = path[2:]
    return path


def _without_redundant_trainval(
    parsed: dict[str, list[_Line]], shown: dict[str, str]
) -> dict[str, list[_Line]]:
    """The lists to convert: ``trainval.txt`` beside train/val lists must name their union
    (then it is dropped), else it is a split of its own."""
    if "trainval" not in parsed or not ({"train", "val"} & parsed.keys()):
        return parsed
    names = {split: {_normal(x.tokens[0]) for x in parsed[split]} for split in parsed}
    parts = [split for split in ("train", "val") if split in parsed]
    union = set().union(*(names[split] for split in parts))
    odd = sorted(names["trainval"] ^ union)
    if odd:
        where = "names" if odd[0] in names["trainval"] else "lacks"
        others = " and ".join(shown[s] for s in parts)
        raise SourceError(
            f"{shown['trainval']} {where} {odd[0]!r}, unlike {others}; trainval.txt beside "
            "them must name exactly their images (fix or remove it)"
        )
    return {split: lines for split, lines in parsed.items() if split != "trainval"}


def _labelled(
    entries: list[Listed], parsed: dict[str, list[_Line]]
) -> tuple[list[Listed], tuple[str, ...], tuple[int | str, ...] | None, str]:
    """The entries with labels (their label tokens dropped), the classes, the class ids and
    where the labels came from."""
    columns = {
        split: Counter(len(x.tokens) for x in lines).most_common(1)[0][0]
        for split, lines in parsed.items()
        if lines
    }
    labelled = {split for split, n in columns.items() if n == 2}
    if labelled:
        return _column_labels(entries, labelled, columns)
    by_split: dict[str, set[str | None]] = defaultdict(set)
    for e in entries:
        if e.image and not e.problem and not e.looked_for:
            by_split[e.split].add(e.image.split("/")[-2] if "/" in e.image else None)
    parents = set().union(*by_split.values())
    out = [_odd_columns(e, 1) for e in entries]
    if None in parents or all(len(folders) < 2 for folders in by_split.values()):
        return out, (), None, "none (no label column, and no list's images lie in class folders)"
    classes = sorted({display_path(p) for p in parents if p is not None})
    index = {name: i for i, name in enumerate(classes)}
    out = [
        replace(e, label=index.get(display_path(e.image.split("/")[-2])))
        if e.image and "/" in e.image and not e.problem
        else e
        for e in out
    ]
    return out, tuple(classes), None, "the image's parent folder"


def _odd_columns(entry: Listed, expected: int) -> Listed:
    """The entry with its label token dropped, or a problem when its line has another count."""
    tokens = entry.extra or []
    if entry.problem or len(tokens) + 1 == expected:
        return replace(entry, extra=None)
    problem = f"{entry.origin}: has {len(tokens) + 1} fields where its list's lines have {expected}"
    return replace(entry, extra=None, problem=problem)


def _column_labels(
    entries: list[Listed], labelled: set[str], columns: dict[str, int]
) -> tuple[list[Listed], tuple[str, ...], tuple[int | str, ...] | None, str]:
    """Labels from the second column: integers are class ids (sorted numerically), anything
    else class names (sorted)."""
    values = {e.extra[0] for e in entries if e.split in labelled and e.extra and not e.problem}
    numbers = bool(values) and all(_INTEGER.fullmatch(v) for v in values)
    names = sorted({int(v) for v in values}) if numbers else sorted(values)
    index: dict[int | str, int] = {name: i for i, name in enumerate(names)}
    out = []
    for entry in entries:
        fixed = _odd_columns(entry, columns.get(entry.split, 1))
        if entry.split in labelled and not fixed.problem:
            token = entry.extra[0]
            fixed = replace(fixed, label=index[int(token) if numbers else token])
        out.append(fixed)
    bare = sorted(set(columns) - labelled)
    source = "the second column" + (f" ({', '.join(bare)}: none)" if bare else "")
    ids = tuple(names) if numbers and names != list(range(len(names))) else None
    return out, tuple(str(name) for name in names), ids, source
