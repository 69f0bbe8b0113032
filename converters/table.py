"""``table``: one row per sample in CSV, TSV, JSONL or Parquet tables (Hugging Face exports too).

Layout: ``root`` is one table file (``.csv``, ``.tsv``, ``.jsonl``/``.ndjson``, ``.parquet``),
or a folder of table files, directly or under ``data/`` (as Hugging Face exports have). A folder
is detected when it holds nothing else (besides hidden, ``README*`` and ``LICENSE*`` files), or
when its top holds exactly one table whose header has an image column (or an ``id`` column) and
a label column (``labels.csv`` beside ``images/``, Kaggle's ``train.csv`` beside ``train/``),
whatever else sits beside it; with ``--source table``, other entries may sit beside any tables.

Splits: a file whose stem is or starts with ``train``, ``val``, ``validation`` or ``test`` and a
non-alphanumeric character (``train.csv``, ``data/train-00000-of-00002.parquet``) gives that
split (``validation`` is named ``val``); the files of one split are read in sorted name order.
Tables without a split name give split None (``--val-fraction`` decides), unless they have a
``split`` column of ``train``/``val``/``validation``/``test`` (empty: None). A folder may not mix
named and unnamed tables, and every table must have the same columns.

Columns (names guessed case-insensitively, or given with ``--image-col``/``--label-col``):

- image (``image``, ``img``, ``image_path``, ``path``, ``file``, ``filename``, ``filepath``,
  ``file_name``; else the one binary or image-struct column; else ``id``, which is then the key
  too): a path looked up in the table's folder, then in the image root (the rule of
  `dlpipe.converters.table_paths`: ``--image-root``, or the one sub-folder holding the files;
  a path without suffix names the one image file with that stem), or absolute; encoded image
  bytes; or the Hugging Face Image struct ``{bytes, path}`` (bytes when not null, else the
  path).
- label (``label``, ``labels``, ``class``, ``category``, ``target``, ``y``, ``class_name``):
  integers, named by the Hugging Face ``ClassLabel`` in the Parquet schema metadata when there
  is one, else ``"0"`` … ``str(max)``; or strings, whose sorted unique values are the classes.
  ``--label-col none``: no label column (samples without ``cls``, no classes). Tables whose
  labels are all -1 (how Hugging Face ships an unlabelled ``test`` split) give samples without
  ``cls`` and no classes too. Such a split beside labelled ones (a named split whose labels
  are all -1 or empty, or whose table has no label column, as Kaggle's ``test.csv``) gives
  samples without ``cls``: its manifest entry lists its own fields. Any other negative label
  is an error.
- key (``__key__``, ``key``, ``id``, or the column ``--key-col`` names, e.g. Kaggle's
  ``image_id``): when present, each row's key is its value escaped by the
  key rule (an id too long for a key is shortened by `dlpipe.sample.make_key`, the full id kept
  as the item's ``original``), and duplicates are an error; otherwise ``{split}_{row:08d}``
  (``row_…`` for split None), the row number counted in its split.

Produces one sample per row: the image under ``"image"``, ``cls`` from the label, and every
other column (the key column too; not a recognised ``split`` column) as ``json``: one compact
UTF-8 object with sorted keys. Values become JSON as follows: dates and times → ISO 8601
strings, durations → seconds, decimals → strings (exact), bytes → base64 strings, NaN and
infinities → null, lists/structs/maps → arrays/objects. Rows are numbered from 0 in their file
(``train.csv row 0`` is the first line after the header); empty CSV cells are null.

When more than half of a table's first 100 image paths (or all of its first 20) name no file,
the scan stops with one error naming a missing path, the folders searched and ``--image-root``,
instead of skipping every sample; fewer missing files are skipped samples.

Image paths are read only when they resolve (``..``, absolute paths and links included) inside
the raw folder: the folder given, or the table file's folder when one table file is given.
Any other path (``/etc/passwd``, ``../../secret.jpg``, a link out) is a skipped sample naming
the path and this rule; put the table in a folder above its images to use them.

Reading: `scan` reads each table once (of a Parquet file only the image, label, split and key
columns) and no image file; `load` reads its row's whole text table or Parquet row group and
keeps the last 8 of them per process (shards mix rows of every file of a split).
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import decimal
import json
import math
import os
from collections import Counter
from typing import Any

import pyarrow as pa

from dlpipe.converters.column_keys import UniqueKeys, column_key
from dlpipe.converters.raw_tree import Listings, RawTree
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
)
from dlpipe.converters.table_files import FileScan, read_row, scan_file
from dlpipe.converters.table_names import (
    ID_AS_IMAGE,
    IMAGE_NAMES,
    LABEL_NAMES,
    TABLE_SUFFIXES,
    Columns,
    find_columns,
    find_tables,
    folder_tables,
    is_table,
    split_of_name,
    string_columns,
)
from dlpipe.converters.table_paths import label_table, path_problem, shown_cell

__all__ = ["TABLE_SUFFIXES", "TableSource", "jsonable", "split_of_name"]


def _label_kind(scan: FileScan, bare: frozenset[str | None]) -> str | None:
    """``int`` or ``str``: what the label column holds (None: no labels, an unlabelled
    split's); SourceError on nulls among labels or other types."""
    kinds = set()
    for row, value in enumerate(scan.labels):
        if value is None and scan.splits[row] in bare:
            continue
        if value is None:
            raise SourceError(
                f"{scan.name} row {row}: the label column {scan.columns.label!r} is empty; "
                "every row needs a label (fill it in, or pick another column with --label-col)"
            )
        if isinstance(value, float) and value.is_integer():
            scan.labels[row] = value = int(value)
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise SourceError(
                f"{scan.name} row {row}: label {value!r} is a {type(value).__name__}; labels "
                "must be integers or strings (pick another column with --label-col)"
            )
        kinds.add("int" if isinstance(value, int) else "str")
    if len(kinds) > 1:
        raise SourceError(f"{scan.name}: the labels mix integers and strings; use one kind")
    return kinds.pop() if kinds else None


def _classes(scans: list[FileScan]) -> tuple[str, ...]:
    """Class names, after turning every file's labels into class indices in place (None for
    the rows of an unlabelled split)."""
    if all(s.columns.label is None for s in scans):
        return ()
    bare = _unlabelled_splits(scans)
    for s in scans:
        s.labels = [
            None if split in bare else v for split, v in zip(s.splits, s.labels, strict=True)
        ]
    kinds = {_label_kind(s, bare) for s in scans} - {None}
    if not kinds:
        return ()
    if kinds == {"str"}:
        classes = tuple(sorted({v for s in scans for v in s.labels if v is not None}))
        index = {name: i for i, name in enumerate(classes)}
        for s in scans:
            s.labels = [None if v is None else index[v] for v in s.labels]
        return classes
    if len(kinds) > 1:
        raise SourceError(
            f"{scans[0].name} and others: labels are integers in some tables and strings in "
            "others; use one kind"
        )
    names = next((s.class_names for s in scans if s.class_names), None)
    for s in scans:
        for row, value in enumerate(s.labels):
            if value is not None and (value < 0 or (names is not None and value >= len(names))):
                limit = f"0..{len(names) - 1} (the ClassLabel names)" if names else ">= 0"
                raise SourceError(
                    f"{s.name} row {row}: label {value} is outside {limit}; fix the label or "
                    "drop the row"
                )
    top = max(v for s in scans for v in s.labels if v is not None)
    return names or tuple(str(i) for i in range(top + 1))


def _unlabelled_splits(scans: list[FileScan]) -> frozenset[str | None]:
    """The splits without labels: every label -1 (how Hugging Face ships a test split),
    empty, or no label column (Kaggle's test.csv). Beside labelled splits only named splits
    count (a -1 among the rows that ``--val-fraction`` splits is an error)."""
    labels: dict[str | None, set[Any]] = {}
    for s in scans:
        for split, value in zip(s.splits, s.labels, strict=True):
            labels.setdefault(split, set()).add(value)
    bare = frozenset(split for split, values in labels.items() if values <= {UNLABELLED, None})
    if bare != set(labels) and None in labels:
        return frozenset()
    return bare


def _label_columns(scans: list[FileScan]) -> Columns:
    """The columns of a labelled table (an unlabelled split's table may lack the label)."""
    return next((s.columns for s in scans if s.columns.label), scans[0].columns)


UNLABELLED = -1
"""The label Hugging Face gives the rows of a split that has none (``test`` splits)."""
_CHECK_ROWS = 100
_EARLY_ROWS = 20

_Keyed = tuple[str, str | None]  # (key, the full id when the key was shortened)


def _id_keys(scans: list[FileScan]) -> list[list[_Keyed]]:
    """Each row's key from its id column; SourceError on empty or duplicate ids."""
    out: list[list[_Keyed]] = []
    seen = UniqueKeys()
    for s in scans:
        keys: list[_Keyed] = []
        column = str(s.columns.key)
        for row, value in enumerate(s.ids):
            where = f"{s.name} row {row}"
            made = column_key(value, where, column)
            seen.add(split_of_name(s.path), made, where, column)
            keys.append((made.key, made.original))
        out.append(keys)
    return out


def _row_keys(scans: list[FileScan]) -> list[list[_Keyed]]:
    counts: Counter[str | None] = Counter()
    out = []
    for s in scans:
        keys: list[_Keyed] = []
        for split in s.splits:
            keys.append((f"{split or 'row'}_{counts[split]:08d}", None))
            counts[split] += 1
        out.append(keys)
    return out


def _check_same_columns(scans: list[FileScan]) -> None:
    """Every table gives the same roles to the same columns (each sample has the same fields)."""
    first = _label_columns(scans)
    for s in scans:
        if s.columns != first and dataclasses.replace(s.columns, label=first.label) != first:
            raise SourceError(
                f"{s.name} and {scans[0].name} have different columns ({_roles(s.columns)} vs "
                f"{_roles(first)}); every table of a dataset needs the same columns"
            )


def _check_found(scan: FileScan, image_root: str | None) -> None:
    """SourceError when more than half of the first 100 image paths name no file (or 20 of
    the first 20 do): the paths point elsewhere, and every sample would be skipped."""
    checked = min(len(scan.resolved), _CHECK_ROWS)
    missing = [row for row in scan.missing if row < checked]
    if not missing or not (
        len(missing) * 2 > checked or missing[:_EARLY_ROWS] == list(range(_EARLY_ROWS))
    ):
        return
    row = missing[0]
    value = scan.images[row] or ""
    folders = ", ".join(display_path(f) for f in scan.searched)
    problem = path_problem(value)
    hint = (
        "check --image-root"
        if image_root
        else "give the folder that holds the images with --image-root DIR"
    )
    where = problem or f"looked for it in {folders}, also without its suffix"
    raise SourceError(
        f"{display_path(scan.name)}: {len(missing)} of the first {checked} image paths name no "
        f"file (row {row}: {shown_cell(value)!r}, {where}); {hint}, or fix the paths in column "
        f"{scan.columns.image!r}"
    )


def _roles(cols: Columns) -> str:
    return f"image {cols.image!r}, label {cols.label!r}, others {', '.join(cols.extra)}"


def jsonable(value: Any) -> Any:
    """`value` as plain JSON data, by the rule in the module docstring."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, tuple) and len(v) == 2 for v in value):
            return {str(k): jsonable(v) for k, v in value}  # an Arrow map
        return [jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, decimal.Decimal):
        return str(value)
    return str(value)


class TableSource(Source):
    """Samples from the rows of CSV/TSV/JSONL/Parquet tables (see the module docstring)."""

    kind = "table"
    options_read = frozenset({"image_col", "label_col", "image_root", "key_col"})

    @classmethod
    def detect(cls, root: str, listings: Listings | None = None) -> bool:
        """True for a table file, a folder of nothing but table files (or ``data/`` of them), or
        a folder whose top holds one table with an image and a label column (`label_table`)."""
        if os.path.isfile(root):
            return is_table(root)
        if not os.path.isdir(root):
            return False
        return folder_tables(root, strict=True) is not None or cls.label_table(root) is not None

    @staticmethod
    def label_table(root: str) -> str | None:
        """The one table at `root`'s top with an image and a label column, by their usual names."""
        images = (*IMAGE_NAMES, ID_AS_IMAGE)
        return label_table(root, raw_folder_of(root), tuple(TABLE_SUFFIXES), images, LABEL_NAMES)

    def table_files(self) -> list[str]:
        """The table files, in scan order; SourceError when `root` is no table layout."""
        return find_tables(self.root)

    def string_columns(self) -> tuple[str, ...]:
        """CSV/TSV columns to read as text whatever they look like: the given image column."""
        return string_columns(self.options)

    def scan(self) -> Scan:
        """Every row as an `Item`, without reading image files; SourceError when unusable."""
        scans = [scan_file(path, self.root, self.options) for path in self.table_files()]
        _check_same_columns(scans)
        classes = _classes(scans)
        keyed = _id_keys(scans) if scans[0].columns.key else _row_keys(scans)
        for s in scans:
            _check_found(s, self.options.image_root)
        items = [
            self._item(s, row, key)
            for s, keys in zip(scans, keyed, strict=True)
            for row, key in enumerate(keys)
        ]
        cols = _label_columns(scans)
        description = {
            "kind": self.kind,
            "root": display_path(self.root),
            "tables": [display_path(s.name) for s in scans],
            "image_roots": {
                display_path(s.name): display_path(os.path.relpath(s.image_root, self.root))
                for s in scans
                if s.image_root
            },
            "columns": {
                "image": cols.image,
                "label": cols.label,
                "split": cols.split,
                "key": cols.key,
                "json": sorted(cols.extra),
            },
        }
        unread = self._unread_images(scans)
        if unread:
            description["unused"] = {"images": unread}
        return Scan(classes=classes, items=tuple(items), description=description)

    def _unread_images(self, scans: list[FileScan]) -> int:
        """Image files in the tables' image roots that no row names (Kaggle's unlabelled
        ``test/`` beside a labelled ``train.csv``, or images a table leaves out)."""
        named = {os.path.normpath(p) for s in scans for p in s.resolved if p is not None}
        roots = sorted({s.image_root for s in scans if s.image_root})
        tree = RawTree(self.root)
        return sum(
            1
            for root in roots
            for entry in tree.files(root, keep=True)
            if image_kind_of_name(entry.name) and os.path.normpath(entry.path) not in named
        )

    def _item(self, scan: FileScan, row: int, keyed: _Keyed) -> Item:
        image = scan.images[row]
        origin = f"{display_path(scan.name)} row {row}" + (
            f" ({shown_cell(image)})" if image else ""
        )
        key, original = keyed
        return Item(
            key=key,
            label=scan.labels[row],
            split=scan.splits[row],
            ref=(scan.path, row, scan.resolved[row]),
            size=scan.sizes[row],
            image_kind=scan.kinds[row],
            origin=origin,
            original=original,
        )

    def load(self, item: Item) -> dict[str, bytes]:
        """The row's image bytes under ``"image"`` and its other columns as ``"json"``."""
        path, row, image_path = item.ref
        try:
            values, schema = read_row(path, row, self.string_columns(), self.raw_folder)
            cols = find_columns(schema, self.options, path)
        except (OSError, IndexError, pa.ArrowException, SourceError, UnicodeDecodeError) as exc:
            raise SampleError(
                f"{item.origin}: the row cannot be read from {display_path(path)} ({exc})"
            ) from exc
        fields = {"image": self._image(values[cols.image], image_path, item)}
        if cols.extra:
            extra = {name: jsonable(values[name]) for name in cols.extra}
            text = json.dumps(extra, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            fields["json"] = text.encode("utf-8")
        return fields

    def _image(self, value: Any, path: str | None, item: Item) -> bytes:
        if isinstance(value, dict):
            value = value["bytes"] if value.get("bytes") is not None else value.get("path")
        if isinstance(value, (bytes, bytearray)):
            return bytes(value)
        problem = path_problem(value) if isinstance(value, str) and value else None
        if problem:
            raise SampleError(
                f"{item.origin}: the image path {problem}; fix the path in the table or drop "
                "the row"
            )
        if not value or path is None:
            raise SampleError(f"{item.origin}: the image cell is empty; fill it or drop the row")
        try:
            return read_file(path, self.raw_folder)
        except SampleError as exc:
            raise SampleError(f"{item.origin}: image {exc}") from exc
