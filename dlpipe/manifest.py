"""The manifest, ``dlpipe.json``: what a prepared dataset holds.

Written last and atomically, so a folder without one is an unfinished conversion. Schema
version 1 (all keys required unless marked optional)::

    {
      "schema": "dlpipe.manifest", "schema_version": 1,
      "dlpipe_version": "0.1.0",
      "format": "wds" | "lmdb" | "hdf5", "format_version": 1,
      "fields": {"jpg": "image", "cls": "int"},          # field name -> codec type
      "classes": ["circle", "ring"],                      # label index -> name (may be [])
      "splits": {
        "train": {
          "samples": 900, "bytes": 4518912,
          "class_counts": [450, 450],                     # optional: per label, when "cls" exists
          "fields": {"jpg": "image"},                     # optional: this split's own fields,
                                                          # when they differ (a test split
                                                          # without labels); else "fields"
          "shards": [{"name": "train-000000.tar", "samples": 900,
                      "bytes": 4518912, "sha256": "…64 hex…"}]
        }
      },
      "options": {...},                                   # conversion options, free-form JSON
      "source": {...},                                    # where the samples came from
      "task": "detection",                                # optional: what the dataset is for
      "field_schemas": {"boxes.json": {"kind": "boxes", ...}},  # optional: annotations' kinds
      "class_ids": [1, 2, 3, 5],                          # optional: the dataset's own class ids
      "version": 2, "versions": [...]                     # optional: from the first append on
    }

The optional keys are written only when a source knows them (`dlpipe.annotations`); ``version``
and ``versions`` (what each ``dlpipe convert --append`` added, `dlpipe.manifest_versions`) only
once a dataset has more than one version: a manifest without them is version 1.

It never holds host names, and a dataset of one version no timestamp: the same input and options
give the same bytes (each appended version records its date).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dlpipe import storage
from dlpipe._version import __version__
from dlpipe.annotations import TASKS, check_field_schemas
from dlpipe.dataset_names import MANIFEST_NAME, PROFILES_NAME, SHARD_SUFFIXES, check_format
from dlpipe.errors import DlpipeError, ManifestError, ManifestNotFoundError
from dlpipe.manifest_versions import VersionInfo, VersionSplit, parse_versions, versions_json
from dlpipe.sample import check_field_name
from dlpipe.unfinished import missing_message

__all__ = [
    "MANIFEST_NAME",
    "MAX_BASE_VALUES",
    "MAX_JSON_DEPTH",
    "MAX_MANIFEST_BYTES",
    "PROFILES_NAME",
    "SCHEMA_VERSION",
    "VALUES_PER_SHARD",
    "DatasetVersionError",
    "Manifest",
    "ShardInfo",
    "SplitInfo",
    "VersionInfo",
    "VersionSplit",
    "is_later_version",
    "parse_manifest",
    "read_manifest",
    "read_manifest_bytes",
    "write_manifest",
]

SCHEMA_NAME = "dlpipe.manifest"
SCHEMA_VERSION = 1
MAX_MANIFEST_BYTES = 256 << 20  # a manifest of 10,000 shards is about 2 MB
MAX_JSON_DEPTH = 32  # dlpipe writes 5 levels; options and source are small free-form objects
# A JSON value costs Python 8 to 64 bytes however few bytes it takes in the file ("1," is two):
# 10**8 integers in 200 MB parsed into 8 GB. Before parsing, the values a manifest may hold are
# bounded by its shards: a shard entry is 5 (counted as below), each with a "sha256" of 64 hex
# digits, and any manifest may hold MAX_BASE_VALUES more (class names and per-split class
# counts: a million classes on three splits). The parse then needs at most a few hundred MB
# plus a small multiple of the file (each shard's room costs the file a digest's bytes).
MAX_BASE_VALUES = 1 << 22
VALUES_PER_SHARD = 8
_SHARD_DIGEST_RE = re.compile(rb'"sha256"\s*:\s*"[0-9a-f]{64}"')
_INT64_MAX = 2**63 - 1
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_SHARD_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
_SPLIT_NAME_RE = re.compile(r"[A-Za-z0-9_]{1,100}")


class DatasetVersionError(DlpipeError, ValueError):
    """A dataset version that the dataset does not have was asked for."""


@dataclass(frozen=True)
class ShardInfo:
    """One shard file: its name in the dataset folder, sample count, size and checksum."""

    name: str
    samples: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class SplitInfo:
    """One split: its shards in order, and per-label sample counts when there is a label."""

    shards: tuple[ShardInfo, ...]
    class_counts: tuple[int, ...] | None = None
    fields: dict[str, str] | None = None
    """This split's fields when they differ from the dataset's (an unlabelled split has no
    ``cls``); None: the dataset's `Manifest.fields`."""

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.shards)


@dataclass(frozen=True)
class Manifest:
    """The parsed ``dlpipe.json`` of one prepared dataset."""

    format: str
    format_version: int
    fields: dict[str, str]
    splits: dict[str, SplitInfo]
    classes: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    dlpipe_version: str = __version__
    task: str | None = None
    """What the dataset is for (`dlpipe.annotations.TASKS`); None when not known."""
    field_schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Annotation field → its kind and conventions (`dlpipe.annotations`)."""
    class_ids: tuple[int | str, ...] | None = None
    """The dataset's own id of each class (COCO's category ids), beside the index."""
    version: int = 1
    """The dataset's version: 1, plus one for each ``dlpipe convert --append``."""
    versions: tuple[VersionInfo, ...] = ()
    """What each version added (`dlpipe.manifest_versions`); () for a dataset of one version."""
    version_sha256: str | None = None
    """Not in the file: set by `at_version` on a view of an earlier version, the sha256 of
    that version's own ``dlpipe.json`` (what a loader state saved on it names)."""

    def split(self, name: str) -> SplitInfo:
        """The split called `name`, or a `KeyError` that lists the splits there are."""
        if name not in self.splits:
            raise KeyError(f"no split {name!r} in this dataset; splits: {sorted(self.splits)}")
        return self.splits[name]

    def fields_of(self, split: str) -> dict[str, str]:
        """The fields of split `split`'s samples: its own, else the dataset's."""
        own = self.split(split).fields
        return dict(self.fields if own is None else own)

    def version_records(self) -> tuple[VersionInfo, ...]:
        """What each version added; for a dataset of one version, its one record."""
        if self.versions:
            return self.versions
        splits = {
            name: VersionSplit(tuple(s.name for s in info.shards), info.samples)
            for name, info in self.splits.items()
        }
        return (VersionInfo(1, splits),)

    def version_of(self, manifest_sha256: str) -> int | None:
        """The earlier version whose ``dlpipe.json`` had this sha256, when this one knows it."""
        for record in self.versions[1:]:
            if record.appended_to == manifest_sha256:
                return record.version - 1
        return None

    def at_version(self, version: int) -> Manifest:
        """The dataset as it was at `version`: each split's shards of versions 1..`version`
        (a split that version did not have yet is left out), with that version's records;
        class counts are known for the latest version only. Class names are kept (an append
        only adds names at the end, so every label keeps its index).

        Raises:
            DatasetVersionError: this dataset has no such version.
        """
        if isinstance(version, bool) or not isinstance(version, int):
            raise DatasetVersionError(f"dataset_version={version!r} is not an integer")
        if not 1 <= version <= self.version:
            raise DatasetVersionError(
                f"dataset_version={version} is not a version of this dataset (it has versions "
                f"1..{self.version}); pass one of those, or None for the latest"
            )
        if version == self.version:
            return self
        kept = self.version_records()[:version]
        splits = {}
        for name, info in self.splits.items():
            count = sum(len(v.splits[name].shards) for v in kept if name in v.splits)
            if count:
                splits[name] = SplitInfo(shards=info.shards[:count], fields=info.fields)
        return replace(
            self,
            splits=splits,
            version=version,
            versions=kept if version > 1 else (),
            version_sha256=self.versions[version].appended_to,
        )

    def to_json(self) -> dict[str, Any]:
        splits = {}
        for name, split in self.splits.items():
            entry: dict[str, Any] = {"samples": split.samples, "bytes": split.bytes}
            if split.class_counts is not None:
                entry["class_counts"] = list(split.class_counts)
            if split.fields is not None:
                entry["fields"] = dict(split.fields)
            entry["shards"] = [asdict(s) for s in split.shards]
            splits[name] = entry
        data: dict[str, Any] = {
            "schema": SCHEMA_NAME,
            "schema_version": SCHEMA_VERSION,
            "dlpipe_version": self.dlpipe_version,
            "format": self.format,
            "format_version": self.format_version,
            "fields": dict(self.fields),
            "classes": list(self.classes),
            "splits": splits,
            "options": self.options,
            "source": self.source,
        }
        if self.task is not None:
            data["task"] = self.task
        if self.field_schemas:
            data["field_schemas"] = dict(self.field_schemas)
        if self.class_ids is not None:
            data["class_ids"] = list(self.class_ids)
        data.update(versions_json(self.version, self.versions))
        return data


def write_manifest(folder: str, manifest: Manifest) -> Manifest:
    """Write ``dlpipe.json`` into `folder` atomically (temp name, fsync, rename).

    The bytes are first parsed as `read_manifest` parses them, so nothing a reader would refuse
    is written, and what a reader will get is returned; the file is never read back.

    Raises:
        ManifestError: `manifest` breaks the schema (nothing is written then).
    """
    path = storage.join(folder, MANIFEST_NAME)
    data = (json.dumps(manifest.to_json(), indent=2, sort_keys=False) + "\n").encode("utf-8")
    try:
        written = parse_manifest(data, path)
    except ManifestError as exc:
        raise ManifestError(
            f"{str(exc).removesuffix(_READER_FIX)}; it was not written: give the writer only "
            "what a manifest may hold (class names are strings, numbers are finite)"
        ) from None
    storage.sync_dir(folder)  # every shard's rename is durable before the manifest names it
    storage.atomic_write_bytes(path, data)
    return written


def read_manifest(folder: str) -> Manifest:
    """Read and validate the manifest of the dataset in `folder` (local path or fsspec URL).

    Raises:
        ManifestNotFoundError: no ``dlpipe.json`` there.
        ManifestError: it is larger than `MAX_MANIFEST_BYTES`, not UTF-8, not valid JSON,
            nested deeper than `MAX_JSON_DEPTH`, not schema version 1, or breaks the schema.
    """
    return parse_manifest(read_manifest_bytes(folder), storage.join(folder, MANIFEST_NAME))


def is_later_version(raw: bytes, manifest_sha256: str) -> bool:
    """Whether the manifest bytes `raw` are a later version of the dataset whose manifest had
    `manifest_sha256` (an append rewrites no shard of the versions before it); False for
    bytes that do not parse."""
    try:
        return parse_manifest(raw, MANIFEST_NAME).version_of(manifest_sha256) is not None
    except ManifestError:
        return False


def read_manifest_bytes(folder: str) -> bytes:
    """The bytes of `folder`'s ``dlpipe.json``: a regular file of at most `MAX_MANIFEST_BYTES`.

    Raises:
        ManifestNotFoundError: no ``dlpipe.json`` there.
        ManifestError: it is not a regular file, or larger than the cap (refused unread).
    """
    path = storage.join(folder, MANIFEST_NAME)
    try:
        if storage.size(path) > MAX_MANIFEST_BYTES:
            raise _too_large(path)
        if storage.is_url(path):
            with storage.open_read(path) as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)
        else:
            raw = _read_regular_file(storage.local_path(path))
    except FileNotFoundError:
        raise ManifestNotFoundError(missing_message(folder)) from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise _too_large(path)
    return raw


def parse_manifest(raw: bytes, path: str) -> Manifest:
    """Validate the bytes of a manifest file; `path` names it in the error."""
    data = _load_json(raw, path)
    try:
        _require(isinstance(data, dict), "the top level is not a JSON object")
        _check_depth(data)
        manifest = _parse(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise _refused(path, f" is not a valid dlpipe manifest: {_describe(exc)}") from exc
    try:
        check_format(manifest.format, manifest.format_version)
    except ManifestError as exc:
        raise ManifestError(f"{path}: {exc}") from None
    suffix = SHARD_SUFFIXES[manifest.format]
    for split, info in manifest.splits.items():
        for shard in info.shards:
            if not shard.name.endswith(suffix):
                what = f"is not a {manifest.format} shard name (ending in {suffix})"
                raise _refused(path, f": shard {shard.name!r} of split {split!r} {what}")
    return manifest


def _read_regular_file(path: str) -> bytes:
    try:
        f = storage.open_regular(path)  # a FIFO named dlpipe.json must not hang the open
    except storage.NotRegularFileError:
        raise _refused(path, " is not a regular file (a FIFO, device or folder)") from None
    with f:
        return f.read(MAX_MANIFEST_BYTES + 1)


_READER_FIX = "; re-run the conversion (dlpipe convert ... --overwrite) or restore the file"


def _refused(path: str, what: str) -> ManifestError:
    return ManifestError(f"{path}{what}{_READER_FIX}")


def _too_large(path: str) -> ManifestError:
    size = f"larger than {MAX_MANIFEST_BYTES >> 20} MiB, the most a manifest may be"
    return _refused(path, f" is {size} (one of 10,000 shards is about 2 MB)")


def _check_value_count(raw: bytes, path: str) -> None:
    """Refuse, unparsed, more JSON values than a manifest of its shards can hold.

    Values are counted from above by their separators (every comma, bracket and brace, those in
    strings too); shards from above by their ``"sha256": "<64 hex digits>"`` pairs, so the room
    a shard buys costs the file a digest's bytes."""
    values = raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1
    shards = sum(1 for _ in _SHARD_DIGEST_RE.finditer(raw))
    most = MAX_BASE_VALUES + VALUES_PER_SHARD * shards
    if values > most:
        raise _refused(
            path,
            f" holds about {values:,} JSON values (commas and brackets), more than a manifest of "
            f"{shards:,} shards can ({most:,}: {MAX_BASE_VALUES:,} plus {VALUES_PER_SHARD} a "
            "shard); it was not parsed",
        )


def _load_json(raw: bytes, path: str) -> Any:
    _check_value_count(raw, path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = f"byte 0x{raw[exc.start]:02x} at offset {exc.start}"
        raise _refused(path, f" is not UTF-8 ({where})") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise _refused(path, f" is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        raise _refused(path, f" is not valid JSON ({exc})") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) != len(pairs):
        counts = Counter(k for k, _ in pairs)
        duplicate = next(k for k, n in counts.items() if n > 1)
        raise ValueError(f"key {duplicate!r} appears twice in one object")
    return data


def _check_depth(data: Any) -> None:
    """Refuse JSON nested deeper than `MAX_JSON_DEPTH` (printing or dumping it would recurse)."""
    level: list[Any] = [data]  # the containers at one depth: scalars cost no memory here
    for _ in range(MAX_JSON_DEPTH):
        below: list[Any] = []
        for value in level:
            items = value.values() if isinstance(value, dict) else value
            below.extend(v for v in items if isinstance(v, (dict, list)))
        if not below:
            return
        level = below
    _require(False, f"it is nested deeper than {MAX_JSON_DEPTH} levels")


def _describe(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"missing key {exc.args[0]!r}"
    return str(exc)


def _parse(data: dict[str, Any]) -> Manifest:
    _require(data["schema"] == SCHEMA_NAME, f"'schema' is {data['schema']!r}, not {SCHEMA_NAME!r}")
    version = data["schema_version"]
    _require(
        version == SCHEMA_VERSION and not isinstance(version, bool),
        f"schema_version {version!r} is not {SCHEMA_VERSION} (upgrade dlpipe to read it)",
    )
    fields = _fields(data["fields"], "fields")
    classes = data["classes"]
    _require(isinstance(classes, list), "'classes' is not a list")
    _require(all(isinstance(c, str) for c in classes), "'classes' holds a non-string")
    splits = data["splits"]
    _require(isinstance(splits, dict) and len(splits) > 0, "'splits' is not a non-empty object")
    parsed = {_split_name(k): _parse_split(k, v, len(classes)) for k, v in splits.items()}
    names = Counter(s.name for split in parsed.values() for s in split.shards)
    twice = sorted(n for n, count in names.items() if count > 1)
    _require(not twice, f"shard {twice[0]!r} is listed twice" if twice else "")
    listed = {k: [(s.name, s.samples) for s in v.shards] for k, v in parsed.items()}
    version, versions = parse_versions(data, listed)
    return Manifest(
        format=_string(data["format"], "format"),
        format_version=_count(data["format_version"], "format_version"),
        fields=fields,
        splits=parsed,
        classes=tuple(classes),
        options=_object(data["options"], "options"),
        source=_object(data["source"], "source"),
        dlpipe_version=_string(data["dlpipe_version"], "dlpipe_version"),
        task=_task(data.get("task")),
        field_schemas=check_field_schemas(data.get("field_schemas", {}), fields),
        class_ids=_class_ids(data.get("class_ids"), len(classes)),
        version=version,
        versions=versions,
    )


def _task(task: Any) -> str | None:
    _require(task is None or task in TASKS, f"task {task!r} is not one of {', '.join(TASKS)}")
    return None if task is None else str(task)


def _class_ids(ids: Any, num_classes: int) -> tuple[int | str, ...] | None:
    if ids is None:
        return None
    _require(
        isinstance(ids, list) and len(ids) == num_classes,
        f"'class_ids' is not a list of {num_classes} ids, one per class",
    )
    _require(
        all(isinstance(i, (int, str)) and not isinstance(i, bool) for i in ids),
        "'class_ids' holds an id that is not an integer or a string",
    )
    _require(len(set(ids)) == len(ids), "'class_ids' names one id twice")
    return tuple(ids)


def _fields(fields: Any, what: str) -> dict[str, str]:
    _require(isinstance(fields, dict) and len(fields) > 0, f"'{what}' is not a non-empty object")
    return {_field_name(k): _string(v, f"{what}.{k}") for k, v in fields.items()}


def _split_name(name: str) -> str:
    _require(
        bool(_SPLIT_NAME_RE.fullmatch(name)),
        f"split name {name!r} is not 1-100 letters, digits and _",
    )
    return name


def _field_name(name: str) -> str:
    try:
        return check_field_name(name)
    except ValueError as exc:
        raise ValueError(str(exc).split(":")[0]) from None


def _parse_split(name: str, data: Any, num_classes: int) -> SplitInfo:
    _require(isinstance(data, dict), f"split {name!r} is not an object")
    _require(isinstance(data["shards"], list), f"split {name!r}: 'shards' is not a list")
    shards = tuple(_parse_shard(name, s) for s in data["shards"])
    _require(len(shards) > 0, f"split {name!r} has no shards")
    own = _fields(data["fields"], f"splits.{name}.fields") if "fields" in data else None
    split = SplitInfo(
        shards=shards, class_counts=_class_counts(name, data, num_classes), fields=own
    )
    for key, total in (("samples", split.samples), ("bytes", split.bytes)):
        _require(total <= _INT64_MAX, f"split {name!r} holds more than 2**63-1 {key}")
        _require(
            data[key] == total and not isinstance(data[key], bool),
            f"split {name!r} says {data[key]!r} {key} but its shards hold {total}",
        )
    total = sum(split.class_counts or ())
    _require(
        split.class_counts is None or total == split.samples,
        f"split {name!r}: class_counts add up to {total}, not its {split.samples} samples",
    )
    return split


def _class_counts(split: str, data: dict[str, Any], num_classes: int) -> tuple[int, ...] | None:
    counts = data.get("class_counts")
    if counts is None:
        return None
    what = f"splits.{split}.class_counts"
    _require(isinstance(counts, list), f"{what} is not a list")
    _require(
        len(counts) == num_classes,
        f"{what} has {len(counts)} entries but there are {num_classes} classes",
    )
    return tuple(_count(c, what) for c in counts)


def _parse_shard(split: str, data: Any) -> ShardInfo:
    _require(isinstance(data, dict), f"a shard of split {split!r} is not an object")
    name = data["name"]
    _require(
        isinstance(name, str) and bool(_SHARD_NAME_RE.fullmatch(name)) and ".." not in name,
        f"shard name {name!r} is not a plain file name (letters, digits, _ - . and no "
        "leading dot, no '..', no folder)",
    )
    digest = _string(data["sha256"], f"{name}.sha256")
    _require(bool(_SHA256_RE.fullmatch(digest)), f"{name}: sha256 {digest!r} is not 64 hex digits")
    return ShardInfo(
        name=name,
        samples=_count(data["samples"], f"{name}.samples"),
        bytes=_count(data["bytes"], f"{name}.bytes"),
        sha256=digest,
    )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _string(value: Any, what: str) -> str:
    _require(isinstance(value, str) and value != "", f"{what} {value!r} is not a non-empty string")
    return str(value)


def _count(value: Any, what: str) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _INT64_MAX
    _require(ok, f"{what} {value!r} is not a non-negative integer (at most 2**63-1)")
    return int(value)


def _object(value: Any, what: str) -> dict[str, Any]:
    _require(isinstance(value, dict), f"{what} is not a JSON object")
    return dict(value)
