"""``imagefolder``: class sub-folders of images, as torchvision's ``ImageFolder`` reads them.

Layout: ``root/<class>/**/<image>``; or, when ``root/train/`` exists beside ``root/val/``,
``root/validation/`` or ``root/test/``, one such tree per split (``validation`` is named
``val``). Images are files with an image suffix (``.jpg .jpeg .png .webp .bmp .gif .tif .tiff
.ppm .pgm``, any case); hidden files and folders are skipped, other files are counted and
ignored. Class index = position in the sorted class names, the same in every split.

Produces one sample per image: the image and ``cls``. The key is the image's path relative to
its split folder, without the suffix, escaped by the key rule (``cat/001.jpg`` →
``cat%2F001``), so equal file names in different classes never collide.
"""

from __future__ import annotations

import os

from dlpipe.converters.source import (
    SPLIT_NAMES,
    Item,
    Scan,
    Source,
    SourceError,
    image_kind_of_name,
    read_file,
)
from dlpipe.sample import escape_key

__all__ = ["ImageFolderSource"]


def _visible(names: list[str]) -> list[str]:
    return sorted(n for n in names if not n.startswith("."))


def _class_dirs(folder: str) -> list[str]:
    return [n for n in _visible(os.listdir(folder)) if os.path.isdir(os.path.join(folder, n))]


class ImageFolderSource(Source):
    kind = "imagefolder"

    @classmethod
    def detect(cls, root: str) -> bool:
        return os.path.isdir(root) and bool(_class_dirs(root))

    def split_roots(self) -> dict[str | None, str]:
        """Split name → folder; ``{None: root}`` when the root is one class tree."""
        subdirs = set(_class_dirs(self.root))
        named = {SPLIT_NAMES[d]: d for d in sorted(subdirs) if d in SPLIT_NAMES}
        if "train" in named and len(named) > 1:
            return {split: os.path.join(self.root, d) for split, d in named.items()}
        return {None: self.root}

    def scan(self) -> Scan:
        roots = self.split_roots()
        classes = sorted({c for folder in roots.values() for c in _class_dirs(folder)})
        if not classes:
            raise SourceError(f"{self.root}: no class folders (expected root/<class>/<image>)")
        index = {name: i for i, name in enumerate(classes)}
        items: list[Item] = []
        ignored = 0
        for split, folder in roots.items():
            for cls_name in _class_dirs(folder):
                found, skipped = self._scan_class(folder, cls_name, index[cls_name], split)
                items += found
                ignored += skipped
        if not items:
            raise SourceError(
                f"{self.root}: the class folders hold no images (suffixes: .jpg .png .webp ...)"
            )
        description = {"kind": self.kind, "root": self.root, "ignored_files": ignored}
        return Scan(classes=tuple(classes), items=tuple(items), description=description)

    def _scan_class(
        self, folder: str, cls_name: str, label: int, split: str | None
    ) -> tuple[list[Item], int]:
        items, ignored = [], 0
        top = os.path.join(folder, cls_name)
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = _visible(dirnames)
            for name in _visible(filenames):
                path = os.path.join(dirpath, name)
                kind = image_kind_of_name(name)
                if kind is None:
                    ignored += 1
                    continue
                rel = os.path.splitext(os.path.relpath(path, folder))[0]
                size = os.stat(path).st_size
                items.append(
                    Item(
                        key=escape_key(rel.replace(os.sep, "/")),
                        label=label,
                        split=split,
                        ref=path,
                        size=size,
                        image_kind=kind,
                        origin=path,
                    )
                )
        return items, ignored

    def load(self, item: Item) -> dict[str, bytes]:
        return {"image": read_file(item.ref)}
