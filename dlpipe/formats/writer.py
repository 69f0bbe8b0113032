"""Streaming dataset writing: shard rotation per split, then the manifest, last.

    with DatasetWriter("out/", "wds", classes=["cat", "dog"]) as writer:
        writer.write("train", {"__key__": "a1", "jpg": jpeg_bytes, "cls": b"0"})

On a clean exit every shard is published and ``dlpipe.json`` written; on an exception no
manifest is written, so the folder reads as unfinished, never as complete.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import numpy as np

from dlpipe import storage
from dlpipe.codecs import field_type
from dlpipe.errors import DlpipeError, InvalidFieldError, OutputExistsError
from dlpipe.formats import FORMATS, get_format, require_storage
from dlpipe.formats.base import ShardBuilder, ShardFormat
from dlpipe.manifest import (
    MANIFEST_NAME,
    PROFILES_NAME,
    Manifest,
    ShardInfo,
    SplitInfo,
    read_manifest,
    write_manifest,
)
from dlpipe.sample import sample_fields

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "DUPLICATES_NAME",
    "ERRORS_NAME",
    "JOURNAL_DIR",
    "KEYS_NAME",
    "DatasetWriter",
    "ShardLimits",
    "SplitWriter",
    "class_counts",
    "dataset_entries",
    "is_dlpipe_name",
    "owned_shards",
    "prepare_output",
    "record_shard_intent",
    "remove_journal",
    "remove_staging",
]

DEFAULT_MAX_SHARD_BYTES = 64 << 20
ERRORS_NAME = "errors.jsonl"
KEYS_NAME = "keys.jsonl"
DUPLICATES_NAME = "duplicates.jsonl"
JOURNAL_DIR = ".dlpipe-journal"
_TMP_PREFIX = ".dlpipe-tmp-"
_INTENT_SUFFIX = ".intent"
_FIXED_NAMES = frozenset(
    {
        MANIFEST_NAME,
        PROFILES_NAME,
        ERRORS_NAME,
        KEYS_NAME,
        DUPLICATES_NAME,
        JOURNAL_DIR,
        storage.LOCK_NAME,
    }
)
_SPLIT_RE = re.compile(r"[A-Za-z0-9_]+")
_SHARD_FILE_RE = re.compile(
    rf"[A-Za-z0-9_]+-\d{{6}}({'|'.join(re.escape(f.suffix) for f in FORMATS.values())})"
)


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
            self._builder = self._new_builder(self.fmt.shard_name(self.split, len(self.shards)))
        self._builder.add(key, values)
        if "cls" in values:
            self.labels.append(int(values["cls"]))

    def _new_builder(self, name: str) -> ShardBuilder:
        # every old shard dlpipe wrote is gone (prepare_output): a file here is a user's
        if storage.exists(storage.join(self.folder, name)):
            raise OutputExistsError(_clash_message(self.folder, [name]))
        record_shard_intent(self.folder, name)
        return ShardBuilder(self.fmt, self.folder, name, self.staging, self.fields)

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
        overwrite: replace an existing dataset in `out` instead of refusing; only files
            dlpipe wrote are deleted (see `prepare_output`).

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
        self._fmt = get_format(self.format)
        require_storage(self._fmt, self.out)
        self._cleanup = contextlib.ExitStack()
        self._cleanup.enter_context(storage.output_lock(self.out))  # held until close/abort
        try:
            prepare_output(self.out, self.overwrite)
            near = None if storage.is_url(self.out) else self.out
            self._staging_path = self._cleanup.enter_context(storage.staging_dir(near))
        except BaseException:
            self._cleanup.close()
            raise
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
            remove_journal(self.out)  # the manifest now proves which shards are dlpipe's
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


def dataset_entries(out: str) -> list[str]:
    """Names in `out` that make it non-empty: all but the writer lock and temp folders."""
    return [
        n for n in storage.listdir(out) if n != storage.LOCK_NAME and not n.startswith(_TMP_PREFIX)
    ]


def is_dlpipe_name(name: str) -> bool:
    """True for the fixed names dlpipe writes beside shards (never a user's file name)."""
    return name in _FIXED_NAMES or name.startswith(_TMP_PREFIX)


def record_shard_intent(out: str, name: str) -> None:
    """Note in the journal that dlpipe is about to publish shard `name` into `out`.

    Written before the shard appears, so a writer killed at any point leaves proof of which
    shard files are dlpipe's: ``--overwrite`` deletes from that proof, never by a name pattern.
    """
    folder = storage.join(out, JOURNAL_DIR)
    storage.makedirs(folder)
    path = storage.join(folder, name + _INTENT_SUFFIX)
    if not storage.is_url(path):
        # an empty file appears whole or not at all: no temp folder (an rmdir costs ms on a
        # filesystem mounted with discard), no rename; a link in its place is not followed
        flags = (
            os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        )
        with contextlib.suppress(OSError):
            os.close(os.open(storage.local_path(path), flags, 0o644))
            return
    storage.atomic_write_bytes(path, b"", durable=False)


def owned_shards(out: str) -> tuple[set[str], str | None]:
    """Shard files dlpipe can prove it wrote in `out`, and why the manifest could not be read.

    The proof is the existing manifest's shard list and the journal's records (finished shards
    and intents); only plain shard names (``split-NNNNNN.suffix``) count.
    """
    names: set[str] = set()
    unreadable = None
    if storage.exists(storage.join(out, MANIFEST_NAME)):
        try:
            manifest = read_manifest(out)
            names.update(s.name for split in manifest.splits.values() for s in split.shards)
        except (DlpipeError, OSError, ValueError, RecursionError) as exc:
            unreadable = str(exc).split("; ")[0]  # the reason; the reader's fix is not ours
    for entry in storage.listdir(storage.join(out, JOURNAL_DIR)):
        stem, suffix = os.path.splitext(entry)
        if suffix in (_INTENT_SUFFIX, ".json"):
            names.add(stem)
    return {n for n in names if _SHARD_FILE_RE.fullmatch(n)}, unreadable


def prepare_output(out: str, overwrite: bool, planned: Sequence[str] = ()) -> None:
    """Make `out` ready for a new dataset: refuse existing data unless `overwrite`.

    With `overwrite`, only what dlpipe can prove it wrote is deleted: the shards the existing
    manifest or journal lists, and dlpipe's fixed names (manifest, errors/keys lists, loader
    profiles, journal, temp folders). The manifest goes first, so an interrupted overwrite
    never looks complete, and the shards to delete are noted in the journal before it goes,
    so a kill half-way leaves them provable. A user's file is never deleted; one that bears
    a name in `planned` (a shard this run will write) is refused before anything is deleted.

    Raises:
        OutputExistsError: `out` holds data and not `overwrite`; or a file there that dlpipe
            cannot prove is its own would be replaced (nothing is deleted then).
    """
    names = dataset_entries(out)
    if names and not overwrite:
        raise OutputExistsError(
            f"{out} already holds {len(names)} entries ({_some(names)}); choose an empty "
            "output folder, or pass overwrite=True (--overwrite) to replace the dataset there"
        )
    storage.makedirs(out)
    if not names:
        return
    owned, unreadable = owned_shards(out)
    _refuse_foreign(out, names, owned, unreadable, planned)
    doomed = sorted(owned.intersection(names))
    for name in doomed:
        record_shard_intent(out, name)
    for name in (MANIFEST_NAME, PROFILES_NAME, ERRORS_NAME, KEYS_NAME, DUPLICATES_NAME, *doomed):
        if name in names:
            storage.remove(storage.join(out, name))
    remove_staging(out)
    remove_journal(out)


def _refuse_foreign(
    out: str, names: list[str], owned: set[str], unreadable: str | None, planned: Sequence[str]
) -> None:
    foreign = [n for n in names if not is_dlpipe_name(n) and n not in owned]
    shard_like = [n for n in foreign if _SHARD_FILE_RE.fullmatch(n)]
    if unreadable is not None and shard_like:
        raise OutputExistsError(
            f"{out}: the old manifest cannot be read ({unreadable}), so --overwrite cannot tell "
            f"which files there dlpipe wrote; nothing was deleted, and {len(shard_like)} "
            f"shard-named files remain ({_some(shard_like)}): delete the old dataset's files "
            "yourself, or choose another --out"
        )
    clashes = [n for n in planned if n in foreign]
    if clashes:
        raise OutputExistsError(_clash_message(out, clashes))


def _clash_message(out: str, clashes: Sequence[str]) -> str:
    return (
        f"{out} holds {_some(clashes)}, not written by dlpipe (no manifest or journal there "
        "lists it), under the name of a shard this conversion writes; nothing was deleted: "
        "move it away, or choose another --out"
    )


def _some(names: Sequence[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def remove_journal(out: str) -> None:
    """Delete the conversion journal folder of `out` (local path or URL), if any."""
    folder = storage.join(out, JOURNAL_DIR)
    if not storage.is_url(folder):
        shutil.rmtree(storage.local_path(folder), ignore_errors=True)
        return
    for name in storage.listdir(folder):
        storage.remove(storage.join(folder, name))


def remove_staging(out: str) -> None:
    """Delete temp folders an interrupted writer left in a local `out` (never a finished file)."""
    if storage.is_url(out):
        return
    for name in storage.listdir(out):
        if name.startswith(_TMP_PREFIX):
            shutil.rmtree(storage.join(out, name), ignore_errors=True)
