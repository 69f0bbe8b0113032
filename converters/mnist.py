"""``mnist``: MNIST and Fashion-MNIST, the IDX files as their sites ship them.

Layout: ``root/`` (or ``root/raw/``, as torchvision stores them) holds
``train-images-idx3-ubyte`` + ``train-labels-idx1-ubyte`` (train) and/or
``t10k-images-idx3-ubyte`` + ``t10k-labels-idx1-ubyte`` (test), each plain or gzip-compressed
with a ``.gz`` suffix (the plain file wins when both exist), each a regular file inside the
raw folder (a FIFO, a device or a link out of it is not an MNIST file). A ``.gz`` file is
decompressed up to the size its header states, and at most 200 times its compressed size (a
decompression bomb is refused; MNIST's files expand 4-8 times: decompress a file yourself to
go past it). An image file is a big-endian
header (magic ``0x00000803``, count, rows, cols) and count x rows x cols uint8 pixels; a label
file is magic ``0x00000801``, count and count uint8 labels. Header, file size and the two
counts are checked.

Produces one sample per image: a lossless greyscale PNG and ``cls``, split ``train`` or
``test``, keyed ``mnist_train_000123`` (``fashion_mnist_...``) by the image's index. Classes are
the digits ``0``..``9``, or the Fashion-MNIST names when ``fashion`` appears in the root's path
(any case) or ``fashion=True`` is given.

Every other file below ``root`` is not read and is counted in ``source.unused`` (images by
their suffix, the rest as other): the ``.gz`` beside a plain file, torchvision's
``processed/*.pt``, a README.
"""

from __future__ import annotations

import gzip
import io
import os
import struct
import zlib

import numpy as np
from PIL import Image

from dlpipe.converters.listed import unread_account
from dlpipe.converters.raw_tree import Listings
from dlpipe.converters.source import (
    Item,
    SampleError,
    Scan,
    Source,
    SourceError,
    SourceOptions,
    display_path,
    file_problem,
    open_regular,
    raw_folder_of,
)

__all__ = ["FASHION_CLASSES", "MnistSource"]

FASHION_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                   "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")  # fmt: skip
_SPLITS = {"train": "train", "test": "t10k"}
_IMAGES, _LABELS = 0x00000803, 0x00000801
_PNG_OVERHEAD = 100  # PNG signature, chunks and zlib framing around the pixel bytes
_MAX_GZIP_RATIO = 200  # decompressed bytes per compressed byte; MNIST's own files: 4-8
_cache: dict[tuple[str, int, int], np.ndarray] = {}  # per process: (path, mtime, size) -> array


def _find_file(folder: str, stem: str) -> str | None:
    raw = raw_folder_of(folder)
    for name in (stem, stem + ".gz"):
        if file_problem(os.path.join(folder, name), raw) is None:
            return os.path.join(folder, name)
    return None


def _gunzip(path: str, f: gzip.GzipFile, compressed: int, magic: int) -> bytes:
    """The decompressed file, read no further than its header's size (and the ratio cap)."""
    header = f.read(4 + 4 * (magic & 0xFF))
    if header[:4] != struct.pack(">I", magic):
        return header  # read_idx names the wrong magic number
    ndim = magic & 0xFF
    dims = struct.unpack(f">{ndim}I", header[4:]) if len(header) == 4 + 4 * ndim else ()
    limit = compressed * _MAX_GZIP_RATIO + (1 << 20)
    wanted = len(header) + int(np.prod(dims, dtype=np.int64)) if dims else len(header)
    if wanted > limit:
        raise SourceError(
            f"{display_path(path)}: its header {list(dims)} claims {wanted} bytes, over "
            f"{_MAX_GZIP_RATIO} times its {compressed} compressed bytes (a decompression "
            "bomb?); decompress it yourself (gunzip) if it is genuine"
        )
    return header + f.read(wanted - len(header) + 1)  # one byte more shows a longer file


def _raw_bytes(path: str, magic: int) -> bytes | np.ndarray:
    """A file's bytes: a read-only memory map when plain, decompressed once when ``.gz``."""
    try:
        with open_regular(path, raw_folder_of(os.path.dirname(path))) as f:
            size = os.fstat(f.fileno()).st_size
            if path.endswith(".gz"):
                with gzip.GzipFile(fileobj=f, mode="rb") as unzipped:
                    return _gunzip(path, unzipped, size, magic)
            return np.memmap(f, dtype=np.uint8, mode="r") if size else b""
    except SampleError as exc:
        raise SourceError(f"{exc}; it cannot be an MNIST file") from exc
    except (OSError, EOFError, zlib.error) as exc:
        raise SourceError(
            f"{display_path(path)}: cannot be read or decompressed ({exc}); re-download it"
        ) from exc


def read_idx(path: str, magic: int) -> np.ndarray:
    """The uint8 array an IDX file holds, shaped by its header; cached per process.

    Raises:
        SourceError: unreadable, wrong magic number, or a size that does not match the header.
    """
    stat = os.stat(path)
    key = (path, stat.st_mtime_ns, stat.st_size)
    if key in _cache:
        return _cache[key]
    raw = _raw_bytes(path, magic)
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    found = struct.unpack(">I", bytes(raw[:4]))[0] if len(raw) >= 4 else None
    if found != magic:
        hint = " (gzip data: name it .gz)" if bytes(raw[:2]) == b"\x1f\x8b" else ""
        shown = "missing" if found is None else f"0x{found:08X}"
        raise SourceError(
            f"{path}: magic number {shown}, expected 0x{magic:08X} for an IDX "
            f"file of {'images' if ndim == 3 else 'labels'}{hint}"
        )
    dims = struct.unpack(f">{ndim}I", bytes(raw[4:header])) if len(raw) >= header else ()
    expected = header + int(np.prod(dims, dtype=np.int64)) if dims else None
    if expected != len(raw):
        raise SourceError(
            f"{path}: {len(raw)} bytes, but its header {list(dims)} needs "
            f"{expected}; the file is truncated or damaged, re-download it"
        )
    array = np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)
    _cache[key] = array
    return array


class MnistSource(Source):
    kind = "mnist"

    def __init__(
        self,
        root: str,
        options: SourceOptions | None = None,
        *,
        fashion: bool | None = None,
        listings: Listings | None = None,
    ) -> None:
        """A source over the IDX files at `root`.

        Args:
            root: the folder holding the IDX files (or their ``raw/`` folder).
            options: unused; MNIST has no columns to name.
            fashion: Fashion-MNIST class names; None decides from ``fashion`` in the path.
            listings: folder listings detection made (the scan lists the root once more to
                count what it does not read).
        """
        super().__init__(root, options, listings=listings)
        self.fashion = "fashion" in self.root.lower() if fashion is None else fashion

    @classmethod
    def detect(cls, root: str, listings: Listings | None = None) -> bool:
        """True when `root` (or ``root/raw``) holds an MNIST images file, plain or gzipped."""
        return any(
            _find_file(folder, f"{prefix}-images-idx3-ubyte")
            for folder in (root, os.path.join(root, "raw"))
            for prefix in _SPLITS.values()
        )

    def _folder(self) -> str:
        """The root, or its ``raw/`` folder when only that holds the files (looked up once)."""
        if getattr(self, "_found", None) is None:
            raw = os.path.join(self.root, "raw")
            self._found = raw if not self._files(self.root) and self._files(raw) else self.root
        return self._found

    @staticmethod
    def _files(folder: str) -> dict[str, tuple[str | None, str | None]]:
        """Split → (images file, labels file) for every split with either present."""
        found = {split: (_find_file(folder, f"{prefix}-images-idx3-ubyte"),
                         _find_file(folder, f"{prefix}-labels-idx1-ubyte"))
                 for split, prefix in _SPLITS.items()}  # fmt: skip
        return {split: pair for split, pair in found.items() if any(pair)}

    def scan(self) -> Scan:
        folder = self._folder()
        files = self._files(folder)
        if not files:
            raise SourceError(
                f"{folder}: no MNIST files (expected train-images-idx3-ubyte, "
                "train-labels-idx1-ubyte, t10k-..., plain or .gz)"
            )
        name = "fashion_mnist" if self.fashion else "mnist"
        classes = FASHION_CLASSES if self.fashion else tuple(str(d) for d in range(10))
        items: list[Item] = []
        for split, (images_path, labels_path) in files.items():
            images, labels = self._split_arrays(folder, split, images_path, labels_path)
            size = images.shape[1] * images.shape[2] + _PNG_OVERHEAD
            for index, label in enumerate(labels.tolist()):
                items.append(
                    Item(
                        key=f"{name}_{split}_{index:06d}",
                        label=label,
                        split=split,
                        ref=(os.path.basename(images_path or ""), index),
                        size=size,
                        image_kind="png",
                        origin=f"{images_path} image {index}",
                    )
                )
        read = {path for pair in files.values() for path in pair if path}
        description = {
            "kind": self.kind,
            "root": display_path(self.root),
            "dataset": name,
            "folder": display_path(folder),
            "layout": self._layout_text(folder, read),
            **unread_account(self.root, read, self.take_listings()),
        }
        return Scan(classes=classes, items=tuple(items), description=description)

    def _layout_text(self, folder: str, read: set[str]) -> str:
        where = "its top" if folder == self.root else f"{display_path(os.path.basename(folder))}/"
        title = "Fashion-MNIST" if self.fashion else "MNIST"
        names = ", ".join(sorted(display_path(os.path.basename(p)) for p in read))
        return f"{where} holds {title}'s IDX files ({names})"

    @staticmethod
    def _split_arrays(
        folder: str, split: str, images_path: str | None, labels_path: str | None
    ) -> tuple[np.ndarray, np.ndarray]:
        prefix = _SPLITS[split]
        if images_path is None or labels_path is None:
            missing = f"{prefix}-{'images-idx3' if images_path is None else 'labels-idx1'}-ubyte"
            raise SourceError(
                f"{folder}: {missing}[.gz] is missing; the {split} split needs "
                "both its images and labels file"
            )
        images, labels = read_idx(images_path, _IMAGES), read_idx(labels_path, _LABELS)
        if len(images) != len(labels):
            raise SourceError(
                f"{images_path} holds {len(images)} images but {labels_path} "
                f"{len(labels)} labels; they must match (re-download both)"
            )
        if len(labels) and int(labels.max()) > 9:
            raise SourceError(f"{labels_path}: label {int(labels.max())} is out of range 0..9")
        return images, labels

    def load(self, item: Item) -> dict[str, bytes]:
        """The image at ``item.ref`` = (images file name, index) as lossless PNG bytes."""
        file, index = item.ref
        try:
            images = read_idx(os.path.join(self._folder(), file), _IMAGES)
        except (OSError, SourceError) as exc:
            raise SampleError(f"{item.origin}: cannot be read ({exc})") from exc
        if not 0 <= index < len(images):
            raise SampleError(f"{item.origin}: the file has only {len(images)} images; rescan")
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(images[index])).save(buffer, format="PNG")
        return {"image": buffer.getvalue()}
