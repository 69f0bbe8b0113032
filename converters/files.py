"""``files``: loose files grouped into samples by name, the WebDataset way.

Layout: ``root/**/<stem>.<ext>`` where the files of one sample share a path up to the first
dot of the file name (``0001.jpg``, ``0001.json``, ``0001.cls`` → one sample ``0001`` with
fields ``jpg``, ``json``, ``cls``). An optional ``split`` top folder (``root/train/``,
``root/val/``, ``root/test/``) names the split. Every sample must carry the same fields.

Produces one sample per group: the image file (if any, by image suffix, with one extension) as
the image, every other file as the field its extension names, lower-cased (``0001.JSON`` →
``json``, ``0001.seg.png`` → ``seg.png``: a mask, ``0001.boxes.json`` → ``boxes.json``, checked
against the image as `dlpipe.annotations` says). A ``cls``
file is the label (ASCII decimal); ``classes.txt`` at the root, one name per line, names them.
The key is the group's path relative to its split folder, escaped by the key rule (shortened
by `dlpipe.sample.make_key` when too long; the item's ``original`` keeps the full name).

Read as every source reads a raw folder (`dlpipe.converters.source`): regular files only,
hidden and OS/tool names skipped, file links followed only inside the root, folder links not
followed; special files and links out are listed as skipped entries in the scan description.
With split folders, the files beside them (a README, other folders) and a ``classes.txt``
inside one are not read: ``source.unused`` counts them (images by their suffix, the rest as
other).
"""

from __future__ import annotations

import itertools
import os
from collections import defaultdict

from dlpipe.converters.listed import count_unused
from dlpipe.converters.raw_tree import Listings, RawEntry, RawTree, relative_path
from dlpipe.converters.source import (
    SPLIT_NAMES,
    Item,
    SampleError,
    Scan,
    Source,
    SourceError,
    display_path,
    image_kind_of_name,
    read_file,
    read_text,
)
from dlpipe.errors import InvalidFieldError
from dlpipe.sample import check_field_name, make_key

__all__ = ["FilesSource"]

_CLASSES_FILE = "classes.txt"
_MAX_CLASSES_BYTES = 64 << 20
_MAX_LABEL_BYTES = 4096


class FilesSource(Source):
    kind = "files"

    @classmethod
    def detect(cls, root: str, listings: Listings | None = None) -> bool:
        """Files that share stems with several extensions (a folder of class folders is not);
        looks at the first 2,000 files, keeping the listings made for the scan."""
        if not os.path.isdir(root):
            return False
        stems: dict[str, set[str]] = defaultdict(set)
        try:
            for entry in itertools.islice(RawTree(root, listings).files(root, keep=True), 2000):
                stem, _, ext = entry.name.partition(".")
                if ext.partition(".")[0].isdigit():  # cat.0.jpg: a label and a number
                    stem, ext = os.path.splitext(entry.name)
                stems[os.path.join(os.path.dirname(entry.path), stem)].add(ext)
        except SourceError:
            return False
        return bool(stems) and sum(len(e) > 1 for e in stems.values()) > len(stems) // 2

    def _split_folders(self, tree: RawTree) -> dict[str | None, str]:
        entries = {e.name: e for e in tree.listing(self.root)}
        subdirs = [d for d in sorted(entries) if d in SPLIT_NAMES]
        if subdirs and all(entries[d].is_dir for d in subdirs):
            return {SPLIT_NAMES[d]: entries[d].path for d in subdirs}
        return {None: self.root}

    def scan(self) -> Scan:
        tree = RawTree(self.root, self.take_listings())
        classes = self._classes()
        folders = self._split_folders(tree)
        files = list(tree.files(self.root))
        items: list[Item] = []
        read: set[str] = set()
        for split, folder in folders.items():
            below = [e for e in files if e.path.startswith(folder + os.sep)]
            items += self._scan_split(split, folder, below)
            read |= {e.path for e in below if relative_path(e.path, folder) != _CLASSES_FILE}
        read.add(os.path.join(self.root, _CLASSES_FILE))  # read by _classes when there
        unread = [relative_path(e.path, self.root) for e in files if e.path not in read]
        if not items:
            raise SourceError(f"{display_path(self.root)}: no files to group into samples")
        fields = {
            tuple(sorted(item.ref)) + (("cls",) if item.label is not None else ()) for item in items
        }
        if len(fields) > 1:
            shapes = ", ".join("+".join(f) for f in sorted(fields)[:4])
            raise SourceError(
                f"{self.root}: samples carry different fields ({shapes}); every sample needs "
                "the same files (add the missing ones or remove the extra)"
            )
        description = {
            "kind": self.kind,
            "root": display_path(self.root),
            "layout": _layout_text(folders, next(iter(fields))),
            "unused": count_unused(unread),
            **tree.report(),
        }
        return Scan(classes=classes, items=tuple(items), description=description)

    def _classes(self) -> tuple[str, ...]:
        path = os.path.join(self.root, _CLASSES_FILE)
        if not os.path.lexists(path):
            return ()
        fix = "classes.txt holds one UTF-8 class name a line: fix or remove it"
        text = read_text(path, self.raw_folder, max_bytes=_MAX_CLASSES_BYTES, fix=fix)
        return tuple(line.strip() for line in text.splitlines() if line.strip())

    def _scan_split(self, split: str | None, folder: str, files: list[RawEntry]) -> list[Item]:
        """The items of the `files` below `folder` (one split's)."""
        groups: dict[str, dict[str, RawEntry]] = defaultdict(dict)
        for entry in files:
            rel = relative_path(entry.path, folder)
            if rel == _CLASSES_FILE:
                continue
            head, _, name = rel.rpartition("/")
            stem, _, ext = name.partition(".")
            field = "image" if image_kind_of_name(name) and "." not in ext else ext.lower()
            try:
                check_field_name(field)
            except InvalidFieldError as exc:
                raise SourceError(
                    f"{display_path(entry.path)}: its extension {ext!r} cannot name a field "
                    f"({exc}); rename or remove the file"
                ) from exc
            group = groups[f"{head}/{stem}" if head else stem]
            if field in group:
                raise SourceError(
                    f"{display_path(entry.path)}: a second image for sample "
                    f"{display_path(stem)!r} ({display_path(group[field].path)})"
                )
            group[field] = entry
        return [self._item(split, key, files) for key, files in sorted(groups.items())]

    def _label(self, entry: RawEntry) -> int:
        try:
            raw = read_file(entry.path, self.raw_folder, max_bytes=_MAX_LABEL_BYTES)
        except SampleError as exc:
            raise SourceError(f"{exc}; fix or remove the label file") from exc
        text = raw.decode("ascii", "replace").strip()
        if not text.lstrip("-").isdigit():
            raise SourceError(f"{display_path(entry.path)}: label {text!r} is not an integer")
        return int(text)

    def _item(self, split: str | None, key: str, files: dict[str, RawEntry]) -> Item:
        label = self._label(files["cls"]) if "cls" in files else None
        kind = image_kind_of_name(files["image"].name) if "image" in files else None
        fields = {f: e for f, e in files.items() if f != "cls"}
        made, shortened = make_key(key)
        return Item(
            key=made,
            label=label,
            split=split,
            ref={f: e.path for f, e in fields.items()},
            size=sum(e.size for e in fields.values()),
            image_kind=kind,
            origin=display_path(next(iter(fields.values())).path) if fields else key,
            original=display_path(key) if shortened else None,
        )

    def load(self, item: Item) -> dict[str, bytes]:
        fields = {name: read_file(path, self.raw_folder) for name, path in item.ref.items()}
        if not fields:
            raise SampleError(f"{item.origin}: sample {item.key!r} has no fields besides cls")
        return fields


def _layout_text(folders: dict[str | None, str], fields: tuple[str, ...]) -> str:
    """Which files made the samples: grouped by stem, at the top or in the split folders."""
    where = "at its top"
    if None not in folders:
        where = "in " + ", ".join(f"{display_path(os.path.basename(f))}/" for f in folders.values())
    return f"files {where} grouped by stem into samples of {', '.join(fields)}"
