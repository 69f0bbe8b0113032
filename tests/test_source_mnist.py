"""The MNIST source reads MNIST and Fashion-MNIST IDX files as shipped, plain or gzipped."""

from __future__ import annotations

import gzip
import io
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import dlpipe
from dlpipe.converters import mnist
from dlpipe.converters.mnist import FASHION_CLASSES, MnistSource
from dlpipe.converters.source import SourceError

TRAIN, TEST = 12, 5


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    """An IDX file as MNIST ships it: big-endian magic (0x0000 08 ndim), dims, uint8 data."""
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data, mtime=0)
    path.write_bytes(data)
    return path


def make_mnist(folder: Path, gz: bool = False, rows: int = 28, cols: int = 28) -> dict:
    """Train and t10k images and labels; returns the arrays by split."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {}
    for split, prefix, count in (("train", "train", TRAIN), ("test", "t10k", TEST)):
        images = rng.integers(0, 256, (count, rows, cols), dtype=np.uint8)
        labels = rng.integers(0, 10, count, dtype=np.uint8)
        write_idx(folder / f"{prefix}-images-idx3-ubyte", images, gz)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte", labels, gz)
        arrays[split] = (images, labels)
    return arrays


def _pixels(png: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.mode == "L"
    return np.asarray(image)


def test_detect(tmp_path: Path) -> None:
    make_mnist(tmp_path / "plain")
    make_mnist(tmp_path / "gz", gz=True)
    make_mnist(tmp_path / "MNIST" / "raw")
    (tmp_path / "other" / "cat").mkdir(parents=True)
    for name in ("plain", "gz", "MNIST"):
        assert MnistSource.detect(str(tmp_path / name))
    assert not MnistSource.detect(str(tmp_path / "other"))


@pytest.mark.parametrize("gz", [False, True])
def test_scan_and_load(tmp_path: Path, gz: bool) -> None:
    arrays = make_mnist(tmp_path, gz=gz)
    source = MnistSource(str(tmp_path))
    scan = source.scan()
    assert scan.classes == tuple("0123456789")
    splits = [item.split for item in scan.items]
    assert splits.count("train") == TRAIN and splits.count("test") == TEST
    keys = [item.key for item in scan.items]
    assert len(set(keys)) == len(keys) and all(dlpipe.check_key(k) == k for k in keys)
    assert keys[0] == "mnist_train_000000" and keys[-1] == f"mnist_test_{TEST - 1:06d}"
    for split, (_images, labels) in arrays.items():
        items = [item for item in scan.items if item.split == split]
        assert [item.label for item in items] == labels.tolist()
        assert all(item.image_kind == "png" and 784 <= item.size < 1024 for item in items)
    worker = pickle.loads(pickle.dumps(source))  # as a worker process receives it
    mnist._cache.clear()
    item = scan.items[TRAIN + 3]
    assert item.ref[1] == 3 and "t10k-images-idx3-ubyte" in item.origin
    png = worker.load(item)["image"]
    assert np.array_equal(_pixels(png), arrays["test"][0][3])
    assert worker.load(item)["image"] == png  # deterministic bytes


def test_shape_comes_from_the_header(tmp_path: Path) -> None:
    arrays = make_mnist(tmp_path, rows=7, cols=5)
    source = MnistSource(str(tmp_path))
    item = source.scan().items[1]
    assert np.array_equal(_pixels(source.load(item)["image"]), arrays["train"][0][1])
    assert _pixels(source.load(item)["image"]).shape == (7, 5)


def test_fashion_names(tmp_path: Path) -> None:
    make_mnist(tmp_path / "FashionMNIST" / "raw", gz=True)
    scan = MnistSource(str(tmp_path / "FashionMNIST")).scan()
    assert scan.classes == FASHION_CLASSES and len(FASHION_CLASSES) == 10
    assert scan.classes[0] == "T-shirt/top" and scan.classes[9] == "Ankle boot"
    assert scan.items[0].key == "fashion_mnist_train_000000"
    make_mnist(tmp_path / "digits")
    assert MnistSource(str(tmp_path / "digits"), fashion=True).scan().classes == FASHION_CLASSES
    plain = MnistSource(str(tmp_path / "FashionMNIST"), fashion=False).scan()
    assert plain.classes[0] == "0"


def test_one_split_and_plain_over_gz(tmp_path: Path) -> None:
    arrays = make_mnist(tmp_path, gz=True)
    for path in tmp_path.glob("train-*"):
        path.unlink()
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", arrays["test"][1])  # beside its .gz
    scan = MnistSource(str(tmp_path)).scan()
    assert {item.split for item in scan.items} == {"test"} and len(scan.items) == TEST
    assert [item.label for item in scan.items] == arrays["test"][1].tolist()


def _corrupt(folder: Path, how: str) -> tuple[str, str]:
    images = folder / "train-images-idx3-ubyte"
    labels = folder / "train-labels-idx1-ubyte"
    if how == "truncated":
        images.write_bytes(images.read_bytes()[:-10])
        return str(images), f"{16 + TRAIN * 784 - 10} bytes, but its header [12, 28, 28] needs"
    if how == "counts":
        write_idx(labels, np.zeros(TRAIN - 1, np.uint8))
        return str(images), f"holds {TRAIN} images but {labels} {TRAIN - 1} labels"
    if how == "missing":
        labels.unlink()
        return str(folder), "train-labels-idx1-ubyte[.gz] is missing"
    if how == "magic":
        images.write_bytes(labels.read_bytes())
        return str(images), "magic number 0x00000801, expected 0x00000803"
    if how == "gzip-unnamed":
        images.write_bytes(gzip.compress(images.read_bytes()))
        return str(images), "(gzip data: name it .gz)"
    if how == "bad-gz":
        gz = images.with_name(images.name + ".gz")
        gz.write_bytes(gzip.compress(images.read_bytes())[:-200])
        images.unlink()
        return str(gz), "cannot be read or decompressed"
    if how == "empty":
        images.write_bytes(b"")
        return str(images), "magic number missing"
    write_idx(labels, np.full(TRAIN, 10, np.uint8))
    return str(labels), "label 10 is out of range 0..9"


@pytest.mark.parametrize(
    "how", ["truncated", "counts", "missing", "magic", "gzip-unnamed", "bad-gz", "empty", "label"]
)
def test_bad_files_name_the_file(tmp_path: Path, how: str) -> None:
    make_mnist(tmp_path)
    path, message = _corrupt(tmp_path, how)
    with pytest.raises(SourceError) as info:
        MnistSource(str(tmp_path)).scan()
    assert path in str(info.value) and message in str(info.value)


def test_no_files(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no MNIST files"):
        MnistSource(str(tmp_path)).scan()
