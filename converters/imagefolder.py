"""``imagefolder``: class sub-folders of images, as torchvision's ``ImageFolder`` reads them.

Layout: ``root/<class>/**/<image>``; or, when ``root/train/`` exists beside ``root/val/``,
``root/validation/`` or ``root/test/``, one such tree per split (``validation`` is named
``val``). Images are regular files with an image suffix (``.jpg .jpeg .png .webp .bmp .gif
.tif .tiff .ppm .pgm``, any case); other files are counted and ignored. Class index = position
in the sorted class names, the same in every split.

Not classes, never read: hidden and OS/tool folders (``.git``, ``__MACOSX``, ``@eaDir``, ... see
`dlpipe.converters.source`), a folder holding a prepared dataset (``dlpipe.json``), links to
folders, and special files (FIFOs, sockets, devices) or links out of the raw folder, which are
listed in the scan description as skipped entries. A class folder without one image is refused
(it would be a label with no samples, usually a mistake such as an unpacked archive's leftover);
``SourceOptions(keep_empty_classes=True)`` keeps it, with a warning. When such a folder is named
as a dataset's part (``annotations``, ``labels``, ``train2017``: `is_structure_name`) or holds
two or more annotation files (``.json``, ``.xml``, ``.txt``, ...: `ANNOTATION_SUFFIXES`; one
``notes.txt`` is no annotation), the refusal says it is no class folder and does not suggest
keeping it.

Auto-detection reads a folder this way only after `dlpipe.converters.guard` found no dataset
structure in its folders (``images/`` beside ``annotations/``, COCO's ``train2017/``, one
archive folder); ``--source imagefolder`` reads it this way regardless.

Produces one sample per image: the image and ``cls``. The key is the image's path relative to
its split folder, without the suffix, escaped by the key rule (``cat/001.jpg`` →
``cat%2F001``), so equal file names in different classes never collide; a path too long for a
key is shortened by `dlpipe.sample.make_key`, and the item's ``original`` keeps the full path.
Names that are not UTF-8 keep their bytes in the key (``caf%E9``) and are shown with ``\\xNN``.
"""

from __future__ import annotations

import os
from collections import Counter

from dlpipe.converters.guard import ANNOTATION_SUFFIXES, is_structure_name
from dlpipe.converters.raw_tree import Listings, RawEntry, RawTree, relative_path
from dlpipe.converters.source import (
    SPLIT_NAMES,
    Item,
    Scan,
    Source,
    SourceError,
    display_path,
    image_kind_of_name,
    log,
    read_file,
)
from dlpipe.manifest import MANIFEST_NAME
from dlpipe.sample import make_key

__all__ = ["ImageFolderSource"]


def _class_folders(tree: RawTree, folder: str) -> list[RawEntry]:
    """The class folders of `folder`: its visible real folders that are not datasets."""
    return [entry for entry in tree.folders(folder) if _is_class_folder(tree, entry)]


def _is_class_folder(tree: RawTree, entry: RawEntry) -> bool:
    """False (one skipped entry) for a folder holding a prepared dataset."""
    if os.path.lexists(os.path.join(entry.path, MANIFEST_NAME)):
        tree.skip(entry.path, f"a prepared dataset ({MANIFEST_NAME}), not a class")
        return False
    return True


def split_tops(tree: RawTree, root: str) -> dict[str | None, list[RawEntry]]:
    """Split name → its class folders, or ``{None: root's class folders}``."""
    top = _class_folders(tree, root)
    subdirs = {e.name: e for e in top}
    named = {SPLIT_NAMES[d]: d for d in sorted(subdirs) if d in SPLIT_NAMES}
    if "train" in named and len(named) > 1:
        return {split: _class_folders(tree, subdirs[d].path) for split, d in named.items()}
    return {None: top}


class ImageFolderSource(Source):
    kind = "imagefolder"
    options_read = frozenset({"keep_empty_classes"})

    @classmethod
    def detect(cls, root: str, listings: Listings | None = None) -> bool:
        """True when `root` (or, for split folders, one of them) has a class folder; the
        listings made are kept for the scan."""
        if not os.path.isdir(root):
            return False
        try:
            return any(split_tops(RawTree(root, listings), root).values())
        except SourceError:
            return False

    def split_roots(self, tree: RawTree | None = None) -> dict[str | None, list[RawEntry]]:
        """Split name → its class folders; ``{None: ...}`` when the root is one class tree."""
        return split_tops(tree or RawTree(self.root), self.root)

    def scan(self) -> Scan:
        tree = RawTree(self.root, self.take_listings())
        tops = self.split_roots(tree)
        classes = sorted({
            display_path(e.name) for entries in tops.values() for e in entries
        })  # fmt: skip
        if not classes:
            raise SourceError(
                f"{display_path(self.root)}: no class folders (expected root/<class>/<image>)"
            )
        index = {name: i for i, name in enumerate(classes)}
        items: list[Item] = []
        ignored: Counter[str] = Counter()  # class name -> annotation files in it
        unused: Counter[str] = Counter()  # kind -> files not read
        for split, entries in tops.items():
            for entry in entries:
                if not tree.claim(entry):
                    continue
                name = display_path(entry.name)
                split_folder = os.path.dirname(entry.path)
                found, skipped = self._scan_class(tree, split_folder, entry, index[name], split)
                items += found
                annotations = sum(n for s, n in skipped.items() if s in ANNOTATION_SUFFIXES)
                ignored[name] += annotations
                unused["annotation files"] += annotations
                unused["other"] += sum(skipped.values()) - annotations
        self._check_empty(classes, {it.label for it in items}, tops, ignored)
        if not items:
            raise SourceError(
                f"{display_path(self.root)}: the class folders hold no images "
                "(suffixes: .jpg .png .webp ...)"
            )
        description = {
            "kind": self.kind,
            "root": display_path(self.root),
            "ignored_files": sum(unused.values()),
            "unused": {kind: n for kind, n in unused.items() if n},
            **tree.report(),
        }
        return Scan(classes=tuple(classes), items=tuple(items), description=description)

    def _check_empty(
        self,
        classes: list[str],
        used: set[int | None],
        tops: dict[str | None, list[RawEntry]],
        annotations: Counter[str],
    ) -> None:
        """Refuse (or, when kept, warn about) class folders holding no image in any split."""
        empty = [name for i, name in enumerate(classes) if i not in used]
        if not empty:
            return
        shown = self._shown_folders(tops, empty)
        if self.options.keep_empty_classes:
            log.warning("kept %d class folders with no images as classes: %s", len(empty), shown)
            return
        parts = [n for n in empty if is_structure_name(n) or annotations[n] >= 2]
        if parts:
            raise SourceError(
                f"{self._shown_folders(tops, parts)}: hold no images but "
                f"{sum(annotations[n] for n in parts)} annotation files, or are named as a "
                "dataset's parts (annotations, labels, train2017, ...), not classes; give the "
                "folder that holds the class folders, or name the dataset's layout with --source"
            )
        raise SourceError(
            f"{shown}: {len(empty)} class folders hold no images, so their labels would have no "
            "samples; remove them, or pass --keep-empty-classes to keep them as classes"
        )

    @staticmethod
    def _shown_folders(tops: dict[str | None, list[RawEntry]], names: list[str]) -> str:
        folders = sorted(
            display_path(e.path) for entries in tops.values() for e in entries
            if display_path(e.name) in names
        )  # fmt: skip
        more = f" and {len(folders) - 5} more" if len(folders) > 5 else ""
        return ", ".join(folders[:5]) + more

    @staticmethod
    def _scan_class(
        tree: RawTree, split_folder: str, top: RawEntry, label: int, split: str | None
    ) -> tuple[list[Item], Counter[str]]:
        """The items of one class folder, and its other files counted by suffix."""
        items: list[Item] = []
        ignored: Counter[str] = Counter()
        for entry in tree.files(top.path):
            kind = image_kind_of_name(entry.name)
            if kind is None:
                ignored[os.path.splitext(entry.name)[1].lower()] += 1
                continue
            rel = relative_path(entry.path, split_folder)
            key, shortened = make_key(os.path.splitext(rel)[0])
            original = display_path(rel) if shortened else None
            origin = display_path(entry.path)
            items.append(Item(key, label, split, entry.path, entry.size, kind, origin, original))
        return items, ignored

    def load(self, item: Item) -> dict[str, bytes]:
        return {"image": read_file(item.ref, self.raw_folder)}
