"""The raw-dataset sources, in the order auto-detection tries them, and `open_source`."""

from __future__ import annotations

import importlib
import os

from dlpipe.converters.source import Source, SourceError, SourceOptions, display_path

__all__ = ["SOURCE_KINDS", "open_source"]

# kind -> "module:Class"; the most specific layouts first, the loosest (class folders) last
SOURCE_KINDS = {
    "cifar": "dlpipe.converters.cifar:CifarSource",
    "mnist": "dlpipe.converters.mnist:MnistSource",
    "table": "dlpipe.converters.table:TableSource",
    "files": "dlpipe.converters.files:FilesSource",
    "imagenet": "dlpipe.converters.imagenet:ImageNetSource",
    "imagefolder": "dlpipe.converters.imagefolder:ImageFolderSource",
}


def _source_class(kind: str) -> type[Source]:
    module, _, name = SOURCE_KINDS[kind].partition(":")
    cls: type[Source] = getattr(importlib.import_module(module), name)
    return cls


def open_source(root: str, kind: str = "auto", options: SourceOptions | None = None) -> Source:
    """The source for `root`: the one `kind` names, or the first whose layout `root` has.

    Raises:
        SourceError: `root` does not exist, or no known layout matches (the message lists them).
    """
    if not os.path.exists(root):
        raise SourceError(
            f"{display_path(root)} does not exist; give the folder (or table file) of raw data"
        )
    if not (os.path.isdir(root) or os.path.isfile(root)):
        raise SourceError(
            f"{display_path(root)} is not a folder or a regular file (a FIFO, a device, a "
            "socket?); give the folder (or table file) of raw data"
        )
    if kind != "auto":
        if kind not in SOURCE_KINDS:
            raise SourceError(
                f"--source {kind!r} is unknown; choose from {', '.join(SOURCE_KINDS)}"
            )
        return _source_class(kind)(root, options)
    for name in SOURCE_KINDS:
        cls = _source_class(name)
        if cls.detect(root):
            return cls(root, options)
    raise SourceError(
        f"{display_path(root)}: cannot tell its layout (none of {', '.join(SOURCE_KINDS)} "
        "matches: expected class folders of images, a CSV/JSONL/Parquet table, key.ext "
        "files, or CIFAR/MNIST files as shipped); name it with --source"
    )
