"""A rank's future shard order, one reader's place in it, and the two eviction rules the shard
cache chooses between.

`ShardPlan` holds the order a rank's readers take shards in (every DataLoader worker of it,
merged in the order they read in time), which of those uses are this reader's, and how far
this reader has read; it answers the questions prefetch and eviction ask of it: which of this
reader's shards come next (`window`) and when any reader needs a shard again (`next_use`).
`pick_victim` applies a policy to the evictable shards: by next use (Belady's rule: the one
needed furthest ahead, or never, goes; only if that is later than the shard it makes room for)
or by least recent use (LRU, for comparison).
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Literal

__all__ = ["BELADY", "LRU", "ShardPlan", "pick_victim"]

BELADY: Literal["belady"] = "belady"
LRU: Literal["lru"] = "lru"


class ShardPlan:
    """The shards the rank's readers take next, in order, the positions that are this reader's
    (`mine`; None: every one), and a cursor past this reader's last use taken.

    The cursor moves only along this reader's own uses, so reading a shard that other readers
    also use later never skips their uses in between.
    """

    def __init__(self, order: Sequence[str] = (), mine: Sequence[int] | None = None) -> None:
        self.order, self.cursor = list(order), 0
        self._mine = list(range(len(self.order))) if mine is None else sorted(mine)
        self._uses: dict[str, list[int]] = {}
        self._own: dict[str, list[int]] = {}
        for position, name in enumerate(self.order):
            self._uses.setdefault(name, []).append(position)
        for position in self._mine:
            self._own.setdefault(self.order[position], []).append(position)
        self._touched: dict[str, int] = {}
        self._clock = 0
        self._last: str | None = None

    def next_use(self, name: str) -> int | None:
        """The first position of `name` (any reader's use) at or after the cursor (None: not
        again)."""
        return _first_from(self._uses.get(name, []), self.cursor)

    def take(self, name: str) -> None:
        """This reader takes `name`: the cursor moves past its own next use of it (if it has
        one), and it becomes the most recently used shard. Taking the shard just taken again
        (one use read sample by sample) stays on that use unless this reader's very next use
        is of it."""
        position = _first_from(self._own.get(name, []), self.cursor)
        if position is not None and (name != self._last or position == self._next_own()):
            self.cursor = position + 1
        self._clock += 1
        self._touched[name] = self._clock
        self._last = name

    def last_used(self, name: str) -> int:
        """When `name` was last taken (a counter; -1: never)."""
        return self._touched.get(name, -1)

    def window(
        self, depth: int, room_bytes: int, sizes: Mapping[str, int]
    ) -> Iterator[tuple[int, str]]:
        """(first position, name) of this reader's next `depth` distinct shards from the
        cursor, as many as fit in `room_bytes` (at least one)."""
        seen: set[str] = set()
        for at in range(bisect.bisect_left(self._mine, self.cursor), len(self._mine)):
            position = self._mine[at]
            name = self.order[position]
            if name not in seen:
                room_bytes -= sizes[name]
                if len(seen) >= depth or (seen and room_bytes < 0):
                    return
                seen.add(name)
                yield position, name

    def _next_own(self) -> int | None:
        return _first_from(self._mine, self.cursor)


def _first_from(positions: list[int], cursor: int) -> int | None:
    """The first of the sorted `positions` at or after `cursor` (None: none)."""
    at = bisect.bisect_left(positions, cursor)
    return positions[at] if at < len(positions) else None


def pick_victim(
    plan: ShardPlan,
    policy: Literal["belady", "lru"],
    candidates: Collection[str],
    position: int | None,
    protected: Collection[str] = (),
    born: Mapping[str, int] | None = None,
) -> str | None:
    """The shard of `candidates` to evict for one used at `position` (None: not in the plan).

    Belady: the candidate used furthest ahead (never counts as furthest), only if that is
    after `position`; of those the plan never uses, the one `born` (downloaded) first: in
    a folder shared by readers the plan does not know (other ranks), a shard another
    fetched just now is likely its next, one fetched long ago likely done with. LRU: the
    least recently taken candidate that is not `protected` (the prefetch window, which LRU
    cannot rank). None when no candidate qualifies.
    """
    if policy == LRU:
        allowed = [n for n in candidates if n not in protected]
        return min(allowed, key=plan.last_used, default=None)
    never, born = len(plan.order) + 1, born or {}
    ranked = {n: never if (p := plan.next_use(n)) is None else p for n in candidates}
    farthest = max(ranked, key=lambda n: (ranked[n], -born.get(n, 0)), default=None)
    limit = -1 if position is None else position
    return farthest if farthest is not None and ranked[farthest] > limit else None
