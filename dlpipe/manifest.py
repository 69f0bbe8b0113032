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
          "shards": [{"name": "train-000000.tar", "samples": 900,
                      "bytes": 4518912, "sha256": "…64 hex…"}]
        }
      },
      "options": {...},                                   # conversion options, free-form JSON
      "source": {...}                                     # where the samples came from
    }

It never holds timestamps or host names: the same input and options give the same bytes.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from dlpipe import storage
from dlpipe._version import __version__
from dlpipe.errors import ManifestError, ManifestNotFoundError

__all__ = [
    "MANIFEST_NAME",
    "PROFILES_NAME",
    "SCHEMA_VERSION",
    "Manifest",
    "ShardInfo",
    "SplitInfo",
    "read_manifest",
    "write_manifest",
]

MANIFEST_NAME = "dlpipe.json"
PROFILES_NAME = "dlpipe-profiles.json"  # loader settings bench-loader measured on this data
SCHEMA_NAME = "dlpipe.manifest"
SCHEMA_VERSION = 1
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_SHARD_NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")
_SHARD_FILE_RE = re.compile(r"[A-Za-z0-9_]+-\d{6}\.[a-z0-9]+")


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

    def split(self, name: str) -> SplitInfo:
        """The split called `name`, or a `KeyError` that lists the splits there are."""
        if name not in self.splits:
            raise KeyError(f"no split {name!r} in this dataset; splits: {sorted(self.splits)}")
        return self.splits[name]

    def to_json(self) -> dict[str, Any]:
        splits = {}
        for name, split in self.splits.items():
            entry: dict[str, Any] = {"samples": split.samples, "bytes": split.bytes}
            if split.class_counts is not None:
                entry["class_counts"] = list(split.class_counts)
            entry["shards"] = [asdict(s) for s in split.shards]
            splits[name] = entry
        return {
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


def write_manifest(folder: str, manifest: Manifest) -> None:
    """Write ``dlpipe.json`` into `folder` atomically (temp name, fsync, rename)."""
    storage.sync_dir(folder)  # every shard's rename is durable before the manifest names it
    text = json.dumps(manifest.to_json(), indent=2, sort_keys=False) + "\n"
    storage.atomic_write_bytes(storage.join(folder, MANIFEST_NAME), text.encode("utf-8"))


def read_manifest(folder: str) -> Manifest:
    """Read and validate the manifest of the dataset in `folder` (local path or fsspec URL).

    Raises:
        ManifestNotFoundError: no ``dlpipe.json`` there.
        ManifestError: it is not valid JSON, not schema version 1, or breaks the schema.
    """
    path = storage.join(folder, MANIFEST_NAME)
    try:
        raw = storage.read_bytes(path)
    except FileNotFoundError:
        raise ManifestNotFoundError(_missing_message(folder)) from None
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ManifestError(f"{path} is not valid JSON ({exc}); re-run the conversion") from exc
    try:
        manifest = _parse(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(
            f"{path} is not a valid dlpipe manifest: {_describe(exc)}; re-run the conversion "
            "(dlpipe convert ... --overwrite) or restore the file"
        ) from exc
    from dlpipe.formats import get_format  # formats build on this module

    try:
        get_format(manifest.format, manifest.format_version)
    except ManifestError as exc:
        raise ManifestError(f"{path}: {exc}") from None
    return manifest


def _missing_message(folder: str) -> str:
    names = storage.listdir(folder)
    if any(_SHARD_FILE_RE.fullmatch(n) or n.startswith(".dlpipe-") for n in names):
        return (
            f"{folder} has no {MANIFEST_NAME}: it is an unfinished conversion (the manifest is "
            "written last). Finish it with `dlpipe convert RAW --out "
            f"{folder} --resume`, or start again with --overwrite"
        )
    inside = [
        n for n in names if storage.exists(storage.join(storage.join(folder, n), MANIFEST_NAME))
    ]
    hint = f" Datasets inside it: {', '.join(inside)}." if inside else ""
    return (
        f"{folder} is not a dlpipe dataset: no {MANIFEST_NAME} there.{hint} Create one with "
        f"`dlpipe convert RAW --to wds|lmdb|hdf5 --out {folder}`"
    )


def _describe(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"missing key {exc.args[0]!r}"
    return str(exc)


def _parse(data: Any) -> Manifest:
    _require(isinstance(data, dict), "the top level is not a JSON object")
    _require(data["schema"] == SCHEMA_NAME, f"'schema' is {data['schema']!r}, not {SCHEMA_NAME!r}")
    version = data["schema_version"]
    _require(
        version == SCHEMA_VERSION,
        f"schema_version {version!r} is not {SCHEMA_VERSION} (upgrade dlpipe to read it)",
    )
    fields = data["fields"]
    _require(isinstance(fields, dict) and len(fields) > 0, "'fields' is not a non-empty object")
    classes = data["classes"]
    _require(isinstance(classes, list), "'classes' is not a list")
    _require(all(isinstance(c, str) for c in classes), "'classes' holds a non-string")
    splits = data["splits"]
    _require(isinstance(splits, dict) and len(splits) > 0, "'splits' is not a non-empty object")
    return Manifest(
        format=_string(data["format"], "format"),
        format_version=_count(data["format_version"], "format_version"),
        fields={_string(k, "field"): _string(v, f"fields.{k}") for k, v in fields.items()},
        splits={_string(k, "split"): _parse_split(k, v) for k, v in splits.items()},
        classes=tuple(classes),
        options=_object(data["options"], "options"),
        source=_object(data["source"], "source"),
        dlpipe_version=_string(data["dlpipe_version"], "dlpipe_version"),
    )


def _parse_split(name: str, data: Any) -> SplitInfo:
    _require(isinstance(data, dict), f"split {name!r} is not an object")
    shards = tuple(_parse_shard(name, s) for s in data["shards"])
    _require(len(shards) > 0, f"split {name!r} has no shards")
    counts = data.get("class_counts")
    if counts is not None:
        counts = tuple(_count(c, f"splits.{name}.class_counts") for c in counts)
    split = SplitInfo(shards=shards, class_counts=counts)
    _require(
        data["samples"] == split.samples,
        f"split {name!r} says {data['samples']} samples but its shards hold {split.samples}",
    )
    return split


def _parse_shard(split: str, data: Any) -> ShardInfo:
    _require(isinstance(data, dict), f"a shard of split {split!r} is not an object")
    name = _string(data["name"], "shard name")
    _require(
        bool(_SHARD_NAME_RE.fullmatch(name)) and name not in {".", ".."},
        f"shard name {name!r} is not a plain file name",
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
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    _require(ok, f"{what} {value!r} is not a non-negative integer")
    return int(value)


def _object(value: Any, what: str) -> dict[str, Any]:
    _require(isinstance(value, dict), f"{what} is not a JSON object")
    return dict(value)
