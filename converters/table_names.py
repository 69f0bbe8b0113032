"""What names mean to the ``table`` source: which files are tables, their splits, column roles.

`find_tables` lists a root's table files in scan order (`folder_tables` for detection);
`split_of_name` gives the split of ``train.csv`` or ``data/test-00000-of-00001.parquet``;
`find_columns` tells which column is the image, label, split and key (guessed from the usual
names, or given with ``--image-col``/``--label-col``/``--key-col``); every other column is
extra (it goes to ``json``). The rules are stated in `dlpipe.converters.table`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa

from dlpipe.converters.source import (
    SourceError,
    SourceOptions,
    display_path,
    file_problem,
    is_ignored_name,
    raw_folder_of,
    unlistable,
)

__all__ = [
    "ID_AS_IMAGE",
    "IMAGE_NAMES",
    "LABEL_NAMES",
    "NO_LABEL",
    "TABLE_SUFFIXES",
    "TEXT_AS_STRING",
    "Columns",
    "find_columns",
    "find_tables",
    "folder_tables",
    "is_bytes",
    "is_image_struct",
    "is_submission",
    "is_table",
    "split_of_name",
    "string_columns",
]

_SPLIT_PREFIXES = (("validation", "val"), ("train", "train"), ("val", "val"), ("test", "test"))
IMAGE_NAMES = ("image", "img", "image_path", "path", "file", "filename", "filepath", "file_name")
LABEL_NAMES = ("label", "labels", "class", "category", "target", "y", "class_name")
_KEY_NAMES = ("__key__", "key", "id")
_SPLIT_COL = "split"
ID_AS_IMAGE = "id"
"""The column that names the image files when no column has an image name (Kaggle)."""
NO_LABEL = "none"
"""``--label-col none``: the table has no label column."""
TEXT_AS_STRING = _KEY_NAMES + IMAGE_NAMES
"""CSV/TSV columns never inferred as numbers (an id ``001`` stays ``001``)."""


TABLE_SUFFIXES = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
}
_DOC_PREFIXES = ("readme", "license")
_SUBMISSION_WORD = "samplesubmission"
_SUBMISSION_NAME = re.compile(
    r"(example|dummy|test)?submissions?(format|example|template|file|sample)?(v?[0-9]+)?"
)


def _has_table_suffix(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in TABLE_SUFFIXES


def is_table(path: str) -> bool:
    """True for a file with a table suffix (``.csv``, ``.tsv``, ``.jsonl``, ...)."""
    return os.path.isfile(path) and _has_table_suffix(path)


def is_submission(name: str) -> bool:
    """True for a competition's submission template (predictions to fill in), never data.

    The file name up to its first dot, lower-cased with every character but letters and digits
    removed, contains ``samplesubmission`` (``sample_submission.csv``, Kaggle's camelCase
    ``sampleSubmission.csv``, Zindi's ``SampleSubmission.csv``, ``sample-submission.tsv``,
    ``sample_submission_v2.csv``, ``stage_1_sample_submission.csv``,
    ``LOC_sample_submission.csv``), or is ``submission`` with an optional ``example``/
    ``dummy``/``test`` before and ``format``/``example``/``template``/``file``/``sample`` and a
    version after (``submission.csv``, DrivenData's ``submission_format.csv``,
    ``submission_example_v2.parquet``). Any suffix: a ``.csv.zip`` is no table either way.
    """
    head = os.path.basename(name).split(".", 1)[0]
    words = re.sub(r"[^a-z0-9]", "", head.lower())
    return _SUBMISSION_WORD in words or _SUBMISSION_NAME.fullmatch(words) is not None


def _visible(folder: str) -> list[str]:
    """The names in `folder` that may be tables (hidden, tool and submission names left out)."""
    try:
        names = os.listdir(folder)
        return sorted(n for n in names if not is_ignored_name(n) and not is_submission(n))
    except OSError as exc:
        raise unlistable(folder, exc) from exc


def _is_real_folder(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


def folder_tables(root: str, strict: bool) -> list[str] | None:
    """The table files of `root` and of ``root/data/``, sorted.

    Args:
        root: the folder.
        strict: return None when `root` holds anything but tables (and docs): detection.
            Otherwise other entries (an image folder beside the tables) are ignored.
    """
    found = []
    for name in _visible(root):
        path = os.path.join(root, name)
        is_data = name == "data" and _is_real_folder(path)
        inner = [os.path.join(path, n) for n in _visible(path)] if is_data else []
        if _has_table_suffix(path) and not os.path.isdir(path):
            found.append(path)  # a FIFO or a link out named .csv is refused by find_tables
        elif inner and all(_has_table_suffix(p) and not os.path.isdir(p) for p in inner):
            found += inner
        elif strict and not (os.path.isfile(path) and name.lower().startswith(_DOC_PREFIXES)):
            return None
    return sorted(found) or None


def find_tables(root: str) -> list[str]:
    """The table files of `root`, in scan order; SourceError when `root` is no table layout.

    Args:
        root: one table file, or a folder of them (directly or under ``data/``); other entries
            of the folder (an image folder beside the tables) are ignored.
    """
    if os.path.isfile(root) and is_submission(root):
        raise SourceError(
            f"{display_path(root)}: a submission template (the predictions a competition "
            "asks for), not labelled data; give the training table (train.csv) or the folder "
            "that holds it"
        )
    if os.path.isfile(root):
        files = [root] if is_table(root) else None
    else:
        files = folder_tables(root, strict=False) if os.path.isdir(root) else None
    if not files:
        raise SourceError(
            f"{display_path(root)}: not a table file or a folder of them (suffixes: "
            f"{' '.join(TABLE_SUFFIXES)}); give the table file itself"
        )
    folder = raw_folder_of(root)
    for path in files:
        problem = file_problem(path, folder)
        if problem is not None:
            raise SourceError(
                f"{display_path(path)}: {problem}, not a regular table file; dlpipe reads "
                "only regular files inside the raw folder (replace it with the table, or "
                "remove it)"
            )
    unnamed = [os.path.basename(f) for f in files if split_of_name(f) is None]
    if unnamed and len(unnamed) < len(files):
        raise SourceError(
            f"{root}: {', '.join(unnamed)} name no split beside tables that do; rename "
            "them to start with train, val or test, or give one table file as the source"
        )
    return sorted(files, key=lambda f: (split_of_name(f) or "", os.path.basename(f), f))


def split_of_name(filename: str) -> str | None:
    """The split a table file's name gives (``train-00000-of-00002.parquet`` → ``train``)."""
    stem = os.path.splitext(os.path.basename(filename))[0].lower()
    for prefix, split in _SPLIT_PREFIXES:
        if stem == prefix or (stem.startswith(prefix) and not stem[len(prefix)].isalnum()):
            return split
    return None


def string_columns(options: SourceOptions) -> tuple[str, ...]:
    """CSV/TSV columns to read as text whatever they look like: the given image and key
    columns (an id ``001`` stays ``001``)."""
    return tuple(c for c in (options.image_col, options.key_col) if c)


@dataclass(frozen=True)
class Columns:
    """The role each column of a table plays (`extra` columns go to ``json``)."""

    image: str
    label: str | None
    split: str | None
    key: str | None
    extra: tuple[str, ...]


def is_image_struct(kind: pa.DataType) -> bool:
    """The Hugging Face Image feature: a struct with ``bytes`` and ``path`` fields."""
    if not pa.types.is_struct(kind):
        return False
    return {"bytes", "path"} <= {kind.field(i).name for i in range(kind.num_fields)}


def is_bytes(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind)


def _guess(names: Sequence[str], candidates: Sequence[str], taken: set[str]) -> str | None:
    for want in candidates:
        for name in names:
            if name.lower() == want and name not in taken:
                return name
    return None


def _given(name: str, schema: pa.Schema, flag: str, path: str) -> str:
    if name not in schema.names:
        raise SourceError(
            f"{path}: {flag} {name!r} is not a column; the columns are {', '.join(schema.names)}"
        )
    return name


def _image_column(schema: pa.Schema, given: str | None, path: str) -> str:
    if given:
        return _given(given, schema, "--image-col", path)
    name = _guess(schema.names, IMAGE_NAMES, set())
    typed = [f.name for f in schema if is_bytes(f.type) or is_image_struct(f.type)]
    if name is None and len(typed) == 1:
        name = typed[0]
    if name is None:  # Kaggle's id,label tables: the id names the image file (no suffix)
        name = _guess(schema.names, (ID_AS_IMAGE,), set())
    if name is None:
        raise SourceError(
            f"{path}: no image column (looked for {', '.join(IMAGE_NAMES)}); the columns are "
            f"{', '.join(schema.names)}: name the one with image paths or bytes with --image-col"
        )
    return name


def find_columns(schema: pa.Schema, options: SourceOptions, path: str) -> Columns:
    """Which column is the image, label, split and key; every other column is extra."""
    image = _image_column(schema, options.image_col, path)
    if options.label_col and options.label_col.lower() == NO_LABEL:
        label: str | None = None
    elif options.label_col:
        label = _given(options.label_col, schema, "--label-col", path)
    else:
        label = _guess(schema.names, LABEL_NAMES, {image})
    split = None
    if split_of_name(path) is None and _SPLIT_COL in schema.names:
        split = _SPLIT_COL if _SPLIT_COL not in (image, label) else None
    taken = {label or "", split or ""} | ({image} if image.lower() != ID_AS_IMAGE else set())
    if options.key_col:
        key: str | None = _given(options.key_col, schema, "--key-col", path)
    else:
        key = _guess(schema.names, _KEY_NAMES, taken)
    used = {image, label, split}
    return Columns(image, label, split, key, tuple(sorted(set(schema.names) - used)))
