"""Labels in file names (the ``filenames`` source, ``--label-from``) and Kaggle's submission
templates in any spelling, as the datasets ship: Dogs vs Cats (``train/cat.0.jpg`` beside
``test1/1.jpg`` and ``sampleSubmission.csv``) and Oxford-IIIT Pet's ``images/``."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
from conftest import one_error_line
from PIL import Image

import dlpipe
from dlpipe.cli import main
from dlpipe.converters.config import ConvertConfig, ConvertOptionError
from dlpipe.converters.filenames import FilenamesSource, label_rule, split_of_folder
from dlpipe.converters.source import SourceError, SourceOptions
from dlpipe.converters.sources import open_source
from dlpipe.converters.table import TableSource
from dlpipe.converters.table_names import find_tables, is_submission


def jpeg(index: int = 0) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 6), (index * 40 % 256, 90, 200)).save(out, "JPEG")
    return out.getvalue()


def put(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())


def dogs_vs_cats(root: Path, *, per: int = 3, test: int = 4, submission: str = "") -> Path:
    """Kaggle's Dogs vs Cats as train.zip and test1.zip unpack, with its sample submission."""
    for label in ("cat", "dog"):
        for i in range(per):
            put(root / "train" / f"{label}.{i}.jpg", jpeg(i))
    for i in range(1, test + 1):
        put(root / "test1" / f"{i}.jpg", jpeg(i))
    rows = "".join(f"{i},0.5\n" for i in range(1, test + 1))
    put(root / (submission or "sampleSubmission.csv"), f"id,label\n{rows}")
    return root


def pets_images(root: Path, breeds: tuple[str, ...] = ("Abyssinian", "great_pyrenees")) -> Path:
    for breed in breeds:
        for i in (1, 100, 173):
            put(root / f"{breed}_{i}.jpg", jpeg(i))
    put(root / "Abyssinian_100.mat", b"MATLAB 5.0 MAT-file")  # as images.tar.gz has
    return root


def convert(raw: Path, out: Path, *flags: str) -> int:
    return main(["convert", str(raw), "--to", "lmdb", "--out", str(out), "--workers", "1", *flags])


def read(out: Path, split: str) -> dict[str, dict]:
    return {s["__key__"]: dict(s) for s in dlpipe.open_dataset(str(out), split)}


# --- Dogs vs Cats --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "submission",
    ["sampleSubmission.csv", "sample_submission.csv", "SampleSubmission.csv", "submission.csv"],
)
def test_dogs_vs_cats_converts_with_labels_from_names_and_an_unlabelled_test_split(
    tmp_path, capsys, submission
) -> None:
    raw = dogs_vs_cats(tmp_path / "dogs-vs-cats", submission=submission)
    out = tmp_path / "out"
    assert convert(raw, out) == 0, capsys.readouterr().err
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.source["kind"] == "filenames"
    assert manifest.classes == ("cat", "dog")
    assert manifest.splits["train"].samples == 6 and manifest.splits["test"].samples == 4
    assert manifest.splits["train"].class_counts == (3, 3)
    assert manifest.fields_of("test") == {"jpg": "image"}  # no cls: test1/ has no labels
    train = read(out, "train")
    assert {k: int(s["cls"]) for k, s in train.items()} == {
        f"{label}%2E{i}": index for index, label in enumerate(("cat", "dog")) for i in range(3)
    }
    test = read(out, "test")
    assert sorted(test) == ["1", "2", "3", "4"] and all("cls" not in s for s in test.values())
    assert main(["verify", str(out), "--decode"]) == 0


def test_dogs_vs_cats_train_folder_alone_converts(tmp_path, capsys) -> None:
    raw = dogs_vs_cats(tmp_path / "dvc")
    out = tmp_path / "out"
    assert convert(raw / "train", out) == 0, capsys.readouterr().err
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == ("cat", "dog") and list(manifest.splits) == ["train"]


def test_a_labelled_val_folder_is_a_labelled_split(tmp_path, capsys) -> None:
    raw = tmp_path / "raw"
    for split, count in (("train", 3), ("Validation", 2)):
        for label in ("cat", "dog"):
            for i in range(count):
                put(raw / split / f"{label}_{i}.jpg", jpeg(i))
    out = tmp_path / "out"
    assert convert(raw, out) == 0, capsys.readouterr().err
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.splits["val"].class_counts == (2, 2) and "cls" in manifest.fields


def test_the_table_source_never_reads_a_sample_submission_as_labels(tmp_path) -> None:
    raw = dogs_vs_cats(tmp_path / "dvc")
    assert TableSource.label_table(str(raw)) is None
    assert not TableSource.detect(str(raw))


# --- Oxford-IIIT Pet's images/ ----------------------------------------------------------------


def test_pets_images_folder_converts_with_breeds_from_the_names(tmp_path, capsys) -> None:
    raw = pets_images(tmp_path / "images", ("Abyssinian", "great_pyrenees", "Bengal"))
    out = tmp_path / "out"
    assert convert(raw, out) == 0, capsys.readouterr().err
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == ("Abyssinian", "Bengal", "great_pyrenees")  # sorted names
    assert manifest.splits["train"].samples == 9
    assert manifest.source["ignored_files"] == 1  # the .mat file
    keys = {k: int(s["cls"]) for k, s in read(out, "train").items()}
    assert keys["great_pyrenees_173"] == 2 and keys["Abyssinian_1"] == 0


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("cat.0.jpg", "cat"),
        ("dog.12499.jpg", "dog"),
        ("Abyssinian_100.jpg", "Abyssinian"),
        ("great_pyrenees_173.jpg", "great_pyrenees"),
        ("american-pit-bull-terrier-7.PNG", "american-pit-bull-terrier"),
        ("n01440764_10026.JPEG", "n01440764"),
        ("3_17.jpg", "3"),
        ("1.jpg", None),
        ("cat.jpg", None),
        ("cat_.jpg", None),
        ("_12.jpg", None),
    ],
)
def test_name_prefix_is_the_stem_before_its_trailing_number(name, label) -> None:
    assert label_rule("name-prefix").label_of(name) == label


@pytest.mark.parametrize(
    ("rule", "name", "label"),
    [
        (r"^([a-z]+)_", "cat_white_01.jpg", "cat"),
        (r"-(?P<label>[a-z]+)\.", "0001-dog.jpg", "dog"),
        (r"(?P<label>[a-z]+)(\d+)", "cat12.jpg", "cat"),
        (r"^([a-z]+)_", "Cat_01.jpg", None),
    ],
)
def test_a_label_regex_is_searched_in_the_name(rule, name, label) -> None:
    assert label_rule(rule).label_of(name) == label


@pytest.mark.parametrize(
    ("rule", "words"), [(r"([a-z]+", "nor a regular expression"), (r"(a)(b)", "2 groups")]
)
def test_a_bad_label_regex_is_one_error_line(tmp_path, capsys, rule, words) -> None:
    raw = pets_images(tmp_path / "images")
    with pytest.raises(SystemExit) as exit_info:
        convert(raw, tmp_path / "out", "--label-from", rule)
    assert exit_info.value.code == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--label-from" in line and words in line
    with pytest.raises(ConvertOptionError, match="--label-from"):
        ConvertConfig.from_options(str(raw), "lmdb", label_from=rule)


def test_label_from_with_another_source_is_refused(tmp_path, capsys) -> None:
    raw = pets_images(tmp_path / "images")
    assert convert(raw, tmp_path / "out", "--source", "imagefolder", "--label-from", "x(.)") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--label-from" in line and "--source imagefolder" in line


def test_label_from_regex_skips_and_lists_names_it_does_not_match(tmp_path, capsys) -> None:
    raw = tmp_path / "photos"
    for label in ("cat", "dog"):
        for i in range(2):
            put(raw / f"photo-{label}-{i}.jpg", jpeg(i))
    put(raw / "holiday.jpg", jpeg(9))  # names no label
    out = tmp_path / "out"
    assert convert(raw, out, "--label-from", r"photo-(?P<label>[a-z]+)-") == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == ("cat", "dog") and manifest.source["skipped"] == 1
    assert manifest.source["label_from"] == r"photo-(?P<label>[a-z]+)-"
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert len(errors) == 1 and "holiday.jpg" in json.dumps(errors[0])
    assert "no label" in json.dumps(errors[0])
    assert (
        convert(raw, tmp_path / "out2", "--label-from", "photo-([a-z]+)-", "--on-error", "fail")
        == 2
    )
    assert "holiday.jpg" in one_error_line(capsys.readouterr().err)


def test_label_from_that_matches_nothing_is_one_error_line(tmp_path, capsys) -> None:
    raw = pets_images(tmp_path / "images")
    assert convert(raw, tmp_path / "out", "--label-from", r"^zzz(\d)") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "no image name gives a label" in line and "--label-from" in line
    assert not (tmp_path / "out").exists()


def test_label_from_is_repeated_by_the_printed_resume_command(tmp_path) -> None:
    config = ConvertConfig.from_options(str(tmp_path / "raw"), "lmdb", label_from="^([a-z]+)_")
    assert "--label-from '^([a-z]+)_'" in config.command("--resume")
    result = dlpipe.convert(
        str(pets_images(tmp_path / "images")), to="lmdb", out=str(tmp_path / "o"), workers=1
    )
    assert result.manifest.classes == ("Abyssinian", "great_pyrenees")


# --- what is not a file-name layout --------------------------------------------------------------


def names_folder(root: Path, names: list[str]) -> Path:
    for i, name in enumerate(names):
        put(root / name, jpeg(i))
    return root


@pytest.mark.parametrize(
    "names",
    [
        ["cat.0.jpg", "cat.1.jpg", "cat.2.jpg"],  # one label
        ["cat.0.jpg", "cat.1.jpg", "dog.0.jpg"],  # a label with one image
        ["cat.0.jpg", "cat.1.jpg", "dog.0.jpg", "dog.1.jpg", "bird.jpg"],  # a name without
        ["IMG_0001.jpg", "IMG_0002.jpg", "DSC_0001.jpg", "DSC_0002.jpg"],  # a phone's photos
        ["1.jpg", "2.jpg", "3.jpg"],  # bare numbers only
    ],
)
def test_folders_whose_names_do_not_all_carry_labels_are_not_detected(tmp_path, names) -> None:
    assert not FilenamesSource.detect(str(names_folder(tmp_path / "raw", names)))


def test_a_files_layout_with_sidecars_is_not_detected(tmp_path) -> None:
    raw = names_folder(tmp_path / "raw", ["cat_1.jpg", "cat_2.jpg", "dog_1.jpg", "dog_2.jpg"])
    for stem in ("cat_1", "cat_2", "dog_1", "dog_2"):
        put(raw / f"{stem}.json", "{}")
    assert not FilenamesSource.detect(str(raw))
    assert open_source(str(raw)).kind == "files"


@pytest.mark.parametrize(
    "extra",
    ["sub/cat_5.jpg", "loose_1.jpg"],  # a sub-folder; an image beside split folders
)
def test_split_layouts_with_other_entries_are_not_detected(tmp_path, extra) -> None:
    raw = dogs_vs_cats(tmp_path / "dvc")
    put(raw / extra if "/" not in extra else raw / "train" / extra, jpeg())
    assert not FilenamesSource.detect(str(raw))


def test_two_folders_of_one_split_are_not_detected(tmp_path) -> None:
    raw = dogs_vs_cats(tmp_path / "dvc")
    put(raw / "test" / "9.jpg", jpeg())  # test/ beside test1/
    assert not FilenamesSource.detect(str(raw))


def test_an_explicit_filenames_source_refuses_sub_folders(tmp_path) -> None:
    raw = dogs_vs_cats(tmp_path / "dvc")
    put(raw / "train" / "more" / "cat.9.jpg", jpeg())
    with pytest.raises(SourceError, match="flat folders"):
        FilenamesSource(str(raw), SourceOptions()).scan()


@pytest.mark.parametrize(
    ("name", "split"),
    [("train", "train"), ("Train", "train"), ("test1", "test"), ("valid", "val"), ("x", None)],
)
def test_split_folder_names(name, split) -> None:
    assert split_of_folder(name) == split


def test_a_label_scan_warns_of_the_names_it_cannot_label(tmp_path, caplog) -> None:
    raw = names_folder(tmp_path / "raw", ["cat_1.jpg", "cat_2.jpg", "x.jpg"])
    source = FilenamesSource(str(raw), SourceOptions(label_from="name-prefix"))
    with caplog.at_level(logging.WARNING, logger="dlpipe"):
        scan = source.scan()
    assert [it.label for it in scan.items] == [0, 0, None]
    assert any("1 images" in r.message and "x.jpg" in r.message for r in caplog.records)


# --- Kaggle submission templates -------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "sample_submission.csv",
        "sampleSubmission.csv",
        "SampleSubmission.csv",
        "sample-submission.csv",
        "SAMPLE_SUBMISSION.CSV",
        "sample_submission_v2.csv",
        "sample_submission.tsv",
        "sample_submission.parquet",
        "sample_submission.csv.zip",
        "stage_1_sample_submission.csv",
        "stage2_sample_submission_V3.csv",
        "LOC_sample_submission.csv",
        "submission_format.csv",
        "SubmissionFormat.csv",
        "submission.csv",
        "submission_example.csv",
        "test_submission.jsonl",
        "sample submission.csv",
        "data/sample_submission.csv",
    ],
)
def test_submission_templates_in_any_spelling(name) -> None:
    assert is_submission(name)


@pytest.mark.parametrize(
    "name",
    [
        "train.csv",
        "test.csv",
        "labels.csv",
        "LOC_val_solution.csv",
        "solution.csv",
        "submissions_reddit.csv",
        "sample_labels.csv",
        "metadata.csv",
    ],
)
def test_data_tables_are_no_submission_templates(name) -> None:
    assert not is_submission(name)


@pytest.mark.parametrize("name", ["sampleSubmission.csv", "SampleSubmission.csv"])
def test_kaggle_tables_beside_any_submission_spelling_read_only_the_data(tmp_path, name) -> None:
    raw = tmp_path / "comp"
    for split in ("train", "test"):
        for i in range(4):
            put(raw / split / f"{split}{i}.jpg", jpeg(i))
    put(raw / "train.csv", "id,label\n" + "".join(f"train{i},{i % 2}\n" for i in range(4)))
    put(raw / "test.csv", "id\n" + "".join(f"test{i}\n" for i in range(4)))
    put(raw / name, "id,label\n" + "".join(f"test{i},0\n" for i in range(4)))
    source = open_source(str(raw))
    assert source.kind == "table"
    assert [Path(p).name for p in find_tables(str(raw))] == ["test.csv", "train.csv"]
    scan = source.scan()
    assert sum(it.label is not None for it in scan.items) == 4  # train's rows, labelled


def test_a_submission_template_given_as_the_table_is_refused(tmp_path, capsys) -> None:
    raw = dogs_vs_cats(tmp_path / "dvc")
    assert convert(raw / "sampleSubmission.csv", tmp_path / "out") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "sampleSubmission.csv" in line and "submission template" in line
