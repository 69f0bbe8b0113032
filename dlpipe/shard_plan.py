"""A reader's future shard order, and the two eviction rules the shard cache chooses between.

`ShardPlan` holds the order a reader announced and how far it has read, and answers the
questions prefetch and eviction ask of it: which shards come next (`window`) and when a shard
is needed again (`next_use`). `pick_victim` applies a policy to the evictable shards: by next
use (Belady's rule: the one needed furthest ahead, or never, goes; only if that is later than
the shard it makes room for) or by least recent use (LRU, for comparison).
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Literal

__all__ = ["BELADY", "LRU", "ShardPlan", "pick_victim"]

BELADY: Literal["belady"] = "belady"
LRU: Literal["lru"] = "lru"


class ShardPlan:
    """The shards one reader takes next, in order, and a cursor past the ones it took."""

    def __init__(self, order: Sequence[str] = ()) -> None:
        self.order, self.cursor = list(order), 0
        self._uses: dict[str, list[int]] = {}
        for position, name in enumerate(self.order):
            self._uses.setdefault(name, []).append(position)
        self._touched: dict[str, int] = {}
        self._clock = 0

    def next_use(self, name: str) -> int | None:
        """The first position of `name` at or after the cursor (None: not again)."""
        uses = self._uses.get(name, [])
        at = bisect.bisect_left(uses, self.cursor)
        return uses[at] if at < len(uses) else None

    def take(self, name: str) -> None:
        """The reader takes `name`: the cursor moves past its next use (if it has one), and it
        becomes the most recently used shard."""
        position = self.next_use(name)
        if position is not None:
            self.cursor = position + 1
        self._clock += 1
        self._touched[name] = self._clock

    def last_used(self, name: str) -> int:
        """When `name` was last taken (a counter; -1: never)."""
        return self._touched.get(name, -1)

    def window(
        self, depth: int, room_bytes: int, sizes: Mapping[str, int]
    ) -> Iterator[tuple[int, str]]:
        """(first position, name) of the next `depth` distinct shards from the cursor, as many
        as fit in `room_bytes` (at least one)."""
        seen: set[str] = set()
        for position in range(self.cursor, len(self.order)):
            name = self.order[position]
            if name not in seen:
                room_bytes -= sizes[name]
                if len(seen) >= depth or (seen and room_bytes < 0):
                    return
                seen.add(name)
                yield position, name


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
    after `position`; of those this reader never uses, the one `born` (downloaded) first:
    in a folder shared by several readers, a shard another reader fetched just now is
    likely its next, one fetched long ago likely done with. LRU: the least recently taken
    candidate that is not `protected` (the prefetch window, which LRU cannot rank). None
    when no candidate qualifies.
    """
    if policy == LRU:
        allowed = [n for n in candidates if n not in protected]
        return min(allowed, key=plan.last_used, default=None)
    never, born = len(plan.order) + 1, born or {}
    ranked = {n: never if (p := plan.next_use(n)) is None else p for n in candidates}
    farthest = max(ranked, key=lambda n: (ranked[n], -born.get(n, 0)), default=None)
    limit = -1 if position is None else position
    return farthest if farthest is not None and ranked[farthest] > limit else None
