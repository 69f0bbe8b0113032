"""``table``: one row per sample in CSV, TSV, JSONL or Parquet tables (Hugging Face exports too).

Layout: ``root`` is one table file (``.csv``, ``.tsv``, ``.jsonl``/``.ndjson``, ``.parquet``),
or a folder of table files, directly or under ``data/`` (as Hugging Face exports have). A folder
is detected when it holds nothing else (besides hidden, ``README*`` and ``LICENSE*`` files);
with ``--source table``, other entries (the folder of images) may sit beside the tables.

Splits: a file whose stem is or starts with ``train``, ``val``, ``validation`` or ``test`` and a
non-alphanumeric character (``train.csv``, ``data/train-00000-of-00002.parquet``) gives that
split (``validation`` is named ``val``); the files of one split are read in sorted name order.
Tables without a split name give split None (``--val-fraction`` decides), unless they have a
``split`` column of ``train``/``val``/``validation``/``test`` (empty: None). A folder may not mix
named and unnamed tables, and every table must have the same columns.

Columns (names guessed case-insensitively, or given with ``--image-col``/``--label-col``):

- image (``image``, ``img``, ``image_path``, ``path``, ``file``, ``filename``, ``filepath``,
  ``file_name``; else the one binary or image-struct column): a path relative to the table's
  folder (or absolute), encoded image bytes, or the Hugging Face Image struct ``{bytes, path}``
  (bytes when not null, else the path).
- label (``label``, ``labels``, ``class``, ``category``, ``target``, ``y``, ``class_name``):
  integers, named by the Hugging Face ``ClassLabel`` in the Parquet schema metadata when there
  is one, else ``"0"`` … ``str(max)``; or strings, whose sorted unique values are the classes.
- key (``__key__``, ``key``, ``id``): when present, each row's key is its value escaped by the
  key rule, and duplicates are an error; otherwise ``{split}_{row:08d}`` (``row_…`` for split
  None), the row number counted in its split.

Produces one sample per row: the image under ``"image"``, ``cls`` from the label, and every
other column (the key column too; not a recognised ``split`` column) as ``json``: one compact
UTF-8 object with sorted keys. Values become JSON as follows: dates and times → ISO 8601
strings, durations → seconds, decimals → strings (exact), bytes → base64 strings, NaN and
infinities → null, lists/structs/maps → arrays/objects. Rows are numbered from 0 in their file
(``train.csv row 0`` is the first line after the header); empty CSV cells are null.

Reading: `scan` reads each table once (of a Parquet file only the image, label, split and key
columns) and no image file; `load` reads its row's whole text table or Parquet row group and
keeps the last 8 of them per process (shards mix rows of every file of a split).
"""

from __future__ import annotations

import base64
import bisect
import datetime
import decimal
import functools
import json
import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from dlpipe.converters.source import (
    Item,
    SampleError,
    Scan,
    Source,
    SourceError,
    image_kind_of_bytes,
    image_kind_of_name,
    read_file,
)
from dlpipe.errors import InvalidKeyError
from dlpipe.sample import escape_key

__all__ = ["TABLE_SUFFIXES", "TableSource", "split_of_name"]

TABLE_SUFFIXES = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
}
_SPLIT_PREFIXES = (("validation", "val"), ("train", "train"), ("val", "val"), ("test", "test"))
_SPLIT_VALUES = {"train": "train", "val": "val", "validation": "val", "test": "test"}
_IMAGE_NAMES = ("image", "img", "image_path", "path", "file", "filename", "filepath", "file_name")
_LABEL_NAMES = ("label", "labels", "class", "category", "target", "y", "class_name")
_KEY_NAMES = ("__key__", "key", "id")
_SPLIT_COL = "split"
_DOC_PREFIXES = ("readme", "license")
_TEXT_AS_STRING = _KEY_NAMES + _IMAGE_NAMES  # CSV columns never inferred as numbers ("001")


def split_of_name(filename: str) -> str | None:
    """The split a table file's name gives (``train-00000-of-00002.parquet`` → ``train``)."""
    stem = os.path.splitext(os.path.basename(filename))[0].lower()
    for prefix, split in _SPLIT_PREFIXES:
        if stem == prefix or (stem.startswith(prefix) and not stem[len(prefix)].isalnum()):
            return split
    return None


def _is_table(path: str) -> bool:
    return os.path.isfile(path) and os.path.splitext(path)[1].lower() in TABLE_SUFFIXES


def _visible(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if not n.startswith("."))


def _folder_tables(root: str, strict: bool) -> list[str] | None:
    """The table files of `root` and of ``root/data/``, sorted.

    Args:
        root: the folder.
        strict: return None when `root` holds anything but tables (and docs): detection.
            Otherwise other entries (an image folder beside the tables) are ignored.
    """
    found = []
    for name in _visible(root):
        path = os.path.join(root, name)
        inner = [os.path.join(path, n) for n in _visible(path)] if name == "data" else []
        if _is_table(path):
            found.append(path)
        elif inner and all(_is_table(p) for p in inner):
            found += inner
        elif strict and not (os.path.isfile(path) and name.lower().startswith(_DOC_PREFIXES)):
            return None
    return sorted(found) or None


def _read_table(
    path: str, columns: Sequence[str] | None = None, strings: tuple[str, ...] = ()
) -> pa.Table:
    """A table file (only `columns` of a Parquet file); SourceError when unparseable.

    Args:
        path: the table file.
        columns: the Parquet columns to read (all when None); text tables are read whole.
        strings: CSV/TSV columns to read as text, besides the usual id and path names.
    """
    fmt = TABLE_SUFFIXES[os.path.splitext(path)[1].lower()]
    if os.path.getsize(path) == 0:
        raise SourceError(
            f"{path}: the table file is empty; remove it or give it a header and rows"
        )
    try:
        if fmt == "parquet":
            return pq.read_table(path, columns=list(columns) if columns else None)
        if fmt == "jsonl":
            return pa_json.read_json(path)
        return pa_csv.read_csv(
            path,
            parse_options=pa_csv.ParseOptions(delimiter="\t" if fmt == "tsv" else ","),
            convert_options=pa_csv.ConvertOptions(
                column_types=dict.fromkeys(_TEXT_AS_STRING + strings, pa.string()),
                strings_can_be_null=True,
            ),
        )
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(
            f"{path}: cannot be read as {fmt} ({exc}); fix the file or remove it"
        ) from exc


def _is_parquet(path: str) -> bool:
    return path.lower().endswith(".parquet")


def _parquet_schema(path: str) -> pa.Schema:
    try:
        return pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(f"{path}: cannot be read as parquet ({exc}); fix or remove it") from exc


def _stamp(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=64)
def _group_starts(path: str, stamp: tuple[int, int]) -> tuple[int, ...]:
    """First row of each Parquet row group, plus the row count (cached per process)."""
    meta = pq.ParquetFile(path).metadata
    starts = [0]
    for i in range(meta.num_row_groups):
        starts.append(starts[-1] + meta.row_group(i).num_rows)
    return tuple(starts)


@functools.lru_cache(maxsize=8)
def _cached_part(
    path: str, stamp: tuple[int, int], group: int, strings: tuple[str, ...]
) -> pa.Table:
    """A text table (group -1) or one Parquet row group, cached per process."""
    if group < 0:
        return _read_table(path, strings=strings)
    return pq.ParquetFile(path).read_row_group(group)


def _row(path: str, row: int, strings: tuple[str, ...]) -> tuple[dict[str, Any], pa.Schema]:
    """One row as Python values, and its table's schema, read lazily and cached."""
    stamp = _stamp(path)
    if _is_parquet(path):
        starts = _group_starts(path, stamp)
        if not 0 <= row < starts[-1]:
            raise IndexError(f"row {row} is past the table's {starts[-1]} rows")
        group = bisect.bisect_right(starts, row) - 1
        part, row = _cached_part(path, stamp, group, ()), row - starts[group]
    else:
        part = _cached_part(path, stamp, -1, strings)
    if not 0 <= row < part.num_rows:
        raise IndexError(f"row {row} is past the table's {part.num_rows} rows")
    return part.slice(row, 1).to_pylist()[0], part.schema


@dataclass(frozen=True)
class _Columns:
    image: str
    label: str | None
    split: str | None
    key: str | None
    extra: tuple[str, ...]


def _is_image_struct(kind: pa.DataType) -> bool:
    """The Hugging Face Image feature: a struct with ``bytes`` and ``path`` fields."""
    if not pa.types.is_struct(kind):
        return False
    return {"bytes", "path"} <= {kind.field(i).name for i in range(kind.num_fields)}


def _is_bytes(kind: pa.DataType) -> bool:
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
    name = _guess(schema.names, _IMAGE_NAMES, set())
    typed = [f.name for f in schema if _is_bytes(f.type) or _is_image_struct(f.type)]
    if name is None and len(typed) == 1:
        name = typed[0]
    if name is None:
        raise SourceError(
            f"{path}: no image column (looked for {', '.join(_IMAGE_NAMES)}); the columns are "
            f"{', '.join(schema.names)}: name the one with image paths or bytes with --image-col"
        )
    return name


def _columns(schema: pa.Schema, source: TableSource, path: str) -> _Columns:
    """Which column is the image, label, split and key; every other column is extra."""
    image = _image_column(schema, source.options.image_col, path)
    if source.options.label_col:
        label: str | None = _given(source.options.label_col, schema, "--label-col", path)
    else:
        label = _guess(schema.names, _LABEL_NAMES, {image})
    split = None
    if split_of_name(path) is None and _SPLIT_COL in schema.names:
        split = _SPLIT_COL if _SPLIT_COL not in (image, label) else None
    key = _guess(schema.names, _KEY_NAMES, {image, label or "", split or ""})
    used = {image, label, split}
    return _Columns(image, label, split, key, tuple(sorted(set(schema.names) - used)))


@dataclass
class _FileScan:
    """What one table file contributes to the scan, before labels become class indices."""

    path: str
    name: str  # as shown in errors: relative to the root folder
    columns: _Columns
    class_names: tuple[str, ...] | None = None  # from Hugging Face ClassLabel metadata
    splits: list[str | None] = field(default_factory=list)
    labels: list[Any] = field(default_factory=list)
    ids: list[Any] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    kinds: list[str | None] = field(default_factory=list)
    images: list[str | None] = field(default_factory=list)  # the image path, for origins


def _hf_class_names(schema: pa.Schema, label: str | None) -> tuple[str, ...] | None:
    """The names of a Hugging Face ``ClassLabel`` feature in Parquet schema metadata."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw or not label:
        return None
    try:
        feature = json.loads(raw)["info"]["features"][label]
    except (ValueError, KeyError, TypeError):
        return None
    if isinstance(feature, dict) and feature.get("_type") == "ClassLabel":
        return tuple(str(n) for n in feature.get("names") or ()) or None
    return None


def _row_splits(table: pa.Table, cols: _Columns, scan: _FileScan) -> list[str | None]:
    if cols.split is None:
        return [split_of_name(scan.path)] * table.num_rows
    out: list[str | None] = []
    for row, value in enumerate(table.column(cols.split).to_pylist()):
        text = str(value).strip().lower() if value is not None else ""
        if text and text not in _SPLIT_VALUES:
            raise SourceError(
                f"{scan.name} row {row}: split {value!r} is not train, val, validation or "
                f"test; fix the value, or rename the {cols.split!r} column to keep it as data"
            )
        out.append(_SPLIT_VALUES.get(text))
    return out


def _image_arrays(chunk: pa.Array, cols: _Columns, name: str) -> tuple[pa.Array, pa.Array]:
    """The image column as (encoded bytes, paths), each null where the other one holds it."""
    if _is_image_struct(chunk.type):
        return pc.struct_field(chunk, "bytes"), pc.struct_field(chunk, "path")
    if _is_bytes(chunk.type):
        return chunk, pa.nulls(len(chunk), pa.string())
    if pa.types.is_string(chunk.type) or pa.types.is_large_string(chunk.type):
        return pa.nulls(len(chunk), pa.binary()), chunk
    raise SourceError(
        f"{name}: image column {cols.image!r} is {chunk.type}; it must hold paths, encoded "
        "image bytes or {bytes, path} structs (choose another with --image-col)"
    )


def _add_image_facts(scan: _FileScan, column: pa.ChunkedArray) -> None:
    """Per row: estimated size, image kind, and the image path (None for embedded bytes)."""
    folder = os.path.dirname(scan.path)
    for chunk in column.chunks:  # chunk by chunk: no copy of a whole column of images
        data, paths = _image_arrays(chunk, scan.columns, scan.name)
        heads = pc.binary_slice(data, 0, 12).to_pylist()
        lengths = pc.binary_length(data).to_pylist()
        for head, length, path in zip(heads, lengths, paths.to_pylist(), strict=True):
            if head is not None:
                scan.sizes.append(length)
                scan.kinds.append(image_kind_of_bytes(head))
                scan.images.append(None)
                continue
            full = os.path.join(folder, path) if path else ""
            scan.sizes.append(os.stat(full).st_size if os.path.isfile(full) else 0)
            scan.kinds.append(image_kind_of_name(path) if path else None)
            scan.images.append(path)


def _scan_file(path: str, source: TableSource) -> _FileScan:
    """One table file's rows: splits, raw labels, ids and image facts."""
    name = os.path.relpath(path, source.root) if path != source.root else os.path.basename(path)
    if _is_parquet(path):
        schema = _parquet_schema(path)
        cols = _columns(schema, source, name)
        table = _read_table(path, [c for c in (cols.image, cols.label, cols.split, cols.key) if c])
    else:
        table = _read_table(path, strings=source.string_columns())
        schema = table.schema
        cols = _columns(schema, source, name)
    if table.num_rows == 0:
        raise SourceError(f"{name}: the table has no rows; add rows or remove the file")
    scan = _FileScan(path, name, cols, class_names=_hf_class_names(schema, cols.label))
    scan.splits = _row_splits(table, cols, scan)
    scan.labels = table.column(cols.label).to_pylist() if cols.label else [None] * table.num_rows
    scan.ids = table.column(cols.key).to_pylist() if cols.key else []
    _add_image_facts(scan, table.column(cols.image))
    return scan


def _label_kind(scan: _FileScan) -> str:
    """``int`` or ``str``: what the label column holds; SourceError on nulls or other types."""
    kinds = set()
    for row, value in enumerate(scan.labels):
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
    return kinds.pop()


def _classes(scans: list[_FileScan]) -> tuple[str, ...]:
    """Class names, after turning every file's labels into class indices in place."""
    if scans[0].columns.label is None:
        return ()
    kinds = {_label_kind(s) for s in scans}
    if kinds == {"str"}:
        classes = tuple(sorted({v for s in scans for v in s.labels}))
        index = {name: i for i, name in enumerate(classes)}
        for s in scans:
            s.labels = [index[v] for v in s.labels]
        return classes
    if len(kinds) > 1:
        raise SourceError(
            f"{scans[0].name} and others: labels are integers in some tables and strings in "
            "others; use one kind"
        )
    names = next((s.class_names for s in scans if s.class_names), None)
    for s in scans:
        for row, value in enumerate(s.labels):
            if value < 0 or (names is not None and value >= len(names)):
                limit = f"0..{len(names) - 1} (the ClassLabel names)" if names else ">= 0"
                raise SourceError(
                    f"{s.name} row {row}: label {value} is outside {limit}; fix the label or "
                    "drop the row"
                )
    top = max(v for s in scans for v in s.labels)
    return names or tuple(str(i) for i in range(top + 1))


def _id_keys(scans: list[_FileScan]) -> list[list[str]]:
    """Each row's key from its id column; SourceError on empty, too long or duplicate ids."""
    out: list[list[str]] = []
    seen: Counter[tuple[str | None, str]] = Counter()
    for s in scans:
        keys = []
        for row, value in enumerate(s.ids):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            try:
                keys.append(escape_key("" if value is None else str(value)))
            except InvalidKeyError as exc:
                raise SourceError(
                    f"{s.name} row {row}: id {value!r} cannot be a key ({exc}); fix it, or "
                    f"rename the {s.columns.key!r} column"
                ) from exc
            seen[(split_of_name(s.path), keys[-1])] += 1
        out.append(keys)
    dupes = sorted(key for (_, key), n in seen.items() if n > 1)
    if dupes:
        raise SourceError(
            f"{scans[0].name}: {len(dupes)} duplicate ids in column {scans[0].columns.key!r} "
            f"({', '.join(dupes[:5])}); ids must be unique: fix them or rename the column"
        )
    return out


def _row_keys(scans: list[_FileScan]) -> list[list[str]]:
    counts: Counter[str | None] = Counter()
    out = []
    for s in scans:
        keys = []
        for split in s.splits:
            keys.append(f"{split or 'row'}_{counts[split]:08d}")
            counts[split] += 1
        out.append(keys)
    return out


def _check_same_columns(scans: list[_FileScan]) -> None:
    """Every table gives the same roles to the same columns (each sample has the same fields)."""
    first = scans[0].columns
    for s in scans[1:]:
        if s.columns != first:
            raise SourceError(
                f"{s.name} and {scans[0].name} have different columns ({_roles(s.columns)} vs "
                f"{_roles(first)}); every table of a dataset needs the same columns"
            )


def _roles(cols: _Columns) -> str:
    return f"image {cols.image!r}, label {cols.label!r}, others {', '.join(cols.extra)}"


def _jsonable(value: Any) -> Any:
    """`value` as plain JSON data, by the rule in the module docstring."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, tuple) and len(v) == 2 for v in value):
            return {str(k): _jsonable(v) for k, v in value}  # an Arrow map
        return [_jsonable(v) for v in value]
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

    @classmethod
    def detect(cls, root: str) -> bool:
        """True for a table file, or a folder of nothing but table files (or ``data/`` of them)."""
        if os.path.isfile(root):
            return _is_table(root)
        return os.path.isdir(root) and _folder_tables(root, strict=True) is not None

    def table_files(self) -> list[str]:
        """The table files, in scan order; SourceError when `root` is no table layout."""
        if os.path.isfile(self.root):
            files = [self.root] if _is_table(self.root) else None
        else:
            files = _folder_tables(self.root, strict=False) if os.path.isdir(self.root) else None
        if not files:
            raise SourceError(
                f"{self.root}: not a table file or a folder of them (suffixes: "
                f"{' '.join(TABLE_SUFFIXES)}); give the table file itself"
            )
        unnamed = [os.path.basename(f) for f in files if split_of_name(f) is None]
        if unnamed and len(unnamed) < len(files):
            raise SourceError(
                f"{self.root}: {', '.join(unnamed)} name no split beside tables that do; rename "
                "them to start with train, val or test, or give one table file as the source"
            )
        return sorted(files, key=lambda f: (split_of_name(f) or "", os.path.basename(f), f))

    def string_columns(self) -> tuple[str, ...]:
        """CSV/TSV columns to read as text whatever they look like: the given image column."""
        return (self.options.image_col,) if self.options.image_col else ()

    def scan(self) -> Scan:
        """Every row as an `Item`, without reading image files; SourceError when unusable."""
        scans = [_scan_file(path, self) for path in self.table_files()]
        _check_same_columns(scans)
        classes = _classes(scans)
        keyed = _id_keys(scans) if scans[0].columns.key else _row_keys(scans)
        items = [
            self._item(s, row, key)
            for s, keys in zip(scans, keyed, strict=True)
            for row, key in enumerate(keys)
        ]
        cols = scans[0].columns
        description = {
            "kind": self.kind,
            "root": self.root,
            "tables": [s.name for s in scans],
            "columns": {
                "image": cols.image,
                "label": cols.label,
                "split": cols.split,
                "key": cols.key,
                "json": sorted(cols.extra),
            },
        }
        return Scan(classes=classes, items=tuple(items), description=description)

    def _item(self, scan: _FileScan, row: int, key: str) -> Item:
        image = scan.images[row]
        origin = f"{scan.name} row {row}" + (f" ({image})" if image else "")
        return Item(
            key=key,
            label=scan.labels[row],
            split=scan.splits[row],
            ref=(scan.path, row),
            size=scan.sizes[row],
            image_kind=scan.kinds[row],
            origin=origin,
        )

    def load(self, item: Item) -> dict[str, bytes]:
        """The row's image bytes under ``"image"`` and its other columns as ``"json"``."""
        path, row = item.ref
        try:
            values, schema = _row(path, row, self.string_columns())
            cols = _columns(schema, self, path)
        except (OSError, IndexError, pa.ArrowException, SourceError) as exc:
            raise SampleError(f"{item.origin}: the row cannot be read from {path} ({exc})") from exc
        fields = {"image": self._image(values[cols.image], os.path.dirname(path), item)}
        if cols.extra:
            extra = {name: _jsonable(values[name]) for name in cols.extra}
            text = json.dumps(extra, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            fields["json"] = text.encode("utf-8")
        return fields

    def _image(self, value: Any, folder: str, item: Item) -> bytes:
        if isinstance(value, dict):
            value = value["bytes"] if value.get("bytes") is not None else value.get("path")
        if isinstance(value, (bytes, bytearray)):
            return bytes(value)
        if not value:
            raise SampleError(f"{item.origin}: the image cell is empty; fill it or drop the row")
        path = os.path.join(folder, str(value))
        try:
            return read_file(path)
        except SampleError as exc:
            raise SampleError(f"{item.origin}: image {exc}") from exc
