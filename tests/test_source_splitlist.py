"""The generic splitlist rule: train/val/test/trainval.txt lists naming images, and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import error_records, one_error
from splitlist_fixtures import (
    convert,
    jpeg,
    make_cub,
    make_food101,
    make_pets,
    samples,
    write,
)

import dlpipe
from dlpipe.converters.sources import SOURCE_KINDS, open_source
from dlpipe.converters.splitlist import SplitListSource

CLASSES = ["cat", "dog", "fox"]


def make_folders(root: Path, lists: str = "", *, suffix: bool = False) -> Path:
    """images/<class>/<n>.jpg; train.txt (n = 1, 2), val.txt (3), test.txt (4) in `lists`."""
    for c, name in enumerate(CLASSES):
        for n in range(1, 6):  # n = 5 is in no list
            write(root / "images" / name / f"{n}.jpg", jpeg(10 * c + n))
    ext = ".jpg" if suffix else ""
    for split, numbers in (("train", (1, 2)), ("val", (3,)), ("test", (4,))):
        lines = [f"# {split} images", *(f"{c}/{n}{ext}" for c in CLASSES for n in numbers)]
        write(root / lists / f"{split}.txt", "\n".join(lines) + "\n\n")
    write(root / "README.md", "a dataset\n")
    return root


def _labels(out: Path, split: str) -> dict[str, int]:
    return {k: int(s["cls"]) for k, s in samples(out, split).items()}


@pytest.mark.parametrize(("lists", "suffix"), [("", False), ("meta", True), ("splits", False),
                                               ("lists", True)])  # fmt: skip
def test_class_folders_named_by_lists(tmp_path: Path, lists: str, suffix: bool) -> None:
    raw = make_folders(tmp_path / "raw", lists, suffix=suffix)
    out = tmp_path / "out"
    assert convert(raw, out) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.source["kind"] == "splitlist" and list(manifest.classes) == CLASSES
    prefix = f"{lists}/" if lists else ""
    assert manifest.source["layout"] == (
        f"generic split lists ({prefix}test.txt, {prefix}train.txt, {prefix}val.txt); "
        "labels: the image's parent folder"
    )
    assert manifest.source["unused"] == {"images": 3, "annotation files": 0, "split lists": 0,
                                         "masks": 0, "other": 1}  # fmt: skip
    for split, numbers in (("train", (1, 2)), ("val", (3,)), ("test", (4,))):
        assert _labels(out, split) == {
            f"{c}/{n}": i for i, c in enumerate(CLASSES) for n in numbers
        }


def test_flat_images_with_integer_labels(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    labels = {f"img_{i:03d}": (i * 7) % 3 + 1 for i in range(9)}  # 1-based ids 1..3
    for i, stem in enumerate(labels):
        write(raw / "images" / f"{stem}.png", jpeg(i))  # a JPEG behind .png: re-encoded
    write(raw / "train.txt", "".join(f"images/{s}.png {labels[s]}\n" for s in list(labels)[:6]))
    write(raw / "test.txt", "".join(f"./images/{s}.png\t{labels[s]}\n" for s in list(labels)[6:]))
    out = tmp_path / "out"
    assert convert(raw, out, "hdf5") == 0
    manifest = dlpipe.read_manifest(str(out))
    assert list(manifest.classes) == ["1", "2", "3"] and manifest.class_ids == (1, 2, 3)
    assert _labels(out, "train") == {f"images/{s}": labels[s] - 1 for s in list(labels)[:6]}
    assert _labels(out, "test") == {f"images/{s}": labels[s] - 1 for s in list(labels)[6:]}


def test_zero_based_integers_and_names_as_labels(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for i in range(4):
        write(raw / "photos" / f"{i}.jpg", jpeg(i))
    write(raw / "train.txt", "photos/0.jpg 0\nphotos/1.jpg 10\nphotos/2.jpg 2\n")
    write(raw / "val.txt", "photos/3.jpg 2\n")
    assert convert(raw, tmp_path / "ints") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "ints"))
    assert list(manifest.classes) == ["0", "2", "10"] and manifest.class_ids == (0, 2, 10)
    write(raw / "train.txt", "photos/0.jpg tabby\nphotos/1.jpg calico\nphotos/2.jpg tabby\n")
    write(raw / "val.txt", "photos/3.jpg siamese\n")
    assert convert(raw, tmp_path / "names") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "names"))
    assert list(manifest.classes) == ["calico", "siamese", "tabby"] and manifest.class_ids is None
    assert _labels(tmp_path / "names", "train") == {"photos/0": 2, "photos/1": 0, "photos/2": 2}


def test_a_bare_test_list_beside_labelled_lists_has_no_labels(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for i in range(5):
        write(raw / "images" / f"{i}.jpg", jpeg(i))
    write(raw / "train.txt", "0.jpg a\n1.jpg b\n2.jpg a\n")
    write(raw / "test.txt", "3.jpg\n4.jpg\n")
    out = tmp_path / "out"
    assert convert(raw, out) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.source["layout"].endswith("labels: the second column (test: none)")
    assert all("cls" not in s for s in samples(out, "test").values())
    assert _labels(out, "train") == {"0": 0, "1": 1, "2": 0}


def test_unlabelled_when_every_image_shares_one_folder(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for i in range(4):
        write(raw / "images" / f"{i}.jpg", jpeg(i))
    write(raw / "train.txt", "0\n1\n2\n")
    write(raw / "val.txt", "3\n")
    assert convert(raw, tmp_path / "out") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert list(manifest.classes) == [] and manifest.task is None
    assert sorted(samples(tmp_path / "out", "train")) == ["0", "1", "2"]


def test_split_folders_are_no_classes(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for split in ("train", "test"):
        for i in range(3):
            write(raw / split / f"{i}.jpg", jpeg(i + (10 if split == "test" else 0)))
        write(raw / f"{split}.txt", "".join(f"{split}/{i}.jpg\n" for i in range(3)))
    assert convert(raw, tmp_path / "out") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert list(manifest.classes) == [] and set(manifest.splits) == {"train", "test"}
    assert manifest.source["layout"].endswith("labels: none (no label column, and no list's "
                                              "images lie in class folders)")  # fmt: skip


def test_trainval_beside_train_and_val_is_checked_not_converted(tmp_path: Path) -> None:
    raw = make_folders(tmp_path / "raw")
    train, val = (raw / "train.txt").read_text(), (raw / "val.txt").read_text()
    write(raw / "trainval.txt", val + train)
    assert convert(raw, tmp_path / "out") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert {k: s.samples for k, s in manifest.splits.items()} == {"train": 6, "val": 3, "test": 3}
    assert "trainval.txt" in manifest.source["layout"]


def test_trainval_and_test_are_the_splits_when_alone(tmp_path: Path) -> None:
    raw = make_folders(tmp_path / "raw", "lists")
    (raw / "lists" / "train.txt").rename(raw / "lists" / "trainval.txt")
    (raw / "lists" / "val.txt").unlink()
    assert convert(raw, tmp_path / "out") == 0
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert {k: s.samples for k, s in manifest.splits.items()} == {"trainval": 6, "test": 3}


def _break(raw: Path, case: str) -> str:
    if case == "trainval-differs":
        lines = (raw / "train.txt").read_text() + (raw / "val.txt").read_text()
        write(raw / "trainval.txt", lines + "fox/5\n")
        return f"{raw / 'trainval.txt'} names 'fox/5', unlike {raw / 'train.txt'} and"
    if case == "in-two-lists":
        write(raw / "test.txt", (raw / "test.txt").read_text() + "cat/1\n")
        return "both name 'images/cat/1.jpg', in splits"
    if case == "twice-in-a-list":
        write(raw / "train.txt", (raw / "train.txt").read_text() + "cat/1.jpg\n")
        return "both name 'images/cat/1.jpg', a split lists each image once"
    if case == "two-list-folders":
        write(raw / "meta" / "train.txt", "cat/1\n")
        return f"split lists lie in both {raw}/ and {raw / 'meta'}"
    if case == "columns":
        write(raw / "val.txt", "cat/3 cat x y\ndog/3 dog x y\n")
        return f"{raw / 'val.txt'}: most lines have 4 fields"
    if case == "not-utf8":
        (raw / "val.txt").write_bytes(b"cat/3\n\xff\xfe\n")
        return f"{raw / 'val.txt'}: not UTF-8 text"
    write(raw / "val.txt", "cat/3\nkoala/3\nwombat/3\n")
    return (
        f"{raw / 'val.txt'}: 2 of its 3 entries cannot be used, e.g. {raw / 'val.txt'} line 2: "
        f"names {raw / 'koala' / '3'}.<image suffix> or {raw / 'images' / 'koala' / '3'}"
        ".<image suffix>, which does not exist"
    )


BAD = [
    "trainval-differs",
    "in-two-lists",
    "two-list-folders",
    "columns",
    "not-utf8",
    "most-missing",
]


@pytest.mark.parametrize("case", BAD)
def test_ambiguous_or_broken_lists_are_one_error_line(tmp_path: Path, case: str, capsys) -> None:
    raw = make_folders(tmp_path / "raw")
    expected = _break(raw, case)
    assert convert(raw, tmp_path / "out") == 2
    line = one_error(capsys)
    assert expected in line, line
    assert not (tmp_path / "out" / "dlpipe.json").exists()


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("cat/3 cat extra", "line 3: has 3 fields, expected '<image path> [<label>]'"),
        ("../../etc/passwd", "line 3: '../../etc/passwd' is not a relative path inside the folder"),
        ("/etc/hostname", "line 3: '/etc/hostname' is not a relative path inside the folder"),
        ("cat/twin", "line 3: names 2 images: images/cat/twin.jpg, images/cat/twin.png"),
        ("cat/42.jpg", "line 3: names {raw}/cat/42.jpg or {raw}/images/cat/42.jpg, which does"),
        ("cat/5 dog", "line 3: has 2 fields where its list's lines have 1"),
    ],
    ids=["fields", "dotdot", "absolute", "two-files", "missing", "odd-columns"],
)
def test_one_bad_line_is_one_skipped_sample(tmp_path: Path, line: str, expected: str) -> None:
    raw = make_folders(tmp_path / "raw")
    write(raw / "images" / "cat" / "twin.jpg", jpeg(90))
    write(raw / "images" / "cat" / "twin.png", jpeg(91))
    write(raw / "train.txt", (raw / "train.txt").read_text().replace("cat/2\n", line + "\n"))
    out = tmp_path / "out"
    assert convert(raw, out) == 0
    (error,) = error_records(out)
    assert f"{raw / 'train.txt'} {expected.format(raw=raw)}" in error["error"], error
    assert dlpipe.read_manifest(str(out)).splits["train"].samples == 5


def test_detection_leaves_specific_layouts_and_yolo_alone(tmp_path: Path) -> None:
    kinds = list(SOURCE_KINDS)
    assert kinds.index("splitlist") < kinds.index("imagefolder")
    for kind in ("food101", "cub200", "oxford-pets", "flowers102", "stanford-cars"):
        assert kinds.index(kind) < kinds.index("splitlist") < kinds.index("imagenet")
    food = make_food101(tmp_path / "food")
    cub = make_cub(tmp_path / "cub")
    pets = make_pets(tmp_path / "pets")
    for root in (food, cub, pets):
        assert not SplitListSource.detect(str(root)), root
    raw = make_folders(tmp_path / "raw")
    assert open_source(str(raw)).kind == "splitlist"
    write(raw / "data.yaml", "names: [cat, dog, fox]\ntrain: train.txt\n")
    assert not SplitListSource.detect(str(raw))
    lists_only = tmp_path / "lists-only"
    write(lists_only / "train.txt", "a\nb\n")
    assert not SplitListSource.detect(str(lists_only))


def test_the_named_layouts_agree_with_torchvision(tmp_path: Path) -> None:
    """torchvision's own dataset classes, run on the same folders, give the same labels."""
    datasets = pytest.importorskip("torchvision.datasets")
    from splitlist_fixtures import make_cars

    make_food101(tmp_path / "food")
    make_pets(tmp_path / "pets" / "oxford-iiit-pet")
    make_cars(tmp_path / "cars")
    cases = [
        ("food", datasets.Food101, {"train": "train", "test": "test"}),
        ("pets", datasets.OxfordIIITPet, {"trainval": "trainval", "test": "test"}),
        ("cars", datasets.StanfordCars, {"train": "train", "test": "test"}),
    ]
    for name, cls, splits in cases:
        out = tmp_path / f"{name}-out"
        assert convert(tmp_path / name, out) == 0
        manifest = dlpipe.read_manifest(str(out))
        for ours, theirs in splits.items():
            reference = cls(str(tmp_path / name), split=theirs)
            assert list(manifest.classes) == list(reference.classes), name
            files = getattr(reference, "_image_files", None) or getattr(reference, "_images", None)
            pairs = zip(files, reference._labels, strict=True) if files else reference._samples
            expected = {Path(str(f)).stem: label for f, label in pairs}
            got = {k.rsplit("/", 1)[-1]: v for k, v in _labels(out, ours).items()}
            if name == "pets":  # torchvision's label is CLASS-ID - 1 (gapped in this subset)
                got = {k: int(manifest.class_ids[v]) - 1 for k, v in got.items()}
            assert got == expected, (name, ours)
