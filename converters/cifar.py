"""``cifar``: CIFAR-10 and CIFAR-100, the *python* versions as their site ships them, unpacked.

Source: https://www.cs.toronto.edu/~kriz/cifar.html (``cifar-10-python.tar.gz``,
``cifar-100-python.tar.gz``).

Layout (``root`` is the unpacked folder itself, or a folder holding it):

- CIFAR-10: ``cifar-10-batches-py/`` with ``data_batch_1`` … ``data_batch_5`` (train),
  ``test_batch`` (test) and ``batches.meta`` (``label_names``).
- CIFAR-100: ``cifar-100-python/`` with ``train``, ``test`` and ``meta``
  (``fine_label_names``; the fine labels are used, the coarse ones ignored).

Each file is a pickled dict with bytes keys: ``b"data"`` (uint8, N x 3072: the R, G and B
planes of a 32x32 image, row-major), ``b"labels"`` or ``b"fine_labels"`` and ``b"filenames"``.
They are unpickled by a restricted unpickler that builds nothing but numpy arrays: any other
global in a file is refused with a `SourceError`, before anything runs. The files are opened
only as regular files inside the raw folder (a FIFO, a device or a link out of it named
``data_batch_1`` is not a CIFAR file).

Produces one sample per image: a lossless 32x32 RGB PNG and ``cls``, split ``train`` or
``test``, keyed ``cifar10_train_000123`` (the image's index in its split, in file order).

Every other file below ``root`` is not read and is counted in ``source.unused``: the class-name
lists of CIFAR's binary versions (``batches.meta.txt``, ``fine_label_names.txt``,
``coarse_label_names.txt``) as annotation files, image files as images, the rest
(``readme.html``, CIFAR-100's ``file.txt~``, the download's archive) as other.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import numpy as np
from PIL import Image

from dlpipe.converters.listed import unread_account, unused_kind
from dlpipe.converters.raw_tree import Listings
from dlpipe.converters.source import (
    Item,
    SampleError,
    Scan,
    Source,
    SourceError,
    display_path,
    file_problem,
    open_regular,
    raw_folder_of,
)

__all__ = ["CifarSource", "SafeUnpickler"]

_SIZE = 3072 + 100  # estimated PNG bytes: the pixels plus signature, chunks and zlib framing
# name -> (folder as shipped, meta file, label-names key, labels key, split -> batch files)
_LAYOUTS: dict[str, tuple[str, str, bytes, bytes, dict[str, tuple[str, ...]]]] = {
    "cifar10": ("cifar-10-batches-py", "batches.meta", b"label_names", b"labels",
                {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)}),
    "cifar100": ("cifar-100-python", "meta", b"fine_label_names", b"fine_labels",
                 {"train": ("train",), "test": ("test",)}),
}  # fmt: skip
_TITLES = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100"}
_NAME_LISTS = frozenset({"batches.meta.txt", "fine_label_names.txt", "coarse_label_names.txt"})
_cache: dict[tuple[str, int, int], np.ndarray] = {}  # per process: (path, mtime, size) -> data
_RECONSTRUCT = np.empty(0).__reduce__()[0]  # numpy.(_)core.multiarray._reconstruct, as it pickles


def _latin1_encode(text: str, encoding: str) -> bytes:
    # Python 3 pickles bytes at protocol <= 2 as _codecs.encode(text, "latin1"); nothing else
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r} is not allowed")
    return text.encode("latin1")


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that can build numpy arrays, dicts, lists and bytes, and nothing else."""

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file, encoding="bytes")
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        """The few globals a CIFAR batch needs; a `SourceError` for anything else."""
        if name == "_reconstruct" and module in ("numpy.core.multiarray", "numpy._core.multiarray"):
            return _RECONSTRUCT
        if module == "numpy" and name in ("ndarray", "dtype"):
            return getattr(np, name)
        if (module, name) == ("_codecs", "encode"):
            return _latin1_encode
        raise SourceError(
            f"{self.path}: the pickle asks for {module}.{name}, which no CIFAR file holds; "
            "refused without running it (re-download the dataset from its site)"
        )


def _unpickle(path: str, folder: str) -> dict[bytes, Any]:
    try:
        with open_regular(path, folder) as f:
            obj = SafeUnpickler(f, path).load()
    except SampleError as exc:
        raise SourceError(f"{exc}; it cannot be a CIFAR file") from exc
    except SourceError:
        raise
    except OSError as exc:
        raise SourceError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    except Exception as exc:  # a damaged pickle raises any of a dozen types
        raise SourceError(f"{path}: not a readable CIFAR pickle ({exc}); re-download it") from exc
    if not isinstance(obj, dict):
        raise SourceError(f"{path}: holds a {type(obj).__name__}, expected a dict of arrays")
    return obj


def _read_batch(path: str, labels_key: bytes, folder: str) -> tuple[np.ndarray, list[int]]:
    """A batch's images (N x 3072 uint8) and labels, checked; the images cached per process."""
    batch = _unpickle(path, folder)
    data, labels = batch.get(b"data"), batch.get(labels_key)
    if not (
        isinstance(data, np.ndarray)
        and data.dtype == np.uint8
        and data.ndim == 2
        and data.shape[1] == 3072
    ):
        shape = getattr(data, "shape", type(data).__name__)
        raise SourceError(f"{path}: b'data' is {shape}, expected a uint8 array of N x 3072")
    if not isinstance(labels, list) or len(labels) != len(data):
        count = len(labels) if isinstance(labels, list) else type(labels).__name__
        raise SourceError(f"{path}: {count} {labels_key!r} for {len(data)} images; need one each")
    stat = os.stat(path)
    _cache[(path, stat.st_mtime_ns, stat.st_size)] = data
    return data, labels


class CifarSource(Source):
    kind = "cifar"

    @classmethod
    def detect(cls, root: str, listings: Listings | None = None) -> bool:
        """True when `root` is, or holds, an unpacked CIFAR-10 or CIFAR-100 python folder."""
        return bool(_find(root))

    def _layout(self) -> tuple[str, str]:
        """(dataset name, folder), or a `SourceError` saying what was expected."""
        cached: tuple[str, str] | None = getattr(self, "_found", None)
        if cached is not None:
            return cached
        found = _find(self.root)
        if len(found) != 1:
            what = "both CIFAR-10 and CIFAR-100" if found else "no CIFAR files"
            raise SourceError(
                f"{self.root}: holds {what}; give the cifar-10-batches-py/ (data_batch_1..5, "
                "test_batch, batches.meta) or cifar-100-python/ (train, test, meta) folder"
            )
        self._found = found[0]
        return found[0]

    def scan(self) -> Scan:
        name, folder = self._layout()
        _, meta_file, names_key, labels_key, splits = _LAYOUTS[name]
        classes = self._classes(os.path.join(folder, meta_file), names_key, self.raw_folder)
        items: list[Item] = []
        for split, files in splits.items():
            start = len(items)
            for file in files:
                path = os.path.join(folder, file)
                labels = _read_batch(path, labels_key, self.raw_folder)[1]
                for row, label in enumerate(labels):
                    if not isinstance(label, int) or not 0 <= label < len(classes):
                        raise SourceError(
                            f"{path}: row {row} has label {label!r}, expected "
                            f"0..{len(classes) - 1} (one per class in {meta_file})"
                        )
                    key = f"{name}_{split}_{len(items) - start:06d}"
                    origin = f"{path} row {row}"
                    items.append(Item(key, label, split, (file, row), _SIZE, "png", origin))
        read = {os.path.join(folder, f) for f in (meta_file, *sum(splits.values(), ()))}
        description = {
            "kind": self.kind,
            "root": display_path(self.root),
            "dataset": name,
            "folder": display_path(folder),
            "layout": self._layout_text(name, folder),
            **unread_account(self.root, read, self.take_listings(), _unused_kind),
        }
        return Scan(classes=classes, items=tuple(items), description=description)

    def _layout_text(self, name: str, folder: str) -> str:
        shipped, meta_file, _, _, splits = _LAYOUTS[name]
        where = "its top" if folder == self.root else f"{display_path(shipped)}/"
        batches = ", ".join(f for files in splits.values() for f in files)
        return f"{where} holds {_TITLES[name]}'s python batches ({batches}) and {meta_file}"

    @staticmethod
    def _classes(path: str, names_key: bytes, raw_folder: str) -> tuple[str, ...]:
        names = _unpickle(path, raw_folder).get(names_key)
        if not isinstance(names, list) or not names:
            raise SourceError(f"{path}: no {names_key!r} list of class names")
        return tuple(n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in names)

    def load(self, item: Item) -> dict[str, bytes]:
        """The image at ``item.ref`` = (batch file, row) as lossless PNG bytes."""
        file, row = item.ref
        name, folder = self._layout()
        path = os.path.join(folder, file)
        try:
            stat = os.stat(path)
            data = _cache.get((path, stat.st_mtime_ns, stat.st_size))
            if data is None:
                data = _read_batch(path, _LAYOUTS[name][3], self.raw_folder)[0]
        except (OSError, SourceError) as exc:
            raise SampleError(f"{item.origin}: cannot be read ({exc})") from exc
        if not 0 <= row < len(data):
            raise SampleError(f"{item.origin}: the file has only {len(data)} rows; rerun the scan")
        pixels = np.ascontiguousarray(data[row].reshape(3, 32, 32).transpose(1, 2, 0))
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        return {"image": buffer.getvalue()}


def _unused_kind(rel: str) -> str:
    """Another CIFAR version's class-name list is an annotation file; else by suffix."""
    return "annotation files" if rel.rpartition("/")[2] in _NAME_LISTS else unused_kind(rel)


def _find(root: str) -> list[tuple[str, str]]:
    """The CIFAR folders at `root` or one level below it: (dataset name, folder)."""
    found = []
    raw = raw_folder_of(root)

    def regular(path: str) -> bool:
        return file_problem(path, raw) is None

    for name, (shipped, meta_file, _, _, splits) in _LAYOUTS.items():
        for folder in (root, os.path.join(root, shipped)):
            first = (files[0] for files in splits.values())
            if regular(os.path.join(folder, meta_file)) and any(
                regular(os.path.join(folder, f)) for f in first
            ):
                found.append((name, os.path.abspath(folder)))
                break
    return found
