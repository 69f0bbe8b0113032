"""The output folder of one dataset being written, and its one owner: `DatasetOutput`.

Shard bytes are written elsewhere (`dlpipe.formats.writer` in this process, conversion workers in
theirs); everything else in the folder is the owner's:

- the lock (``.dlpipe-lock``: one writer per folder, held from `open` to `close`);
- preparing the folder: existing data is refused, or with overwrite only what dlpipe can prove it
  wrote is deleted (`dlpipe.formats.owned.prepare_output`);
- the journal (``.dlpipe-journal/``): the plan, an intent before each shard is published (the
  proof that a shard file is dlpipe's), and a record of each finished shard (what ``--resume``
  keeps);
- the finished shards and their per-split counts, ``errors.jsonl`` and the other record lists;
- the manifest, written last from what the owner holds (never read back), then the journal goes.

An append (``dlpipe convert --append``) adds a version to a finished dataset: `prepare_append`
touches nothing the manifest lists, and `finish_version` merges the record lists (each new
record tagged with its version) and replaces the manifest, last, with one that lists the old
shards and the new ones after them. Until then the folder is the old version, whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any, Protocol, TypeVar

import numpy as np

from dlpipe import storage
from dlpipe._version import __version__
from dlpipe.codecs import field_type
from dlpipe.dataset_names import (
    CONVERT_CONFIG_NAME,
    DUPLICATES_NAME,
    ERRORS_NAME,
    JOURNAL_DIR,
    JOURNAL_PLAN_NAME,
    KEYS_NAME,
    MANIFEST_NAME,
)
from dlpipe.errors import DlpipeError, InvalidFieldError, OutputExistsError
from dlpipe.formats.appended import merge_records, own_fields, split_after
from dlpipe.formats.base import ShardFormat
from dlpipe.formats.owned import (
    clash_message,
    dataset_entries,
    owned_shards,
    prepare_output,
    record_shard_intent,
    remove_journal,
    remove_staging,
)
from dlpipe.manifest import (
    Manifest,
    ShardInfo,
    SplitInfo,
    VersionInfo,
    VersionSplit,
    parse_manifest,
    read_manifest_bytes,
    write_manifest,
)

__all__ = [
    "DatasetChangedWhileAppendingError",
    "DatasetOutput",
    "EmptySplitError",
    "ShardResult",
    "class_counts",
]

_LISTS = (KEYS_NAME, DUPLICATES_NAME)  # the record lists a caller gives `finish`
_FILES = (CONVERT_CONFIG_NAME,)  # the other files it gives


class EmptySplitError(DlpipeError, ValueError):
    """Every sample of a split was skipped, so there is no dataset to write."""


class DatasetChangedWhileAppendingError(DlpipeError, RuntimeError):
    """The manifest an append was planned on was replaced before it could start."""


class ShardResult(Protocol):
    """What a finished shard adds to the dataset (a conversion's ``TaskResult`` is one)."""

    @property
    def split(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def info(self) -> ShardInfo | None:
        """The published shard; None when every sample of it was skipped."""

    @property
    def labels(self) -> list[int]: ...
    @property
    def fields(self) -> list[str]: ...
    @property
    def skipped(self) -> list[dict[str, Any]]: ...


R = TypeVar("R", bound=ShardResult)


class DatasetOutput:
    """Owns the output folder `out` of a dataset in format `fmt` (see the module docstring).

    Use it as a context manager (or `open` / `close`): the lock is held in between, and what
    the lock created for a folder that was not there is removed when it is left unused.
    """

    def __init__(self, out: str, fmt: ShardFormat) -> None:
        self.out, self.fmt = out, fmt
        self._journal = storage.join(out, JOURNAL_DIR)
        self._shards: dict[str, ShardResult] = {}
        self._held = contextlib.ExitStack()

    def open(self) -> DatasetOutput:
        """Take the lock (`dlpipe.storage.output_lock`: `OutputLockedError` when held)."""
        created = storage.new_output_paths(self.out)  # removed if left unused (a refusal)
        self._held.callback(storage.remove_left_empty, created)
        self._held.enter_context(storage.output_lock(self.out))
        return self

    def close(self) -> None:
        """Release the lock (finished or not: an unfinished folder stays resumable)."""
        self._held.close()

    def __enter__(self) -> DatasetOutput:
        try:
            return self.open()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def entries(self) -> list[str]:
        """What makes the folder non-empty (`dataset_entries`)."""
        return dataset_entries(self.out)

    def prepare(self, *, overwrite: bool, planned: Sequence[str] = ()) -> None:
        """Make the folder ready for a new dataset (`prepare_output`)."""
        prepare_output(self.out, overwrite, planned)

    def prepare_append(self, base_sha256: str, planned: Sequence[str]) -> int:
        """Make a finished dataset ready for a new version; nothing its manifest lists is
        touched. The shards of an unfinished append (its journal proves them dlpipe's, the
        manifest does not list them) are deleted and its journal goes: this run starts anew.

        Args:
            base_sha256: the sha256 of the ``dlpipe.json`` the append was planned on.
            planned: the names of the shards this run writes.

        Returns:
            How many shards of an unfinished append were deleted.

        Raises:
            DatasetChangedWhileAppendingError: the manifest is no longer that one.
            OutputExistsError: a file bears a planned name and dlpipe cannot prove it wrote it.
        """
        raw = read_manifest_bytes(self.out)
        if hashlib.sha256(raw).hexdigest() != base_sha256:
            raise DatasetChangedWhileAppendingError(
                f"{self.out}: its {MANIFEST_NAME} changed after this append read it (another "
                "append finished meanwhile?); run the command again to append to the new version"
            )
        manifest = parse_manifest(raw, storage.join(self.out, MANIFEST_NAME))
        listed = {s.name for split in manifest.splits.values() for s in split.shards}
        owned, _ = owned_shards(self.out)
        names = set(self.entries())
        left = sorted((owned - listed) & names)
        clashes = [n for n in planned if n in names and n not in left]
        if clashes:
            raise OutputExistsError(clash_message(self.out, clashes))
        for name in left:
            storage.remove(storage.join(self.out, name))
        remove_staging(self.out)
        remove_journal(self.out)
        return len(left)

    def claim_shard(self, name: str) -> None:
        """Note the intent to publish shard `name`, refusing a file of that name dlpipe did not
        write (every old shard dlpipe wrote went in `prepare`).

        Raises:
            OutputExistsError: a file named `name` is there.
        """
        if storage.exists(storage.join(self.out, name)):
            raise OutputExistsError(clash_message(self.out, [name]))
        record_shard_intent(self.out, name)

    def journal_exists(self) -> bool:
        """True when an interrupted run left a journal with its plan (resumable)."""
        return storage.exists(storage.join(self._journal, JOURNAL_PLAN_NAME))

    def start_journal(self, plan: Mapping[str, Any]) -> None:
        """Record the plan this run follows (`journal_plan` gives it back to a resume)."""
        storage.makedirs(self._journal)
        data = json.dumps(plan, sort_keys=True, default=str).encode()
        storage.atomic_write_bytes(storage.join(self._journal, JOURNAL_PLAN_NAME), data)

    def journal_plan(self) -> dict[str, Any]:
        """The plan the interrupted run recorded; {} when it cannot be read as an object."""
        try:
            recorded = json.loads(
                storage.read_bytes(storage.join(self._journal, JOURNAL_PLAN_NAME))
            )
        except (OSError, ValueError, RecursionError):
            return {}
        return recorded if isinstance(recorded, dict) else {}

    def resume(self, parse: Callable[[dict[str, Any]], R]) -> dict[str, R]:
        """Take back the shards an interrupted run finished (its journal records, each made a
        result by `parse`) whose files are still whole; drops its temp folders. A record that
        cannot be read (cut short by a power cut) counts as absent: its shard is written again.
        """
        remove_staging(self.out)
        results = {}
        for name in storage.listdir(self._journal):
            if name == JOURNAL_PLAN_NAME or not name.endswith(".json"):
                continue
            try:
                result = parse(json.loads(storage.read_bytes(storage.join(self._journal, name))))
            except (ValueError, KeyError, TypeError):
                continue
            if self._intact(result.info):
                self._shards[result.name] = result
                results[result.name] = result
        return results

    def _intact(self, info: ShardInfo | None) -> bool:
        if info is None:
            return True
        try:
            return storage.size(storage.join(self.out, info.name)) == info.bytes
        except FileNotFoundError:
            return False

    def add(self, result: ShardResult, record: Mapping[str, Any] | None = None) -> None:
        """Hold a finished shard for the manifest; with `record`, journal it first (what
        `resume` parses back)."""
        if record is not None:
            path = storage.join(self._journal, f"{result.name}.json")
            data = json.dumps(record, sort_keys=True).encode()
            # not fsynced: a record lost in a power cut only means that shard is written again
            storage.atomic_write_bytes(path, data, durable=False)
        self._shards[result.name] = result

    def finish(
        self,
        order: Sequence[str],
        *,
        classes: Sequence[str] = (),
        options: Mapping[str, Any] | None = None,
        source: Mapping[str, Any] | None = None,
        task: str | None = None,
        field_schemas: Mapping[str, dict[str, Any]] | None = None,
        class_ids: tuple[int | str, ...] | None = None,
        lists: Mapping[str, Sequence[dict[str, Any]]] | None = None,
        files: Mapping[str, bytes] | None = None,
    ) -> Manifest:
        """Write ``errors.jsonl`` (when samples were skipped), the non-empty `lists`
        (``keys.jsonl``, ``duplicates.jsonl``), then the manifest, last; remove the journal.

        Args:
            order: every shard's name, in the manifest's order (splits in order, each split's
                shards in order); each one must have been added.
            classes, options, source, task, class_ids: the manifest's entries.
            field_schemas: annotation schemas; those of fields the dataset lacks are left out.
            lists: record files to write beside the shards, by name.
            files: other files of the dataset to write beside the shards, by name (the
                resolved ``convert.toml``).

        Returns:
            The manifest as a reader will parse it.

        Raises:
            EmptySplitError: a split lost every sample (``errors.jsonl`` says why).
        """
        results = [self._shards[name] for name in order]
        skipped = [s for r in results for s in r.skipped]
        if skipped:
            storage.atomic_write_jsonl(storage.join(self.out, ERRORS_NAME), skipped)
        splits = self._splits(results, len(classes))
        fields = max((info.fields or {} for info in splits.values()), key=len)  # labelled: cls
        splits = {n: own_fields(i, fields) for n, i in splits.items()}
        for name, records in (lists or {}).items():
            assert name in _LISTS, name
            if records:
                storage.atomic_write_jsonl(storage.join(self.out, name), list(records))
        for name, data in (files or {}).items():
            assert name in _FILES, name
            storage.atomic_write_bytes(storage.join(self.out, name), data)
        manifest = Manifest(
            format=self.fmt.name,
            format_version=self.fmt.version,
            fields=fields,
            splits=splits,
            classes=tuple(classes),
            options=dict(options or {}),
            source=dict(source or {}),
            task=task,
            field_schemas={n: s for n, s in (field_schemas or {}).items() if n in fields},
            class_ids=class_ids,
        )
        written = write_manifest(self.out, manifest)
        remove_journal(self.out)  # the manifest now proves which shards are dlpipe's
        return written

    def finish_version(
        self,
        order: Sequence[str],
        base: Manifest,
        base_sha256: str,
        *,
        classes: Sequence[str],
        class_ids: tuple[int | str, ...] | None,
        source: Mapping[str, Any],
        lists: Mapping[str, Sequence[dict[str, Any]]] | None = None,
    ) -> Manifest:
        """Write version N+1 of `base` (version N, whose ``dlpipe.json`` had `base_sha256`):
        the record lists (``errors.jsonl`` and `lists`), this version's records tagged with
        it, then the manifest, last; remove the journal.

        Args:
            order: the added shards' names, in order (each one added).
            classes, class_ids: the dataset's, with any new class at the end.
            source: where this version's samples came from.
            lists: record files to merge beside the shards, by name.

        Returns:
            The manifest as a reader will parse it.

        Raises:
            EmptySplitError: a split lost every added sample.
            VersionFieldsError: an added split's fields are not the dataset's split's.
        """
        results = [self._shards[name] for name in order]
        version = base.version + 1
        added = self._splits(results, len(classes))
        record = VersionInfo(
            version,
            {
                name: VersionSplit(tuple(s.name for s in i.shards), i.samples)
                for name, i in added.items()
            },
            date=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            appended_to=base_sha256,
            source=dict(source),
        )
        manifest = replace(
            base,
            splits=split_after(base, added, len(classes)),
            classes=tuple(classes),
            class_ids=class_ids,
            dlpipe_version=__version__,
            version=version,
            versions=(*base.version_records(), record),
            version_sha256=None,
        )
        skipped = [s for r in results for s in r.skipped]
        for name, records in ((ERRORS_NAME, skipped), *(lists or {}).items()):
            assert name == ERRORS_NAME or name in _LISTS, name
            merge_records(storage.join(self.out, name), records, version)
        written = write_manifest(self.out, manifest)
        remove_journal(self.out)
        return written

    def _splits(self, results: list[ShardResult], num_classes: int) -> dict[str, SplitInfo]:
        """Each split's shards, class counts and fields, in the order of `results`."""
        splits = {}
        for split in dict.fromkeys(r.split for r in results):
            mine = [r for r in results if r.split == split]
            shards = tuple(r.info for r in mine if r.info is not None)
            if not shards:
                raise EmptySplitError(
                    f"every sample of split {split!r} was skipped, so no dataset was written; "
                    f"the reasons are listed in {storage.join(self.out, ERRORS_NAME)}"
                )
            names = next(r.fields for r in mine if r.info is not None)
            splits[split] = SplitInfo(
                shards=shards,
                class_counts=class_counts(split, [x for r in mine for x in r.labels], num_classes),
                fields={name: field_type(name) for name in names},
            )
        return splits


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
