"""Streaming dataset writing: shard rotation per split; the folder's owner writes the manifest.

    with DatasetWriter("out/", "wds", classes=["cat", "dog"]) as writer:
        writer.write("train", {"__key__": "a1", "jpg": jpeg_bytes, "cls": b"0"})

On a clean exit every shard is published and ``dlpipe.json`` written; on an exception no
manifest is written, so the folder reads as unfinished, never as complete. The lock, the
journal, the counts and the manifest are the output folder's owner's
(`dlpipe.formats.output.DatasetOutput`), as for ``dlpipe convert``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from dlpipe import storage
from dlpipe.errors import InvalidFieldError
from dlpipe.formats import get_format, require_storage
from dlpipe.formats.base import ShardBuilder
from dlpipe.formats.output import DatasetOutput
from dlpipe.manifest import Manifest, ShardInfo
from dlpipe.sample import sample_fields

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "DatasetWriter",
    "ShardLimits",
    "SplitWriter",
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


@dataclass(frozen=True)
class _Published:
    """A shard a `SplitWriter` published (a `dlpipe.formats.output.ShardResult`)."""

    split: str
    name: str
    info: ShardInfo
    labels: list[int]
    fields: list[str]
    skipped: list[dict[str, Any]] = field(default_factory=list)


class SplitWriter:
    """Writes one split's samples into shards ``{split}-000000``, ``-000001``, ... in order,
    and hands each one it publishes to the folder's owner, `output`."""

    def __init__(
        self,
        output: DatasetOutput,
        split: str,
        staging: str,
        limits: ShardLimits,
        fields: Sequence[str],
    ) -> None:
        if not _SPLIT_RE.fullmatch(split):
            raise ValueError(f"split name {split!r} must be letters, digits and _ only")
        self.output, self.split = output, split
        self.staging, self.limits, self.fields = staging, limits, tuple(fields)
        self.names: list[str] = []
        """The split's shards so far, in order."""
        self._labels: list[int] = []  # of the shard being written
        self._builder: ShardBuilder | None = None

    def write(self, key: str, values: dict[str, bytes]) -> None:
        size = len(key) + sum(len(v) for v in values.values())
        b = self._builder
        if b is not None and self.limits.is_full(b.samples, b.payload_bytes, size):
            self._publish(b)
        if self._builder is None:
            name = self.output.fmt.shard_name(self.split, len(self.names))
            self.output.claim_shard(name)
            self._builder = ShardBuilder(
                self.output.fmt, self.output.out, name, self.staging, self.fields
            )
            self.names.append(name)
        self._builder.add(key, values)
        if "cls" in values:
            self._labels.append(int(values["cls"]))

    def _publish(self, builder: ShardBuilder) -> None:
        info = builder.finish()
        shard = _Published(self.split, info.name, info, self._labels, list(self.fields))
        self.output.add(shard)
        self._builder, self._labels = None, []

    def close(self) -> list[str]:
        """Publish the last shard; returns the split's shard names, in order."""
        if self._builder is not None:
            self._publish(self._builder)
        return self.names

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
        overwrite: replace an existing dataset in `out` instead of refusing; only files
            dlpipe wrote are deleted (see `dlpipe.formats.owned.prepare_output`).

    The writer holds `out`'s lock (``.dlpipe-lock``, local paths only) from creation to
    close or abort: a second writer of the same folder fails at once with
    `dlpipe.storage.OutputLockedError`.
    """

    out: str
    format: str
    classes: Sequence[str] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    source: Mapping[str, Any] = field(default_factory=dict)
    limits: ShardLimits = field(default_factory=ShardLimits)
    overwrite: bool = False

    def __post_init__(self) -> None:
        fmt = get_format(self.format)
        require_storage(fmt, self.out)
        self._output = DatasetOutput(self.out, fmt)
        self._cleanup = contextlib.ExitStack()
        self._cleanup.enter_context(self._output)  # the lock, held until close/abort
        try:
            self._output.prepare(overwrite=self.overwrite)
            near = None if storage.is_url(self.out) else self.out
            self._staging_path = self._cleanup.enter_context(storage.staging_dir(near))
        except BaseException:
            self._cleanup.close()
            raise
        self._splits: dict[str, SplitWriter] = {}
        self._fields: tuple[str, ...] | None = None
        self._manifest: Manifest | None = None

    def write(self, split: str, sample: Mapping[str, Any]) -> None:
        """Add one sample to `split` (splits may interleave)."""
        key, values = sample_fields(sample)
        if self._fields is None:
            self._fields = tuple(values)
        writer = self._splits.get(split)
        if writer is None:
            writer = SplitWriter(self._output, split, self._staging_path, self.limits, self._fields)
            self._splits[split] = writer
        writer.write(key, values)

    def close(self) -> Manifest:
        """Publish the last shards and write ``dlpipe.json``; returns the manifest (the one
        written: a second close writes nothing)."""
        if self._manifest is not None:
            return self._manifest
        try:
            if not self._splits or self._fields is None:
                raise InvalidFieldError(f"no samples were written to {self.out}; nothing to save")
            order = [name for writer in self._splits.values() for name in writer.close()]
            self._manifest = self._output.finish(
                order, classes=self.classes, options=self.options, source=self.source
            )
            return self._manifest
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
