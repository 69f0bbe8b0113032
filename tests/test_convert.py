"""dlpipe convert as a user runs it: sources, options, bad input, determinism, kill and resume."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import FORMAT_NAMES
from convert_hold import ConvertHold
from PIL import Image

import dlpipe
from dlpipe.cli import main
from dlpipe.converters import engine
from dlpipe.synthetic import SHAPE_CLASSES, split_samples, write_imagefolder

DLPIPE = str(Path(sys.executable).parent / "dlpipe")


def make_raw(root: Path, per_class: int = 6, *, splits: bool = True) -> Path:
    """Shapes as an ImageFolder: root/{train,val}/<class>/*.jpg, or root/<class>/*.jpg (also
    when fewer than 4 per class leave val empty: a lone train/ would read as one class)."""
    pairs = list(split_samples(per_class, seed=1, val_fraction=0.25 if splits else 0))
    if splits and all(split == "train" for split, _ in pairs):
        write_imagefolder(str(root.with_name(root.name + "-parts")), pairs)
        os.replace(root.with_name(root.name + "-parts") / "train", root)
        return root
    write_imagefolder(str(root), pairs)
    return root / "train" if not splits else root


def run(argv: list[str]) -> int:
    return main(["convert", *argv])


def read_all(path: Path | str, split: str = "train") -> list[dict]:
    return list(dlpipe.open_dataset(str(path), split))


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_imagefolder_with_splits_converts_byte_for_byte(tmp_path, fmt) -> None:
    raw = make_raw(tmp_path / "raw")
    out = tmp_path / "out"
    assert run([str(raw), "--to", fmt, "--out", str(out), "--workers", "2"]) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == SHAPE_CLASSES
    assert {n: s.samples for n, s in manifest.splits.items()} == {"train": 40, "val": 8}
    assert manifest.fields == {"jpg": "image", "cls": "int"}
    for sample in read_all(out, "val"):
        cls_name, stem = dlpipe.unescape_key(sample["__key__"]).split("/")
        assert SHAPE_CLASSES[int(sample["cls"])] == cls_name
        assert sample["jpg"] == (raw / "val" / cls_name / f"{stem}.jpg").read_bytes()
    assert dlpipe.verify_dataset(str(out), decode=True).ok
    assert not (out / ".dlpipe-journal").exists() and not (out / "errors.jsonl").exists()


def test_same_input_and_options_give_identical_output(tmp_path) -> None:
    raw = make_raw(tmp_path / "raw", per_class=10)
    outs = [tmp_path / "a", tmp_path / "b"]
    for out, workers in zip(outs, ["1", "2"]):
        assert (
            run(
                [
                    str(raw),
                    "--to",
                    "wds",
                    "--out",
                    str(out),
                    "--shard-size",
                    "20KB",
                    "--workers",
                    workers,
                ]
            )
            == 0
        )
    names = sorted(os.listdir(outs[0]))
    assert names == sorted(os.listdir(outs[1])) and len(names) > 4
    for name in names:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name


def test_samples_are_shuffled_across_shards_and_val_is_stratified(tmp_path) -> None:
    raw = make_raw(tmp_path / "raw", per_class=20, splits=False)

    def convert_with_seed(seed: int) -> Path:
        out = tmp_path / f"seed{seed}"
        argv = [str(raw), "--to", "hdf5", "--out", str(out), "--val-fraction", "0.25"]
        assert run([*argv, "--shard-size", "40KB", "--seed", str(seed)]) == 0
        return out

    out = convert_with_seed(3)
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.splits["val"].class_counts == (5,) * 8
    assert manifest.splits["train"].class_counts == (15,) * 8
    shards = manifest.splits["train"].shards
    assert len(shards) >= 3
    first = [int(s["cls"]) for s in read_all(out)][: shards[0].samples]
    assert len(set(first)) >= 4  # a shard mixes classes
    other = convert_with_seed(4)
    assert [s["__key__"] for s in read_all(other)] != [s["__key__"] for s in read_all(out)]


def test_max_side_reencodes_large_images_keeping_aspect(tmp_path) -> None:
    raw = tmp_path / "raw"
    for name, size in [("big", (300, 150)), ("small", (40, 30))]:
        (raw / "a").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", size, (200, 30, 30)).save(raw / "a" / f"{name}.jpg", quality=90)
    out = tmp_path / "out"
    flags = ["--max-side", "64", "--quality", "80", "--source", "imagefolder"]  # one class
    assert run([str(raw), "--to", "lmdb", "--out", str(out), *flags]) == 0
    images = {s["__key__"]: Image.open(io.BytesIO(s["jpg"])) for s in read_all(out)}
    assert images["a%2Fbig"].size == (64, 32)
    assert images["a%2Fsmall"].size == (40, 30)
    stored = {s["__key__"]: s["jpg"] for s in read_all(out)}
    assert stored["a%2Fsmall"] == (raw / "a" / "small.jpg").read_bytes()  # not re-encoded


def test_a_png_in_a_jpeg_dataset_is_reencoded_and_counted(tmp_path, capsys) -> None:
    raw = make_raw(tmp_path / "raw", per_class=2, splits=False)
    Image.new("RGBA", (20, 20), (1, 2, 3, 128)).save(raw / "ring" / "odd.png")
    out = tmp_path / "out"
    assert run([str(raw), "--to", "wds", "--out", str(out)]) == 0
    assert "re-encoded 1 images" in capsys.readouterr().out
    odd = next(s for s in read_all(out) if s["__key__"] == "ring%2Fodd")
    assert Image.open(io.BytesIO(odd["jpg"])).format == "JPEG"


def _break_some_files(raw: Path) -> dict[str, Path]:
    circle = raw / "circle"
    bad = {
        "truncated": circle / "truncated.jpg",
        "empty": circle / "empty.jpg",
        "text": circle / "text.jpg",
    }
    whole = next(circle.glob("circle_*.jpg")).read_bytes()
    bad["truncated"].write_bytes(whole[: len(whole) // 2])
    bad["empty"].write_bytes(b"")
    bad["text"].write_text("this is not an image")
    return bad


def test_bad_images_are_skipped_listed_and_counted(tmp_path, capsys) -> None:
    raw = make_raw(tmp_path / "raw", per_class=3, splits=False)
    bad = _break_some_files(raw)
    (raw / "circle" / "notes.md").write_text("ignored: not an image suffix")
    out = tmp_path / "out"
    assert run([str(raw), "--to", "hdf5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "skipped 3 samples" in printed
    lines = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert sorted(x["origin"] for x in lines) == sorted(str(p) for p in bad.values())
    assert all(x["error"] for x in lines)
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.source["skipped"] == 3 and manifest.source["ignored_files"] == 1
    assert manifest.splits["train"].samples == 24
    assert manifest.splits["train"].class_counts[SHAPE_CLASSES.index("circle")] == 3


def test_on_error_fail_stops_naming_the_file_and_writes_no_manifest(tmp_path, capsys) -> None:
    raw = make_raw(tmp_path / "raw", per_class=2, splits=False)
    (raw / "star" / "empty.jpg").write_bytes(b"")
    out = tmp_path / "out"
    assert run([str(raw), "--to", "wds", "--out", str(out), "--on-error", "fail"]) == 2
    err = capsys.readouterr().err
    assert "empty.jpg" in err and "--on-error skip" in err
    assert not (out / "dlpipe.json").exists()
    with pytest.raises(dlpipe.ManifestNotFoundError, match="--resume"):
        dlpipe.open_dataset(str(out))


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: p.mkdir(), "cannot tell its layout"),
        (lambda p: (p.mkdir(), (p / "readme.txt").write_text("x")), "cannot tell its layout"),
        (lambda p: (p / "cat").mkdir(parents=True), "hold no images"),
        (lambda p: None, "does not exist"),
    ],
    ids=["empty", "unknown", "no-images", "missing"],
)
def test_unusable_sources_are_one_clear_error(tmp_path, capsys, setup, message) -> None:
    raw = tmp_path / "raw"
    setup(raw)
    out = tmp_path / "out"
    assert run([str(raw), "--to", "lmdb", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (out / "dlpipe.json").exists()


def test_duplicate_keys_are_an_error(tmp_path, capsys) -> None:
    raw = make_raw(tmp_path / "raw", per_class=1, splits=False)
    image = next((raw / "cross").glob("*.jpg"))
    Image.open(image).save(image.with_suffix(".png"))
    assert run([str(raw), "--to", "wds", "--out", str(tmp_path / "out")]) == 2
    assert "duplicate sample keys" in capsys.readouterr().err


def test_existing_output_needs_resume_or_overwrite(tmp_path, capsys) -> None:
    raw = make_raw(tmp_path / "raw", per_class=2)
    out = tmp_path / "out"
    assert run([str(raw), "--to", "wds", "--out", str(out)]) == 0
    assert run([str(raw), "--to", "wds", "--out", str(out)]) == 2
    assert "--resume" in capsys.readouterr().err
    assert run([str(raw), "--to", "wds", "--out", str(out), "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert run([str(raw), "--to", "wds", "--out", str(out), "--overwrite", "--seed", "9"]) == 0
    assert dlpipe.read_manifest(str(out)).options["seed"] == 9


def test_default_out_is_beside_the_raw_data_or_under_the_data_dir(tmp_path, monkeypatch) -> None:
    raw = make_raw(tmp_path / "shapes", per_class=1)
    monkeypatch.delenv("DLPIPE_DATA_DIR", raising=False)
    assert engine.default_out(str(raw), "lmdb") == str(tmp_path / "shapes-lmdb")
    monkeypatch.setenv("DLPIPE_DATA_DIR", str(tmp_path / "data"))
    assert run([str(raw), "--to", "hdf5"]) == 0
    assert (tmp_path / "data" / "shapes-hdf5" / "dlpipe.json").exists()


def test_refuses_when_the_disk_is_too_small(tmp_path, monkeypatch, capsys) -> None:
    raw = make_raw(tmp_path / "raw", per_class=2)
    monkeypatch.setattr(
        dlpipe.storage.shutil, "disk_usage", lambda p: SimpleNamespace(total=1, used=1, free=0)
    )
    out = tmp_path / "out"
    assert run([str(raw), "--to", "wds", "--out", str(out)]) == 2
    assert "free" in capsys.readouterr().err
    assert not (out / "dlpipe.json").exists()


def test_warns_when_the_output_is_on_the_system_disk(tmp_path, monkeypatch, capsys) -> None:
    raw = make_raw(tmp_path / "raw", per_class=1)
    monkeypatch.setattr("dlpipe.storage.on_system_disk", lambda out: True)
    assert run([str(raw), "--to", "wds", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "system disk" in out and "DLPIPE_DATA_DIR" in out


def test_files_source_groups_key_ext_files(tmp_path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    for i, sample in enumerate(dlpipe.synthetic.synthetic_samples(6)):
        (raw / f"{i:04d}.jpg").write_bytes(sample["jpg"])
        (raw / f"{i:04d}.json").write_text(json.dumps({"i": i}))
        (raw / f"{i:04d}.cls").write_text(str(i % 2))
    (raw / "classes.txt").write_text("even\nodd\n")
    out = tmp_path / "out"
    assert run([str(raw), "--to", "lmdb", "--out", str(out)]) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.source["kind"] == "files" and manifest.classes == ("even", "odd")
    assert manifest.fields == {"jpg": "image", "json": "json", "cls": "int"}
    got = {s["__key__"]: dlpipe.decode_sample(s) for s in read_all(out)}
    assert got["0003"]["json"] == {"i": 3} and got["0003"]["cls"] == 1


def _journal_entries(out: Path) -> int:
    folder = out / ".dlpipe-journal"
    return len(list(folder.glob("train-*.json"))) if folder.exists() else 0


@pytest.mark.slow
def test_kill_9_then_resume_gives_the_same_dataset(tmp_path) -> None:
    raw = make_raw(tmp_path / "raw", per_class=5)
    reference = tmp_path / "reference"
    args = ["--to", "wds", "--shard-size", "1", "--workers", "1"]  # one sample per shard
    subprocess.run(
        [DLPIPE, "convert", str(raw), *args, "--out", str(reference)],
        check=True,
        capture_output=True,
    )
    out = tmp_path / "out"
    command = [DLPIPE, "convert", str(raw), *args, "--out", str(out)]
    ConvertHold(tmp_path / "hold").kill_after_first_shard(command)
    finished = _journal_entries(out)
    assert finished == 1
    assert not (out / "dlpipe.json").exists()
    with pytest.raises(dlpipe.ManifestNotFoundError, match="--resume"):
        dlpipe.open_dataset(str(out))
    done = subprocess.run(
        [DLPIPE, "convert", str(raw), *args, "--out", str(out), "--resume"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert f"resumed {finished} finished shards" in done.stdout
    assert (out / "dlpipe.json").read_bytes() == (reference / "dlpipe.json").read_bytes()
    assert sorted(os.listdir(out)) == sorted(os.listdir(reference))


def test_resume_refuses_changed_options(tmp_path, capsys) -> None:
    raw = make_raw(tmp_path / "raw", per_class=2)
    out = tmp_path / "out"
    assert run([str(raw), "--to", "wds", "--out", str(out)]) == 0
    os.remove(out / "dlpipe.json")
    (out / ".dlpipe-journal").mkdir()
    (out / ".dlpipe-journal" / "plan.json").write_text(json.dumps({"fingerprint": "old"}))
    assert run([str(raw), "--to", "wds", "--out", str(out), "--resume"]) == 2
    assert "differ from the interrupted run" in capsys.readouterr().err


def test_convert_runs_from_a_shell(tmp_path) -> None:
    raw = make_raw(tmp_path / "raw", per_class=2)
    done = subprocess.run(
        f"{DLPIPE} convert raw/ --to lmdb", shell=True, cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and "samples/s" in done.stdout
    assert dlpipe.verify_dataset(str(tmp_path / "raw-lmdb"), decode=True).ok
    assert raw.exists()


def test_cifar_python_batches_convert_end_to_end(tmp_path) -> None:
    from test_source_cifar import make_cifar10

    folder = make_cifar10(tmp_path)
    out = tmp_path.parent / f"{tmp_path.name}-out"  # not inside the raw folder
    assert run([str(tmp_path), "--to", "hdf5", "--out", str(out)]) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.source["kind"] == "cifar" and manifest.fields == {"png": "image", "cls": "int"}
    assert set(manifest.splits) == {"train", "test"}
    assert folder.exists() and dlpipe.verify_dataset(str(out), decode=True).ok


def test_mnist_idx_files_convert_end_to_end(tmp_path) -> None:
    from test_source_mnist import make_mnist

    make_mnist(tmp_path / "mnist", gz=True)
    out = tmp_path / "out"
    assert run([str(tmp_path / "mnist"), "--to", "wds", "--out", str(out)]) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.source["kind"] == "mnist" and manifest.classes == tuple("0123456789")
    sample = dlpipe.decode_sample(read_all(out)[0])
    assert sample["png"].size == (28, 28) and sample["png"].mode == "L"


def test_csv_table_of_paths_converts_end_to_end(tmp_path) -> None:
    raw = tmp_path / "table"
    (raw / "images").mkdir(parents=True)
    rows = ["path,label,photographer"]
    for i, sample in enumerate(dlpipe.synthetic.synthetic_samples(8)):
        (raw / "images" / f"{i}.jpg").write_bytes(sample["jpg"])
        rows.append(f"images/{i}.jpg,{SHAPE_CLASSES[int(sample['cls'])]},ann{i % 2}")
    (raw / "table.csv").write_text("\n".join(rows) + "\n")  # paths relative to the table
    assert (
        run(
            [
                str(raw / "table.csv"),
                "--to",
                "lmdb",
                "--out",
                str(tmp_path / "t"),
                "--image-col",
                "path",
                "--label-col",
                "label",
                "--source",
                "table",
            ]
        )
        == 0
    )
    manifest = dlpipe.read_manifest(str(tmp_path / "t"))
    assert manifest.source["kind"] == "table" and manifest.classes == tuple(sorted(SHAPE_CLASSES))
    got = [dlpipe.decode_sample(s) for s in read_all(tmp_path / "t")]
    assert len(got) == 8 and {g["json"]["photographer"] for g in got} == {"ann0", "ann1"}


def test_missing_label_column_is_one_clear_error(tmp_path, capsys) -> None:
    raw = tmp_path / "t.csv"
    raw.write_text("path,label\nmissing.jpg,cat\n")
    assert run([str(raw), "--to", "wds", "--label-col", "kind", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "kind" in err and "label" in err and err.count("\n") == 1


def test_source_override_and_unknown_choices(tmp_path, capsys) -> None:
    raw = make_raw(tmp_path / "raw", per_class=1, splits=False)
    out = tmp_path / "out"
    assert run([str(raw), "--to", "wds", "--out", str(out), "--source", "table"]) == 2
    assert "table" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        run([str(raw), "--to", "zip"])
    assert exit_info.value.code == 2
    assert run([str(raw), "--to", "wds", "--out", str(out), "--source", "imagefolder"]) == 0
