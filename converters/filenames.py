"""``filenames``: flat folders of images whose file names carry the label.

Layout: ``root/<label><sep><number>.<ext>``, a flat folder of images (Oxford-IIIT Pet's
``images/``: ``Abyssinian_100.jpg``, ``great_pyrenees_173.jpg``); or split folders beside
each other, each flat (Kaggle's Dogs vs Cats: ``train/cat.0.jpg``, ``train/dog.0.jpg`` beside
``test1/1.jpg``). A split folder is named ``train``/``training``, ``val``/``valid``/
``validation`` or ``test``/``testing``, any case, optionally followed by digits (``test1``
is ``test``); ``train`` must be one of them and no two may name the same split. Beside split
folders the root may hold other files (Kaggle's ``sampleSubmission.csv``, a README), never
read, but no images and no other folders.

Labels (`label_rule`, ``--label-from``):

- ``name-prefix`` (the default): the file's stem without its trailing separator (``_``, ``.``,
  ``-``) and number: ``cat.0`` → ``cat``, ``great_pyrenees_173`` → ``great_pyrenees``.
- a regular expression, searched in the file name (suffix included) with `re.search`; its one
  group, or its group named ``label``, is the label (``--label-from '^([a-z]+)_'``).

Auto-detection (no ``--label-from``) needs every image of the flat folder, or of ``train/``,
named by ``name-prefix``, at least 2 labels with at least 2 images each, and no label that is
a camera's or tool's generic prefix (``IMG``, ``DSC``, ``PXL``, ``image``, ``frame``, ... see
`GENERIC_PREFIXES`: a folder of phone photos has no classes). Every other split folder is
either labelled the same way, or holds only images named by bare numbers (``1.jpg``): an
unlabelled split. Non-image files are not read (counted in ``source.unused`` as other, with the
files beside the split folders), unless more than half of the images have one beside them with
the same stem (``0001.jpg`` + ``0001.json``): that is the ``files`` layout. ``--label-from``
(or ``--source filenames``) reads the layout without these checks.

Unlabelled splits: a split folder in which no image name gives a label becomes a split of
samples without ``cls`` (its manifest entry lists its own fields), as the table source gives
Kaggle's ``test.csv``; at least one split must have labels. In a labelled split, an image
whose name gives no label is a per-sample error (``--on-error``: skipped and listed in
``errors.jsonl``, or the run stops naming it), counted in a warning at the scan (and in
``source.skipped``, not in ``source.unused``: it was planned as a sample).

Produces one sample per image: the image and ``cls`` (class index = position in the sorted
label names). The key is the file name without its suffix, escaped by the key rule
(``cat.0.jpg`` → ``cat%2E0``; shortened by `dlpipe.sample.make_key` when too long, the item's
``original`` keeping the full name). Read as every source reads a raw folder
(`dlpipe.converters.source`); a sub-folder of a flat folder (or of a split folder) is refused.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass

from dlpipe.converters.listed import count_unused
from dlpipe.converters.raw_tree import Listings, RawEntry, RawTree, relative_path
from dlpipe.converters.source import (
    SPLIT_WORDS,
    Item,
    SampleError,
    Scan,
    Source,
    SourceError,
    display_path,
    image_kind_of_name,
    log,
    read_file,
)
from dlpipe.sample import make_key

__all__ = [
    "GENERIC_PREFIXES",
    "NAME_PREFIX",
    "FilenamesSource",
    "LabelRule",
    "label_rule",
    "split_of_folder",
]

NAME_PREFIX = "name-prefix"
"""``--label-from name-prefix``: the label is the stem before its trailing ``[_.-]<digits>``."""
_NAME_PREFIX = re.compile(r"(?P<label>.+?)[_.\-][0-9]+")
_BARE_NUMBER = re.compile(r"[0-9]+")
_SPLIT_FOLDER = re.compile(r"(train|training|val|valid|validation|test|testing)[0-9]*")
GENERIC_PREFIXES = frozenset(
    {
        *("img", "image", "images", "im", "pic", "picture", "photo", "dsc", "dscn", "dscf"),
        *("pxl", "mvimg", "screenshot", "screen shot", "frame", "file", "sample", "scan"),
        *("page", "untitled", "capture", "snapshot", "vid", "video", "clip", "shot"),
    }
)
"""Name prefixes (compared lower-case) that name a camera, a phone or a tool, not a class."""
MIN_LABELS = 2
MIN_IMAGES_PER_LABEL = 2


@dataclass(frozen=True)
class LabelRule:
    """How a file name gives its label: `text` is ``name-prefix`` or a regular expression."""

    text: str
    pattern: re.Pattern[str]

    def label_of(self, name: str) -> str | None:
        """The label `name` (a file name) gives, or None when it gives none."""
        if self.text == NAME_PREFIX:
            match = self.pattern.fullmatch(os.path.splitext(name)[0])
        else:
            match = self.pattern.search(name)
        if match is None:
            return None
        label = match.group("label") if "label" in self.pattern.groupindex else match.group(1)
        return label or None


def label_rule(text: str) -> LabelRule:
    """The rule ``--label-from`` names.

    Raises:
        ValueError: `text` is not ``name-prefix`` nor a regular expression with one group or
            a group named ``label``.
    """
    if text == NAME_PREFIX:
        return LabelRule(text, _NAME_PREFIX)
    try:
        pattern = re.compile(text)
    except re.error as exc:
        raise ValueError(
            f"{text!r} is neither {NAME_PREFIX} nor a regular expression ({exc})"
        ) from None
    if "label" not in pattern.groupindex and pattern.groups != 1:
        raise ValueError(
            f"{text!r} has {pattern.groups} groups; give one group, or name the label's group "
            "(?P<label>...), e.g. '^([A-Za-z]+)_'"
        )
    return LabelRule(text, pattern)


def split_of_folder(name: str) -> str | None:
    """The split a folder name gives (``train``, ``Validation``, ``test1`` → ``test``)."""
    match = _SPLIT_FOLDER.fullmatch(name.lower())
    if match is None:
        return None
    word = match.group(1)
    return SPLIT_WORDS[word]


def _split_folders(tree: RawTree, root: str) -> dict[str | None, str] | None:
    """Split → its folder: ``{None: root}`` for a flat folder, the split folders beside each
    other (train among them, each split once, no images beside them); None otherwise."""
    entries = tree.listing(root)
    folders = [e for e in entries if e.is_dir]
    if not folders:
        return {None: root}
    splits = {e.path: split_of_folder(e.name) for e in folders}
    named = [s for s in splits.values() if s is not None]
    loose = any(not e.is_dir and image_kind_of_name(e.name) for e in entries)
    if None in splits.values() or "train" not in named or len(set(named)) < len(named) or loose:
        return None
    return {split: path for path, split in sorted(splits.items(), key=lambda p: p[1] or "")}


def _layout_text(folders: dict[str | None, str], rule: LabelRule, unlabelled: list[str]) -> str:
    """Where the images lie and how their names give labels."""
    where = "its top"
    if None not in folders:
        where = ", ".join(f"{display_path(os.path.basename(f))}/" for f in folders.values())
    bare = f" ({', '.join(unlabelled)}: no labels, bare numbers)" if unlabelled else ""
    return f"the image names in {where} give the labels by --label-from {rule.text}{bare}"


def _images(entries: list[RawEntry]) -> list[RawEntry]:
    return [e for e in entries if not e.is_dir and image_kind_of_name(e.name)]


def _has_sidecars(entries: list[RawEntry], images: list[RawEntry]) -> bool:
    """More than half of the images share their stem with another file (``files`` layout)."""
    stems = Counter(os.path.splitext(e.name)[0] for e in entries if not e.is_dir)
    paired = sum(stems[os.path.splitext(e.name)[0]] > 1 for e in images)
    return paired * 2 > len(images)


def _labels_found(names: list[str], rule: LabelRule) -> Counter[str] | None:
    """Label → images for a labelled split; an empty Counter for a split of bare numbers;
    None when the names are neither."""
    if all(_BARE_NUMBER.fullmatch(os.path.splitext(n)[0]) for n in names):
        return Counter()
    labels = [rule.label_of(n) for n in names]
    if None in labels:
        return None
    return Counter(label for label in labels if label is not None)


class FilenamesSource(Source):
    """Images labelled by their file names (see the module docstring)."""

    kind = "filenames"
    options_read = frozenset({"label_from"})

    @classmethod
    def detect(cls, root: str, listings: Listings | None = None) -> bool:
        """True for a flat folder (or split folders) of images all named ``<label>_<n>.<ext>``
        by the rule in the module docstring; the listings made are kept for the scan."""
        if not os.path.isdir(root):
            return False
        try:
            tree = RawTree(root, listings)
            folders = _split_folders(tree, root)
            if folders is None:
                return False
            counts: Counter[str] = Counter()
            for split, folder in folders.items():
                found = cls._detect_split(tree, folder, split)
                if found is None:
                    return False
                counts += found
        except SourceError:
            return False
        generic = {label.lower() for label in counts} & GENERIC_PREFIXES
        enough = len(counts) >= MIN_LABELS and min(counts.values()) >= MIN_IMAGES_PER_LABEL
        return enough and not generic

    @staticmethod
    def _detect_split(tree: RawTree, folder: str, split: str | None) -> Counter[str] | None:
        entries = tree.listing(folder)
        images = _images(entries)
        if not images or any(e.is_dir for e in entries) or _has_sidecars(entries, images):
            return None
        found = _labels_found([e.name for e in images], label_rule(NAME_PREFIX))
        if found is None or (split in (None, "train") and not found):
            return None  # the train split (or the one folder) must have labels
        return found

    def rule(self) -> LabelRule:
        """The label rule: ``--label-from``, else ``name-prefix``."""
        text = self.options.label_from or NAME_PREFIX
        try:
            return label_rule(text)
        except ValueError as exc:
            raise SourceError(f"--label-from {exc}") from None

    def scan(self) -> Scan:
        tree = RawTree(self.root, self.take_listings())
        folders = self._folders(tree)
        rule = self.rule()
        found = {split: self._split_images(tree, folder) for split, folder in folders.items()}
        labels = {
            split: [rule.label_of(e.name) for e, _ in images] for split, images in found.items()
        }
        classes = sorted({display_path(x) for names in labels.values() for x in names if x})
        if not classes:
            raise self._no_labels(found, rule)
        index = {name: i for i, name in enumerate(classes)}
        items: list[Item] = []
        unlabelled = sorted(s or "" for s, names in labels.items() if not any(names))
        for split, images in found.items():
            bare = not any(labels[split])
            for (entry, rel), label in zip(images, labels[split], strict=True):
                cls = None if label is None else index[display_path(label)]
                items.append(self._item(entry, rel, split, cls, None if bare else rule))
        self._warn_unlabelled(items, rule)
        unread = [
            e.path
            for folder in dict.fromkeys((self.root, *folders.values()))
            for e in tree.listing(folder)
            if not e.is_dir and not image_kind_of_name(e.name)
        ]
        description = {
            "kind": self.kind,
            "root": display_path(self.root),
            "layout": _layout_text(folders, rule, unlabelled),
            "label_from": rule.text,
            "unlabelled_splits": unlabelled,
            "ignored_files": sum(os.path.dirname(p) in folders.values() for p in unread),
            "unused": count_unused(relative_path(p, self.root) for p in unread),
            **tree.report(),
        }
        return Scan(classes=tuple(classes), items=tuple(items), description=description)

    def _folders(self, tree: RawTree) -> dict[str | None, str]:
        folders = _split_folders(tree, self.root)
        if folders is None:
            shown = ", ".join(display_path(e.name) for e in tree.folders(self.root)[:5])
            raise SourceError(
                f"{display_path(self.root)}: holds folders ({shown}) that are not split folders "
                "(train/ beside val/ or test/); the filenames source reads a flat folder of "
                "images, or flat train/, val/, test/ folders: give the folder of images"
            )
        for folder in folders.values():
            inner = tree.folders(folder)
            if folder != self.root and inner:
                raise SourceError(
                    f"{display_path(inner[0].path)}: a folder inside the split folder "
                    f"{display_path(folder)}; the filenames source reads flat folders of images"
                )
        return folders

    @staticmethod
    def _split_images(tree: RawTree, folder: str) -> list[tuple[RawEntry, str]]:
        return [(e, e.name) for e in tree.listing(folder) if image_kind_of_name(e.name)]

    def _no_labels(
        self, found: dict[str | None, list[tuple[RawEntry, str]]], rule: LabelRule
    ) -> SourceError:
        example = next((name for images in found.values() for _, name in images), None)
        if example is None:
            return SourceError(
                f"{display_path(self.root)}: no images (suffixes: .jpg .png .webp ...)"
            )
        return SourceError(
            f"{display_path(self.root)}: no image name gives a label by --label-from "
            f"{rule.text} (e.g. {display_path(example)!r}); give a regular expression whose "
            "group is the label, e.g. --label-from '^([A-Za-z]+)_'"
        )

    def _item(
        self,
        entry: RawEntry,
        rel: str,
        split: str | None,
        label: int | None,
        rule: LabelRule | None,
    ) -> Item:
        key, shortened = make_key(os.path.splitext(rel)[0])
        problem = None
        if label is None and rule is not None:
            problem = f"its name gives no label by --label-from {rule.text}"
        kind = image_kind_of_name(entry.name)
        return Item(
            key=key,
            label=label,
            split=split,
            ref=(entry.path, problem),
            size=entry.size,
            image_kind=kind,
            origin=display_path(entry.path),
            original=display_path(rel) if shortened else None,
        )

    @staticmethod
    def _warn_unlabelled(items: list[Item], rule: LabelRule) -> None:
        bad = [it.origin for it in items if it.ref[1] is not None]
        if bad:
            log.warning(
                "%d images are named against --label-from %s (e.g. %s); each is a bad sample, "
                "skipped or fatal as --on-error says",
                len(bad),
                rule.text,
                bad[0],
            )

    def load(self, item: Item) -> dict[str, bytes]:
        path, problem = item.ref
        if problem is not None:
            raise SampleError(f"{item.origin}: {problem}")
        return {"image": read_file(path, self.raw_folder)}
