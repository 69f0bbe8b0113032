"""The metadata files of a Hugging Face image folder: reading them, and what their columns mean.

`read_metadata` reads one ``metadata.jsonl`` (line by line, so an error names its line),
``metadata.csv`` or ``metadata.parquet`` (with its Hugging Face ``features``); `find_roles` tells
which column is the image, a further image, the caption, the label, the objects and the rest;
`resolve_path` turns a ``file_name`` cell into a path in the raw folder, never out of the
metadata file's folder. The rules are stated in `dlpipe.converters.hf_folder`. A JSON line nested
deeper than `MAX_DEPTH` arrays and objects is a `SourceError` naming its line (the rows are
walked again to make samples; no hostile nesting reaches that).
"""

from __future__ import annotations

import csv
import json
import posixpath
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from dlpipe.converters.raw_tree import relative_path
from dlpipe.converters.source import (
    SPLIT_NAMES,
    SampleError,
    SourceError,
    display_path,
    open_regular,
    read_file,
)

__all__ = [
    "CAPTION_NAMES",
    "FILE_SUFFIX",
    "MAX_DEPTH",
    "METADATA_NAMES",
    "NO_LABEL",
    "UNLABELLED",
    "MetadataFile",
    "Roles",
    "find_roles",
    "names_files",
    "read_metadata",
    "resolve_path",
]

METADATA_NAMES = ("metadata.jsonl", "metadata.csv", "metadata.parquet")
CAPTION_NAMES = ("text", "caption", "captions")
FILE_NAME, FILE_SUFFIX = "file_name", "_file_name"
NO_LABEL = "none"
"""``--label-col none``: no labels (not even from folders)."""
UNLABELLED = -1
"""The label Hugging Face gives a row without one."""
_HEADER_BYTES = 64 << 10
MAX_DEPTH = 64
"""The deepest nesting of arrays and objects a metadata.jsonl line may have."""


@dataclass
class MetadataFile:
    """One metadata file: its rows as Python values, and where each row came from."""

    path: str
    name: str  # relative to the root, for messages
    folder: str  # the metadata file's folder, relative to the root ("" for the root)
    split: str | None
    rows: list[dict[str, Any]]
    columns: list[str]
    lines: list[int] | None = None  # JSONL line numbers
    features: dict[str, Any] = field(default_factory=dict)  # a Parquet's HF features

    def origin(self, row: int) -> str:
        return f"{self.name} line {self.lines[row]}" if self.lines else f"{self.name} row {row}"


@dataclass(frozen=True)
class Roles:
    """The role of each column of a metadata file."""

    image: str
    extras: tuple[tuple[str, str], ...]  # (column, field prefix)
    caption: str | None
    label: str | None
    objects: str | None
    json: tuple[str, ...]


def names_files(path: str, folder: str) -> bool:
    """Whether a metadata file's header names ``file_name``/``*_file_name``; True when the
    header cannot be read (the scan then names the problem)."""
    try:
        with open_regular(path, folder) as f:
            if path.endswith(".parquet"):
                names = list(pq.read_schema(f).names)
            else:
                line = f.readline(_HEADER_BYTES).decode("utf-8-sig")
                names = (
                    list(json.loads(line))
                    if path.endswith(".jsonl")
                    else next(csv.reader([line]), [])
                )
    except (SampleError, OSError, pa.ArrowException, ValueError, TypeError, RecursionError):
        return True
    return any(_is_file_column(str(n)) for n in names)


def _is_file_column(name: str) -> bool:
    return name == FILE_NAME or name.endswith(FILE_SUFFIX)


def _split_of(folder: str) -> str | None:
    """The split a metadata file's folder (relative to the root) names, if any."""
    parts = [p for p in folder.split("/") if p]
    if parts[:1] == ["data"]:
        parts = parts[1:]
    return SPLIT_NAMES.get(parts[0].lower()) if parts else None


def _read_jsonl(path: str, name: str, folder: str) -> tuple[list[dict[str, Any]], list[int]]:
    try:
        text = read_file(path, folder).decode("utf-8-sig")
    except (SampleError, UnicodeDecodeError) as exc:
        raise SourceError(f"{name}: cannot be read as UTF-8 JSON lines ({exc}); fix it") from exc
    rows, lines = [], []
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 is JSON text
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            deep = _nested_too_deep(row)
        except RecursionError:
            deep = True
        except ValueError as exc:
            raise SourceError(
                f"{name} line {number}: not JSON ({exc}); each line is one object such as "
                '{"file_name": "0001.png", "text": "..."}: fix or remove the line'
            ) from None
        if deep:
            raise SourceError(
                f"{name} line {number}: JSON nested deeper than {MAX_DEPTH} levels of arrays "
                "and objects; fix or remove the line"
            )
        if not isinstance(row, dict):
            raise SourceError(
                f"{name} line {number}: a JSON {type(row).__name__}, not an object with a "
                "file_name; fix or remove the line"
            )
        rows.append(row)
        lines.append(number)
    return rows, lines


def _nested_too_deep(value: Any) -> bool:
    """Whether parsed JSON nests arrays and objects deeper than `MAX_DEPTH` (walked without
    recursion)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth == MAX_DEPTH:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def _read_table(path: str, name: str, folder: str) -> tuple[pa.Table, dict[str, Any]]:
    strings = dict.fromkeys((FILE_NAME, "image" + FILE_SUFFIX, *CAPTION_NAMES), pa.string())
    try:
        with open_regular(path, folder) as f:
            if path.endswith(".parquet"):
                table = pq.read_table(f)
            else:
                options = pa_csv.ConvertOptions(column_types=strings, strings_can_be_null=True)
                quoted = pa_csv.ParseOptions(newlines_in_values=True)  # as pandas reads them
                table = pa_csv.read_csv(f, parse_options=quoted, convert_options=options)
    except SampleError as exc:
        raise SourceError(f"{exc}; the metadata file cannot be read") from exc
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(f"{name}: cannot be read ({exc}); fix the file or remove it") from exc
    try:
        info = json.loads((table.schema.metadata or {}).get(b"huggingface", b"{}"))
        features = info.get("info", {}).get("features", {})
    except (ValueError, AttributeError, RecursionError):
        features = {}
    return table, features if isinstance(features, dict) else {}


def read_metadata(path: str, root: str, folder: str) -> MetadataFile:
    """One metadata file's rows; SourceError when it cannot be parsed or has no rows."""
    name = display_path(relative_path(path, root))
    meta_folder = posixpath.dirname(relative_path(path, root))
    meta = MetadataFile(path, name, meta_folder, _split_of(meta_folder), [], [])
    if path.endswith(".jsonl"):
        meta.rows, meta.lines = _read_jsonl(path, name, folder)
        meta.columns = list(dict.fromkeys(k for row in meta.rows for k in row))
    else:
        table, meta.features = _read_table(path, name, folder)
        try:
            meta.rows, meta.columns = table.to_pylist(), list(table.column_names)
        except UnicodeDecodeError as exc:  # a Parquet text column (Arrow does not check)
            raise SourceError(
                f"{name}: holds text that is not UTF-8 ({exc}); write the file again as UTF-8"
            ) from None
    if not meta.rows:
        raise SourceError(f"{name}: the metadata file has no rows; add rows or remove it")
    return meta


def _values(meta: MetadataFile, column: str) -> list[Any]:
    return [row.get(column) for row in meta.rows if row.get(column) is not None]


def _field_prefix(column: str) -> str:
    prefix = column[: -len(FILE_SUFFIX)] if column.endswith(FILE_SUFFIX) else "file"
    return re.sub(r"[^a-z0-9_]", "_", prefix.lower()).strip("_") or "file"


def _caption_column(meta: MetadataFile) -> str | None:
    for want in CAPTION_NAMES:
        for column in meta.columns:
            values = _values(meta, column) if column.lower() == want else []
            if values and all(isinstance(v, str) for v in values):
                return column
            if any(isinstance(v, str) for v in values):
                raise SourceError(
                    f"{meta.name}: column {column!r} mixes text with other values; a caption "
                    "column holds one string per row"
                )
    return None


def _label_column(meta: MetadataFile, given: str | None, objects: str | None) -> str | None:
    if given and given.lower() == NO_LABEL:
        return None
    if given and given not in meta.columns:
        raise SourceError(
            f"{meta.name}: --label-col {given!r} is not a column; the columns are "
            f"{', '.join(meta.columns)}"
        )
    if given and objects:
        raise SourceError(
            f"{meta.name}: --label-col {given!r} beside {objects!r}: a detection dataset's "
            "classes are its objects' categories (drop --label-col)"
        )
    return given or ("label" if "label" in meta.columns and not objects else None)


def find_roles(meta: MetadataFile, image_col: str | None, label_col: str | None) -> Roles:
    """Which column is the image, the further images, the caption, label, objects and json."""
    files = [c for c in meta.columns if _is_file_column(c)]
    files = [c for c in files if all(isinstance(v, str) for v in _values(meta, c))]
    if image_col and image_col not in files:
        raise SourceError(
            f"{meta.name}: --image-col {image_col!r} is not a file_name column (those are: "
            f"{', '.join(files) or 'none'})"
        )
    image = image_col or next((c for c in (FILE_NAME, "image" + FILE_SUFFIX) if c in files), None)
    image = image or (files[0] if files else None)
    if image is None:
        raise SourceError(
            f"{meta.name}: no file_name column (the columns are {', '.join(meta.columns)}); "
            "a Hugging Face metadata file names each image in file_name (or *_file_name), "
            "relative to its own folder; for another table give --source table"
        )
    extras = tuple((c, _field_prefix(c)) for c in files if c != image)
    prefixes = Counter(p for _, p in extras)
    if any(n > 1 for n in prefixes.values()):
        raise SourceError(f"{meta.name}: columns {[c for c, _ in extras]} name one field twice")
    objects = (
        "objects" if any(isinstance(v, (dict, list)) for v in _values(meta, "objects")) else None
    )
    caption = _caption_column(meta)
    label = _label_column(meta, label_col, objects)
    used = {image, caption, label, objects, *(c for c, _ in extras)}
    return Roles(image, extras, caption, label, objects, tuple(sorted(set(meta.columns) - used)))


def resolve_path(folder: str, value: Any) -> str | None:
    """The root-relative path a cell names; None when it leaves the metadata file's folder."""
    if not isinstance(value, str) or not value:
        return None
    text = value.replace("\\", "/")
    if text.startswith("/") or re.match(r"[A-Za-z]:", text):
        return None
    norm = posixpath.normpath(text)
    if norm in (".", "..") or norm.startswith("../"):
        return None
    return posixpath.join(folder, norm) if folder else norm
