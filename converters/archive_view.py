"""Raw data as unpacked: archives given as RAW, or lying at its top, read in place.

`unpacked_view` decides whether RAW needs reading through its archives: RAW is a ``.zip``,
``.tar`` or ``.tar.gz`` (or a folder inside one: ``train.zip/train``), or a folder whose top
holds such archives that are not unpacked beside them already. Then it builds a `View`: a
folder in the user cache (``raw-views/<id>``) mirroring RAW as unpacking every archive where
it lies would make it, every file in it an empty placeholder of the real size, and a map
from each placeholder to what it stands for (a file of RAW, or an archive member).

Sources detect and scan the view unchanged (names, folders and sizes are all there); the
readers of `dlpipe.converters.source` read a placeholder's target instead (`target_of`), so
image bytes come straight out of the archive, and `display_path` names a placeholder by its
archive and member (``coco/train2017.zip/train2017/1.jpg``). Keys are the paths as unpacked,
so converting the archives and converting what they unpack to give the same dataset.

Where the two disagree the files on disk win: a member whose path a file of RAW already has
is skipped, as is a member replaced by a later one of the same name, a member under a name
another member uses for a file, and what `dlpipe.converters.archives` refuses. A folder of
tars that read as WebDataset shards is no archive: the ``webdataset`` source reads it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any

from dlpipe import storage
from dlpipe.converters.archives import (
    Archive,
    Member,
    archive_kind,
    index_archive,
    looks_like_shard,
    refuse_unreadable_archive,
    top_names,
)
from dlpipe.converters.source import SourceError, display_path, is_ignored_name
from dlpipe.converters.view_targets import VIEW_MAP, load_map, views_root

__all__ = ["View", "unpacked_view"]

log = logging.getLogger("dlpipe")

_MAX_EXAMPLES = 20


@dataclass(frozen=True)
class View:
    """RAW as unpacked: `root` is the folder the sources read (the view, or a folder in it)."""

    root: str
    archives: tuple[str, ...]
    members: int
    already_unpacked: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]

    def report(self) -> dict[str, Any]:
        """The archives read, for the scan description (``source.archives``)."""
        if self.skipped:
            shown = "; ".join(f"{path} ({why})" for path, why in self.skipped[:3])
            more = f" and {len(self.skipped) - 3} more" if len(self.skipped) > 3 else ""
            log.warning("skipped %d archive members: %s%s", len(self.skipped), shown, more)
        return {
            "read": list(self.archives),
            "members": self.members,
            "already_unpacked": list(self.already_unpacked),
            "skipped_members": len(self.skipped),
            "skipped_examples": [{"path": p, "reason": r} for p, r in self.skipped[:_MAX_EXAMPLES]],
        }


def unpacked_view(raw: str) -> View | None:
    """The view of `raw` (module docstring), or None when nothing in it is an archive to read.

    Raises:
        SourceError: an archive cannot be read (damaged, a bomb, a compression without random
            access), or `raw` names a folder inside an archive that the archive lacks.
    """
    if storage.is_url(raw):
        return None  # archives are read from local disk only
    given = os.path.abspath(raw)
    base, rest = _existing_base(given)
    if os.path.isfile(base):
        refuse_unreadable_archive(base)
        if archive_kind(base) is None or looks_like_shard(base):
            return None
        archives, real = [base], None
        already: list[str] = []
    elif os.path.isdir(base):
        archives, already = _top_archives(base)
        if not archives:
            return None
        real = base
    else:
        return None
    view = _Builder(base, real, archives).build()
    root = os.path.join(view, rest) if rest else view
    if rest and not os.path.lexists(root):
        raise SourceError(
            f"{display_path(given)} does not exist: {display_path(base)} holds no "
            f"{display_path(rest)}; give the archive, or a folder it holds"
        )
    built = load_map(view)
    return View(
        root=root,
        archives=tuple(display_path(a) for a in archives),
        members=sum(1 for entry in built["files"].values() if entry[0] >= 0),
        already_unpacked=tuple(display_path(a) for a in already),
        skipped=tuple((p, r) for p, r in built["skipped"]),
    )


def _existing_base(path: str) -> tuple[str, str]:
    """`path`'s deepest existing ancestor (itself when it exists) and the rest below it."""
    base, rest = path, ""
    while not os.path.lexists(base):
        parent = os.path.dirname(base)
        if parent == base:
            break
        rest = os.path.join(os.path.basename(base), rest) if rest else os.path.basename(base)
        base = parent
    return base, rest


def _top_archives(folder: str) -> tuple[list[str], list[str]]:
    """The archives at `folder`'s top to read, and those already unpacked beside them; none
    when a tar there reads as a WebDataset shard."""
    try:
        names = sorted(n for n in os.listdir(folder) if not is_ignored_name(n))
    except OSError:
        return [], []
    found = [
        os.path.join(folder, n)
        for n in names
        if archive_kind(n)
        and os.path.isfile(os.path.join(folder, n))
        and not os.path.islink(os.path.join(folder, n))
    ]
    if any(archive_kind(p) != "zip" and looks_like_shard(p) for p in found):
        return [], []
    mounted: list[str] = []
    already: list[str] = []
    for path in found:
        tops = top_names(path)
        unpacked = bool(tops) and all(os.path.lexists(os.path.join(folder, t)) for t in tops)
        (already if unpacked else mounted).append(path)
    if already:
        shown = ", ".join(map(display_path, already))
        log.info("already unpacked beside them, not read: %s", shown)
    return mounted, already


class _Builder:
    """Lists RAW's files and its archives' members into one map, then makes the view."""

    def __init__(self, base: str, real: str | None, archives: list[str]) -> None:
        self.base, self.real, self.archives = base, real, archives
        self.files: dict[str, list[Any]] = {}  # rel → [archive index or -1, where, size]
        self.folders: set[str] = set()
        self.skipped: list[tuple[str, str]] = []

    def build(self) -> str:
        if self.real is not None:
            self._real_files()
        indexed = [_indexed(path) for path in self.archives]
        for number, (archive, _) in enumerate(indexed):
            self._members(number, archive)
        self._refuse_nested()
        listing = {
            "base": self.base,
            "real": self.real,
            "archives": [[a.path, a.kind, list(a.stamp), gzi] for a, gzi in indexed],
            "files": self.files,
            "folders": sorted(self.folders),
            "skipped": self.skipped,
        }
        text = json.dumps(listing, sort_keys=True, ensure_ascii=False)
        digest = hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:20]
        view = os.path.join(views_root(), digest)
        if not os.path.isdir(view):
            _make_view(view, text, self.files, self.folders)
        return view

    def _real_files(self) -> None:
        from dlpipe.converters.raw_tree import RawTree, relative_path

        assert self.real is not None
        tree = RawTree(self.real)
        mounted = set(self.archives)
        stack = [self.real]
        while stack:
            folder = stack.pop()
            for entry in tree.listing(folder):
                rel = relative_path(entry.path, self.real)
                if entry.is_dir:
                    if tree.claim(entry):
                        self.folders.add(rel)
                        stack.append(entry.path)
                elif entry.path not in mounted:
                    self.files[rel] = [-1, 0, entry.size]
        self.skipped += list(tree.skipped.items())

    def _members(self, number: int, archive: Archive) -> None:
        shown = display_path(archive.path)
        self.skipped += [(f"{shown}/{n}", why) for n, why in archive.skipped.items()]
        for name in sorted(archive.folders):
            if not _hidden(name) and not self._file_above(name) and name not in self.files:
                self.folders.add(name)
        for member in archive.members:
            name = member.name
            if _hidden(name):
                continue
            why = self._conflict(name, number)
            if why is not None:
                self.skipped.append((f"{shown}/{name}", why))
                continue
            if name in self.files:  # the same archive names it twice: the later member is read
                self.skipped.append((f"{shown}/{name}", "replaced by a later member of one name"))
            self.files[name] = [number, member.where, member.size]
            parent = os.path.dirname(name)
            while parent and parent not in self.folders:
                self.folders.add(parent)
                parent = os.path.dirname(parent)

    def _refuse_nested(self) -> None:
        """Archives packed at an archive's top (Kaggle's ``dogs-vs-cats.zip`` holds
        ``train.zip``): reading them in place would need a copy, so say how to unpack."""
        nested = sorted(
            name
            for name, (number, _, _) in self.files.items()
            if number >= 0 and "/" not in name and archive_kind(name)
        )
        if nested:
            outer = self.archives[self.files[nested[0]][0]]
            shown = ", ".join(display_path(n) for n in nested[:3])
            folder = display_path(os.path.splitext(outer)[0])
            raise SourceError(
                f"{display_path(outer)} holds archives ({shown}); dlpipe reads archives in "
                f"place but not one inside another: unpack the outer one (`unzip -d {folder} "
                f"{display_path(outer)}` or `tar xf`) and convert {folder}, whose archives are "
                "then read in place"
            )

    def _conflict(self, name: str, number: int) -> str | None:
        earlier = self.files.get(name)
        if earlier is not None and earlier[0] == -1:
            return "already unpacked beside the archive (the file on disk is read)"
        if earlier is not None and earlier[0] != number:
            return f"also in {display_path(self.archives[earlier[0]])} (that one is read)"
        if name in self.folders or self._file_above(name):
            return "a file and a folder of one name in the archive"
        return None

    def _file_above(self, name: str) -> bool:
        parent = os.path.dirname(name)
        while parent:
            if parent in self.files:
                return True
            parent = os.path.dirname(parent)
        return False


def _hidden(name: str) -> bool:
    return any(is_ignored_name(part) for part in name.split("/"))


def _indexed(path: str) -> tuple[Archive, str | None]:
    """The archive's listing, from the cache when it was listed at this size and time."""
    info = os.stat(path)
    key = f"{os.path.realpath(path)}\0{info.st_size}\0{info.st_mtime_ns}"
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:20]
    folder = os.path.join(views_root(), "indexes")
    listing = os.path.join(folder, f"{digest}.json")
    gzi = os.path.join(folder, f"{digest}.gzi") if archive_kind(path) == "tgz" else None
    try:
        with open(listing, encoding="utf-8") as f:
            saved = json.load(f)
        archive = Archive(path, saved["kind"], (saved["stamp"][0], saved["stamp"][1]))
        archive.members = [Member(*m) for m in saved["members"]]
        archive.folders = set(saved["folders"])
        archive.skipped = dict(saved["skipped"])
        if gzi is None or os.path.isfile(gzi):
            return archive, gzi
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not listed yet (or a damaged cache entry): list it again
    log.info("listing %s (once: the listing is kept in %s)", display_path(path), folder)
    os.makedirs(folder, exist_ok=True)
    staged_gzi = f"{gzi}.{os.getpid()}.tmp" if gzi else None
    archive = index_archive(path, staged_gzi)
    if gzi is not None and staged_gzi is not None:
        os.replace(staged_gzi, gzi)
    saved = {
        "kind": archive.kind,
        "stamp": list(archive.stamp),
        "members": [[m.name, m.size, m.where] for m in archive.members],
        "folders": sorted(archive.folders),
        "skipped": archive.skipped,
    }
    storage.atomic_write_bytes(
        listing, json.dumps(saved, ensure_ascii=False).encode("utf-8", "surrogateescape")
    )
    return archive, gzi


def _make_view(view: str, text: str, files: dict[str, list[Any]], folders: set[str]) -> None:
    """Make the view's folders and placeholders in a staging folder, then rename it in place
    (a view is complete or absent; two runs building one keep the first)."""
    staging = f"{view}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        for folder in sorted(folders):
            os.makedirs(os.path.join(staging, folder), exist_ok=True)
        for rel, (_, _, size) in files.items():
            fd = os.open(os.path.join(staging, rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.ftruncate(fd, size)  # sparse: no data, the size the scan plans with
            finally:
                os.close(fd)
        with open(os.path.join(staging, VIEW_MAP), "w", encoding="utf-8") as f:
            f.write(text)
        os.rename(staging, view)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if not os.path.isdir(view):
            raise SourceError(
                f"cannot make the unpacked view of the archives in {display_path(view)} "
                f"({exc.strerror or exc}); set XDG_CACHE_HOME to a writable folder with free "
                "inodes, or unpack the archives and convert the folder"
            ) from None
