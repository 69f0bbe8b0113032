"""The safety net of auto-detection: a dataset's structure is never read as its classes.

``imagefolder`` is the loosest layout (every sub-folder is a class) and auto-detection tries it
last. Before it is accepted, `refuse_structure` looks at what the class-folder reading would
make and refuses it, with one `SourceError` that names what it found, what the folder looks
like and the command that converts it, when one of these rules holds (names compared
lower-case; "class folders" are the folders imagefolder would read as classes, in every
split; an explicit ``--source imagefolder`` skips every rule):

1. **Structure names.** A class folder named as a part of a dataset, never a class
   (`is_structure_name`): ``images``, ``imgs``, ``annotations``, ``labels``, ``meta``,
   ``metadata``, ``trimaps``, ``jpegimages``, ``imagesets``, ``segmentationclass``, ``xmls``,
   ``groundtruth``, ... (`STRUCTURE_NAMES`), a name beginning ``images_`` or
   ``annotations_`` (Omniglot's ``images_background``, COCO's
   ``annotations_trainval2017``), or a split-like name: ``train``, ``training``, ``val``,
   ``valid``, ``validation``, ``test``, ``testing``, ``trainval``, ``dev``, ``eval`` with
   digits and filler words only (``train2017``, ``val2017``, ``test1``, ``test-dev2017``,
   ``training_set``, ``seg_train``: `is_split_like`).
   One such folder refuses the reading (``train/`` beside ``val/`` or ``test/`` is a split,
   see `dlpipe.converters.imagefolder`, and never reaches this rule).
2. **Annotation folders.** A class folder of any name, without sub-folders, that holds at
   least 2 annotation files (`ANNOTATION_SUFFIXES`: ``.txt .xml .json .csv .mat .yaml`` ...)
   and at least twice as many as images (YOLO's ``labels/train/``, Pets' ``xmls/``). A name
   that may be a class (``mask``, ``gt``, ``depth``, ``parts``, ...) counts only with this
   evidence, or, for a mask-like name (``mask``, ``masks``, ``gt``, ``depth``, ``seg``,
   ``label``, ...), when half of its images carry the file names of the images in a photo
   folder beside it (``img/``, ``images/``, ``rgb/``, ...): masks beside their photos.
3. **Layout files at the top** (`layout_of`): a COCO annotation file (``instances_*.json``,
   ``captions_*``, ``person_keypoints_*``, ``panoptic_*``, ``*.coco.json``, or a JSON file
   whose first MiB has ``"images"`` and ``"annotations"`` keys) at the top or in
   ``annotations/``; VOC's ``JPEGImages/`` beside ``Annotations/``, ``ImageSets/`` or
   ``Segmentation*/``; a YAML file with a ``names:`` key, or ``labels/`` beside ``images/``
   (YOLO); a ``metadata.csv``/``.jsonl``/``.parquet`` at the top, in a split or a class folder
   (Hugging Face); split lists (``train.txt``, ``test.txt``, ``trainval.txt``, ``list.txt``,
   ``classes.txt``, ``images.txt``, ``train_test_split.txt``, ``image_class_labels.txt``, ...)
   at the top or in ``meta/``, ``annotations/``, ``splits/``. The message names the
   ``--source`` that reads the layout (``coco``, ``voc``, ``yolo``, ``hf``, ``splitlist``).
4. **One class.** The reading has exactly one class name (no layout files at the top). In
   split folders, that is refused as a dataset of one class. Otherwise the one folder
   (an archive unpacked into root: ``root/food-101/``, ``root/PetImages/``) is looked at by
   every other layout's detection and then by these rules, up to 3 folders deep, and the
   message gives the command that converts it (``dlpipe convert root/PetImages --to ...``,
   ``dlpipe convert root/food-101 --source food101 --to ...``), or, for a folder of images
   without labels, ``--source files``; it never descends by itself. A folder holding no
   image at all is left to the scan, which names it as a class folder without images.

The message ends with the command that reads the folders as classes all the same
(``--source imagefolder``). Contents are looked at by name only (no image is opened), except
the head of a JSON or YAML file at the top, read as every raw file is read (regular files
inside the raw folder only). The class folders' listings it makes are kept for the scan, so
detection and the scan still list every folder once.
"""

from __future__ import annotations

import os
import re
import shlex
from collections import Counter
from dataclasses import dataclass, field

from dlpipe.converters.filenames import FilenamesSource, split_of_folder
from dlpipe.converters.guard_layouts import METADATA, Layout, layout_of, registered
from dlpipe.converters.raw_tree import Listings, RawEntry, RawTree
from dlpipe.converters.source import IMAGE_SUFFIXES, SourceError, display_path

__all__ = [
    "ANNOTATION_SUFFIXES",
    "STRUCTURE_NAMES",
    "Peek",
    "is_split_like",
    "is_structure",
    "is_structure_name",
    "refuse_structure",
]

STRUCTURE_NAMES = frozenset(
    {
        *("images", "imgs", "annotations", "annotation", "anns", "labels", "meta", "metadata"),
        *("trimaps", "jpegimages", "imagesets", "segmentationclass", "segmentationobject"),
        *("segmentationclassaug", "xmls", "groundtruth", "ground_truth", "ground-truth"),
        *("bboxes", "keypoints", "splits"),
    }
)
"""Folder names of a dataset's parts, never classes (compared lower-case)."""
_MASK_NAMES = frozenset({"mask", "masks", "trimap", "segmentation", "segmentations", "seg"})
_MASK_NAMES |= {"gt", "depth", "label"}
_PHOTO_NAMES = frozenset({"image", "images", "img", "imgs", "jpegimages", "rgb", "photos"})
_PHOTO_NAMES |= {"input", "inputs", "frames", "color", "colour", "raw"}
_PREFIXES = ("images_", "annotations_", "images-", "annotations-")
_SPLIT_WORDS = frozenset(
    {"train", "training", "val", "valid", "validation", "test", "testing", "trainval"}
) | {"dev", "eval", "evaluation"}
_SPLIT_FILLERS = frozenset(
    {"set", "sets", "data", "dataset", "images", "imgs", "img", "image", "seg", "split", "v"}
) | {"std", "dev", "challenge", "part", "final", "small", "mini", "full", "pred", "files"}
_WORDS = re.compile(r"[a-z]+|[0-9]+")
ANNOTATION_SUFFIXES = frozenset(
    {
        *(".txt", ".xml", ".json", ".jsonl", ".csv", ".tsv", ".mat", ".yaml", ".yml"),
        *(".npy", ".npz", ".pkl", ".pickle", ".h5", ".hdf5", ".pts", ".seg", ".lst"),
    }
)
"""File suffixes of annotations, masks' lists and split lists (compared lower-case)."""
_DOC_PREFIXES = ("readme", "license", "licence", "citation", "copying")
_FORMATS = "wds|lmdb|hdf5"
_STRUCTURE_KINDS = ("coco", "yolo", "voc", "splitlist", "hf")


def is_structure_name(name: str) -> bool:
    """True for a folder name of a dataset's part or split, never a class (rule 1)."""
    low = name.lower()
    return low in STRUCTURE_NAMES or low.startswith(_PREFIXES) or is_split_like(low)


def is_split_like(name: str) -> bool:
    """True for a split's folder name: its words (letters or digits, any separator) are a
    split word and only split words, digits and fillers (``train2017``, ``test-dev2017``,
    ``training_set``, ``seg_train``, ``Test``, ``valid``; not ``trainer`` or ``test_tube``)."""
    words = _WORDS.findall(name.lower())
    return bool(set(words) & _SPLIT_WORDS) and all(
        w.isdigit() or w in _SPLIT_WORDS or w in _SPLIT_FILLERS for w in words
    )


@dataclass(frozen=True)
class Peek:
    """What a folder's listing holds, by name: images, annotation files by suffix, folders,
    and (for a photo or mask folder only) its images' stems."""

    images: int
    notes: Counter[str] = field(default_factory=Counter)
    folders: int = 0
    metadata: str | None = None
    stems: frozenset[str] = frozenset()

    @property
    def annotations(self) -> int:
        return sum(self.notes.values())

    def mostly_annotations(self) -> bool:
        """At least 2 annotation files, twice as many as images, and no sub-folders (where a
        class's images may lie)."""
        return self.folders == 0 and self.annotations >= 2 * max(self.images, 1)

    def shown(self) -> str:
        kinds = ", ".join(f"{n} {s}" for s, n in self.notes.most_common(3))
        return f"{kinds} files and {self.images or 'no'} images"


def _peek(tree: RawTree, folder: str) -> Peek:
    """`folder`'s listing, counted (the listing is kept for the scan, which takes it: every
    folder is still listed once)."""
    images, notes, folders, metadata, stems = 0, Counter[str](), 0, None, set()
    paired = os.path.basename(folder).lower() in _MASK_NAMES | _PHOTO_NAMES
    for entry in tree.listing(folder):
        if entry.is_dir:
            folders += 1
            continue
        stem, suffix = os.path.splitext(entry.name)
        if suffix.lower() in IMAGE_SUFFIXES:
            images += 1
            if paired:
                stems.add(stem)
        elif suffix.lower() in ANNOTATION_SUFFIXES and not _is_doc(entry.name):
            notes[suffix.lower()] += 1
        if entry.name.lower() in METADATA:
            metadata = entry.name
    return Peek(images, notes, folders, metadata, frozenset(stems))


def _is_doc(name: str) -> bool:
    return name.lower().startswith(_DOC_PREFIXES)


@dataclass(frozen=True)
class _Finding:
    """Why a class-folder reading is refused, and what converts the folder right."""

    path: str  # the folder the commands name (as the user gave it, joined)
    found: str  # what was found in that folder ("" when the folder is fine)
    looks: str  # what dlpipe thinks it is
    fixes: tuple[str, ...]  # each an explained command
    chain: str = ""  # the one folder (and its one folder, ...) around `path`: "food-101"


def _reasons(folders: list[RawEntry], peeks: dict[str, Peek]) -> list[str]:
    """Why the class folders are a dataset's structure (rules 1 and 2); [] when they are not."""
    named = sorted({f.name for f in folders if is_structure_name(f.name)})
    reasons = []
    if named and len(named) == len({f.name for f in folders}):
        reasons.append("those are names of a dataset's parts, not classes")
    elif named:
        shown = ", ".join(f"{display_path(n)}/" for n in named[:6])
        reasons.append(f"{shown} {'is' if len(named) == 1 else 'are'} named as a dataset's part")
    for entry in folders:
        peek = peeks[entry.path]
        if entry.name in named:
            continue
        if peek.mostly_annotations():
            reasons.append(f"{display_path(entry.name)}/ holds {peek.shown()}")
        elif entry.name.lower() in _MASK_NAMES and _pairs_with(entry, folders, peeks):
            reasons.append(
                f"{display_path(entry.name)}/ holds images named as those of another folder "
                "(masks beside their photos)"
            )
    return reasons


def _pairs_with(entry: RawEntry, folders: list[RawEntry], peeks: dict[str, Peek]) -> bool:
    """Half of the folder's images are named as those of a photo folder beside it (``img/``,
    ``images/``, ``rgb/``, ...): masks and their photos. Classes may share names (``cat/1.jpg``
    beside ``dog/1.jpg``), so a sibling of any other name is no evidence."""
    mine = peeks[entry.path].stems
    return bool(mine) and any(
        len(mine & peeks[other.path].stems) * 2 >= len(mine)
        for other in folders
        if other.path != entry.path and other.name.lower() in _PHOTO_NAMES
    )


def _command(path: str, kind: str | None = None) -> str:
    source = ["--source", kind] if kind else []
    return f"`{shlex.join(['dlpipe', 'convert', display_path(path), *source, '--to'])} {_FORMATS}`"


def _layout_fix(path: str, layout: Layout | None) -> str:
    if layout is not None and registered(layout.kind):
        return f"convert it with {_command(path, layout.kind)}"
    if layout is not None:
        return (
            f"this dlpipe has no {layout.kind} source to read it: turn it into class folders "
            "or a label table first"
        )
    kinds = [k for k in _STRUCTURE_KINDS if registered(k)]
    if not kinds:
        return "turn it into class folders or a label table first"
    return f"name its layout: {_command(path, 'KIND')} with KIND one of {', '.join(kinds)}"


def _names(folders: list[RawEntry]) -> str:
    names = sorted({f"{display_path(f.name)}/" for f in folders})
    more = f" and {len(names) - 6} more" if len(names) > 6 else ""
    return ", ".join(names[:6]) + more


_MAX_DEPTH = 3  # folders inside folders looked into (VOC: root/VOCdevkit/VOC2012)


def refuse_structure(root: str, listings: Listings | None = None) -> None:
    """Refuse reading `root` as class folders when the rules of the module docstring say its
    folders are a dataset's structure, or its one class an archive's top folder.

    Args:
        root: the raw folder, as the user gave it (the commands in the message name it so).
        listings: detection's listings, kept for the scan.

    Raises:
        SourceError: naming what was found, what it looks like and the commands that convert it.
    """
    finding = _find(root, listings, 0)
    if finding is None:
        return
    force = f"read its folders as classes all the same with {_command(root, 'imagefolder')}"
    fixes = "; or ".join([*finding.fixes, force])
    found = finding.found
    if finding.chain:
        around = f"its only folder, {finding.chain}/, would be its one class"
        found = f"{around}; in it, {found}" if found else around
    raise SourceError(
        f"{display_path(root)}: not read as class folders: {found}; this looks like "
        f"{finding.looks}: {fixes}"
    )


def is_structure(root: str, listings: Listings | None = None) -> bool:
    """True when `refuse_structure` would refuse `root` (so no message offers reading it as
    class folders: a YOLO or VOC root is no alternative class-folder dataset)."""
    try:
        return _find(root, listings, 0) is not None
    except SourceError:
        return False


def _class_folders(
    absolute: str, listings: Listings | None
) -> tuple[RawTree, dict[str | None, list[RawEntry]]]:
    from dlpipe.converters.imagefolder import split_tops  # it imports this module

    tree = RawTree(absolute, listings)
    return tree, split_tops(tree, absolute)


def _find(root: str, listings: Listings | None, depth: int) -> _Finding | None:
    """Why `root`'s class-folder reading is refused (None: it is not)."""
    absolute = os.path.abspath(root)
    tree, tops = _class_folders(absolute, listings)
    folders: list[RawEntry] = [e for entries in tops.values() for e in entries]
    splits = sorted({os.path.dirname(e.path) for e in folders} - {absolute})
    peeks = {e.path: _peek(tree, e.path) for e in folders}
    layout = layout_of(absolute, tree, splits, peeks)
    one = len({e.name for e in folders}) == 1
    if layout is None and one and list(tops) == [None]:
        return _inside(root, folders[0], listings, depth)
    reasons = _reasons(folders, peeks)
    if layout is not None or reasons:
        found = f"its folders {_names(folders)} would be its classes"
        found += f", but {'; '.join(reasons)}" if reasons else ""
        looks = layout.looks if layout else "a dataset's structure, not class folders of images"
        fixes = [_layout_fix(root, layout), *_name_fixes(root, folders, peeks, layout, listings)]
        return _Finding(root, found, looks, tuple(fixes))
    if not one:
        return None
    found = f"its split folders hold one class folder, {_names(folders)}"
    return _Finding(root, found, "a dataset of one class", ("add the other class folders",))


def _name_fixes(
    root: str,
    folders: list[RawEntry],
    peeks: dict[str, Peek],
    layout: Layout | None,
    listings: Listings | None,
) -> list[str]:
    """The commands that take labels from file names, where the images' names carry them, and
    the one that converts a split folder of class folders (Fruits-360's ``Training/``)."""
    fixes = []
    for entry in folders:
        if entry.name.lower() in ("images", "imgs", "jpegimages") and FilenamesSource.detect(
            entry.path, listings
        ):
            path = os.path.join(root, entry.name)
            fixes.append(f"take the labels from the file names with {_command(path, 'filenames')}")
    nested = [e for e in folders if is_split_like(e.name) and peeks[e.path].folders]
    nested.sort(key=lambda e: not {"train", "training"} & set(_WORDS.findall(e.name.lower())))
    if layout is None and nested:
        path = os.path.join(root, nested[0].name)
        fixes.append(f"convert the class folders of one split with {_command(path)}")
    splits = [split_of_folder(e.name) for e in folders]
    flat = all(peeks[e.path].folders == 0 and peeks[e.path].images for e in folders)
    if layout is None and not fixes and flat and "train" in splits and None not in splits:
        fixes.append(
            "if the image names carry the labels (cat.0.jpg, dog.0.jpg), take them from "
            f"there with {_command(root, 'filenames')}"
        )
    return fixes


def _inside(root: str, entry: RawEntry, listings: Listings | None, depth: int) -> _Finding | None:
    """The finding for a reading of one class folder (an archive's top folder, mostly): what
    the folder inside holds, and the command that converts it."""
    name = display_path(entry.name)
    inner = os.path.join(root, entry.name)
    kind = _detected_kind(entry.path, listings)
    if kind is not None:
        looks = f"a folder around a dataset ({name}/ reads as the {kind} layout)"
        return _Finding(inner, "", looks, (f"convert that folder with {_command(inner)}",), name)
    _, tops = _class_folders(entry.path, listings)
    classes = [e for entries in tops.values() for e in entries]
    if classes and depth < _MAX_DEPTH:
        sub = _find(inner, listings, depth + 1)
        if sub is not None:
            chain = f"{name}/{sub.chain}" if sub.chain else name
            return _Finding(sub.path, sub.found, sub.looks, sub.fixes, chain)
        looks = f"a folder around a dataset ({name}/ holds the class folders {_names(classes)})"
        return _Finding(inner, "", looks, (f"convert that folder with {_command(inner)}",), name)
    if _peek(RawTree(entry.path, listings), entry.path).images:
        fix = f"convert its images without labels with {_command(inner, 'files')}"
        return _Finding(inner, "", f"a folder around images without labels ({name}/)", (fix,), name)
    return None  # nothing to read: the scan names the class folder without images


def _detected_kind(folder: str, listings: Listings | None) -> str | None:
    """The layout auto-detection finds in `folder` before the class folders, or None."""
    import importlib

    from dlpipe.converters.sources import SOURCE_KINDS

    for kind, where in SOURCE_KINDS.items():
        if kind == "imagefolder":
            continue
        module, _, name = where.partition(":")
        try:
            if getattr(importlib.import_module(module), name).detect(folder, listings):
                return kind
        except SourceError:
            continue
    return None
