"""Where a table's image paths point, and whether a folder is a table beside its images.

A path in a table's image column is looked up, in order, in the table's folder and then in the
image root: the folder ``--image-root`` gives (`SourceOptions.image_root`; a relative one is
taken in the raw folder first, then in the current folder), or else the one sub-folder of the
table's folder that holds the files the first 20 rows name, when the table's folder holds none
of them (Kaggle's ``train.csv`` beside ``train/``; ``labels.csv`` beside ``images/``). The folder
chosen is logged and recorded in the scan description. A path without an image suffix (a Kaggle
``id`` column) names the one image file whose name is the path plus an image suffix (``.jpg``,
``.png``, ...); when none or several match, the path is missing.

A path cell that can name no file (a NUL byte, text that is not valid Unicode, over 4096 bytes:
`path_problem`) is never looked up: its row is a skipped sample naming the problem, as a missing
file is. Control characters, ``..`` and absolute paths are legal names: they are looked up, and
read only when the file lies inside the raw folder (`dlpipe.converters.table`).

`label_table` tells detection whether a folder's root holds exactly one table whose header has
an image-path column and a label column (beside it, only tables that name splits, such as
Kaggle's unlabelled ``test.csv``; a submission template, ``sample_submission.csv`` or
``sampleSubmission.csv`` in any spelling (`is_submission`), is ignored): such a folder is a
``table`` layout even with class or image folders beside the table. Headers are read from
regular files inside the folder only, at most 64 KiB of each; a JSON lines header nested
past what Python parses is a `SourceError` naming the file.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from dlpipe.converters.source import (
    IMAGE_SUFFIXES,
    SampleError,
    SourceError,
    display_path,
    file_problem,
    is_ignored_name,
    log,
    open_regular,
)
from dlpipe.converters.table_names import is_submission, split_of_name
from dlpipe.storage import is_inside

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_PATH_BYTES",
    "PROBE_ROWS",
    "PathResolver",
    "label_table",
    "make_resolver",
    "path_problem",
    "resolve_image_root",
    "shown_cell",
]

PROBE_ROWS = 20
"""How many of a table's first image paths choose its image root."""
MAX_PATH_BYTES = 4096
"""The longest path a table may name (Linux's PATH_MAX)."""
MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects a JSON lines table may have."""
_HEADER_BYTES = 64 << 10
_SHOWN_CHARS = 200


def path_problem(value: str) -> str | None:
    """Why an image path cell can name no file (None when it can): a NUL byte, text that is
    not valid Unicode (a lone surrogate), or more than `MAX_PATH_BYTES` bytes."""
    if "\0" in value:
        return "holds a NUL byte, which no file name can"
    try:
        size = len(os.fsencode(value))
    except UnicodeEncodeError:
        return "holds text that is not valid Unicode (a lone surrogate)"
    if size > MAX_PATH_BYTES:
        return f"is {size} bytes long, over the {MAX_PATH_BYTES}-byte limit of a path"
    return None


def shown_cell(value: str) -> str:
    """A table cell as printable, JSON-safe text (`display_path`), cut to its first 200
    characters (a 10 MB cell would otherwise fill every message about its row)."""
    text = display_path(value)
    if len(text) <= _SHOWN_CHARS:
        return text
    return f"{text[:_SHOWN_CHARS]}... ({len(text)} characters)"


def _has_image_suffix(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in IMAGE_SUFFIXES


@functools.lru_cache(maxsize=16)
def _image_stems(folder: str) -> dict[str, tuple[str, ...]]:
    """Stem → the image file names of `folder` with that stem (listed once per folder)."""
    stems: dict[str, list[str]] = {}
    try:
        names = os.listdir(folder)
    except (OSError, ValueError):  # ValueError: a NUL byte (`path_problem` keeps those out)
        return {}
    for name in names:
        if not is_ignored_name(name) and _has_image_suffix(name):
            stems.setdefault(os.path.splitext(name)[0], []).append(name)
    return {stem: tuple(sorted(found)) for stem, found in stems.items()}


class PathResolver:
    """Looks up one table's image paths in its folder, then in its image root (if any)."""

    def __init__(self, table_folder: str, image_root: str | None) -> None:
        self.folders = (table_folder,) + ((image_root,) if image_root else ())

    def candidates(self, value: str) -> list[str]:
        """The paths `value` may name, in lookup order (absolute paths: only themselves)."""
        return [os.path.normpath(os.path.join(folder, value)) for folder in self.folders]

    def find(self, value: str) -> str | None:
        """The existing path `value` names (any kind of entry: it is checked when read)."""
        for path in dict.fromkeys(self.candidates(value)):
            if os.path.lexists(path):
                return path
            if not _has_image_suffix(path):
                matches = _image_stems(os.path.dirname(path)).get(os.path.basename(path), ())
                if len(matches) == 1:
                    return os.path.join(os.path.dirname(path), matches[0])
        return None

    def resolve(self, value: str) -> tuple[str, bool]:
        """(the path to read, whether it exists); a missing path gives its first candidate."""
        found = self.find(value)
        return (found, True) if found else (self.candidates(value)[0], False)


def _sub_folders(folder: str, raw_folder: str) -> list[str]:
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    paths = [os.path.join(folder, n) for n in names if not is_ignored_name(n)]
    return [
        p
        for p in paths
        if os.path.isdir(p) and not os.path.islink(p) and is_inside(os.path.realpath(p), raw_folder)
    ]


def resolve_image_root(given: str, raw_root: str, raw_folder: str) -> str:
    """The ``--image-root`` folder as an absolute path; SourceError when unusable.

    Args:
        given: the option's value; relative: in the raw folder first, then the current folder.
        raw_root: the folder given as raw input (or the table file's folder).
        raw_folder: the real raw folder the image root must lie in.
    """
    inside = os.path.join(raw_root, given)
    path = os.path.abspath(inside if os.path.isdir(inside) else given)
    if not os.path.isdir(path):
        raise SourceError(
            f"--image-root {display_path(given)}: not a folder (looked in {display_path(raw_root)}"
            " and the current folder); give the folder that holds the table's images"
        )
    if not is_inside(os.path.realpath(path), raw_folder):
        real = display_path(os.path.realpath(path))
        raise SourceError(
            f"--image-root {display_path(given)}: resolves to {real}"
            f", outside the raw folder {display_path(raw_folder)}; dlpipe reads only files inside "
            "it (give a raw folder above both the table and the images)"
        )
    return path


def make_resolver(
    table: str, values: Sequence[str | None], image_root: str | None, raw_folder: str
) -> tuple[PathResolver, str | None]:
    """The resolver for one table's paths, and the image root it chose itself (or None).

    Args:
        table: the table file.
        values: the table's image paths (None for embedded bytes), in row order.
        image_root: the resolved ``--image-root``, or None to choose one from the first rows.
        raw_folder: the real raw folder; a chosen image root lies inside it.
    """
    folder = os.path.dirname(table)
    if image_root is not None:
        return PathResolver(folder, image_root), None
    probe = [v for v in values if v and not os.path.isabs(v) and not path_problem(v)]
    probe = probe[:PROBE_ROWS]
    plain = PathResolver(folder, None)
    if not probe or any(plain.find(v) for v in probe):
        return plain, None
    holders = [
        sub
        for sub in _sub_folders(folder, raw_folder)
        if any(PathResolver(sub, None).find(v) for v in probe)
    ]
    if len(holders) != 1:
        return plain, None
    log.info(
        "%s: image paths are read from %s, the one folder beside it holding the files its "
        "first rows name (choose another with --image-root)",
        display_path(table),
        display_path(holders[0]),
    )
    return PathResolver(folder, holders[0]), holders[0]


def _header_names(path: str, raw_folder: str) -> list[str]:
    """The column names of a table file, from at most its first 64 KiB (all of a Parquet
    footer); [] when it cannot be read."""
    try:
        with open_regular(path, raw_folder) as f:
            if path.lower().endswith(".parquet"):
                return list(pq.read_schema(f).names)
            head = f.read(_HEADER_BYTES).decode("utf-8", "replace").splitlines()
    except (SampleError, OSError, pa.ArrowException):
        return []
    if not head:
        return []
    if path.lower().endswith((".jsonl", ".ndjson")):
        try:
            row = json.loads(head[0])
        except ValueError:  # the scan names the problem with its line
            return []
        except RecursionError:
            raise SourceError(
                f"{display_path(path)} line 1: JSON nested deeper than {MAX_JSON_DEPTH} levels "
                "of arrays and objects; fix or remove the line"
            ) from None
        return [str(k) for k in row] if isinstance(row, dict) else []
    delimiter = "\t" if path.lower().endswith(".tsv") else ","
    return [name.strip().strip('"') for name in head[0].split(delimiter)]


def label_table(
    root: str,
    raw_folder: str,
    suffixes: Sequence[str],
    image_names: Sequence[str],
    label_names: Sequence[str],
) -> str | None:
    """The one table file at `root`'s top whose header names an image column and a label
    column (by the usual names, any case); None when there is none, or several. Other tables
    may sit beside it only when every table names a split (Kaggle's ``train.csv`` beside
    ``test.csv``, which has no labels); a submission template (``sample_submission.csv``,
    ``sampleSubmission.csv``, ... see `is_submission`) is no table of the data."""
    try:
        names = sorted(n for n in os.listdir(root) if not is_ignored_name(n))
    except OSError:
        return None
    tables = [
        os.path.join(root, n)
        for n in names
        if os.path.splitext(n)[1].lower() in suffixes
        and not is_submission(n)
        and not os.path.isdir(os.path.join(root, n))
    ]
    labelled = [t for t in tables if _has_columns(t, raw_folder, image_names, label_names)]
    if len(labelled) != 1:
        return None
    if len(tables) > 1 and not all(split_of_name(t) for t in tables):
        return None
    return labelled[0]


def _has_columns(
    table: str, raw_folder: str, image_names: Sequence[str], label_names: Sequence[str]
) -> bool:
    if file_problem(table, raw_folder) is not None:
        return False
    header = {name.lower() for name in _header_names(table, raw_folder)}
    return bool(header & set(image_names) and header & set(label_names))
