"""``hf``: a Hugging Face ``datasets`` image folder with metadata files, as ImageFolder reads it.

Layout (huggingface.co/docs/datasets/image_dataset, and ``folder_based_builder.py``): images
beside a ``metadata.jsonl``, ``metadata.csv`` or ``metadata.parquet`` at the top, in split
folders (``train/``, ``val/``, ``validation/``, ``test/``, also under ``data/``), or deeper.
Each row names its image in ``file_name`` relative to the metadata file's folder
(``images/1.jpg``); another ``*_file_name`` column names a further image of the sample
(``conditioning_image_file_name``). Detected when such a file at the top, in ``data/`` or in a
split folder has a ``file_name`` or ``*_file_name`` column (or cannot be parsed: the scan
names the line). The split is the first folder of a metadata file's path (after ``data/``)
that names one; without one every sample is ``train`` (``--val-fraction`` may carve a val).

Produces one sample per row, every column kept:

- the image (``file_name``; ``image_file_name`` when there is no ``file_name``; or
  ``--image-col``); each other ``X_file_name`` column → field ``x.<jpg|png|webp>``, stored as is;
- a string column ``text``/``caption``/``captions`` → ``txt`` (task ``captioning``);
- ``label`` (or ``--label-col``): integers (named by a Parquet's ``ClassLabel`` feature, else
  ``"0"``...) or names (sorted) → ``cls`` (task ``classification``); -1 or empty = no label,
  a split whose rows all have none has no ``cls``; without a label column, no caption and no
  objects, the folder names of the images when every image lies in a sub-folder at the same
  depth and there are several (ImageFolder's rule; it adds them beside metadata only with
  ``drop_labels=False``; ``--label-col none`` leaves them out);
- ``objects`` (``{"bbox": [[x, y, w, h], ...], "categories": [...]}``, or ``category``, or a
  list of such objects) → ``boxes.json`` (task ``detection``): boxes in COCO's
  ``[x_min, y_min, width, height]`` pixels, as HF's object-detection docs write them; labels =
  category index (names from a ``ClassLabel`` feature, else the integers, or the sorted
  names); ``id`` and ``iscrowd`` kept; a ``label`` column then goes to ``json``;
- every other column → ``json`` (sorted keys, JSON-safe values as the ``table`` source writes).

The key is the image's path in its split folder without suffix, escaped (``images%2F1``); a
file named by several rows gets ``#1``, ``#2``... ``--key-col`` names a column whose values are
the keys instead, as the table source reads one (escaped, shortened when too long; an empty
value or a key twice in a split stops the scan naming the row). ``--image-root`` is refused:
``file_name`` is relative to its metadata file's folder, as Hugging Face resolves it (the
``table`` source looks paths up in an image root). A row whose file is missing, outside its
metadata's folder (``../x.jpg``, an absolute path), or whose box or label is malformed, is a
skipped sample; when most of a metadata file's first rows name no file the scan stops naming
the file, a row and where it looked. Images no row names are not read (ImageFolder leaves them
out too): counted in ``unused`` (as images; every other file no row names as other) and warned
about. Files are read by the raw-folder rule of `dlpipe.converters.source`. Reading the
metadata files and the columns' roles: `dlpipe.converters.hf_metadata`; labels, objects, keys
and fields of a row: `dlpipe.converters.hf_rows`.
"""

from __future__ import annotations

import os
import posixpath
from typing import Any, NamedTuple

from dlpipe.annotations import BOXES_SCHEMA, CAPTION_SCHEMA
from dlpipe.converters.hf_metadata import (
    FILE_SUFFIX,
    METADATA_NAMES,
    MetadataFile,
    Roles,
    find_roles,
    names_files,
    read_metadata,
    resolve_path,
)
from dlpipe.converters.hf_rows import (
    Row,
    assign_labels,
    column_keys,
    first_with,
    object_extras,
    parse_objects,
    path_keys,
    row_fields,
)
from dlpipe.converters.listed import count_unused
from dlpipe.converters.raw_tree import Listings, RawEntry, RawTree, relative_path
from dlpipe.converters.source import (
    IMAGE_SUFFIXES,
    SPLIT_NAMES,
    Item,
    SampleError,
    Scan,
    Source,
    SourceError,
    display_path,
    image_kind_of_bytes,
    image_kind_of_name,
    log,
    read_file,
)

__all__ = ["BBOX_FORMAT", "HfFolderSource"]

BBOX_FORMAT = "COCO [x_min, y_min, width, height], pixels"
_CHECK_ROWS, _EARLY_ROWS = 100, 20


class _Ref(NamedTuple):
    """What `load` needs: the files to read and the fields made at the scan (or the problem)."""

    image: str
    extras: tuple[tuple[str, str], ...]  # (field, path)
    fields: tuple[tuple[str, bytes], ...]
    problem: str | None


class HfFolderSource(Source):
    """Hugging Face ImageFolder with metadata files (see the module docstring)."""

    kind = "hf"
    options_read = frozenset({"label_col", "key_col", "image_root"})  # image_root: refused

    @classmethod
    def detect(cls, root: str, listings: Listings | None = None) -> bool:
        """True when the top, ``data/`` or a split folder holds a metadata file naming files."""
        if not os.path.isdir(root):
            return False
        try:
            tree = RawTree(root, listings)
            found = _top_metadata(tree, root)
        except SourceError:
            return False
        return any(names_files(e.path, tree.folder) for e in found)

    def scan(self) -> Scan:
        if self.options.image_root:
            raise SourceError(
                f"--image-root {display_path(self.options.image_root)!r}: a Hugging Face "
                "image folder names each image in file_name relative to its metadata file's "
                "folder, so the hf source has no image root; drop --image-root (or read the "
                "metadata as a table, whose paths are looked up there: --source table)"
            )
        tree = RawTree(self.root, self.take_listings())
        files: dict[str, RawEntry] = {}
        metas: list[str] = []
        for entry in tree.files(self.root):
            if entry.name in METADATA_NAMES:
                metas.append(entry.path)
            else:
                files[relative_path(entry.path, self.root)] = entry
        return _Scanner(self, tree, files, metas).scan()

    def load(self, item: Item) -> dict[str, bytes]:
        """The image, further images, and the fields the scan made; SampleError for a bad row."""
        ref: _Ref = item.ref
        if ref.problem:
            raise SampleError(f"{item.origin}: {ref.problem}")
        fields = {"image": read_file(ref.image, self.raw_folder)}
        for name, path in ref.extras:
            data = read_file(path, self.raw_folder)
            kind = image_kind_of_bytes(data)
            if kind != name.rpartition(".")[2]:
                raise SampleError(
                    f"{item.origin}: {display_path(path)} is a {kind} image, the other images of "
                    f"field {name!r} are {name.rpartition('.')[2]}; convert it"
                )
            fields[name] = data
        fields.update(ref.fields)
        return fields


def _top_metadata(tree: RawTree, root: str) -> list[RawEntry]:
    """The metadata files at the top, in ``data/`` and in split folders (of either)."""
    found = []
    tops = [root]
    for top in tops:
        for entry in tree.listing(top):
            if not entry.is_dir and entry.name in METADATA_NAMES:
                found.append(entry)
            elif entry.is_dir and top == root and entry.name == "data":
                tops.append(entry.path)
            elif entry.is_dir and entry.name.lower() in SPLIT_NAMES:
                found += [e for e in tree.listing(entry.path) if e.name in METADATA_NAMES]
    return [e for e in found if not e.is_dir]


class _Scanner:
    """The scan of one HF folder: metadata rows → items (split out of the source for size)."""

    def __init__(
        self, source: HfFolderSource, tree: RawTree, files: dict[str, RawEntry], metas: list[str]
    ) -> None:
        self.source, self.tree, self.files = source, tree, files
        self.root = source.root
        self.metas = sorted(metas)
        self.used: set[str] = set()

    def scan(self) -> Scan:
        metas = self._read_all()
        rows = [row for meta, roles in metas for row in self._rows(meta, roles)]
        classes, how = assign_labels(rows, metas, self.source.options.label_col, self.root)
        items = self._items(rows, how)
        task, schema = _task(metas, how)
        return Scan(
            classes=classes,
            items=tuple(items),
            description=self._description(metas, how),
            task=task,
            field_schemas=schema,
        )

    def _read_all(self) -> list[tuple[MetadataFile, Roles]]:
        if not self.metas:
            raise SourceError(
                f"{display_path(self.root)}: no metadata.jsonl, metadata.csv or metadata.parquet"
            )
        suffixes = {os.path.splitext(m)[1] for m in self.metas}
        if len(suffixes) > 1:
            raise SourceError(
                f"{display_path(self.root)}: metadata files of several kinds "
                f"({', '.join(sorted(suffixes))}); Hugging Face reads one kind: keep one"
            )
        options = self.source.options
        metas = [read_metadata(p, self.root, self.tree.folder) for p in self.metas]
        for meta in metas:
            if options.key_col and options.key_col not in meta.columns:
                raise SourceError(
                    f"{meta.name}: --key-col {options.key_col!r} is not a column; the columns "
                    f"are {', '.join(meta.columns)}"
                )
        out = [(m, find_roles(m, options.image_col, options.label_col)) for m in metas]
        self._check_splits(out)
        return out

    def _check_splits(self, metas: list[tuple[MetadataFile, Roles]]) -> None:
        unnamed = [m.name for m, _ in metas if m.split is None]
        if unnamed and len(unnamed) < len(metas):
            raise SourceError(
                f"{unnamed[0]}: names no split (train/, val/, validation/, test/) beside metadata "
                "files that do; move it into a split folder or remove it"
            )
        first: dict[str | None, tuple[MetadataFile, Roles]] = {}
        for meta, roles in metas:
            other, theirs = first.setdefault(meta.split, (meta, roles))
            if _shape(roles) != _shape(theirs):
                raise SourceError(
                    f"{meta.name} and {other.name} have different columns ({_describe(roles)} vs "
                    f"{_describe(theirs)}); the metadata files of a split need the same columns"
                )

    def _rows(self, meta: MetadataFile, roles: Roles) -> list[Row]:
        rows = [Row(meta, i, roles) for i in range(len(meta.rows))]
        for row in rows:
            row.image = self._file(row, roles.image, main=True)
            for column, prefix in roles.extras:
                entry = self._file(row, column)
                if entry is not None:
                    row.extras.append((prefix, entry))
            if roles.label:
                row.label = row.values.get(roles.label)
            if roles.objects:
                try:
                    row.objects = parse_objects(row.values.get(roles.objects))
                except ValueError as exc:
                    row.fail(str(exc))
        self._check_found(meta, rows)
        return rows

    def _file(self, row: Row, column: str, main: bool = False) -> RawEntry | None:
        value = row.values.get(column)
        rel = resolve_path(row.meta.folder, value)
        if rel is None:
            row.fail(_bad_path(column, value, row.meta.folder))
            return None
        entry = self.files.get(rel)
        if entry is None:
            path = os.path.join(self.root, rel)
            why = self.tree.skipped.get(display_path(path), "no such file")
            row.fail(f"{column} {value!r}: {display_path(path)}: {why}")
            row.missing = row.missing or (main and why == "no such file")
            return None
        self.used.add(rel)
        if main:
            row.image_rel = rel
        return entry

    def _check_found(self, meta: MetadataFile, rows: list[Row]) -> None:
        """SourceError when more than half of the first 100 rows (or all of the first 20) name
        no file: the paths point elsewhere, and every sample would be skipped."""
        checked = rows[:_CHECK_ROWS]
        missing = [r for r in checked if r.missing]
        early = rows[:_EARLY_ROWS]
        if not (
            len(missing) * 2 > len(checked)
            or (len(early) == _EARLY_ROWS and all(r.missing for r in early))
        ):
            return
        first = missing[0]
        value = first.values.get(first.roles.image)
        folder = display_path(os.path.join(self.root, meta.folder))
        raise SourceError(
            f"{meta.name}: {len(missing)} of its first {len(checked)} rows name no file "
            f"({first.origin}: {value!r}, looked for {os.path.join(folder, str(value))}); "
            f"file_name is relative to the metadata file's folder {folder}: fix the paths or "
            "move the metadata file beside the images"
        )

    def _items(self, rows: list[Row], how: str | None) -> list[Item]:
        kinds = self._extra_kinds(rows)
        with_json = {r.meta.split for r in rows if r.roles.json or object_extras(r)}
        key_col = self.source.options.key_col
        keys = column_keys(rows, key_col) if key_col else path_keys(rows)
        items = []
        for row, (key, original) in zip(rows, keys, strict=True):
            fields = row_fields(row, row.meta.split in with_json) if row.problem is None else {}
            items.append(self._item(row, key, original, fields, kinds, how))
        return items

    def _extra_kinds(self, rows: list[Row]) -> dict[str, str]:
        """Field prefix → the image kind its column's first file has (jpg/png/webp)."""
        kinds: dict[str, str] = {}
        for row in rows:
            for prefix, entry in row.extras:
                kind = kinds.setdefault(prefix, image_kind_of_name(entry.name) or "other")
                if kind not in ("jpg", "png", "webp"):
                    raise SourceError(
                        f"{row.origin}: {display_path(entry.path)} is no jpg, png or webp image; "
                        f"images of further columns ({prefix}{FILE_SUFFIX}) are stored as they are"
                    )
        return kinds

    def _item(
        self,
        row: Row,
        key: str,
        original: str | None,
        fields: dict[str, bytes],
        kinds: dict[str, str],
        how: str | None,
    ) -> Item:
        extras = tuple((f"{p}.{kinds[p]}", e.path) for p, e in row.extras)
        image = row.image.path if row.image else ""
        value = row.values.get(row.roles.image)
        size = sum(e.size for _, e in row.extras) + sum(len(v) for v in fields.values())
        return Item(
            key=key,
            label=row.label if how in ("column", "folders") else None,
            split=row.meta.split,
            ref=_Ref(image, extras, tuple(sorted(fields.items())), row.problem),
            size=size + (row.image.size if row.image else 0),
            image_kind=image_kind_of_name(str(value)) if value else None,
            origin=f"{row.origin} ({value})" if value else row.origin,
            original=original,
        )

    def _description(
        self, metas: list[tuple[MetadataFile, Roles]], how: str | None
    ) -> dict[str, Any]:
        unread = self.files.keys() - self.used
        unused = sorted(r for r in unread if posixpath.splitext(r)[1].lower() in IMAGE_SUFFIXES)
        if unused:
            log.warning(
                "%s: %d image files are named by no metadata row and are not read (%s); "
                "Hugging Face's ImageFolder leaves them out too: add rows for them to use them",
                display_path(self.root),
                len(unused),
                ", ".join(display_path(u) for u in unused[:3])
                + (", ..." if len(unused) > 3 else ""),
            )
        where = sorted({m.folder or "." for m, _ in metas})
        return {
            "kind": HfFolderSource.kind,
            "root": display_path(self.root),
            "layout": (
                f"{', '.join(sorted({os.path.basename(m.path) for m, _ in metas}))} in "
                f"{', '.join(display_path(w) for w in where)} names each image in file_name: "
                "a Hugging Face ImageFolder with metadata"
            ),
            "metadata": [m.name for m, _ in metas],
            "columns": {m.name: _columns(r) for m, r in metas},
            "labels": how,
            "bbox_format": BBOX_FORMAT if how == "objects" else None,
            "unused": count_unused(unread),
            "unused_examples": [display_path(u) for u in unused[:20]],
            **self.tree.report(),
        }


def _bad_path(column: str, value: Any, folder: str) -> str:
    if value is None or value == "":
        return f"{column} is empty; fill it or drop the row"
    if not isinstance(value, str):
        return f"{column} {value!r} is not a file name"
    return (
        f"{column} {value!r} leads outside the metadata file's folder "
        f"{display_path(folder or '.')}; Hugging Face file names are relative paths inside "
        "it, and dlpipe reads nothing else"
    )


def _shape(roles: Roles) -> tuple[Any, ...]:
    """What fields a metadata file's samples get (files of one split must agree)."""
    return (
        tuple(p for _, p in roles.extras),
        roles.caption is not None,
        roles.label is not None,
        roles.objects is not None,
    )


def _columns(roles: Roles) -> dict[str, Any]:
    """The roles of a metadata file's columns, for the scan description."""
    return {
        "image": roles.image,
        "images": {column: prefix for column, prefix in roles.extras},
        "caption": roles.caption,
        "label": roles.label,
        "objects": roles.objects,
        "json": list(roles.json),
    }


def _describe(roles: Roles) -> str:
    parts = [f"image {roles.image!r}"]
    parts += [f"{name} {getattr(roles, name)!r}" for name in ("caption", "label", "objects")]
    return ", ".join([*parts, f"others {', '.join(roles.json) or 'none'}"])


def _task(
    metas: list[tuple[MetadataFile, Roles]], how: str | None
) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """The task (detection, else classification, else captioning) and the fields' schemas."""
    schema: dict[str, dict[str, Any]] = {}
    if first_with(metas, "caption"):
        schema["txt"] = CAPTION_SCHEMA
    if how == "objects":
        schema["boxes.json"] = BOXES_SCHEMA
        return "detection", schema
    if how:
        return "classification", schema
    return ("captioning" if schema else None), schema
