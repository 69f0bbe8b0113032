"""Flowers-102 and Stanford Cars: datasets whose split lists are MATLAB files.

The ``.mat`` files are read with scipy (``pip install scipy``; torchvision needs it for these
datasets too), after dlpipe's own bounds: at most 16 MiB on disk, the compressed variables
at most 16 MiB inflated in all (scipy keeps every variable), and no array (at any depth of
cells and structs) claiming more elements than it has bytes, so a crafted file is one
`SourceError`, never a huge allocation.
"""

from __future__ import annotations

import io
import math
import os
import struct
import zlib
from dataclasses import replace
from typing import Any

import numpy as np

from dlpipe.annotations import BOXES_FIELD, BOXES_SCHEMA, encode_boxes
from dlpipe.converters.listed import Listed, ListedSource, Listing, failed, find_base, join
from dlpipe.converters.raw_tree import RawEntry
from dlpipe.converters.source import SampleError, SourceError, display_path, read_file

__all__ = ["LAYOUTS", "Flowers102Source", "StanfordCarsSource", "load_mat"]

_MAX_MAT_BYTES = 16 << 20  # setid.mat is 15 KB, cars_train_annos.mat 330 KB
_MAX_DEPTH = 16  # the datasets' files nest a struct's fields one deep
_MI_MATRIX, _MI_COMPRESSED, _MX_CELL, _MX_STRUCT = 14, 15, 1, 2


def load_mat(raw_folder: str, path: str) -> dict[str, Any]:
    """The variables of a MATLAB v5/v7 file, as ``scipy.io.loadmat(squeeze_me=True)`` gives
    them, read within this module's bounds.

    Raises:
        SourceError: scipy is missing (naming ``pip install scipy``), or the file is missing,
            oversized or not a readable MATLAB v5/v7 file.
    """
    shown = display_path(path)
    try:
        import scipy.io
    except ImportError:
        raise SourceError(
            f"{shown}: reading MATLAB files needs scipy, which is not installed: pip install scipy"
        ) from None
    if not os.path.lexists(path):
        raise SourceError(f"{shown} is missing; restore it from the dataset's download")
    try:
        data = read_file(path, raw_folder, max_bytes=_MAX_MAT_BYTES)
    except SampleError as exc:
        raise SourceError(str(exc)) from None
    _check_bounds(data, shown)
    try:
        return dict(scipy.io.loadmat(io.BytesIO(data), squeeze_me=True))
    except Exception as exc:  # scipy raises ValueError, TypeError, NotImplementedError (v7.3)...
        raise SourceError(
            f"{shown}: not a readable MATLAB v5/v7 file ({exc}); restore it"
        ) from None


def _check_bounds(data: bytes, shown: str) -> None:
    """Refuse a file whose variables inflate past the limit or claim more elements than bytes."""
    endian = {b"IM": "<", b"MI": ">"}.get(data[126:128])
    if len(data) < 128 or endian is None:
        raise SourceError(f"{shown}: no MATLAB 5 header (a v7.3 file must be saved with -v7)")
    pos, budget = 128, _MAX_MAT_BYTES  # for all variables: scipy keeps every one of them
    while pos + 8 <= len(data):
        kind, size = struct.unpack_from(endian + "II", data, pos)
        body = data[pos + 8 : pos + 8 + size]
        pos += 8 + (size if kind == _MI_COMPRESSED else (size + 7) // 8 * 8)
        if kind == _MI_COMPRESSED:
            try:
                body = zlib.decompressobj().decompress(body, budget + 1)
            except zlib.error as exc:
                raise SourceError(f"{shown}: damaged compressed data ({exc}); restore it") from None
            if len(body) > budget:
                raise SourceError(
                    f"{shown}: a variable inflates past {_MAX_MAT_BYTES >> 20} MiB (with the "
                    "variables before it); restore the file"
                )
            budget -= len(body)
            if len(body) >= 8:
                kind, size = struct.unpack_from(endian + "II", body)
                body = body[8 : 8 + size]
        if kind == _MI_MATRIX:
            _check_matrix(body, endian, shown)


def _elements(body: bytes, pos: int, endian: str) -> tuple[int, bytes, int]:
    """(type, payload, next position) of the element at `pos` (small elements included)."""
    kind, size = struct.unpack_from(endian + "II", body, pos)
    if kind >> 16:
        return kind & 0xFFFF, body[pos + 4 : pos + 4 + (kind >> 16)], pos + 8
    return kind, body[pos + 8 : pos + 8 + size], pos + 8 + (size + 7) // 8 * 8


def _check_matrix(body: bytes, endian: str, shown: str, depth: int = 0) -> None:
    if depth > _MAX_DEPTH:
        raise SourceError(f"{shown}: cells or structs nested over {_MAX_DEPTH} deep; restore it")
    try:
        _, flags, pos = _elements(body, 0, endian)
        _, dims_data, pos = _elements(body, pos, endian)
        _, _, pos = _elements(body, pos, endian)  # the name
        dims = struct.unpack(
            f"{endian}{len(dims_data) // 4}i", dims_data[: len(dims_data) // 4 * 4]
        )
        count = math.prod(dims)
        if min(dims, default=0) < 0 or count > len(body):
            raise SourceError(f"{shown}: an array claims {count} elements in {len(body)} bytes")
        matlab_class = flags[0] if endian == "<" else flags[3]
        if matlab_class == _MX_STRUCT:
            _, length_data, pos = _elements(body, pos, endian)
            _, names, pos = _elements(body, pos, endian)
            length = struct.unpack(endian + "i", length_data[:4])[0]
            count *= len(names) // length if length > 0 else 0
        if matlab_class in (_MX_CELL, _MX_STRUCT):
            for _ in range(count):
                _, inner, pos = _elements(body, pos, endian)
                _check_matrix(inner, endian, shown, depth + 1)
    except struct.error:
        raise SourceError(f"{shown}: a MATLAB element is cut short; restore the file") from None


def _ids(value: Any, shown: str) -> list[int]:
    """A MATLAB numeric vector of whole numbers as ints; SourceError otherwise."""
    array = np.atleast_1d(np.asarray(value))
    if array.dtype.kind not in "iuf" or array.ndim != 1 or not np.all(np.mod(array, 1) == 0):
        raise SourceError(f"{shown} is missing or not a vector of whole numbers; restore the file")
    return [int(v) for v in array]


_FLOWER_NAMES = (
    "pink primrose", "hard-leaved pocket orchid", "canterbury bells", "sweet pea",
    "english marigold", "tiger lily", "moon orchid", "bird of paradise", "monkshood",
    "globe thistle", "snapdragon", "colt's foot", "king protea", "spear thistle", "yellow iris",
    "globe-flower", "purple coneflower", "peruvian lily", "balloon flower",
    "giant white arum lily", "fire lily", "pincushion flower", "fritillary", "red ginger",
    "grape hyacinth", "corn poppy", "prince of wales feathers", "stemless gentian", "artichoke",
    "sweet william", "carnation", "garden phlox", "love in the mist", "mexican aster",
    "alpine sea holly", "ruby-lipped cattleya", "cape flower", "great masterwort", "siam tulip",
    "lenten rose", "barbeton daisy", "daffodil", "sword lily", "poinsettia", "bolero deep blue",
    "wallflower", "marigold", "buttercup", "oxeye daisy", "common dandelion", "petunia",
    "wild pansy", "primula", "sunflower", "pelargonium", "bishop of llandaff", "gaura",
    "geranium", "orange dahlia", "pink-yellow dahlia?", "cautleya spicata", "japanese anemone",
    "black-eyed susan", "silverbush", "californian poppy", "osteospermum", "spring crocus",
    "bearded iris", "windflower", "tree poppy", "gazania", "azalea", "water lily", "rose",
    "thorn apple", "morning glory", "passion flower", "lotus", "toad lily", "anthurium",
    "frangipani", "clematis", "hibiscus", "columbine", "desert-rose", "tree mallow", "magnolia",
    "cyclamen", "watercress", "canna lily", "hippeastrum", "bee balm", "ball moss", "foxglove",
    "bougainvillea", "camellia", "mallow", "mexican petunia", "bromelia", "blanket flower",
    "trumpet creeper", "blackberry lily",
)  # fmt: skip
"""Flowers-102's class names as torchvision's ``Flowers102.classes`` gives them (label 1 first);
the download itself names none."""


class Flowers102Source(ListedSource):
    """``flowers102``: Oxford Flowers-102 as torchvision's ``Flowers102`` reads it.

    Layout: ``jpg/image_00001.jpg`` … (``102flowers.tgz``), ``imagelabels.mat`` (``labels``:
    the class 1..102 of image i at position i) and ``setid.mat`` (``trnid``, ``valid``,
    ``tstid``: the image numbers of each split) beside ``jpg/``. RAW is that folder, or the
    folder holding torchvision's ``flowers-102/``.

    Produces image + ``cls``; splits ``train`` (trnid), ``val`` (valid), ``test`` (tstid);
    classes = torchvision's 102 names (0 = label 1, ``pink primrose``), the labels in
    ``class_ids``; key = the file stem (``image_00001``). An image number without a label, or a
    label outside 1..102, is a skipped sample; an image in no split is counted in ``unused``.
    """

    kind = "flowers102"
    name = "Flowers-102"
    needs = "jpg/, imagelabels.mat and setid.mat (or flowers-102/ holding them)"
    _SPLITS = (("train", "trnid"), ("val", "valid"), ("test", "tstid"))

    @classmethod
    def find_base(cls, root: str) -> str | None:
        return find_base(root, ("", "flowers-102"), ("jpg/", "imagelabels.mat", "setid.mat"))

    def read_lists(self, base: str, files: dict[str, RawEntry]) -> Listing:
        labels_file, setid_file = (
            self.path(join(base, "imagelabels.mat")),
            self.path(join(base, "setid.mat")),
        )
        labels_mat, setid = (
            load_mat(self.raw_folder, labels_file),
            load_mat(self.raw_folder, setid_file),
        )
        labels = _ids(labels_mat.get("labels"), f"{display_path(labels_file)} 'labels'")
        entries = []
        for split, variable in self._SPLITS:
            shown = f"{display_path(setid_file)} '{variable}'"
            for position, number in enumerate(_ids(setid.get(variable), shown), 1):
                stem = f"image_{number:05d}"
                entry = Listed(split, join(base, "jpg", f"{stem}.jpg"), stem, None, shown, position,
                               place="entry")  # fmt: skip
                entries.append(_flower_label(entry, number, labels))
        read = {join(base, "imagelabels.mat"), join(base, "setid.mat")}
        return Listing(
            layout=f"Flowers-102 ({', '.join(sorted(read))}, jpg/)",
            classes=_FLOWER_NAMES,
            entries=entries,
            read=read,
            class_ids=tuple(range(1, len(_FLOWER_NAMES) + 1)),
        )


def _flower_label(entry: Listed, number: int, labels: list[int]) -> Listed:
    if not 1 <= number <= len(labels):
        return failed(entry, f"image {number} has no label (imagelabels.mat labels "
                             f"images 1..{len(labels)})")  # fmt: skip
    label = labels[number - 1]
    if not 1 <= label <= len(_FLOWER_NAMES):
        return failed(entry, f"image {number} has label {label}, not one of 1..102")
    return replace(entry, label=label - 1)


class StanfordCarsSource(ListedSource):
    """``stanford-cars``: Stanford Cars (Cars-196) as torchvision's ``StanfordCars`` reads it.

    Layout: ``cars_train/00001.jpg`` …, ``cars_test/00001.jpg`` …, ``devkit/cars_meta.mat``
    (``class_names``: a cell of 196 names, class 1 first), ``devkit/cars_train_annos.mat`` and
    ``cars_test_annos_withlabels.mat`` (in the folder or in ``devkit/``; ``annotations``: a
    struct array of ``bbox_x1, bbox_y1, bbox_x2, bbox_y2, class, fname``). RAW is that folder,
    or the folder holding torchvision's ``stanford_cars/``. A test split with only the
    devkit's unlabelled ``cars_test_annos.mat`` is left out (``source.left_out``).

    Produces image + ``cls`` + ``boxes.json`` (the car's box; the devkit's 1-based inclusive
    pixel bounds become ``[x1 - 1, y1 - 1, x2, y2]``, labelled with the class); splits
    ``train`` and ``test``; classes = ``class_names`` in order, ids 1.. in ``class_ids``; key =
    the file stem. A row with a class outside 1..N, no file name or a box that is not four
    numbers is a skipped sample.
    """

    kind = "stanford-cars"
    name = "Stanford Cars"
    needs = "devkit/cars_meta.mat and cars_train/ or cars_test/ (or stanford_cars/ holding them)"
    _FIELDS = ("bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2", "class", "fname")

    @classmethod
    def find_base(cls, root: str) -> str | None:
        folders = ("cars_train/", "cars_test/")
        return find_base(root, ("", "stanford_cars"), ("devkit/cars_meta.mat",), folders)

    def read_lists(self, base: str, files: dict[str, RawEntry]) -> Listing:
        meta = self.path(join(base, "devkit", "cars_meta.mat"))
        names = np.atleast_1d(load_mat(self.raw_folder, meta).get("class_names", np.array([])))
        if not names.size or not all(isinstance(n, str) for n in names):
            raise SourceError(f"{display_path(meta)}: 'class_names' is not a cell of names")
        read, entries, left_out = {join(base, "devkit", "cars_meta.mat")}, [], {}
        test = [join(base, n) for n in ("cars_test_annos_withlabels.mat",
                                         "devkit/cars_test_annos_withlabels.mat")]  # fmt: skip
        for split, candidates in (
            ("train", [join(base, "devkit/cars_train_annos.mat")]),
            ("test", test),
        ):
            annos = next((rel for rel in candidates if rel in files), None)
            if annos is None:
                left_out[split] = f"none of {', '.join(candidates)} is there"
                continue
            read.add(annos)
            entries += self._split(split, base, annos, len(names))
        return Listing(
            layout=f"Stanford Cars ({', '.join(sorted(read))})",
            classes=tuple(str(n) for n in names),
            entries=entries,
            read=read,
            field_schemas={BOXES_FIELD: BOXES_SCHEMA},
            class_ids=tuple(range(1, len(names) + 1)),
            description={"left_out": left_out} if left_out else {},
        )

    def _split(self, split: str, base: str, annos: str, num_classes: int) -> list[Listed]:
        path = self.path(annos)
        shown = f"{display_path(path)} 'annotations'"
        rows = np.atleast_1d(load_mat(self.raw_folder, path).get("annotations", np.array([])))
        if rows.dtype.names is None or not set(self._FIELDS) <= set(rows.dtype.names):
            raise SourceError(
                f"{shown} is not a struct array with fields {', '.join(self._FIELDS)}"
            )
        entries = []
        for position, row in enumerate(rows, 1):
            fname = row["fname"]
            stem = (
                os.path.splitext(fname)[0]
                if isinstance(fname, str) and fname
                else f"row_{position}"
            )
            image = join(base, f"cars_{split}", fname) if isinstance(fname, str) and fname else None
            entry = Listed(split, image, stem, None, shown, position, place="entry")
            entries.append(_car_annotations(entry, row, num_classes))
        return entries

    def annotations(self, extra: Any) -> dict[str, bytes]:
        box, label = extra
        return {BOXES_FIELD: encode_boxes([box], [label])}

    def unused_kind(self, rel: str) -> str:
        return "annotation files" if rel.endswith(".mat") else super().unused_kind(rel)


def _car_annotations(entry: Listed, row: Any, num_classes: int) -> Listed:
    if entry.image is None:
        return failed(entry, "has no file name (fname)")
    try:
        x1, y1, x2, y2, class_id = (
            float(np.asarray(row[f]).item()) for f in StanfordCarsSource._FIELDS[:5]
        )
    except (TypeError, ValueError):
        return failed(entry, "has a box or class that is not a number")
    if not class_id.is_integer() or not 1 <= class_id <= num_classes:
        return failed(entry, f"has class {class_id:g}, not one of 1..{num_classes}")
    label = int(class_id) - 1
    return replace(entry, label=label, extra=([x1 - 1, y1 - 1, x2, y2], label))


LAYOUTS: tuple[type[ListedSource], ...] = (Flowers102Source, StanfordCarsSource)
"""The layouts of this module, which the generic ``splitlist`` rule leaves to them."""
