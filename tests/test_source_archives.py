"""Archives as downloaded (.zip, .tar, .tar.gz) converted in place: each public layout packed
the way it ships gives byte for byte the dataset its unpacked folder gives; hostile members,
bombs, damaged and unreadable archives are skipped entries or one error line."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import error_records, one_error_line
from splitlist_fixtures import (
    jpeg,
    make_cars,
    make_cub,
    make_flowers,
    make_food101,
    make_pets,
    write,
)
from test_source_coco import make_coco
from test_source_voc import make_voc

from dlpipe.cli import main
from dlpipe.converters.archive_view import unpacked_view
from dlpipe.converters.source import SampleError
from dlpipe.converters.view_targets import target_of
from dlpipe.manifest import MANIFEST_NAME
from dlpipe.sample import unescape_key


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Views and listings go to a cache of the test's own."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache


def _add(archive: zipfile.ZipFile | tarfile.TarFile, path: Path, name: str) -> None:
    if isinstance(archive, zipfile.ZipFile):
        archive.write(path, name)
    else:
        archive.add(path, name, recursive=False)


def pack(folder: Path, names: list[str], archive: Path) -> Path:
    """`folder`'s entries `names` (recursively, folders included, sorted) into `archive`, as
    `zip -r` or `tar czf` run in `folder` make it; the packed entries are removed."""
    entries = []
    for name in names:
        top = folder / name
        entries.append(top)
        if top.is_dir():
            entries += sorted(top.rglob("*"))
    made: zipfile.ZipFile | tarfile.TarFile
    if archive.name.endswith(".zip"):
        made = zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED)
    else:
        mode = "w:gz" if archive.name.endswith("gz") else "w"
        made = tarfile.open(archive, mode)  # noqa: SIM115 (closed by the with below)
    with made:
        for path in entries:
            _add(made, path, path.relative_to(folder).as_posix())
    for name in names:
        shutil.rmtree(folder / name) if (folder / name).is_dir() else (folder / name).unlink()
    return archive


def convert(raw: Path, out: Path, *extra: str) -> int:
    return main(["convert", str(raw), "--to", "wds", "--out", str(out), "--workers", "1", *extra])


def dataset_of(out: Path) -> dict:
    """What the output holds: every shard file's sha256, the classes, the task and the
    fields (not the raw paths the manifest's description names)."""
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    shards = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.iterdir())
        if p.suffix == ".tar"
    }
    kept = {k: manifest.get(k) for k in ("classes", "task", "fields", "class_ids", "splits")}
    return {"shards": shards, **kept}


def _packed_whole(make, top: str, archive: str, *, plain_top: bool, in_folder: bool = False):
    """A dataset whose download is one archive of its top folder `top`: the unpacked copy
    (`top` itself when `plain_top`, else the folder holding it), and the archive as RAW (or,
    `in_folder`, the folder holding it)."""

    def build(tmp: Path) -> tuple[Path, Path]:
        make(tmp / "plain")
        make(tmp / "packed")
        plain = tmp / "plain" / top if plain_top else tmp / "plain"
        if in_folder:
            pack(tmp / "packed", [top], tmp / "packed" / archive)
            return plain, tmp / "packed"
        return plain, pack(tmp / "packed", [top], tmp / archive)

    return build


_food = _packed_whole(make_food101, "food-101", "food-101.tar.gz", plain_top=True)
_food_in_folder = _packed_whole(
    make_food101, "food-101", "food-101.tar.gz", plain_top=False, in_folder=True
)
_food_zip = _packed_whole(make_food101, "food-101", "food-101.zip", plain_top=True)
_cub = _packed_whole(make_cub, "CUB_200_2011", "CUB_200_2011.tgz", plain_top=False)


def _pets(tmp: Path) -> tuple[Path, Path]:
    make_pets(tmp / "plain")
    make_pets(tmp / "packed")
    pack(tmp / "packed", ["images"], tmp / "packed" / "images.tar.gz")
    pack(tmp / "packed", ["annotations"], tmp / "packed" / "annotations.tar.gz")
    return tmp / "plain", tmp / "packed"


def _flowers(tmp: Path) -> tuple[Path, Path]:
    """torchvision's download: 102flowers.tgz beside the two .mat files, read together."""
    make_flowers(tmp / "plain")
    root = make_flowers(tmp / "packed")
    pack(root, ["jpg"], root / "102flowers.tgz")
    return tmp / "plain" / "flowers-102", root


def _cars(tmp: Path) -> tuple[Path, Path]:
    make_cars(tmp / "plain")
    root = make_cars(tmp / "packed")
    pack(root, ["devkit"], root / "car_devkit.tgz")
    pack(root, ["cars_train"], root / "cars_train.tgz")
    pack(root, ["cars_test"], root / "cars_test.tgz")
    return tmp / "plain" / "stanford_cars", root


def _coco(tmp: Path) -> tuple[Path, Path]:
    make_coco(tmp / "plain")
    root = make_coco(tmp / "packed")
    for name in ("train2017", "val2017", "test2017"):
        pack(root, [name], root / f"{name}.zip")
    pack(root, ["annotations"], root / "annotations_trainval2017.zip")
    return tmp / "plain", root


_voc = _packed_whole(make_voc, "VOCdevkit", "VOCtrainval_11-May-2012.tar", plain_top=False)


def _classes_zip(tmp: Path) -> tuple[Path, Path]:
    for base in ("plain", "packed"):
        for i in range(6):
            write(tmp / base / ("cat" if i % 2 else "dog") / f"{i}.jpg", jpeg(i))
    return tmp / "plain", pack(tmp / "packed", ["cat", "dog"], tmp / "pets.zip")


LAYOUTS: dict[str, Callable[[Path], tuple[Path, Path]]] = {
    "food101-tar.gz-as-raw": _food,
    "food101-tar.gz-in-folder": _food_in_folder,
    "food101-zip": _food_zip,
    "cub-tgz": _cub,
    "pets-two-archives": _pets,
    "flowers-tgz-beside-mat-files": _flowers,
    "cars-three-archives": _cars,
    "coco-zips": _coco,
    "voc-plain-tar": _voc,
    "class-folders-zip": _classes_zip,
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_archive_as_downloaded_converts_as_its_unpacked_folder(
    tmp_path: Path, layout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    plain, packed = LAYOUTS[layout](tmp_path)
    assert convert(plain, tmp_path / "out-plain") == 0
    capsys.readouterr()
    assert convert(packed, tmp_path / "out-packed") == 0
    printed = capsys.readouterr().out
    assert "archives: read in place:" in printed
    expected = dataset_of(tmp_path / "out-plain")
    assert expected["shards"]
    assert dataset_of(tmp_path / "out-packed") == expected
    manifest = json.loads((tmp_path / "out-packed" / MANIFEST_NAME).read_text())
    assert manifest["source"]["archives"]["read"]
    assert manifest["source"]["archives"]["skipped_members"] == 0


def test_spawned_workers_read_the_members_alike(tmp_path: Path) -> None:
    plain, packed = _pets(tmp_path)
    assert convert(plain, tmp_path / "one") == 0
    args = ["convert", str(packed), "--to", "lmdb", "--workers", "2", "--shard-size", "1MiB"]
    assert main([*args, "--out", str(tmp_path / "two")]) == 0
    assert main([*args[:-4], "--workers", "1", "--out", str(tmp_path / "ref")]) == 0
    import dlpipe

    def keys(out: Path) -> list[tuple[str, bytes]]:
        data = dlpipe.open_dataset(out, "trainval", rank=0, world_size=1)
        return sorted((s["__key__"], s.get("jpg", b"")) for s in data)

    assert keys(tmp_path / "two") == keys(tmp_path / "ref")


def test_a_folder_inside_an_archive_is_a_raw_folder(tmp_path: Path) -> None:
    for i in range(4):
        write(tmp_path / "d" / "data" / ("cat" if i % 2 else "dog") / f"{i}.jpg", jpeg(i))
    archive = pack(tmp_path / "d", ["data"], tmp_path / "download.zip")
    assert main(["convert", str(archive / "data"), "--to", "wds", "--workers", "1"]) == 0
    out = tmp_path / "data-wds"  # beside the archive, named after the folder
    assert json.loads((out / MANIFEST_NAME).read_text())["classes"] == ["cat", "dog"]


def test_an_archive_with_its_folder_unpacked_beside_it_is_not_read_twice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_food101(tmp_path / "raw")
    shutil.make_archive(str(tmp_path / "raw" / "food-101"), "gztar", tmp_path / "raw", "food-101")
    assert convert(tmp_path / "raw", tmp_path / "out") == 0
    assert "archives:" not in capsys.readouterr().out
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert "archives" not in manifest["source"]
    assert sum(s["samples"] for s in manifest["splits"]["train"]["shards"]) == 9


def _hostile_tar(path: Path) -> None:
    with tarfile.open(path, "w") as tar:

        def add(name: str, data: bytes = b"", **fields: object) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            for key, value in fields.items():
                setattr(info, key, value)
            tar.addfile(info, io.BytesIO(data) if data else None)

        add("data/", type=tarfile.DIRTYPE)
        for i in range(4):
            add(f"data/{'cat' if i % 2 else 'dog'}/{i}.jpg", jpeg(i))
        add("data/cat/../../evil.jpg", jpeg(10))
        add("/etc/evil.jpg", jpeg(11))
        add("data/cat/link.jpg", type=tarfile.SYMTYPE, linkname="/etc/passwd")
        add("data/cat/hard.jpg", type=tarfile.LNKTYPE, linkname="data/cat/1.jpg")
        add("data/dog/fifo.jpg", type=tarfile.FIFOTYPE)
        add("data/dog/dev.jpg", type=tarfile.CHRTYPE, devmajor=1, devminor=5)
        add("data/dog/0.jpg", jpeg(20))  # the same name again: the later one is read
        add("data/__MACOSX/._0.jpg", b"\0\5\26\7")


def test_hostile_members_are_skipped_entries_and_nothing_lands_outside(tmp_path: Path) -> None:
    _hostile_tar(tmp_path / "hostile.tar")
    assert convert(tmp_path / "hostile.tar" / "data", tmp_path / "out") == 0
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    archives = manifest["source"]["archives"]
    reasons = {
        e["path"].rsplit("hostile.tar/", 1)[1]: e["reason"] for e in archives["skipped_examples"]
    }
    assert "outside its folder" in reasons["data/cat/../../evil.jpg"]
    assert "absolute" in reasons["/etc/evil.jpg"]
    assert "symbolic link" in reasons["data/cat/link.jpg"]
    assert "hard link" in reasons["data/cat/hard.jpg"]
    assert "FIFO" in reasons["data/dog/fifo.jpg"]
    assert "device" in reasons["data/dog/dev.jpg"]
    assert "replaced by a later member" in reasons["data/dog/0.jpg"]
    assert archives["skipped_members"] == 7
    assert manifest["classes"] == ["cat", "dog"]
    assert not (tmp_path / "evil.jpg").exists() and not (tmp_path.parent / "evil.jpg").exists()
    import dlpipe

    samples = {
        unescape_key(s["__key__"]): s["jpg"] for s in dlpipe.open_dataset(tmp_path / "out", "train")
    }
    assert sorted(samples) == ["cat/1", "cat/3", "dog/0", "dog/2"]
    assert samples["dog/0"] == jpeg(20)  # the later member of the name


def test_windows_zip_names_with_backslashes_are_folders(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "win.zip", "w") as zf:
        for i in range(4):
            zf.writestr(f"{'cat' if i % 2 else 'dog'}\\{i}.jpg", jpeg(i))
    assert convert(tmp_path / "win.zip", tmp_path / "out") == 0
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert manifest["classes"] == ["cat", "dog"]


def _patch(path: Path, signature: bytes, offset: int, value: bytes, which: int = 0) -> None:
    data = bytearray(path.read_bytes())
    at = -1
    for _ in range(which + 1):
        at = data.index(signature, at + 1)
    data[at + offset : at + offset + len(value)] = value
    path.write_bytes(bytes(data))


def _two_member_zip(path: Path) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("cat/0.jpg", jpeg(0))
        zf.writestr("dog/1.jpg", jpeg(1))
    return path


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("declared-size", "zip bomb"),
        ("overlapping", "overlap"),
        ("truncated", "not a readable zip archive"),
        ("not-a-zip", "not a readable zip archive"),
    ],
)
def test_a_zip_bomb_or_damaged_zip_is_one_error_line(
    tmp_path: Path, case: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    archive = _two_member_zip(tmp_path / "x.zip")
    if case == "declared-size":  # the central directory claims 4 GB for a 1 kB member
        _patch(archive, b"PK\x01\x02", 24, (0xFFFFFFF0).to_bytes(4, "little"))
    elif case == "overlapping":  # the second entry points at the first one's data
        _patch(archive, b"PK\x01\x02", 42, (0).to_bytes(4, "little"), which=1)
    elif case == "truncated":
        archive.write_bytes(archive.read_bytes()[:-60])
    else:
        archive.write_bytes(b"this is no zip file\n" * 10)
    before = sorted(os.listdir(tmp_path))
    assert convert(archive, tmp_path / "out") == 2
    line = one_error_line(capsys.readouterr().err)
    assert message in line and "x.zip" in line
    assert sorted(set(os.listdir(tmp_path)) - {"cache"}) == before  # no output folder made


def test_a_damaged_gzip_tar_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for i in range(20):
        write(tmp_path / "d" / "data" / ("cat" if i % 2 else "dog") / f"{i}.jpg", jpeg(i, (64, 64)))
    archive = pack(tmp_path / "d", ["data"], tmp_path / "x.tar.gz")
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    assert convert(archive, tmp_path / "out") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "x.tar.gz" in line and "download it again" in line


def test_a_tar_header_claiming_more_than_gzip_can_hold_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("data/cat/0.jpg")
        info.size = 1 << 40  # a terabyte, then nothing
        tar.addfile(info)
    import gzip

    (tmp_path / "bomb.tar.gz").write_bytes(gzip.compress(buffer.getvalue()))
    assert convert(tmp_path / "bomb.tar.gz", tmp_path / "out") == 2
    assert "gzip bomb" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("name", "command"),
    [("x.tar.xz", "unxz"), ("x.tar.bz2", "bunzip2"), ("x.tar.zst", "zstd -d"), ("x.7z", "7z x")],
)
def test_an_archive_without_random_access_names_the_command_that_makes_it_readable(
    tmp_path: Path, name: str, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / name).write_bytes(b"\xfd7zXZ\x00" + bytes(100))
    assert convert(tmp_path / name, tmp_path / "out") == 2
    line = one_error_line(capsys.readouterr().err)
    assert command in line and name in line


def test_a_damaged_image_in_an_archive_is_named_by_its_member(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "x.zip", "w") as zf:
        for i in range(4):
            zf.writestr(f"{'cat' if i % 2 else 'dog'}/{i}.jpg", jpeg(i))
        zf.writestr("cat/broken.jpg", jpeg(9)[:100])
    assert convert(tmp_path / "x.zip", tmp_path / "out") == 0
    (record,) = error_records(tmp_path / "out")
    assert record["origin"].endswith("x.zip/cat/broken.jpg")


def test_a_member_changed_after_the_scan_is_refused_not_misread(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "x.zip", "w") as zf:
        zf.writestr("cat/0.jpg", jpeg(0))
        zf.writestr("dog/1.jpg", jpeg(1))
    view = unpacked_view(str(tmp_path / "x.zip"))
    assert view is not None
    placeholder = os.path.join(view.root, "cat", "0.jpg")
    target = target_of(placeholder)
    assert target is not None and target.read() == jpeg(0)
    assert os.stat(placeholder).st_size == len(jpeg(0))
    assert stat.S_ISREG(os.stat(placeholder).st_mode)
    with zipfile.ZipFile(tmp_path / "x.zip", "a") as zf:
        zf.writestr("cat/2.jpg", jpeg(2))
    from dlpipe.converters import archive_reads

    archive_reads._OPEN.close()
    with pytest.raises(SampleError, match="changed since the scan"):
        target.read()


def test_ray_refuses_archives_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, packed = _classes_zip(tmp_path)
    command = ["convert", str(packed), "--to", "wds", "--out", str(tmp_path / "out")]
    assert main([*command, "--engine", "ray"]) == 2
    assert "unpack them on the cluster's shared disk" in one_error_line(capsys.readouterr().err)


def test_a_folder_the_archive_lacks_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, packed = _classes_zip(tmp_path)
    assert convert(packed / "nothing", tmp_path / "out") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "holds no nothing" in line


def test_kaggle_zip_of_zips_names_the_unzip_that_makes_it_readable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """dogs-vs-cats.zip holds train.zip, test1.zip and sampleSubmission.csv; once unpacked,
    that folder's zips are read in place (the labels in the file names)."""
    inner = tmp_path / "inner"
    for i in range(6):
        write(inner / "train" / f"{'cat' if i % 2 else 'dog'}.{i}.jpg", jpeg(i))
        write(inner / "test1" / f"{i + 1}.jpg", jpeg(10 + i))
    write(inner / "sampleSubmission.csv", "id,label\n1,0\n")
    pack(inner, ["train"], inner / "train.zip")
    pack(inner, ["test1"], inner / "test1.zip")
    outer = pack(
        inner, ["train.zip", "test1.zip", "sampleSubmission.csv"], tmp_path / "dogs-vs-cats.zip"
    )
    assert convert(outer, tmp_path / "out") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "holds archives (test1.zip, train.zip)" in line and "unzip -d" in line
    folder = tmp_path / "dogs-vs-cats"
    with zipfile.ZipFile(outer) as zf:
        zf.extractall(folder)
    assert convert(folder, tmp_path / "out") == 0
    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert manifest["classes"] == ["cat", "dog"]
    assert manifest["source"]["kind"] == "filenames"
