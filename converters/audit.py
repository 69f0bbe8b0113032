"""The duplicate and leakage audit: exact and near-duplicate images within and across splits.

Convert already decodes every image once (the integrity check); the audit rides on that
decode. Each written sample gets a fingerprint:

- the source file's size: files of equal bytes have equal sizes (and equal hashes, below);
  a group whose files all have one size is read again and compared by ``sha256``: equal
  bytes are an **exact** duplicate. Only those files are read twice.
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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from dlpipe.converters.source import SampleError

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
    """One written sample's fingerprints: its image file's size and difference hash."""

    split: str
    key: str
    size: int
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


def find_duplicates(
    prints: Iterable[Fingerprint], read: Callable[[Fingerprint], bytes]
) -> list[DuplicateGroup]:
    """Every group of two or more samples linked by equal or near hashes, sorted; a group is
    exact when its files' bytes are equal (equal bytes decode to equal hashes, so copies
    always share a group).

    Args:
        prints: the samples' fingerprints.
        read: a sample's image file, for the groups whose files have one size (they are
            compared by sha256); a file that cannot be read again leaves its group near.
    """
    items = sorted(prints, key=lambda p: (p.split, p.key))
    links = _Links(len(items))
    first: dict[int, int] = {}
    for i, p in enumerate(items):  # equal hashes
        links.join(first.setdefault(p.dhash, i), i)
    hashes = np.array([p.dhash for p in items], dtype=np.uint64)
    unique, where = np.unique(hashes, return_index=True)
    for a, b in _near_pairs(unique):
        links.join(int(where[a]), int(where[b]))
    found = []
    for members in links.groups():
        group = [items[i] for i in members]
        exact = _same_bytes(group, read)
        found.append(
            DuplicateGroup("exact" if exact else "near", tuple((p.split, p.key) for p in group))
        )
    return sorted(found, key=lambda g: g.members)


def _same_bytes(group: Sequence[Fingerprint], read: Callable[[Fingerprint], bytes]) -> bool:
    """Whether every file of `group` holds the same bytes: sizes first, then the sha256s of
    the files read again."""
    if len({p.size for p in group}) > 1:
        return False
    digests = set()
    for p in group:
        try:
            digest = file_digest(read(p))
        except (OSError, SampleError):
            return False  # changed or gone since it was converted: not known to be a copy
        digests.add(digest)
        if len(digests) > 1:
            return False
    return True


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


def _bits_apart(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """The Hamming distances of two arrays of 64-bit hashes, pair by pair."""
    xor = np.ascontiguousarray(left ^ right)
    return _POPCOUNT[xor.view(np.uint8)].reshape(-1, 8).sum(axis=1)


def _near_pairs(unique: np.ndarray) -> Iterable[tuple[int, int]]:
    """Index pairs of distinct hashes at most `NEAR_BITS` apart: only hashes sharing one of
    ``NEAR_BITS + 1`` blocks are compared (two hashes that close agree on a whole block).

    Per block, the hashes sorted by the block's value put each run of equal values side by
    side; the pairs `step` places apart in that order are compared at once, for each `step`
    up to the longest run."""
    bounds = [64 * b // _BLOCKS for b in range(_BLOCKS + 1)]
    found: set[tuple[int, int]] = set()
    for b in range(_BLOCKS):
        width = bounds[b + 1] - bounds[b]
        keys = (unique >> np.uint64(bounds[b])) & np.uint64((1 << width) - 1)
        order = np.argsort(keys, kind="stable")
        ranked = keys[order]
        step = 1
        while step < len(order):
            same = np.flatnonzero(ranked[step:] == ranked[:-step])
            if not len(same):
                break  # no run is longer than `step`
            left, right = order[same], order[same + step]
            close = _bits_apart(unique[left], unique[right]) <= NEAR_BITS
            found.update(zip(left[close].tolist(), right[close].tolist(), strict=True))
            step += 1
    return sorted((min(a, b), max(a, b)) for a, b in found)


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
