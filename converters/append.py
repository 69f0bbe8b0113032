"""``dlpipe convert NEW_RAW --out DATASET --append``: the dataset an append adds a version to.

An append writes new shards only, named after the dataset's last shard of each split, and then
a new manifest (`dlpipe.manifest_versions`: version N+1 and what it added). Until that manifest
replaces the old one, atomically, the dataset is version N, whole and readable: no old shard or
list is rewritten before it, and the new shards are not listed. The rules, each refused with the
option or sample it names:

- the same format and image options (`SAME_OPTIONS`); the image type is the dataset's;
- the same task and annotation schemas; labels where the dataset's split has them;
- classes: the dataset's keep their indices and a new class name goes at the end of the list.
  Annotations (boxes, masks) hold class indices in their bytes, so there the new raw data's
  classes must be the dataset's, in order, new ones after them;
- a key stays unique within its split across versions (a clash names the key, the version and
  shard that hold it and the new file);
- an exact copy of a sample the dataset holds (the same stored image bytes, by sha256) is
  reported, and with ``--dedup`` left out (the dataset's sample is kept).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from dlpipe import storage
from dlpipe.converters.images import prepare_image
from dlpipe.converters.plan import Plan, ShardTask
from dlpipe.converters.source import Item, SampleError, Scan, Source
from dlpipe.converters.worker import TaskResult, WorkerConfig
from dlpipe.errors import DlpipeError, ManifestError, ManifestNotFoundError
from dlpipe.formats import get_format
from dlpipe.manifest import MANIFEST_NAME, Manifest, ShardInfo, parse_manifest, read_manifest_bytes

__all__ = [
    "SAME_OPTIONS",
    "AppendBase",
    "AppendError",
    "StoredSample",
    "check_keys",
    "check_labels",
    "check_nothing_left",
    "check_options",
    "copies_of_stored",
    "digest_task",
    "fit_scan",
    "image_field",
    "open_base",
    "read_stored",
    "shard_digests",
]

SAME_OPTIONS = {
    "format": "--to",
    "max_side": "--max-side",
    "quality": "--quality",
    "seekable_jpeg": "--seekable-jpeg",
    "instance_masks": "--instance-masks",
}
"""The recorded options an append must share with the dataset (option -> flag)."""
_LAST_INDEX = 999_999  # shard names hold six digits


class AppendError(DlpipeError, ValueError):
    """``--append`` cannot add this raw data to this dataset (named, with the fix)."""


@dataclass(frozen=True)
class StoredSample:
    """A sample of the dataset: where it is, and the sha256 of its stored image bytes."""

    version: int
    shard: str
    digest: str | None


@dataclass(frozen=True)
class AppendBase:
    """The dataset an append adds to: its manifest (version N) and that file's sha256."""

    out: str
    manifest: Manifest
    sha256: str

    def first_index(self) -> dict[str, int]:
        """Each split's next shard number: one after the highest of its shards."""
        found: dict[str, int] = {}
        for split, info in self.manifest.splits.items():
            pattern = re.compile(rf"{re.escape(split)}-(\d{{6}})\.")
            numbers = [int(m.group(1)) for s in info.shards if (m := pattern.match(s.name))]
            found[split] = max(numbers, default=len(info.shards) - 1) + 1
            if found[split] > _LAST_INDEX:
                raise AppendError(
                    f"{self.out}: split {split!r} has used every shard number up to "
                    f"{_LAST_INDEX}; convert the raw data into a dataset of its own"
                )
        return found

    def version_of_shard(self) -> dict[str, int]:
        """Shard name -> the version that added it."""
        return {
            name: record.version
            for record in self.manifest.version_records()
            for part in record.splits.values()
            for name in part.shards
        }


def open_base(out: str, to: str) -> AppendBase:
    """The finished dataset in `out`, whose format must be `to`.

    Raises:
        AppendError: no finished dataset there (the reader's reason and fix), or another format.
    """
    try:
        raw = read_manifest_bytes(out)
        manifest = parse_manifest(raw, storage.join(out, MANIFEST_NAME))
    except (ManifestNotFoundError, ManifestError) as exc:
        raise AppendError(f"--append adds to a finished dataset in --out, and {exc}") from None
    base = AppendBase(out, manifest, hashlib.sha256(raw).hexdigest())
    if manifest.format != to:
        raise AppendError(_differs(base, "--to", manifest.format, to))
    return base


def image_field(base: AppendBase) -> str:
    """The dataset's image field: the recorded one, else its field of type image."""
    recorded = base.manifest.options.get("image_field")
    if isinstance(recorded, str) and recorded in base.manifest.fields:
        return recorded
    images = [n for n, kind in base.manifest.fields.items() if kind == "image"]
    return images[0] if images else "jpg"


def check_options(base: AppendBase, recorded: Mapping[str, Any]) -> None:
    """Refuse an image or format option that differs from the dataset's (`SAME_OPTIONS`)."""
    for name, flag in SAME_OPTIONS.items():
        old = base.manifest.options.get(name)
        if name in base.manifest.options and recorded.get(name) != old:
            raise AppendError(_differs(base, flag, old, recorded.get(name)))


def _differs(base: AppendBase, flag: str, old: Any, new: Any) -> str:
    if isinstance(old, bool) or old is None:
        fix = f"pass {flag}" if old else f"leave out {flag}"
    else:
        fix = f"pass {flag} {old}"
    return (
        f"--append: {flag} is {new!r} in this run, but {base.out} was made "
        f"with {old!r}; an appended version keeps the dataset's options: {fix} (or "
        "convert the new data into a dataset of its own)"
    )


def fit_scan(base: AppendBase, scan: Scan) -> Scan:
    """`scan` with the dataset's class list (new names at its end) and labels renumbered to
    it, after checking the task, annotation schemas and class ids agree.

    Raises:
        AppendError: naming what differs.
    """
    old = base.manifest
    if scan.task != old.task:
        raise AppendError(
            f"--append: {base.out} is a {old.task or 'plain'} dataset, the new raw data "
            f"reads as {scan.task or 'plain'}; append raw data of the dataset's task"
        )
    for name in sorted(set(scan.field_schemas) & set(old.field_schemas)):
        if scan.field_schemas[name] != old.field_schemas[name]:
            raise AppendError(
                f"--append: field {name} of the new raw data has schema "
                f"{scan.field_schemas[name]!r}, the dataset's is "
                f"{old.field_schemas[name]!r}; append raw data with the same schema"
            )
    if not scan.classes:
        return replace(scan, classes=old.classes, class_ids=old.class_ids)
    classes = old.classes + tuple(c for c in scan.classes if c not in old.classes)
    index = {name: i for i, name in enumerate(classes)}
    moved = {i: index[name] for i, name in enumerate(scan.classes) if index[name] != i}
    if moved and (scan.field_schemas or scan.class_ids is not None):
        raise AppendError(
            f"--append: the new raw data's classes ({_some(scan.classes)}) do not start with "
            f"the dataset's ({_some(old.classes)}), and its annotations hold class indices; "
            "give the new data the dataset's classes, in order, new ones after them"
        )
    items = tuple(_renumbered(it, moved) for it in scan.items) if moved else scan.items
    return replace(
        scan, classes=classes, items=items, class_ids=_class_ids(base, scan, len(classes))
    )


def _renumbered(item: Item, moved: Mapping[int, int]) -> Item:
    if item.label is None or item.label not in moved:
        return item
    return replace(item, label=moved[item.label])


def _class_ids(base: AppendBase, scan: Scan, count: int) -> tuple[int | str, ...] | None:
    old, new = base.manifest.class_ids, scan.class_ids
    if old is None and new is None:
        return None
    shared = min(len(old or ()), len(new or ()))
    if old is None or new is None or old[:shared] != new[:shared]:
        raise AppendError(
            f"--append: the new raw data's class ids ({_some(new or ())}) are not the "
            f"dataset's ({_some(old or ())}); append raw data with the same class ids"
        )
    merged = tuple(old) + tuple(new[len(old) :])
    if len(merged) != count:
        raise AppendError("--append: the class ids do not name every class once")
    return merged


def _some(values: Iterable[Any]) -> str:
    listed = [str(v) for v in values]
    return ", ".join(listed[:5]) + (", ..." if len(listed) > 5 else "") or "none"


def check_labels(base: AppendBase, plan: Plan) -> None:
    """Refuse a split whose new samples have labels where the dataset's have none, or none
    where it has them."""
    for split in plan.splits():
        labelled = any(
            it.label is not None for t in plan.tasks if t.split == split for it in t.items
        )
        info = base.manifest.splits.get(split)
        fields = base.manifest.fields_of(split) if info is not None else base.manifest.fields
        if labelled != ("cls" in fields):
            have, lack = ("labels", "none") if labelled else ("no labels", "labels")
            raise AppendError(
                f"--append: the new samples of split {split!r} have {have}, the dataset's "
                f"{'split' if info is not None else 'samples'} {lack}; append raw data whose "
                "samples are labelled as the dataset's are"
            )


def read_stored(base: AppendBase, image_field: str) -> dict[tuple[str, str], StoredSample]:
    """Every sample of the dataset by (split, key): its version, shard and image digest
    (read from the shards, no image decoded)."""
    fmt = get_format(base.manifest.format, base.manifest.format_version)
    version_of = base.version_of_shard()
    stored: dict[tuple[str, str], StoredSample] = {}
    for split, info in base.manifest.splits.items():
        fields = list(base.manifest.fields_of(split))
        for shard in info.shards:
            for key, digest in shard_digests(base.out, fmt.name, shard, fields, image_field):
                stored[split, key] = StoredSample(version_of[shard.name], shard.name, digest)
    return stored


def shard_digests(
    out: str, fmt: str, shard: ShardInfo, fields: list[str], image_field: str
) -> list[tuple[str, str | None]]:
    """(key, sha256 of the image bytes or None) of every sample of one shard."""
    reader = get_format(fmt).reader(storage.join(out, shard.name), shard, fields)
    try:
        return [(str(s["__key__"]), _digest(s.get(image_field))) for s in reader]
    finally:
        reader.close()


def _digest(data: Any) -> str | None:
    return hashlib.sha256(data).hexdigest() if isinstance(data, bytes) else None


def check_keys(
    base: AppendBase, stored: Mapping[tuple[str, str], StoredSample], plan: Plan
) -> None:
    """Refuse a planned sample whose key its split already holds (in any version).

    Raises:
        AppendError: naming the key, the version and shard holding it, the new file and the fix.
    """
    for task in plan.tasks:
        for item in task.items:
            held = stored.get((task.split, item.key))
            if held is not None:
                raise AppendError(
                    f"--append: key {item.key!r} of split {task.split!r} is in "
                    f"{base.out} already (version {held.version}, shard {held.shard}) and "
                    f"again in the new raw data ({item.origin}); keys stay unique within "
                    "a split across versions: rename or remove the new file (with --dedup, an "
                    "exact copy of the dataset's sample is skipped instead)"
                )


def check_nothing_left(base: AppendBase, plan: Plan, copies: list[dict[str, Any]]) -> None:
    """Refuse an append that ``--dedup`` left without a sample."""
    if plan.tasks:
        return
    first = copies[0]["samples"] if copies else []
    example = (
        f", e.g. {first[1]['key']!r} of split {first[1]['split']!r} copies {first[0]['key']!r}"
        if first
        else ""
    )
    raise AppendError(
        f"--append --dedup: every new sample is an exact copy of a sample of {base.out}"
        f"{example}; nothing was appended (the dataset stays version {base.manifest.version})"
    )


def copies_of_stored(
    stored: Mapping[tuple[str, str], StoredSample],
    new: Mapping[tuple[str, str], str],
    version: int,
) -> list[dict[str, Any]]:
    """``duplicates.jsonl`` records: each new sample (by (split, key) -> image digest) that is
    an exact copy of a sample of the dataset, with the dataset's sample first."""
    by_digest: dict[str, tuple[str, str, StoredSample]] = {}
    for (split, key), sample in sorted(stored.items()):
        if sample.digest is not None:
            by_digest.setdefault(sample.digest, (split, key, sample))
    records = []
    for (split, key), digest in sorted(new.items()):
        if digest not in by_digest:
            continue
        old_split, old_key, sample = by_digest[digest]
        members = [
            {"split": old_split, "key": old_key, "version": sample.version},
            {"split": split, "key": key, "version": version},
        ]
        records.append(
            {
                "kind": "exact",
                "splits": sorted({old_split, split}),
                "samples": members,
                "of_existing": True,
            }
        )
    return records


def digest_task(source: Source, task: ShardTask, config: WorkerConfig) -> TaskResult:
    """``--append --dedup``'s first pass: each image as it would be stored, nothing written:
    fingerprints ``(key, file size, dhash, sha256 of the stored bytes)``. A sample that
    cannot be read is left out here; the writing pass reports it."""
    result = TaskResult(split=task.split, name=task.name, info=None)
    for item in task.items:
        try:
            data = source.load(item).get("image")
            if data is not None:
                image = prepare_image(data, config.image, item.origin)
                digest = hashlib.sha256(image.data).hexdigest()
                result.fingerprints.append((item.key, len(data), image.dhash, digest))
        except SampleError:
            continue
    return result
