"""The conversion plan: which sample goes to which shard, decided before anything is written.

The plan depends only on the scan and the options, never on the order the filesystem lists
files or on timing: items are sorted by key, split (a seeded, per-class split for
``--val-fraction``), shuffled with a seeded generator, and cut into shards by estimated bytes.
So the same input and options give the same shards, whichever engine writes them, and a
resumed run writes exactly the shards the interrupted run would have.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from dlpipe.converters.source import Item, Scan, SourceError
from dlpipe.formats.base import ShardFormat
from dlpipe.unfinished import CONVERT_OPTION_FLAGS

__all__ = ["OPTION_FLAGS", "Plan", "ShardTask", "default_shard_bytes", "make_plan"]

OPTION_FLAGS = CONVERT_OPTION_FLAGS  # each option's flag, for the commands hints print

_ITEM_FIELDS = tuple(f.name for f in fields(Item))  # its values are plain data, no dataclasses
MIN_SHARD_BYTES = 1 << 20
MAX_SHARD_BYTES = 256 << 20
TARGET_SHARDS = 64
_ITEM_ENCODER = json.JSONEncoder(sort_keys=True, default=str)


@dataclass(frozen=True)
class ShardTask:
    """One unit of parallel work: a shard name and the items it holds, in order."""

    split: str
    name: str
    items: tuple[Item, ...]


@dataclass(frozen=True)
class Plan:
    """The shard tasks, the class names, the fingerprint of everything that shaped them, and
    the source's account of the raw data.

    `options` are the options folded into the fingerprint (the journal records them, so a
    refused ``--resume`` can name what changed).
    """

    classes: tuple[str, ...]
    tasks: tuple[ShardTask, ...]
    fingerprint: str
    options: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    """What the source said of the raw data: its ``kind``, the ``layout`` it read and why,
    and what it did not use (``unused``: a count per kind); not part of the fingerprint."""

    def splits(self) -> list[str]:
        return list(dict.fromkeys(t.split for t in self.tasks))


def default_shard_bytes(split_bytes: int) -> int:
    """About 64 shards per split, within 1-256 MiB.

    Enough shards for 8 ranks x 8 workers to each stream their own even when the dataset is
    small (WebDataset's ~100 MB default gave a 490 MB set 5 shards, 30% slower at 2 workers
    than 24 shards), and no more than 256 MiB so one shard stays a quick unit to retry.
    """
    return int(min(MAX_SHARD_BYTES, max(MIN_SHARD_BYTES, split_bytes // TARGET_SHARDS)))


def make_plan(
    scan: Scan,
    *,
    fmt: ShardFormat,
    seed: int,
    val_fraction: float | None,
    shard_bytes: int | None,
    options: dict,
    first_index: Mapping[str, int] | None = None,
) -> Plan:
    """Split, shuffle and cut the scanned items into named shard tasks.

    Args:
        scan: the source's listing.
        fmt: the output format, which names the shards.
        seed: seeds the shuffle and the val split.
        val_fraction: fraction of each class moved to ``val`` when the source has no splits.
        shard_bytes: target bytes per shard, or None for `default_shard_bytes`.
        options: every option that changes the output, folded into the fingerprint (with the
            class names).
        first_index: the number of each split's first shard (an append continues after the
            dataset's shards; 0 for a split not named).
    """
    _check_unique(scan.items)
    by_split = _assign_splits(scan.items, seed, val_fraction)
    tasks: list[ShardTask] = []
    for split in sorted(by_split, key=lambda s: (s != "train", s)):
        items = sorted(by_split[split], key=lambda it: it.key)
        order = np.random.default_rng([seed, zlib.crc32(split.encode())]).permutation(len(items))
        shuffled = [items[i] for i in order]
        target = shard_bytes or default_shard_bytes(sum(it.size for it in shuffled))
        first = (first_index or {}).get(split, 0)
        for index, chunk in enumerate(_cut(shuffled, target), start=first):
            name = fmt.shard_name(split, index)
            tasks.append(ShardTask(split=split, name=name, items=tuple(chunk)))
    fingerprint = _fingerprint(tasks, options, scan.classes)
    return Plan(classes=scan.classes, tasks=tuple(tasks), fingerprint=fingerprint, options=options)


def _check_unique(items: Sequence[Item]) -> None:
    counts = Counter((it.split, it.key) for it in items)
    dupes = [key for (_, key), n in counts.items() if n > 1]
    if dupes:
        origins = " and ".join([it.origin for it in items if it.key == dupes[0]][:2])
        raise SourceError(
            f"{len(dupes)} duplicate sample keys, e.g. {dupes[0]!r} from {origins}; keys must "
            "be unique: rename or remove the duplicates"
        )


def _assign_splits(
    items: Sequence[Item], seed: int, val_fraction: float | None
) -> dict[str, list[Item]]:
    by_split: dict[str, list[Item]] = defaultdict(list)
    unsplit = [it for it in items if it.split is None]
    for it in items:
        if it.split is not None:
            by_split[it.split].append(it)
    if not unsplit:
        return by_split
    if not val_fraction:
        by_split["train"] += unsplit
        return by_split
    by_class: dict[int | None, list[Item]] = defaultdict(list)
    for it in sorted(unsplit, key=lambda it: it.key):
        by_class[it.label].append(it)
    rng = np.random.default_rng([seed, 1])
    for label in sorted(by_class, key=lambda x: (x is None, x or 0)):
        group = by_class[label]
        order = rng.permutation(len(group))
        n_val = round(len(group) * val_fraction)
        for rank, i in enumerate(order):
            by_split["val" if rank < n_val else "train"].append(group[i])
    return by_split


def _cut(items: list[Item], target: int) -> list[list[Item]]:
    shards: list[list[Item]] = [[]]
    size = 0
    for it in items:
        if shards[-1] and size + it.size > target:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.size
    return shards if shards[0] else []


def _fingerprint(tasks: Sequence[ShardTask], options: dict, classes: Sequence[str]) -> str:
    digest = hashlib.sha256(json.dumps(options, sort_keys=True, default=str).encode())
    digest.update(json.dumps(list(classes)).encode())
    encode = _ITEM_ENCODER.encode  # json.dumps's bytes, without an encoder made per item
    for task in tasks:
        digest.update(task.name.encode())
        for it in task.items:  # a flat dict, not asdict: its deep copy was 60% of this serial loop
            record = {name: getattr(it, name) for name in _ITEM_FIELDS}
            digest.update(encode(record).encode())
    return digest.hexdigest()
