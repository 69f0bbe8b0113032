"""`RawTree`: a raw folder listed by the reading rule of `dlpipe.converters.source`, once.

Every folder is listed with one ``os.scandir``; an entry's kind comes from the directory entry
itself (``d_type``, no system call on Linux), and the only per-entry ``lstat`` is the one that
gives a regular file its size (the shard plan needs it) or a folder its identity (each real
folder is scanned once). A link costs a ``realpath`` and a ``stat`` of its target: it is
followed only to a regular file inside the raw folder, never to a folder.

Auto-detection looks at a few folders before the scan walks the whole tree; the listings it
makes are kept in `Listings` and handed to the scan, which takes each one instead of listing
the folder again. So detection plus the scan list every folder of a class-folder tree once.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dlpipe import storage
from dlpipe.converters.source import (
    SourceError,
    display_path,
    file_problem,
    is_ignored_name,
    log,
    unlistable,
)

__all__ = ["Listings", "RawEntry", "RawTree", "relative_path"]

_MAX_EXAMPLES = 20


@dataclass(frozen=True)
class RawEntry:
    """A regular file or a real folder found in a raw folder (any link already checked)."""

    name: str
    path: str  # as found: a link's own path for a followed file link
    is_dir: bool
    size: int
    ident: tuple[int, int]  # (st_dev, st_ino) of the file or folder itself


@dataclass(frozen=True)
class _Listing:
    """One folder's visible entries, and its skipped entries (shown path → reason)."""

    entries: list[RawEntry]
    skipped: dict[str, str]


class Listings:
    """Folder listings shared by the trees of one conversion (detection's, then the scan's).

    Each listing is made once; the scan's walk takes it (dropping it from here), so no folder
    is listed twice and the listings of a million files are not held beside the scan's items.
    """

    def __init__(self) -> None:
        self._by_folder: dict[str, _Listing] = {}

    def get(self, folder: str) -> _Listing | None:
        """The kept listing of `folder`, or None."""
        return self._by_folder.get(folder)

    def keep(self, folder: str, listing: _Listing) -> None:
        """Keep `listing` for a later tree."""
        self._by_folder[folder] = listing

    def take(self, folder: str) -> _Listing | None:
        """The kept listing of `folder`, no longer kept; None when there is none."""
        return self._by_folder.pop(folder, None)


def relative_path(path: str, folder: str) -> str:
    """`path` relative to `folder`, ``/``-separated; `path` is a walk's path below `folder`
    (built by joining names onto it), so slicing is enough (``os.path.relpath`` normalises
    both paths, a quarter of a million-file scan's time)."""
    prefix = folder.rstrip(os.sep) + os.sep
    assert path.startswith(prefix), (path, folder)
    rel = path[len(prefix) :]
    return rel if os.sep == "/" else rel.replace(os.sep, "/")


class RawTree:
    """Lists a raw folder by the rule in the module docstring, recording every skipped entry.

    Args:
        root: the raw folder.
        listings: listings already made of its folders (by detection); new ones are added.
    """

    def __init__(self, root: str, listings: Listings | None = None) -> None:
        self.folder = os.path.realpath(root)
        self.skipped: dict[str, str] = {}  # shown path -> reason, in the order found
        self._listings = listings if listings is not None else Listings()
        try:
            info = os.stat(self.folder)
        except OSError as exc:
            raise SourceError(f"{display_path(root)}: cannot be read ({exc.strerror})") from exc
        self._seen: set[tuple[int, int]] = {(info.st_dev, info.st_ino)}

    def skip(self, path: str, reason: str) -> None:
        """Record one entry that is not read, and why."""
        self.skipped.setdefault(display_path(path), reason)

    def listing(self, folder: str) -> list[RawEntry]:
        """The visible regular files and real folders of `folder`, sorted by name (listed
        once: kept for later calls and trees).

        Raises:
            SourceError: `folder` cannot be listed (a class would silently lose its images).
        """
        found = self._listings.get(folder)
        if found is None:
            found = self._list(folder)
            self._listings.keep(folder, found)
        return self._replay(found)

    def _take(self, folder: str) -> list[RawEntry]:
        """`listing`, for a walk that reads `folder` only this once (not kept)."""
        return self._replay(self._listings.take(folder) or self._list(folder))

    def _replay(self, found: _Listing) -> list[RawEntry]:
        for path, reason in found.skipped.items():
            self.skipped.setdefault(path, reason)
        return found.entries

    def _list(self, folder: str) -> _Listing:
        try:
            with os.scandir(folder) as it:
                found = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            raise unlistable(folder, exc) from exc
        entries: list[RawEntry] = []
        skipped: dict[str, str] = {}
        for dir_entry in found:
            if is_ignored_name(dir_entry.name):
                continue
            entry = self._entry(dir_entry)
            if isinstance(entry, str):
                skipped.setdefault(display_path(dir_entry.path), entry)
            else:
                entries.append(entry)
        return _Listing(entries, skipped)

    def _entry(self, entry: os.DirEntry[str]) -> RawEntry | str:
        """The entry, or why it is skipped; kinds from ``d_type``, one lstat for size/ident."""
        try:
            if entry.is_symlink():
                return self._link(entry)
            is_dir = entry.is_dir(follow_symlinks=False)
            if not (is_dir or entry.is_file(follow_symlinks=False)):
                return storage.file_kind(entry.stat(follow_symlinks=False).st_mode)
            info = entry.stat(follow_symlinks=False)
        except OSError as exc:
            return f"cannot be read ({exc.strerror or exc})"
        if not (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)):  # replaced since
            return storage.file_kind(info.st_mode)
        return RawEntry(entry.name, entry.path, is_dir, info.st_size, (info.st_dev, info.st_ino))

    def _link(self, entry: os.DirEntry[str]) -> RawEntry | str:
        problem = file_problem(entry.path, self.folder)
        if problem == "a folder":
            problem = "a link to a folder (folder links are not followed)"
        if problem is not None:
            return problem
        try:
            info = os.stat(entry.path)
        except OSError as exc:  # replaced since the check
            return f"cannot be read ({exc.strerror or exc})"
        return RawEntry(entry.name, entry.path, False, info.st_size, (info.st_dev, info.st_ino))

    def claim(self, folder: RawEntry) -> bool:
        """Mark a real folder as scanned; False (one skipped entry) when it already was."""
        if folder.ident in self._seen:
            self.skip(folder.path, "a second name for a folder already scanned (a mount loop)")
            return False
        self._seen.add(folder.ident)
        return True

    def folders(self, folder: str) -> list[RawEntry]:
        """The visible real folders of `folder`, sorted (files in it are not looked at)."""
        return [e for e in self.listing(folder) if e.is_dir]

    def files(self, top: str, *, keep: bool = False) -> Iterator[RawEntry]:
        """Every regular file below the folder `top`, each real folder once, sorted per folder.

        Args:
            top: the folder to walk.
            keep: keep the listings for a later tree (detection's peek); by default the walk
                takes them, as the scan reads each folder once.
        """
        stack = [top]
        while stack:
            folder = stack.pop()
            subfolders = []
            for entry in self.listing(folder) if keep else self._take(folder):
                if not entry.is_dir:
                    yield entry
                elif self.claim(entry):
                    subfolders.append(entry.path)
            stack.extend(reversed(subfolders))

    def report(self) -> dict[str, Any]:
        """The skipped entries for a scan description (count and the first 20), logged once."""
        skipped = list(self.skipped.items())
        if skipped:
            shown = "; ".join(f"{path} ({why})" for path, why in skipped[:3])
            more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
            log.warning(
                "%s: skipped %d entries that are not regular files inside the raw folder: %s%s",
                display_path(self.folder),
                len(skipped),
                shown,
                more,
            )
        examples = [{"path": p, "reason": r} for p, r in skipped[:_MAX_EXAMPLES]]
        return {"skipped_entries": len(skipped), "skipped_examples": examples}
