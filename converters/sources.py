"""The raw-dataset sources, in the order auto-detection tries them, and `open_source`."""

from __future__ import annotations

import dataclasses
import importlib
import os

from dlpipe import storage
from dlpipe.converters.guard import is_structure, refuse_structure
from dlpipe.converters.raw_tree import Listings
from dlpipe.converters.source import (
    IMAGE_SUFFIXES,
    Source,
    SourceError,
    SourceOptions,
    display_path,
    is_ignored_name,
    log,
)
from dlpipe.converters.source_kinds import SOURCE_KINDS

__all__ = ["SOURCE_KINDS", "open_source", "refuse_unread_options", "why_detected"]

# a layout that is a special case of another: matching both is no ambiguity
_SPECIAL_CASE_OF = {
    "imagenet": ("imagefolder",),
    "filenames": ("imagefolder",),  # Kaggle's train/ and test1/ are no classes
    "food101": ("imagefolder",),
    "cub200": ("imagefolder",),
    "oxford-pets": ("imagefolder", "filenames"),  # images/ holds Abyssinian_1.jpg, ...
    "flowers102": ("imagefolder",),
    "stanford-cars": ("imagefolder",),
    "splitlist": ("imagefolder",),
    "voc": ("imagefolder",),  # voc-seg on the same tree is named in the warning
    "voc-seg": ("imagefolder",),
    "yolo": ("imagefolder", "splitlist", "files"),  # train.txt lists, x.jpg beside x.txt
    # an annotated layout's folders (annotations/, train2017/, labels/) are no classes, and a
    # metadata table that names the images is the layout, not a table beside class folders
    "coco": ("imagefolder",),
    "hf": ("imagefolder", "table"),
}

# why a layout was detected, for the warning when several match
_WHY = {
    "cifar": "it holds CIFAR batch files",
    "mnist": "it holds MNIST idx files",
    "webdataset": "it holds WebDataset .tar shards (at its top or in split folders)",
    "food101": "it has Food-101's meta/classes.txt and meta/train.txt or test.txt",
    "cub200": "it has CUB-200-2011's images.txt and train_test_split.txt",
    "oxford-pets": "it has Oxford-IIIT Pet's annotations/trainval.txt or test.txt",
    "flowers102": "it has Flowers-102's jpg/, imagelabels.mat and setid.mat",
    "stanford-cars": "it has Stanford Cars' devkit/cars_meta.mat",
    "splitlist": "it holds split lists (train.txt, val.txt, test.txt, trainval.txt)",
    "voc": "it has Pascal VOC's JPEGImages/, Annotations/ and ImageSets/Main/",
    "voc-seg": "it has Pascal VOC's SegmentationClass/ and ImageSets/Segmentation/",
    "yolo": "it holds a YOLO data YAML (names, train/val) or Darknet's obj.data/obj.names",
    "coco": "it has annotations/instances_<split>.json (or <split>/_annotations.coco.json)",
    "filenames": "its images are named <label>_<number> (cat.0.jpg, Abyssinian_12.jpg)",
    "hf": "it holds Hugging Face metadata files (metadata.jsonl/csv/parquet, file_name)",
    "files": "its files share stems (key.jpg beside key.json, ...)",
    "imagenet": "it has ImageNet's train/ and val/ synset folders",
    "imagefolder": "its sub-folders read as class folders of images",
}


def why_detected(root: str, kind: str) -> str:
    """Why auto-detection reads `root` as `kind` (the warning when several layouts match, and
    convert's first lines)."""
    if kind == "table":
        from dlpipe.converters.table import TableSource

        table = TableSource.label_table(root) if os.path.isdir(root) else None
        if table is not None:
            return f"{display_path(os.path.basename(table))} has an image and a label column"
        return "it holds table files"
    return _WHY.get(kind, "its layout matches")


def _table_beside_others(root: str) -> bool:
    from dlpipe.converters.table import TableSource

    return TableSource.label_table(root) is not None


def _warn_if_ambiguous(root: str, chosen: str, listings: Listings) -> None:
    """A warning naming the chosen layout, why, and the ``--source`` of each other match."""
    if chosen == "table" and not (os.path.isdir(root) and _table_beside_others(root)):
        return  # a table file, or a folder of nothing but tables
    later = list(SOURCE_KINDS)[list(SOURCE_KINDS).index(chosen) + 1 :]
    others = [
        kind
        for kind in later
        if kind not in _SPECIAL_CASE_OF.get(chosen, ())
        and _source_class(kind).detect(os.path.abspath(root), listings)
        and not (kind == "imagefolder" and is_structure(root, listings))  # no class folders
    ]
    if not others:
        return
    alternatives = "; ".join(
        f"it also reads as {kind} ({why_detected(root, kind)}): give --source {kind} for that"
        for kind in others
    )
    log.warning(
        "%s: read as %s (--source %s) because %s; %s",
        display_path(root),
        chosen,
        chosen,
        why_detected(root, chosen),
        alternatives,
    )


def _warn_of_loose_images(root: str) -> None:
    """A warning when image files lie at the top beside the class or split folders: an
    ImageFolder reads only the folders, so those files would be left out unseen."""
    try:
        names = sorted(n for n in os.listdir(root) if not is_ignored_name(n))
    except OSError:
        return
    loose = [
        n
        for n in names
        if os.path.splitext(n)[1].lower() in IMAGE_SUFFIXES
        and os.path.isfile(os.path.join(root, n))
    ]
    if loose:
        log.warning(
            "%s: read as class folders; the %d image files at its top (%s) are in no class "
            "folder and are not read (move them into one, or give --source files to read "
            "every file as a sample without labels)",
            display_path(root),
            len(loose),
            ", ".join(display_path(n) for n in loose[:3]) + (", ..." if len(loose) > 3 else ""),
        )


def _source_class(kind: str) -> type[Source]:
    module, _, name = SOURCE_KINDS[kind].partition(":")
    cls: type[Source] = getattr(importlib.import_module(module), name)
    return cls


def _url_source(root: str, kind: str, options: SourceOptions | None) -> Source:
    """WebDataset shards at an fsspec URL: the one layout read from object storage (its tars
    by byte ranges), and only when it is there."""
    if kind not in ("auto", "webdataset"):
        raise SourceError(
            f"{root}: only WebDataset shards (.tar) are read from a URL; the {kind} source reads "
            "a local folder: download the raw data (e.g. `aws s3 sync`) and convert that"
        )
    source = _source_class("webdataset")
    if kind == "auto" and not source.detect(root):
        raise SourceError(
            f"{root}: holds no WebDataset shards (.tar files at its top or in train/, val/, "
            "test/ folders); from a URL dlpipe reads only those: download other raw data and "
            "convert the folder"
        )
    refuse_unread_options(source, root, options)
    return source(root, options)


# what each option is for, in the refusal of an option the chosen layout does not read
_OPTION_USE = {
    "image_col": "names a table's image column (--source table)",
    "label_col": "names a table's or metadata file's label column (--source table or hf)",
    "image_root": "says where a table's image paths are looked up (--source table)",
    "key_col": "names a table's or metadata file's key column (--source table or hf)",
    "keep_empty_classes": "keeps empty class folders (--source imagefolder)",
    "label_from": "reads labels from file names (--source filenames)",
    "instance_masks": "converts COCO's segmentations (--source coco)",
}


def refuse_unread_options(cls: type[Source], root: str, options: SourceOptions | None) -> None:
    """A `SourceError` for an option given that the layout `cls` does not read: an option
    ignored would make another dataset than the one asked for, without a word."""
    if options is None:
        return
    given = [
        f.name
        for f in dataclasses.fields(options)
        if getattr(options, f.name) != f.default and f.name not in {*cls.options_read, "kind"}
    ]
    if given:
        name = given[0]
        flag = "--" + name.replace("_", "-")
        raise SourceError(
            f"{display_path(root)} reads as {cls.kind}, which does not read {flag} (it "
            f"{_OPTION_USE[name]}); drop {flag}, or name the layout that reads it with --source"
        )


def open_source(root: str, kind: str = "auto", options: SourceOptions | None = None) -> Source:
    """The source for `root`: the one `kind` names, or the first whose layout `root` has.

    Raises:
        SourceError: `root` does not exist, or no known layout matches (the message lists them).
    """
    if storage.is_url(root):
        return _url_source(root, kind, options)
    if not os.path.exists(root):
        raise SourceError(
            f"{display_path(root)} does not exist; give the folder (or table file) of raw data"
        )
    if not (os.path.isdir(root) or os.path.isfile(root)):
        raise SourceError(
            f"{display_path(root)} is not a folder or a regular file (a FIFO, a device, a "
            "socket?); give the folder (or table file) of raw data"
        )
    if kind == "auto" and options is not None and options.label_from is not None:
        kind = "filenames"  # labels from file names: no other source reads them
    if kind != "auto":
        if kind not in SOURCE_KINDS:
            raise SourceError(
                f"--source {kind!r} is unknown; choose from {', '.join(SOURCE_KINDS)}"
            )
        refuse_unread_options(_source_class(kind), root, options)
        return _source_class(kind)(root, options)
    listings = Listings()  # what detection lists, the scan reuses: each folder listed once
    absolute = os.path.abspath(root)
    for name in SOURCE_KINDS:
        cls = _source_class(name)
        if cls.detect(absolute, listings):
            refuse_unread_options(cls, root, options)
            if name == "imagefolder":  # the loosest reading: refuse a dataset's structure
                refuse_structure(root, listings)
            _warn_if_ambiguous(root, name, listings)
            if name in ("imagefolder", "imagenet"):
                _warn_of_loose_images(root)
            return cls(root, options, listings=listings)
    raise SourceError(
        f"{display_path(root)}: cannot tell its layout (none of {', '.join(SOURCE_KINDS)} "
        "matches: expected class folders of images, a CSV/JSONL/Parquet table, key.ext "
        "files, or CIFAR/MNIST files as shipped); name it with --source"
    )
