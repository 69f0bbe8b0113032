"""The CIFAR source reads the python versions of CIFAR-10/100 as shipped, and unpickles safely."""

from __future__ import annotations

import io
import os
import pickle
import struct
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from PIL import Image

import dlpipe
from dlpipe.converters import cifar
from dlpipe.converters.cifar import CifarSource
from dlpipe.converters.source import SampleError, SourceError

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer",
                 "dog", "frog", "horse", "ship", "truck"]  # fmt: skip
PER_BATCH, TEST_COUNT = 4, 6


def _batch(rng: np.random.Generator, count: int, labels_key: bytes, n_classes: int) -> dict:
    return {
        b"batch_label": b"training batch",
        labels_key: [int(x) for x in rng.integers(0, n_classes, count)],
        b"data": rng.integers(0, 256, (count, 3072), dtype=np.uint8),
        b"filenames": [f"img_{i:06d}.png".encode() for i in range(count)],
    }


def _dump(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def make_cifar10(parent: Path, seed: int = 0) -> Path:
    """cifar-10-batches-py/ with 5 train batches of PER_BATCH images and a test batch."""
    rng = np.random.default_rng(seed)
    folder = parent / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for i in range(1, 6):
        _dump(folder / f"data_batch_{i}", _batch(rng, PER_BATCH, b"labels", 10))
    _dump(folder / "test_batch", _batch(rng, TEST_COUNT, b"labels", 10))
    meta = {b"num_cases_per_batch": PER_BATCH, b"num_vis": 3072,
            b"label_names": [n.encode() for n in CIFAR10_NAMES]}  # fmt: skip
    _dump(folder / "batches.meta", meta)
    return folder


def make_cifar100(parent: Path) -> Path:
    rng = np.random.default_rng(1)
    folder = parent / "cifar-100-python"
    folder.mkdir(parents=True)
    for name, count in (("train", 7), ("test", 3)):
        batch = _batch(rng, count, b"fine_labels", 100)
        batch[b"coarse_labels"] = [label // 5 for label in batch[b"fine_labels"]]
        _dump(folder / name, batch)
    meta = {b"fine_label_names": [f"fine_{i:02d}".encode() for i in range(100)],
            b"coarse_label_names": [f"coarse_{i:02d}".encode() for i in range(20)]}  # fmt: skip
    _dump(folder / "meta", meta)
    return folder


def _load(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")


def _pixels(png: bytes) -> np.ndarray:
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.mode == "RGB" and image.size == (32, 32)
    return np.asarray(image)


def test_detect_folder_or_parent(tmp_path: Path) -> None:
    folder = make_cifar10(tmp_path / "a")
    make_cifar100(tmp_path / "b")
    (tmp_path / "c" / "cat").mkdir(parents=True)
    assert CifarSource.detect(str(folder)) and CifarSource.detect(str(tmp_path / "a"))
    assert CifarSource.detect(str(tmp_path / "b" / "cifar-100-python"))
    assert CifarSource.detect(str(tmp_path / "b"))
    assert not CifarSource.detect(str(tmp_path / "c")) and not CifarSource.detect(str(tmp_path))


def test_cifar10_scan(tmp_path: Path) -> None:
    folder = make_cifar10(tmp_path)
    scan = CifarSource(str(tmp_path)).scan()
    assert scan.classes == tuple(CIFAR10_NAMES)
    splits = [item.split for item in scan.items]
    assert splits.count("train") == 5 * PER_BATCH and splits.count("test") == TEST_COUNT
    keys = [item.key for item in scan.items]
    assert len(set(keys)) == len(keys) and all(dlpipe.check_key(k) == k for k in keys)
    assert keys[0] == "cifar10_train_000000" and "cifar10_test_000005" in keys
    assert keys == [item.key for item in CifarSource(str(folder)).scan().items]  # deterministic
    expected = [lb for i in range(1, 6) for lb in _load(folder / f"data_batch_{i}")[b"labels"]]
    assert [item.label for item in scan.items if item.split == "train"] == expected
    item = scan.items[PER_BATCH + 1]
    assert item.ref == ("data_batch_2", 1) and item.image_kind == "png"
    assert 3072 <= item.size < 4096 and "data_batch_2 row 1" in item.origin
    assert pickle.loads(pickle.dumps(item)) == item


def test_cifar10_load_is_exact_and_lazy(tmp_path: Path) -> None:
    folder = make_cifar10(tmp_path)
    source = CifarSource(str(folder))
    scan = source.scan()
    worker = pickle.loads(pickle.dumps(source))  # as a worker process receives it
    cifar._cache.clear()
    for item in scan.items[::3]:
        file, row = item.ref
        expected = _load(folder / file)[b"data"][row].reshape(3, 32, 32).transpose(1, 2, 0)
        png = worker.load(item)["image"]
        assert np.array_equal(_pixels(png), expected)
        assert worker.load(item)["image"] == png  # deterministic bytes


def test_cifar100_uses_fine_labels(tmp_path: Path) -> None:
    folder = make_cifar100(tmp_path)
    source = CifarSource(str(tmp_path))
    scan = source.scan()
    assert len(scan.classes) == 100 and scan.classes[3] == "fine_03"
    assert [it.split for it in scan.items].count("train") == 7 and len(scan.items) == 10
    assert scan.items[0].key == "cifar100_train_000000" and scan.items[7].ref == ("test", 0)
    train = _load(folder / "train")
    assert [it.label for it in scan.items[:7]] == train[b"fine_labels"]
    expected = train[b"data"][6].reshape(3, 32, 32).transpose(1, 2, 0)
    assert np.array_equal(_pixels(source.load(scan.items[6])["image"]), expected)


_PurePickler: Any = vars(pickle)["_Pickler"]  # the Python pickler, whose opcodes can be overridden


class _Py2Pickler(_PurePickler):
    """Writes str and bytes as Python 2 ``str`` (BINSTRING), as the shipped files hold them."""

    dispatch: ClassVar[dict] = dict(_PurePickler.dispatch)

    def save_py2_str(self, obj: str | bytes) -> None:
        data = obj.encode("latin1") if isinstance(obj, str) else obj
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[str] = save_py2_str
    dispatch[bytes] = save_py2_str


def test_python2_pickles_as_shipped(tmp_path: Path) -> None:
    folder = make_cifar10(tmp_path)
    for path in folder.iterdir():
        obj = _load(path)
        buffer = io.BytesIO()
        _Py2Pickler(buffer, protocol=2).dump(obj)
        raw = buffer.getvalue().replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
        assert b"_codecs" not in raw
        assert (b"cnumpy.core.multiarray\n_reconstruct" in raw) == (path.name != "batches.meta")
        path.write_bytes(raw)
    cifar._cache.clear()
    source = CifarSource(str(folder))
    scan = source.scan()
    assert scan.classes == tuple(CIFAR10_NAMES) and len(scan.items) == 5 * PER_BATCH + TEST_COUNT
    expected = _load(folder / "test_batch")[b"data"][2].reshape(3, 32, 32).transpose(1, 2, 0)
    assert np.array_equal(_pixels(source.load(scan.items[-4])["image"]), expected)


class _Evil:
    def __init__(self, func: Any, *args: Any) -> None:
        self.call = (func, args)

    def __reduce__(self) -> tuple:
        return self.call


@pytest.mark.parametrize("attack", ["os.system", "builtins.open"])
def test_malicious_pickle_is_refused_and_not_run(tmp_path: Path, attack: str) -> None:
    folder = make_cifar10(tmp_path)
    marker = tmp_path / "pwned"
    if attack == "os.system":
        evil = _Evil(os.system, f"touch {marker}")
    else:
        evil = _Evil(open, str(marker), "w")
    batch = _load(folder / "data_batch_3")
    batch[b"labels"] = evil
    _dump(folder / "data_batch_3", batch)
    with pytest.raises(SourceError, match=r"data_batch_3: the pickle asks for .*(system|open)"):
        CifarSource(str(folder)).scan()
    assert not marker.exists()


def test_load_after_file_turned_malicious_is_a_sample_error(tmp_path: Path) -> None:
    folder = make_cifar10(tmp_path)
    source = CifarSource(str(folder))
    item = source.scan().items[-1]
    _dump(folder / "test_batch", {b"data": _Evil(os.system, f"touch {tmp_path / 'x'}")})
    with pytest.raises(SampleError, match="test_batch"):
        source.load(item)
    assert not (tmp_path / "x").exists()


BREAK_MESSAGES = {
    "missing": "cannot be read",
    "truncated": "not a readable CIFAR pickle",
    "shape": "expected a uint8 array of N x 3072",
    "counts": "3 b'labels' for 4 images",
    "label": "row 0 has label 10, expected 0..9",
    "not-dict": "holds a list",
}


def _break(folder: Path, how: str) -> str:
    path = folder / "data_batch_3"
    batch: Any = _load(path)
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:5000])
    elif how == "shape":
        batch[b"data"] = batch[b"data"].reshape(-1, 1024)
    elif how == "counts":
        batch[b"labels"] = batch[b"labels"][:-1]
    elif how == "label":
        batch[b"labels"][0] = 10
    elif how == "not-dict":
        batch = [batch]
    if how not in ("missing", "truncated"):
        _dump(path, batch)
    return BREAK_MESSAGES[how]


@pytest.mark.parametrize("how", sorted(BREAK_MESSAGES))
def test_malformed_batch_names_the_file(tmp_path: Path, how: str) -> None:
    folder = make_cifar10(tmp_path)
    message = _break(folder, how)
    with pytest.raises(SourceError) as info:
        CifarSource(str(tmp_path)).scan()
    assert str(folder / "data_batch_3") in str(info.value) and message in str(info.value)


def test_missing_meta_or_ambiguous_root(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no CIFAR files; give the cifar-10-batches-py/"):
        CifarSource(str(tmp_path)).scan()
    make_cifar10(tmp_path)
    make_cifar100(tmp_path)
    with pytest.raises(SourceError, match="both CIFAR-10 and CIFAR-100"):
        CifarSource(str(tmp_path)).scan()
    (tmp_path / "cifar-100-python" / "meta").unlink()
    (tmp_path / "cifar-10-batches-py" / "batches.meta").write_bytes(b"")
    with pytest.raises(SourceError, match=r"batches\.meta: not a readable CIFAR pickle"):
        CifarSource(str(tmp_path)).scan()
