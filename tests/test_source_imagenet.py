"""The imagenet source reads ILSVRC2012 as Kaggle and the devkit ship it, and refuses bad labels."""

from __future__ import annotations

import io
import os
import random
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import error_records
from PIL import Image

import dlpipe
from dlpipe.cli import main
from dlpipe.converters.imagenet import ImageNetSource, read_synsets
from dlpipe.converters.source import SourceError
from dlpipe.converters.sources import open_source
from dlpipe.sample import unescape_key

# wnid-sorted: n01440764 (0), n01443537 (1), n02119789 (2); the devkit numbers them otherwise
NAMES = {"n02119789": "kit fox, Vulpes macrotis", "n01440764": "tench, Tinca tinca",
         "n01443537": "goldfish, Carassius auratus"}  # fmt: skip
DEVKIT_IDS = {1: "n02119789", 2: "n01440764", 3: "n01443537"}  # ILSVRC2012_ID -> wnid
CLASSES = sorted(NAMES)
VAL_WNIDS = ["n02119789", "n01440764", "n01443537", "n01440764", "n02119789", "n01443537"]
PER_CLASS = 3
KAGGLE_DATA = Path("ILSVRC", "Data", "CLS-LOC")
DEVKIT_DATA = Path("ILSVRC2012_devkit_t12", "data")


def _jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)).save(buffer, "JPEG")
    return buffer.getvalue()


def val_name(i: int) -> str:
    return f"ILSVRC2012_val_{i:08d}"


def _images(splits: Path) -> None:
    """train/<wnid>/<wnid>_<n>.JPEG and a flat val/ILSVRC2012_val_<8 digits>.JPEG."""
    for c, wnid in enumerate(CLASSES):
        (splits / "train" / wnid).mkdir(parents=True)
        for n in range(PER_CLASS):
            (splits / "train" / wnid / f"{wnid}_{n + 1}.JPEG").write_bytes(_jpeg(c * 10 + n))
    (splits / "val").mkdir()
    for i in range(1, len(VAL_WNIDS) + 1):
        (splits / "val" / f"{val_name(i)}.JPEG").write_bytes(_jpeg(100 + i))


def make_kaggle(root: Path, *, flat: bool = False) -> Path:
    """The Kaggle "ImageNet Object Localization Challenge" download, unzipped (or flattened)."""
    splits = root if flat else root / KAGGLE_DATA
    splits.mkdir(parents=True, exist_ok=True)
    _images(splits)
    if not flat:
        (splits / "test").mkdir()
        (splits / "test" / "ILSVRC2012_test_00000001.JPEG").write_bytes(_jpeg(999))
        (root / "ILSVRC" / "ImageSets" / "CLS-LOC").mkdir(parents=True)
        (root / "ILSVRC" / "ImageSets" / "CLS-LOC" / "train_cls.txt").write_text("x 1\n")
    mapping = "".join(f"{w} {NAMES[w]}\n" for w in CLASSES)
    (root / "LOC_synset_mapping.txt").write_text(mapping)
    rows = [f"{val_name(i + 1)},{w} 10 12 40 33 {w} 1 2 9 9 \n" for i, w in enumerate(VAL_WNIDS)]
    random.Random(0).shuffle(rows)  # the real file is not in image order
    (root / "LOC_val_solution.csv").write_text("ImageId,PredictionString\n" + "".join(rows))
    train = [f"{w}_{n + 1},{w} 3 4 50 60 \n" for w in CLASSES for n in range(PER_CLASS)]
    (root / "LOC_train_solution.csv").write_text("ImageId,PredictionString\n" + "".join(train))
    (root / "LOC_sample_submission.csv").write_text(
        "ImageId,PredictionString\nILSVRC2012_test_00000001,n01440764 0 0 1 1\n"
    )
    return root


def write_meta_mat(path: Path, rows: list[tuple[int, str, str, int]], **savemat: object) -> None:
    """meta.mat as the devkit ships it: a ``synsets`` struct array with the devkit's fields."""
    sio = pytest.importorskip("scipy.io")
    fields = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children",
              "wordnet_height", "num_train_images"]  # fmt: skip
    synsets = np.zeros((len(rows), 1), dtype=[(f, "O") for f in fields])
    for i, (class_id, wnid, words, children) in enumerate(rows):
        kids = np.arange(1, children + 1, dtype=np.float64).reshape(1, -1)
        values = (float(class_id), wnid, words, f"the gloss of {wnid}", float(children),
                  kids if children else np.zeros((0, 0)), 0.0, 1300.0)  # fmt: skip
        for name, value in zip(fields, values, strict=True):
            synsets[i, 0][name] = value
    sio.savemat(str(path), {"synsets": synsets}, **savemat)  # type: ignore[attr-defined]


def make_devkit(root: Path, **savemat: object) -> Path:
    """train/, val/ and ILSVRC2012_devkit_t12/ as torchvision's ImageNet reads them."""
    root.mkdir(parents=True, exist_ok=True)
    _images(root)
    (root / DEVKIT_DATA).mkdir(parents=True)
    (root / "ILSVRC2012_devkit_t12" / "evaluation").mkdir()
    (root / "ILSVRC2012_devkit_t12" / "readme.txt").write_text("ILSVRC2012 devkit\n")
    rows = [(i, w, NAMES[w], 0) for i, w in DEVKIT_IDS.items()]
    rows.append((4, "n00001740", "entity", 3))  # an inner synset: not a class
    write_meta_mat(root / DEVKIT_DATA / "meta.mat", rows, **savemat)
    ids = {w: i for i, w in DEVKIT_IDS.items()}
    truth = "".join(f"{ids[w]}\n" for w in VAL_WNIDS)
    (root / DEVKIT_DATA / "ILSVRC2012_validation_ground_truth.txt").write_text(truth)
    return root


def convert(raw: Path, out: Path, fmt: str = "wds", *extra: str) -> int:
    return main(["convert", str(raw), "--to", fmt, "--out", str(out), "--workers", "1", *extra])


def labels_by_key(out: Path, split: str) -> dict[str, int]:
    dataset = dlpipe.open_dataset(out, split, rank=0, world_size=1)
    return {unescape_key(s["__key__"]): int(s["cls"]) for s in dataset}


def _check_dataset(out: Path, layout: str) -> dlpipe.Manifest:
    manifest = dlpipe.read_manifest(str(out))
    assert list(manifest.classes) == CLASSES
    assert {k: s.samples for k, s in manifest.splits.items()} == {"train": 9, "val": 6}
    assert manifest.source["kind"] == "imagenet"
    assert manifest.source["layout"].startswith(f"{layout}: the ")
    assert manifest.source["class_names"] == [NAMES[w] for w in CLASSES]
    assert manifest.source["skipped"] == 0
    val = labels_by_key(out, "val")
    assert val == {val_name(i + 1): CLASSES.index(w) for i, w in enumerate(VAL_WNIDS)}
    train = labels_by_key(out, "train")
    assert train == {f"{w}/{w}_{n + 1}": c for c, w in enumerate(CLASSES) for n in range(3)}
    return manifest


@pytest.mark.parametrize("flat", [False, True], ids=["as-shipped", "flattened"])
def test_kaggle_converts_both_splits(tmp_path: Path, flat: bool, capsys) -> None:
    raw = make_kaggle(tmp_path / "imagenet", flat=flat)
    assert convert(raw, tmp_path / "out") == 0
    manifest = _check_dataset(tmp_path / "out", "kaggle")
    test = raw / KAGGLE_DATA / "test"
    assert manifest.source.get("left_out") == (None if flat else {"test": f"{test}: no labels"})
    assert "skipped 0 samples" in capsys.readouterr().out


@pytest.mark.parametrize("compress", [True, False], ids=["compressed", "plain"])
def test_devkit_converts_both_splits(tmp_path: Path, compress: bool) -> None:
    raw = make_devkit(tmp_path / "imagenet", do_compression=compress)
    assert convert(raw, tmp_path / "out", "lmdb") == 0
    _check_dataset(tmp_path / "out", "devkit")


def test_detection_by_names(tmp_path: Path) -> None:
    kaggle = make_kaggle(tmp_path / "kaggle")
    flat = make_kaggle(tmp_path / "flat", flat=True)
    devkit = make_devkit(tmp_path / "devkit")
    for root in (kaggle, flat, devkit):
        assert open_source(str(root)).kind == "imagenet", root
    assert not ImageNetSource.detect(str(tmp_path))
    (flat / "LOC_synset_mapping.txt").unlink()
    (flat / "LOC_val_solution.csv").unlink()
    assert open_source(str(flat)).kind == "imagefolder"


def _sort_val(val: Path) -> None:
    """What valprep.sh does: move each val image into its class folder."""
    for i, wnid in enumerate(VAL_WNIDS, 1):
        (val / wnid).mkdir(exist_ok=True)
        (val / f"{val_name(i)}.JPEG").rename(val / wnid / f"{val_name(i)}.JPEG")


def test_val_sorted_by_valprep_without_label_files_is_an_imagefolder(tmp_path: Path) -> None:
    raw = make_kaggle(tmp_path / "raw", flat=True)
    for name in ("LOC_synset_mapping.txt", "LOC_val_solution.csv", "LOC_train_solution.csv"):
        (raw / name).unlink()
    _sort_val(raw / "val")
    assert convert(raw, tmp_path / "out") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.source["kind"] == "imagefolder" and list(manifest.classes) == CLASSES
    assert manifest.splits["val"].samples == 6


def test_val_sorted_with_label_files_keeps_the_labels(tmp_path: Path) -> None:
    raw = make_kaggle(tmp_path / "raw", flat=True)
    _sort_val(raw / "val")
    assert convert(raw, tmp_path / "out") == 0
    _check_dataset(tmp_path / "out", "kaggle")


def _one_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


def _kaggle_case(raw: Path, case: str) -> str:
    """Break a Kaggle layout one way; return what the error must name."""
    splits = raw / KAGGLE_DATA
    csv = raw / "LOC_val_solution.csv"
    if case == "no-val-folder":
        for p in (splits / "val").iterdir():
            p.unlink()
        (splits / "val").rmdir()
        return f"{splits / 'val'} is missing"
    if case == "image-without-label":
        (splits / "val" / f"{val_name(7)}.JPEG").write_bytes(_jpeg(7))
        return f"{splits / 'val' / val_name(7)}.JPEG has no label"
    if case == "label-without-image":
        (splits / "val" / f"{val_name(3)}.JPEG").unlink()
        return f"({val_name(3)}) has no image"
    if case == "no-csv":
        csv.unlink()
        return f"{csv} is missing"
    if case == "bad-header":
        csv.write_text("id,label\n" + csv.read_text().split("\n", 1)[1])
        return "header 'id,label', expected ImageId,PredictionString"
    if case == "duplicate-row":
        csv.write_text(csv.read_text() + f"{val_name(1)},n01440764 1 1 2 2\n")
        return f"{csv} line 8 repeats its ImageId"
    if case == "every-label-unknown":
        csv.write_text(csv.read_text().replace("n0", "n9"))
        return "nor is any other val label"
    if case == "bad-mapping":
        (raw / "LOC_synset_mapping.txt").write_bytes(b"\x89PNG garbage\n")
        return "not UTF-8 text"
    if case == "mapping-line":
        (raw / "LOC_synset_mapping.txt").write_text("tench n01440764\n")
        return "line 1: 'tench' is not a WordNet id"
    (splits / "train" / "n99999999").mkdir()
    (splits / "train" / "n99999999" / "x.JPEG").write_bytes(_jpeg(1))
    return "'n99999999' is not one of the 3 classes"


KAGGLE_CASES = ["no-val-folder", "image-without-label", "label-without-image", "no-csv",
                "bad-header", "duplicate-row", "every-label-unknown", "bad-mapping",
                "mapping-line", "unknown-train-class"]  # fmt: skip


@pytest.mark.parametrize("case", KAGGLE_CASES)
def test_kaggle_bad_labels_are_one_error_line(tmp_path: Path, case: str, capsys) -> None:
    raw = make_kaggle(tmp_path / "raw")
    expected = _kaggle_case(raw, case)
    files = sorted(raw.rglob("*"))
    assert convert(raw, tmp_path / "out") == 2
    line = _one_error(capsys)
    assert expected in line, line
    assert not (tmp_path / "out" / "dlpipe.json").exists()
    assert sorted(raw.rglob("*")) == files  # nothing of the user's touched


def _devkit_case(raw: Path, case: str) -> str:
    truth = raw / DEVKIT_DATA / "ILSVRC2012_validation_ground_truth.txt"
    meta = raw / DEVKIT_DATA / "meta.mat"
    if case == "truth-too-long":
        truth.write_text(truth.read_text() + "2\n")
        return f"holds 6 val images and {truth} labels 7"
    if case == "truth-too-short":
        truth.write_text("".join(truth.read_text().splitlines(keepends=True)[:5]))
        return f"{raw / 'val' / val_name(6)}.JPEG has no label"
    if case == "truth-not-a-number":
        truth.write_text(truth.read_text().replace("3\n", "three\n", 1))
        return "line 3: 'three' is not an ILSVRC2012_ID"
    if case == "no-truth":
        truth.unlink()
        return f"{truth} is missing"
    if case == "no-meta":
        meta.unlink()
        return f"{meta} is missing"
    if case == "meta-garbage":
        meta.write_bytes(b"MATLAB 7.3 MAT-file" + bytes(200))
        return "no MATLAB 5 header"
    (raw / "val").rename(raw / "elsewhere")
    return f"{raw / 'val'} is missing"


DEVKIT_CASES = ["truth-too-long", "truth-too-short", "truth-not-a-number", "no-truth",
                "no-meta", "meta-garbage", "no-val-folder"]  # fmt: skip


@pytest.mark.parametrize("case", DEVKIT_CASES)
def test_devkit_bad_labels_are_one_error_line(tmp_path: Path, case: str, capsys) -> None:
    raw = make_devkit(tmp_path / "raw")
    expected = _devkit_case(raw, case)
    assert convert(raw, tmp_path / "out", "hdf5") == 2
    line = _one_error(capsys)
    assert expected in line, line
    assert not (tmp_path / "out" / "dlpipe.json").exists()


@pytest.mark.parametrize("row", ["n99999999 1 2 3 4", ""], ids=["unknown-wnid", "empty"])
def test_one_bad_val_row_skips_only_its_sample(tmp_path: Path, row: str, capsys) -> None:
    raw = make_kaggle(tmp_path / "raw", flat=True)
    csv = raw / "LOC_val_solution.csv"
    lines = csv.read_text().splitlines()
    number = next(i for i, x in enumerate(lines) if x.startswith(val_name(2)))
    lines[number] = f"{val_name(2)},{row}"
    csv.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    assert convert(raw, out) == 0
    assert "skipped 1 samples" in capsys.readouterr().out
    (error,) = error_records(out)
    assert error["key"] == val_name(2) and f"{csv} line {number + 1}: " in error["error"]
    assert ("'n99999999' is not one of" if row else "no label") in error["error"]
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.splits["val"].samples == 5 and manifest.source["skipped"] == 1
    assert convert(raw, tmp_path / "fail", "wds", "--on-error", "fail") == 2
    assert f"{csv} line {number + 1}: " in _one_error(capsys)


def test_devkit_val_label_of_an_inner_synset_skips_its_sample(tmp_path: Path) -> None:
    raw = make_devkit(tmp_path / "raw")
    truth = raw / DEVKIT_DATA / "ILSVRC2012_validation_ground_truth.txt"
    lines = truth.read_text().splitlines()
    truth.write_text("\n".join([*lines[:3], "4", *lines[4:]]) + "\n")  # 4 = "entity"
    assert convert(raw, tmp_path / "out") == 0
    (error,) = error_records(tmp_path / "out")
    assert error["key"] == val_name(4)
    assert f"{truth} line 4: the label 'ILSVRC2012_ID 4' is not one of the 3" in error["error"]


def test_label_file_that_is_a_fifo_is_refused_without_hanging(tmp_path: Path) -> None:
    raw = make_kaggle(tmp_path / "raw")
    (raw / "LOC_val_solution.csv").unlink()
    os.mkfifo(raw / "LOC_val_solution.csv")
    command = [sys.executable, "-m", "dlpipe", "convert", str(raw), "--to", "wds",
               "--out", str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr + done.stdout
    assert lines[0].startswith(f"error: {raw / 'LOC_val_solution.csv'}: is a FIFO")


@pytest.mark.parametrize("target", ["/dev/zero", "/etc/hostname", "elsewhere"])
def test_label_file_linked_out_of_the_folder_is_refused(
    tmp_path: Path, target: str, capsys
) -> None:
    raw = make_devkit(tmp_path / "raw")
    meta = raw / DEVKIT_DATA / "meta.mat"
    if target == "elsewhere":
        target = str(tmp_path / "meta.mat")
        meta.rename(target)
    else:
        meta.unlink()
    meta.symlink_to(target)
    assert convert(raw, tmp_path / "out") == 2
    line = _one_error(capsys)
    assert line.startswith(f"error: {meta}: ") and "outside the raw folder" in line


def test_oversized_label_file_is_refused_unread(tmp_path: Path, capsys) -> None:
    raw = make_kaggle(tmp_path / "raw")
    csv = raw / "LOC_val_solution.csv"
    os.truncate(csv, (64 << 20) + 1)  # sparse: nothing of it needs to be read to refuse it
    assert convert(raw, tmp_path / "out") == 2
    assert f"{csv}: {(64 << 20) + 1} bytes, over the" in _one_error(capsys)


def test_split_folder_linked_from_elsewhere_is_refused(tmp_path: Path, capsys) -> None:
    raw = make_kaggle(tmp_path / "raw", flat=True)
    (raw / "val").rename(tmp_path / "val-elsewhere")
    (raw / "val").symlink_to(tmp_path / "val-elsewhere")
    assert convert(raw, tmp_path / "out") == 2
    assert f"{raw / 'val'} is (or lies under) a symbolic link" in _one_error(capsys)


def test_special_and_linked_images_are_never_read(tmp_path: Path) -> None:
    raw = make_kaggle(tmp_path / "raw", flat=True)
    tench = raw / "train" / "n01440764"
    (tench / "zero.JPEG").symlink_to("/dev/zero")
    os.mkfifo(tench / "pipe.JPEG")
    (tench / "notes.txt").write_text("not an image")
    assert convert(raw, tmp_path / "out") == 0
    manifest = _check_dataset(tmp_path / "out", "kaggle")
    assert manifest.source["skipped_entries"] == 2 and manifest.source["ignored_files"] == 1


def _meta_bytes(tmp_path: Path, compress: bool) -> bytes:
    path = tmp_path / f"meta-{compress}.mat"
    write_meta_mat(path, [(1, "n02119789", "kit fox", 0), (2, "n00001740", "entity", 1)],
                   do_compression=compress)  # fmt: skip
    return path.read_bytes()


@pytest.mark.parametrize("compress", [True, False], ids=["compressed", "plain"])
def test_damaged_meta_mat_is_a_source_error(tmp_path: Path, compress: bool) -> None:
    data = _meta_bytes(tmp_path, compress)
    path = tmp_path / "meta.mat"
    path.write_bytes(data)
    assert read_synsets(str(tmp_path), str(path)) == [
        (1.0, "n02119789", "kit fox", 0.0), (2.0, "n00001740", "entity", 1.0)
    ]  # fmt: skip
    rng = random.Random(0)
    damaged = [data[:n] for n in range(0, len(data), 3)]
    for _ in range(300):
        flipped = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            flipped[rng.randrange(128, len(data))] = rng.randrange(256)
        damaged.append(bytes(flipped))
    for blob in damaged:
        path.write_bytes(blob)
        try:
            rows = read_synsets(str(tmp_path), str(path))
        except SourceError as exc:
            assert str(exc).startswith(f"{path}: ")
        else:
            assert isinstance(rows, list)


def _mat_element(kind: int, payload: bytes) -> bytes:
    return struct.pack("<II", kind, len(payload)) + payload + bytes(-len(payload) % 8)


def _mat(*elements: bytes) -> bytes:
    return b"MATLAB 5.0 MAT-file".ljust(116) + bytes(8) + b"\x00\x01IM" + b"".join(elements)


def _huge_struct() -> bytes:
    """A 232-byte synsets struct claiming 2e9 elements (scipy's loadmat asks for 16 GB)."""
    dims = struct.pack("<ii", 2_000_000_000, 1)
    body = (_mat_element(6, struct.pack("<II", 2, 0)) + _mat_element(5, dims)
            + _mat_element(1, b"synsets") + struct.pack("<HHi", 5, 4, 8)
            + _mat_element(1, b"WNID".ljust(8, b"\0")))  # fmt: skip
    return _mat(_mat_element(14, body))


def _zip_bomb() -> bytes:
    """A compressed variable of 1 MB that inflates to 1 GiB."""
    packer, zeros = zlib.compressobj(1), bytes(16 << 20)
    inflated = struct.pack("<II", 14, (1 << 30) - 8)
    data = packer.compress(inflated) + b"".join(packer.compress(zeros) for _ in range(64))
    return _mat(_mat_element(15, data + packer.flush()))


BOUNDED_READ = """
import resource, sys
from dlpipe.converters.imagenet import read_synsets
from dlpipe.converters.source import SourceError
vm = int(next(x for x in open("/proc/self/status") if x.startswith("VmSize")).split()[1]) << 10
resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), vm + (256 << 20)))
try:
    read_synsets(sys.argv[1], sys.argv[2])
except SourceError as exc:
    print(exc)
"""


@pytest.mark.parametrize("make", [_huge_struct, _zip_bomb], ids=["huge-dims", "zip-bomb"])
def test_hostile_meta_mat_is_refused_in_bounded_memory(tmp_path: Path, make) -> None:
    path = tmp_path / "meta.mat"
    path.write_bytes(make())
    command = [sys.executable, "-c", textwrap.dedent(BOUNDED_READ), str(tmp_path), str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and not done.stderr, done.stderr
    assert done.stdout.startswith(f"{path}: not a readable MATLAB file (")
    assert ("cannot fit" if make is _huge_struct else "decompresses past 16 MiB") in done.stdout


def test_png_named_jpeg_as_in_the_real_train_set_is_stored_as_jpeg(tmp_path: Path) -> None:
    raw = make_kaggle(tmp_path / "raw", flat=True)
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buffer, "PNG")  # n02105855_2933.JPEG
    (raw / "train" / "n01440764" / "n01440764_2.JPEG").write_bytes(buffer.getvalue())
    assert convert(raw, tmp_path / "out") == 0
    dataset = dlpipe.open_dataset(tmp_path / "out", "train", rank=0, world_size=1)
    stored = {s["__key__"]: s["jpg"] for s in dataset}
    assert stored["n01440764%2Fn01440764_2"][:3] == b"\xff\xd8\xff"
