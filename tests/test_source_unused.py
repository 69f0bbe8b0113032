"""What ``dlpipe convert`` did not read is accounted for, per kind, in every source: each
dataset built as it ships, plus stray files, checked in the manifest's ``source.unused`` and in
the ``not used:`` line convert prints (and the ``source:`` line naming the layout and why).
Hidden files are never counted, special files are skipped entries, never unused."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest
from test_source_cifar import make_cifar10, make_cifar100
from test_source_filenames import dogs_vs_cats, pets_images, put
from test_source_hf_folder import captions, image, write_jsonl
from test_source_imagenet import DEVKIT_DATA, make_devkit, make_kaggle
from test_source_mnist import make_mnist
from test_source_splitlist import make_folders

import dlpipe
from dlpipe.cli import main

KINDS = ("images", "annotation files", "split lists", "masks", "other")


def unused(images: int = 0, annotations: int = 0, lists: int = 0, masks: int = 0, other: int = 0):
    return dict(zip(KINDS, (images, annotations, lists, masks, other), strict=True))


def convert_and_check(raw: Path, out: Path, capsys, expected: dict, *flags: str) -> dict:
    """Convert `raw`; the manifest's ``source.unused`` is `expected` and the printed
    ``not used:`` line lists its counts (no line when nothing was left)."""
    code = main(["convert", str(raw), "--to", "wds", "--out", str(out), "--workers", "1", *flags])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    source = dlpipe.read_manifest(str(out)).source
    assert source["unused"] == expected
    lines = [line for line in printed.out.splitlines() if line.startswith("not used:")]
    shown = ", ".join(f"{n} {kind}" for kind, n in expected.items() if n)
    assert lines == ([f"not used: {shown}"] if shown else [])
    sources = [line for line in printed.out.splitlines() if line.startswith("source: ")]
    assert sources == [f"source: {source['kind']}: {source['layout']}"]
    return source


def hidden_and_special(folder: Path) -> None:
    """What is never counted as unused: hidden/OS files, and a FIFO (a skipped entry)."""
    put(folder / ".DS_Store", b"\0")
    put(folder / "Thumbs.db", b"\0")
    os.mkfifo(folder / "pipe")


# --- cifar -----------------------------------------------------------------------------------


@pytest.mark.parametrize("given", ["parent", "folder"])
def test_cifar10_counts_readme_name_lists_and_strays(tmp_path: Path, capsys, given: str) -> None:
    folder = make_cifar10(tmp_path / "raw")
    put(folder / "readme.html", "<html>CIFAR-10</html>")  # as cifar-10-python.tar.gz ships
    put(folder / "batches.meta.txt", "airplane\nautomobile\n")  # the binary version's names
    put(folder / "preview.png", image(1))
    put(tmp_path / "raw" / "NOTES.md", "where it came from")
    hidden_and_special(folder)
    raw = tmp_path / "raw" if given == "parent" else folder
    expected = unused(images=1, annotations=1, other=1 + (given == "parent"))
    source = convert_and_check(raw, tmp_path / "out", capsys, expected)
    where = "cifar-10-batches-py/" if given == "parent" else "its top"
    assert source["layout"] == (
        f"{where} holds CIFAR-10's python batches (data_batch_1, data_batch_2, data_batch_3, "
        "data_batch_4, data_batch_5, test_batch) and batches.meta"
    )
    assert source["skipped_entries"] == 1  # the FIFO: skipped, not opened, not "unused"


def test_cifar10_tar_gz_as_downloaded_counts_its_readme(tmp_path: Path, capsys) -> None:
    folder = make_cifar10(tmp_path / "unpacked")
    put(folder / "readme.html", "<html>CIFAR-10</html>")
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="cifar-10-batches-py")
    source = convert_and_check(archive, tmp_path / "out", capsys, unused(other=1))
    assert source["root"] == str(archive) and source["archives"]["members"] == 8
    assert dlpipe.read_manifest(str(tmp_path / "out")).splits["train"].samples == 20


def test_cifar100_counts_its_file_txt_and_the_binary_name_lists(tmp_path: Path, capsys) -> None:
    folder = make_cifar100(tmp_path / "raw")
    put(folder / "file.txt~", "")  # cifar-100-python.tar.gz ships this leftover
    for name in ("fine_label_names.txt", "coarse_label_names.txt"):
        put(tmp_path / "raw" / "cifar-100-binary" / name, "apple\n")
    put(tmp_path / "raw" / "cifar-100-binary" / "train.bin", b"\0" * 3074)
    source = convert_and_check(tmp_path / "raw", tmp_path / "out", capsys,
                               unused(annotations=2, other=2))  # fmt: skip
    assert source["layout"].startswith("cifar-100-python/ holds CIFAR-100's python batches")


def test_cifar_with_nothing_beside_it_prints_no_not_used_line(tmp_path: Path, capsys) -> None:
    convert_and_check(make_cifar10(tmp_path / "raw"), tmp_path / "out", capsys, unused())


# --- mnist -----------------------------------------------------------------------------------


def test_mnist_as_torchvision_keeps_it_counts_the_gz_beside_the_plain_files(
    tmp_path: Path, capsys
) -> None:
    raw = tmp_path / "MNIST"
    make_mnist(raw / "raw", gz=True)  # torchvision downloads the .gz files and unpacks them
    make_mnist(raw / "raw")
    put(raw / "processed" / "training.pt", b"\0")  # older torchvision's cache
    put(raw / "raw" / "sample.png", image(2))
    hidden_and_special(raw / "raw")
    source = convert_and_check(raw, tmp_path / "out", capsys, unused(images=1, other=5))
    assert source["layout"] == (
        "raw/ holds MNIST's IDX files (t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, "
        "train-images-idx3-ubyte, train-labels-idx1-ubyte)"
    )
    assert source["skipped_entries"] == 1


def test_fashion_mnist_gz_files_as_downloaded_leave_only_the_readme(tmp_path: Path, capsys) -> None:
    raw = tmp_path / "fashion-mnist"
    make_mnist(raw, gz=True)
    put(raw / "README.md", "Fashion-MNIST")
    source = convert_and_check(raw, tmp_path / "out", capsys, unused(other=1))
    assert source["layout"].startswith("its top holds Fashion-MNIST's IDX files (t10k-images-")
    assert "-idx3-ubyte.gz" in source["layout"]


# --- imagenet --------------------------------------------------------------------------------


def test_imagenet_kaggle_counts_test_boxes_imagesets_and_the_submission(
    tmp_path: Path, capsys
) -> None:
    raw = make_kaggle(tmp_path / "raw")  # test/ holds 1 image; ImageSets/ 1 list
    put(raw / "ILSVRC" / "Annotations" / "CLS-LOC" / "val" / "ILSVRC2012_val_00000001.xml", "<a/>")
    put(raw / "ILSVRC" / "Data" / "CLS-LOC" / "train" / "n01440764" / "notes.txt", "x")
    hidden_and_special(raw)
    expected = unused(images=1, annotations=2, lists=1, other=2)
    source = convert_and_check(raw, tmp_path / "out", capsys, expected)
    assert source["layout"] == (
        "kaggle: the Kaggle download (LOC_synset_mapping.txt, LOC_val_solution.csv) labels the "
        "images of ILSVRC/Data/CLS-LOC/train/ and val/"
    )
    assert source["left_out"] == {"test": f"{raw / 'ILSVRC/Data/CLS-LOC/test'}: no labels"}
    assert source["ignored_files"] == 1 and source["skipped_entries"] == 1


def test_imagenet_devkit_counts_its_code_readme_blacklist_and_loose_images(
    tmp_path: Path, capsys
) -> None:
    raw = make_devkit(tmp_path / "raw")
    put(raw / DEVKIT_DATA / "ILSVRC2012_validation_blacklist.txt", "36\n50\n")
    put(raw / "ILSVRC2012_devkit_t12" / "evaluation" / "demo_eval.m", "% matlab")
    put(raw / "train" / "loose.JPEG", image(3, kind="JPEG"))  # in no synset folder
    put(raw / "test" / "ILSVRC2012_test_00000001.JPEG", image(4, kind="JPEG"))
    expected = unused(images=2, lists=1, other=2)
    source = convert_and_check(raw, tmp_path / "out", capsys, expected)
    assert source["layout"] == (
        "devkit: the devkit (ILSVRC2012_devkit_t12/data/meta.mat, ILSVRC2012_devkit_t12/data/"
        "ILSVRC2012_validation_ground_truth.txt) labels the images of train/ and val/"
    )
    assert dlpipe.read_manifest(str(tmp_path / "out")).splits["train"].samples == 9


# --- files -----------------------------------------------------------------------------------


def grouped(root: Path) -> Path:
    """key.jpg + key.cls + key.json in train/ and val/, classes.txt at the top."""
    for split, keys in (("train", range(4)), ("val", range(4, 6))):
        for k in keys:
            put(root / split / f"{k:04d}.jpg", image(k, kind="JPEG"))
            put(root / split / f"{k:04d}.cls", str(k % 2))
            put(root / split / f"{k:04d}.json", f'{{"k": {k}}}')
    put(root / "classes.txt", "cat\ndog\n")
    return root


def test_files_counts_what_lies_beside_its_split_folders(tmp_path: Path, capsys) -> None:
    raw = grouped(tmp_path / "raw")
    put(raw / "README.md", "about")
    put(raw / "cover.jpg", image(9, kind="JPEG"))
    put(raw / "extras" / "stats.json", "{}")
    put(raw / "train" / "classes.txt", "cat\ndog\n")  # only the top's is read
    hidden_and_special(raw)
    source = convert_and_check(raw, tmp_path / "out", capsys, unused(images=1, other=3),
                               "--source", "files")  # fmt: skip
    assert (
        source["layout"] == "files in train/, val/ grouped by stem into samples of image, json, cls"
    )
    manifest = dlpipe.read_manifest(str(tmp_path / "out"))
    assert manifest.classes == ("cat", "dog")
    assert {k: s.samples for k, s in manifest.splits.items()} == {"train": 4, "val": 2}


def test_files_without_split_folders_reads_every_file(tmp_path: Path, capsys) -> None:
    raw = tmp_path / "raw"
    for k in range(4):
        put(raw / f"{k:04d}.jpg", image(k, kind="JPEG"))
        put(raw / f"{k:04d}.txt", f"caption {k}")
    put(raw / "classes.txt", "")
    source = convert_and_check(raw, tmp_path / "out", capsys, unused())
    assert source["layout"] == "files at its top grouped by stem into samples of image, txt"


# --- filenames -------------------------------------------------------------------------------


def test_dogs_vs_cats_counts_the_sample_submission_and_other_files(tmp_path: Path, capsys) -> None:
    raw = dogs_vs_cats(tmp_path / "raw")
    put(raw / "train" / "notes.txt", "x")
    put(raw / "test1" / "labels.json", "{}")
    hidden_and_special(raw / "train")
    source = convert_and_check(raw, tmp_path / "out", capsys, unused(other=3))
    assert source["ignored_files"] == 2 and source["skipped_entries"] == 1
    assert source["layout"] == (
        "the image names in test1/, train/ give the labels by --label-from name-prefix "
        "(test: no labels, bare numbers)"
    )


def test_pets_images_count_their_mat_files_but_not_a_skipped_image(tmp_path: Path, capsys) -> None:
    raw = pets_images(tmp_path / "images")  # the .mat file images.tar.gz has
    put(raw / "photo.jpg", image(5, kind="JPEG"))  # its name gives no label
    source = convert_and_check(raw, tmp_path / "out", capsys, unused(other=1),
                               "--source", "filenames")  # fmt: skip
    assert source["skipped"] == 1  # a skipped sample (errors.jsonl), not an unused file
    assert (
        source["layout"] == "the image names in its top give the labels by --label-from name-prefix"
    )


# --- splitlist -------------------------------------------------------------------------------


def test_splitlist_counts_unlisted_images_and_every_other_file(tmp_path: Path, capsys) -> None:
    raw = make_folders(tmp_path / "raw", "meta")  # 3 images in no list, a README
    put(raw / "meta" / "attributes.csv", "image,furry\n")
    put(raw / "images" / "cat" / "1.xml", "<box/>")
    hidden_and_special(raw / "images")
    source = convert_and_check(raw, tmp_path / "out", capsys, unused(images=3, other=3))
    assert source["skipped_entries"] == 1


# --- hf --------------------------------------------------------------------------------------


def test_hf_counts_images_no_row_names_and_every_other_file(tmp_path: Path, capsys) -> None:
    raw = captions(tmp_path / "raw")
    put(raw / "train" / "stray.png", image(99))
    put(raw / "masks" / "1.png", image(98))
    put(raw / "train" / "notes.txt", "not data")
    put(raw / "README.md", "a dataset card")
    hidden_and_special(raw / "train")
    source = convert_and_check(raw, tmp_path / "out", capsys, unused(images=2, other=2))
    assert source["unused_examples"] == ["masks/1.png", "train/stray.png"]
    assert source["skipped_entries"] == 1


def test_hf_images_read_as_further_columns_are_not_counted(tmp_path: Path, capsys) -> None:
    raw = tmp_path / "raw"
    rows = []
    for i in range(3):
        put(raw / "images" / f"{i}.png", image(i))
        put(raw / "conditioning" / f"{i}.png", image(10 + i))
        rows.append({"file_name": f"images/{i}.png",
                     "conditioning_image_file_name": f"conditioning/{i}.png"})  # fmt: skip
    put(raw / "conditioning" / "3.png", image(13))
    write_jsonl(raw / "metadata.jsonl", rows)
    convert_and_check(raw, tmp_path / "out", capsys, unused(images=1))


def test_hf_files_named_without_an_image_suffix_are_read_not_counted(
    tmp_path: Path, capsys
) -> None:
    raw = tmp_path / "raw"
    for i in range(3):
        put(raw / f"{i}.dat", image(i))  # a PNG under another name: read and decoded
    write_jsonl(raw / "metadata.jsonl", [{"file_name": f"{i}.dat", "text": "x"} for i in range(3)])
    put(raw / "3.dat", image(3))  # named by no row
    convert_and_check(raw, tmp_path / "out", capsys, unused(other=1))
    assert dlpipe.read_manifest(str(tmp_path / "out")).splits["train"].samples == 3
