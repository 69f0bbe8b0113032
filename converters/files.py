"""``files``: loose files grouped into samples by name, the WebDataset way.

Layout: ``root/**/<stem>.<ext>`` where the files of one sample share a path up to the first
dot of the file name (``0001.jpg``, ``0001.json``, ``0001.cls`` → one sample ``0001`` with
fields ``jpg``, ``json``, ``cls``). An optional ``split`` top folder (``root/train/``,
``root/val/``, ``root/test/``) names the split. Every sample must carry the same fields.

Produces one sample per group: the image file (if any, by image suffix) as the image, every
other file as the field its extension names, lower-cased (``0001.JSON`` → ``json``). A ``cls``
file is the label (ASCII decimal); ``classes.txt`` at the root, one name per line, names them.
The key is the group's path relative to its split folder, escaped by the key rule.
"""

from __future__ import annotations

import os
from collections import defaultdict

from dlpipe.converters.source import (
    SPLIT_NAMES,
    Item,
    SampleError,
    Scan,
    Source,
    SourceError,
    image_kind_of_name,
    read_file,
)
from dlpipe.sample import check_field_name, escape_key

__all__ = ["FilesSource"]

_CLASSES_FILE = "classes.txt"


def _walk(folder: str) -> list[str]:
    paths = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        paths += [os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith(".")]
    return paths


class FilesSource(Source):
    kind = "files"

    @classmethod
    def detect(cls, root: str) -> bool:
        """Files that share stems with several extensions (a folder of class folders is not)."""
        if not os.path.isdir(root):
            return False
        stems: dict[str, set[str]] = defaultdict(set)
        for path in _walk(root)[:2000]:
            stem, _, ext = os.path.basename(path).partition(".")
            stems[os.path.join(os.path.dirname(path), stem)].add(ext)
        return bool(stems) and sum(len(e) > 1 for e in stems.values()) > len(stems) // 2

    def _split_folders(self) -> dict[str | None, str]:
        subdirs = [d for d in sorted(os.listdir(self.root)) if d in SPLIT_NAMES]
        if subdirs and all(os.path.isdir(os.path.join(self.root, d)) for d in subdirs):
            return {SPLIT_NAMES[d]: os.path.join(self.root, d) for d in subdirs}
        return {None: self.root}

    def scan(self) -> Scan:
        classes = self._classes()
        items: list[Item] = []
        for split, folder in self._split_folders().items():
            items += self._scan_split(split, folder)
        if not items:
            raise SourceError(f"{self.root}: no files to group into samples")
        fields = {
            tuple(sorted(item.ref)) + (("cls",) if item.label is not None else ()) for item in items
        }
        if len(fields) > 1:
            shapes = ", ".join("+".join(f) for f in sorted(fields)[:4])
            raise SourceError(
                f"{self.root}: samples carry different fields ({shapes}); every sample needs "
                "the same files (add the missing ones or remove the extra)"
            )
        return Scan(
            classes=classes, items=tuple(items), description={"kind": self.kind, "root": self.root}
        )

    def _classes(self) -> tuple[str, ...]:
        path = os.path.join(self.root, _CLASSES_FILE)
        if not os.path.exists(path):
            return ()
        with open(path, encoding="utf-8") as f:
            return tuple(line.strip() for line in f if line.strip())

    def _scan_split(self, split: str | None, folder: str) -> list[Item]:
        groups: dict[str, dict[str, str]] = defaultdict(dict)
        for path in _walk(folder):
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            if rel == _CLASSES_FILE:
                continue
            head, _, name = rel.rpartition("/")
            stem, _, ext = name.partition(".")
            field = "image" if image_kind_of_name(name) else ext.lower()
            check_field_name(field)
            group = groups[f"{head}/{stem}" if head else stem]
            if field in group:
                raise SourceError(f"{path}: a second image for sample {stem!r} ({group[field]})")
            group[field] = path
        return [self._item(split, key, files) for key, files in sorted(groups.items())]

    def _item(self, split: str | None, key: str, files: dict[str, str]) -> Item:
        label = None
        if "cls" in files:
            text = read_file(files["cls"]).decode("ascii", "replace").strip()
            if not text.lstrip("-").isdigit():
                raise SourceError(f"{files['cls']}: label {text!r} is not an integer")
            label = int(text)
        kind = image_kind_of_name(files["image"]) if "image" in files else None
        fields = {f: p for f, p in files.items() if f != "cls"}
        return Item(
            key=escape_key(key),
            label=label,
            split=split,
            ref=fields,
            size=sum(os.stat(p).st_size for p in fields.values()),
            image_kind=kind,
            origin=next(iter(fields.values()), key),
        )

    def load(self, item: Item) -> dict[str, bytes]:
        fields = {name: read_file(path) for name, path in item.ref.items()}
        if not fields:
            raise SampleError(f"{item.origin}: sample {item.key!r} has no fields besides cls")
        return fields
