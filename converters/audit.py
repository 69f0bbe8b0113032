"""The duplicate and leakage audit: exact and near-duplicate images within and across splits.

Convert already decodes every image once (the integrity check); the audit rides on that
decode. Each written sample gets two fingerprints:

- ``sha256`` of the source file's bytes: equal bytes are an **exact** duplicate.
- a 64-bit **difference hash** (dHash, as ``imagehash.dhash`` computes it: the greyscale image
  shrunk to 9 x 8 with Lanczos, one bit per horizontally adjacent pair, set where the right
  pixel is brighter) of the decoded image (a JPEG: the 1/8-scale greyscale draft that the
  integrity check decodes).
  Two images whose hashes differ in at most `NEAR_BITS` of the 64 bits are a **near**
  duplicate: the same picture re-encoded, resized or slightly recoloured.

Duplicates are grouped (a group holds every sample linked by an exact or near match); a group
spanning two splits is **leakage** (a train image also in val or test: a silently optimistic
evaluation). Near pairs are found without comparing every pair: the hash is cut into
``NEAR_BITS + 1`` blocks, and two hashes within `NEAR_BITS` bits agree on at least one block
(pigeonhole), so only samples sharing a block value are compared.

The report goes into the manifest (``source.duplicates``: counts and the first groups) and, in
full, into ``duplicates.jsonl`` beside the shards. ``--dedup`` drops all but one sample of
each group before the shards are planned: the copy in an evaluation split is kept (val, then
test, then the others, then train), within a split the first key.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

__all__ = [
    "NEAR_BITS",
    "DuplicateGroup",
    "Fingerprint",
    "audit_report",
    "dhash",
    "find_duplicates",
    "kept_and_dropped",
]

NEAR_BITS = 4
"""Two difference hashes at most this many bits apart are near duplicates."""
_BLOCKS = NEAR_BITS + 1
_EXAMPLES = 20
_SPLIT_PREFERENCE = {"val": 0, "test": 1, "train": 3}  # other splits: 2


def dhash(image: Image.Image) -> int:
    """The 64-bit difference hash of a decoded image."""
    grey = image if image.mode == "L" else image.convert("L")
    small = np.frombuffer(grey.resize((9, 8), Image.Resampling.LANCZOS).tobytes(), np.uint8)
    rows = small.reshape(8, 9)
    return int.from_bytes(np.packbits(rows[:, 1:] > rows[:, :-1]).tobytes(), "big")


def file_digest(data: bytes) -> str:
    """The hex sha256 of an image file's bytes."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Fingerprint:
    """One written sample's fingerprints."""

    split: str
    key: str
    sha256: str
    dhash: int


@dataclass(frozen=True)
class DuplicateGroup:
    """Samples that are copies of one another: ``exact`` when all share their bytes."""

    kind: str
    members: tuple[tuple[str, str], ...]  # (split, key), sorted

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(sorted({split for split, _ in self.members}))

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "splits": list(self.splits),
            "samples": [{"split": s, "key": k} for s, k in self.members],
        }


def find_duplicates(prints: Iterable[Fingerprint]) -> list[DuplicateGroup]:
    """Every group of two or more samples linked by equal bytes or near hashes, sorted."""
    items = sorted(prints, key=lambda p: (p.split, p.key))
    links = _Links(len(items))
    for field in ("sha256", "dhash"):  # equal bytes, equal hashes
        first: dict[Any, int] = {}
        for i, p in enumerate(items):
            links.join(first.setdefault(getattr(p, field), i), i)
    hashes = np.array([p.dhash for p in items], dtype=np.uint64)
    unique, where = np.unique(hashes, return_index=True)
    for a, b in _near_pairs(unique):
        links.join(int(where[a]), int(where[b]))
    found = []
    for members in links.groups():
        exact = len({items[i].sha256 for i in members}) == 1
        pairs = tuple((items[i].split, items[i].key) for i in members)
        found.append(DuplicateGroup("exact" if exact else "near", pairs))
    return sorted(found, key=lambda g: g.members)


class _Links:
    """Union-find over sample indices (the smaller index is a group's root)."""

    def __init__(self, count: int) -> None:
        self.parent = list(range(count))

    def root(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def join(self, i: int, j: int) -> None:
        a, b = self.root(i), self.root(j)
        if a != b:
            self.parent[max(a, b)] = min(a, b)

    def groups(self) -> list[list[int]]:
        by_root: dict[int, list[int]] = defaultdict(list)
        for i in range(len(self.parent)):
            by_root[self.root(i)].append(i)
        return [members for members in by_root.values() if len(members) > 1]


_POPCOUNT = np.array([bin(b).count("1") for b in range(256)], dtype=np.uint8)


def _bits_apart(row: np.uint64, others: np.ndarray) -> np.ndarray:
    """The Hamming distance of one 64-bit hash to each of `others`."""
    xor = np.ascontiguousarray(others ^ row)
    return _POPCOUNT[xor.view(np.uint8)].reshape(-1, 8).sum(axis=1)


def _near_pairs(unique: np.ndarray) -> Iterable[tuple[int, int]]:
    """Index pairs of distinct hashes at most `NEAR_BITS` apart: only hashes sharing one of
    ``NEAR_BITS + 1`` blocks are compared (two hashes that close agree on a whole block)."""
    bounds = [64 * b // _BLOCKS for b in range(_BLOCKS + 1)]
    for b in range(_BLOCKS):
        width = bounds[b + 1] - bounds[b]
        keys = (unique >> np.uint64(bounds[b])) & np.uint64((1 << width) - 1)
        order = np.argsort(keys, kind="stable")
        for run in np.split(order, np.flatnonzero(np.diff(keys[order])) + 1):
            for a in range(len(run) - 1):
                rest = run[a + 1 :]
                close = rest[_bits_apart(unique[run[a]], unique[rest]) <= NEAR_BITS]
                yield from ((int(run[a]), int(c)) for c in close)


def kept_and_dropped(
    groups: Sequence[DuplicateGroup],
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """For ``--dedup``: the one sample kept of each group, and the others."""
    kept, dropped = [], []
    for group in groups:
        ranked = sorted(group.members, key=lambda m: (_SPLIT_PREFERENCE.get(m[0], 2), m))
        kept.append(ranked[0])
        dropped += ranked[1:]
    return kept, dropped


def audit_report(
    groups: Sequence[DuplicateGroup], dropped: int = 0, audited: int = 0
) -> dict[str, Any]:
    """The manifest's ``source.duplicates``: counts and the first groups.

    ``exact``/``near``: samples beyond the first of each group of that kind; ``leaking``:
    groups spanning splits; ``dropped``: samples ``--dedup`` left out.
    """
    return {
        "audited": audited,
        "near_bits": NEAR_BITS,
        "groups": len(groups),
        "exact": sum(len(g.members) - 1 for g in groups if g.kind == "exact"),
        "near": sum(len(g.members) - 1 for g in groups if g.kind == "near"),
        "leaking": sum(1 for g in groups if len(g.splits) > 1),
        "dropped": dropped,
        "examples": [g.to_json() for g in groups[:_EXAMPLES]],
    }
