"""The shared base of the sources whose official split lives in list files or tables.

`ListedSource` is the base of every layout whose splits are named by list files or tables
(Food-101 and CUB-200-2011: `dlpipe.converters.splitlist_datasets`; Oxford-IIIT Pet:
`dlpipe.converters.oxford_pets`; Flowers-102 and Stanford Cars:
`dlpipe.converters.splitlist_mat`; the generic rule: `dlpipe.converters.splitlist`). A
subclass finds its folder by file names (`find_base`: RAW itself or the folder its archive
made inside RAW) and reads its lists into `Listed` entries; the base walks RAW once (the
reading rule of `dlpipe.converters.raw_tree`) and holds every layout to the same rules:

- A listed image that is not there is one skipped sample (a `SampleError` naming the list, the
  line and the path looked for), and so is a malformed line or an image without a label; when
  more than half of one list's lines fail, the scan stops with one `SourceError` naming the
  list, an example line and what was looked for (the wrong folder was given, or the images
  were never unpacked).
- An image named twice is refused: official splits never overlap, a list names an image once.
- Image files that no split names are not read and never land in a split: the scan
  description counts them under ``unused["images"]``, beside the annotation files, split
  lists, masks and other files it did not read. ``layout`` names the dataset recognised and
  the files its splits came from.
"""

from __future__ import annotations

import os
from abc import abstractmethod
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from dlpipe.converters.raw_tree import Listings, RawEntry, RawTree, relative_path
from dlpipe.converters.source import (
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
from dlpipe.sample import make_key

__all__ = [
    "UNUSED_KINDS",
    "Listed",
    "ListedSource",
    "Listing",
    "count_unused",
    "data_lines",
    "failed",
    "find_base",
    "join",
    "read_list_file",
    "shown_line",
    "unread_account",
    "unused_kind",
]

UNUSED_KINDS = ("images", "annotation files", "split lists", "masks", "other")
"""The kinds a source counts what it did not read by (``source.unused``; every source's, not
only the listed ones': cifar, mnist, imagenet, files, filenames and hf count by them too)."""
_MAX_LIST_BYTES = 64 << 20  # Food-101's train.txt is 1.4 MB, CUB's images.txt 0.6 MB


@dataclass(frozen=True)
class Listed:
    """One image a split list names.

    Attributes:
        split: the official split.
        image: the image's path relative to the raw folder (``/``-separated), or None when the
            line names none that can be looked up.
        key: the text the sample key is made from (a path in the image folder, no suffix).
        label: the class index, or None.
        list_file: the list naming it, as shown in messages.
        line: the line number in the list.
        problem: why the sample cannot be made (raised as a SampleError by `load`).
        extra: the layout's annotations for `ListedSource.annotations` (small, picklable).
        looked_for: what to name when the image is missing (default: `image`).
        place: what `line` counts (``line``; ``entry`` for a MATLAB array).
    """

    split: str
    image: str | None
    key: str
    label: int | None
    list_file: str
    line: int
    problem: str | None = None
    extra: Any = None
    looked_for: str | None = None
    place: str = "line"

    @property
    def origin(self) -> str:
        return f"{self.list_file} {self.place} {self.line}"


@dataclass
class Listing:
    """What a layout read from its lists: the classes, the images each split names, and the
    files read (relative paths, not counted as unused)."""

    layout: str
    classes: tuple[str, ...]
    entries: list[Listed]
    read: set[str]
    field_schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    class_ids: tuple[int | str, ...] | None = None
    description: dict[str, Any] = field(default_factory=dict)


def unused_kind(rel: str) -> str:
    """The kind an unread file is counted as when its layout knows it no better: ``images``
    by its image suffix, else ``other``."""
    return "images" if image_kind_of_name(rel) else "other"


def count_unused(
    paths: Iterable[str], kind_of: Callable[[str], str] = unused_kind
) -> dict[str, int]:
    """Each of `UNUSED_KINDS` → how many of `paths` (unread files, relative to the raw folder,
    ``/``-separated) `kind_of` counts as it."""
    counts = dict.fromkeys(UNUSED_KINDS, 0)
    for rel in paths:
        counts[kind_of(rel)] += 1
    return counts


def unread_account(
    root: str,
    read: set[str],
    listings: Listings | None = None,
    kind_of: Callable[[str], str] = unused_kind,
) -> dict[str, Any]:
    """A scan description's ``unused`` and skipped entries for a source that reads a few files
    by name (`read`: their paths as joined onto `root`): every other regular file below `root`
    (the rule of `dlpipe.converters.raw_tree`) counted by kind."""
    tree = RawTree(root, listings)
    unread = [relative_path(e.path, root) for e in tree.files(root) if e.path not in read]
    return {"unused": count_unused(unread, kind_of), **tree.report()}


def read_list_file(raw_folder: str, path: str, what: str = "the split lists") -> str:
    """A list file's UTF-8 text (at most 64 MiB, a regular file inside `raw_folder`).

    Raises:
        SourceError: naming the file: missing, unreadable, too large or not UTF-8.
    """
    if not os.path.lexists(path):
        raise SourceError(f"{display_path(path)} is missing; it holds {what} (restore it)")
    return read_text(path, raw_folder, max_bytes=_MAX_LIST_BYTES, fix="restore it")


def data_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, stripped line) of the lines that are not blank or ``#`` comments."""
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            yield number, stripped


def shown_line(text: str) -> str:
    """`text` quoted for a message, cut after 60 characters."""
    return repr(text if len(text) <= 60 else text[:60] + "...")


def failed(entry: Listed, problem: str) -> Listed:
    """`entry` as one that cannot be converted, for `problem` (prefixed with its origin)."""
    return replace(entry, problem=f"{entry.origin}: {problem}")


def join(*parts: str) -> str:
    """Relative path parts joined with ``/`` (empty parts dropped)."""
    return "/".join(p for p in parts if p)


def find_base(
    root: str, bases: tuple[str, ...], names: tuple[str, ...], any_of: tuple[str, ...] = ()
) -> str | None:
    """The first of `bases` (folders below `root`, "" for itself) holding every path in `names`
    (a trailing ``/``: a folder) and at least one of `any_of`; None when none does."""

    def there(base: str, name: str) -> bool:
        path = os.path.join(root, base, name.rstrip("/"))
        return os.path.isdir(path) if name.endswith("/") else os.path.isfile(path)

    for base in bases:
        if all(there(base, n) for n in names) and (
            not any_of or any(there(base, n) for n in any_of)
        ):
            return os.path.join(root, base) if base else root
    return None


class ListedSource(Source):
    """A layout whose splits list their images (see the module docstring for the rules)."""

    name: ClassVar[str]  # the dataset's name in messages and ``layout``
    needs: ClassVar[str]  # what detection looks for, in the message when it is not there

    @classmethod
    @abstractmethod
    def find_base(cls, root: str) -> str | None:
        """The folder holding the layout's files (`root` or a named sub-folder), by names."""

    @abstractmethod
    def read_lists(self, base: str, files: dict[str, RawEntry]) -> Listing:
        """The layout's classes and listed images; `base` is relative to the raw folder ("" or
        ``food-101/``), `files` every regular file below the raw folder by relative path."""

    def unused_kind(self, rel: str) -> str:
        """The kind an unread file is counted as (one of `UNUSED_KINDS`)."""
        return unused_kind(rel)

    def annotations(self, extra: Any) -> dict[str, bytes]:
        """The annotation fields of a sample from its `Listed.extra`."""
        return {}

    @classmethod
    def detect(cls, root: str, listings: Listings | None = None) -> bool:
        return os.path.isdir(root) and cls.find_base(root) is not None

    def path(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/"))

    def scan(self) -> Scan:
        base = self.find_base(self.root)
        if base is None:
            raise SourceError(
                f"{display_path(self.root)}: not the {self.name} layout, which has {self.needs}; "
                "give the folder its download was unpacked into"
            )
        tree = RawTree(self.root, self.take_listings())
        files = {relative_path(e.path, self.root): e for e in tree.files(self.root)}
        rel = os.path.relpath(base, self.root).replace(os.sep, "/")
        listing = self.read_lists("" if rel == "." else rel, files)
        items, used = self._items(tree, files, listing.entries)
        unused = count_unused(files.keys() - used - listing.read, self.unused_kind)
        description = {
            "kind": self.kind,
            "root": display_path(self.root),
            "layout": listing.layout,
            **listing.description,
            "unused": unused,
            **tree.report(),
        }
        return Scan(
            classes=listing.classes,
            items=tuple(items),
            description=description,
            task="classification" if listing.classes else None,
            field_schemas=listing.field_schemas,
            class_ids=listing.class_ids,
        )

    def _items(
        self, tree: RawTree, files: dict[str, RawEntry], entries: list[Listed]
    ) -> tuple[list[Item], set[str]]:
        """The items of the listed images, and the images they use; refuses an image in two
        splits and a list most of whose lines fail."""
        failed: dict[str, list[tuple[Listed, str]]] = defaultdict(list)
        first: dict[str, Listed] = {}
        items = []
        for entry in entries:
            found = files.get(entry.image) if entry.image is not None else None
            problem = entry.problem or (None if found else self._missing(tree, entry))
            if problem:
                failed[entry.list_file].append((entry, problem))
            if found is not None and entry.image is not None:
                _one_split(first.setdefault(entry.image, entry), entry)
            path = found.path if found else self.path(entry.image or entry.key)
            key, shortened = make_key(entry.key)
            ref = (path, problem, entry.extra)
            size, kind = (found.size, image_kind_of_name(found.name)) if found else (0, None)
            original = display_path(entry.key) if shortened else None
            items.append(
                Item(key, entry.label, entry.split, ref, size, kind or None, display_path(path),
                     original)
            )  # fmt: skip
        _check_failures(failed, Counter(e.list_file for e in entries))
        return items, set(first)

    def _missing(self, tree: RawTree, entry: Listed) -> str:
        path = self.path(entry.image or entry.key)
        wanted = entry.looked_for or display_path(path)
        why = tree.skipped.get(display_path(path))
        what = f"is {why}" if why else "does not exist"
        return (
            f"{entry.origin}: names {wanted}, which {what} (restore the image from the "
            "download, or remove the line)"
        )

    def load(self, item: Item) -> dict[str, bytes]:
        """The image's bytes and the layout's annotations; a listed image that is missing, a
        malformed line or an image without a label raises SampleError."""
        path, problem, extra = item.ref
        if problem:
            raise SampleError(problem)
        return {"image": read_file(path, self.raw_folder), **self.annotations(extra)}


def _one_split(first: Listed, entry: Listed) -> None:
    """Refuse a second entry naming `first`'s image: in another split, or again in its own."""
    if first is entry:
        return
    rule = (
        "a split lists each image once (remove one of the lines)"
        if first.split == entry.split
        else f"in splits {first.split} and {entry.split}; an official split never shares an "
        "image with another (restore the lists from the download)"
    )
    raise SourceError(f"{first.origin} and {entry.origin} both name {first.image!r}, {rule}")


def _check_failures(failed: dict[str, list[tuple[Listed, str]]], totals: Counter[str]) -> None:
    """Refuse a list more than half of whose lines cannot be used."""
    for list_file, problems in failed.items():
        if len(problems) * 2 > totals[list_file]:
            raise SourceError(
                f"{list_file}: {len(problems)} of its {totals[list_file]} entries cannot be used, "
                f"e.g. {problems[0][1]}; give the folder the dataset was unpacked into, with "
                "its images"
            )
