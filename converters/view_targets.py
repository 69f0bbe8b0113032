"""What a placeholder of an unpacked view stands for (`dlpipe.converters.archive_view`
builds the views): `target_of` maps a path in a view to its archive member or raw file, and
`shown_path` names it as the user knows it. Every raw read asks (`converters.source`), so the
check for a path outside any view is a string comparison."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import IO, Any

from dlpipe import storage
from dlpipe.converters.archive_reads import member_file, read_member
from dlpipe.converters.archives import Member
from dlpipe.converters.source import SampleError, open_regular, read_file

__all__ = ["VIEW_MAP", "Target", "load_map", "shown_path", "target_of", "views_root"]

_VIEWS = "raw-views"
VIEW_MAP = ".dlpipe-view.json"  # in each view: its listing and map


def views_root() -> str:
    """The real path of the views' folder (every raw read asks: two lookups, then cached)."""
    return _real_views_root(os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"))


@functools.lru_cache(maxsize=4)
def _real_views_root(cache: str | None, home: str | None) -> str:
    del cache, home  # the cache's key: user_cache reads them
    return os.path.realpath(storage.user_cache(_VIEWS))  # walks build paths from real paths


@dataclass(frozen=True)
class Target:
    """What a view's placeholder stands for: a file of RAW, or an archive member."""

    shown: str
    size: int
    raw_file: str | None = None
    raw_folder: str | None = None
    archive: tuple[str, str, tuple[int, int], str | None] | None = None  # path, kind, stamp, gzi
    member: Member | None = None

    def read(self) -> bytes:
        if self.raw_file is not None:
            return read_file(self.raw_file, self.raw_folder)
        assert self.archive is not None and self.member is not None
        return read_member(*self.archive[:3], self.member, self.archive[3])

    def open(self) -> IO[bytes]:
        if self.raw_file is not None:
            return open_regular(self.raw_file, self.raw_folder)
        assert self.archive is not None and self.member is not None
        return member_file(*self.archive[:3], self.member, self.archive[3])


@functools.lru_cache(maxsize=4)
def load_map(view: str) -> dict[str, Any]:
    with open(os.path.join(view, VIEW_MAP), encoding="utf-8") as f:
        loaded: dict[str, Any] = json.load(f)
    return loaded


def _split(path: str) -> tuple[str, str] | None:
    """(the view folder, the path in it) for a path inside a view; None otherwise."""
    root = views_root() + os.sep
    if not path.startswith(root):
        return None
    digest, _, rel = path[len(root) :].partition(os.sep)
    if digest == "indexes" or not digest:
        return None
    return os.path.join(root, digest), rel


def target_of(path: str) -> Target | None:
    """What the view's placeholder `path` stands for; None for a path in no view.

    Raises:
        SampleError: `path` lies in a view but is no file of it.
    """
    found = _split(path if path.startswith(os.sep) else os.path.abspath(path))
    if found is None:
        return None
    view, rel = found
    try:
        listing = load_map(view)
    except (OSError, ValueError) as exc:
        raise SampleError(f"{path}: the unpacked view is gone ({exc}); convert again") from None
    entry = listing["files"].get(rel.replace(os.sep, "/"))
    if entry is None:
        raise SampleError(f"{shown_path(path)}: no file of the archives or the raw folder")
    number, where, size = entry
    if number < 0:
        real = listing["real"]
        raw_file = os.path.join(real, rel)
        return Target(raw_file, size, raw_file=raw_file, raw_folder=os.path.realpath(real))
    apath, kind, stamp, gzi = listing["archives"][number]
    return Target(
        f"{apath}/{rel}",
        size,
        archive=(apath, kind, (stamp[0], stamp[1]), gzi),
        member=Member(rel, size, where),
    )


def shown_path(path: str) -> str:
    """`path` as the user knows it: a view's path as its archive member or raw file, the
    view's folders as the raw folder's (unchanged outside views)."""
    found = _split(os.path.abspath(path)) if path.startswith(os.sep) else None
    if found is None:
        return path
    view, rel = found
    try:
        listing = load_map(view)
    except (OSError, ValueError):
        return path
    entry = listing["files"].get(rel.replace(os.sep, "/"))
    if entry is not None and entry[0] >= 0:
        return f"{listing['archives'][entry[0]][0]}/{rel}"
    return os.path.join(listing["base"], rel) if rel else listing["base"]
