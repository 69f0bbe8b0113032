"""``oxford-pets``: the Oxford-IIIT Pet dataset, read exactly as its two archives unpack."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, ClassVar

from dlpipe.annotations import MASK_FIELD, mask_schema
from dlpipe.converters.listed import (
    Listed,
    ListedSource,
    Listing,
    data_lines,
    failed,
    find_base,
    join,
    read_list_file,
    shown_line,
)
from dlpipe.converters.raw_tree import RawEntry
from dlpipe.converters.source import SampleError, SourceError, display_path, read_file

__all__ = ["OxfordPetsSource"]

_TRIMAP_VALUES = {1: "pet", 2: "background", 3: "border"}


class OxfordPetsSource(ListedSource):
    """``oxford-pets``: the Oxford-IIIT Pet dataset (``images.tar.gz`` and
    ``annotations.tar.gz`` unpacked side by side), as torchvision's ``OxfordIIITPet`` reads it.

    Layout: ``images/<Breed>_<n>.jpg`` (cat breeds capitalised, dog breeds lower case; a few
    ``.mat`` files lie there too), ``annotations/trainval.txt`` and ``test.txt`` (``Image
    CLASS-ID SPECIES BREED-ID``, e.g. ``great_pyrenees_173 16 2 11``), ``annotations/list.txt``
    (the same lines under ``#`` comment lines), ``annotations/trimaps/<Image>.png`` (1 pet,
    2 background, 3 border; macOS ``._*`` files beside them are never read) and
    ``annotations/xmls/`` (head boxes of some trainval images: not read, counted in
    ``unused``). RAW is the folder holding ``images/`` and ``annotations/``, or the
    ``oxford-iiit-pet/`` folder torchvision downloads to, or the folder holding that.

    Produces image + ``cls`` + ``seg.png`` (the trimap as it is) + ``json`` (``{"species":
    "Cat"|"Dog", "breed_id": n}``, torchvision's binary category); splits ``trainval`` and
    ``test`` (the official names); classes by CLASS-ID (its ids in ``class_ids``), named as
    torchvision names them (``great_pyrenees`` → ``Great Pyrenees``; the file-name breeds in
    ``source.breeds``); key = the image name. A malformed line, a missing trimap or a trimap
    holding another value than 1, 2, 3 is a skipped sample; two breeds for one CLASS-ID stop
    the scan.
    """

    kind = "oxford-pets"
    name = "Oxford-IIIT Pet"
    needs = "images/ and annotations/trainval.txt or test.txt (or oxford-iiit-pet/ holding them)"
    _LISTS: ClassVar[dict[str, str]] = {"trainval": "trainval.txt", "test": "test.txt"}

    @classmethod
    def find_base(cls, root: str) -> str | None:
        bases = ("", "oxford-iiit-pet")
        lists = ("annotations/trainval.txt", "annotations/test.txt")
        return find_base(root, bases, ("images/",), lists)

    def read_lists(self, base: str, files: dict[str, RawEntry]) -> Listing:
        notes = join(base, "annotations")
        read = {join(notes, name) for name in self._LISTS.values()}
        texts = {split: self._lines(join(notes, name)) for split, name in self._LISTS.items()}
        everything = [row for rows in texts.values() for row in rows]
        if join(notes, "list.txt") in files:
            read.add(join(notes, "list.txt"))
            everything += self._lines(join(notes, "list.txt"))
        layout = f"Oxford-IIIT Pet ({', '.join(sorted(read))}, {join(notes, 'trimaps/')})"
        breeds = _pet_breeds(everything)
        ids = sorted(breeds)
        index = {class_id: i for i, class_id in enumerate(ids)}
        entries = []
        for split, rows in texts.items():
            for shown, number, fields in rows:
                stem = fields[0]
                entry = Listed(
                    split, join(base, "images", f"{stem}.jpg"), stem, None, shown, number
                )
                trimap = join(notes, "trimaps", f"{stem}.png")
                entries.append(_pet_entry(entry, fields, index, trimap, trimap in files))
                read.add(trimap)  # read with its image (a missing one is in no count)
        return Listing(
            layout=layout,
            classes=tuple(" ".join(p.title() for p in breeds[i].split("_")) for i in ids),
            entries=entries,
            read=read,
            field_schemas={MASK_FIELD: mask_schema(_TRIMAP_VALUES)},
            class_ids=tuple(ids),
            description={"breeds": [breeds[i] for i in ids]},
        )

    def _lines(self, rel: str) -> list[tuple[str, int, list[str]]]:
        path = self.path(rel)
        shown = display_path(path)
        text = read_list_file(self.raw_folder, path)
        return [(shown, number, line.split()) for number, line in data_lines(text)]

    def unused_kind(self, rel: str) -> str:
        parts = rel.split("/")
        if "xmls" in parts:
            return "annotation files"
        if "trimaps" in parts:
            return "masks"
        return super().unused_kind(rel)

    def annotations(self, extra: Any) -> dict[str, bytes]:
        trimap, fields = extra
        path = self.path(trimap)
        data = read_file(path, self.raw_folder)
        _check_trimap(data, path)
        return {MASK_FIELD: data, "json": fields.encode("utf-8")}


def _pet_fields(fields: list[str]) -> tuple[int, int, int] | None:
    """(CLASS-ID, SPECIES, BREED-ID) of a well-formed line's fields, else None."""
    numbers = fields[1:]
    if len(fields) != 4 or not all(v.isascii() and v.isdigit() for v in numbers):
        return None
    class_id, species, breed_id = (int(v) for v in numbers)
    return (class_id, species, breed_id) if species in (1, 2) and class_id > 0 else None


def _pet_breeds(rows: list[tuple[str, int, list[str]]]) -> dict[int, str]:
    """CLASS-ID → the breed its image names share; SourceError when one id has two breeds."""
    breeds: dict[int, tuple[str, str]] = {}
    for shown, number, fields in rows:
        parsed = _pet_fields(fields)
        if parsed is None:
            continue
        breed = fields[0].rsplit("_", 1)[0]
        first = breeds.setdefault(parsed[0], (breed, f"{shown} line {number}"))
        if first[0] != breed:
            raise SourceError(
                f"{shown} line {number}: CLASS-ID {parsed[0]} is breed {breed!r}, but {first[1]} "
                f"gives it {first[0]!r}; restore the lists from the download"
            )
    if not breeds:
        raise SourceError(
            f"{rows[0][0] if rows else 'annotations/'}: no line 'Image CLASS-ID SPECIES "
            "BREED-ID'; restore trainval.txt and test.txt from annotations.tar.gz"
        )
    return {class_id: breed for class_id, (breed, _) in breeds.items()}


def _pet_entry(
    entry: Listed, fields: list[str], index: dict[int, int], trimap: str, has_trimap: bool
) -> Listed:
    parsed = _pet_fields(fields)
    if parsed is None:
        return failed(entry, f"{shown_line(' '.join(fields))} is not 'Image CLASS-ID SPECIES "
                              "BREED-ID' (SPECIES 1 cat, 2 dog)")  # fmt: skip
    if not has_trimap:
        return failed(entry, f"image {fields[0]} has no trimap {trimap}")
    class_id, species, breed_id = parsed
    info = json.dumps({"breed_id": breed_id, "species": ("Cat", "Dog")[species - 1]},
                      separators=(",", ":"), sort_keys=True)  # fmt: skip
    return replace(entry, label=index[class_id], extra=(trimap, info))


def _check_trimap(data: bytes, path: str) -> None:
    """Refuse a trimap holding a value the schema does not name (1 pet, 2 background, 3 border)."""
    import numpy as np

    from dlpipe.codecs import open_image

    try:
        image = open_image(data)
        values = set(np.unique(np.asarray(image)).tolist()) if image.mode in ("L", "P") else None
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError, ...
        raise SampleError(f"{display_path(path)}: not a readable PNG ({exc})") from None
    if values is None or not values <= _TRIMAP_VALUES.keys():
        what = f"values {sorted(values)}" if values is not None else f"mode {image.mode}"
        raise SampleError(
            f"{display_path(path)}: a trimap holds 1 (pet), 2 (background), 3 (border) in one "
            f"channel; this one has {what}"
        )
