"""A dataset's versions: what each ``dlpipe convert --append`` added, as the manifest records it.

A dataset converted once is version 1, and its manifest holds neither key below (the same input
and options still give the same bytes). Each append adds new shards at the end of the splits'
shard lists and writes::

    "version": 2,
    "versions": [
      {"version": 1, "splits": {"train": {"shards": ["train-000000.tar"], "samples": 90}}},
      {"version": 2, "date": "2026-12-05T17:40:00Z",
       "appended_to": "…64 hex: the sha256 of version 1's dlpipe.json…",
       "splits": {"train": {"shards": ["train-000001.tar"], "samples": 30}},
       "source": {...}}                                   # where version 2's samples came from
    ]

The manifest's own ``source`` describes version 1. Read as untrusted input: versions are
numbered 1..version in order, and each split's shards are exactly the concatenation of what the
versions added to it, in order (so version N of a dataset is a prefix of every split). A loader
state names the manifest it was saved on by its sha256; ``appended_to`` is how a later version
knows that an older state was saved on version N (`dlpipe.Manifest.at_version`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dlpipe.manifest import Manifest

__all__ = [
    "VersionInfo",
    "VersionSplit",
    "parse_versions",
    "state_version_problem",
    "versions_json",
]

_DATE_RE = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class VersionSplit:
    """What one version added to one split: its shards' names, in order, and their samples."""

    shards: tuple[str, ...]
    samples: int


@dataclass(frozen=True)
class VersionInfo:
    """One version of a dataset: what it added, when, from where, and to which manifest."""

    version: int
    splits: dict[str, VersionSplit]
    date: str | None = None
    """When the version was written (UTC, ``YYYY-MM-DDTHH:MM:SSZ``); None for version 1."""
    appended_to: str | None = None
    """The sha256 of the ``dlpipe.json`` this version replaced (version - 1's); None for 1."""
    source: dict[str, Any] = field(default_factory=dict)
    """Where this version's samples came from (version 1's: the manifest's ``source``)."""

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"version": self.version}
        if self.date is not None:
            entry["date"] = self.date
        if self.appended_to is not None:
            entry["appended_to"] = self.appended_to
        entry["splits"] = {
            name: {"shards": list(s.shards), "samples": s.samples}
            for name, s in self.splits.items()
        }
        if self.source:
            entry["source"] = self.source
        return entry


def versions_json(version: int, versions: Sequence[VersionInfo]) -> dict[str, Any]:
    """The manifest's ``version`` and ``versions`` keys: none for a dataset of one version."""
    if version == 1:
        return {}
    return {"version": version, "versions": [v.to_json() for v in versions]}


def state_version_problem(saved_sha256: Any, manifest: Manifest) -> str | None:
    """When a loader state names (by `saved_sha256`) the manifest of an earlier version of
    `manifest`'s dataset: what is wrong, naming both versions, and the fix; else None."""
    version = manifest.version_of(saved_sha256) if isinstance(saved_sha256, str) else None
    if version is None:
        return None
    return (
        f"the saved loader state was taken on version {version} of this dataset, and this "
        f"loader reads version {manifest.version} (appended since): to go on over version "
        f"{version}'s shards, load it into a loader made with "
        f"LoaderConfig(dataset_version={version}) (dlpipe train: --dataset-version {version}); "
        f"else start anew on version {manifest.version}"
    )


def parse_versions(
    data: Mapping[str, Any], shards: Mapping[str, Sequence[tuple[str, int]]]
) -> tuple[int, tuple[VersionInfo, ...]]:
    """The manifest's version and its version records, checked against `shards` (each split's
    shards as (name, samples), in order); ``(1, ())`` for a manifest without them.

    Raises:
        ValueError: naming what breaks the rules of the module docstring.
    """
    version = data.get("version", 1)
    _require(
        isinstance(version, int) and not isinstance(version, bool) and 1 <= version <= 1 << 20,
        f"'version' {version!r} is not an integer in 1..{1 << 20}",
    )
    if version == 1:
        _require("versions" not in data, "'versions' is given but 'version' is 1")
        return 1, ()
    records = data.get("versions")
    _require(
        isinstance(records, list) and len(records) == version,
        f"'versions' is not a list of {version} records (version is {version})",
    )
    assert isinstance(records, list)
    parsed = tuple(_parse_version(i + 1, record) for i, record in enumerate(records))
    _check_against_splits(parsed, shards)
    return version, parsed


def _parse_version(number: int, data: Any) -> VersionInfo:
    what = f"versions[{number - 1}]"
    _require(isinstance(data, dict), f"{what} is not an object")
    _require(data.get("version") == number, f"{what}.version is not {number}")
    date, base = data.get("date"), data.get("appended_to")
    _require(
        date is None or (isinstance(date, str) and bool(_DATE_RE.fullmatch(date))),
        f"{what}.date {date!r} is not YYYY-MM-DDTHH:MM:SSZ",
    )
    _require(
        (number == 1) == (base is None),
        f"{what}.appended_to must be given for every version but 1",
    )
    _require(
        base is None or (isinstance(base, str) and bool(_SHA256_RE.fullmatch(base))),
        f"{what}.appended_to {base!r} is not 64 hex digits",
    )
    source = data.get("source", {})
    _require(isinstance(source, dict), f"{what}.source is not an object")
    splits = data.get("splits")
    _require(
        isinstance(splits, dict) and len(splits) > 0, f"{what}.splits is not a non-empty object"
    )
    parsed = {str(k): _parse_split(f"{what}.splits.{k}", v) for k, v in splits.items()}
    return VersionInfo(number, parsed, date=date, appended_to=base, source=dict(source))


def _parse_split(what: str, data: Any) -> VersionSplit:
    _require(isinstance(data, dict), f"{what} is not an object")
    names, samples = data.get("shards"), data.get("samples")
    _require(
        isinstance(names, list) and len(names) > 0 and all(isinstance(n, str) for n in names),
        f"{what}.shards is not a non-empty list of shard names",
    )
    _require(
        isinstance(samples, int) and not isinstance(samples, bool) and 0 <= samples <= _INT64_MAX,
        f"{what}.samples {samples!r} is not a non-negative integer",
    )
    return VersionSplit(tuple(names), int(samples))


def _check_against_splits(
    versions: Sequence[VersionInfo], shards: Mapping[str, Sequence[tuple[str, int]]]
) -> None:
    """Each split's shards are the versions' additions to it, in version order."""
    for version in versions:
        unknown = sorted(set(version.splits) - set(shards))
        _require(not unknown, f"version {version.version} adds to a split {unknown[:1]} not listed")
    for split, listed in shards.items():
        added = [
            (v.version, v.splits[split]) for v in versions if split in v.splits
        ]  # in version order
        names = [n for _, s in added for n in s.shards]
        _require(
            names == [n for n, _ in listed],
            f"split {split!r}: its shards are not, in order, the shards its versions added",
        )
        samples = dict(listed)
        for number, part in added:
            total = sum(samples[n] for n in part.shards)
            _require(
                part.samples == total,
                f"version {number} says it added {part.samples} samples to split {split!r}, "
                f"its shards hold {total}",
            )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
