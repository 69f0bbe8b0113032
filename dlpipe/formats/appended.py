"""What an appended version adds to the dataset's manifest and record lists (the output
folder's owner, `dlpipe.formats.output.DatasetOutput.finish_version`, writes them): each split's
shards with the new ones after them, the class counts padded for new classes, and the record
lists with this version's records tagged with it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from dlpipe import storage
from dlpipe.errors import DlpipeError
from dlpipe.manifest import Manifest, SplitInfo

__all__ = ["VersionFieldsError", "merge_records", "own_fields", "split_after"]


class VersionFieldsError(DlpipeError, ValueError):
    """An appended split's samples have other fields than the dataset's split."""


def split_after(
    base: Manifest,
    added: Mapping[str, SplitInfo],
    num_classes: int,
) -> dict[str, SplitInfo]:
    """`base`'s splits with the `added` shards after each one's own (a new split after them,
    its fields kept by `own_fields` where they differ from the dataset's).

    Raises:
        VersionFieldsError: an added split's fields are not the dataset's split's.
    """
    splits = {}
    for name, info in base.splits.items():
        counts = _padded(info.class_counts, num_classes)
        new = added.get(name)
        if new is None:
            splits[name] = replace(info, class_counts=counts)
            continue
        expected = base.fields_of(name)
        if new.fields != expected:
            raise VersionFieldsError(
                f"the new samples of split {name!r} have the fields {', '.join(new.fields or ())}"
                f", the dataset's have {', '.join(expected)}; nothing was added (the dataset "
                f"is still version {base.version}, and the next --append removes this run's "
                "shards): append raw data whose samples have the dataset's fields"
            )
        total = None
        if counts is not None and new.class_counts is not None:
            total = tuple(a + b for a, b in zip(counts, new.class_counts, strict=True))
        splits[name] = SplitInfo(info.shards + new.shards, class_counts=total, fields=info.fields)
    for name, new in added.items():
        if name not in splits:
            splits[name] = own_fields(new, base.fields)
    return splits


def _padded(counts: tuple[int, ...] | None, num_classes: int) -> tuple[int, ...] | None:
    """Class counts with a zero for each class added after them."""
    return None if counts is None else counts + (0,) * (num_classes - len(counts))


def merge_records(path: str, records: Sequence[dict[str, Any]], version: int) -> None:
    """Rewrite the record list at `path` as its records of earlier versions plus `records`,
    each tagged with `version` (a list left by an interrupted try of the same version loses
    that try's records)."""
    kept: list[dict[str, Any]] = []
    if storage.exists(path):
        for line in storage.read_bytes(path).splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("version") != version:
                kept.append(record)
    new = [{**r, "version": version} for r in records]
    if kept or new:
        storage.atomic_write_jsonl(path, kept + new)


def own_fields(split: SplitInfo, fields: dict[str, str]) -> SplitInfo:
    """`split` with its own fields only where they differ from the dataset's."""
    own = split.fields if split.fields != fields else None
    return SplitInfo(shards=split.shards, class_counts=split.class_counts, fields=own)
