"""The subset lists of a Pascal VOC year folder: which ``ImageSets/<task>/*.txt`` are read, the
split each one gives, and the ids each holds.

Every ``ImageSets/Main/*.txt`` (``ImageSets/Segmentation/*.txt`` for voc-seg) is a subset list
(as Datumaro's VOC importer, which CVAT's export goes through, reads them) except a per-class
list ``<class>_<subset>.txt`` (a class of ``labelmap.txt``, else of VOC's 20). Its name, case
aside, is mapped as dlpipe maps split names (`SPLIT_NAMES`: ``Validation`` → ``val``):
``train``/``val``/``test`` as the devkit ships them; ``trainval`` (their union) read only when
neither ``train`` nor ``val`` is there; CVAT's ``default`` subset gives no split (Item.split
None: ``--val-fraction`` decides); any other name is its own split. A name that is not
``[A-Za-z0-9_]`` after mapping, or two files that map to one name, is a `SourceError` naming
the files, and so is an id listed twice, in one list or in two.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterable

from dlpipe.converters.source import (
    SPLIT_NAMES,
    Item,
    SourceError,
    display_path,
    read_text,
)
from dlpipe.sample import unescape_key

__all__ = ["DEFAULT_SUBSET", "check_once", "read_ids", "split_of", "subset_lists"]

DEFAULT_SUBSET = "default"
"""CVAT's subset of a task without subsets: no split."""
_MAX_LIST_BYTES = 16 << 20  # VOC2012's largest list (trainval.txt) is 180 KB
_NAME = re.compile(r"[A-Za-z0-9_]{1,100}")


def subset_lists(folder: str, paths: Iterable[str], classes: Collection[str]) -> dict[str, str]:
    """Subset name → its list file, of the ``.txt`` files in `paths` directly in `folder`.

    Args:
        folder: the ``ImageSets/<task>/`` folder.
        paths: the regular files found below the year folder.
        classes: the class names whose ``<class>_<subset>.txt`` lists are per-class lists.

    Raises:
        SourceError: no subset list, a name dlpipe cannot store, two files of one name.
    """
    found: dict[str, str] = {}
    for path in sorted(paths):
        stem, suffix = os.path.splitext(os.path.basename(path))
        if os.path.dirname(path) != folder or suffix.lower() != ".txt":
            continue
        if any(stem.startswith(f"{c}_") and len(stem) > len(c) + 1 for c in classes):
            continue  # <class>_<subset>.txt: '<id> 1' lines, not a subset
        name = _subset_name(stem, path)
        if name in found:
            raise SourceError(
                f"{display_path(path)} and {display_path(found[name])} both name subset "
                f"{name!r}; keep one of them"
            )
        found[name] = path
    if "trainval" in found and ("train" in found or "val" in found):
        del found["trainval"]  # the union of train and val, read only without them
    if not found:
        raise SourceError(
            f"{display_path(folder)}: no split list (train.txt, val.txt, trainval.txt) nor "
            "subset list (CVAT's default.txt); restore ImageSets/ from the VOC download or "
            "export the dataset again"
        )
    return found


def _subset_name(stem: str, path: str) -> str:
    """A list's subset name: its stem, lower-case, mapped through `SPLIT_NAMES`."""
    name = SPLIT_NAMES.get(stem.lower(), stem.lower())
    if not _NAME.fullmatch(name):
        raise SourceError(
            f"{display_path(path)}: subset {stem[:60]!r} is no split name dlpipe can store "
            "(1-100 letters, digits and '_', such as default, Train or Validation); rename "
            "the list file, or remove it if it is no subset list"
        )
    return name


def split_of(name: str) -> str | None:
    """The dataset split of a subset name: None for CVAT's ``default``, else the name."""
    return None if name == DEFAULT_SUBSET else name


def read_ids(root: str, path: str) -> list[tuple[int, str]]:
    """(line number, id) of a subset list: one id a line.

    Raises:
        SourceError: the file cannot be read, or a line is not one id.
    """
    text = read_text(path, root, max_bytes=_MAX_LIST_BYTES, fix="restore it from the download")
    ids = []
    for number, line in enumerate(text.splitlines(), 1):
        word = line.strip()
        if not word:
            continue
        if len(word.split()) != 1 or "/" in word or "\\" in word or word.startswith("."):
            raise SourceError(
                f"{display_path(path)} line {number}: {word[:40]!r} is not one image id (a "
                "split list holds one id a line, such as 2008_000008; per-class lists "
                "'<id> 1' are not split lists, and are known by a class name before '_')"
            )
        ids.append((number, word))
    return ids


def check_once(items_of: dict[str, list[Item]], lists: dict[str, str]) -> None:
    """Refuse an id listed twice, in one subset list or in two (a leak between splits).

    Args:
        items_of: subset name → the items of its list.
        lists: subset name → its list file.
    """
    seen: dict[str, str] = {}
    for name, items in items_of.items():
        for item in items:
            if item.key in seen:
                raise SourceError(
                    f"{display_path(lists[name])}: id {unescape_key(item.key)!r} is listed "
                    f"twice (also in {display_path(lists[seen[item.key]])}); each image "
                    "belongs to one split (restore the lists from the VOC download)"
                )
            seen[item.key] = name
