"""Streaming dataset writing: shard rotation per split, then the manifest, last.

    with DatasetWriter("out/", "wds", classes=["cat", "dog"]) as writer:
        writer.write("train", {"__key__": "a1", "jpg": jpeg_bytes, "cls": b"0"})

On a clean exit every shard is published and ``dlpipe.json`` written; on an exception no
manifest is written, so the folder reads as unfinished, never as complete.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import numpy as np

from dlpipe import storage
from dlpipe.codecs import field_type
from dlpipe.errors import InvalidFieldError, OutputExistsError
from dlpipe.formats import FORMATS, get_format, require_storage
from dlpipe.formats.base import ShardBuilder, ShardFormat
from dlpipe.manifest import (
    MANIFEST_NAME,
    PROFILES_NAME,
    Manifest,
    ShardInfo,
    SplitInfo,
    write_manifest,
)
from dlpipe.sample import sample_fields

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "DatasetWriter",
    "ShardLimits",
    "SplitWriter",
    "class_counts",
    "prepare_output",
    "remove_staging",
]

DEFAULT_MAX_SHARD_BYTES = 64 << 20
_SPLIT_RE = re.compile(r"[A-Za-z0-9_]+")


@dataclass(frozen=True, kw_only=True)
class ShardLimits:
    """When a shard is full: a payload byte budget and, optionally, a sample count."""

    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    max_shard_samples: int | None = None

    def __post_init__(self) -> None:
        if self.max_shard_bytes <= 0 or (self.max_shard_samples or 1) <= 0:
            raise ValueError(f"shard limits must be positive, got {self}")

    def is_full(self, samples: int, payload_bytes: int, next_bytes: int) -> bool:
        if samples == 0:
            return False
        if self.max_shard_samples is not None and samples >= self.max_shard_samples:
            return True
        return payload_bytes + next_bytes > self.max_shard_bytes


def class_counts(split: str, labels: Sequence[int], num_classes: int) -> tuple[int, ...] | None:
    """Samples per label for a split's manifest entry; None when there are no labels."""
    if not num_classes or not len(labels):
        return None
    array = np.asarray(labels)
    if array.min() < 0 or array.max() >= num_classes:
        raise InvalidFieldError(
            f"split {split!r} has labels {array.min()}..{array.max()} but only "
            f"{num_classes} class names; cls must be in 0..{num_classes - 1}"
        )
    return tuple(int(c) for c in np.bincount(array, minlength=num_classes))


class SplitWriter:
    """Writes one split's samples into shards ``{split}-000000``, ``-000001``, ... in order."""

    def __init__(
        self, fmt: ShardFormat, folder: str, split: str, staging: str, limits: ShardLimits
    ) -> None:
        if not _SPLIT_RE.fullmatch(split):
            raise ValueError(f"split name {split!r} must be letters, digits and _ only")
        self.fmt, self.folder, self.split = fmt, folder, split
        self.staging, self.limits = staging, limits
        self.fields: tuple[str, ...] | None = None
        self.shards: list[ShardInfo] = []
        self.labels: list[int] = []
        self._builder: ShardBuilder | None = None

    def write(self, key: str, values: dict[str, bytes]) -> None:
        if self.fields is None:
            self.fields = tuple(values)
        size = len(key) + sum(len(v) for v in values.values())
        b = self._builder
        if b is not None and self.limits.is_full(b.samples, b.payload_bytes, size):
            self.shards.append(b.finish())
            self._builder = None
        if self._builder is None:
            name = self.fmt.shard_name(self.split, len(self.shards))
            self._builder = ShardBuilder(self.fmt, self.folder, name, self.staging, self.fields)
        self._builder.add(key, values)
        if "cls" in values:
            self.labels.append(int(values["cls"]))

    def close(self, num_classes: int) -> SplitInfo:
        if self._builder is not None:
            self.shards.append(self._builder.finish())
            self._builder = None
        counts = class_counts(self.split, self.labels, num_classes)
        return SplitInfo(shards=tuple(self.shards), class_counts=counts)

    def abort(self) -> None:
        if self._builder is not None:
            self._builder.abort()
            self._builder = None


@dataclass(kw_only=True)
class DatasetWriter:
    """Writes a prepared dataset (any format) split by split, then its manifest.

    Args:
        out: the dataset folder, a local path or an fsspec URL (not for lmdb).
        format: ``wds``, ``lmdb`` or ``hdf5``.
        classes: label index → class name; labels in ``cls`` must index into it.
        options: conversion options to record in the manifest.
        source: where the samples came from, recorded in the manifest.
        limits: when to start a new shard.
        overwrite: replace an existing dataset in `out` instead of refusing.
    """

    out: str
    format: str
    classes: Sequence[str] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    source: Mapping[str, Any] = field(default_factory=dict)
    limits: ShardLimits = field(default_factory=ShardLimits)
    overwrite: bool = False

    def __post_init__(self) -> None:
        self._fmt = get_format(self.format)
        require_storage(self._fmt, self.out)
        prepare_output(self.out, self.overwrite)
        self._cleanup = contextlib.ExitStack()
        near = None if storage.is_url(self.out) else self.out
        self._staging_path = self._cleanup.enter_context(storage.staging_dir(near))
        self._splits: dict[str, SplitWriter] = {}
        self._fields: tuple[str, ...] | None = None

    def write(self, split: str, sample: Mapping[str, Any]) -> None:
        """Add one sample to `split` (splits may interleave)."""
        key, values = sample_fields(sample)
        if self._fields is None:
            self._fields = tuple(values)
        writer = self._splits.get(split)
        if writer is None:
            writer = SplitWriter(self._fmt, self.out, split, self._staging_path, self.limits)
            writer.fields = self._fields
            self._splits[split] = writer
        writer.write(key, values)

    def close(self) -> Manifest:
        """Publish the last shards and write ``dlpipe.json``; returns the manifest."""
        try:
            if not self._splits or self._fields is None:
                raise InvalidFieldError(f"no samples were written to {self.out}; nothing to save")
            splits = {name: w.close(len(self.classes)) for name, w in self._splits.items()}
            manifest = Manifest(
                format=self._fmt.name,
                format_version=self._fmt.version,
                fields={name: field_type(name) for name in self._fields},
                splits=splits,
                classes=tuple(self.classes),
                options=dict(self.options),
                source=dict(self.source),
            )
            write_manifest(self.out, manifest)
            return manifest
        finally:
            self._cleanup.close()

    def abort(self) -> None:
        """Drop unfinished shards; no manifest is written."""
        for writer in self._splits.values():
            writer.abort()
        self._cleanup.close()

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def prepare_output(out: str, overwrite: bool) -> None:
    """Make `out` ready for a new dataset: refuse existing data unless `overwrite`.

    With `overwrite`, the old manifest goes first (so an interrupted overwrite never looks
    complete), then the old dataset's shards and loader profiles; files dlpipe did not write
    are left alone.
    """
    names = [n for n in storage.listdir(out) if not n.startswith(".dlpipe-tmp-")]
    if names and not overwrite:
        raise OutputExistsError(
            f"{out} already holds {len(names)} entries ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}); choose an empty --out, or pass --overwrite "
            "to replace the dataset there"
        )
    storage.makedirs(out)
    if not names:
        return
    if MANIFEST_NAME in names:
        storage.remove(storage.join(out, MANIFEST_NAME))
    if PROFILES_NAME in names:  # loader settings measured on the old data
        storage.remove(storage.join(out, PROFILES_NAME))
    suffixes = "|".join(re.escape(f.suffix) for f in FORMATS.values())
    shard_re = re.compile(rf"[A-Za-z0-9_]+-\d{{6}}({suffixes})")
    for name in names:
        if shard_re.fullmatch(name):
            storage.remove(storage.join(out, name))
    remove_staging(out)


def remove_staging(out: str) -> None:
    """Delete temp folders an interrupted writer left in a local `out` (never a finished file)."""
    if storage.is_url(out):
        return
    for name in storage.listdir(out):
        if name.startswith(".dlpipe-tmp-"):
            shutil.rmtree(storage.join(out, name), ignore_errors=True)
