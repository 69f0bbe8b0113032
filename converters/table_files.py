"""One table file of the ``table`` source: reading it, and what it holds.

`scan_file` gathers one file's rows (splits, raw labels, ids, image facts) for the scan (which
files are tables, their splits and the role of each column: `dlpipe.converters.table_names`);
`read_row` reads one row lazily, keeping the last 8 text tables or Parquet row groups per
process. The layout, split and column rules are stated in `dlpipe.converters.table`.

Table files are opened only as regular files inside the raw folder (`open_regular`: a FIFO or
``/dev/zero`` named ``data.csv`` is refused, never read); a table-named entry that is not one
is a `SourceError` naming it, not a silently missing table. A JSON lines table nested deeper
than `MAX_JSON_DEPTH` (which Arrow's reader would recurse into until the process crashes) or
with a line over 1 MiB (which Arrow reads in one block), and a text column that is not UTF-8,
are `SourceError`s naming the file and the line or column; an image path that can name
no file (`path_problem`) is a skipped sample.
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from dlpipe.converters.source import (
    SPLIT_NAMES,
    SampleError,
    SourceError,
    SourceOptions,
    display_path,
    image_kind_of_bytes,
    image_kind_of_name,
    open_regular,
    raw_folder_of,
)
from dlpipe.converters.table_names import (
    TABLE_SUFFIXES,
    TEXT_AS_STRING,
    Columns,
    find_columns,
    is_bytes,
    is_image_struct,
    split_of_name,
    string_columns,
)
from dlpipe.converters.table_paths import (
    MAX_JSON_DEPTH,
    PROBE_ROWS,
    PathResolver,
    make_resolver,
    path_problem,
    resolve_image_root,
)
from dlpipe.storage import is_inside

__all__ = [
    "MAX_JSON_DEPTH",
    "FileScan",
    "read_row",
    "scan_file",
]

_JSON_STRING = re.compile(rb'"(?:[^"\\\n]|\\.)*"')  # a JSON string on one line
_JSON_BLOCK_BYTES = 1 << 20  # what Arrow's JSON reader parses at once: a line's longest


def _open_table(path: str, folder: str) -> Any:
    """The table file opened as a regular file inside `folder`; SourceError otherwise."""
    try:
        return open_regular(path, folder)
    except SampleError as exc:
        raise SourceError(f"{exc}; the table cannot be read") from exc


def _read_table(
    path: str, folder: str, columns: Sequence[str] | None = None, strings: tuple[str, ...] = ()
) -> pa.Table:
    """A table file (only `columns` of a Parquet file); SourceError when unparseable.

    Args:
        path: the table file.
        folder: the real raw folder the file must lie in.
        columns: the Parquet columns to read (all when None); text tables are read whole.
        strings: CSV/TSV columns to read as text, besides the usual id and path names.
    """
    with _open_table(path, folder) as f:
        return _parse_table(f, path, columns, strings)


def _parse_table(
    f: Any, path: str, columns: Sequence[str] | None, strings: tuple[str, ...]
) -> pa.Table:
    fmt = TABLE_SUFFIXES[os.path.splitext(path)[1].lower()]
    if os.fstat(f.fileno()).st_size == 0:
        raise SourceError(
            f"{display_path(path)}: the table file is empty; remove it or give it a header and rows"
        )
    try:
        if fmt == "parquet":
            return pq.read_table(f, columns=list(columns) if columns else None)
        if fmt == "jsonl":
            _check_json_lines(f, path)
            return pa_json.read_json(f, pa_json.ReadOptions(block_size=_JSON_BLOCK_BYTES))
        return pa_csv.read_csv(
            f,
            parse_options=pa_csv.ParseOptions(delimiter="\t" if fmt == "tsv" else ","),
            convert_options=pa_csv.ConvertOptions(
                column_types=dict.fromkeys(TEXT_AS_STRING + strings, pa.string()),
                strings_can_be_null=True,
            ),
        )
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(
            f"{display_path(path)}: cannot be read as {fmt} ({exc}); fix the file or remove it"
        ) from exc


def _check_json_lines(f: Any, path: str) -> None:
    """SourceError when a line of the JSON lines file `f` is longer than Arrow reads (a block)
    or nests deeper than `MAX_JSON_DEPTH`; read a block at a time, `f` is left at its start."""
    number, pending = 1, b""
    while True:
        block = f.read(_JSON_BLOCK_BYTES)
        data = pending + block
        cut = data.rfind(b"\n") + 1 if block else len(data)
        if len(data) - cut > _JSON_BLOCK_BYTES:
            long_line = number + data.count(b"\n", 0, cut)
            raise SourceError(
                f"{display_path(path)} line {long_line}: longer than "
                f"{_JSON_BLOCK_BYTES >> 20} MiB; a JSON lines table holds one row per line "
                "(store large values, such as images, in files it names)"
            )
        lines, pending = data[:cut], data[cut:]
        deep = _deep_line(lines)
        if deep is not None:
            raise SourceError(
                f"{display_path(path)} line {number + deep}: JSON nested deeper than "
                f"{MAX_JSON_DEPTH} levels of arrays and objects; fix or remove the line"
            )
        number += lines.count(b"\n")
        if not block:
            break
    f.seek(0)


def _deep_line(lines: bytes) -> int | None:
    """The index of the first of `lines` nested deeper than `MAX_JSON_DEPTH`, or None."""
    text = np.frombuffer(_JSON_STRING.sub(b'""', lines), np.uint8)  # brackets outside strings
    if not text.size:
        return None
    opens = (text == ord("[")) | (text == ord("{"))
    step = opens.astype(np.int32) - ((text == ord("]")) | (text == ord("}")))
    depth = np.cumsum(step, dtype=np.int32)
    newline = text == ord("\n")
    line = np.cumsum(newline)  # the line each byte is on (a newline opens the next)
    start_depth = np.concatenate(([0], depth[newline]))  # each line counts from its own start
    over = np.flatnonzero(depth - start_depth[line] > MAX_JSON_DEPTH)
    return int(line[over[0]]) if over.size else None


def _is_parquet(path: str) -> bool:
    return path.lower().endswith(".parquet")


def _parquet_schema(path: str, folder: str) -> pa.Schema:
    try:
        with _open_table(path, folder) as f:
            return pq.read_schema(f)
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(f"{path}: cannot be read as parquet ({exc}); fix or remove it") from exc


def _stamp(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=64)
def _group_starts(path: str, folder: str, stamp: tuple[int, int]) -> tuple[int, ...]:
    """First row of each Parquet row group, plus the row count (cached per process)."""
    with _open_table(path, folder) as f:
        meta = pq.ParquetFile(f).metadata
    starts = [0]
    for i in range(meta.num_row_groups):
        starts.append(starts[-1] + meta.row_group(i).num_rows)
    return tuple(starts)


@functools.lru_cache(maxsize=8)
def _cached_part(
    path: str, folder: str, stamp: tuple[int, int], group: int, strings: tuple[str, ...]
) -> pa.Table:
    """A text table (group -1) or one Parquet row group, cached per process."""
    if group < 0:
        return _read_table(path, folder, strings=strings)
    with _open_table(path, folder) as f:
        return pq.ParquetFile(f).read_row_group(group)


def read_row(
    path: str, row: int, strings: tuple[str, ...], folder: str
) -> tuple[dict[str, Any], pa.Schema]:
    """One row as Python values, and its table's schema, read lazily and cached.

    Args:
        path: the table file.
        row: the row number in the file.
        strings: CSV/TSV columns to read as text (`string_columns`).
        folder: the real raw folder the table must lie in.
    """
    stamp = _stamp(path)
    if _is_parquet(path):
        starts = _group_starts(path, folder, stamp)
        if not 0 <= row < starts[-1]:
            raise IndexError(f"row {row} is past the table's {starts[-1]} rows")
        group = bisect.bisect_right(starts, row) - 1
        part, row = _cached_part(path, folder, stamp, group, ()), row - starts[group]
    else:
        part = _cached_part(path, folder, stamp, -1, strings)
    if not 0 <= row < part.num_rows:
        raise IndexError(f"row {row} is past the table's {part.num_rows} rows")
    return part.slice(row, 1).to_pylist()[0], part.schema


@dataclass
class FileScan:
    """What one table file contributes to the scan, before labels become class indices."""

    path: str
    name: str  # as shown in errors: relative to the root folder
    columns: Columns
    class_names: tuple[str, ...] | None = None  # from Hugging Face ClassLabel metadata
    splits: list[str | None] = field(default_factory=list)
    labels: list[Any] = field(default_factory=list)
    ids: list[Any] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    kinds: list[str | None] = field(default_factory=list)
    images: list[str | None] = field(default_factory=list)  # the image path, for origins
    resolved: list[str | None] = field(default_factory=list)  # the file to read, by path rule
    missing: list[int] = field(default_factory=list)  # rows whose image path names no file
    searched: tuple[str, ...] = ()  # the folders image paths are looked up in
    image_root: str | None = None  # the image root chosen from the first rows, if any


def _hf_class_names(schema: pa.Schema, label: str | None) -> tuple[str, ...] | None:
    """The names of a Hugging Face ``ClassLabel`` feature in Parquet schema metadata."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw or not label:
        return None
    try:
        feature = json.loads(raw)["info"]["features"][label]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    if isinstance(feature, dict) and feature.get("_type") == "ClassLabel":
        return tuple(str(n) for n in feature.get("names") or ()) or None
    return None


def _check_text(table: pa.Table, name: str) -> None:
    """SourceError naming the column when a text column holds bytes that are not UTF-8 (Arrow's
    Parquet and JSON readers pass them on; its CSV reader refuses them itself)."""
    for column in table.column_names:
        try:
            table.column(column).validate(full=True)
        except pa.ArrowInvalid as exc:
            raise SourceError(
                f"{name}: column {column!r} holds text that is not UTF-8 ({exc}); write it "
                "again as UTF-8 (or pick other columns with --image-col/--label-col/--key-col)"
            ) from None


def _row_splits(table: pa.Table, cols: Columns, scan: FileScan) -> list[str | None]:
    if cols.split is None:
        return [split_of_name(scan.path)] * table.num_rows
    out: list[str | None] = []
    for row, value in enumerate(table.column(cols.split).to_pylist()):
        text = str(value).strip().lower() if value is not None else ""
        if text and text not in SPLIT_NAMES:
            raise SourceError(
                f"{scan.name} row {row}: split {value!r} is not train, val, validation or "
                f"test; fix the value, or rename the {cols.split!r} column to keep it as data"
            )
        out.append(SPLIT_NAMES.get(text))
    return out


def _image_arrays(chunk: pa.Array, cols: Columns, name: str) -> tuple[pa.Array, pa.Array]:
    """The image column as (encoded bytes, paths), each null where the other one holds it."""
    if is_image_struct(chunk.type):
        return pc.struct_field(chunk, "bytes"), pc.struct_field(chunk, "path")
    if is_bytes(chunk.type):
        return chunk, pa.nulls(len(chunk), pa.string())
    if pa.types.is_string(chunk.type) or pa.types.is_large_string(chunk.type):
        return pa.nulls(len(chunk), pa.binary()), chunk
    raise SourceError(
        f"{name}: image column {cols.image!r} is {chunk.type}; it must hold paths, encoded "
        "image bytes or {bytes, path} structs (choose another with --image-col)"
    )


def _path_size(path: str, folders: tuple[str, ...]) -> int:
    """A listed image's size on disk; 0 when missing, not a regular file, or plainly outside
    the raw folder, as given or as its real path (`read_file` checks links out of it when
    the image is read)."""
    shown = os.path.abspath(path)
    if not path or not any(is_inside(shown, folder) for folder in folders):
        return 0
    try:
        info = os.stat(path)
    except (OSError, ValueError):  # ValueError: a NUL byte
        return 0
    return info.st_size if stat.S_ISREG(info.st_mode) else 0


def _path_values(column: pa.ChunkedArray, cols: Columns, name: str) -> list[str | None]:
    """The image column's paths (None where a row embeds bytes), for choosing an image root."""
    values: list[str | None] = []
    for chunk in column.chunks:
        data, paths = _image_arrays(chunk, cols, name)
        heads = pc.binary_slice(data, 0, 1).to_pylist()
        values += [
            None if h is not None else p for h, p in zip(heads, paths.to_pylist(), strict=True)
        ]
    return values


def _add_image_facts(
    scan: FileScan, column: pa.ChunkedArray, folders: tuple[str, ...], resolver: PathResolver
) -> None:
    """Per row: estimated size, image kind, the image path and the file it names (None for
    embedded bytes), and the rows whose path names no file."""
    for chunk in column.chunks:  # chunk by chunk: no copy of a whole column of images
        data, paths = _image_arrays(chunk, scan.columns, scan.name)
        heads = pc.binary_slice(data, 0, 12).to_pylist()
        lengths = pc.binary_length(data).to_pylist()
        for head, length, path in zip(heads, lengths, paths.to_pylist(), strict=True):
            if head is not None:
                scan.sizes.append(length)
                scan.kinds.append(image_kind_of_bytes(head))
                scan.images.append(None)
                scan.resolved.append(None)
                continue
            if path and path_problem(path):  # named by the sample's error at load
                full, found = "", False
            else:
                full, found = resolver.resolve(path) if path else ("", True)
            if not found:
                scan.missing.append(len(scan.resolved))
            scan.resolved.append(full or None)
            scan.sizes.append(_path_size(full, folders))
            scan.kinds.append(image_kind_of_name(path) if path else None)
            scan.images.append(path)


def scan_file(path: str, root: str, options: SourceOptions) -> FileScan:
    """One table file's rows: splits, raw labels, ids and image facts.

    Args:
        path: the table file.
        root: the source's root, that names in errors are relative to.
        options: the user's ``--image-col``/``--label-col``.
    """
    name = os.path.relpath(path, root) if path != root else os.path.basename(path)
    folder = raw_folder_of(root)
    if _is_parquet(path):
        schema = _parquet_schema(path, folder)
        cols = find_columns(schema, options, name)
        wanted = [c for c in (cols.image, cols.label, cols.split, cols.key) if c]
        table = _read_table(path, folder, wanted)
    else:
        table = _read_table(path, folder, strings=string_columns(options))
        schema = table.schema
        cols = find_columns(schema, options, name)
    _check_text(table, name)
    if table.num_rows == 0:
        raise SourceError(f"{name}: the table has no rows; add rows or remove the file")
    scan = FileScan(path, name, cols, class_names=_hf_class_names(schema, cols.label))
    scan.splits = _row_splits(table, cols, scan)
    scan.labels = table.column(cols.label).to_pylist() if cols.label else [None] * table.num_rows
    scan.ids = table.column(cols.key).to_pylist() if cols.key else []
    given = os.path.abspath(root if os.path.isdir(root) else os.path.dirname(root))
    image_root = (
        resolve_image_root(options.image_root, given, folder) if options.image_root else None
    )
    column = table.column(cols.image)
    probe = _path_values(column.slice(0, PROBE_ROWS * 5), cols, name)
    resolver, scan.image_root = make_resolver(path, probe, image_root, folder)
    scan.searched = resolver.folders
    _add_image_facts(scan, column, (given, folder), resolver)
    return scan
